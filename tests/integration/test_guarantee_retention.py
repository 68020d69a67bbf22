"""Retention that drops a generation an offline durable session has not read yet loses
those messages (a message lives between one and two `message_retention_period`s),
but never silently: the loss is logged, counted in
`stratamq_session_messages_expired_total{reason="retention"}`, and the session's state
of that generation is pruned, so the session resumes and keeps working (later
messages arrive, no resend of a message that is gone)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import MQTT_5, Properties, Puback, Publish
from tests.support.clients import (
    RawClient,
    generations,
    metric_value,
    unique,
)

RETENTION = "2s"
LOST = 5


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path, {"durable_sessions":
                                   {"message_retention_period": RETENTION}}) as process:
        yield process


def connect(broker: BrokerProcess, client_id: str, resume: bool) -> RawClient:
    client = RawClient(broker.port, MQTT_5)
    connack = client.connect(client_id, clean_start=False,
                             properties=Properties(session_expiry_interval=3600))
    assert (connack.reason_code, connack.session_present) == (0, resume)
    return client


def publish(broker: BrokerProcess, topic: str, payloads: list[bytes]) -> None:
    publisher = RawClient(broker.port, MQTT_5)
    publisher.connect(unique("pub"))
    for number, payload in enumerate(payloads, 1):
        ack = publisher.publish(topic, payload, 1, packet_id=number)
        assert isinstance(ack, Puback) and ack.reason_code == 0
    publisher.disconnect()


def expired_by_retention(broker: BrokerProcess) -> float:
    return metric_value(broker, "stratamq_session_messages_expired_total", reason="retention")


def wait_until_dropped(broker: BrokerProcess, generation: int) -> None:
    """Until no shard has `generation` or an older one any more."""
    deadline = time.monotonic() + 30
    while min(min(ids) for ids in generations(broker).values()) <= generation:
        assert time.monotonic() < deadline, f"generation {generation} was never dropped"
        time.sleep(0.2)


@pytest.mark.parametrize("unacknowledged", [False, True],
                         ids=["never-sent", "sent-not-acknowledged"])
def test_retention_loss_is_counted_logged_and_the_session_goes_on(
        broker: BrokerProcess, unacknowledged: bool) -> None:
    client_id = unique("retained")
    topic = unique("ret") + "/t"
    client = connect(broker, client_id, resume=False)
    assert client.subscribe(topic, 1).reason_codes == [1]
    if not unacknowledged:
        client.disconnect()
    expired_before = expired_by_retention(broker)
    doomed = [b"doomed-%d" % n for n in range(LOST)]
    publish(broker, topic, doomed)
    # read after publishing: a rollover in between only makes the wait longer
    generation = max(max(ids) for ids in generations(broker).values())
    if unacknowledged:
        # received, never acknowledged: the session holds their packet ids for a resend
        assert [client.expect(Publish).payload for _ in doomed] == doomed
        client.close()
    wait_until_dropped(broker, generation)

    client = connect(broker, client_id, resume=True)
    later = [b"later-%d" % n for n in range(3)]
    publish(broker, topic, later)
    got = []
    for _ in later:
        packet = client.expect(Publish)
        assert packet.packet_id is not None
        client.send(Puback(packet.packet_id))
        got.append(packet.payload)
    assert got == later  # nothing of the dropped generation, not even a resend
    client.quiet()
    client.disconnect()

    assert expired_by_retention(broker) - expired_before == LOST
    lines = [line for line in broker.log().splitlines()
             if client_id in line and "retention" in line]
    assert lines, "the loss of the session's messages was not logged"
