"""CONNECT / CONNACK, sessions, keepalive, takeover and DISCONNECT against a real broker
(MQTT 5.0 chapter 3.1, 3.2, 3.14, 4.13; MQTT 3.1.1 chapter 3.1, 3.2)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Auth,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Publish,
    encode,
)
from tests.support.clients import (
    PahoClient,
    RawClient,
    paho_properties,
    prop,
    unique,
)

BROKER_CONFIG: dict[str, Any] = {"mqtt": {"max_keepalive": 30, "topic_alias_maximum": 8,
                                   "receive_maximum": 50, "max_packet_size": "64KiB"}}


def expiry(seconds: int) -> Properties:
    return Properties(session_expiry_interval=seconds)


# -- CONNACK ----------------------------------------------------------------------------

def test_v5_empty_client_id_gets_an_assigned_identifier(broker: BrokerProcess) -> None:
    client = PahoClient(broker.port, "")
    try:
        connack = client.connect()
        assert connack.reason_code == 0
        assert connack.properties is not None
        assigned = prop(connack.properties, "AssignedClientIdentifier")
        assert assigned
        # CONNACK tells the client the server's limits
        assert prop(connack.properties, "ReceiveMaximum") == 50
        assert prop(connack.properties, "MaximumPacketSize") == 64 * 1024
        assert prop(connack.properties, "TopicAliasMaximum") == 8
        # the assigned identifier is a working session
        topic = unique("assigned")
        assert client.subscribe(topic, 1) == [1]
        assert client.publish(topic, b"hi", 1) == 0
        assert client.expect(1)[0].payload == b"hi"
    finally:
        client.stop()
    other = RawClient(broker.port)
    connack_raw = other.connect("", clean_start=False, properties=expiry(10))
    assert connack_raw.reason_code == 0
    assert connack_raw.properties.assigned_client_identifier not in (None, "", assigned)
    other.disconnect()


def test_v311_empty_client_id_needs_clean_session(broker: BrokerProcess) -> None:
    refused = RawClient(broker.port, MQTT_3_1_1)
    connack = refused.connect("", clean_start=False)
    assert (connack.session_present, connack.reason_code) == (False, 2)  # identifier rejected
    assert refused.wait_closed() == []
    accepted = RawClient(broker.port, MQTT_3_1_1)
    assert accepted.connect("", clean_start=True).reason_code == 0
    accepted.disconnect()


@pytest.mark.parametrize("level", [2, 6, 7])
def test_unsupported_protocol_version_gets_return_code_1(broker: BrokerProcess,
                                                         level: int) -> None:
    client = RawClient(broker.port, MQTT_3_1_1)
    body = b"\x00\x04MQTT" + bytes((level, 0x02)) + b"\x00\x3c" + b"\x00\x01x"
    client.send_bytes(bytes((0x10, len(body))) + body)
    client.sock.settimeout(5)
    assert client.sock.recv(16) == b"\x20\x02\x00\x01"  # 3.1.1 CONNACK, return code 1
    assert client.wait_closed() == []


def test_enhanced_authentication_is_refused_with_bad_authentication_method(
        broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    connack = client.connect(unique("scram"), properties=Properties(
        authentication_method="SCRAM-SHA-256", authentication_data=b"client-first"))
    assert connack.reason_code == 0x8C
    assert client.wait_closed() == []


# -- clean start, session present, session expiry -----------------------------------------

def test_v5_clean_start_and_session_present(broker: BrokerProcess) -> None:
    client_id = unique("present5")
    sessions = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=60)
    steps = [(True, False), (False, True), (False, True), (True, False), (False, True)]
    for clean_start, present in steps:
        client = PahoClient(broker.port, client_id)
        connack = client.connect(clean_start=clean_start, properties=sessions)
        assert (connack.reason_code, connack.session_present) == (0, present), clean_start
        client.disconnect()


def test_v311_clean_session_and_session_present(broker: BrokerProcess) -> None:
    client_id = unique("present3")
    # clean session 0 keeps the session; clean session 1 discards it and ends it at close
    steps = [(False, False), (False, True), (True, False), (False, False), (False, True)]
    for clean_session, present in steps:
        client = PahoClient(broker.port, client_id, version=4, clean_session=clean_session)
        connack = client.connect()
        assert (connack.reason_code, connack.session_present) == (0, present), clean_session
        client.disconnect()


def test_v5_session_without_expiry_ends_with_the_connection(broker: BrokerProcess) -> None:
    client_id = unique("noexpiry")
    client = RawClient(broker.port)
    assert client.connect(client_id, clean_start=False).reason_code == 0
    client.disconnect()
    again = RawClient(broker.port)
    assert again.connect(client_id, clean_start=False).session_present is False
    again.disconnect()


def test_v5_session_expires_after_its_interval(broker: BrokerProcess) -> None:
    client_id = unique("expiry")
    topic = unique("expiry")
    client = RawClient(broker.port)
    client.connect(client_id, properties=expiry(60))
    client.subscribe(topic, 1)
    client.disconnect()
    kept = RawClient(broker.port)  # and now the session gets one second
    assert kept.connect(client_id, clean_start=False,
                        properties=expiry(1)).session_present is True
    kept.disconnect()
    time.sleep(2)  # well past the one-second expiry (its timer starts after the close)
    late = RawClient(broker.port)
    assert late.connect(client_id, clean_start=False).session_present is False
    # nothing of the old session is left: its subscription is gone
    publisher = RawClient(broker.port)
    publisher.connect(unique("pub"))
    publisher.publish(topic, b"x", 1)
    late.quiet()
    late.disconnect()
    publisher.disconnect()


def test_clean_start_discards_the_session_for_good(broker: BrokerProcess) -> None:
    client_id = unique("discard")
    topic = unique("discard")
    client = RawClient(broker.port)
    client.connect(client_id, properties=expiry(60))
    client.subscribe(topic, 1)
    publisher = RawClient(broker.port)
    publisher.connect(unique("pub"))
    publisher.publish(topic, b"x", 1)
    message = client.expect(Publish)
    assert message.packet_id is not None
    client.send(Puback(message.packet_id))  # progress the session writes down soon
    client.disconnect()
    fresh = RawClient(broker.port)
    assert fresh.connect(client_id, clean_start=True).session_present is False
    fresh.disconnect()
    time.sleep(0.2)  # longer than the session waits to write progress down
    again = RawClient(broker.port)
    assert again.connect(client_id, clean_start=False).session_present is False
    publisher.publish(topic, b"y", 1)
    again.quiet()  # the old subscription is gone too
    again.disconnect()
    publisher.disconnect()


def test_session_expiry_set_to_zero_on_disconnect_ends_the_session(
        broker: BrokerProcess) -> None:
    client_id = unique("zero")
    client = RawClient(broker.port)
    client.connect(client_id, properties=expiry(60))
    client.disconnect(0, expiry(0))
    again = RawClient(broker.port)
    assert again.connect(client_id, clean_start=False).session_present is False
    again.disconnect()


def test_disconnect_may_not_turn_a_session_durable(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("late-expiry"))
    client.send(Disconnect(0, expiry(60)))
    assert [p.reason_code for p in client.wait_closed()
            if isinstance(p, Disconnect)] == [0x82]  # protocol error


# -- keepalive ------------------------------------------------------------------------------

@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_silent_client_is_disconnected_after_one_and_a_half_keepalives(
        broker: BrokerProcess, level: int) -> None:
    client = RawClient(broker.port, level)
    assert client.connect(unique("silent"), keepalive=1).reason_code == 0
    closed = client.wait_closed(timeout=6)
    if level == MQTT_5:
        assert [p.reason_code for p in closed if isinstance(p, Disconnect)] == [0x8D]
    else:
        assert closed == []


def test_pings_keep_a_connection_open(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("pinger"), keepalive=1)
    for _ in range(4):  # 2 s of pings: more than 1.5 keepalives
        time.sleep(0.5)
        client.send(Pingreq())
        client.expect(Pingresp)
    client.disconnect()


def test_server_keepalive_caps_what_the_client_asks(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    assert client.connect(unique("ka"), keepalive=300).properties.server_keep_alive == 30
    client.disconnect()
    forever = RawClient(broker.port)
    assert forever.connect(unique("ka0"), keepalive=0).properties.server_keep_alive == 30
    forever.disconnect()
    within = RawClient(broker.port)
    assert within.connect(unique("ka10"), keepalive=10).properties.server_keep_alive is None
    within.disconnect()


# -- takeover -------------------------------------------------------------------------------

def test_v5_takeover_sends_session_taken_over(broker: BrokerProcess) -> None:
    client_id = unique("takeover5")
    sessions = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=60)
    old = PahoClient(broker.port, client_id)
    new = PahoClient(broker.port, client_id)
    try:
        old.connect(properties=sessions)
        topic = unique("takeover")
        old.subscribe(topic, 1)
        connack = new.connect(clean_start=False, properties=sessions)
        assert (connack.reason_code, connack.session_present) == (0, True)
        assert old.wait_disconnected() == 0x8E
        # the session (with its subscription) now serves the new connection
        assert new.publish(topic, b"after", 1) == 0
        assert new.expect(1)[0].payload == b"after"
        old.quiet()
    finally:
        old.stop()
        new.stop()


def test_v311_takeover_closes_the_old_connection(broker: BrokerProcess) -> None:
    client_id = unique("takeover3")
    old = RawClient(broker.port, MQTT_3_1_1)
    old.connect(client_id, clean_start=False)
    new = RawClient(broker.port, MQTT_3_1_1)
    connack = new.connect(client_id, clean_start=False)
    assert (connack.reason_code, connack.session_present) == (0, True)
    assert old.wait_closed() == []  # no DISCONNECT exists for a server in 3.1.1
    new.disconnect()


# -- DISCONNECT from the server --------------------------------------------------------------

def _closing_reason(client: RawClient) -> list[int]:
    return [p.reason_code for p in client.wait_closed() if isinstance(p, Disconnect)]


def test_second_connect_is_a_protocol_error(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("twice"))
    client.send(Connect(unique("twice"), MQTT_5))
    assert _closing_reason(client) == [0x82]


def test_auth_packet_without_enhanced_auth_is_a_protocol_error(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("auth"))
    client.send(Auth(0x19))
    assert _closing_reason(client) == [0x82]


def test_invalid_topic_alias_is_disconnected_with_0x94(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("alias"))
    client.send(Publish("a/b", b"x", properties=Properties(topic_alias=9)))  # maximum is 8
    assert _closing_reason(client) == [0x94]


def test_unknown_topic_alias_is_a_protocol_error(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("alias"))
    client.send(Publish("", b"x", properties=Properties(topic_alias=3)))
    assert _closing_reason(client) == [0x82]


def test_wildcard_in_a_published_topic_is_disconnected_with_0x90(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("wild"))
    client.send(Publish("a/+", b"x", 1, packet_id=1))
    assert _closing_reason(client) == [0x90]


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_packet_larger_than_the_maximum_is_refused(broker: BrokerProcess, level: int) -> None:
    client = RawClient(broker.port, level)
    client.connect(unique("big"))
    client.send(Publish("big", bytes(64 * 1024), 1, packet_id=1))
    closing = _closing_reason(client)
    assert closing == ([0x95] if level == MQTT_5 else [])


def test_more_unacknowledged_publishes_than_receive_maximum(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("flood"))
    # 51 QoS 1 messages in one write: the broker reads them at once, before it has
    # acknowledged any, and the 51st exceeds its receive maximum of 50
    client.send_bytes(b"".join(
        encode(Publish("flood", b"x", 1, packet_id=number), MQTT_5) for number in range(1, 52)))
    assert _closing_reason(client) == [0x93]
