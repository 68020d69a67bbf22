"""A `deny subscribe` rule must hold for every topic it names, whatever filter reaches
it (docs/architecture.md, guarantee 5): a user denied `secret/#` who subscribes `#` or `+/x` must
never receive a message published on `secret/...`, live, retained or replayed from
storage into a durable session.

Whether the broker refuses the wide filter in its SUBACK or grants it and filters at
delivery is the fix's choice; these tests only look at what arrives. Every test ends
with a marker on an allowed topic that the user subscribes to exactly, published after
the secret ones by the same publisher, so "the secret did not arrive" is checked after
the broker has demonstrably delivered what came later."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import yaml
from paho.mqtt.packettypes import PacketTypes

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.auth.passwords import set_password
from tests.support.clients import (
    QUIET,
    PahoClient,
    paho_properties,
    unique,
)

RULES = [
    {"permission": "deny", "action": "subscribe", "username": "bob", "topics": ["secret/#"]},
]


def access_config(workdir: Path, rules: list[dict[str, Any]]) -> dict[str, Any]:
    passwords = workdir / "passwd"
    for user in ("alice", "bob"):
        set_password(passwords, user, f"{user}-secret", "pbkdf2", iterations=1000)
    acl = workdir / "acl.yaml"
    acl.write_text(yaml.safe_dump(rules))
    return {"access_control": {"allow_anonymous": False, "password_file": str(passwords),
                               "acl_file": str(acl), "acl_no_match": "allow"}}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    workdir = tmp_path_factory.mktemp("acl-wild")
    with running_broker(workdir, access_config(workdir, RULES)) as process:
        yield process


def login(broker: BrokerProcess, clients: list[PahoClient], user: str, *, version: int = 5,
          client_id: str | None = None, durable: bool = False) -> PahoClient:
    client = PahoClient(broker.port, client_id or unique(user), version=version,
                        clean_session=None if version == 5 else not durable)
    client.client.username_pw_set(user, f"{user}-secret")
    clients.append(client)
    properties = (paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=300)
                  if durable and version == 5 else None)
    assert client.connect(clean_start=not durable, properties=properties).reason_code == 0
    return client


def no_secret(messages: list[mqtt.MQTTMessage]) -> list[str]:
    return [m.topic for m in messages if m.topic.startswith("secret/")]


def received_through(client: PahoClient, marker_topic: str) -> list[mqtt.MQTTMessage]:
    """Everything up to the marker, and whatever else arrives within QUIET after it
    (the marker itself may come twice: through the exact and the wide filter)."""
    got: list[mqtt.MQTTMessage] = []
    while not any(m.topic == marker_topic for m in got):
        got.extend(client.expect(1))
    while True:
        try:
            got.append(client.messages.get(timeout=QUIET))
        except queue.Empty:
            return got


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("wide_filter", ["#", "+/x", "+/+", "+/#"])
def test_denied_topic_never_arrives_through_a_wider_filter(
        broker: BrokerProcess, clients: list[PahoClient], version: int,
        wide_filter: str) -> None:
    marker = unique("marker")
    bob = login(broker, clients, "bob", version=version)
    bob.subscribe(wide_filter, 1)  # granted or refused: the fix decides
    bob.subscribe(f"open/{marker}", 1)
    alice = login(broker, clients, "alice")
    assert alice.publish("secret/x", b"classified", 1) == 0
    assert alice.publish(f"open/{marker}", b"marker", 1) == 0
    got = received_through(bob, f"open/{marker}")
    assert no_secret(got) == [], (
        f"bob is denied secret/# but received {no_secret(got)} through {wide_filter!r}")


def test_overlapping_wide_filters_deliver_no_copy(broker: BrokerProcess,
                                                  clients: list[PahoClient]) -> None:
    """The report: `#` and `+/x` together gave bob two copies of `secret/x`."""
    marker = unique("marker")
    bob = login(broker, clients, "bob")
    bob.subscribe("#", 1)
    bob.subscribe("+/x", 1)
    bob.subscribe(f"open/{marker}", 1)
    alice = login(broker, clients, "alice")
    assert alice.publish("secret/x", b"classified", 1) == 0
    assert alice.publish(f"open/{marker}", b"marker", 1) == 0
    got = received_through(bob, f"open/{marker}")
    assert no_secret(got) == []


def test_denied_retained_message_is_not_sent_on_a_wide_subscription(
        broker: BrokerProcess, clients: list[PahoClient]) -> None:
    level = unique("r")
    alice = login(broker, clients, "alice")
    assert alice.publish(f"secret/{level}", b"retained secret", 1, retain=True) == 0
    assert alice.publish(f"open/{level}", b"retained open", 1, retain=True) == 0
    bob = login(broker, clients, "bob")
    bob.subscribe(f"+/{level}", 1)
    bob.subscribe(f"open/{level}", 1)  # the marker: at least this retained copy comes
    got = received_through(bob, f"open/{level}")
    assert no_secret(got) == []
    # clean up the retained messages for the other tests
    alice.publish(f"secret/{level}", b"", 1, retain=True)
    alice.publish(f"open/{level}", b"", 1, retain=True)


def test_denied_topic_is_not_replayed_into_a_durable_session(
        broker: BrokerProcess, clients: list[PahoClient]) -> None:
    """Messages stored while the session was away reach it from storage, not from
    the live feed: the rule must hold on that path too."""
    marker = unique("marker")
    client_id = unique("bob-durable")
    bob = login(broker, clients, "bob", client_id=client_id, durable=True)
    bob.subscribe("#", 1)
    bob.subscribe(f"open/{marker}", 1)
    bob.disconnect()
    alice = login(broker, clients, "alice")
    assert alice.publish("secret/x", b"classified", 1) == 0
    assert alice.publish(f"open/{marker}", b"marker", 1) == 0
    bob = login(broker, clients, "bob", client_id=client_id, durable=True)
    got = received_through(bob, f"open/{marker}")
    assert no_secret(got) == []


def test_denied_topic_never_reaches_a_shared_subscription(
        broker: BrokerProcess, clients: list[PahoClient]) -> None:
    marker = unique("marker")
    bob = login(broker, clients, "bob")
    bob.subscribe(f"$share/{unique('g')}/#", 1)
    bob.subscribe(f"open/{marker}", 1)
    alice = login(broker, clients, "alice")
    assert alice.publish("secret/x", b"classified", 1) == 0
    assert alice.publish(f"open/{marker}", b"marker", 1) == 0
    got = received_through(bob, f"open/{marker}")
    assert no_secret(got) == []


def test_resumed_subscriptions_are_checked_against_the_rules_of_now(
        tmp_path: Path, clients: list[PahoClient]) -> None:
    """A durable session keeps its subscriptions across a restart; when the rules
    changed meanwhile, what they now deny is not delivered through them."""
    config = access_config(tmp_path, [])
    marker = unique("marker")
    client_id = unique("bob-durable")
    with running_broker(tmp_path, config) as process:
        bob = login(process, clients, "bob", client_id=client_id, durable=True)
        bob.subscribe("#", 1)
        bob.subscribe(f"open/{marker}", 1)
        bob.disconnect()
        assert process.stop() == 0
        (tmp_path / "acl.yaml").write_text(yaml.safe_dump([
            {"permission": "deny", "action": "subscribe", "username": "bob",
             "topics": ["eq #"]}]))
        process.start()
        alice = login(process, clients, "alice")
        assert alice.publish("other/x", b"not through #", 1) == 0
        assert alice.publish(f"open/{marker}", b"marker", 1) == 0
        bob = login(process, clients, "bob", client_id=client_id, durable=True)
        got = received_through(bob, f"open/{marker}")
        assert [(m.topic, m.payload) for m in got] == [(f"open/{marker}", b"marker")]
