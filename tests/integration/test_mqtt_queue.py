"""The queue of a transient session is bounded (`mqtt.max_queued_messages`): when it is
full, queued QoS 0 messages are dropped first (counted); QoS 1/2 messages that still
find no room are read from storage later, never dropped. So are those of a shared
group whose members' queues are all full."""

from __future__ import annotations

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import Properties, Puback, Publish
from tests.support.clients import PahoClient, RawClient, metric_value, unique

MAX_QUEUED = 10


BROKER_CONFIG = {"mqtt": {"max_queued_messages": MAX_QUEUED}}


def acknowledge_in_order(client: RawClient, expected: list[bytes]) -> None:
    """Receive the QoS 1 messages `expected`, in this order, acknowledging each after
    it came (one at a time, for a client with a receive maximum of 1)."""
    for payload in expected:
        packet = client.expect(Publish)
        assert packet.payload == payload
        assert packet.packet_id is not None
        client.send(Puback(packet.packet_id))
    client.quiet()


def test_full_queue_drops_qos0_first(broker: BrokerProcess) -> None:
    topic = unique("q")
    dropped_before = metric_value(broker, "stratamq_messages_dropped_total",
                                  reason="queue_full")
    # one message in flight at a time, and the client does not acknowledge it yet
    subscriber = RawClient(broker.port)
    subscriber.connect(unique("slow"), properties=Properties(receive_maximum=1))
    subscriber.subscribe(topic, 1)
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        publisher.connect()
        publisher.publish(topic, b"in flight", 1)
        publisher.publish(topic, b"head", 1)  # queued: waits for the window
        for number in range(5):
            publisher.publish(topic, b"qos0-%d" % number, 0)  # queued behind it
        # 4 more fill the queue (10); each of the next 5 pushes a QoS 0 message out;
        # the last 2 find nothing to push out and come from storage, after the others
        for number in range(11):
            publisher.publish(topic, b"qos1-%d" % number, 1)

        acknowledge_in_order(subscriber, [b"in flight", b"head"]
                             + [b"qos1-%d" % n for n in range(11)])
    finally:
        publisher.stop()
    subscriber.disconnect()
    assert metric_value(broker, "stratamq_messages_dropped_total",
                        reason="queue_full") - dropped_before == 5


def test_queue_is_free_again_after_it_drained(broker: BrokerProcess) -> None:
    topic = unique("q2")
    subscriber = PahoClient(broker.port, unique("sub"))
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        subscriber.connect()
        subscriber.subscribe(topic, 1)
        publisher.connect()
        for round_ in range(3):  # more than the queue holds, in rounds it can take
            for number in range(MAX_QUEUED):
                publisher.publish(topic, b"%d-%d" % (round_, number), 1)
            got = [m.payload for m in subscriber.expect(MAX_QUEUED)]
            assert got == [b"%d-%d" % (round_, n) for n in range(MAX_QUEUED)]
    finally:
        subscriber.stop()
        publisher.stop()


def test_a_shared_group_with_full_queues_gets_its_qos1_messages_from_storage(
        broker: BrokerProcess) -> None:
    topic = unique("qs")
    dropped_before = metric_value(broker, "stratamq_messages_dropped_total",
                                  reason="queue_full")
    member = RawClient(broker.port)  # one message in flight, acknowledged late
    member.connect(unique("slow"), properties=Properties(receive_maximum=1))
    member.subscribe(f"$share/g/{topic}", 1)
    publisher = PahoClient(broker.port, unique("pub"))
    try:
        publisher.connect()
        sent = [b"m%d" % n for n in range(3 * MAX_QUEUED)]
        for payload in sent:  # 1 in flight, 10 queued: 19 find no room
            publisher.publish(topic, payload, 1)
        acknowledge_in_order(member, sent)
    finally:
        publisher.stop()
    member.disconnect()
    assert metric_value(broker, "stratamq_messages_dropped_total",
                        reason="queue_full") == dropped_before
