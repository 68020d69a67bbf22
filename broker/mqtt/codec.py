"""Encoding and decoding of MQTT control packets, and the stream reader a connection
hands its bytes to.

Decoding is strict: whatever the spec calls a Malformed Packet or a Protocol Error
raises MalformedPacketError or ProtocolError, so a listener can answer with the error's
`mqtt_reason_code` and close. Checks that need session state (topic alias maximum,
packet ids in flight, who may send which packet, topic syntax) are the session's.

Protocol levels: 5 is MQTT 5.0; 4 is MQTT 3.1.1; 3 is MQTT 3.1, accepted and handled
with the 3.1.1 wire format (the two differ on the wire only in the CONNECT protocol
name, "MQIsdp"). A decoded Connect says which level the connection speaks.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeVar

from .errors import MalformedPacketError, PacketTooLargeError, ProtocolError
from .errors import UnsupportedProtocolVersionError as _Unsupported
from .packets import (
    MQTT_3_1,
    MQTT_5,
    PROTOCOL_LEVELS,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from .properties import (
    NO_PROPERTIES,
    WILL_PROPERTIES,
    Properties,
    decode_properties,
    encode_properties,
)
from .reason_codes import (
    AUTH_REASON_CODES,
    CONNACK_REASON_CODES,
    CONNACK_RETURN_CODES_V3,
    DISCONNECT_REASON_CODES,
    PUBACK_REASON_CODES,
    PUBCOMP_REASON_CODES,
    PUBREC_REASON_CODES,
    PUBREL_REASON_CODES,
    SUBACK_FAILURE_V3,
    SUBACK_REASON_CODES,
    SUBACK_RETURN_CODES_V3,
    UNSUBACK_REASON_CODES,
    connack_return_code,
)
from .wire import (
    U16,
    PacketType,
    binary_field,
    encode_varint,
    read_binary,
    read_u8,
    read_u16,
    read_utf8,
    scan_varint,
    utf8_field,
)

_PROTOCOL_NAMES = {MQTT_3_1: "MQIsdp", 4: "MQTT", MQTT_5: "MQTT"}

# The low nibble of the first byte each packet type must carry (MQTT 5.0 table 2-2);
# anything else is a Malformed Packet. PUBLISH is the one type whose bits mean something.
_FIXED_FLAGS: dict[int, int] = {
    PacketType.CONNECT: 0, PacketType.CONNACK: 0, PacketType.PUBACK: 0,
    PacketType.PUBREC: 0, PacketType.PUBREL: 2, PacketType.PUBCOMP: 0,
    PacketType.SUBSCRIBE: 2, PacketType.SUBACK: 0, PacketType.UNSUBSCRIBE: 2,
    PacketType.UNSUBACK: 0, PacketType.PINGREQ: 0, PacketType.PINGRESP: 0,
    PacketType.DISCONNECT: 0, PacketType.AUTH: 0,
}

# Plain ints for the hot paths: reading an IntEnum member costs ~50 ns in CPython 3.11.
_CONNECT = int(PacketType.CONNECT)
_PUBLISH = int(PacketType.PUBLISH)

# A decoder reads the body that lies in buf[pos:end].
_Decoder = Callable[[bytes, int, int, int], Packet]


# --- decoding ---------------------------------------------------------------------------

def decode(data: bytes | bytearray | memoryview, protocol_level: int) -> Packet:
    """Decode `data`, which must hold exactly one whole packet (fixed header included).
    `protocol_level` is the connection's level; a CONNECT carries its own."""
    _check_level(protocol_level)
    buf = bytes(data)  # no copy when data is already bytes
    size = len(buf)
    if size < 2:
        raise MalformedPacketError("packet is shorter than its fixed header")
    if buf[1] < 0x80:
        remaining, start = buf[1], 2
    else:
        header = scan_varint(buf, 1, size)
        if header is None:
            raise MalformedPacketError("packet is shorter than its fixed header")
        remaining, start = header
    if start + remaining != size:
        raise MalformedPacketError(
            f"remaining length is {remaining} but {size - start} bytes follow")
    return _decode(buf[0], buf, start, size, protocol_level)


