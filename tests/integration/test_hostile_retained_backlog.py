"""A SUBSCRIBE that matches more retained QoS 1 messages than the session's queue
holds (`mqtt.max_queued_messages`, 1000 by default) gets every one of them: retained
delivery waits for room in the queue instead of dropping QoS 1/2 messages, as slow
subscribers lose no QoS 1/2 message of the live feed either.

Before, the retained messages were all offered to the queue at once and those past
its bound dropped (counted as `queue_full`): a subscriber reading normally with a
Receive Maximum of 10 got 1,128 of 3,000. A live message published meanwhile reaches
the subscriber too, and nothing is counted as dropped."""

from __future__ import annotations

import time

import pytest
from paho.mqtt.packettypes import PacketTypes

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import (
    MQTT_5,
    Properties,
    Puback,
    Publish,
    Unsuback,
    Unsubscribe,
    encode,
)
from tests.support.clients import PahoClient, RawClient, metric_value, paho_properties, unique

COUNT = 3000
CHUNK = 100  # QoS 1 publishes in flight at once, under the broker's Receive Maximum
RECEIVE_MAXIMUM = 10


@pytest.fixture(scope="module")
def root(broker: BrokerProcess) -> str:
    """A topic level with COUNT retained QoS 1 messages under it."""
    level = unique("backlog")
    publish_retained(broker, level)
    return level


def publish_retained(broker: BrokerProcess, root: str) -> None:
    publisher = RawClient(broker.port, MQTT_5)
    assert publisher.connect(unique("retainer")).reason_code == 0
    for first in range(0, COUNT, CHUNK):
        numbers = range(first, min(first + CHUNK, COUNT))
        publisher.send_bytes(b"".join(
            encode(Publish(f"{root}/{n}", b"r%d" % n, 1, True, packet_id=n - first + 1),
                   MQTT_5) for n in numbers))
        for _ in numbers:
            assert publisher.expect(Puback, timeout=30).reason_code == 0
    publisher.disconnect()


def dropped(broker: BrokerProcess) -> float:
    return metric_value(broker, "stratamq_messages_dropped_total", reason="queue_full")


@pytest.mark.parametrize("durable", [False, True])
def test_every_retained_qos1_message_reaches_a_subscriber(broker: BrokerProcess, root: str,
                                                          durable: bool) -> None:
    dropped_before = dropped(broker)
    properties = {"ReceiveMaximum": RECEIVE_MAXIMUM}
    if durable:
        properties["SessionExpiryInterval"] = 300
    subscriber = PahoClient(broker.port, unique("reader"))
    try:
        connack = subscriber.connect(
            properties=paho_properties(PacketTypes.CONNECT, **properties))
        assert connack.reason_code == 0
        started = time.monotonic()
        assert subscriber.subscribe(f"{root}/#", 1) == [1]
        # a live message published while the retained ones are on their way
        live = PahoClient(broker.port, unique("live"))
        assert live.connect().reason_code == 0
        live_topic = f"{root}/live-{int(durable)}"
        assert live.publish(live_topic, b"live", 1) == 0
        live.stop()
        got = {message.topic: bytes(message.payload)
               for message in subscriber.expect(COUNT + 1, timeout=60)}
        print(f"\n{COUNT + 1} messages in {time.monotonic() - started:.1f} s")
        assert got.pop(live_topic) == b"live"
        assert got == {f"{root}/{i}": b"r%d" % i for i in range(COUNT)}
        subscriber.quiet()
        assert dropped(broker) == dropped_before
    finally:
        subscriber.stop()


def test_a_subscriber_that_reads_nothing_holds_the_rest_back(broker: BrokerProcess,
                                                             root: str) -> None:
    """Unacknowledged, only the Receive Maximum goes out and the rest waits (neither
    dropped nor all read into memory); UNSUBSCRIBE stops what was not queued yet."""
    dropped_before = dropped(broker)
    client = RawClient(broker.port, MQTT_5)
    assert client.connect(unique("idle"), properties=Properties(receive_maximum=5)
                          ).reason_code == 0
    assert client.subscribe(f"{root}/#", 1).reason_codes == [1]
    first = [client.expect(Publish) for _ in range(5)]
    client.quiet()
    client.send(Unsubscribe(2, [f"{root}/#"]))
    assert client.expect(Unsuback).packet_id == 2
    # what was queued before the UNSUBSCRIBE still comes as the client acknowledges
    received = len(first)
    pending = [packet.packet_id or 0 for packet in first]
    while pending:
        client.send(Puback(pending.pop()))
        try:
            packet = client.recv(0.5)
        except TimeoutError:
            continue
        assert isinstance(packet, Publish), packet
        received += 1
        pending.append(packet.packet_id or 0)
    print(f"\n{received} of {COUNT} sent: the rest stopped at UNSUBSCRIBE")
    assert received < COUNT // 2, f"{received} sent after UNSUBSCRIBE stopped the rest"
    assert dropped(broker) == dropped_before
    client.disconnect()
