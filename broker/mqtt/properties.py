"""MQTT 5.0 properties (section 2.2.2): the typed `Properties` record, its encoding, and
the checks a received property block must pass.

Error classes follow the spec's wording: an identifier that is unknown or not valid for
the packet, or a value that does not parse, is a Malformed Packet (2.2.2.2); a second
copy of a property that may appear once, or a value the property does not allow, is a
Protocol Error (the per-property text in chapter 3).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from .errors import MalformedPacketError, ProtocolError
from .wire import (
    PacketType,
    binary_field,
    encode_varint,
    read_binary,
    read_u16,
    read_u32,
    read_utf8,
    read_varint,
    utf8_field,
)

# Not a packet type: the will properties inside a CONNECT payload have their own set of
# allowed properties. Packet type 0 is reserved, so the number cannot clash.
WILL_PROPERTIES = 0


@dataclass(slots=True, repr=False)
class Properties:
    """One optional field per property; None (or an empty list) means absent.
    One-byte flags (request_problem_information, retain_available, ...) stay ints
    0/1 so that what was received is what is sent."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: list[int] = field(default_factory=list)
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: list[tuple[str, str]] = field(default_factory=list)
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None

    def __repr__(self) -> str:
        # Only what is present: 27 mostly-None fields would drown a log line.
        present = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELD_NAMES
                            if getattr(self, name) not in (None, []))
        return f"Properties({present})"


_FIELD_NAMES = tuple(item.name for item in fields(Properties))


# Data types of section 1.5.
_BYTE, _U16, _U32, _VARINT, _UTF8, _BINARY, _PAIR = range(7)
# Value rules the spec states per property; anything else of the right type is allowed.
_ANY, _ZERO_OR_ONE, _NOT_ZERO = range(3)


@dataclass(frozen=True, slots=True)
class PropertySpec:
    ident: int
    name: str
    data_type: int
    packets: frozenset[int]
    rule: int = _ANY
    repeatable: bool = False


_P = PacketType
_ACKS = frozenset({_P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP})
_MESSAGE = frozenset({_P.PUBLISH, WILL_PROPERTIES})

