"""Topic matching and the MQTT 5 message features: wildcards and `$` topics,
subscription identifiers, no local, topic aliases, maximum packet size, message expiry
and the properties a message carries (MQTT 5.0 sections 3.3.2, 3.8.3, 4.7)."""

from __future__ import annotations

import asyncio
import time

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.subscribeoptions import SubscribeOptions

from harness.processes import HOST, BrokerProcess
from stratamq.broker.mqtt import MQTT_3_1_1, MQTT_5, Properties, Puback, Publish
from tests.support.clients import (
    TIMEOUT,
    PahoClient,
    RawClient,
    paho_properties,
    prop,
    unique,
)


def connected(broker: BrokerProcess, clients: list[PahoClient], version: int = 5, *,
              client_id: str | None = None) -> PahoClient:
    client = PahoClient(broker.port, client_id or unique("c"), version=version)
    assert client.connect().reason_code == 0
    clients.append(client)
    return client


# -- topic matching ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", [4, 5])
def test_wildcards(broker: BrokerProcess, clients: list[PahoClient], version: int) -> None:
    root = unique("w")
    cases = {
        f"{root}/+/temp": {f"{root}/a/temp", f"{root}//temp"},
        f"{root}/#": {f"{root}", f"{root}/a/temp", f"{root}//temp", f"{root}/a/b/c",
                      f"{root}/a"},
        f"{root}/a/+": {f"{root}/a/temp"},
        f"{root}/+": {f"{root}/a"},
        f"+/{root}": set(),
    }
    topics = [f"{root}", f"{root}/a", f"{root}/a/temp", f"{root}//temp", f"{root}/a/b/c"]
    publisher = connected(broker, clients, version)
    for topic_filter, expected in cases.items():
        subscriber = connected(broker, clients, version)
        subscriber.subscribe(topic_filter, 1)
        for topic in topics:
            publisher.publish(topic, topic.encode(), 1)
        got = {m.topic for m in subscriber.expect(len(expected))}
        assert got == expected, topic_filter
        subscriber.quiet(0.1)


def test_wildcards_at_the_first_level_skip_dollar_topics(broker: BrokerProcess,
                                                         clients: list[PahoClient]) -> None:
    level = unique("d")
    publisher = connected(broker, clients)
    everything = connected(broker, clients)
    everything.subscribe("#", 0)
    plus = connected(broker, clients)
    plus.subscribe(f"+/{level}", 0)
    dollar = connected(broker, clients)
    dollar.subscribe(f"$x/{level}", 0)
    dollar_wild = connected(broker, clients)
    dollar_wild.subscribe("$x/#", 0)
    publisher.publish(f"$x/{level}", b"dollar", 1)
    publisher.publish(f"y/{level}", b"plain", 1)
    assert [m.payload for m in dollar.expect(1)] == [b"dollar"]
    assert [m.payload for m in dollar_wild.expect(1)] == [b"dollar"]
    assert [m.payload for m in plus.expect(1)] == [b"plain"]
    assert [m.payload for m in everything.expect(1)] == [b"plain"]
    for client in (dollar, dollar_wild, plus, everything):
        client.quiet(0.1)


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_invalid_topic_filters_are_refused_in_suback(broker: BrokerProcess, level: int) -> None:
    client = RawClient(broker.port, level)
    client.connect(unique("bad"))
    failure = 0x8F if level == MQTT_5 else 0x80
    for packet_id, topic_filter in enumerate(["a/#/b", "a+", "a/b#", "$share/g"], 1):
        suback = client.subscribe(topic_filter, 1, packet_id=packet_id)
        assert suback.reason_codes == [failure], topic_filter
    assert client.subscribe("fine/+", 1, packet_id=9).reason_codes == [1]
    client.disconnect()


