"""The first message on a topic nobody published to before reaches every live matching
subscription straight from the commit feed, durable and clean sessions alike: it does
not wait for the periodic stream discovery (`durable_sessions.renew_streams_interval`,
here an hour, so a delivery can only come from the feed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import MQTT_5, Properties, Puback, Publish
from tests.support.clients import RawClient, unique

WAIT = 10.0  # generous: the feed delivers in milliseconds; an hour is what is ruled out
TOPICS = 5


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path,
                        {"durable_sessions": {"renew_streams_interval": "1h"}}) as process:
        yield process


def received(client: RawClient, count: int) -> list[str]:
    topics: list[str] = []
    try:
        for _ in range(count):
            packet = client.expect(Publish, WAIT)
            assert packet.packet_id is not None
            client.send(Puback(packet.packet_id))
            topics.append(packet.topic)
    except TimeoutError:
        pass
    return topics


@pytest.mark.parametrize("session", ["durable", "durable-resumed", "durable-restarted",
                                     "clean"])
def test_first_message_on_a_new_topic_arrives_from_the_feed(broker: BrokerProcess,
                                                            session: str) -> None:
    prefix = unique("P")
    durable = session != "clean"
    client_id = unique("sub")
    subscriber = RawClient(broker.port, MQTT_5)
    properties = Properties(session_expiry_interval=3600) if durable else None
    subscriber.connect(client_id, clean_start=not durable, properties=properties)
    assert subscriber.subscribe(f"{prefix}/+/t", 1).reason_codes == [1]
    if session != "durable" and durable:
        subscriber.disconnect()
        if session == "durable-restarted":
            assert broker.stop() == 0
            broker.start()
        subscriber = RawClient(broker.port, MQTT_5)
        assert subscriber.connect(client_id, clean_start=False,
                                  properties=properties).session_present

    publisher = RawClient(broker.port, MQTT_5)
    publisher.connect(unique("pub"))
    topics = [f"{prefix}/{level}/t" for level in range(TOPICS)]
    for number, topic in enumerate(topics, 1):
        ack = publisher.publish(topic, b"first", 1, packet_id=number)
        assert isinstance(ack, Puback) and ack.reason_code == 0
    publisher.disconnect()

    assert sorted(received(subscriber, TOPICS)) == topics
    subscriber.disconnect()
