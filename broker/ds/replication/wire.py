"""The bytes of the peer protocol's log shipping: an `AppendRequest` from a shard's
leader to a follower, and the follower's `AppendResult`. Big-endian, versioned; a
message that does not decode raises CorruptDataError (not recoverable: the peer runs
other code or the bytes were damaged)."""

from __future__ import annotations

import struct

from ...errors import CorruptDataError
from ..rocks import blob, read_blob
from .leader import AppendRequest
from .log import AppendResult, Entry, Position

VERSION = 1
# version, epoch, previous epoch, previous offset, committed, entries
_REQUEST = struct.Struct(">BQQQQI")
_ENTRY = struct.Struct(">QQ")
# version, accepted, matched, last epoch, last offset, retry from
_RESULT = struct.Struct(">BBQQQQ")


def encode_request(request: AppendRequest) -> bytes:
    parts = [_REQUEST.pack(VERSION, request.epoch, *request.previous, request.committed,
                           len(request.entries))]
    for entry in request.entries:
        parts += (_ENTRY.pack(*entry.position), blob(entry.batch))
    return b"".join(parts)


def decode_request(raw: bytes) -> AppendRequest:
    try:
        (version, epoch, previous_epoch, previous_offset, committed,
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
    return AppendRequest(epoch, Position(previous_epoch, previous_offset), entries, committed)


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


def _check_version(version: int) -> None:
    if version != VERSION:
        raise ValueError(f"peer protocol version {version}, this site speaks {VERSION}")
