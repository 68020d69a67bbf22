"""Clients for the broker crash tests: publishers that stream numbered QoS 1/2 messages
and a durable subscriber that acknowledges late (paho; both keep their MQTT session
across reconnects, and paho resends what was in flight when a connection drops), and a
raw client that sends exactly the packets a test gives it."""

from __future__ import annotations

import collections
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from stratamq.broker import mqtt as wire

P = TypeVar("P", bound=wire.Packet)

HOST = "127.0.0.1"
SESSION_EXPIRY = 600  # seconds: longer than the test, so sessions outlive every restart
WINDOW = 20  # messages a publisher leaves unacknowledged at most (paho's max in flight)
MAX_PER_PUBLISHER = 60_000  # below 65535: paho's message ids must not wrap
PACKET_ID_NOT_FOUND = 0x92


@dataclass(frozen=True, slots=True, order=True)
class Numbered:
    """What a payload says: who sent it, on which topic, at which QoS, its number."""

    publisher: str
    topic: str
    qos: int
    seq: int

    def encode(self) -> bytes:
        return f"{self.publisher}|{self.topic}|{self.qos}|{self.seq}".encode()

    @classmethod
    def decode(cls, payload: bytes) -> Numbered:
        publisher, topic, qos, seq = payload.decode().split("|")
        return cls(publisher, topic, int(qos), int(seq))

    @property
    def key(self) -> tuple[str, str, int]:
        return self.publisher, self.topic, self.qos


class PahoClient(mqtt.Client):
    """paho's Client, with one bug of paho 2.2 worked around. Before every reconnect
    attempt paho resets what is in flight: a QoS 2 message waiting for PUBCOMP becomes
    "resend PUBREL". When that attempt fails (the broker is still restarting) the
    next attempt resets again and turns "resend PUBREL" into a new PUBLISH with DUP 0,
    though the broker has released that packet id: a broker must then store it as a
    new message (MQTT-4.3.3-10), and the test saw it delivered twice. Here "resend
    PUBREL" survives a failed attempt."""

    def _messages_reconnect_reset_out(self) -> None:
        with self._out_message_mutex:
            resending = [message for message in self._out_messages.values()
                         if message.qos == 2 and message.state == mqtt.mqtt_ms_resend_pubrel]
        super()._messages_reconnect_reset_out()
        with self._out_message_mutex:
            for message in resending:
                message.state = mqtt.mqtt_ms_resend_pubrel


def _session_properties() -> Properties:
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.SessionExpiryInterval = SESSION_EXPIRY
    return properties


def _connect(client: mqtt.Client, port: int, v5: bool) -> None:
    client.reconnect_delay_set(1, 2)
    if v5:
        client.connect(HOST, port, keepalive=10, clean_start=False,
                       properties=_session_properties())
    else:
        client.connect(HOST, port, keepalive=10)