def decode_body(first_byte: int, body: bytes, protocol_level: int) -> Packet:
    """Decode one packet from its first byte and the `body` its remaining length
    covers."""
    _check_level(protocol_level)
    return _decode(first_byte, body, 0, len(body), protocol_level)


def _decode(first_byte: int, buf: bytes, pos: int, end: int, level: int) -> Packet:
    packet_type = first_byte >> 4
    if packet_type == _PUBLISH:
        return _decode_publish(first_byte & 0x0F, buf, pos, end, level)
    if packet_type == 0:
        raise MalformedPacketError("packet type 0 is reserved")
    if first_byte & 0x0F != _FIXED_FLAGS[packet_type]:
        raise MalformedPacketError(
            f"{PacketType(packet_type).name} has reserved flags 0x{first_byte & 0x0F:x}")
    return _DECODERS[packet_type](buf, pos, end, level)


def _check_level(protocol_level: int) -> None:
    if protocol_level not in PROTOCOL_LEVELS:
        raise ValueError(f"protocol level {protocol_level} is not one of {PROTOCOL_LEVELS}")


def _expect_end(pos: int, end: int, what: str) -> None:
    if pos != end:
        raise MalformedPacketError(f"{end - pos} bytes left over at the end of {what}")


def _packet_id(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    packet_id, pos = read_u16(buf, pos, end, f"{what} packet identifier")
    if packet_id == 0:
        raise MalformedPacketError(f"{what} packet identifier is 0")
    return packet_id, pos


def _decode_publish(flags: int, buf: bytes, pos: int, end: int, level: int) -> Publish:
    # The broker's hot path: reads are inlined rather than going through wire helpers.
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacketError("PUBLISH with QoS 3")
    dup = flags & 0x08 != 0
    if dup and qos == 0:
        raise MalformedPacketError("PUBLISH with DUP set at QoS 0")  # MQTT-3.3.1-2
    if pos + 2 > end:
        raise MalformedPacketError("PUBLISH topic length is truncated")
    topic_end = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if topic_end > end:
        raise MalformedPacketError("PUBLISH topic is longer than its packet")
    try:
        topic = buf[pos + 2:topic_end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPacketError("PUBLISH topic is not well-formed UTF-8") from exc
    if "\x00" in topic:
        raise MalformedPacketError("PUBLISH topic contains U+0000")
    pos = topic_end
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise MalformedPacketError("PUBLISH packet identifier is truncated")
        packet_id = (buf[pos] << 8) | buf[pos + 1]
        if packet_id == 0:
            raise MalformedPacketError("PUBLISH packet identifier is 0")
        pos += 2
    if level == MQTT_5:
        properties, pos = decode_properties(buf, pos, end, _PUBLISH)
    else:
        properties = Properties()
    return Publish(topic, buf[pos:end], qos, flags & 0x01 != 0, dup, packet_id, properties)


def _decode_connect(buf: bytes, pos: int, end: int, _level: int) -> Connect:
    name, pos = read_utf8(buf, pos, end, "protocol name")
    if pos >= end:
        raise _Unsupported("CONNECT ends before its protocol level")
    level = buf[pos]
    pos += 1
    if _PROTOCOL_NAMES.get(level) != name:
        raise _Unsupported(f"protocol {name!r} level {level} is not supported", level)
    flags, pos = read_u8(buf, pos, end, "connect flags")
    if flags & 0x01:
        raise MalformedPacketError("CONNECT reserved flag is set")  # MQTT-3.1.2-3
    has_will = flags & 0x04 != 0
    will_qos = (flags >> 3) & 0x03
    will_retain = flags & 0x20 != 0
    if has_will:
        if will_qos == 3:
            raise MalformedPacketError("will QoS 3")
    elif will_qos or will_retain:
        raise MalformedPacketError("will QoS or will retain set without the will flag")
    has_password = flags & 0x40 != 0
    has_username = flags & 0x80 != 0
    if has_password and not has_username and level != MQTT_5:
        # MQTT 5 allows a password alone (3.1.2.9); 3.1.1 does not (MQTT-3.1.2-22).
        raise MalformedPacketError("password flag set without the user name flag")
    keepalive, pos = read_u16(buf, pos, end, "keep alive")
    if level == MQTT_5:
        properties, pos = decode_properties(buf, pos, end, PacketType.CONNECT)
    else:
        properties = Properties()
    client_id, pos = read_utf8(buf, pos, end, "client identifier")
    will = None
    if has_will:
        if level == MQTT_5:
            will_properties, pos = decode_properties(buf, pos, end, WILL_PROPERTIES)
        else:
            will_properties = Properties()
        will_topic, pos = read_utf8(buf, pos, end, "will topic")
        will_payload, pos = read_binary(buf, pos, end, "will payload")
        will = Will(will_topic, will_payload, will_qos, will_retain, will_properties)
    username = password = None
    if has_username:
        username, pos = read_utf8(buf, pos, end, "user name")
    if has_password:
        password, pos = read_binary(buf, pos, end, "password")
    _expect_end(pos, end, "CONNECT")
    return Connect(client_id, level, flags & 0x02 != 0, keepalive, username, password,
                   will, properties)


def _decode_connack(buf: bytes, pos: int, end: int, level: int) -> Connack:
    flags, pos = read_u8(buf, pos, end, "CONNACK flags")
    if flags & 0xFE:
        raise MalformedPacketError("CONNACK reserved flags are set")
    code, pos = read_u8(buf, pos, end, "CONNACK reason code")
    if level == MQTT_5:
        allowed = CONNACK_REASON_CODES
        properties, pos = decode_properties(buf, pos, end, PacketType.CONNACK)
    else:
        allowed = CONNACK_RETURN_CODES_V3
        properties = Properties()
    _expect_end(pos, end, "CONNACK")
    if code not in allowed:
        raise ProtocolError(f"0x{code:02x} is not a CONNACK reason code")
    if flags and code:
        raise ProtocolError("CONNACK refuses the connection but says a session is present")
    return Connack(flags != 0, code, properties)


_AckT = TypeVar("_AckT", Puback, Pubrec, Pubrel, Pubcomp)


def _publish_ack_decoder(cls: type[_AckT], allowed: frozenset[int]) -> Callable[
        [bytes, int, int, int], _AckT]:
    packet_type = cls.packet_type
    what = packet_type.name

    def decode_ack(buf: bytes, pos: int, end: int, level: int) -> _AckT:
        size = end - pos
        if size < 2:
            raise MalformedPacketError(f"{what} packet identifier is truncated")
        packet_id = (buf[pos] << 8) | buf[pos + 1]
        if packet_id == 0:
            raise MalformedPacketError(f"{what} packet identifier is 0")
        if size == 2:
            return cls(packet_id, 0, NO_PROPERTIES)
        if level != MQTT_5:
            raise MalformedPacketError(f"{size - 2} bytes left over at the end of {what}")
        # MQTT 5 may leave out the reason code (meaning success), or only the properties.
        code = buf[pos + 2]
        if code not in allowed:
            raise ProtocolError(f"0x{code:02x} is not a {what} reason code")
        if size == 3:
            return cls(packet_id, code, NO_PROPERTIES)
        properties, pos = decode_properties(buf, pos + 3, end, packet_type)
        _expect_end(pos, end, what)
        return cls(packet_id, code, properties)

    return decode_ack


def _decode_subscribe(buf: bytes, pos: int, end: int, level: int) -> Subscribe:
    packet_id, pos = _packet_id(buf, pos, end, "SUBSCRIBE")
    if level == MQTT_5:
        properties, pos = decode_properties(buf, pos, end, PacketType.SUBSCRIBE)
    else:
        properties = Properties()
    subscriptions: list[tuple[str, SubscriptionOptions]] = []
    while pos < end:
        topic_filter, pos = read_utf8(buf, pos, end, "topic filter")
        options, pos = read_u8(buf, pos, end, "subscription options")
        qos = options & 0x03
        if level == MQTT_5:
            if options & 0xC0:
                raise MalformedPacketError("subscription options reserved bits are set")
            retain_handling = (options >> 4) & 0x03
            if qos == 3:
                raise ProtocolError("subscription with maximum QoS 3")
            if retain_handling == 3:
                raise ProtocolError("subscription with retain handling 3")
            subscriptions.append((topic_filter, SubscriptionOptions(
                qos, options & 0x04 != 0, options & 0x08 != 0, retain_handling)))
        else:
            if options & 0xFC or qos == 3:
                raise MalformedPacketError(f"subscription options 0x{options:02x}")
            subscriptions.append((topic_filter, SubscriptionOptions(qos)))
    if not subscriptions:
        raise ProtocolError("SUBSCRIBE without topic filters")  # MQTT-3.8.3-2
    return Subscribe(packet_id, subscriptions, properties)


def _decode_suback(buf: bytes, pos: int, end: int, level: int) -> Suback:
    packet_id, pos = _packet_id(buf, pos, end, "SUBACK")
    if level == MQTT_5:
        allowed = SUBACK_REASON_CODES
        properties, pos = decode_properties(buf, pos, end, PacketType.SUBACK)
    else:
        allowed = SUBACK_RETURN_CODES_V3
        properties = Properties()
    codes = list(buf[pos:end])
    if not codes:
        raise ProtocolError("SUBACK without reason codes")
    if not allowed.issuperset(codes):
        raise ProtocolError(f"SUBACK reason codes {codes} include one SUBACK cannot carry")
    return Suback(packet_id, codes, properties)


def _decode_unsubscribe(buf: bytes, pos: int, end: int, level: int) -> Unsubscribe:
    packet_id, pos = _packet_id(buf, pos, end, "UNSUBSCRIBE")
    if level == MQTT_5:
        properties, pos = decode_properties(buf, pos, end, PacketType.UNSUBSCRIBE)
    else:
        properties = Properties()
    topic_filters: list[str] = []
    while pos < end:
        topic_filter, pos = read_utf8(buf, pos, end, "topic filter")
        topic_filters.append(topic_filter)
    if not topic_filters:
        raise ProtocolError("UNSUBSCRIBE without topic filters")  # MQTT-3.10.3-2
    return Unsubscribe(packet_id, topic_filters, properties)


def _decode_unsuback(buf: bytes, pos: int, end: int, level: int) -> Unsuback:
    packet_id, pos = _packet_id(buf, pos, end, "UNSUBACK")
    if level != MQTT_5:
        _expect_end(pos, end, "UNSUBACK")
        return Unsuback(packet_id)
    properties, pos = decode_properties(buf, pos, end, PacketType.UNSUBACK)
    codes = list(buf[pos:end])
    if not codes:
        raise ProtocolError("UNSUBACK without reason codes")
    if not UNSUBACK_REASON_CODES.issuperset(codes):
        raise ProtocolError(f"UNSUBACK reason codes {codes} include one it cannot carry")
    return Unsuback(packet_id, codes, properties)


def _decode_pingreq(_buf: bytes, pos: int, end: int, _level: int) -> Pingreq:
    _expect_end(pos, end, "PINGREQ")
    return Pingreq()


def _decode_pingresp(_buf: bytes, pos: int, end: int, _level: int) -> Pingresp:
    _expect_end(pos, end, "PINGRESP")
    return Pingresp()


def _decode_disconnect(buf: bytes, pos: int, end: int, level: int) -> Disconnect:
    if pos == end:
        return Disconnect()
    if level != MQTT_5:
        raise MalformedPacketError(f"{end - pos} bytes left over at the end of DISCONNECT")
    code = buf[pos]
    if code not in DISCONNECT_REASON_CODES:
        raise ProtocolError(f"0x{code:02x} is not a DISCONNECT reason code")
    if end - pos == 1:
        return Disconnect(code)  # the property length may be left out (3.14.2.2.1)
    properties, pos = decode_properties(buf, pos + 1, end, PacketType.DISCONNECT)
    _expect_end(pos, end, "DISCONNECT")
    return Disconnect(code, properties)


def _decode_auth(buf: bytes, pos: int, end: int, level: int) -> Auth:
    if level != MQTT_5:
        raise MalformedPacketError("packet type 15 is reserved before MQTT 5")
    if pos == end:
        return Auth()
    code = buf[pos]
    if code not in AUTH_REASON_CODES:
        raise ProtocolError(f"0x{code:02x} is not an AUTH reason code")
    # Unlike DISCONNECT, AUTH may only leave out reason code and properties together.
    properties, pos = decode_properties(buf, pos + 1, end, PacketType.AUTH)
    _expect_end(pos, end, "AUTH")
    return Auth(code, properties)


_DECODERS: dict[int, _Decoder] = {
    PacketType.CONNECT: _decode_connect,
    PacketType.CONNACK: _decode_connack,
    PacketType.PUBACK: _publish_ack_decoder(Puback, PUBACK_REASON_CODES),
    PacketType.PUBREC: _publish_ack_decoder(Pubrec, PUBREC_REASON_CODES),
    PacketType.PUBREL: _publish_ack_decoder(Pubrel, PUBREL_REASON_CODES),
    PacketType.PUBCOMP: _publish_ack_decoder(Pubcomp, PUBCOMP_REASON_CODES),
    PacketType.SUBSCRIBE: _decode_subscribe,
    PacketType.SUBACK: _decode_suback,
    PacketType.UNSUBSCRIBE: _decode_unsubscribe,
    PacketType.UNSUBACK: _decode_unsuback,
    PacketType.PINGREQ: _decode_pingreq,
    PacketType.PINGRESP: _decode_pingresp,
    PacketType.DISCONNECT: _decode_disconnect,
    PacketType.AUTH: _decode_auth,
}


# --- stream reading ---------------------------------------------------------------------

class PacketReader:
    """Turns the bytes of one connection, in whatever pieces they arrive, into packets.

    With `protocol_level` None (a server's side of a new connection) the first packet
    must be CONNECT and sets `protocol_level`; a later CONNECT is a Protocol Error
    (MQTT-3.1.0-1, MQTT-3.1.0-2). `max_packet_size` bounds the whole packet, fixed
    header included, as MQTT 5's Maximum Packet Size does; it is checked as soon as the
    fixed header is in, before the body is waited for. `max_connect_size`, when given,
    bounds the first packet (CONNECT) instead: a server buffers what an unauthenticated
    peer sends, so that bound is kept small.

    After decode() raises, the connection is to be closed: the reader's state is not
    defined any more, and packets decoded earlier in the same decode() are dropped (none
    of them has been acknowledged, so a client sends them again).
    """

    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_pending", "max_connect_size", "max_packet_size", "protocol_level")


    def __init__(self, max_packet_size: int, protocol_level: int | None = None, *,
                 max_connect_size: int | None = None) -> None:
        if protocol_level is not None:
            _check_level(protocol_level)
        self.max_packet_size = max_packet_size
        self.max_connect_size = (max_packet_size if max_connect_size is None
                                 else min(max_connect_size, max_packet_size))
        self.protocol_level = protocol_level
        self._pending = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received that do not make a whole packet yet."""
        return len(self._pending)

    def decode(self, data: bytes | bytearray | memoryview) -> list[Packet]:
        pending = self._pending
        if pending:
            pending += data
            # Copy the pending bytes out only once a whole packet is in: a large packet
            # arriving in many pieces must not be copied once per piece.
            bounds = self._packet_bounds(pending, 0, len(pending))
            if bounds is None or bounds[1] > len(pending):
                return []
            buf = bytes(pending)
            pending.clear()
        else:
            buf = bytes(data)  # no copy when data is already bytes
        packets: list[Packet] = []
        pos = 0
        size = len(buf)
        while pos < size:
            bounds = self._packet_bounds(buf, pos, size)
            if bounds is None or bounds[1] > size:
                break
            start, end = bounds
            level = self.protocol_level
            packet = _decode(buf[pos], buf, start, end, MQTT_5 if level is None else level)
            if level is None:
                # _packet_bounds lets only a CONNECT through as the first packet.
                assert isinstance(packet, Connect)
                self.protocol_level = packet.protocol_level
            packets.append(packet)
            pos = end
        if pos < size:
            pending += buf[pos:] if pos else buf
        return packets

    def _packet_bounds(self, buf: bytes | bytearray, pos: int,
                       size: int) -> tuple[int, int] | None:
        """Where the body of the packet at `pos` starts and ends (the end may lie beyond
        what has arrived), or None while its fixed header is incomplete. Checks what
        the fixed header alone tells, as soon as it is in: CONNECT coming first and
        only first, and the packet's size."""
        if pos >= size:
            return None
        is_connect = buf[pos] >> 4 == _CONNECT
        if self.protocol_level is None:
            if not is_connect:
                raise ProtocolError("the first packet on a connection must be CONNECT")
        elif is_connect:
            raise ProtocolError("a second CONNECT on a connection")
        if size - pos < 2:
            return None
        length_byte = buf[pos + 1]
        if length_byte < 0x80:
            start = pos + 2
            end = start + length_byte
        else:
            scanned = scan_varint(buf, pos + 1, size)
            if scanned is None:
                return None
            remaining, start = scanned
            end = start + remaining
        limit = self.max_connect_size if self.protocol_level is None else self.max_packet_size
        if end - pos > limit:
            what = "CONNECT" if self.protocol_level is None else "packet"
            raise PacketTooLargeError(
                f"{what} of {end - pos} bytes exceeds the maximum of {limit}")
        return start, end


# --- encoding ---------------------------------------------------------------------------

def encode(packet: Packet, protocol_level: int) -> bytes:
    """The bytes of `packet` at `protocol_level`. What that level cannot carry (MQTT 5
    properties and reason codes at levels 3 and 4) is left out; a packet that cannot be
    encoded at all (AUTH before MQTT 5, a field out of range) raises ValueError."""
    _check_level(protocol_level)
    try:
        return _encode(packet, protocol_level)
    except struct.error as exc:
        raise ValueError(f"cannot encode {packet!r}: {exc}") from exc


def _encode(packet: Packet, level: int) -> bytes:
    # Most frequent first: the chain is the dispatch.
    if isinstance(packet, Publish):
        return _encode_publish(packet, level)
    if isinstance(packet, Puback):
        return _encode_publish_ack(0x40, packet, level)
    if isinstance(packet, Pubrec):
        return _encode_publish_ack(0x50, packet, level)
    if isinstance(packet, Pubrel):
        return _encode_publish_ack(0x62, packet, level)
    if isinstance(packet, Pubcomp):
        return _encode_publish_ack(0x70, packet, level)
    if isinstance(packet, Pingreq):
        return b"\xc0\x00"
    if isinstance(packet, Pingresp):
        return b"\xd0\x00"
    if isinstance(packet, Connect):
        return _encode_connect(packet, level)
    if isinstance(packet, Connack):
        return _encode_connack(packet, level)
    if isinstance(packet, Subscribe):
        return _encode_subscribe(packet, level)
    if isinstance(packet, Suback):
        return _encode_suback(packet, level)
    if isinstance(packet, Unsubscribe):
        return _encode_unsubscribe(packet, level)
    if isinstance(packet, Unsuback):
        return _encode_unsuback(packet, level)
    if isinstance(packet, Disconnect):
        return _encode_disconnect(packet, level)
    if isinstance(packet, Auth):
        return _encode_auth(packet, level)
    raise TypeError(f"not an MQTT packet: {packet!r}")


_FIRST_BYTES = tuple(bytes((value,)) for value in range(256))


def _frame(first_byte: int, body: bytes) -> bytes:
    return _FIRST_BYTES[first_byte] + encode_varint(len(body)) + body


def _encode_publish(packet: Publish, level: int) -> bytes:
    return _publish_bytes(packet.topic, packet.payload, packet.qos, packet.retain, packet.dup,
                          packet.packet_id, packet.properties, level)


def encode_publish(topic: str, payload: bytes, qos: int, retain: bool, dup: bool,
                   packet_id: int | None, properties: Properties, level: int) -> bytes:
    """`encode(Publish(...), level)` without making the packet object: the broker
    sends every delivered message through here."""
    _check_level(level)
    try:
        return _publish_bytes(topic, payload, qos, retain, dup, packet_id, properties, level)
    except struct.error as exc:
        raise ValueError(f"cannot encode PUBLISH of {topic!r}: {exc}") from exc


def _publish_bytes(topic: str, payload: bytes, qos: int, retain: bool, dup: bool,
                   packet_id: int | None, properties: Properties, level: int) -> bytes:
    if qos == 0:
        if dup:
            raise ValueError("DUP must be 0 at QoS 0")
        header = utf8_field(topic)
    elif qos == 1 or qos == 2:
        if packet_id is None or packet_id == 0:
            raise ValueError(f"PUBLISH at QoS {qos} needs a non-zero packet identifier")
        header = utf8_field(topic) + U16.pack(packet_id)
    else:
        raise ValueError(f"PUBLISH with QoS {qos}")
    if level == MQTT_5:
        header += encode_properties(properties, _PUBLISH)
    first_byte = 0x30 | qos << 1 | (0x08 if dup else 0) | (0x01 if retain else 0)
    return b"".join((_FIRST_BYTES[first_byte], encode_varint(len(header) + len(payload)),
                     header, payload))


def _encode_connect(packet: Connect, level: int) -> bytes:
    if packet.protocol_level != level:
        raise ValueError(f"CONNECT for level {packet.protocol_level} encoded at level {level}")
    will = packet.will
    flags = 0x02 if packet.clean_start else 0
    if will is not None:
        if will.qos not in (0, 1, 2):
            raise ValueError(f"will QoS {will.qos}")
        flags |= 0x04 | will.qos << 3 | (0x20 if will.retain else 0)
    if packet.password is not None:
        if packet.username is None and level != MQTT_5:
            raise ValueError("a password needs a user name before MQTT 5")
        flags |= 0x40
    if packet.username is not None:
        flags |= 0x80
    parts = [utf8_field(_PROTOCOL_NAMES[level]), bytes((level, flags)),
             U16.pack(packet.keepalive)]
    if level == MQTT_5:
        parts.append(encode_properties(packet.properties, PacketType.CONNECT))
    parts.append(utf8_field(packet.client_id))
    if will is not None:
        if level == MQTT_5:
            parts.append(encode_properties(will.properties, WILL_PROPERTIES))
        parts.append(utf8_field(will.topic))
        parts.append(binary_field(will.payload))
    if packet.username is not None:
        parts.append(utf8_field(packet.username))
    if packet.password is not None:
        parts.append(binary_field(packet.password))
    return _frame(0x10, b"".join(parts))


def _encode_connack(packet: Connack, level: int) -> bytes:
    flags = 0x01 if packet.session_present else 0
    code = packet.reason_code
    if level == MQTT_5:
        return _frame(0x20, bytes((flags, code))
                      + encode_properties(packet.properties, PacketType.CONNACK))
    if code >= 0x80:
        mapped = connack_return_code(code)
        if mapped is None:
            raise ValueError(f"reason code 0x{code:02x} has no MQTT 3.1.1 return code; "
                             "close the connection without a CONNACK")
        code = mapped
    return _frame(0x20, bytes((flags, code)))


def _encode_publish_ack(first_byte: int, packet: Puback | Pubrec | Pubrel | Pubcomp,
                        level: int) -> bytes:
    packet_id = U16.pack(packet.packet_id)
    if level != MQTT_5:
        return _FIRST_BYTES[first_byte] + b"\x02" + packet_id
    properties = encode_properties(packet.properties, packet.packet_type)
    if properties == b"\x00":
        if packet.reason_code == 0:
            return _FIRST_BYTES[first_byte] + b"\x02" + packet_id
        return _FIRST_BYTES[first_byte] + b"\x03" + packet_id + bytes((packet.reason_code,))
    return _frame(first_byte, packet_id + bytes((packet.reason_code,)) + properties)






def _encode_subscribe(packet: Subscribe, level: int) -> bytes:
    parts = [U16.pack(packet.packet_id)]
    if level == MQTT_5:
        parts.append(encode_properties(packet.properties, PacketType.SUBSCRIBE))
    for topic_filter, options in packet.subscriptions:
        byte = options.qos
        if level == MQTT_5:
            byte |= ((0x04 if options.no_local else 0)
                     | (0x08 if options.retain_as_published else 0)
                     | options.retain_handling << 4)
        parts.append(utf8_field(topic_filter) + bytes((byte,)))
    return _frame(0x82, b"".join(parts))


def _encode_suback(packet: Suback, level: int) -> bytes:
    codes = packet.reason_codes
    if level == MQTT_5:
        return _frame(0x90, U16.pack(packet.packet_id)
                      + encode_properties(packet.properties, PacketType.SUBACK) + bytes(codes))
    # 3.1.1 knows one failure code; every v5 refusal becomes it.
    v3_codes = bytes(SUBACK_FAILURE_V3 if code >= 0x80 else code for code in codes)
    return _frame(0x90, U16.pack(packet.packet_id) + v3_codes)


def _encode_unsubscribe(packet: Unsubscribe, level: int) -> bytes:
    parts = [U16.pack(packet.packet_id)]
    if level == MQTT_5:
        parts.append(encode_properties(packet.properties, PacketType.UNSUBSCRIBE))
    parts.extend(utf8_field(topic_filter) for topic_filter in packet.topic_filters)
    return _frame(0xA2, b"".join(parts))


def _encode_unsuback(packet: Unsuback, level: int) -> bytes:
    if level != MQTT_5:
        return b"\xb0\x02" + U16.pack(packet.packet_id)
    return _frame(0xB0, U16.pack(packet.packet_id)
                  + encode_properties(packet.properties, PacketType.UNSUBACK)
                  + bytes(packet.reason_codes))


def _encode_disconnect(packet: Disconnect, level: int) -> bytes:
    if level != MQTT_5:
        return b"\xe0\x00"
    properties = encode_properties(packet.properties, PacketType.DISCONNECT)
    if properties == b"\x00":
        if packet.reason_code == 0:
            return b"\xe0\x00"
        return b"\xe0\x01" + bytes((packet.reason_code,))
    return _frame(0xE0, bytes((packet.reason_code,)) + properties)


def _encode_auth(packet: Auth, level: int) -> bytes:
    if level != MQTT_5:
        raise ValueError("AUTH exists in MQTT 5 only")
    properties = encode_properties(packet.properties, PacketType.AUTH)
    if properties == b"\x00" and packet.reason_code == 0:
        return b"\xf0\x00"
    return _frame(0xF0, bytes((packet.reason_code,)) + properties)

