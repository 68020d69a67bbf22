"""The bytes of the peer protocol's log shipping: an `AppendRequest` from a shard's
leader to a follower, and the follower's `AppendResult`. Big-endian, versioned; a
message that does not decode raises CorruptDataError (not recoverable: the peer runs
other code or the bytes were damaged)."""

from __future__ import annotations

import struct

from ...errors import CorruptDataError
from ..fence import Fence
from ..message import Message, decode_message, encode_message
from ..rocks import blob, read_blob
from .leader import AppendRequest
from .log import AppendResult, Entry, Position

VERSION = 2
# version, epoch, previous epoch, previous offset, committed, trim before, entries
_REQUEST = struct.Struct(">BQQQQQI")
_ENTRY = struct.Struct(">QQ")
# version, accepted, matched, last epoch, last offset, retry from
_RESULT = struct.Struct(">BBQQQQ")


def encode_request(request: AppendRequest) -> bytes:
    parts = [_REQUEST.pack(VERSION, request.epoch, *request.previous, request.committed,
                           request.trim_before, len(request.entries))]
    for entry in request.entries:
        parts += (_ENTRY.pack(*entry.position), blob(entry.batch))
    return b"".join(parts)


def decode_request(raw: bytes) -> AppendRequest:
    try:
        (version, epoch, previous_epoch, previous_offset, committed, trim_before,
         count) = _REQUEST.unpack_from(raw)
        _check_version(version)
        pos = _REQUEST.size
        entries = []
        for _ in range(count):
            entry_epoch, offset = _ENTRY.unpack_from(raw, pos)
            batch, pos = read_blob(raw, pos + _ENTRY.size)
            entries.append(Entry(Position(entry_epoch, offset), batch))
        if pos != len(raw):
            raise ValueError("trailing bytes")
    except (struct.error, ValueError) as exc:
        raise CorruptDataError(f"append request does not decode: {exc}") from exc
    return AppendRequest(epoch, Position(previous_epoch, previous_offset), entries, committed,
                         trim_before)


def encode_result(result: AppendResult) -> bytes:
    return _RESULT.pack(VERSION, result.accepted, result.matched, *result.last,
                        result.retry_from)


def decode_result(raw: bytes) -> AppendResult:
    try:
        version, accepted, matched, last_epoch, last_offset, retry_from = _RESULT.unpack(raw)
        _check_version(version)
    except (struct.error, ValueError) as exc:
        raise CorruptDataError(f"append result does not decode: {exc}") from exc
    return AppendResult(bool(accepted), matched, Position(last_epoch, last_offset), retry_from)


# version, messages, record puts, record deletes
_SUBMIT = struct.Struct(">BIII")
# after the records: the number of fences, then each: key (a blob), epoch, claim,
# owner (a blob)
_FENCES = struct.Struct(">I")
_FENCE = struct.Struct(">QB")


def encode_submit(messages: list[Message], record_puts: list[tuple[bytes, bytes]],
                  record_deletes: list[bytes], fences: list[Fence] | None = None) -> bytes:
    """A write forwarded to a shard's leader: messages and the records to write with
    them in one batch, and the fences of its fenced writes."""
    parts = [_SUBMIT.pack(VERSION, len(messages), len(record_puts), len(record_deletes))]
    parts += (blob(encode_message(message)) for message in messages)
    for key, value in record_puts:
        parts += (blob(key), blob(value))
    parts += (blob(key) for key in record_deletes)
    parts.append(_FENCES.pack(len(fences or [])))
    for fence in fences or []:
        parts += (blob(fence.key), _FENCE.pack(fence.epoch, fence.claim), blob(fence.owner))
    return b"".join(parts)


def decode_submit(raw: bytes) -> tuple[list[Message], list[tuple[bytes, bytes]], list[bytes],
                                       list[Fence]]:
    try:
        version, n_messages, n_puts, n_deletes = _SUBMIT.unpack_from(raw)
        _check_version(version)
        pos = _SUBMIT.size
        messages = []
        for _ in range(n_messages):
            encoded, pos = read_blob(raw, pos)
            messages.append(decode_message(encoded))
        puts = []
        for _ in range(n_puts):
            key, pos = read_blob(raw, pos)
            value, pos = read_blob(raw, pos)
            puts.append((key, value))
        deletes = []
        for _ in range(n_deletes):
            key, pos = read_blob(raw, pos)
            deletes.append(key)
        (n_fences,) = _FENCES.unpack_from(raw, pos)
        pos += _FENCES.size
        fences = []
        for _ in range(n_fences):
            fence_of, pos = read_blob(raw, pos)
            epoch, claim = _FENCE.unpack_from(raw, pos)
            owner, pos = read_blob(raw, pos + _FENCE.size)
            fences.append(Fence(fence_of, epoch, bool(claim), owner))
        if pos != len(raw):
            raise ValueError("trailing bytes")
    except (struct.error, ValueError) as exc:
        raise CorruptDataError(f"forwarded write does not decode: {exc}") from exc
    return messages, puts, deletes, fences


def _check_version(version: int) -> None:
    if version != VERSION:
        raise ValueError(f"peer protocol version {version}, this site speaks {VERSION}")
