"""Inbound flow control: a client may have at most `mqtt.receive_maximum` QoS 1/2
publishes that the broker has not acknowledged yet (it acknowledges only once the
store has committed them). MQTT 5 clients are told the number in CONNACK and one that
sends more is disconnected with 0x93. MQTT 3.1.1 has no such announcement, so the
broker must apply back-pressure instead: stop reading (and handling) the client's
packets past that many, until acknowledgements free places. Without it a 3.1.1
client can pile up any number of pending publishes in the broker's memory.

How it is made visible without timing: the write buffer is told to hold messages for
a while (`flush_interval`), so no PUBACK can be sent for that long. A 3.1.1 client
sends receive_maximum + 6 QoS 1 publishes and then a PINGREQ, all in one write. With
back-pressure the PINGREQ is not even read before the first publishes are committed:
its PINGRESP comes after PUBACKs. Without it, the PINGRESP comes at once, before
any PUBACK. Only the order of the packets the client receives is asserted. (The
order is a consequence of back-pressure applied per packet, not per socket read: the
whole burst arrives in one read.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.processes import BrokerProcess, running_broker
from harness.waiting import wait_until
from stratamq.broker.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Publish,
    encode,
)
from tests.support.clients import RawClient, unique

RECEIVE_MAXIMUM = 4
HOLD = "1500ms"  # how long the write buffer keeps messages before writing them


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    config = {"mqtt": {"receive_maximum": RECEIVE_MAXIMUM},
              "durable_storage": {"messages": {
                  "n_shards": 1, "local_write_buffer": {"flush_interval": HOLD}}}}
    with running_broker(tmp_path_factory.mktemp("inbound"), config) as process:
        yield process


def burst(level: int, count: int) -> bytes:
    topic = unique("flow")
    return b"".join(encode(Publish(topic, b"x", 1, packet_id=i), level)
                    for i in range(1, count + 1)) + encode(Pingreq(), level)


def test_311_client_is_not_read_past_receive_maximum(broker: BrokerProcess) -> None:
    count = RECEIVE_MAXIMUM + 6
    client = RawClient(broker.port, MQTT_3_1_1)
    assert client.connect(unique("flow311")).reason_code == 0
    client.send_bytes(burst(MQTT_3_1_1, count))
    order: list[str] = []
    while len(order) < count + 1:
        packet = client.recv(timeout=30)
        assert packet is not None, f"closed after {order}"
        order.append(type(packet).__name__ if not isinstance(packet, Puback)
                     else f"Puback({packet.packet_id})")
    client.disconnect()
    # every publish is acknowledged, in order, and nothing is lost
    assert [o for o in order if o.startswith("Puback")] == [
        f"Puback({i})" for i in range(1, count + 1)]
    # the PINGREQ behind them was not handled before places were freed
    assert order.index("Pingresp") >= RECEIVE_MAXIMUM, (
        f"the broker read past {RECEIVE_MAXIMUM} unacknowledged publishes: {order}")


def test_311_client_keeps_publishing_at_the_pace_of_acknowledgements(
        broker: BrokerProcess) -> None:
    """Back-pressure must not become a deadlock: many more publishes than
    receive_maximum, sent without waiting, are all acknowledged."""
    count = RECEIVE_MAXIMUM * 5
    client = RawClient(broker.port, MQTT_3_1_1)
    assert client.connect(unique("pace311")).reason_code == 0
    client.send_bytes(burst(MQTT_3_1_1, count))
    received = [client.recv(timeout=30) for _ in range(count + 1)]
    assert [p.packet_id for p in received if isinstance(p, Puback)] == list(
        range(1, count + 1))
    assert sum(isinstance(p, Pingresp) for p in received) == 1
    client.disconnect()


def test_mqtt5_client_over_receive_maximum_is_disconnected(broker: BrokerProcess) -> None:
    """The MQTT 5 counterpart (works today): the limit is announced in CONNACK and
    exceeding it is an error, 0x93."""
    client = RawClient(broker.port, MQTT_5)
    connack = client.connect(unique("flow5"))
    assert connack.properties.receive_maximum == RECEIVE_MAXIMUM
    client.send_bytes(burst(MQTT_5, RECEIVE_MAXIMUM + 1))
    closing = client.wait_closed(timeout=30)
    assert [p.reason_code for p in closing if isinstance(p, Disconnect)] == [0x93]
    # and the site's log says who and why (a client cut off and reconnecting in a
    # loop is otherwise a mystery to whoever runs the site)
    assert wait_until(lambda: "receive maximum exceeded (0x93)" in broker.log(), 10), \
        broker.log_tail()
    line = next(line for line in broker.log().splitlines() if "(0x93)" in line)
    assert "flow5" in line, line
    # with the limit it broke: the figure to compare with the client's settings
    assert f"more than {RECEIVE_MAXIMUM} QoS 1/2 PUBLISH unacknowledged" in line, line
