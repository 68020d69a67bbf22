"""CONNECT: authenticate, negotiate, open (or take over) the session, CONNACK."""

from __future__ import annotations

import secrets
import uuid
from typing import TYPE_CHECKING

from ..core.session_takeover import NotSessionOwner
from ..errors import StratamqError
from ..mqtt import MQTT_5, Connack, Connect, Properties, ReasonCode
from ..mqtt.error_codes import mqtt_reason_code
from ..net.address import peer_host
from ..session.model import NEVER_EXPIRES, WillRecord
from .properties import to_message_properties

if TYPE_CHECKING:
    from .channel import Channel

# The largest Keep Alive MQTT can express: a server limit below it is enforced.
MAX_KEEPALIVE = 65535


async def handle_connect(channel: Channel, packet: Connect) -> None:
    channel.level = packet.protocol_level
    properties = packet.properties
    if properties.authentication_method is not None:
        channel.refuse(ReasonCode.BAD_AUTHENTICATION_METHOD)  # no enhanced auth here
    client_id = packet.client_id
    assigned = None
    if not client_id:
        if channel.level < MQTT_5 and not packet.clean_start:
            channel.refuse(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
        client_id = assigned = f"stratamq-{uuid.uuid4().hex[:16]}"
    channel.client_id = client_id
    channel.username = packet.username
    reason = await channel.access.authenticate_async(client_id, packet.username,
                                                     packet.password, peer_host(channel.peer))
    if reason != ReasonCode.SUCCESS:
        channel.refuse(reason)
    if packet.will is not None and not channel.access.authorize_publish(
            client_id, packet.username, packet.will.topic):
        channel.refuse(ReasonCode.NOT_AUTHORIZED)
    limits = channel.limits
    if channel.level == MQTT_5:
        expiry = properties.session_expiry_interval or 0
        if properties.receive_maximum:
            channel.receive_maximum = min(properties.receive_maximum, limits.max_inflight)
        if properties.maximum_packet_size:
            channel.client_max_packet = properties.maximum_packet_size
        channel.client_alias_maximum = properties.topic_alias_maximum or 0
    else:
        expiry = 0 if packet.clean_start else NEVER_EXPIRES
    channel.keepalive = packet.keepalive
    server_keepalive = None
    if channel.keepalive > limits.max_keepalive or \
            (channel.keepalive == 0 and limits.max_keepalive < MAX_KEEPALIVE):
        channel.keepalive = server_keepalive = limits.max_keepalive
    registry = channel.broker.registry
    try:
        session, present = await registry.open_session(
            channel, packet.clean_start, expiry, packet.username,
            lambda topic_filter: channel.access.authorize_subscribe(
                client_id, packet.username, topic_filter))
    except NotSessionOwner:
        channel.refuse(ReasonCode.NOT_AUTHORIZED)
    except StratamqError as error:
        # the storage could not tell the session's state (its QoS 2 packet ids past a
        # read barrier, say): refused, the client tries again, rather than a guess
        channel.refuse(mqtt_reason_code(error))
    channel.session = session
    if packet.will is not None:
        will = packet.will
        session.set_will(WillRecord(will.topic, will.payload, will.qos, will.retain,
                                    to_message_properties(will.properties),
                                    will.properties.will_delay_interval or 0,
                                    secrets.randbits(63) or 1))
    else:
        session.set_will(None)
    connack_properties = Properties()
    if channel.level == MQTT_5:
        connack_properties.assigned_client_identifier = assigned
        connack_properties.receive_maximum = limits.receive_maximum
        connack_properties.maximum_packet_size = limits.max_packet_size
        connack_properties.topic_alias_maximum = limits.topic_alias_maximum
        connack_properties.server_keep_alive = server_keepalive
    if session.durable:
        # Before CONNACK: a client told its session is there finds it (and the ids of
        # its inbound QoS 2 messages, loaded with it) after a crash too.
        await registry.persist(session, connecting=True)
    channel.send(Connack(present, ReasonCode.SUCCESS, connack_properties))
    session.attach(channel)
