"""PUBLISH from a client: topic aliases, checks, access control, store; PUBACK or
PUBREC only once the message is durable."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ..core.publish import all_stored
from ..ds import FencedError, Message
from ..errors import StratamqError
from ..metrics import MESSAGES_DROPPED, messages_received
from ..mqtt import MQTT_5, NO_PROPERTIES, Puback, Publish, Pubrec, ReasonCode
from ..mqtt.error_codes import disconnect_reason_code
from ..net.read_loop import ConnectionClosed
from ..topic import validate_topic
from .properties import to_message_properties

if TYPE_CHECKING:
    from .channel import Channel

log = logging.getLogger(__name__)


def _fail(channel: Channel, reason_code: int, detail: str = "") -> ConnectionClosed:
    channel.disconnect(reason_code, detail)
    return ConnectionClosed()


def _resolve_topic(channel: Channel, packet: Publish) -> str:
    topic = packet.topic
    alias = packet.properties.topic_alias
    if not topic and alias is None:
        raise _fail(channel, ReasonCode.PROTOCOL_ERROR)  # needs an alias (MQTT-3.3.2-8)
    if alias is not None:
        if not 0 < alias <= channel.limits.topic_alias_maximum:
            raise _fail(channel, ReasonCode.TOPIC_ALIAS_INVALID)
        if topic:
            channel.inbound_aliases[alias] = topic
        else:
            topic = channel.inbound_aliases.get(alias, "")
            if not topic:
                raise _fail(channel, ReasonCode.PROTOCOL_ERROR)
    return topic


async def handle_publish(channel: Channel, packet: Publish) -> None:
    session = channel.attached_session()
    if packet.properties.subscription_identifiers:
        raise _fail(channel, ReasonCode.PROTOCOL_ERROR)  # server only (MQTT-3.3.4-6)
    topic = _resolve_topic(channel, packet)
    try:
        levels = validate_topic(topic)
    except StratamqError:
        raise _fail(channel, ReasonCode.TOPIC_NAME_INVALID) from None
    if len(levels) > channel.limits.max_topic_levels:
        raise _fail(channel, ReasonCode.TOPIC_NAME_INVALID)
    if packet.qos == 2 and await _received_before(channel, packet.packet_id or 0):
        channel.send(Pubrec(packet.packet_id or 0))  # a resend: stored already
        return
    if packet.qos > 0 and channel.level == MQTT_5 \
            and channel.inbound_qos_pending >= channel.limits.receive_maximum:
        raise _fail(channel, ReasonCode.RECEIVE_MAXIMUM_EXCEEDED,
                    f"more than {channel.limits.receive_maximum} QoS 1/2 PUBLISH "
                    f"unacknowledged (mqtt.receive_maximum, told in CONNACK)")
    if not channel.access.authorize_publish(channel.client_id, channel.username, topic,
                                            levels):
        MESSAGES_DROPPED.labels("not_authorized").inc()
        _ack(channel, packet, ReasonCode.NOT_AUTHORIZED)
        return
    if (packet.qos > 0 and channel.inbound_qos_pending >= channel.limits.receive_maximum) \
            or not channel.broker.publisher.has_room(channel.client_id):
        await _wait_for_room(channel, packet)
    if _a_store_failed(channel):
        raise _fail(channel, ReasonCode.UNSPECIFIED_ERROR)
    message = Message(topic, packet.payload, channel.client_id, packet.qos, packet.retain,
                      to_message_properties(packet.properties))
    messages_received(packet.qos).inc()
    if packet.qos == 2 and packet.retain:
        # The retained copy first (Publisher.publish_qos2 says why), reading nothing
        # more from the client meanwhile, so its messages keep their order.
        try:
            await channel.broker.publisher.store_retained(message)
        except StratamqError as error:
            raise _fail(channel, disconnect_reason_code(error)) from None
        if channel.closing:  # nothing of the message stored: the client resends it
            raise ConnectionClosed()
        if _a_store_failed(channel):  # an earlier message's, meanwhile (order)
            raise _fail(channel, ReasonCode.UNSPECIFIED_ERROR)
    try:
        if packet.qos == 2:
            waits = channel.broker.publisher.publish_qos2(
                message, packet.packet_id or 0, session.owner_epoch, session.incarnation)
        else:
            waits = channel.broker.publisher.publish(message, wait=packet.qos > 0)
    except StratamqError as error:
        raise _fail(channel, disconnect_reason_code(error)) from None
    if packet.qos == 0:
        return
    channel.inbound_qos_pending += 1
    channel.last_store = waits[0]
    done = all_stored(waits)
    if packet.qos == 2:
        # before any later packet is read: a resend must find it
        session.inbound_qos2.storing(packet.packet_id or 0, done)
    done.add_done_callback(lambda future: _stored(channel, packet, future))


def _a_store_failed(channel: Channel) -> bool:
    """Whether a QoS 1/2 message of this connection failed to be stored, even if the
    connection has not heard yet (the failure's callbacks run later). A message taken
    after that could be committed before the client resends the failed one (order per
    publisher and topic, MQTT-4.6.0-5). The latest store tells: a client's messages
    share one shard's write buffer, which fails everything queued behind a failed
    write (replicated sites; on a single site a failed write is a failed disk)."""
    last = channel.last_store
    return last is not None and last.done() and (last.cancelled()
                                                 or last.exception() is not None)


async def _wait_for_room(channel: Channel, packet: Publish) -> None:
    """Back-pressure: the read loop takes nothing more from this client until its
    PUBLISH can be taken. A 3.1.1 client is not told a Receive Maximum (an MQTT 5 one
    exceeding it is disconnected above), so it waits for one of its unacknowledged
    publishes to be stored; and any publisher waits while the write buffer of its
    shard is full, rather than being refused."""
    if packet.qos > 0:
        while channel.inbound_qos_pending >= channel.limits.receive_maximum:
            channel.inbound_slot_freed.clear()
            await channel.inbound_slot_freed.wait()
    await channel.broker.publisher.wait_for_room(channel.client_id)
    if channel.closing:
        raise ConnectionClosed()


async def _received_before(channel: Channel, packet_id: int) -> bool:
    """Whether a QoS 2 message with this packet id is stored already and awaits its
    PUBREL. A resend of one whose store is under way waits for that store (and keeps
    the packets after it waiting too, so their order holds)."""
    session = channel.attached_session()
    store = session.inbound_qos2.store_under_way(packet_id)
    if store is not None:
        await asyncio.wait([store])
        if channel.closing:
            raise ConnectionClosed()
    if session.inbound_qos2.unknown(packet_id):
        # its store failed, but may have been committed: storing it again could
        # deliver it twice, so the storage decides (or the connection ends)
        try:
            stored = await channel.broker.publisher.qos2_stored(
                channel.client_id, packet_id, session.incarnation)
        except StratamqError as error:
            raise _fail(channel, disconnect_reason_code(error)) from None
        if channel.closing:
            raise ConnectionClosed()
        session.inbound_qos2.known(packet_id, stored)
    return session.inbound_qos2.pending(packet_id)


def _stored(channel: Channel, packet: Publish, future: asyncio.Future[Any]) -> None:
    """A QoS 1/2 message is durable (or failed): only now is it acknowledged."""
    channel.inbound_qos_pending -= 1
    channel.inbound_slot_freed.set()
    # Read the outcome even when closing: asyncio logs an exception never read (with a
    # traceback per failed gather of several writes) once the future is collected.
    failed = future.cancelled() or future.exception() is not None
    if channel.closing:  # the connection is gone: nobody else asks
        return
    if failed:
        error = None if future.cancelled() else future.exception()
        if isinstance(error, FencedError):  # its session is another site's now
            log.info("%s: taken over by another site; a PUBLISH read here before that "
                     "is not stored (the client resends it there)", channel.client_id)
        else:
            log.error("store failed for %s: %s", channel.client_id, error)
        channel.disconnect(ReasonCode.UNSPECIFIED_ERROR)
        channel.close_transport()
        return
    _ack(channel, packet, ReasonCode.SUCCESS)


def _ack(channel: Channel, packet: Publish, reason_code: int) -> None:
    if channel.closing:
        return
    packet_id = packet.packet_id or 0
    # MQTT 3.1.1 acknowledgements carry no reason code
    code = reason_code if channel.level == MQTT_5 else ReasonCode.SUCCESS
    if packet.qos == 1:
        channel.send(Puback(packet_id, code, NO_PROPERTIES))
    elif packet.qos == 2:
        channel.send(Pubrec(packet_id, code, NO_PROPERTIES))
