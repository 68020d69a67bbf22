"""Cooked batches: what a shard leader makes of a write-buffer flush, once.

Timestamps are assigned, the topic structure is learned and keys are encoded before
anything is written, so a replica applies exactly the leader's bytes and never
diverges. Applying the same cooked batch twice writes the same keys and values."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ..errors import CorruptDataError
from .lts import STATIC_INDEX_BYTES, Edge, StaticIndex
from .message import Message
from .rocks import blob, read_blob

FORMAT_VERSION = 1
# version, shard, generation, last timestamp, messages, entries, edges, record puts,
# record deletes
_HEADER = struct.Struct(">BIIQIIIII")
_U32 = struct.Struct(">I")


@dataclass(slots=True)
class CookedBatch:
    shard: int
    generation: int
    last_timestamp: int
    message_count: int
    payload_bytes: int = 0
    entries: list[tuple[bytes, bytes]] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    # Small records written atomically with the messages, in the shard's metadata
    # (a publisher's QoS 2 packet ids, so a resent PUBLISH is never stored twice).
    record_puts: list[tuple[bytes, bytes]] = field(default_factory=list)
    record_deletes: list[bytes] = field(default_factory=list)
    # The leader's view of what it cooked, for the commit feed: each message with the
    # static index of its stream. Not shipped to replicas (they do not feed).
    messages: list[tuple[StaticIndex, Message]] = field(default_factory=list, compare=False,
                                                         repr=False)

    def to_bytes(self) -> bytes:
        parts = [_HEADER.pack(FORMAT_VERSION, self.shard, self.generation, self.last_timestamp,
                              self.message_count, len(self.entries), len(self.edges),
                              len(self.record_puts), len(self.record_deletes)),
                 _U32.pack(self.payload_bytes)]
        for key, value in [*self.entries, *self.record_puts]:
            parts += (blob(key), blob(value))
        parts += (blob(key) for key in self.record_deletes)
        for edge in self.edges:
            label = edge.label.encode("utf-8")
            parts += (edge.parent, edge.child, blob(label))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, raw: bytes) -> CookedBatch:
        try:
            (version, shard, generation, last_ts, n_msgs, n_entries, n_edges, n_puts,
             n_deletes) = _HEADER.unpack_from(raw)
            if version != FORMAT_VERSION:
                raise ValueError(f"unknown cooked batch version {version}")
            pos = _HEADER.size
            (payload_bytes,) = _U32.unpack_from(raw, pos)
            pos += 4
            pairs: list[tuple[bytes, bytes]] = []
            for _ in range(n_entries + n_puts):
                key, pos = read_blob(raw, pos)
                value, pos = read_blob(raw, pos)
                pairs.append((key, value))
            deletes: list[bytes] = []
            for _ in range(n_deletes):
                key, pos = read_blob(raw, pos)
                deletes.append(key)
            edges: list[Edge] = []
            for _ in range(n_edges):
                parent = raw[pos:pos + STATIC_INDEX_BYTES]
                child = raw[pos + STATIC_INDEX_BYTES:pos + 2 * STATIC_INDEX_BYTES]
                label, pos = read_blob(raw, pos + 2 * STATIC_INDEX_BYTES)
                edges.append(Edge(parent, label.decode("utf-8"), child))
            if pos != len(raw):
                raise ValueError("trailing bytes")
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            raise CorruptDataError(f"cooked batch does not decode: {exc}") from exc
        return cls(shard, generation, last_ts, n_msgs, payload_bytes, pairs[:n_entries], edges,
                   pairs[n_entries:], deletes)


