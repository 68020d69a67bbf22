"""What a shard log entry holds: one change that every replica of the shard applies,
in log order, the same way. Pure.

A cooked batch (messages and records), the start of a new generation, or the drop of
an old one: generations change only through the log on a replicated site, so that
every replica has the same generations with the same ids and the same learned topic
structure. A no-op opens each leader epoch (a new leader commits the entries it
inherited with the first entry of its own epoch, see `commit.py`).

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
class Noop:
    pass


Change = bytes | AddGeneration | DropGeneration | Noop
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
    return bytes((Kind.NOOP,))


def decode(raw: bytes) -> Change:
    if not raw:
        raise CorruptDataError("empty shard log entry")
    kind, body = raw[0], raw[1:]
    try:
        if kind == Kind.BATCH:
            return body
        if kind == Kind.ADD_GENERATION:
            (at,) = _U64.unpack_from(body)
            seed = json.loads(body[_U64.size:].decode("utf-8"))
            if not isinstance(seed, list) or not all(isinstance(p, str) for p in seed):
                raise ValueError("the seed is not a list of patterns")
            return AddGeneration(at, tuple(seed))
        if kind == Kind.DROP_GENERATION:
            (generation,) = _U32.unpack(body)
            return DropGeneration(generation)
        if kind == Kind.NOOP and not body:
            return Noop()
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CorruptDataError(f"shard log entry of kind {kind} does not decode: "
                               f"{exc}") from exc
    raise CorruptDataError(f"shard log entry of unknown kind {kind} ({len(raw)} bytes)")