def test_unsubscribe(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("u")
    client = connected(broker, clients)
    client.subscribe(topic, 1)
    assert client.unsubscribe(topic) == [0]
    assert client.unsubscribe(topic) == [0x11]  # no subscription existed
    client.publish(topic, b"x", 1)
    client.quiet()


# -- subscription options -----------------------------------------------------------------------

def test_subscription_identifiers(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    root = unique("sid")
    client = connected(broker, clients)
    client.subscribe(f"{root}/+", 1,
                     properties=paho_properties(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=5))
    client.subscribe(f"{root}/b", 1, properties=paho_properties(
        PacketTypes.SUBSCRIBE, SubscriptionIdentifier=268_435_455))
    client.subscribe(f"{root}/#", 1)  # no identifier
    client.publish(f"{root}/b", b"b", 1)
    # one copy for the three subscriptions, carrying all their identifiers (MQTT-3.3.4-4)
    [message] = client.expect(1)
    assert sorted(prop(message.properties, "SubscriptionIdentifier")) == [5, 268_435_455]
    client.quiet()
    client.publish(f"{root}/c", b"c", 1)
    [message] = client.expect(1)
    assert prop(message.properties, "SubscriptionIdentifier") == [5]
    client.quiet()


def test_no_local(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("nl")
    own = connected(broker, clients)
    own.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=True))
    echo = connected(broker, clients)
    echo.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=False))
    own.publish(topic, b"from own", 1)
    echo.publish(topic, b"from echo", 1)
    assert [m.payload for m in own.expect(1)] == [b"from echo"]
    assert sorted(m.payload for m in echo.expect(2)) == [b"from echo", b"from own"]
    own.quiet()


def test_no_local_in_a_durable_session(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("nld")
    sessions = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=60)
    own = PahoClient(broker.port, unique("own"))
    clients.append(own)
    own.connect(properties=sessions)
    own.subscribe(topic, options=SubscribeOptions(qos=1, noLocal=True))
    own.publish(topic, b"mine", 1)
    connected(broker, clients).publish(topic, b"theirs", 1)
    assert [m.payload for m in own.expect(1)] == [b"theirs"]
    own.quiet()


# -- topic aliases -------------------------------------------------------------------------------

