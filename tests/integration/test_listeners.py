"""MQTT over WebSocket and over TLS, each against a real broker process."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from harness.processes import BrokerProcess, free_port

TIMEOUT = 10.0


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 made with the openssl command line."""
    cert, key = folder / "server.pem", folder / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, Path,
                                                                            int]]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_certificate(folder)
    tls_port = free_port()
    broker = BrokerProcess(folder, {"listeners": {"tls": {
        "enable": True, "bind": f"127.0.0.1:{tls_port}", "certfile": str(cert),
        "keyfile": str(key)}}}).start()
    yield broker, cert, tls_port
    broker.kill()


def round_trip(client: mqtt.Client, host: str, port: int) -> list[bytes]:
    """Connect, subscribe, publish QoS 1 to ourselves, return what came back."""
    received: list[bytes] = []
    arrived = threading.Event()
    subscribed = threading.Event()

    def on_message(_c: mqtt.Client, _u: object, message: mqtt.MQTTMessage) -> None:
        received.append(bytes(message.payload))
        arrived.set()

    client.on_message = on_message
    client.on_subscribe = lambda *_args: subscribed.set()
    client.connect(host, port)
    client.loop_start()
    try:
        client.subscribe("listeners/t", qos=1)
        assert subscribed.wait(TIMEOUT)
        client.publish("listeners/t", b"hello", qos=1).wait_for_publish(TIMEOUT)
        assert arrived.wait(TIMEOUT)
    finally:
        client.disconnect()
        client.loop_stop()
    return received


def test_mqtt_over_websocket(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path).start()
    try:
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="ws-client",
                             protocol=mqtt.MQTTv5, transport="websockets")
        client.ws_set_options(path="/mqtt")
        assert round_trip(client, "127.0.0.1", broker.ws_port) == [b"hello"]
    finally:
        broker.kill()


def test_mqtt_over_tls(tls_broker: tuple[BrokerProcess, Path, int]) -> None:
    _broker, cert, tls_port = tls_broker
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="tls-client",
                         protocol=mqtt.MQTTv311)
    client.tls_set(ca_certs=str(cert))
    assert round_trip(client, "127.0.0.1", tls_port) == [b"hello"]


def test_tls_listener_refuses_plain_mqtt(tls_broker: tuple[BrokerProcess, Path, int]) -> None:
    broker, _cert, tls_port = tls_broker
    with socket.create_connection(("127.0.0.1", tls_port), timeout=TIMEOUT) as plain:
        # a CONNECT in clear text is not a TLS handshake: the server closes
        plain.sendall(bytes.fromhex("101000044d5154540402003c0004746573"))
        plain.settimeout(TIMEOUT)
        try:
            answer = plain.recv(1024)
        except ConnectionResetError:
            answer = b""
        assert not answer.startswith(b"\x20")  # never a CONNACK
    assert broker.alive()


def test_tls_needs_certificate_in_config(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path, {"listeners": {"tls": {"enable": True}}})
    with pytest.raises(RuntimeError, match="certfile and keyfile are required"):
        broker.start()
