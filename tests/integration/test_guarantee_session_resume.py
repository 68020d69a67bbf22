"""MQTT 5 session resumption when the reconnecting CONNECT has no Session Expiry
Interval (MQTT-3.1.2-4/5, 3.1.2.11.2): a session made with an expiry > 0 resumes on
Clean Start 0 whatever the new CONNECT says; the new expiry (absent: 0) only applies
when the new connection ends. Messages queued while the client was away are
delivered, each with its Message Expiry Interval reduced by the time it waited
(MQTT-3.3.2-6); one that expired meanwhile is never delivered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import MQTT_5, Properties, Puback, Publish
from tests.support.clients import RawClient, unique


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path) as process:
        yield process


def make_session(broker: BrokerProcess, client_id: str, topic_filter: str) -> None:
    """A durable session with a subscription, then the client goes away."""
    client = RawClient(broker.port, MQTT_5)
    connack = client.connect(client_id, clean_start=False,
                             properties=Properties(session_expiry_interval=3600))
    assert (connack.reason_code, connack.session_present) == (0, False)
    assert client.subscribe(topic_filter, 1).reason_codes == [1]
    client.disconnect()


def publish(broker: BrokerProcess, topic: str, payloads: list[bytes],
            expiry: list[int | None] | None = None) -> None:
    publisher = RawClient(broker.port)
    publisher.connect(unique("pub"))
    for number, payload in enumerate(payloads, 1):
        interval = expiry[number - 1] if expiry else None
        ack = publisher.publish(topic, payload, 1, packet_id=number,
                                properties=Properties(message_expiry_interval=interval))
        assert isinstance(ack, Puback) and ack.reason_code == 0
    publisher.disconnect()


def resume(broker: BrokerProcess, client_id: str, with_expiry: bool) -> RawClient:
    client = RawClient(broker.port, MQTT_5)
    properties = Properties(session_expiry_interval=3600) if with_expiry else Properties()
    connack = client.connect(client_id, clean_start=False, properties=properties)
    assert connack.reason_code == 0
    assert connack.session_present, "the stored session was not resumed"
    return client


def test_resume_without_session_expiry_property_delivers_queued_messages(
        broker: BrokerProcess) -> None:
    client_id = unique("resume")
    topic = unique("resume") + "/t"
    make_session(broker, client_id, topic)
    payloads = [b"away-%d" % n for n in range(5)]
    publish(broker, topic, payloads)

    client = resume(broker, client_id, with_expiry=False)
    got = [client.expect(Publish) for _ in payloads]
    assert [p.payload for p in got] == payloads
    for packet in got:
        assert packet.packet_id is not None
        client.send(Puback(packet.packet_id))
    client.quiet()
    client.disconnect()

    # The new connection's expiry (absent: 0) applied when it ended: the session is gone.
    again = RawClient(broker.port, MQTT_5)
    connack = again.connect(client_id, clean_start=False)
    assert (connack.reason_code, connack.session_present) == (0, False)
    again.disconnect()


@pytest.mark.parametrize("with_expiry", [False, True],
                         ids=["no-session-expiry-property", "session-expiry-again"])
def test_messages_queued_offline_carry_their_remaining_expiry(broker: BrokerProcess,
                                                              with_expiry: bool) -> None:
    client_id = unique("expiry")
    topic = unique("expiry") + "/t"
    make_session(broker, client_id, topic)
    publish(broker, topic, [b"lives", b"expires"], expiry=[60, 1])
    # The messages wait at least this long: the remaining interval is at most 60 - 2,
    # and the 1 s one has expired (a longer wait only makes both more certain).
    time.sleep(2.5)

    client = resume(broker, client_id, with_expiry)
    packet = client.expect(Publish)
    assert packet.payload == b"lives"
    remaining = packet.properties.message_expiry_interval
    assert remaining is not None and 1 <= remaining <= 58, remaining
    assert packet.packet_id is not None
    client.send(Puback(packet.packet_id))
    client.quiet(1.0)  # the expired message never comes
    client.disconnect()


def test_a_quiet_resumed_session_outlives_a_crash_of_its_site(broker: BrokerProcess) -> None:
    """The session written before CONNACK was recorded as disconnected at that moment
    (not attached to its connection yet): a resumed session that stayed quiet (no
    SUBSCRIBE, nothing delivered: nothing written after) expired after a crash of its
    site though its client was connected all along. It is recorded connected, so its
    expiry counts from the site's restart."""
    client_id = unique("quiet")
    make_session(broker, client_id, unique("quiet") + "/t")
    quiet = RawClient(broker.port, MQTT_5)
    connack = quiet.connect(client_id, clean_start=False,
                            properties=Properties(session_expiry_interval=2))
    assert connack.session_present
    time.sleep(3)  # connected, idle, longer than its expiry
    broker.kill()
    broker.start()
    again = RawClient(broker.port, MQTT_5)
    connack = again.connect(client_id, clean_start=False,
                            properties=Properties(session_expiry_interval=2))
    assert (connack.reason_code, connack.session_present) == (0, True)
    again.disconnect()
