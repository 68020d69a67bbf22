"""paho-mqtt clients that record into a `History` (tests/support/history.py): a
publisher streaming numbered QoS 1 / QoS 2 messages and a subscriber, both keeping
their MQTT session across reconnects (paho reconnects by itself and resends what was
in flight). Callbacks run on paho's network thread; the History is thread-safe."""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from harness.waiting import wait_until

# paho 2.2 turns a released QoS 2 message into a new PUBLISH after a failed reconnect
# attempt; this subclass keeps it at "resend PUBREL" (see its docstring).
from tests.integration.crash_clients import PahoClient
from tests.support.history import History, Message
from tests.support.shards import client_id_on_shard

SESSION_EXPIRY = 3600  # seconds: longer than any test, so sessions outlive every restart
WINDOW = 20  # messages a publisher leaves unacknowledged at most
MAX_PER_PUBLISHER = 60_000  # below 65535: paho's message ids must not wrap
PACKET_ID_NOT_FOUND = 0x92


def _client(name: str) -> PahoClient:
    client = PahoClient(CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv5)
    client.reconnect_delay_set(1, 2)
    return client


def _connect(client: mqtt.Client, host: str, port: int, durable: bool) -> None:
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.SessionExpiryInterval = SESSION_EXPIRY if durable else 0
    # connect_async: the first attempt may fail too (a site still starting); the
    # network thread keeps trying
    client.connect_async(host, port, keepalive=10, clean_start=not durable,
                         properties=properties)
    client.loop_start()


