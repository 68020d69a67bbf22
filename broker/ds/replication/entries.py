"""What a shard log entry holds: one change that every replica of the shard applies,
in log order, the same way. Pure.

A cooked batch (messages and records), the start of a new generation, the drop of
an old one, a GC write (deletes of expired messages in a closed generation, with
records), or a new topic seed: generations change only through the log on a
replicated site, so that every replica has the same generations with the same ids,
the same messages and the same learned topic structure. A no-op opens each leader
epoch (a new leader commits the entries it inherited with the first entry of its
own epoch, see `commit.py`).

Layout: one kind byte, then the kind's body."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum

from ...errors import CorruptDataError

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


class Kind(IntEnum):
    NOOP = 0
    BATCH = 1
    ADD_GENERATION = 2
    DROP_GENERATION = 3
    GC_WRITE = 4
    SET_TOPIC_SEED = 5


@dataclass(frozen=True, slots=True)
class AddGeneration:
    """Close the current generation and start one at `at` (µs), its trie seeded with
    `seed` (the leader's topic seed, so that every replica learns the same keys)."""

    at: int
    seed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DropGeneration:
    generation: int


@dataclass(frozen=True, slots=True)
class GcWrite:
    """Delete data entries of closed generation `generation` (`Shard.gc_write`) and put
    records (the GC plan's applied mark), in one batch; the records are put even
    where the generation is gone."""

    generation: int
    deletes: tuple[bytes, ...]
    record_puts: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class SetTopicSeed:
    """The topic seed of the generations started from now on (`Shard.set_topic_seed`)."""

    patterns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Noop:
    pass


Change = bytes | AddGeneration | DropGeneration | GcWrite | SetTopicSeed | Noop
"""A decoded entry: bytes are a cooked batch (`CookedBatch.to_bytes`)."""


def encode_batch(cooked: bytes) -> bytes:
    return bytes((Kind.BATCH,)) + cooked


def encode(change: Change) -> bytes:
    if isinstance(change, bytes):
        return encode_batch(change)
    if isinstance(change, AddGeneration):
        return bytes((Kind.ADD_GENERATION,)) + _U64.pack(change.at) + json.dumps(
            list(change.seed)).encode("utf-8")
    if isinstance(change, DropGeneration):
        return bytes((Kind.DROP_GENERATION,)) + _U32.pack(change.generation)
    if isinstance(change, GcWrite):
        parts = [bytes((Kind.GC_WRITE,)), _U32.pack(change.generation),
                 _U32.pack(len(change.deletes))]
        for key in change.deletes:
            parts += [_U32.pack(len(key)), key]
        for key, value in change.record_puts:
            parts += [_U32.pack(len(key)), key, _U32.pack(len(value)), value]
        return b"".join(parts)
    if isinstance(change, SetTopicSeed):
        return bytes((Kind.SET_TOPIC_SEED,)) + json.dumps(list(change.patterns)).encode()
    return bytes((Kind.NOOP,))


def _decode_gc_write(body: bytes) -> GcWrite:
    generation, deleted = _U32.unpack_from(body), _U32.unpack_from(body, _U32.size)
    fields: list[bytes] = []
    at = 2 * _U32.size
    while at < len(body):
        (size,) = _U32.unpack_from(body, at)
        at += _U32.size
        if at + size > len(body):
            raise ValueError("a key or value runs past the entry's end")
        fields.append(body[at:at + size])
        at += size
    deletes, puts = fields[:deleted[0]], fields[deleted[0]:]
    if len(deletes) < deleted[0] or len(puts) % 2:
        raise ValueError("the deletes and the record pairs do not add up")
    return GcWrite(generation[0], tuple(deletes),
                   tuple(zip(puts[::2], puts[1::2], strict=True)))


def _decode_patterns(body: bytes) -> tuple[str, ...]:
    patterns = json.loads(body.decode("utf-8"))
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ValueError("the seed is not a list of patterns")
    return tuple(patterns)


def decode(raw: bytes) -> Change:
    if not raw:
        raise CorruptDataError("empty shard log entry")
    kind, body = raw[0], raw[1:]
    try:
        if kind == Kind.BATCH:
            return body
        if kind == Kind.ADD_GENERATION:
            (at,) = _U64.unpack_from(body)
            return AddGeneration(at, _decode_patterns(body[_U64.size:]))
        if kind == Kind.DROP_GENERATION:
            (generation,) = _U32.unpack(body)
            return DropGeneration(generation)
        if kind == Kind.GC_WRITE:
            return _decode_gc_write(body)
        if kind == Kind.SET_TOPIC_SEED:
            return SetTopicSeed(_decode_patterns(body))
        if kind == Kind.NOOP and not body:
            return Noop()
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CorruptDataError(f"shard log entry of kind {kind} does not decode: "
                               f"{exc}") from exc
    raise CorruptDataError(f"shard log entry of unknown kind {kind} ({len(raw)} bytes)")
