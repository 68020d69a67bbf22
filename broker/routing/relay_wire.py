"""Bytes on the peer port for the relay: a push of committed messages of one shard
to a site that holds no replica of it. Pure: no I/O."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..ds import Message, blob, decode_message, encode_message, read_blob
from ..errors import CorruptDataError

_U32 = struct.Struct(">I")
_PUSH_HEAD = struct.Struct(">BII")  # gap flag, shard, message count


@dataclass(frozen=True, slots=True)
class Push:
    """Committed messages of one shard for a site that holds no replica of it, in
    commit order. `gap`: the sender dropped earlier messages of the shard for this
    site (it was slow or unreachable); its readers go back to storage."""

    shard: int
    gap: bool
    messages: list[tuple[int, bytes, Message]]  # (generation, static index, message)


def encode_push(push: Push) -> bytes:
    parts = [_PUSH_HEAD.pack(int(push.gap), push.shard, len(push.messages))]
    for generation, static, message in push.messages:
        parts += (_U32.pack(generation), blob(static), blob(encode_message(message)))
    return b"".join(parts)


def decode_push(raw: bytes) -> Push:
    try:
        gap, shard, count = _PUSH_HEAD.unpack_from(raw)
        pos = _PUSH_HEAD.size
        messages = []
        for _ in range(count):
            (generation,) = _U32.unpack_from(raw, pos)
            static, pos = read_blob(raw, pos + 4)
            value, pos = read_blob(raw, pos)
            messages.append((generation, static, decode_message(value)))
        if pos != len(raw):
            raise ValueError("trailing bytes")
    except (ValueError, struct.error, CorruptDataError) as exc:
        raise CorruptDataError(f"a relay push does not decode: {exc}") from exc
    return Push(shard, bool(gap), messages)