class Publisher:
    """Publishes to its topics in turn, alternating QoS 1 and 2, each (topic, QoS) with
    its own sequence numbers, never more than WINDOW unacknowledged."""

    def __init__(self, name: str, port: int, topics: list[str], v5: bool) -> None:
        self.name = name
        self.topics = topics
        self.client = PahoClient(CallbackAPIVersion.VERSION2, client_id=name,
                                  protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
                                  clean_session=None if v5 else False)
        self.client.on_publish = self._on_publish
        self.sent: dict[int, Numbered] = {}  # message id -> message
        self.acked: set[int] = set()  # message ids with PUBACK / PUBCOMP (success)
        self.refused: list[tuple[int, int]] = []  # (message id, reason code)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"publisher-{name}",
                                        daemon=True)
        self._port = port
        self._v5 = v5

    def _on_publish(self, _client: mqtt.Client, _userdata: Any, mid: int,
                    reason_code: ReasonCode, _properties: Properties) -> None:
        # paho holds its own lock here: only touch ours, never call into paho
        with self._lock:
            # PUBCOMP "Packet Identifier not found" answers a PUBREL resent after the
            # broker had completed the exchange (its PUBCOMP was lost): done, not refused
            if reason_code.is_failure and reason_code.value != PACKET_ID_NOT_FOUND:
                self.refused.append((mid, reason_code.value))
            else:
                self.acked.add(mid)

    def unacked(self) -> int:
        with self._lock:
            return len(self.sent) - len(self.acked) - len(self.refused)

    def start(self) -> None:
        _connect(self.client, self._port, self._v5)
        self.client.loop_start()
        self._thread.start()

    def _run(self) -> None:
        numbers: collections.Counter[tuple[str, int]] = collections.Counter()
        for index in range(MAX_PER_PUBLISHER):
            while self.unacked() >= WINDOW and not self._stop.is_set():
                time.sleep(0.001)
            if self._stop.is_set():
                return
            topic = self.topics[index % len(self.topics)]
            qos = 1 + (index // len(self.topics)) % 2
            message = Numbered(self.name, topic, qos, numbers[topic, qos])
            numbers[topic, qos] += 1
            # while disconnected paho keeps the message and sends it on reconnect
            info = self.client.publish(topic, message.encode(), qos)
            with self._lock:
                self.sent[info.mid] = message

    def stop_publishing(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()

    def acknowledged(self) -> list[Numbered]:
        with self._lock:
            return [self.sent[mid] for mid in self.acked]

    def close(self) -> None:
        self._stop.set()
        self.client.disconnect()
        self.client.loop_stop()


@dataclass(slots=True)
class _PendingAck:
    due: float
    connection: int
    mid: int
    qos: int


# paho with manual_ack answers no PUBREL by itself, not even one for a message id it
# has forgotten (MQTT 5 4.3.3 wants a PUBCOMP then too); its debug log is the one place
# that shows every PUBREL, so the subscriber answers those from there.
_PUBREL = re.compile(r"Received PUBREL \(Mid: (\d+)\)")


class DurableSubscriber:
    """MQTT 5, clean start false, session expiry > 0, manual acknowledgements sent
    `ack_delay` seconds late, on the connection the message came on and never on a
    later one (a stale PUBACK there could acknowledge a different message that now has
    the same packet id)."""

    def __init__(self, client_id: str, port: int, topic_filter: str,
                 ack_delay: float) -> None:
        self.client = PahoClient(CallbackAPIVersion.VERSION2, client_id=client_id,
                                  protocol=mqtt.MQTTv5, manual_ack=True)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.client.on_log = self._on_log
        self.topic_filter = topic_filter
        self.ack_delay = ack_delay
        self.received: list[Numbered] = []  # in on_message order
        self.connects = 0
        self.sessions_lost = 0  # reconnects answered with session present = 0
        self.subscribed = threading.Event()
        self._port = port
        self._lock = threading.Lock()
        self._connected = False
        self._connection = 0  # changes at every connect and disconnect
        self._acks: collections.deque[_PendingAck] = collections.deque()
        self._stop = threading.Event()
        self._acker = threading.Thread(target=self._ack_loop, name="subscriber-acks",
                                       daemon=True)

    def start(self) -> None:
        _connect(self.client, self._port, v5=True)
        self.client.loop_start()
        self._acker.start()

    def _on_connect(self, client: mqtt.Client, _userdata: Any, flags: mqtt.ConnectFlags,
                    reason_code: ReasonCode, _properties: Properties | None) -> None:
        if reason_code.is_failure:
            return
        with self._lock:
            self._connected = True
            self._connection += 1
            self.connects += 1
            first = self.connects == 1
            if not first and not flags.session_present:
                self.sessions_lost += 1
        if first:
            client.subscribe(self.topic_filter, qos=2)

    def _on_disconnect(self, _client: mqtt.Client, _userdata: Any,
                       _flags: mqtt.DisconnectFlags, _reason_code: ReasonCode,
                       _properties: Properties | None) -> None:
        with self._lock:
            self._connected = False
            self._connection += 1

    def _on_subscribe(self, _client: mqtt.Client, _userdata: Any, _mid: int,
                      reason_codes: list[ReasonCode], _properties: Properties | None) -> None:
        assert [code.value for code in reason_codes] == [2]
        self.subscribed.set()

    def _later(self, mid: int, qos: int) -> None:
        with self._lock:
            self._acks.append(_PendingAck(time.monotonic() + self.ack_delay,
                                          self._connection, mid, qos))

    def _on_message(self, _client: mqtt.Client, _userdata: Any,
                    message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.received.append(Numbered.decode(bytes(message.payload)))
        if message.qos == 1:
            self._later(message.mid, 1)
        # QoS 2 is delivered here on PUBREL; its PUBCOMP goes out from _on_log

    def _on_log(self, _client: mqtt.Client, _userdata: Any, _level: int, text: str) -> None:
        match = _PUBREL.fullmatch(text)
        if match is not None:
            self._later(int(match.group(1)), 2)

    def _ack_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending = self._acks[0] if self._acks else None
                if pending is None or pending.due > time.monotonic():
                    pending = None
                else:
                    self._acks.popleft()
                    if pending.connection != self._connection or not self._connected:
                        continue  # that connection is gone: the broker sends it again
            if pending is None:
                time.sleep(0.002)
                continue
            # Outside our lock (paho calls back into _on_log from here). A disconnect
            # in between is harmless: paho drops queued packets when it reconnects,
            # and it waits at least a second before it does.
            self.client.ack(pending.mid, pending.qos)

    def payloads(self) -> set[Numbered]:
        with self._lock:
            return set(self.received)

    def close(self) -> None:
        self._stop.set()
        self._acker.join(5)
        self.client.disconnect()
        self.client.loop_stop()


class RawClient:
    """One MQTT connection over a plain socket, packets encoded by the broker's codec:
    the test chooses every field, packet identifiers included."""

    def __init__(self, port: int, level: int = wire.MQTT_5, timeout: float = 5.0) -> None:
        self.level = level
        self.sock = socket.create_connection((HOST, port), timeout)
        self._reader = wire.PacketReader(1 << 20, protocol_level=level)
        self._received: collections.deque[wire.Packet] = collections.deque()

    def send(self, packet: wire.Packet) -> None:
        self.sock.sendall(wire.encode(packet, self.level))

    def receive(self) -> wire.Packet:
        """The next packet; ConnectionError once the broker has closed the connection."""
        while not self._received:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self._received.extend(self._reader.decode(data))
        return self._received.popleft()

    def expect(self, kind: type[P]) -> P:
        packet = self.receive()
        assert isinstance(packet, kind), f"expected {kind.__name__}, got {packet}"
        return packet

    def connect(self, client_id: str, clean_start: bool,
                session_expiry: int = SESSION_EXPIRY) -> wire.Connack:
        properties = wire.Properties(session_expiry_interval=session_expiry) \
            if self.level == wire.MQTT_5 else wire.Properties()
        self.send(wire.Connect(client_id, self.level, clean_start, 30,
                               properties=properties))
        connack = self.expect(wire.Connack)
        assert connack.reason_code == 0, connack
        return connack

    def publish_qos2(self, topic: str, payload: bytes, packet_id: int) -> None:
        """The whole exchange: PUBLISH, PUBREC, PUBREL, PUBCOMP, each answer a success."""
        self.send(wire.Publish(topic, payload, 2, packet_id=packet_id))
        pubrec = self.expect(wire.Pubrec)
        assert (pubrec.packet_id, pubrec.reason_code) == (packet_id, 0), pubrec
        self.send(wire.Pubrel(packet_id))
        pubcomp = self.expect(wire.Pubcomp)
        assert (pubcomp.packet_id, pubcomp.reason_code) == (packet_id, 0), pubcomp

    def close(self) -> None:
        self.sock.close()
