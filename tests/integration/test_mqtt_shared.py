"""Shared subscriptions `$share/{group}/{filter}` (MQTT 5.0 section 4.8.2)."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable

import pytest
from paho.mqtt.packettypes import PacketTypes

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import Disconnect, Subscribe, SubscriptionOptions
from stratamq.broker.shared.positions import SAVE_INTERVAL
from tests.support.clients import (
    TIMEOUT,
    PahoClient,
    RawClient,
    paho_properties,
    unique,
)


def connected(broker: BrokerProcess, clients: list[PahoClient], version: int = 5, *,
              manual_ack: bool = False) -> PahoClient:
    client = PahoClient(broker.port, unique("c"), version=version, manual_ack=manual_ack)
    assert client.connect().reason_code == 0
    clients.append(client)
    return client


def test_each_message_goes_to_one_member_of_each_group(broker: BrokerProcess,
                                                       clients: list[PahoClient]) -> None:
    root = unique("sh")
    group_a = [connected(broker, clients, version) for version in (5, 5, 4)]
    for member in group_a:
        assert member.subscribe(f"$share/a/{root}/+", 1) == [1]
    group_b = [connected(broker, clients) for _ in range(2)]
    for member in group_b:
        member.subscribe(f"$share/b/{root}/#", 1)
    plain = connected(broker, clients)
    plain.subscribe(f"{root}/#", 1)
    publisher = connected(broker, clients)
    sent = [b"%d" % n for n in range(24)]
    for payload in sent:
        publisher.publish(f"{root}/t", payload, 1)

    assert sorted(m.payload for m in plain.expect(24)) == sorted(sent)
    for group in (group_a, group_b):
        shares = drain(group, len(sent))
        assert sorted(p for share in shares for p in share) == sorted(sent)  # once per group
        for member in group:
            member.quiet(0.1)


def drain(members: list[PahoClient], count: int) -> list[list[bytes]]:
    """`count` messages from whichever members get them: the payloads per member."""
    shares: list[list[bytes]] = [[] for _ in members]
    deadline = time.monotonic() + TIMEOUT
    while sum(map(len, shares)) < count and time.monotonic() < deadline:
        for member, share in zip(members, shares, strict=True):
            with contextlib.suppress(queue.Empty):
                share.append(bytes(member.messages.get(timeout=0.01).payload))
    return shares


def test_every_member_gets_a_share(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("share")
    members = [connected(broker, clients) for _ in range(3)]
    for member in members:
        member.subscribe(f"$share/g/{topic}", 1)
    publisher = connected(broker, clients)
    for number in range(30):
        publisher.publish(topic, b"%d" % number, 1)
    shares = drain(members, 30)
    assert sorted(p for share in shares for p in share) == sorted(b"%d" % n for n in range(30))
    assert all(shares), shares  # round robin: nobody is left out


def test_in_flight_messages_of_a_leaving_member_go_to_another(broker: BrokerProcess,
                                                              clients: list[PahoClient]) -> None:
    topic = unique("leave")
    leaving = connected(broker, clients, manual_ack=True)  # receives, never acknowledges
    staying = connected(broker, clients)
    for member in (leaving, staying):
        member.subscribe(f"$share/workers/{topic}", 1)
    publisher = connected(broker, clients)
    sent = [b"job%d" % n for n in range(6)]
    for payload in sent:
        publisher.publish(topic, payload, 1)
    # the members share the messages: the leaving one holds its part unacknowledged
    held, passed = drain([leaving, staying], len(sent))
    assert sorted(held + passed) == sorted(sent)
    assert held
    leaving.disconnect()
    # the staying member gets the held part now
    assert sorted(m.payload for m in staying.expect(len(held))) == sorted(held)
    staying.quiet()


def test_retained_messages_are_not_sent_to_shared_subscriptions(
        broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("shr")
    publisher = connected(broker, clients)
    publisher.publish(topic, b"retained", 1, retain=True)
    member = connected(broker, clients)
    member.subscribe(f"$share/g/{topic}", 1)
    member.quiet()
    publisher.publish(topic, b"", 1, retain=True)
    assert member.expect(1)[0].payload == b""


def test_no_local_on_a_shared_subscription_is_a_protocol_error(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("nl"))
    client.send(Subscribe(1, [(f"$share/g/{unique('nl')}", SubscriptionOptions(1, True))]))
    assert [p.reason_code for p in client.wait_closed() if isinstance(p, Disconnect)] == [0x82]


def saved_away(broker: BrokerProcess) -> set[str]:
    """The members away that the site's stored records of its groups name."""
    return {client for group in broker.shared_groups() for client in group["saved_away"] or []}


@pytest.mark.parametrize("while_away", ["nothing", "restart", "kill -9"])
def test_a_group_whose_only_member_is_away_keeps_its_messages(
        broker_factory: Callable[..., BrokerProcess], clients: list[PahoClient],
        while_away: str) -> None:
    """The only member of a group, a session kept across disconnects with receive
    maximum 1, holds one message unacknowledged and has the rest queued when it goes
    (it disconnects, or the site restarts under it, or the site is killed); more are
    published while it is away. Back, it gets every one, at least once. (The group
    used to go with its last connection, and start again from the live feed: all 40
    were lost.)"""
    broker = broker_factory()
    topic = unique("away")
    client_id = unique("member")
    keep_session = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=3600,
                                   ReceiveMaximum=1)
    member = PahoClient(broker.port, client_id, manual_ack=True)
    clients.append(member)
    assert member.connect(clean_start=False, properties=keep_session).reason_code == 0
    assert member.subscribe(f"$share/g/{topic}/#", 1) == [1]
    publisher = connected(broker, clients)
    for number in range(20):
        publisher.publish(f"{topic}/{number % 3}", b"%d" % number, 1)
    first = member.expect(1)[0]  # never acknowledged
    if while_away == "nothing":
        member.disconnect()
    elif while_away == "restart":
        assert broker.stop() == 0
        broker.start()
    else:
        # Killed once the site has saved the group with this member: any position
        # saved since it subscribed is at or before its first message.
        deadline = time.monotonic() + TIMEOUT
        while client_id not in saved_away(broker):
            assert time.monotonic() < deadline, f"never saved: {broker.shared_groups()}"
            time.sleep(SAVE_INTERVAL / 10)
        broker.kill()
        broker.start()
    member.stop()
    publisher = connected(broker, clients)
    for number in range(20, 40):
        publisher.publish(f"{topic}/{number % 3}", b"%d" % number, 1)

    back = PahoClient(broker.port, client_id)
    clients.append(back)
    connack = back.connect(clean_start=False, properties=keep_session)
    assert (connack.reason_code, connack.session_present) == (0, True)
    # at least once: the one sent and not acknowledged comes again
    got = [int(message.payload) for message in back.expect(40, timeout=2 * TIMEOUT)]
    assert sorted(got) == list(range(40)), (int(first.payload), got)
