"""Quality of service in both directions, redelivery with DUP and the original packet
identifiers, and the receive maximum (MQTT 5.0 sections 4.3, 4.4, 4.9; MQTT 3.1.1
sections 4.3, 4.4)."""

from __future__ import annotations

import pytest

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)
from stratamq.broker.mqtt import Properties as Props
from tests.support.clients import PahoClient, RawClient, unique


@pytest.mark.parametrize("version", [4, 5])
def test_delivery_qos_is_the_lower_of_publish_and_subscription(broker: BrokerProcess,
                                                               version: int) -> None:
    root = unique("qos")
    subscriber = PahoClient(broker.port, unique("sub"), version=version)
    publisher = PahoClient(broker.port, unique("pub"), version=version)
    try:
        subscriber.connect()
        for sub_qos in (0, 1, 2):
            assert subscriber.subscribe(f"{root}/{sub_qos}/#", sub_qos) == [sub_qos]
        publisher.connect()
        for sub_qos in (0, 1, 2):
            for pub_qos in (0, 1, 2):
                assert publisher.publish(f"{root}/{sub_qos}/{pub_qos}", b"%d%d" % (
                    sub_qos, pub_qos), pub_qos) == 0
        got = {(m.topic, m.payload, m.qos) for m in subscriber.expect(9)}
        assert got == {(f"{root}/{s}/{p}", b"%d%d" % (s, p), min(s, p))
                       for s in (0, 1, 2) for p in (0, 1, 2)}
        subscriber.quiet()
    finally:
        subscriber.stop()
        publisher.stop()


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_inbound_qos2_resend_before_pubrel_is_delivered_once(broker: BrokerProcess,
                                                             level: int) -> None:
    topic = unique("once")
    subscriber = PahoClient(broker.port, unique("sub"))
    try:
        subscriber.connect()
        subscriber.subscribe(topic, 2)
        publisher = RawClient(broker.port, level)
        publisher.connect(unique("pub"))
        publisher.send(Publish(topic, b"exactly once", 2, packet_id=7))
        assert publisher.expect(Pubrec).packet_id == 7
        publisher.send(Publish(topic, b"exactly once", 2, dup=True, packet_id=7))
        assert publisher.expect(Pubrec).packet_id == 7
        publisher.send(Pubrel(7))
        assert publisher.expect(Pubcomp).packet_id == 7
        # the packet identifier is free again: a new message with it is a new message
        assert isinstance(publisher.publish(topic, b"second", 2, packet_id=7), Pubcomp)
        assert [m.payload for m in subscriber.expect(2)] == [b"exactly once", b"second"]
        subscriber.quiet()
        publisher.disconnect()
    finally:
        subscriber.stop()


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_outbound_qos2_exchange(broker: BrokerProcess, level: int) -> None:
    topic = unique("out2")
    subscriber = RawClient(broker.port, level)
    subscriber.connect(unique("sub"))
    subscriber.subscribe(topic, 2)
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        publisher.connect()
        assert publisher.publish(topic, b"q2", 2) == 0
        message = subscriber.expect(Publish)
        assert (message.payload, message.qos, message.dup) == (b"q2", 2, False)
        assert message.packet_id is not None
        subscriber.send(Pubrec(message.packet_id))
        assert subscriber.expect(Pubrel).packet_id == message.packet_id
        subscriber.send(Pubcomp(message.packet_id))
        subscriber.quiet()
        subscriber.disconnect()
    finally:
        publisher.stop()


