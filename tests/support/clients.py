"""MQTT clients for the broker's integration tests.

`PahoClient` is paho-mqtt with everything it receives recorded, so a test waits on
events with timeouts instead of sleeping. `RawClient` speaks MQTT over a plain socket
with the project's codec, for what paho cannot do: stay silent past a keepalive, send
packets a client must not send, check packet identifiers and DUP flags byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, TypeVar

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from harness.processes import HOST, BrokerProcess
from stratamq.broker.mqtt import (
    MQTT_5,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketReader,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Will,
    encode,
)

TIMEOUT = 5.0  # the longest any single expected event is waited for
QUIET = 0.4  # how long "nothing more arrives" is watched

P = TypeVar("P", bound=Packet)


def unique(prefix: str) -> str:
    """A client id or topic level no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


ADMIN_TOKEN = BrokerProcess.ADMIN_TOKEN


def admin_get(broker: BrokerProcess, path: str) -> Any:
    """GET an admin API route (`/api/v1/...`) and return its JSON."""
    request = urllib.request.Request(f"http://{HOST}:{broker.admin_port}{path}",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.loads(response.read())


def metric_value(broker: BrokerProcess, name: str, **labels: str) -> float:
    """The value of one sample of the site's `/metrics` (0 when it is not there yet:
    a labelled counter appears with its first increment)."""
    with urllib.request.urlopen(f"http://{HOST}:{broker.admin_port}/metrics",
                                timeout=TIMEOUT) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        series_name, _, raw_labels = series.partition("{")
        found = dict(pair.split("=", 1) for pair in raw_labels.rstrip("}").split(",")
                     if pair)
        if series_name == name and found == {k: f'"{v}"' for k, v in labels.items()}:
            return float(value)
    return 0.0


def generations(broker: BrokerProcess, db: str = "messages") -> dict[int, list[int]]:
    """Shard id -> the ids of its generations, as the admin API shows them."""
    view = admin_get(broker, f"/api/v1/ds/storages/{db}")
    return {shard["id"]: [g["id"] for g in shard["generations"]] for shard in view["shards"]}


def paho_properties(packet_type: int, **values: Any) -> PahoProperties:
    """`paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=60)`."""
    properties = PahoProperties(packet_type)  # type: ignore[no-untyped-call]
    for name, value in values.items():
        setattr(properties, name, value)
    return properties


def prop(properties: PahoProperties | None, name: str) -> Any:
    """A property paho received, None when absent (paho sets them as attributes)."""
    return getattr(properties, name, None)


@dataclass(frozen=True)
class PahoConnack:
    reason_code: int
    session_present: bool
    properties: PahoProperties | None


class PahoClient:
    """paho-mqtt on its network thread; what it receives lands in queues. It never
    reconnects by itself: a test decides when a client comes back."""

    def __init__(self, port: int, client_id: str = "", *, version: int = 5,
                 clean_session: bool | None = None, manual_ack: bool = False,
                 host: str = HOST) -> None:
        self.port = port
        self.host = host
        self.version = version
        protocol = mqtt.MQTTv5 if version == 5 else mqtt.MQTTv311
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                  clean_session=clean_session, protocol=protocol,
                                  reconnect_on_failure=False, manual_ack=manual_ack)
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connacks: queue.Queue[PahoConnack] = queue.Queue()
        self.disconnects: queue.Queue[int] = queue.Queue()
        self._results: dict[tuple[str, int], Any] = {}
        self._condition = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_unsubscribe

    # -- callbacks (network thread) -------------------------------------------------

    def _on_connect(self, _c: mqtt.Client, _u: Any, flags: mqtt.ConnectFlags,
                    reason_code: PahoReasonCode, properties: PahoProperties | None) -> None:
        self.connacks.put(PahoConnack(reason_code.value, flags.session_present, properties))

    def _on_disconnect(self, _c: mqtt.Client, _u: Any, _flags: mqtt.DisconnectFlags,
                       reason_code: PahoReasonCode, _p: PahoProperties | None) -> None:
        self.disconnects.put(reason_code.value)

    def _on_message(self, _c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        self.messages.put(message)

    def _record(self, kind: str, mid: int, value: Any) -> None:
        with self._condition:
            self._results[(kind, mid)] = value
            self._condition.notify_all()

    def _on_publish(self, _c: mqtt.Client, _u: Any, mid: int, reason_code: PahoReasonCode,
                    _p: PahoProperties) -> None:
        self._record("publish", mid, reason_code.value)

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, mid: int, codes: list[PahoReasonCode],
                      _p: PahoProperties | None) -> None:
        self._record("subscribe", mid, [code.value for code in codes])

    def _on_unsubscribe(self, _c: mqtt.Client, _u: Any, mid: int,
                        codes: list[PahoReasonCode], _p: PahoProperties | None) -> None:
        self._record("unsubscribe", mid, [code.value for code in codes])

    def _result(self, kind: str, mid: int | None, timeout: float = TIMEOUT) -> Any:
        assert mid is not None
        with self._condition:
            if not self._condition.wait_for(lambda: (kind, mid) in self._results, timeout):
                raise AssertionError(f"no {kind} acknowledgement for mid {mid}")
            return self._results.pop((kind, mid))

    # -- actions (test thread) ------------------------------------------------------

    def connect(self, *, clean_start: bool = True, keepalive: int = 60,
                properties: PahoProperties | None = None) -> PahoConnack:
        """Connect and return the CONNACK (also a refusal)."""
        if self.version == 5:
            self.client.connect(self.host, self.port, keepalive, clean_start=clean_start,
                                properties=properties)
        else:
            self.client.connect(self.host, self.port, keepalive)
        self.client.loop_start()
        try:
            return self.connacks.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError("no CONNACK") from None

    def subscribe(self, topic: str | list[tuple[str, SubscribeOptions]], qos: int = 1, *,
                  options: SubscribeOptions | None = None,
                  properties: PahoProperties | None = None) -> list[int]:
        """Subscribe and return the SUBACK's reason codes."""
        if isinstance(topic, list):
            _, mid = self.client.subscribe(topic, properties=properties)
        elif options is not None:
            _, mid = self.client.subscribe(topic, options=options, properties=properties)
        else:
            _, mid = self.client.subscribe(topic, qos, properties=properties)
        codes: list[int] = self._result("subscribe", mid)
        return codes

    def unsubscribe(self, topic: str) -> list[int]:
        _, mid = self.client.unsubscribe(topic)
        codes: list[int] = self._result("unsubscribe", mid)
        return codes

    def publish(self, topic: str, payload: bytes = b"", qos: int = 1, *, retain: bool = False,
                properties: PahoProperties | None = None) -> int:
        """Publish; at QoS 1 and 2 wait for the PUBACK / PUBCOMP and return its reason
        code (the PUBREC's when that refused the message)."""
        info = self.client.publish(topic, payload, qos, retain, properties)
        if qos == 0:
            info.wait_for_publish(TIMEOUT)
            return 0
        code: int = self._result("publish", info.mid)
        return code

    def expect(self, count: int, timeout: float = TIMEOUT) -> list[mqtt.MQTTMessage]:
        """The next `count` messages; fails when they do not all arrive in time."""
        got: list[mqtt.MQTTMessage] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                got.append(self.messages.get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                raise AssertionError(
                    f"{len(got)} of {count} messages arrived: "
                    f"{[(m.topic, m.payload) for m in got]}") from None
        return got

    def quiet(self, wait: float = QUIET) -> None:
        """Nothing (more) arrives."""
        try:
            message = self.messages.get(timeout=wait)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected message {message.topic} {message.payload!r}")

    def ack(self, message: mqtt.MQTTMessage) -> None:
        self.client.ack(message.mid, message.qos)

    def wait_disconnected(self, timeout: float = TIMEOUT) -> int:
        """The reason code paho reports for the end of the connection."""
        try:
            code = self.disconnects.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("the connection did not end") from None
        self.client.loop_stop()
        return code

    def disconnect(self, reason_code: int = 0, properties: PahoProperties | None = None
                   ) -> None:
        """A normal DISCONNECT (with a reason code and properties on MQTT 5)."""
        if self.version == 5:
            self.client.disconnect(PahoReasonCode(PacketTypes.DISCONNECT, identifier=reason_code),
                                   properties)
        else:
            self.client.disconnect()
        self.wait_disconnected()

    def drop(self) -> None:
        """End the connection without a DISCONNECT, as a crashed client would."""
        sock = self.client.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)
        self.wait_disconnected()

    def stop(self) -> None:
        """Clean up whatever state the client is in (for `finally` blocks)."""
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()


