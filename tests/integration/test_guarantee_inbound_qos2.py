"""An inbound QoS 2 PUBLISH is stored once (MQTT-4.3.3, "exactly once"), also when
its resend (DUP=1, same packet identifier) reaches the broker before the store of the
first copy has completed: in the same TCP segment, or on a new connection of the same
session after the first one closed at once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import MQTT_5, Properties, Pubcomp, Publish, Pubrec, Pubrel, encode
from tests.support.clients import QUIET, RawClient, unique


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path) as process:
        yield process


def durable_client(broker: BrokerProcess, client_id: str, resume: bool) -> RawClient:
    client = RawClient(broker.port, MQTT_5)
    connack = client.connect(client_id, clean_start=False,
                             properties=Properties(session_expiry_interval=3600))
    assert (connack.reason_code, connack.session_present) == (0, resume)
    return client


def received_publishes(subscriber: RawClient) -> list[bytes]:
    """Everything the subscriber gets until it is quiet, each QoS 2 exchange
    completed, resends of one packet id (DUP) counted once: what its application sees."""
    delivered: list[bytes] = []
    awaiting_pubrel: set[int] = set()
    with contextlib.suppress(TimeoutError):
        for _ in range(100):  # bounded: far more than any correct run sends
            packet = subscriber.recv(QUIET * 3)
            if isinstance(packet, Publish):
                assert packet.packet_id is not None
                if packet.packet_id not in awaiting_pubrel:
                    delivered.append(packet.payload)
                awaiting_pubrel.add(packet.packet_id)
                subscriber.send(Pubrec(packet.packet_id))
            elif isinstance(packet, Pubrel):
                awaiting_pubrel.discard(packet.packet_id)
                subscriber.send(Pubcomp(packet.packet_id))
    return delivered


def subscriber_for(broker: BrokerProcess, topic: str) -> RawClient:
    subscriber = RawClient(broker.port, MQTT_5)
    subscriber.connect(unique("reader"))
    assert subscriber.subscribe(topic, 2).reason_codes == [2]
    return subscriber


def test_resend_in_the_same_segment_is_stored_once(broker: BrokerProcess) -> None:
    topic = unique("segment") + "/t"
    subscriber = subscriber_for(broker, topic)
    publisher = durable_client(broker, unique("writer"), resume=False)
    first = Publish(topic, b"exactly once", 2, packet_id=1)
    resend = Publish(topic, b"exactly once", 2, dup=True, packet_id=1)
    # One write: the broker reads both before the first one's store has completed.
    publisher.send_bytes(encode(first, MQTT_5) + encode(resend, MQTT_5))
    assert publisher.expect(Pubrec).packet_id == 1
    assert publisher.expect(Pubrec).packet_id == 1
    publisher.send(Pubrel(1))
    assert publisher.expect(Pubcomp).reason_code == 0
    publisher.disconnect()

    assert received_publishes(subscriber) == [b"exactly once"]
    subscriber.disconnect()


def test_resend_after_the_connection_closed_at_once_is_stored_once(
        broker: BrokerProcess) -> None:
    topic = unique("closed") + "/t"
    subscriber = subscriber_for(broker, topic)
    publisher_id = unique("writer")
    publisher = durable_client(broker, publisher_id, resume=False)
    # PUBLISH and gone: the connection closes while the store is under way.
    publisher.send(Publish(topic, b"exactly once", 2, packet_id=1))
    publisher.close()

    again = durable_client(broker, publisher_id, resume=True)
    again.send(Publish(topic, b"exactly once", 2, dup=True, packet_id=1))
    assert again.expect(Pubrec).packet_id == 1
    again.send(Pubrel(1))
    assert again.expect(Pubcomp).reason_code == 0
    again.disconnect()

    assert received_publishes(subscriber) == [b"exactly once"]
    subscriber.disconnect()