def test_client_to_server_topic_alias(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    root = unique("alias-in")
    subscriber = connected(broker, clients)
    subscriber.subscribe(f"{root}/#", 1)
    publisher = RawClient(broker.port)
    publisher.connect(unique("aliaser"))
    for packet_id, (topic, payload) in enumerate(
            [(f"{root}/long/topic/name", b"1"), ("", b"2"), (f"{root}/other", b"3"),
             ("", b"4")], 1):
        properties = Properties(topic_alias=1)
        publisher.send(Publish(topic, payload, 1, packet_id=packet_id, properties=properties))
        assert publisher.expect(Puback).reason_code == 0
    messages = subscriber.expect(4)
    assert [(m.topic, m.payload) for m in messages] == [
        (f"{root}/long/topic/name", b"1"), (f"{root}/long/topic/name", b"2"),
        (f"{root}/other", b"3"), (f"{root}/other", b"4")]
    # the publisher's alias is its own: subscribers do not get it
    assert [prop(m.properties, "TopicAlias") for m in messages] == [None] * 4
    publisher.disconnect()


def test_server_to_client_topic_alias(broker: BrokerProcess, clients: list[PahoClient]) -> None:
    root = unique("alias-out")
    subscriber = RawClient(broker.port)
    subscriber.connect(unique("aliased"), properties=Properties(topic_alias_maximum=2))
    subscriber.subscribe(f"{root}/#", 0)
    plain = RawClient(broker.port)  # no topic_alias_maximum: never an alias
    plain.connect(unique("plain"))
    plain.subscribe(f"{root}/#", 0)
    publisher = connected(broker, clients)
    sent = [f"{root}/a", f"{root}/a", f"{root}/b", f"{root}/c", f"{root}/b", f"{root}/a"]
    for topic in sent:
        publisher.publish(topic, b"x", 1)
    aliases: dict[int, str] = {}
    resolved = []
    for _ in sent:
        packet = subscriber.expect(Publish)
        alias = packet.properties.topic_alias
        if alias is None:
            assert packet.topic
            resolved.append(packet.topic)
            continue
        assert 1 <= alias <= 2
        if packet.topic:
            aliases[alias] = packet.topic
        resolved.append(aliases[alias])
    assert resolved == sent
    assert len(aliases) == 2  # two aliases were used, and reused
    for topic in sent:
        packet = plain.expect(Publish)
        assert (packet.topic, packet.properties.topic_alias) == (topic, None)
    subscriber.disconnect()
    plain.disconnect()


# -- maximum packet size -------------------------------------------------------------------------

def test_messages_larger_than_the_clients_maximum_are_not_sent(
        broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("max")
    subscriber = RawClient(broker.port)
    subscriber.connect(unique("small"), properties=Properties(maximum_packet_size=256,
                                                              receive_maximum=1))
    subscriber.subscribe(topic, 1)
    publisher = connected(broker, clients)
    publisher.publish(topic, bytes(300), 1)
    publisher.publish(topic, b"fits", 1)
    publisher.publish(topic, bytes(300), 0)
    publisher.publish(topic, b"fits too", 1)
    first = subscriber.expect(Publish)
    assert first.payload == b"fits"  # the large one was dropped, not left in flight
    assert first.packet_id is not None
    subscriber.send(Puback(first.packet_id))
    assert subscriber.expect(Publish).payload == b"fits too"
    subscriber.quiet()
    subscriber.disconnect()


# -- message expiry ------------------------------------------------------------------------------

def test_message_expiry_for_a_durable_session_that_comes_back_late(
        broker: BrokerProcess, clients: list[PahoClient]) -> None:
    topic = unique("exp")
    client_id = unique("late")
    sessions = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=60)
    subscriber = PahoClient(broker.port, client_id)
    clients.append(subscriber)
    subscriber.connect(properties=sessions)
    subscriber.subscribe(topic, 1)
    subscriber.disconnect()
    publisher = connected(broker, clients)
    for payload, interval in [(b"short", 1), (b"long", 100), (b"forever", None)]:
        properties = (paho_properties(PacketTypes.PUBLISH, MessageExpiryInterval=interval)
                      if interval else None)
        publisher.publish(topic, payload, 1, properties=properties)
    time.sleep(1.2)
    late = PahoClient(broker.port, client_id)
    clients.append(late)
    assert late.connect(clean_start=False, properties=sessions).session_present
    long, forever = late.expect(2)
    assert (long.payload, forever.payload) == (b"long", b"forever")
    assert 0 < prop(long.properties, "MessageExpiryInterval") < 100  # counted down
    assert prop(forever.properties, "MessageExpiryInterval") is None
    late.quiet()


# -- what a message carries ------------------------------------------------------------------------

def test_publish_properties_are_passed_through(broker: BrokerProcess,
                                               clients: list[PahoClient]) -> None:
    topic = unique("props")
    v5 = connected(broker, clients)
    v5.subscribe(topic, 1)
    v3 = connected(broker, clients, 4)
    v3.subscribe(topic, 1)
    publisher = connected(broker, clients)
    user = [("a", "1"), ("a", "2"), ("b", "ü")]
    publisher.publish(topic, b"{}", 1, properties=paho_properties(
        PacketTypes.PUBLISH, PayloadFormatIndicator=1, ContentType="application/json",
        ResponseTopic=f"{topic}/reply", CorrelationData=b"\x00\x01corr",
        UserProperty=user, MessageExpiryInterval=3600))
    [message] = v5.expect(1)
    properties = message.properties
    assert prop(properties, "PayloadFormatIndicator") == 1
    assert prop(properties, "ContentType") == "application/json"
    assert prop(properties, "ResponseTopic") == f"{topic}/reply"
    assert prop(properties, "CorrelationData") == b"\x00\x01corr"
    assert prop(properties, "UserProperty") == user  # order and repeats kept
    assert 3599 <= prop(properties, "MessageExpiryInterval") <= 3600
    assert v3.expect(1)[0].payload == b"{}"  # 3.1.1 gets the message without them


def test_request_response_with_aiomqtt(broker: BrokerProcess) -> None:
    """A responder answers on the response topic with the correlation data."""
    root = unique("rpc")

    async def scenario() -> list[tuple[bytes, bytes | None]]:
        v5 = aiomqtt.ProtocolVersion.V5
        async with aiomqtt.Client(HOST, broker.port, identifier=unique("responder"),
                                  protocol=v5) as responder, \
                aiomqtt.Client(HOST, broker.port, identifier=unique("requester"),
                               protocol=v5) as requester:
            await responder.subscribe(f"{root}/requests", 1)
            await requester.subscribe(f"{root}/replies", 1)

            async def respond() -> None:
                async for request in responder.messages:
                    reply = paho_properties(
                        PacketTypes.PUBLISH,
                        CorrelationData=prop(request.properties, "CorrelationData"))
                    assert isinstance(request.payload, bytes)
                    await responder.publish(prop(request.properties, "ResponseTopic"),
                                            request.payload.upper(), 1, properties=reply)

            serving = asyncio.create_task(respond())
            for number in range(3):
                await requester.publish(f"{root}/requests", b"ping %d" % number, 1,
                                        properties=paho_properties(
                                            PacketTypes.PUBLISH,
                                            ResponseTopic=f"{root}/replies",
                                            CorrelationData=b"id-%d" % number))
            replies = []
            async for reply in requester.messages:
                assert isinstance(reply.payload, bytes)
                replies.append((reply.payload, prop(reply.properties, "CorrelationData")))
                if len(replies) == 3:
                    break
            serving.cancel()
            return replies

    replies = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert sorted(replies) == [(b"PING %d" % n, b"id-%d" % n) for n in range(3)]