class RawClient:
    """One MQTT connection over a plain socket, encoded with the project's codec."""

    def __init__(self, port: int, level: int = MQTT_5, host: str = HOST) -> None:
        self.level = level
        self.sock = socket.create_connection((host, port), timeout=TIMEOUT)
        self._reader = PacketReader(1 << 28, protocol_level=level)
        self._received: deque[Packet] = deque()
        self.eof = False

    def send(self, packet: Packet) -> None:
        self.sock.sendall(encode(packet, self.level))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float = TIMEOUT) -> Packet | None:
        """The next packet; None once the broker has closed the connection."""
        deadline = time.monotonic() + timeout
        while not self._received:
            if self.eof:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no packet")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                continue
            self._received.extend(self._reader.decode(data))
        return self._received.popleft()

    def expect(self, kind: type[P], timeout: float = TIMEOUT) -> P:
        packet = self.recv(timeout)
        assert isinstance(packet, kind), f"expected {kind.__name__}, got {packet!r}"
        return packet

    def quiet(self, wait: float = QUIET) -> None:
        """No packet arrives (and the connection stays open) for `wait` seconds."""
        try:
            packet = self.recv(wait)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected {packet!r}")

    def wait_closed(self, timeout: float = TIMEOUT) -> list[Packet]:
        """Wait for the broker to close the connection; returns what came before."""
        before: list[Packet] = []
        while (packet := self.recv(timeout)) is not None:
            before.append(packet)
        return before

    def connect(self, client_id: str, *, clean_start: bool = True, keepalive: int = 60,
                properties: Properties | None = None, will: Will | None = None,
                username: str | None = None, password: bytes | None = None) -> Connack:
        self.send(Connect(client_id, self.level, clean_start, keepalive, username, password,
                          will, properties or Properties()))
        return self.expect(Connack)

    def subscribe(self, topic_filter: str, qos: int = 1, *, packet_id: int = 1,
                  properties: Properties | None = None, **options: Any) -> Suback:
        self.send(Subscribe(packet_id, [(topic_filter, SubscriptionOptions(qos, **options))],
                            properties or Properties()))
        return self.expect(Suback)

    def publish(self, topic: str, payload: bytes, qos: int = 0, *, packet_id: int | None = None,
                retain: bool = False, properties: Properties | None = None) -> Packet | None:
        """Publish; at QoS 1 return the PUBACK, at QoS 2 run the whole exchange and
        return the PUBCOMP (or a refusing PUBREC)."""
        if qos and packet_id is None:
            packet_id = 1
        self.send(Publish(topic, payload, qos, retain, False, packet_id,
                          properties or Properties()))
        if qos == 0:
            return None
        if qos == 1:
            return self.expect(Puback)
        assert packet_id is not None
        pubrec = self.expect(Pubrec)
        if pubrec.reason_code >= 0x80:
            return pubrec
        self.send(Pubrel(packet_id))
        return self.expect(Pubcomp)

    def disconnect(self, reason_code: int = 0, properties: Properties | None = None) -> None:
        self.send(Disconnect(reason_code, properties or Properties()))
        self.wait_closed()
        self.close()

    def close(self) -> None:
        """Close the socket: without a DISCONNECT first, an abnormal end."""
        with contextlib.suppress(OSError):
            self.sock.close()
