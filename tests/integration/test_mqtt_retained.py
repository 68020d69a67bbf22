"""Retained messages (MQTT 5.0 sections 3.3.1.3 and 3.8.3.1; MQTT 3.1.1 section 3.3.1.3)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.subscribeoptions import SubscribeOptions

from harness.processes import BrokerProcess, running_broker
from tests.support.clients import (
    PahoClient,
    paho_properties,
    prop,
    unique,
)


def connected(broker: BrokerProcess, clients: list[PahoClient], version: int = 5) -> PahoClient:
    client = PahoClient(broker.port, unique("c"), version=version)
    assert client.connect().reason_code == 0
    clients.append(client)
    return client


@pytest.mark.parametrize("version", [4, 5])
def test_retained_message_is_sent_to_new_subscribers(broker: BrokerProcess,
                                                     clients: list[PahoClient],
                                                     version: int) -> None:
    topic = unique("r")
    publisher = connected(broker, clients, version)
    publisher.publish(topic, b"old", 1, retain=True)
    publisher.publish(topic, b"new", 1, retain=True)  # replaces the old one
    subscriber = connected(broker, clients, version)
    subscriber.subscribe(topic, 1)
    [message] = subscriber.expect(1)
    assert (message.payload, message.retain, message.qos) == (b"new", True, 1)
    subscriber.quiet()
    # an established subscription gets a retained publish with RETAIN 0 (3.1.1 and the
    # MQTT 5 default retain-as-published 0)
    publisher.publish(topic, b"live", 1, retain=True)
    [live] = subscriber.expect(1)
    assert (live.payload, live.retain) == (b"live", False)


def test_retained_message_qos_is_capped_by_the_subscription(broker: BrokerProcess,
                                                            clients: list[PahoClient]) -> None:
    topic = unique("r")
    connected(broker, clients).publish(topic, b"q2", 2, retain=True)
    subscriber = connected(broker, clients)
    subscriber.subscribe(topic, 1)
    assert subscriber.expect(1)[0].qos == 1


@pytest.mark.parametrize("version", [4, 5])
def test_empty_retained_message_clears_the_topic(broker: BrokerProcess,
                                                 clients: list[PahoClient],
                                                 version: int) -> None:
    topic = unique("r")
    publisher = connected(broker, clients, version)
    watcher = connected(broker, clients, version)
    watcher.subscribe(topic, 1)
    publisher.publish(topic, b"kept", 1, retain=True)
    publisher.publish(topic, b"", 1, retain=True)
    # the clearing message is an ordinary message for existing subscribers
    assert [m.payload for m in watcher.expect(2)] == [b"kept", b""]
    subscriber = connected(broker, clients, version)
    subscriber.subscribe(topic, 1)
    subscriber.quiet()


def test_retained_message_carries_the_subscription_identifier(
        broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("rsid")
    connected(broker, clients).publish(topic, b"r", 1, retain=True)
    subscriber = connected(broker, clients)
    subscriber.subscribe(topic, 1, properties=paho_properties(PacketTypes.SUBSCRIBE,
                                                              SubscriptionIdentifier=42))
    [message] = subscriber.expect(1)
    assert (message.retain, prop(message.properties, "SubscriptionIdentifier")) == (True, [42])


def test_retain_handling(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    root = unique("rh")
    connected(broker, clients).publish(f"{root}/a", b"retained", 1, retain=True)
    subscriber = connected(broker, clients)

    def subscribe(retain_handling: int, suffix: str) -> None:
        options = SubscribeOptions(qos=1, retainHandling=retain_handling)
        assert subscriber.subscribe(f"{root}/{suffix}", options=options) == [1]

    subscribe(0, "+")  # 0: on every subscribe
    assert subscriber.expect(1)[0].payload == b"retained"
    subscribe(0, "+")
    assert subscriber.expect(1)[0].payload == b"retained"
    subscribe(1, "#")  # 1: only when the subscription is new
    assert subscriber.expect(1)[0].payload == b"retained"
    subscribe(1, "#")
    subscriber.quiet()
    subscribe(2, "a")  # 2: never
    subscriber.quiet()


def test_retain_as_published(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("rap")
    kept = connected(broker, clients)
    kept.subscribe(topic, options=SubscribeOptions(qos=1, retainAsPublished=True))
    cleared = connected(broker, clients)
    cleared.subscribe(topic, options=SubscribeOptions(qos=1, retainAsPublished=False))
    publisher = connected(broker, clients)
    publisher.publish(topic, b"r", 1, retain=True)
    publisher.publish(topic, b"n", 1, retain=False)
    assert [(m.payload, m.retain) for m in kept.expect(2)] == [(b"r", True), (b"n", False)]
    assert [(m.payload, m.retain) for m in cleared.expect(2)] == [(b"r", False), (b"n", False)]


def test_wildcards_do_not_reach_retained_dollar_topics(broker: BrokerProcess,
                                                       clients: list[PahoClient]) -> None:
    level = unique("sys")
    publisher = connected(broker, clients)
    publisher.publish(f"$internal/{level}", b"dollar", 1, retain=True)
    publisher.publish(f"{level}/plain", b"plain", 1, retain=True)
    everything = connected(broker, clients)
    everything.subscribe("#", 1)
    # the retained messages `#` gets come right after SUBACK, before this marker
    publisher.publish(f"{level}/marker", b"marker", 1)
    seen: list[bytes] = []
    while not seen or seen[-1] != b"marker":
        seen.append(bytes(everything.expect(1)[0].payload))
    assert b"plain" in seen
    assert b"dollar" not in seen
    explicit = connected(broker, clients)
    explicit.subscribe(f"$internal/{level}", 1)
    assert explicit.expect(1)[0].payload == b"dollar"
    # clear both, so that later `#` subscribers in this module see less
    publisher.publish(f"$internal/{level}", b"", 1, retain=True)
    publisher.publish(f"{level}/plain", b"", 1, retain=True)


def test_retained_message_expiry(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    root = unique("rexp")
    publisher = connected(broker, clients)
    publisher.publish(f"{root}/short", b"short", 1, retain=True,
                      properties=paho_properties(PacketTypes.PUBLISH, MessageExpiryInterval=1))
    publisher.publish(f"{root}/long", b"long", 1, retain=True,
                      properties=paho_properties(PacketTypes.PUBLISH, MessageExpiryInterval=100))
    time.sleep(1.2)
    subscriber = connected(broker, clients)
    subscriber.subscribe(f"{root}/+", 1)
    [message] = subscriber.expect(1)
    assert message.payload == b"long"
    # the interval the subscriber gets is what is left of it
    assert 0 < prop(message.properties, "MessageExpiryInterval") < 100
    subscriber.quiet()


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_retained_messages_survive_a_restart(tmp_path: Path, how: str) -> None:
    with running_broker(tmp_path) as broker:
        publisher = PahoClient(broker.port, unique("pub"))
        publisher.connect()
        publisher.publish("keep/a", b"a", 1, retain=True)
        publisher.publish("keep/b", b"b", 2, retain=True)
        publisher.publish("keep/b", b"", 1, retain=True)
        publisher.stop()
        if how == "kill":
            broker.kill()
        else:
            assert broker.stop() == 0
        broker.start()
        subscriber = PahoClient(broker.port, unique("sub"))
        try:
            subscriber.connect()
            subscriber.subscribe("keep/#", 2)
            assert [(m.topic, m.payload, m.retain) for m in subscriber.expect(1)] == [
                ("keep/a", b"a", True)]
            subscriber.quiet()
        finally:
            subscriber.stop()
