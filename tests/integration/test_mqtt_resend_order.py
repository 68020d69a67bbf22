"""Unacknowledged messages are resent in the order they were first sent, also when
they come from different streams (topics), after a reconnect and after `kill -9`
(MQTT-4.6.0-1)."""

from __future__ import annotations

import time
from pathlib import Path

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import Properties, Publish
from tests.support.clients import PahoClient, RawClient

DURABLE = Properties(session_expiry_interval=600, receive_maximum=100)
TOPICS = ("order/a", "order/b", "order/c")


def receive_publishes(client: RawClient, count: int) -> list[Publish]:
    got = [client.expect(Publish) for _ in range(count)]
    return got


def test_resend_keeps_the_first_sending_order_across_streams(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path).start()
    try:
        subscriber = RawClient(broker.port)
        subscriber.connect("orderly", clean_start=False, properties=DURABLE)
        subscriber.subscribe("order/#", 1)

        # Delivered live, so in publish order: the three topics (three streams)
        # interleave. Replaying stream by stream would give another order.
        publisher = PahoClient(broker.port, "order-pub")
        publisher.connect()
        for number in range(30):
            assert publisher.publish(TOPICS[number % 3], b"%d" % number, 1) == 0
        publisher.client.disconnect()
        publisher.client.loop_stop()
        first = receive_publishes(subscriber, 30)  # none acknowledged
        first_order = [(p.topic, p.payload) for p in first]
        assert [payload for _t, payload in first_order] == [b"%d" % n for n in range(30)]
        subscriber.close()

        subscriber = RawClient(broker.port)
        subscriber.connect("orderly", clean_start=False, properties=DURABLE)
        again = receive_publishes(subscriber, 30)
        assert [(p.topic, p.payload) for p in again] == first_order
        assert all(p.dup for p in again)
        assert [p.packet_id for p in again] == [p.packet_id for p in first]
        time.sleep(0.3)  # the session's record catches up with what was sent
        subscriber.close()

        broker.kill()
        broker.start()
        subscriber = RawClient(broker.port)
        subscriber.connect("orderly", clean_start=False, properties=DURABLE)
        after_crash = receive_publishes(subscriber, 30)
        assert [(p.topic, p.payload) for p in after_crash] == first_order
        assert [p.packet_id for p in after_crash] == [p.packet_id for p in first]
        subscriber.close()
    finally:
        broker.kill()