# Table 2-4 of MQTT 5.0.
SPECS: tuple[PropertySpec, ...] = (
    PropertySpec(0x01, "payload_format_indicator", _BYTE, _MESSAGE, _ZERO_OR_ONE),
    PropertySpec(0x02, "message_expiry_interval", _U32, _MESSAGE),
    PropertySpec(0x03, "content_type", _UTF8, _MESSAGE),
    PropertySpec(0x08, "response_topic", _UTF8, _MESSAGE),
    PropertySpec(0x09, "correlation_data", _BINARY, _MESSAGE),
    # Repeatable in PUBLISH only (one per matching subscription); SUBSCRIBE is checked
    # separately.
    PropertySpec(0x0B, "subscription_identifiers", _VARINT,
                 frozenset({_P.PUBLISH, _P.SUBSCRIBE}), _NOT_ZERO, repeatable=True),
    PropertySpec(0x11, "session_expiry_interval", _U32,
                 frozenset({_P.CONNECT, _P.CONNACK, _P.DISCONNECT})),
    PropertySpec(0x12, "assigned_client_identifier", _UTF8, frozenset({_P.CONNACK})),
    PropertySpec(0x13, "server_keep_alive", _U16, frozenset({_P.CONNACK})),
    PropertySpec(0x15, "authentication_method", _UTF8,
                 frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    PropertySpec(0x16, "authentication_data", _BINARY,
                 frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    PropertySpec(0x17, "request_problem_information", _BYTE, frozenset({_P.CONNECT}),
                 _ZERO_OR_ONE),
    PropertySpec(0x18, "will_delay_interval", _U32, frozenset({WILL_PROPERTIES})),
    PropertySpec(0x19, "request_response_information", _BYTE, frozenset({_P.CONNECT}),
                 _ZERO_OR_ONE),
    PropertySpec(0x1A, "response_information", _UTF8, frozenset({_P.CONNACK})),
    PropertySpec(0x1C, "server_reference", _UTF8, frozenset({_P.CONNACK, _P.DISCONNECT})),
    PropertySpec(0x1F, "reason_string", _UTF8,
                 _ACKS | {_P.CONNACK, _P.SUBACK, _P.UNSUBACK, _P.DISCONNECT, _P.AUTH}),
    PropertySpec(0x21, "receive_maximum", _U16, frozenset({_P.CONNECT, _P.CONNACK}),
                 _NOT_ZERO),
    PropertySpec(0x22, "topic_alias_maximum", _U16, frozenset({_P.CONNECT, _P.CONNACK})),
    # Alias 0 or above the negotiated maximum is the session's check: it alone knows
    # the maximum, and answers 0x94 Topic Alias invalid rather than 0x82.
    PropertySpec(0x23, "topic_alias", _U16, frozenset({_P.PUBLISH})),
    PropertySpec(0x24, "maximum_qos", _BYTE, frozenset({_P.CONNACK}), _ZERO_OR_ONE),
    PropertySpec(0x25, "retain_available", _BYTE, frozenset({_P.CONNACK}), _ZERO_OR_ONE),
    PropertySpec(0x26, "user_properties", _PAIR,
                 _ACKS | _MESSAGE | {_P.CONNECT, _P.CONNACK, _P.SUBSCRIBE, _P.SUBACK,
                                     _P.UNSUBSCRIBE, _P.UNSUBACK, _P.DISCONNECT, _P.AUTH},
                 repeatable=True),
    PropertySpec(0x27, "maximum_packet_size", _U32, frozenset({_P.CONNECT, _P.CONNACK}),
                 _NOT_ZERO),
    PropertySpec(0x28, "wildcard_subscription_available", _BYTE, frozenset({_P.CONNACK}),
                 _ZERO_OR_ONE),
    PropertySpec(0x29, "subscription_identifier_available", _BYTE,
                 frozenset({_P.CONNACK}), _ZERO_OR_ONE),
    PropertySpec(0x2A, "shared_subscription_available", _BYTE, frozenset({_P.CONNACK}),
                 _ZERO_OR_ONE),
)

_KINDS = (WILL_PROPERTIES, *PacketType)
# Per packet kind: identifier -> spec for decoding, and the specs to encode, in order.
_ALLOWED: dict[int, dict[int, PropertySpec]] = {
    kind: {spec.ident: spec for spec in SPECS if kind in spec.packets} for kind in _KINDS
}
_TO_ENCODE: dict[int, tuple[PropertySpec, ...]] = {
    kind: tuple(spec for spec in SPECS if kind in spec.packets) for kind in _KINDS
}


def decode_properties(buf: bytes, pos: int, end: int, kind: int) -> tuple[Properties, int]:
    """Read a property block (length, then properties) for a packet of type `kind` (or
    WILL_PROPERTIES) and return it with the position after it."""
    if pos < end and buf[pos] == 0:
        return Properties(), pos + 1  # the usual case: no properties
    length, pos = read_varint(buf, pos, end, "property length")
    props = Properties()
    stop = pos + length
    if stop > end:
        raise MalformedPacketError("property length runs past the end of the packet")
    allowed = _ALLOWED[kind]
    while pos < stop:
        # The identifier is a Variable Byte Integer, but every defined one is below 128:
        # a byte with the continuation bit set can only start an unknown identifier.
        ident = buf[pos]
        pos += 1
        spec = allowed.get(ident)
        if spec is None:
            where = "will properties" if kind == WILL_PROPERTIES else PacketType(kind).name
            raise MalformedPacketError(f"property 0x{ident:02x} is not valid in {where}")
        data_type = spec.data_type
        value: int | str | bytes | tuple[str, str]
        if data_type == _BYTE:
            if pos >= stop:
                raise MalformedPacketError(f"{spec.name} is truncated")
            value = buf[pos]
            pos += 1
        elif data_type == _U16:
            value, pos = read_u16(buf, pos, stop, spec.name)
        elif data_type == _U32:
            value, pos = read_u32(buf, pos, stop, spec.name)
        elif data_type == _VARINT:
            value, pos = read_varint(buf, pos, stop, spec.name)
        elif data_type == _UTF8:
            value, pos = read_utf8(buf, pos, stop, spec.name)
        elif data_type == _BINARY:
            value, pos = read_binary(buf, pos, stop, spec.name)
        else:
            name, pos = read_utf8(buf, pos, stop, "user property name")
            text, pos = read_utf8(buf, pos, stop, "user property value")
            value = (name, text)
        rule = spec.rule
        if rule == _ZERO_OR_ONE and value not in (0, 1):
            raise ProtocolError(f"{spec.name} must be 0 or 1, not {value!r}")
        if rule == _NOT_ZERO and value == 0:
            raise ProtocolError(f"{spec.name} must not be 0")
        if spec.repeatable:
            getattr(props, spec.name).append(value)
        elif getattr(props, spec.name) is not None:
            raise ProtocolError(f"{spec.name} appears more than once")
        else:
            setattr(props, spec.name, value)
    if kind == PacketType.SUBSCRIBE and len(props.subscription_identifiers) > 1:
        raise ProtocolError("SUBSCRIBE carries more than one subscription identifier")
    if props.authentication_data is not None and props.authentication_method is None:
        raise ProtocolError("authentication data without an authentication method")
    return props, pos




def _values_getter(specs: tuple[PropertySpec, ...]) -> Callable[[Properties], tuple[Any, ...]]:
    """A getter for the values of `specs`, as a tuple, read by attrgetter in C."""
    if len(specs) == 1:
        single = attrgetter(specs[0].name)
        return lambda props: (single(props),)
    return attrgetter(*(spec.name for spec in specs))


# Per packet kind: the values of the properties it may carry, and those values when all
# are absent. PINGREQ and PINGRESP carry no properties at all.
_GETTERS = {kind: _values_getter(specs) for kind, specs in _TO_ENCODE.items() if specs}
_ABSENT: dict[int, tuple[Any, ...]] = {
    kind: tuple([] if spec.repeatable else None for spec in specs)
    for kind, specs in _TO_ENCODE.items()
}
_BYTE_PROPERTY = struct.Struct(">BB")
_U16_PROPERTY = struct.Struct(">BH")
_U32_PROPERTY = struct.Struct(">BI")
_EMPTY_BLOCK = b"\x00"


def encode_properties(props: Properties, kind: int) -> bytes:
    """The property block (length, then properties) for a packet of type `kind` (or
    WILL_PROPERTIES). Only properties valid for that kind are written: the others are
    not representable there, and the decoder on the other side would refuse them."""
    values = _GETTERS[kind](props)
    if values == _ABSENT[kind]:
        return _EMPTY_BLOCK  # the usual case, decided by one tuple comparison in C
    parts: list[bytes] = []
    for spec, value in zip(_TO_ENCODE[kind], values, strict=True):
        if value is None or value == []:
            continue
        data_type = spec.data_type
        ident = spec.ident
        if data_type == _BYTE:
            parts.append(_BYTE_PROPERTY.pack(ident, value))
        elif data_type == _U16:
            parts.append(_U16_PROPERTY.pack(ident, value))
        elif data_type == _U32:
            parts.append(_U32_PROPERTY.pack(ident, value))
        elif data_type == _VARINT:
            for number in value:
                parts.append(bytes((ident,)) + encode_varint(number))
        elif data_type == _UTF8:
            parts.append(bytes((ident,)) + utf8_field(value))
        elif data_type == _BINARY:
            parts.append(bytes((ident,)) + binary_field(value))
        else:
            for name, text in value:
                parts.append(bytes((ident,)) + utf8_field(name) + utf8_field(text))
    if not parts:
        return _EMPTY_BLOCK
    block = b"".join(parts)
    return encode_varint(len(block)) + block


# A packet without properties, shared by every such packet the codec decodes and the
# broker sends (a Properties() per PUBACK cost ~0.3 us): never changed.
NO_PROPERTIES = Properties()
