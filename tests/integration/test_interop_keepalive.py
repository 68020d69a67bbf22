"""Server Keep Alive (MQTT 5.0 section 3.2.2.3.14): a client asking for a keepalive
above `mqtt.max_keepalive` is told in its CONNACK to use `max_keepalive`, and the
broker then holds it to that (closes it after 1.5 x max_keepalive of silence)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import MQTT_3_1_1, MQTT_5, Disconnect
from tests.support.clients import RawClient, unique

MAX_KEEPALIVE = 2


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path_factory.mktemp("keepalive"),
                        {"mqtt": {"max_keepalive": MAX_KEEPALIVE}}) as process:
        yield process


def test_keepalive_above_the_maximum_gets_server_keep_alive(broker: BrokerProcess) -> None:
    client = RawClient(broker.port, MQTT_5)
    connack = client.connect(unique("ka"), keepalive=600)
    assert connack.reason_code == 0
    assert connack.properties.server_keep_alive == MAX_KEEPALIVE
    # silent past 1.5 x the server's keepalive (not the 600 s asked for): closed with
    # 0x8D Keep Alive timeout
    closing = client.wait_closed(timeout=MAX_KEEPALIVE * 1.5 + 10)
    assert [p.reason_code for p in closing if isinstance(p, Disconnect)] == [0x8D]


def test_keepalive_within_the_maximum_has_no_server_keep_alive(broker: BrokerProcess) -> None:
    client = RawClient(broker.port, MQTT_5)
    connack = client.connect(unique("ka"), keepalive=1)
    assert connack.reason_code == 0
    assert connack.properties.server_keep_alive is None
    client.disconnect()


def test_keepalive_above_the_maximum_on_311_is_enforced(broker: BrokerProcess) -> None:
    """3.1.1 has no way to tell the client; the broker still holds it to the maximum."""
    client = RawClient(broker.port, MQTT_3_1_1)
    assert client.connect(unique("ka"), keepalive=600).reason_code == 0
    client.sock.settimeout(MAX_KEEPALIVE * 1.5 + 10)
    with contextlib.suppress(ConnectionResetError):  # a reset is a close too
        assert client.sock.recv(16) == b""
