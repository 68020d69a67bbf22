"""One client connection: reads packets, runs the MQTT protocol for them, writes
packets. Transport-agnostic: TCP, TLS and WebSocket listeners feed it bytes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..auth import AccessControl
from ..core.broker import Broker
from ..ds import Message, MessageProperties
from ..errors import StratamqError
from ..metrics import (
    BYTES_RECEIVED,
    BYTES_SENT,
    MESSAGES_DROPPED,
    messages_delivered,
    messages_received,
    packets_received,
    packets_sent,
)
from ..mqtt import (
    MQTT_5,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketReader,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
    encode,
)
from ..mqtt.errors import MqttCodecError, UnsupportedProtocolVersionError
from ..session.model import Subscription, WillRecord, split_shared
from ..session.session import Delivery, Session
from ..topic import validate_filter, validate_topic

log = logging.getLogger(__name__)

NEVER_EXPIRES = 0xFFFFFFFF


class Transport(Protocol):
    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def buffered(self) -> int:
        """Bytes written but not yet sent (for slow-consumer protection)."""
        ...


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_packet_size: int = 1024 * 1024
    max_topic_levels: int = 128
    max_inflight: int = 32
    receive_maximum: int = 128  # what clients may have in flight towards us
    topic_alias_maximum: int = 64
    connect_timeout: float = 10.0
    max_keepalive: int = 65535
    max_write_buffer: int = 8 * 1024 * 1024


_NO_PROPERTIES = Properties()


class ConnectionClosed(Exception):
    """Raised inside the connection to end it (after any DISCONNECT is sent)."""


def _to_message_properties(properties: Properties) -> MessageProperties:
    return MessageProperties(
        payload_format_indicator=properties.payload_format_indicator,
        message_expiry_interval=properties.message_expiry_interval,
        content_type=properties.content_type,
        response_topic=properties.response_topic,
        correlation_data=properties.correlation_data,
        user_properties=tuple(properties.user_properties),
    )


class Connection:
    def __init__(self, broker: Broker, access: AccessControl, transport: Transport,
                 limits: ConnectionLimits, listener: str, peer: str) -> None:
        self.broker = broker
        self.access = access
        self.transport = transport
        self.limits = limits
        self.listener = listener
        self.peer = peer
        self.client_id = ""
        self.username: str | None = None
        self.level = 4
        self.connected_at = time.time()
        self.keepalive = 0
        self.receive_maximum = limits.max_inflight
        self.session: Session | None = None
        self._reader = PacketReader(limits.max_packet_size)
        self._client_max_packet = 0x7FFFFFFF
        self._inbound_aliases: dict[int, str] = {}
        self._outbound_aliases: dict[str, int] = {}
        self._client_alias_maximum = 0
        self._inbound_qos_pending = 0
        self._closing = False
        self._will_on_close = True
        self._kicked = asyncio.Event()

    # -- the read loop ------------------------------------------------------------

    async def run(self, read: Callable[[], Awaitable[bytes]]) -> None:
        """Serve the connection until it ends; never raises."""
        try:
            await self._serve(read)
        except ConnectionClosed:
            pass
        except UnsupportedProtocolVersionError:
            # CONNACK in the 3.1.1 format, return code 1 (MQTT-3.1.2-2)
            self.level = 4
            self._send(Connack(False, 0x84))
        except MqttCodecError as error:
            self._disconnect(error.mqtt_reason_code)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception:  # a bug must end this connection, never the site
            log.exception("connection %s (%s) failed", self.client_id or "?", self.peer)
            self._disconnect(0x80)
        finally:
            await self._finish()

    async def _serve(self, read: Callable[[], Awaitable[bytes]]) -> None:
        timeout: float | None = self.limits.connect_timeout
        while not self._closing:
            try:
                # asyncio.timeout, not wait_for: no task per read
                async with asyncio.timeout(timeout):
                    data = await read()
            except TimeoutError:
                self._disconnect(0x8D)  # Keep Alive timeout
                raise ConnectionClosed() from None
            if not data:
                raise ConnectionClosed()
            BYTES_RECEIVED.inc(len(data))
            for packet in self._reader.feed(data):
                packets_received(type(packet).__name__.lower()).inc()
                await self._handle(packet)
            timeout = self.keepalive * 1.5 if self.keepalive else None
            if self.session is None:
                timeout = self.limits.connect_timeout

    async def _handle(self, packet: Packet) -> None:
        if isinstance(packet, Publish):
            await self._on_publish(packet)
        elif isinstance(packet, Puback):
            self._session().on_puback(packet.packet_id)
        elif isinstance(packet, Pubrec):
            await self._session().on_pubrec(packet.packet_id, packet.reason_code >= 0x80)
        elif isinstance(packet, Pubrel):
            await self._on_pubrel(packet)
        elif isinstance(packet, Pubcomp):
            self._session().on_pubcomp(packet.packet_id)
        elif isinstance(packet, Subscribe):
            await self._on_subscribe(packet)
        elif isinstance(packet, Unsubscribe):
            await self._on_unsubscribe(packet)
        elif isinstance(packet, Pingreq):
            self._send(Pingresp())
        elif isinstance(packet, Disconnect):
            await self._on_disconnect(packet)
        elif isinstance(packet, Connect):
            await self._on_connect(packet)
        elif isinstance(packet, Auth):
            self._disconnect(0x82)  # no enhanced authentication: AUTH is a protocol error
            raise ConnectionClosed()
        else:  # CONNACK, SUBACK, ... are server-to-client only
            self._disconnect(0x82)
            raise ConnectionClosed()

    def _session(self) -> Session:
        assert self.session is not None
        return self.session

    # -- CONNECT ------------------------------------------------------------------

    async def _on_connect(self, packet: Connect) -> None:
        self.level = packet.protocol_level
        properties = packet.properties
        if properties.authentication_method is not None:
            self._refuse(0x8C)  # Bad authentication method: no enhanced auth here
        client_id = packet.client_id
        assigned = None
        if not client_id:
            if self.level < MQTT_5 and not packet.clean_start:
                self._refuse(0x85)
            client_id = assigned = f"stratamq-{uuid.uuid4().hex[:16]}"
        self.client_id = client_id
        self.username = packet.username
        reason = await self.access.authenticate_async(client_id, packet.username,
                                                      packet.password)
        if reason != 0:
            self._refuse(reason)
        if packet.will is not None and not self.access.authorize_publish(
                client_id, packet.username, packet.will.topic):
            self._refuse(0x87)
        if self.level == MQTT_5:
            expiry = properties.session_expiry_interval or 0
            if properties.receive_maximum:
                self.receive_maximum = min(properties.receive_maximum, self.limits.max_inflight)
            if properties.maximum_packet_size:
                self._client_max_packet = properties.maximum_packet_size
            self._client_alias_maximum = properties.topic_alias_maximum or 0
        else:
            expiry = 0 if packet.clean_start else NEVER_EXPIRES
        self.keepalive = packet.keepalive
        server_keepalive = None
        if self.keepalive > self.limits.max_keepalive or \
                (self.keepalive == 0 and self.limits.max_keepalive < 65535):
            self.keepalive = server_keepalive = self.limits.max_keepalive
        session, present = await self.broker.registry.open_session(self, packet.clean_start, expiry)
        self.session = session
        if packet.will is not None:
            will = packet.will
            session.set_will(WillRecord(will.topic, will.payload, will.qos, will.retain,
                                        _to_message_properties(will.properties),
                                        will.properties.will_delay_interval or 0))
        else:
            session.set_will(None)
        connack_properties = Properties()
        if self.level == MQTT_5:
            connack_properties.assigned_client_identifier = assigned
            connack_properties.receive_maximum = self.limits.receive_maximum
            connack_properties.maximum_packet_size = self.limits.max_packet_size
            connack_properties.topic_alias_maximum = self.limits.topic_alias_maximum
            connack_properties.server_keep_alive = server_keepalive
        self._send(Connack(present, 0, connack_properties))
        if session.durable:
            await self.broker.registry.persist(session)
        session.attach(self)

    def _refuse(self, reason_code: int) -> None:
        self._send(Connack(False, reason_code))
        self._will_on_close = False
        raise ConnectionClosed()

    # -- PUBLISH in ---------------------------------------------------------------

    async def _on_publish(self, packet: Publish) -> None:
        session = self._session()
        topic = packet.topic
        alias = packet.properties.topic_alias
        if packet.properties.subscription_identifiers:
            self._disconnect(0x82)  # only the server sets them (MQTT-3.3.4-6)
            raise ConnectionClosed()
        if not topic and alias is None:
            self._disconnect(0x82)  # an empty topic needs an alias (MQTT-3.3.2-8)
            raise ConnectionClosed()
        if alias is not None:
            if not 0 < alias <= self.limits.topic_alias_maximum:
                self._disconnect(0x94)  # Topic Alias invalid
                raise ConnectionClosed()
            if topic:
                self._inbound_aliases[alias] = topic
            else:
                topic = self._inbound_aliases.get(alias, "")
                if not topic:
                    self._disconnect(0x82)
                    raise ConnectionClosed()
        try:
            levels = validate_topic(topic)
        except StratamqError:
            self._disconnect(0x90)
            raise ConnectionClosed() from None
        if len(levels) > self.limits.max_topic_levels:
            self._disconnect(0x90)
            raise ConnectionClosed()
        if packet.qos == 2 and session.inbound_qos2_pending(packet.packet_id or 0):
            self._send(Pubrec(packet.packet_id or 0))  # a resend: stored already
            return
        if packet.qos > 0 and self.level == MQTT_5 \
                and self._inbound_qos_pending >= self.limits.receive_maximum:
            self._disconnect(0x93)  # Receive Maximum exceeded
            raise ConnectionClosed()
        if not self.access.authorize_publish(self.client_id, self.username, topic):
            MESSAGES_DROPPED.labels("not_authorized").inc()
            self._ack(packet, 0x87)
            return
        message = Message(topic, packet.payload, self.client_id, packet.qos, packet.retain,
                          _to_message_properties(packet.properties))
        messages_received(packet.qos).inc()
        try:
            waits = self.broker.publisher.publish(message, wait=packet.qos > 0,
                                        qos2_packet_id=packet.packet_id if packet.qos == 2
                                        else None)
        except StratamqError as error:
            self._disconnect(error.mqtt_reason_code)
            raise ConnectionClosed() from None
        if packet.qos == 0:
            return
        self._inbound_qos_pending += 1
        done = waits[0] if len(waits) == 1 else asyncio.gather(*waits)
        done.add_done_callback(lambda future: self._stored(packet, future))

    def _stored(self, packet: Publish, future: asyncio.Future[Any]) -> None:
        """A QoS 1/2 message is durable (or failed): only now is it acknowledged."""
        self._inbound_qos_pending -= 1
        if self._closing:
            return
        if future.cancelled() or future.exception() is not None:
            log.error("store failed for %s: %s", self.client_id,
                      None if future.cancelled() else future.exception())
            self._disconnect(0x80)
            self._close_transport()
            return
        if packet.qos == 2:
            # its packet id was recorded with it: a resend is now recognised
            self._session().inbound_qos2_stored(packet.packet_id or 0)
        self._ack(packet, 0)

    def _ack(self, packet: Publish, reason_code: int) -> None:
        if self._closing:
            return
        packet_id = packet.packet_id or 0
        if packet.qos == 1:
            self._send(Puback(packet_id, reason_code if self.level == MQTT_5 else 0))
        elif packet.qos == 2:
            self._send(Pubrec(packet_id, reason_code if self.level == MQTT_5 else 0))

    async def _on_pubrel(self, packet: Pubrel) -> None:
        session = self._session()
        packet_id = packet.packet_id
        if not session.inbound_qos2_pending(packet_id):
            self._send(Pubcomp(packet_id, 0 if self.level < MQTT_5 else 0x92))
            return
        session.inbound_qos2_released(packet_id)
        released = asyncio.gather(*self.broker.publisher.release_qos2(self.client_id, packet_id))
        released.add_done_callback(lambda future: self._released(packet_id, future))

    def _released(self, packet_id: int, future: asyncio.Future[list[None]]) -> None:
        """The packet id is forgotten durably: only now may the client reuse it."""
        if self._closing:
            return
        if future.cancelled() or future.exception() is not None:
            self._disconnect(0x80)
            self._close_transport()
            return
        self._send(Pubcomp(packet_id))

    # -- SUBSCRIBE / UNSUBSCRIBE --------------------------------------------------

    async def _on_subscribe(self, packet: Subscribe) -> None:
        session = self._session()
        identifiers = packet.properties.subscription_identifiers
        identifier = identifiers[0] if identifiers else None
        codes: list[int] = []
        retained_to_send: list[Subscription] = []
        for raw_filter, options in packet.subscriptions:
            try:
                group, topic_filter = split_shared(raw_filter)
                levels = validate_filter(topic_filter)
            except (ValueError, StratamqError):
                codes.append(0x8F)
                continue
            if len(levels) > self.limits.max_topic_levels:
                codes.append(0x8F)
                continue
            if group is not None and options.no_local:
                self._disconnect(0x82)  # no local on a shared subscription
                raise ConnectionClosed()
            if not self.access.authorize_subscribe(self.client_id, self.username, raw_filter):
                codes.append(0x87)
                continue
            subscription = Subscription(topic_filter, options.qos, options.no_local,
                                        options.retain_as_published, options.retain_handling,
                                        identifier, group, time.time_ns() // 1000)
            is_new = session.subscribe(subscription)
            self.broker.dispatcher.route(session, subscription)
            codes.append(options.qos)
            if group is None and (options.retain_handling == 0
                                  or (options.retain_handling == 1 and is_new)):
                retained_to_send.append(subscription)
        if session.durable:
            await self.broker.registry.persist(session)
        # Look the retained messages up before SUBACK: one published after the client
        # has its SUBACK reaches it through the subscription only, not twice.
        retained = [(subscription, message) for subscription in retained_to_send
                    for message in await self.broker.retained.matching(
                        subscription.topic_filter)]
        self._send(Suback(packet.packet_id, codes))
        for subscription, message in retained:
            session.offer(Delivery(message, min(message.qos, subscription.qos), True,
                                   (subscription.identifier,)
                                   if subscription.identifier else ()))

    async def _on_unsubscribe(self, packet: Unsubscribe) -> None:
        session = self._session()
        codes = []
        for raw_filter in packet.topic_filters:
            removed = session.unsubscribe(raw_filter)
            if removed is not None:
                self.broker.dispatcher.unroute(session, removed)
            codes.append(0x00 if removed is not None else 0x11)
        if session.durable:
            await self.broker.registry.persist(session)
        self._send(Unsuback(packet.packet_id, codes if self.level == MQTT_5 else []))

    # -- DISCONNECT ---------------------------------------------------------------

    async def _on_disconnect(self, packet: Disconnect) -> None:
        session = self._session()
        requested = packet.properties.session_expiry_interval
        if requested is not None:
            if session.expiry_interval == 0 and requested > 0:
                self._disconnect(0x82)  # may not turn a session durable at the end
                raise ConnectionClosed()
            session.set_expiry_interval(requested)  # 0: the session ends with this connection
        # Only a normal disconnection (0x00) discards the will; 0x04 asks for it, and
        # an error code leaves it in place (MQTT 5.0 sections 3.1.2.5 and 3.14.4).
        self._will_on_close = packet.reason_code != 0x00
        raise ConnectionClosed()

    async def kick(self, reason_code: int) -> None:
        """Another connection took this session over."""
        self._disconnect(reason_code)
        self._close_transport()
        await self._kicked.wait()

    def _disconnect(self, reason_code: int) -> None:
        """Tell the client why (MQTT 5 only; 3.1.1 just closes) and stop reading."""
        if self._closing:
            return
        if self.level == MQTT_5 and self.session is not None:
            self._send(Disconnect(reason_code))
        elif self.level == MQTT_5 and reason_code >= 0x80 and self.session is None:
            self._send(Connack(False, reason_code))
        self._closing = True

    def _close_transport(self) -> None:
        self._closing = True
        with contextlib.suppress(Exception):
            self.transport.close()

    async def _finish(self) -> None:
        self._closing = True
        self._close_transport()
        session = self.session
        if session is not None:
            self.session = None
            await self.broker.registry.close_session(self, session, self._will_on_close)
        self._kicked.set()

    # -- sending ------------------------------------------------------------------

    def _send(self, packet: Packet) -> None:
        data = encode(packet, self.level)
        packets_sent(type(packet).__name__.lower()).inc()
        BYTES_SENT.inc(len(data))
        self.transport.write(data)

    def send_pubrel(self, packet_id: int) -> None:
        if not self._closing:
            self._send(Pubrel(packet_id))

    def send_publish(self, delivery: Delivery, packet_id: int | None, dup: bool) -> bool:
        if self._closing:
            return True
        if delivery.qos == 0 and self.transport.buffered() > self.limits.max_write_buffer:
            MESSAGES_DROPPED.labels("slow_consumer").inc()
            return True
        message = delivery.message
        if self.level < MQTT_5:
            properties = _NO_PROPERTIES  # not written before MQTT 5, never changed
        else:
            properties = Properties()
            source = message.properties
            properties.payload_format_indicator = source.payload_format_indicator
            properties.content_type = source.content_type
            properties.response_topic = source.response_topic
            properties.correlation_data = source.correlation_data
            properties.user_properties = list(source.user_properties)
            if source.message_expiry_interval is not None:
                waited = (time.time_ns() // 1000 - message.timestamp) // 1_000_000
                properties.message_expiry_interval = max(
                    source.message_expiry_interval - waited, 1)
            properties.subscription_identifiers = list(delivery.subscription_ids)
        topic = message.topic
        if self._client_alias_maximum:
            alias = self._outbound_aliases.get(topic)
            if alias is not None:
                properties.topic_alias = alias
                topic = ""
            elif len(self._outbound_aliases) < self._client_alias_maximum:
                alias = len(self._outbound_aliases) + 1
                self._outbound_aliases[topic] = alias
                properties.topic_alias = alias
        packet = Publish(topic, message.payload, delivery.qos, delivery.retain, dup, packet_id,
                         properties)
        data = encode(packet, self.level)
        if len(data) > self._client_max_packet:
            MESSAGES_DROPPED.labels("too_large_for_client").inc()
            if properties.topic_alias is not None and topic:
                del self._outbound_aliases[topic]
            return False
        packets_sent("publish").inc()
        messages_delivered(delivery.qos).inc()
        BYTES_SENT.inc(len(data))
        self.transport.write(data)
        return True
