"""A broker under hostile input, for the connection fuzz test: raw-socket exchanges,
and the checks that follow each one (the process lives, a well-behaved paho client
still connects, publishes at QoS 1 and receives its message, nothing crashed inside)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from harness.processes import BrokerProcess

HOST = "127.0.0.1"
DURABLE_ID = "fuzz-durable"
DURABLE_FILTER = "fuzz/durable/#"  # every probe message lands here too
TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class Exchange:
    closed: bool  # the broker closed (or reset) the connection
    received: bytes


def send_hostile(port: int, chunks: Iterable[bytes], wait: float) -> Exchange:
    """Send `chunks` on a fresh connection, then read until the broker closes it or
    `wait` seconds have passed."""
    received = bytearray()
    with socket.create_connection((HOST, port), TIMEOUT) as sock:
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return Exchange(True, bytes(received))
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return Exchange(True, bytes(received))
            if not data:
                return Exchange(True, bytes(received))
            received += data
    return Exchange(False, bytes(received))


def _client(client_id: str) -> mqtt.Client:
    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)


def _session_expiry(seconds: int) -> Properties:
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.SessionExpiryInterval = seconds
    return properties


class _Events:
    """What a paho client's callbacks report, as events a test can wait for."""

    def __init__(self, client: mqtt.Client) -> None:
        self.connected = threading.Event()
        self.session_present = False
        self.subscribed = threading.Event()
        self.messages: list[mqtt.MQTTMessage] = []
        self.arrived = threading.Condition()
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message

    def _on_connect(self, _client: mqtt.Client, _userdata: Any, flags: mqtt.ConnectFlags,
                    reason_code: ReasonCode, _properties: Properties | None) -> None:
        if not reason_code.is_failure:
            self.session_present = flags.session_present
            self.connected.set()

    def _on_subscribe(self, _client: mqtt.Client, _userdata: Any, _mid: int,
                      reason_codes: list[ReasonCode], _properties: Properties | None) -> None:
        if not any(code.is_failure for code in reason_codes):
            self.subscribed.set()

    def _on_message(self, _client: mqtt.Client, _userdata: Any,
                    message: mqtt.MQTTMessage) -> None:
        with self.arrived:
            self.messages.append(message)
            self.arrived.notify_all()

    def payloads(self) -> list[bytes]:
        with self.arrived:
            return [bytes(message.payload) for message in self.messages]


@dataclass
class Site:
    """The module's broker and what the well-behaved clients did on it."""

    broker: BrokerProcess
    probes: list[bytes] = field(default_factory=list)  # published by probe(), in order
    _log_seen: int = 0

    def start(self) -> None:
        """Leave a durable session with a subscription behind (offline: what it gets
        while the fuzz runs waits in storage)."""
        client = _client(DURABLE_ID)
        events = _Events(client)
        client.connect(HOST, self.broker.port, 30, clean_start=True,
                       properties=_session_expiry(3600))
        client.loop_start()
        try:
            assert events.connected.wait(TIMEOUT), "durable subscriber: no CONNACK"
            client.subscribe(DURABLE_FILTER, qos=1)
            assert events.subscribed.wait(TIMEOUT), "durable subscriber: no SUBACK"
        finally:
            client.disconnect()
            client.loop_stop()

    def check(self, what: str) -> None:
        """After hostile input: the broker runs, logged no traceback, and serves a
        fresh client end to end."""
        assert self.broker.alive(), f"broker died after {what}:\n{self.broker.log()[-3000:]}"
        self.probe()
        log = self.broker.log()
        new, self._log_seen = log[self._log_seen:], len(log)
        assert "Traceback" not in new, f"broker logged a traceback after {what}:\n{new}"

    def probe(self) -> None:
        number = len(self.probes)
        topic = f"fuzz/durable/{number}"
        payload = f"probe {number}".encode()
        client = _client(f"fuzz-probe-{number}")
        events = _Events(client)
        client.connect(HOST, self.broker.port, 30)
        client.loop_start()
        try:
            assert events.connected.wait(TIMEOUT), "probe: no CONNACK"
            client.subscribe(topic, qos=1)
            assert events.subscribed.wait(TIMEOUT), "probe: no SUBACK"
            info = client.publish(topic, payload, qos=1)
            info.wait_for_publish(TIMEOUT)
            assert info.is_published(), "probe: no PUBACK"
            self.probes.append(payload)
            with events.arrived:
                assert events.arrived.wait_for(lambda: bool(events.messages), TIMEOUT), \
                    "probe: own message not received"
            assert events.payloads() == [payload]
        finally:
            client.disconnect()
            client.loop_stop()

    def durable_payloads(self, expected: int) -> tuple[bool, list[bytes]]:
        """Resume the durable session; (session present, payloads received once
        `expected` have arrived or the time is up)."""
        client = _client(DURABLE_ID)
        events = _Events(client)
        client.connect(HOST, self.broker.port, 30, clean_start=False,
                       properties=_session_expiry(3600))
        client.loop_start()
        try:
            assert events.connected.wait(TIMEOUT), "durable subscriber: no CONNACK"
            with events.arrived:
                events.arrived.wait_for(lambda: len(events.messages) >= expected, 10)
            time.sleep(0.2)  # anything beyond the expected would arrive now
            return events.session_present, events.payloads()
        finally:
            client.disconnect()
            client.loop_stop()