class RecordingPublisher:
    """MQTT 5, clean start false. Publishes to its topics in turn, each at every QoS of
    `qos_levels` in turn, never more than WINDOW unacknowledged. `prefill` messages
    are handed to paho before it connects (it sends them once connected); every later
    one only while connected (see `_may_publish`). `pace`: seconds at least between two
    publishes (a long test would otherwise reach MAX_PER_PUBLISHER before its end)."""

    def __init__(self, history: History, name: str, host: str, port: int,
                 topics: list[str], qos_levels: tuple[int, ...] = (1, 2), *,
                 prefill: int = 0, pace: float = 0.0) -> None:
        assert prefill <= WINDOW
        self.pace = pace
        self.history = history
        self.name = name
        self.topics = topics
        self.qos_levels = qos_levels
        self.prefill = prefill
        self.client = _client(name)
        self.client.on_publish = self._on_publish
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.connects = 0
        # When (time.monotonic) each acknowledgement came and each connection ended:
        # the pauses between acknowledgements on one connection (`longest_pause`).
        self.acknowledged_at: list[float] = []
        self.disconnected_at: list[float] = []
        self.sent = 0
        self._numbers: collections.Counter[tuple[str, int]] = collections.Counter()
        self._by_mid: dict[int, Message] = {}
        self._early: dict[int, int] = {}  # mid -> reason code that came before publish() returned
        self._done = 0  # acknowledged or refused
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"publisher-{name}",
                                        daemon=True)
        self._address = (host, port)

    def _on_connect(self, _c: mqtt.Client, _u: Any, _f: mqtt.ConnectFlags,
                    reason_code: ReasonCode, _p: Properties | None) -> None:
        if not reason_code.is_failure:
            with self._lock:
                self.connects += 1

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _f: mqtt.DisconnectFlags,
                       _r: ReasonCode, _p: Properties | None) -> None:
        with self._lock:
            self.disconnected_at.append(time.monotonic())

    def longest_pause(self, since: float, until: float) -> float:
        """The longest time between two acknowledgements in [since, until] with no
        disconnection between them (a reconnect to a restarted site is not a pause
        of the storage)."""
        with self._lock:
            times = [at for at in self.acknowledged_at if since <= at <= until]
            ends = list(self.disconnected_at)
        return max((later - earlier for earlier, later in itertools.pairwise(times)
                    if not any(earlier <= end <= later for end in ends)), default=0.0)

    def _on_publish(self, _c: mqtt.Client, _u: Any, mid: int, reason_code: ReasonCode,
                    _p: Properties) -> None:
        # paho holds its own lock here: only touch ours and the History's
        with self._lock:
            message = self._by_mid.pop(mid, None)
            if message is None:
                self._early[mid] = reason_code.value
                return
            self._settle(message, reason_code.value)

    def _settle(self, message: Message, code: int) -> None:
        self._done += 1
        # PUBCOMP "packet identifier not found" answers a PUBREL resent after the
        # broker had completed the exchange (its PUBCOMP was lost): done, not refused
        if code < 0x80 or code == PACKET_ID_NOT_FOUND:
            self.acknowledged_at.append(time.monotonic())
            self.history.acknowledged(message)
        else:
            self.history.refused(message, code)

    def unacked(self) -> int:
        with self._lock:
            return self.sent - self._done

    def start(self) -> None:
        for index in range(self.prefill):
            self._publish(index)
        _connect(self.client, *self._address, durable=True)
        self._thread.start()

    def _may_publish(self) -> bool:
        """Connected, and paho has sent what it kept to send after a (re)connect.
        paho marks the connection up before it sends those (under its message lock,
        after on_connect): a message handed over in between would overtake them (the
        recorder's own test saw QoS 2 message 4 arrive before 0..3)."""
        client = self.client
        with client._out_message_mutex:
            return client.is_connected() and all(
                m.state != mqtt.mqtt_ms_publish for m in client._out_messages.values())

    def _run(self) -> None:
        for index in range(self.prefill, MAX_PER_PUBLISHER):
            while (self.unacked() >= WINDOW or not self._may_publish()) \
                    and not self._stop.is_set():
                time.sleep(0.002)
            if self._stop.is_set():
                return
            self._publish(index)
            if self.pace and self._stop.wait(self.pace):
                return

    def _publish(self, index: int) -> None:
        topic = self.topics[index % len(self.topics)]
        qos = self.qos_levels[(index // len(self.topics)) % len(self.qos_levels)]
        message = Message(self.name, topic, qos, self._numbers[topic, qos])
        self._numbers[topic, qos] += 1
        self.history.published(message)
        with self._lock:
            self.sent += 1
        # if the connection drops now, paho keeps the message and sends it on reconnect
        info = self.client.publish(topic, message.encode(), qos)
        with self._lock:
            code = self._early.pop(info.mid, None)
            if code is None:
                self._by_mid[info.mid] = message
            else:
                self._settle(message, code)

    def stop_publishing(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), f"{self.name} did not stop"

    def close(self) -> None:
        self._stop.set()
        self.client.disconnect()
        self.client.loop_stop()


class RecordingSubscriber:
    """MQTT 5; durable: clean start false with a session expiry longer than the test,
    subscribing once (the session keeps the subscription); else clean start,
    subscribing at every connect. paho acknowledges each message after the callback
    has recorded it (QoS 2 is handed over on PUBREL)."""

    def __init__(self, history: History, name: str, host: str, port: int,
                 topic_filter: str, qos: int = 2, *, durable: bool = True) -> None:
        self.history = history
        self.name = name
        self.topic_filter = topic_filter
        self.qos = qos
        self.durable = durable
        self.client = _client(name)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.subscribed = threading.Event()
        self.connects = 0
        self._address = (host, port)
        self._lock = threading.Lock()

    def start(self) -> None:
        _connect(self.client, *self._address, durable=self.durable)

    def _on_connect(self, client: mqtt.Client, _u: Any, flags: mqtt.ConnectFlags,
                    reason_code: ReasonCode, _p: Properties | None) -> None:
        if reason_code.is_failure:
            return
        self.history.connected(self.name, clean_start=not self.durable, durable=self.durable,
                               session_present=flags.session_present)
        with self._lock:
            self.connects += 1
            first = self.connects == 1
        if first or not flags.session_present:
            client.subscribe(self.topic_filter, qos=self.qos)

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _f: mqtt.DisconnectFlags,
                       _r: ReasonCode, _p: Properties | None) -> None:
        self.history.disconnected(self.name)

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, _mid: int, codes: list[ReasonCode],
                      _p: Properties | None) -> None:
        assert len(codes) == 1
        if not codes[0].is_failure:
            self.history.subscribed(self.name, self.topic_filter, codes[0].value)
            self.subscribed.set()

    def _on_message(self, _c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        self.history.received(self.name, message.topic, bytes(message.payload), message.qos,
                              bool(message.dup))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


RecordingClient = RecordingPublisher | RecordingSubscriber


def wait_delivered(history: History, stall: float = 30.0, every: float = 1.0) -> bool:
    """Wait until every acknowledged message reached every session that should have
    it, as long as deliveries go on: False once `stall` seconds pass with nothing more
    delivered. A backlog (a site that was cut off, a subscriber behind) drains at its
    own pace; only a delivery that stopped is a failure. Counted once every `every`
    seconds, never more often: the count holds the history's lock, which the clients'
    callbacks need to record what they receive, and this process's GIL, which the
    partition proxies' threads need to carry the sites' replication traffic."""
    def missing() -> int:
        return sum(len(lost) for lost in history.missing().values())

    left = missing()
    progress_at = time.monotonic()
    while left:
        if time.monotonic() - progress_at > stall:
            return False
        time.sleep(every)
        now_left = missing()
        if now_left < left:
            progress_at = time.monotonic()
        left = now_left
    return True


def all_connected(clients: Sequence[RecordingClient], timeout: float,
                  reconnected: Sequence[RecordingClient] = (),
                  connects_before: dict[str, int] | None = None) -> bool:
    """Within `timeout` seconds every client is connected, and each of `reconnected`
    has connected again since `connects_before` (name -> its `connects` then)."""
    before = connects_before or {}
    return wait_until(lambda: all(c.client.is_connected() for c in clients) and all(
        c.connects > before.get(c.name, 0) for c in reconnected), timeout)


def connect_counts(clients: Sequence[RecordingClient]) -> dict[str, int]:
    return {c.name: c.connects for c in clients}


def describe_clients(clients: Sequence[RecordingClient]) -> str:
    return ", ".join(f"{c.name}: {c.connects} connects"
                     f"{'' if c.client.is_connected() else ' (not connected)'}"
                     for c in clients)


def stop_and_drain(publishers: Sequence[RecordingPublisher], timeout: float) -> bool:
    """Stop every publisher handing over new messages, then wait until each has its
    acknowledgements for everything it handed over; False when some still wait."""
    for publisher in publishers:
        publisher.stop_publishing()
    return wait_until(lambda: all(p.unacked() == 0 for p in publishers), timeout)


def more_acknowledged(history: History, count: int, timeout: float) -> bool:
    """`count` more messages than now are acknowledged within `timeout` seconds."""
    target = len(history.acknowledged_messages()) + count
    # each look lists every publication under the history's lock: not too often
    return wait_until(lambda: len(history.acknowledged_messages()) >= target, timeout,
                      every=0.25)


class ShardLoad:
    """The load the operator tests keep running through plans, rolls and kills: a
    publisher per shard of the `messages` database (a client id that lands on that
    shard, topic `load/<shard>`, QoS levels `publish_qos` in turn) and one subscriber to
    `load/#` at `subscribe_qos`, all on `host`, all recording into one History."""

    def __init__(self, name: str, host: str, n_shards: int, publish_qos: tuple[int, ...],
                 subscribe_qos: int, pace: float, port: int = 1883) -> None:
        self.history = History()
        self.subscriber = RecordingSubscriber(self.history, f"{name}-sub", host, port,
                                              "load/#", qos=subscribe_qos)
        self.publishers = [
            RecordingPublisher(self.history, client_id_on_shard(f"{name}-pub{shard}", shard,
                                                                n_shards),
                               host, port, [f"load/{shard}"], publish_qos, pace=pace)
            for shard in range(n_shards)]
        self.started = False

    def start(self) -> None:
        self.subscriber.start()
        assert self.subscriber.subscribed.wait(30), "the subscriber did not subscribe"
        for publisher in self.publishers:
            publisher.start()
        assert all_connected([*self.publishers, self.subscriber], 30)
        self.started = True

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()
        self.subscriber.close()
