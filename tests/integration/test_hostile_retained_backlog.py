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

from stratamq.broker.mqtt import MQTT_5, Puback, Publish, encode
from tests.support.clients import PahoClient, RawClient, metric_value, paho_properties, unique
from tests.support.harness import BrokerProcess

COUNT = 3000
CHUNK = 100  # QoS 1 publishes in flight at once, under the broker's Receive Maximum
RECEIVE_MAXIMUM = 10


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
def test_every_retained_qos1_message_reaches_a_subscriber(broker: BrokerProcess,
                                                          durable: bool) -> None:
    root = unique("backlog")
    publish_retained(broker, root)
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
        assert live.publish(f"{root}/live", b"live", 1) == 0
        live.stop()
        got = {message.topic: bytes(message.payload)
               for message in subscriber.expect(COUNT + 1, timeout=60)}
        print(f"\n{COUNT + 1} messages in {time.monotonic() - started:.1f} s")
        assert got.pop(f"{root}/live") == b"live"
        assert got == {f"{root}/{i}": b"r%d" % i for i in range(COUNT)}
        subscriber.quiet()
        assert dropped(broker) == dropped_before
    finally:
        subscriber.stop()
