"""MQTT data representations (MQTT 5.0 section 1.5) and packet type numbers.

Readers take a bytes object, the position to read at and the end of the region they may
read; they return the value and the position after it, and raise MalformedPacketError
rather than read past `end`, so a length field can never make a reader leave its packet.

They read `bytes`, not memoryviews: in CPython, slicing bytes and decoding the slice is
about three times faster than decoding a memoryview slice (the generic codec path), and
a payload slice is one copy either way.
"""

from __future__ import annotations

import struct
from enum import IntEnum

from .errors import MalformedPacketError


class PacketType(IntEnum):
    """Control packet types: the high nibble of the fixed header's first byte."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


MAX_VARINT = 268_435_455
MAX_UINT16 = 0xFFFF

U16 = struct.Struct(">H")
U32 = struct.Struct(">I")

# Precomputed one-byte varints: almost every remaining length and property length fits.
_SMALL_VARINTS = tuple(bytes((value,)) for value in range(128))


def encode_varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _SMALL_VARINTS[value]
    if not 0 <= value <= MAX_VARINT:
        raise ValueError(f"{value} does not fit a Variable Byte Integer")
    out = bytearray()
    while value:
        digit = value & 0x7F
        value >>= 7
        out.append(digit | 0x80 if value else digit)
    return bytes(out)


def scan_varint(buf: bytes | bytearray, pos: int, end: int) -> tuple[int, int] | None:
    """Read a Variable Byte Integer, or return None when the region ends inside it (the
    stream reader then waits for more bytes). Section 1.5.5 caps it at four bytes and
    requires the minimum number of bytes, so a longer or padded encoding is malformed."""
    value = 0
    shift = 0
    for index in range(pos, min(pos + 4, end)):
        byte = buf[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            # A final byte of zero after a continuation byte adds nothing: the encoding
            # was not minimal (MQTT-1.5.5-1).
            if byte == 0 and index > pos:
                raise MalformedPacketError("Variable Byte Integer is not minimally encoded")
            return value, index + 1
        shift += 7
    if end - pos >= 4:
        raise MalformedPacketError("Variable Byte Integer longer than 4 bytes")
    return None


def read_varint(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    scanned = scan_varint(buf, pos, end)
    if scanned is None:
        raise MalformedPacketError(f"{what} is truncated")
    return scanned


def read_u8(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    if pos >= end:
        raise MalformedPacketError(f"{what} is missing")
    return buf[pos], pos + 1


def read_u16(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    if pos + 2 > end:
        raise MalformedPacketError(f"{what} is truncated")
    return (buf[pos] << 8) | buf[pos + 1], pos + 2


def read_u32(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    if pos + 4 > end:
        raise MalformedPacketError(f"{what} is truncated")
    return U32.unpack_from(buf, pos)[0], pos + 4


def read_binary(buf: bytes, pos: int, end: int, what: str) -> tuple[bytes, int]:
    if pos + 2 > end:
        raise MalformedPacketError(f"{what} length is truncated")
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise MalformedPacketError(f"{what} is longer than its packet")
    return buf[pos + 2:stop], stop


def read_utf8(buf: bytes, pos: int, end: int, what: str) -> tuple[str, int]:
    """Read a UTF-8 Encoded String (section 1.5.4): the decoder's strict mode refuses
    ill-formed UTF-8, overlong forms and encoded surrogates; U+0000 is refused here."""
    if pos + 2 > end:
        raise MalformedPacketError(f"{what} length is truncated")
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise MalformedPacketError(f"{what} is longer than its packet")
    try:
        text = buf[pos + 2:stop].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPacketError(f"{what} is not well-formed UTF-8") from exc
    if "\x00" in text:
        raise MalformedPacketError(f"{what} contains U+0000")
    return text, stop


def utf8_field(text: str) -> bytes:
    """A UTF-8 Encoded String: two-byte length, then the bytes. A lone surrogate raises
    UnicodeEncodeError (a ValueError), so it never reaches the wire."""
    raw = text.encode("utf-8")
    if len(raw) > MAX_UINT16:
        raise ValueError(f"string of {len(raw)} bytes does not fit a UTF-8 Encoded String")
    return U16.pack(len(raw)) + raw


def binary_field(data: bytes) -> bytes:
    if len(data) > MAX_UINT16:
        raise ValueError(f"{len(data)} bytes do not fit Binary Data")
    return U16.pack(len(data)) + data
