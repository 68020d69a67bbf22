"""Durable sessions across broker restarts and `kill -9` (docs/architecture.md
"Guarantees" 1 and 2): every message the publisher got a PUBACK for reaches a
durable subscriber, however long it was away; what it did not acknowledge comes again
with DUP and its packet identifier; a QoS 2 message past PUBREC is never published again."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

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
from tests.support.clients import QUIET, RawClient, unique

TOPIC = "plant/line1/temp"


@pytest.fixture
def broker(broker_factory: Callable[..., BrokerProcess]) -> BrokerProcess:
    """A site of each test's own: the tests restart it."""
    return broker_factory()


def restart(broker: BrokerProcess, how: str) -> None:
    if how == "kill":
        broker.kill()
    else:
        assert broker.stop() == 0
    broker.start()


def durable(broker: BrokerProcess, level: int, client_id: str, *, resume: bool) -> RawClient:
    """A durable session: clean start 0 and session expiry on MQTT 5, clean session 0
    on 3.1.1 (its session never expires)."""
    client = RawClient(broker.port, level)
    properties = Props(session_expiry_interval=3600) if level == MQTT_5 else None
    connack = client.connect(client_id, clean_start=False, properties=properties)
    assert (connack.reason_code, connack.session_present) == (0, resume)
    return client


def publish_all(broker: BrokerProcess, payloads: list[bytes], qos: int = 1) -> None:
    publisher = RawClient(broker.port)
    publisher.connect(unique("pub"))
    for number, payload in enumerate(payloads, 1):
        ack = publisher.publish(TOPIC, payload, qos, packet_id=number)
        assert isinstance(ack, Puback | Pubcomp) and ack.reason_code == 0
    publisher.disconnect()


def receive(client: RawClient, count: int) -> list[Publish]:
    return [client.expect(Publish) for _ in range(count)]


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_durable_sessions_resume_with_every_unacknowledged_message(broker: BrokerProcess,
                                                                   how: str) -> None:
    ids = {level: unique(f"durable{level}") for level in (MQTT_3_1_1, MQTT_5)}
    first = {}
    for level, client_id in ids.items():
        client = durable(broker, level, client_id, resume=False)
        client.subscribe("plant/#", 1)
        first[level] = client
    publish_all(broker, [b"m0", b"m1", b"m2"])
    sent = {}
    for level, client in first.items():
        sent[level] = receive(client, 3)
        assert [p.payload for p in sent[level]] == [b"m0", b"m1", b"m2"]
        packet_id = sent[level][0].packet_id
        assert packet_id is not None
        client.send(Puback(packet_id))  # m0 is done; m1 and m2 are not acknowledged
        client.disconnect()
    # published while the subscribers are away, acknowledged, then the broker goes down
    away = [b"away%d" % n for n in range(20)]
    publish_all(broker, away)
    restart(broker, how)

    for level, client_id in ids.items():
        client = durable(broker, level, client_id, resume=True)
        got = receive(client, 22)
        # the two publishers' messages may interleave: order holds per publisher
        assert [(p.payload, p.packet_id) for p in got if p.dup] == [
            (b"m1", sent[level][1].packet_id), (b"m2", sent[level][2].packet_id)]
        assert [p.payload for p in got if not p.dup] == away
        for packet in got:
            assert packet.packet_id is not None
            client.send(Puback(packet.packet_id))
        client.quiet()
        client.disconnect()
        durable(broker, level, client_id, resume=True).quiet()


def test_kill_while_connected_redelivers_what_was_not_acknowledged(
        broker: BrokerProcess) -> None:
    client_id = unique("connected")
    client = durable(broker, MQTT_5, client_id, resume=False)
    client.subscribe("plant/#", 1)
    publish_all(broker, [b"a", b"b", b"c"])
    got = receive(client, 3)
    assert got[0].packet_id is not None
    client.send(Puback(got[0].packet_id))
    client.quiet(0.2)  # the acknowledgement is processed (and persisted soon after)
    broker.kill()
    client.close()
    broker.start()
    again = durable(broker, MQTT_5, client_id, resume=True)
    redelivered: list[bytes] = []
    while not redelivered or redelivered[-1] != b"c":
        packet = again.expect(Publish)
        redelivered.append(packet.payload)
        assert packet.packet_id is not None
        again.send(Puback(packet.packet_id))
    # "a" was acknowledged; had the broker died before it wrote that down, sending it
    # again is still at least once
    assert redelivered in ([b"b", b"c"], [b"a", b"b", b"c"])
    again.quiet()
    again.disconnect()


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_qos2_past_pubrec_is_not_published_again(broker: BrokerProcess, how: str) -> None:
    client_id = unique("exactly")
    client = durable(broker, MQTT_5, client_id, resume=False)
    client.subscribe("plant/#", 2)
    publish_all(broker, [b"once", b"pending"], qos=2)
    once, pending = receive(client, 2)
    assert once.packet_id is not None and pending.packet_id is not None
    client.send(Pubrec(once.packet_id))
    assert client.expect(Pubrel).packet_id == once.packet_id  # PUBREC is stored by now
    restart(broker, how)
    client.close()

    again = durable(broker, MQTT_5, client_id, resume=True)
    packets = [again.recv() for _ in range(2)]
    assert [p.packet_id for p in packets if isinstance(p, Pubrel)] == [once.packet_id]
    assert [(p.payload, p.dup, p.packet_id) for p in packets if isinstance(p, Publish)] == [
        (b"pending", True, pending.packet_id)]
    again.send(Pubcomp(once.packet_id))
    again.send(Pubrec(pending.packet_id))
    assert again.expect(Pubrel).packet_id == pending.packet_id
    again.send(Pubcomp(pending.packet_id))
    again.quiet()
    again.disconnect()
    durable(broker, MQTT_5, client_id, resume=True).quiet()


@pytest.mark.parametrize("how", ["reconnect", "kill"])
def test_inbound_qos2_resent_after_pubrec_is_stored_once(broker: BrokerProcess,
                                                         how: str) -> None:
    subscriber_id = unique("reader")
    subscriber = durable(broker, MQTT_5, subscriber_id, resume=False)
    subscriber.subscribe("plant/#", 2)
    publisher_id = unique("writer")
    publisher = durable(broker, MQTT_5, publisher_id, resume=False)
    publisher.send(Publish(TOPIC, b"exactly once", 2, packet_id=5))
    assert publisher.expect(Pubrec).packet_id == 5  # stored, and its packet id with it
    message = subscriber.expect(Publish)
    assert message.payload == b"exactly once" and message.packet_id is not None
    subscriber.send(Pubrec(message.packet_id))
    subscriber.expect(Pubrel)
    subscriber.send(Pubcomp(message.packet_id))
    subscriber.close()
    if how == "kill":
        broker.kill()
        broker.start()
    publisher.close()  # the PUBREL never went out

    again = durable(broker, MQTT_5, publisher_id, resume=True)
    again.send(Publish(TOPIC, b"exactly once", 2, dup=True, packet_id=5))
    assert again.expect(Pubrec).packet_id == 5
    again.send(Pubrel(5))
    assert again.expect(Pubcomp).packet_id == 5
    again.disconnect()
    reader = durable(broker, MQTT_5, subscriber_id, resume=True)
    later: list[object] = []
    with contextlib.suppress(TimeoutError):
        while True:  # a PUBREL may come again (its PUBCOMP is persisted lazily)
            packet = reader.recv(QUIET)
            later.append(packet)
            if isinstance(packet, Pubrel):
                reader.send(Pubcomp(packet.packet_id))
    assert not [p for p in later if isinstance(p, Publish)]
    reader.disconnect()
