"""Crash safety of the broker (docs/architecture.md "Guarantees" 1 and 2).

The main test: publishers stream numbered QoS 1 and QoS 2 messages, a durable
subscriber acknowledges them late, and the broker is SIGKILLed and restarted on the
same data directory several times meanwhile. Afterwards every message whose
PUBACK/PUBCOMP a publisher received reached the subscriber's application at least once,
QoS 2 ones exactly once, and per publisher, topic and QoS the messages arrived in
publish order (QoS 1 may repeat messages it had delivered before: a redelivery)."""

from __future__ import annotations

import collections
import functools
import random
import time
from collections.abc import Iterable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from harness.processes import BrokerProcess
from harness.waiting import wait_until
from stratamq.broker import mqtt as wire
from stratamq.broker.ds import DbOptions, DurableStorage
from stratamq.broker.mqtt import MQTT_3_1_1, MQTT_5
from tests.integration.crash_clients import (
    DurableSubscriber,
    Numbered,
    PahoClient,
    Publisher,
    RawClient,
)
from tests.support.storage import read_filter, run

KILLS = 4
TOPICS = ["crash/a", "crash/b"]  # both publishers on both topics: their streams interleave
ACK_DELAY = 0.02


def back_online(subscriber: DurableSubscriber, publishers: list[Publisher],
                connects: int) -> bool:
    return subscriber.connects >= connects and all(p.client.is_connected()
                                                   for p in publishers)


def stored_payloads(data_dir: Path, topic_filter: str) -> list[bytes]:
    """Every stored message's payload (read with the broker down)."""

    async def read() -> list[bytes]:
        storage = DurableStorage(data_dir)
        await storage.open_db("messages", DbOptions(n_shards=4))  # the harness's shards
        try:
            stored = await read_filter(storage, "messages", topic_filter, batch_size=1000)
        finally:
            await storage.close()
        return [message.payload for message in stored]

    return run(read())


def order_violations(received: Iterable[Numbered]) -> list[str]:
    """Per (publisher, topic, QoS), first deliveries come in publish order with no gap
    (0, 1, 2, ...): a repeated number (a QoS 1 redelivery; a repeated QoS 2 message is
    reported on its own) never brings a newer message ahead of an older one."""
    by_key: dict[tuple[str, str, int], list[int]] = collections.defaultdict(list)
    for message in received:
        by_key[message.key].append(message.seq)
    problems = []
    for key, seqs in sorted(by_key.items()):
        seen = 0  # the numbers delivered so far: 0 .. seen-1
        for index, seq in enumerate(seqs):
            if seq == seen:
                seen += 1
            elif seq > seen:
                problems.append(f"{key}: {seq} arrived before {seen} "
                                f"(...{seqs[max(index - 5, 0):index + 1]})")
                break
    return problems


@pytest.mark.slow
def test_acknowledged_messages_survive_broker_sigkills(tmp_path: Path) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    broker = BrokerProcess(tmp_path).start()
    subscriber = DurableSubscriber("crash-subscriber", broker.port, "crash/#", ACK_DELAY)
    publishers = [Publisher("crash-p0", broker.port, TOPICS, v5=True),
                  Publisher("crash-p1", broker.port, TOPICS, v5=False)]
    try:
        subscriber.start()
        assert subscriber.subscribed.wait(10), "no SUBACK"
        for publisher in publishers:
            publisher.start()
        for kill in range(KILLS):
            # every client is back (and busy) before the next kill, at a random moment
            assert wait_until(functools.partial(back_online, subscriber, publishers, kill + 1),
                              15), f"clients did not reconnect after kill {kill}"
            time.sleep(rng.uniform(0.2, 1.2))
            broker.kill()
            time.sleep(rng.uniform(0.0, 0.3))
            broker.start()
        time.sleep(1.0)
        for publisher in publishers:
            publisher.stop_publishing()
        # what was in flight is resent and acknowledged once the clients are back
        drained = wait_until(lambda: all(p.unacked() == 0 for p in publishers), 20)
        acknowledged = {m for p in publishers for m in p.acknowledged()}
        delivered = wait_until(lambda: acknowledged <= subscriber.payloads(), 20)
        time.sleep(0.5)  # let redeliveries that are on their way arrive too
    finally:
        subscriber.close()
        for publisher in publishers:
            publisher.close()
        alive = broker.alive()
        broker.kill()

    received = list(subscriber.received)
    context = (f"seed {seed}; published {sum(len(p.sent) for p in publishers)}, "
               f"acknowledged {len(acknowledged)}, delivered {len(received)}, "
               f"subscriber connects {subscriber.connects}")
    assert alive, "the broker died: " + broker.log()[-3000:]
    assert not [p.refused for p in publishers if p.refused], context
    assert drained, f"publishers still wait for acknowledgements: {context}"
    assert subscriber.connects == KILLS + 1, context  # each kill cut the subscriber off

    failures = []
    if subscriber.sessions_lost:
        failures.append(f"{subscriber.sessions_lost} reconnects found no session")
    lost = sorted(acknowledged - set(received))
    if lost or not delivered:
        failures.append(f"{len(lost)} acknowledged messages never delivered: {lost[:5]}")
    twice = sorted(m for m, n in collections.Counter(received).items() if m.qos == 2 and n > 1)
    if twice:
        stored = collections.Counter(stored_payloads(tmp_path / "data", "crash/#"))
        stored_twice = sum(1 for m in twice if stored[m.encode()] > 1)
        failures.append(
            f"{len(twice)} QoS 2 messages delivered more than once "
            f"(by publisher {dict(collections.Counter(m.publisher for m in twice))}; "
            f"{stored_twice} of them stored more than once), e.g. {twice[:5]}")
    failures += order_violations(received)
    assert not failures, "\n".join([context, *failures])


