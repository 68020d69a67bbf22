"""The stored message and its compact binary form.

A message is serialized once, when its batch is cooked, and the bytes are what
replicas apply and readers decode; so the format is versioned and fixed-width
where it can be, to keep decoding a single `struct.unpack_from` plus slices."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import CorruptDataError

FORMAT_VERSION = 1

# version, flags, timestamp, topic length, client id length, payload length
_HEADER = struct.Struct(">BBQHHI")
_U16 = struct.Struct(">H")
_TOPIC_LENGTH_OFFSET = 10  # after version, flags and timestamp
_U32 = struct.Struct(">I")
_TIMESTAMP = struct.Struct(">Q")
_TIMESTAMP_OFFSET = 2  # after version and flags

_FLAG_RETAIN = 0x04
_FLAG_HAS_PROPERTIES = 0x08
_QOS_MASK = 0x03

# Property tags inside the properties block; one byte each, then the value.
_TAG_PAYLOAD_FORMAT = 1
_TAG_MESSAGE_EXPIRY = 2
_TAG_CONTENT_TYPE = 3
_TAG_RESPONSE_TOPIC = 4
_TAG_CORRELATION_DATA = 5
_TAG_USER_PROPERTY = 6


@dataclass(slots=True, frozen=True)
class MessageProperties:
    """The MQTT 5 PUBLISH properties a subscriber must receive unchanged."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()

    def is_empty(self) -> bool:
        return self == _EMPTY_PROPERTIES


# Shared by every message without properties (most), so the check is `is`, not `==`.
EMPTY_PROPERTIES = _EMPTY_PROPERTIES = MessageProperties()


@dataclass(slots=True)
class Message:
    """One MQTT message as stored. `timestamp` (µs) is set by the shard leader when
    the batch is cooked; before that it is 0."""

    topic: str
    payload: bytes
    client_id: str = ""
    qos: int = 0
    retain: bool = False
    properties: MessageProperties = EMPTY_PROPERTIES
    timestamp: int = 0


def _pack_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U16.pack(len(raw)) + raw


def _encode_properties(props: MessageProperties) -> bytes:
    parts: list[bytes] = []
    if props.payload_format_indicator is not None:
        parts.append(bytes((_TAG_PAYLOAD_FORMAT, props.payload_format_indicator)))
    if props.message_expiry_interval is not None:
        parts.append(bytes((_TAG_MESSAGE_EXPIRY,)) + _U32.pack(props.message_expiry_interval))
    if props.content_type is not None:
        parts.append(bytes((_TAG_CONTENT_TYPE,)) + _pack_str(props.content_type))
    if props.response_topic is not None:
        parts.append(bytes((_TAG_RESPONSE_TOPIC,)) + _pack_str(props.response_topic))
    if props.correlation_data is not None:
        parts.append(bytes((_TAG_CORRELATION_DATA,)) + _U32.pack(len(props.correlation_data))
                     + props.correlation_data)
    for name, value in props.user_properties:
        parts.append(bytes((_TAG_USER_PROPERTY,)) + _pack_str(name) + _pack_str(value))
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def encode_message(message: Message) -> bytes:
    topic = message.topic.encode("utf-8")
    client_id = message.client_id.encode("utf-8")
    flags = (message.qos & _QOS_MASK) | (_FLAG_RETAIN if message.retain else 0)
    props = message.properties
    tail = b""
    if props is not _EMPTY_PROPERTIES and not props.is_empty():
        flags |= _FLAG_HAS_PROPERTIES
        tail = _encode_properties(props)
    header = _HEADER.pack(FORMAT_VERSION, flags, message.timestamp, len(topic), len(client_id),
                          len(message.payload))
    return b"".join((header, topic, client_id, message.payload, tail))


class _Cursor:
    """Reads the properties block; only messages that carry properties pay for it."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.pos = pos

    def byte(self) -> int:
        value = self.data[self.pos]
        self.pos += 1
        return value

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.data, self.pos)
        self.pos += 4
        return int(value)

    def blob(self, length: int) -> bytes:
        value = self.data[self.pos:self.pos + length]
        if len(value) != length:
            raise ValueError("truncated")
        self.pos += length
        return value

    def string(self) -> str:
        (length,) = _U16.unpack_from(self.data, self.pos)
        self.pos += 2
        return self.blob(length).decode("utf-8")


def _decode_properties(data: bytes, pos: int) -> MessageProperties:
    cursor = _Cursor(data, pos)
    end = cursor.pos + 4 + cursor.u32()
    values: dict[str, object] = {}
    user_properties: list[tuple[str, str]] = []
    while cursor.pos < end:
        tag = cursor.byte()
        if tag == _TAG_PAYLOAD_FORMAT:
            values["payload_format_indicator"] = cursor.byte()
        elif tag == _TAG_MESSAGE_EXPIRY:
            values["message_expiry_interval"] = cursor.u32()
        elif tag == _TAG_CONTENT_TYPE:
            values["content_type"] = cursor.string()
        elif tag == _TAG_RESPONSE_TOPIC:
            values["response_topic"] = cursor.string()
        elif tag == _TAG_CORRELATION_DATA:
            values["correlation_data"] = cursor.blob(cursor.u32())
        elif tag == _TAG_USER_PROPERTY:
            user_properties.append((cursor.string(), cursor.string()))
        else:
            raise ValueError(f"unknown property tag {tag}")
    return MessageProperties(user_properties=tuple(user_properties), **values)  # type: ignore[arg-type]


def decode_message(data: bytes) -> Message:
    try:
        version, flags, timestamp, topic_len, client_len, payload_len = _HEADER.unpack_from(data)
        if version != FORMAT_VERSION:
            raise ValueError(f"unknown message format version {version}")
        pos = _HEADER.size
        topic = data[pos:pos + topic_len].decode("utf-8")
        pos += topic_len
        client_id = data[pos:pos + client_len].decode("utf-8")
        pos += client_len
        payload = data[pos:pos + payload_len]
        pos += payload_len
        properties = _decode_properties(data, pos) if flags & _FLAG_HAS_PROPERTIES \
            else _EMPTY_PROPERTIES
    except (ValueError, struct.error, UnicodeDecodeError, IndexError) as exc:
        raise CorruptDataError(f"stored message does not decode: {exc}") from exc
    return Message(topic, payload, client_id, flags & _QOS_MASK, bool(flags & _FLAG_RETAIN),
                   properties, timestamp)


def peek_topic(data: bytes) -> str:
    """The topic of a stored message without decoding the rest (for filter checks)."""
    (topic_len,) = _U16.unpack_from(data, _TOPIC_LENGTH_OFFSET)
    return data[_HEADER.size:_HEADER.size + topic_len].decode("utf-8")


def peek_timestamp(data: bytes) -> int:
    """The timestamp of a stored message without decoding the rest."""
    return int(_TIMESTAMP.unpack_from(data, _TIMESTAMP_OFFSET)[0])
