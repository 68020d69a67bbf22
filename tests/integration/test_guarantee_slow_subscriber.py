"""A connected subscriber never loses a QoS 1/2 message because it is slow (docs/architecture.md
"Guarantees" 6): when the queue of a transient session is full
(`mqtt.max_queued_messages`), it keeps reading from storage; only QoS 0 messages may
be dropped, and each drop is counted in `stratamq_messages_dropped_total`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import MQTT_5, Properties, Puback, Pubcomp, Publish, Pubrec, Pubrel
from tests.support.clients import (
    PahoClient,
    RawClient,
    metric_value,
    unique,
)

MAX_QUEUED = 10
QOS0 = 20
QOS_HIGH = 60  # six times the queue


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path, {"mqtt": {"max_queued_messages": MAX_QUEUED}}) as process:
        yield process


def dropped(broker: BrokerProcess) -> float:
    return metric_value(broker, "stratamq_messages_dropped_total", reason="queue_full")


@pytest.mark.parametrize("qos", [1, 2])
def test_slow_clean_subscriber_gets_every_qos1_and_qos2_message(broker: BrokerProcess,
                                                                qos: int) -> None:
    topic = unique("slow") + "/t"
    # Clean session, one message in flight at a time, and it does not read at first.
    subscriber = RawClient(broker.port, MQTT_5)
    subscriber.connect(unique("slow"), properties=Properties(receive_maximum=1))
    assert subscriber.subscribe(topic, qos).reason_codes == [qos]
    dropped_before = dropped(broker)
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        publisher.connect()
        # QoS 0 and QoS 1/2 interleaved, so the queue overflows with both kinds in it
        for number in range(QOS_HIGH):
            assert publisher.publish(topic, b"high-%d" % number, qos) == 0
            if number < QOS0:
                publisher.publish(topic, b"low-%d" % number, 0)
    finally:
        publisher.stop()

    high: list[bytes] = []
    low: list[bytes] = []
    # bounded: every message once, and some slack for resends
    for _ in range(2 * (QOS_HIGH + QOS0)):
        if len(high) == QOS_HIGH:
            break
        try:
            packet = subscriber.recv()
        except TimeoutError:
            break
        if isinstance(packet, Publish):
            if packet.qos == 0:
                low.append(packet.payload)
                continue
            assert packet.packet_id is not None and not packet.dup
            high.append(packet.payload)
            subscriber.send(Puback(packet.packet_id) if qos == 1 else Pubrec(packet.packet_id))
        elif isinstance(packet, Pubrel):
            subscriber.send(Pubcomp(packet.packet_id))
    # Every QoS 1/2 message, in publish order, none lost to the full queue.
    assert high == [b"high-%d" % n for n in range(QOS_HIGH)], \
        f"{QOS_HIGH - len(set(high))} of {QOS_HIGH} QoS {qos} messages lost"
    # QoS 0 may be dropped, but then counted.
    assert dropped(broker) - dropped_before == QOS0 - len(low)
    subscriber.disconnect()


def test_slow_subscriber_with_overlapping_filters_gets_each_message_once(
        broker: BrokerProcess) -> None:
    """Falling behind on several topics through overlapping filters: every QoS 1
    message arrives once (one copy for both filters), in publish order per topic."""
    root = unique("slowov")
    topics = [f"{root}/a", f"{root}/b", f"{root}/c/d"]
    subscriber = RawClient(broker.port, MQTT_5)
    subscriber.connect(unique("slow"), properties=Properties(receive_maximum=1))
    assert subscriber.subscribe(f"{root}/#", 1, packet_id=1).reason_codes == [1]
    assert subscriber.subscribe(f"{root}/a", 1, packet_id=2).reason_codes == [1]
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        publisher.connect()
        for number in range(QOS_HIGH):
            assert publisher.publish(topics[number % 3], b"%d" % number, 1) == 0
    finally:
        publisher.stop()
    got: list[tuple[str, bytes]] = []
    while True:
        try:
            packet = subscriber.recv(2.0)
        except TimeoutError:
            break
        assert isinstance(packet, Publish), packet
        assert packet.packet_id is not None and not packet.dup
        got.append((packet.topic, packet.payload))
        subscriber.send(Puback(packet.packet_id))
    for index, topic in enumerate(topics):
        assert [p for t, p in got if t == topic] == \
            [b"%d" % n for n in range(index, QOS_HIGH, 3)], topic
    assert len(got) == QOS_HIGH
    subscriber.disconnect()