@pytest.mark.parametrize("level", [MQTT_5, MQTT_3_1_1])
def test_packet_id_reused_after_a_crash_is_a_new_message(tmp_path: Path, level: int) -> None:
    """A QoS 2 exchange completes (PUBCOMP received), the broker is killed at once, and
    after the restart the client's next QoS 2 message reuses the packet identifier, as
    it may (MQTT 5 2.2.1): that is a new message, to be stored, not a resend."""
    broker = BrokerProcess(tmp_path).start()
    try:
        client = RawClient(broker.port, level)
        client.connect("reuse-publisher", clean_start=False)
        client.publish_qos2("reuse/t", b"first", packet_id=7)
        broker.kill()  # right after PUBCOMP: within the broker's deferred persist
        client.close()
        broker.start()
        client = RawClient(broker.port, level)
        assert client.connect("reuse-publisher", clean_start=False).session_present
        client.publish_qos2("reuse/t", b"second", packet_id=7)
        client.close()
    finally:
        broker.kill()
    stored = stored_payloads(tmp_path / "data", "reuse/#")
    assert b"second" in stored, f"PUBCOMP received, message not stored: {stored}"


def test_pubrels_after_two_kills_come_in_pubrec_order(tmp_path: Path) -> None:
    """The site-killed-twice history test's order breach, step by step. After the
    first kill the restored session resends its unacknowledged QoS 2 messages under
    their old packet identifiers (3, 4, 5) and numbers new ones from 1 again. The
    client PUBRECs all five; the second kill comes before any PUBCOMP. After it the
    PUBRELs must come in PUBREC order: the client delivers a QoS 2 message at its
    PUBREL, so packet-identifier order would deliver the newer two first."""
    broker = BrokerProcess(tmp_path).start()
    try:
        subscriber = RawClient(broker.port)
        subscriber.connect("pubrel-order", clean_start=False)
        subscriber.send(wire.Subscribe(1, [("q/#", wire.SubscriptionOptions(qos=2))]))
        subscriber.expect(wire.Suback)
        publisher = RawClient(broker.port)
        publisher.connect("pubrel-order-pub", clean_start=True)
        for n in range(5):
            publisher.publish_qos2("q/t", bytes([n]), packet_id=n + 1)
        sent = [subscriber.expect(wire.Publish) for _ in range(5)]
        assert [(p.payload, p.packet_id) for p in sent] == \
            [(bytes([n]), n + 1) for n in range(5)]
        for packet_id in (1, 2):  # the first two complete; 3, 4 and 5 are not acknowledged
            subscriber.send(wire.Pubrec(packet_id))
            assert subscriber.expect(wire.Pubrel).packet_id == packet_id
            subscriber.send(wire.Pubcomp(packet_id))
        time.sleep(0.5)  # the session's deferred write records the completions
        broker.kill()

        broker.start()
        subscriber = RawClient(broker.port)
        assert subscriber.connect("pubrel-order", clean_start=False).session_present
        resent = [subscriber.expect(wire.Publish) for _ in range(3)]
        assert [(p.payload, p.packet_id, p.dup) for p in resent] == \
            [(bytes([n]), n + 1, True) for n in (2, 3, 4)]
        publisher = RawClient(broker.port)
        publisher.connect("pubrel-order-pub", clean_start=True)
        for n in (5, 6):
            publisher.publish_qos2("q/t", bytes([n]), packet_id=n + 1)
        new = [subscriber.expect(wire.Publish) for _ in range(2)]
        assert [(p.payload, p.packet_id) for p in new] == [(bytes([5]), 1), (bytes([6]), 2)]
        for publish in [*resent, *new]:
            subscriber.send(wire.Pubrec(publish.packet_id or 0))
        released = [subscriber.expect(wire.Pubrel).packet_id for _ in range(5)]
        assert released == [3, 4, 5, 1, 2]
        broker.kill()  # no PUBCOMP: all five are past PUBREC, their PUBRELs pending

        broker.start()
        subscriber = RawClient(broker.port)
        assert subscriber.connect("pubrel-order", clean_start=False).session_present
        assert [subscriber.expect(wire.Pubrel).packet_id for _ in range(5)] == \
            [3, 4, 5, 1, 2]
        subscriber.close()
    finally:
        broker.kill()


def test_crash_clients_resend_pubrel_after_failed_reconnect_attempts() -> None:
    """The crash test's paho client keeps a released QoS 2 message at "resend PUBREL"
    however many reconnect attempts fail (paho 2.2 itself turns it into a new PUBLISH
    on the second attempt, which the broker rightly stores again)."""
    client = PahoClient(CallbackAPIVersion.VERSION2, client_id="reset-check",
                        clean_session=False)
    message = mqtt.MQTTMessage(mid=5, topic=b"t")
    message.qos = 2
    message.state = mqtt.mqtt_ms_wait_for_pubcomp
    client._out_messages[5] = message
    for _attempt in range(3):
        client._messages_reconnect_reset_out()
    assert message.state == mqtt.mqtt_ms_resend_pubrel
    assert not message.dup