def _durable(broker: BrokerProcess, level: int, client_id: str, clean_start: bool) -> RawClient:
    client = RawClient(broker.port, level)
    properties = Props(session_expiry_interval=300) if level == MQTT_5 else None
    connack = client.connect(client_id, clean_start=clean_start, properties=properties)
    assert connack.reason_code == 0
    return client


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_unacknowledged_messages_are_resent_with_dup_and_their_packet_ids(
        broker: BrokerProcess, level: int) -> None:
    client_id = unique("dup")
    topic = unique("dup")
    subscriber = _durable(broker, level, client_id, level == MQTT_5)
    subscriber.subscribe(f"{topic}/#", 2)
    publisher = RawClient(broker.port)
    publisher.connect(unique("pub"))
    # one topic: the order of redelivery is guaranteed per publisher and topic
    publisher.publish(f"{topic}/x", b"one", 1, packet_id=1)
    publisher.publish(f"{topic}/x", b"two", 2, packet_id=2)
    publisher.publish(f"{topic}/x", b"three", 2, packet_id=3)
    first = [subscriber.expect(Publish) for _ in range(3)]
    assert [(p.payload, p.qos, p.dup) for p in first] == [
        (b"one", 1, False), (b"two", 2, False), (b"three", 2, False)]
    assert first[2].packet_id is not None
    subscriber.send(Pubrec(first[2].packet_id))  # "three" is received, "one", "two" not
    assert subscriber.expect(Pubrel).packet_id == first[2].packet_id
    subscriber.close()

    again = _durable(broker, level, client_id, False)
    resent = [again.recv() for _ in range(3)]
    assert [(p.payload, p.qos, p.dup, p.packet_id) for p in resent
            if isinstance(p, Publish)] == [
        (b"one", 1, True, first[0].packet_id), (b"two", 2, True, first[1].packet_id)]
    # "three" is past PUBREC: only its PUBREL comes again
    assert [p.packet_id for p in resent if isinstance(p, Pubrel)] == [first[2].packet_id]
    assert first[0].packet_id is not None and first[1].packet_id is not None
    again.send(Puback(first[0].packet_id))
    again.send(Pubrec(first[1].packet_id))
    assert again.expect(Pubrel).packet_id == first[1].packet_id
    again.send(Pubcomp(first[1].packet_id))
    again.send(Pubcomp(first[2].packet_id))
    again.quiet()
    again.close()

    # everything is acknowledged now: a third connection gets nothing again
    third = _durable(broker, level, client_id, False)
    third.quiet()
    third.disconnect()
    publisher.disconnect()


def test_client_receive_maximum_bounds_the_in_flight_window(broker: BrokerProcess) -> None:
    topic = unique("window")
    subscriber = RawClient(broker.port)
    subscriber.connect(unique("sub"), properties=Props(receive_maximum=2))
    subscriber.subscribe(topic, 2)
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        publisher.connect()
        for number in range(6):
            publisher.publish(topic, b"%d" % number, 1 + number % 2)
        window = [subscriber.expect(Publish) for _ in range(2)]
        subscriber.quiet()  # two unacknowledged: the broker waits
        received = list(window)
        while len(received) < 6:
            oldest = window.pop(0)
            assert oldest.packet_id is not None
            if oldest.qos == 1:
                subscriber.send(Puback(oldest.packet_id))
            else:  # at QoS 2 the slot is free only after PUBCOMP
                subscriber.send(Pubrec(oldest.packet_id))
                assert subscriber.expect(Pubrel).packet_id == oldest.packet_id
                subscriber.quiet(0.1)
                subscriber.send(Pubcomp(oldest.packet_id))
            window.append(subscriber.expect(Publish))
            received.append(window[-1])
            subscriber.quiet(0.1)
        assert [p.payload for p in received] == [b"%d" % n for n in range(6)]
        subscriber.disconnect()
    finally:
        publisher.stop()


def test_paho_manual_ack_with_receive_maximum(broker: BrokerProcess) -> None:
    """The same window seen through paho: never more than two unacknowledged."""
    from paho.mqtt.packettypes import PacketTypes

    from tests.support.clients import paho_properties

    topic = unique("paho-window")
    subscriber = PahoClient(broker.port, unique("sub"), manual_ack=True)
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        subscriber.connect(properties=paho_properties(PacketTypes.CONNECT, ReceiveMaximum=2))
        subscriber.subscribe(topic, 1)
        publisher.connect()
        for number in range(5):
            publisher.publish(topic, b"%d" % number, 1)
        pending = subscriber.expect(2)
        subscriber.quiet()
        payloads = [m.payload for m in pending]
        while pending:
            subscriber.ack(pending.pop(0))
            if len(payloads) < 5:
                pending += subscriber.expect(1)
                payloads.append(pending[-1].payload)
            subscriber.quiet(0.1)
        assert payloads == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        subscriber.stop()
        publisher.stop()
