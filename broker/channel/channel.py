"""One client connection's protocol state: who the client is, what it negotiated,
its topic aliases, and the session it holds. Inbound packets go to one handler per
packet type (handle_*.py); outbound packets leave through `send` and the `Outlet`
methods a session calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..auth import AccessControl
from ..core.broker import Broker
from ..deadlines import Deadlines
from ..ds import FencedError
from ..errors import StratamqError
from ..flag import Flag
from ..metrics import BYTES_SENT, MESSAGES_DROPPED, messages_delivered, packets_sent
from ..mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketReader,
    Pingreq,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    ReasonCode,
    Subscribe,
    Unsubscribe,
    encode,
    encode_publish,
)
from ..mqtt.errors import MqttCodecError, UnsupportedProtocolVersionError
from ..net.read_loop import ConnectionClosed, read_packets
from ..net.transport import Transport
from ..session.outbox import Delivery
from ..session.session import Session
from . import (
    handle_acks,
    handle_connect,
    handle_disconnect,
    handle_ping,
    handle_publish,
    handle_pubrel,
    handle_subscribe,
    handle_unsubscribe,
)
from .properties import NO_PROPERTIES, to_publish_properties
from .retained_sender import RetainedSender

log = logging.getLogger(__name__)

# Any packet fits until the client announces its Maximum Packet Size.
NO_PACKET_LIMIT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class ChannelLimits:
    max_packet_size: int = 1024 * 1024
    max_topic_levels: int = 128
    max_subscriptions: int = 1000
    max_inflight: int = 128
    receive_maximum: int = 128  # what clients may have in flight towards us
    topic_alias_maximum: int = 64
    connect_timeout: float = 10.0
    max_connect_packet_size: int = 64 * 1024
    max_keepalive: int = 65535
    max_write_buffer: int = 8 * 1024 * 1024


Handler = Callable[["Channel", Any], Awaitable[None] | None]


# The disconnects a client brings on itself, said in the site's log (one line per
# connection at most): a client cut off that reconnects in a loop is otherwise a
# mystery to whoever runs the site. Takeovers, stops and storage trouble are said
# elsewhere or are no fault of the client.
_CLIENT_FAULTS = frozenset({
    ReasonCode.MALFORMED_PACKET, ReasonCode.PROTOCOL_ERROR, ReasonCode.KEEP_ALIVE_TIMEOUT,
    ReasonCode.TOPIC_FILTER_INVALID, ReasonCode.TOPIC_NAME_INVALID,
    ReasonCode.RECEIVE_MAXIMUM_EXCEEDED, ReasonCode.TOPIC_ALIAS_INVALID,
    ReasonCode.PACKET_TOO_LARGE, ReasonCode.MESSAGE_RATE_TOO_HIGH,
    ReasonCode.QUOTA_EXCEEDED, ReasonCode.PAYLOAD_FORMAT_INVALID,
    ReasonCode.RETAIN_NOT_SUPPORTED, ReasonCode.QOS_NOT_SUPPORTED,
})


def _protocol_error(channel: Channel, _packet: Packet) -> None:
    # AUTH (no enhanced authentication here), and CONNACK, SUBACK, ... which only a
    # server sends.
    channel.disconnect(ReasonCode.PROTOCOL_ERROR)
    raise ConnectionClosed()


_HANDLERS: dict[type[Packet], Handler] = {
    Publish: handle_publish.handle_publish,
    Puback: handle_acks.handle_puback,
    Pubrec: handle_acks.handle_pubrec,
    Pubrel: handle_pubrel.handle_pubrel,
    Pubcomp: handle_acks.handle_pubcomp,
    Subscribe: handle_subscribe.handle_subscribe,
    Unsubscribe: handle_unsubscribe.handle_unsubscribe,
    Pingreq: handle_ping.handle_pingreq,
    Disconnect: handle_disconnect.handle_disconnect,
    Connect: handle_connect.handle_connect,
    Auth: _protocol_error,
}


class Channel:
    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_deadlines", "_kicked", "_outbound_aliases", "_reader", "access", "broker",
                 "client_alias_maximum", "client_id", "client_max_packet", "closing",
                 "connected_at", "inbound_aliases", "inbound_qos_pending", "inbound_slot_freed",
                 "keepalive", "last_store", "level", "limits", "listener", "peer",
                 "receive_maximum", "retained", "session", "transport", "username", "will_on_close")

    def __init__(self, broker: Broker, access: AccessControl, transport: Transport,
                 limits: ChannelLimits, listener: str, peer: str,
                 deadlines: Deadlines) -> None:
        self.broker = broker
        self.access = access
        self.transport = transport
        self.limits = limits
        self.listener = listener
        self.peer = peer
        self.client_id = ""
        self.username: str | None = None
        self.level = MQTT_3_1_1
        self.connected_at = time.time()
        self.keepalive = 0
        self.receive_maximum = limits.max_inflight
        self.session: Session | None = None
        self.client_max_packet = NO_PACKET_LIMIT
        self.inbound_aliases: dict[int, str] = {}
        self.client_alias_maximum = 0
        self.inbound_qos_pending = 0
        self.inbound_slot_freed = Flag()  # set as inbound_qos_pending falls
        # The store of this client's latest QoS 1/2 message: once it has failed, nothing
        # more is stored from this connection (see handle_publish).
        self.last_store: asyncio.Future[None] | None = None
        self.closing = False
        self.will_on_close = True
        # the retained messages its SUBSCRIBEs ask for, sent as the queue has room
        self.retained = RetainedSender(broker.retained)
        self._reader = PacketReader(limits.max_packet_size,
                                    max_connect_size=limits.max_connect_packet_size)
        self._outbound_aliases: dict[str, int] = {}
        self._kicked = Flag()
        self._deadlines = deadlines  # the site's, for every connection's read deadline

    # -- the connection's life ----------------------------------------------------

    async def run(self, read: Callable[[], Awaitable[bytes]]) -> None:
        """Serve the connection until it ends; never raises."""
        try:
            await read_packets(read, self._reader, self, self._deadlines)
        except ConnectionClosed:
            pass
        except UnsupportedProtocolVersionError:
            # CONNACK in the 3.1.1 format, return code 1 (MQTT-3.1.2-2)
            self.level = MQTT_3_1_1
            self.send(Connack(False, ReasonCode.UNSUPPORTED_PROTOCOL_VERSION))
        except MqttCodecError as error:
            self.disconnect(error.mqtt_reason_code)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except FencedError:
            # a write of the session was refused: another site took it over (and this
            # one heard of it only now); the registry has dropped it here
            self.disconnect(ReasonCode.SESSION_TAKEN_OVER)
        except Exception as error:  # a bug must end this connection, never the site
            if isinstance(error, StratamqError) and error.recoverable:
                # storage slow or not readable yet (a write or read timed out): a
                # passing state, said in a line; 0x89 Server busy: try again later
                # (0x88 Server unavailable is for a CONNACK only)
                log.warning("connection %s (%s) closed: %s", self.client_id or "?",
                            self.peer, error.message)
                self.disconnect(ReasonCode.SERVER_BUSY)
            else:
                log.exception("connection %s (%s) failed", self.client_id or "?",
                              self.peer)
                self.disconnect(ReasonCode.UNSPECIFIED_ERROR)
        finally:
            await self._finish()

    def read_timeout(self) -> float | None:
        if self.session is None:
            return self.limits.connect_timeout
        return self.keepalive * 1.5 if self.keepalive else None

    def on_read_timeout(self) -> None:
        self.disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)

    def handle(self, packet: Packet) -> Awaitable[None] | None:
        return _HANDLERS.get(type(packet), _protocol_error)(self, packet)

    def attached_session(self) -> Session:
        assert self.session is not None
        return self.session

    async def kick(self, reason_code: int) -> None:
        """Another connection took this session over, or the site is stopping."""
        self.disconnect(reason_code)
        self.close_transport()
        await self._kicked.wait()

    def refuse(self, reason_code: int) -> NoReturn:
        """Answer CONNECT with a refusal and end the connection."""
        self.send(Connack(False, reason_code))
        self.will_on_close = False
        raise ConnectionClosed()

    def disconnect(self, reason_code: int, detail: str = "") -> None:
        """Tell the client why (MQTT 5 only; 3.1.1 just closes) and stop reading.
        `detail` goes to the log line of a client fault (the limit it broke)."""
        if self.closing:
            return
        if reason_code in _CLIENT_FAULTS:
            log.info("client %s (%s) disconnected: %s (0x%02X)%s", self.client_id or "?",
                     self.peer, ReasonCode(reason_code).name.lower().replace("_", " "),
                     reason_code, f": {detail}" if detail else "")
        if self.level == MQTT_5 and self.session is not None:
            self.send(Disconnect(reason_code))
        elif self.level == MQTT_5 and reason_code >= ReasonCode.UNSPECIFIED_ERROR \
                and self.session is None:
            self.send(Connack(False, reason_code))
        self.closing = True

    def close_transport(self) -> None:
        self.closing = True
        with contextlib.suppress(Exception):
            self.transport.close()

    async def _finish(self) -> None:
        self.closing = True
        self.close_transport()
        session = self.session
        try:
            # before the session is detached: a connection that takes it over next
            # gets none of the retained messages this one asked for
            await self.retained.close()
            if session is not None:
                self.session = None
                await self.broker.registry.close_session(self, session, self.will_on_close)
        finally:
            self._kicked.set()  # a connection taking the session over waits for this

    # -- sending ------------------------------------------------------------------

    def send(self, packet: Packet) -> None:
        data = encode(packet, self.level)
        packets_sent(type(packet).__name__).inc()
        BYTES_SENT.inc(len(data))
        self.transport.write(data)

    def may_subscribe(self, topic_filter: str) -> bool:
        return self.access.authorize_subscribe(self.client_id, self.username, topic_filter)

    def may_receive(self, topic: str) -> bool:
        return self.access.authorize_delivery(self.client_id, self.username, topic)

    def send_pubrel(self, packet_id: int) -> None:
        if not self.closing:
            self.send(Pubrel(packet_id))

    def send_publish(self, delivery: Delivery, packet_id: int | None, dup: bool) -> bool:
        if self.closing:
            return True
        if delivery.qos == 0 and self.transport.buffered() > self.limits.max_write_buffer:
            MESSAGES_DROPPED.labels("slow_consumer").inc()
            return True
        message = delivery.message
        if self.level < MQTT_5:
            properties = NO_PROPERTIES
        else:
            properties = to_publish_properties(message, delivery.subscription_ids)
        topic = message.topic
        if self.client_alias_maximum:
            alias = self._outbound_aliases.get(topic)
            if alias is not None:
                properties.topic_alias = alias
                topic = ""
            elif len(self._outbound_aliases) < self.client_alias_maximum:
                alias = len(self._outbound_aliases) + 1
                self._outbound_aliases[topic] = alias
                properties.topic_alias = alias
        data = encode_publish(topic, message.payload, delivery.qos, delivery.retain, dup,
                              packet_id, properties, self.level)
        if len(data) > self.client_max_packet:
            MESSAGES_DROPPED.labels("too_large_for_client").inc()
            if properties.topic_alias is not None and topic:
                del self._outbound_aliases[topic]
            return False
        packets_sent("Publish").inc()
        messages_delivered(delivery.qos).inc()
        BYTES_SENT.inc(len(data))
        self.transport.write(data)
        return True
