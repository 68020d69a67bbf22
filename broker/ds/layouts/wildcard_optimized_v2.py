"""Layout `wildcard_optimized_v2` (the default).

Each message is one data key, `static index | 0x0000 | timestamp`, holding the
message, plus one empty index key per varying level,
`static index | level number | 8-byte hash of the level | timestamp`.
Reading a stream with no concrete varying level is a plain range scan of its data
keys. With concrete levels, the index iterators of those levels are zig-zagged to
the next timestamp they share, and the data key at that timestamp is fetched; the
topic is then checked against the filter, since two levels may share a hash. No
epochs, so nothing waits for an epoch to close."""

from __future__ import annotations

import hashlib
import struct
from itertools import islice
from typing import Any

from rocksdict import ReadOptions

from ...topic import levels_match
from ..cache import BytesBoundedCache
from ..lts import DEFAULT_TOPIC_CACHE_BYTES, PLUS, StaticIndex, TopicKey
from ..message import peek_topic
from ..rocks import after_prefix
from .base import KeyValueReader, ReadStats, StreamOf

NAME = "wildcard_optimized_v2"

_TS = struct.Struct(">Q")
_DATA_LEVEL = b"\x00\x00"
_LEVEL = struct.Struct(">H")
HASH_BYTES = 8


def level_hash(level: str) -> bytes:
    return hashlib.blake2b(level.encode("utf-8"), digest_size=HASH_BYTES).digest()


def data_prefix(static: StaticIndex) -> bytes:
    return static + _DATA_LEVEL


def data_key(static: StaticIndex, timestamp: int) -> bytes:
    return static + _DATA_LEVEL + _TS.pack(timestamp)


def index_prefix(static: StaticIndex, level_number: int, level: str) -> bytes:
    return static + _LEVEL.pack(level_number) + level_hash(level)


class WildcardOptimizedV2:
    name = NAME

    def __init__(self, cache_bytes: int = DEFAULT_TOPIC_CACHE_BYTES) -> None:
        # key prefixes of a topic's index entries, computed once per topic name
        # (a str key: its hash is cached, unlike a TopicKey's)
        self._index_prefixes: BytesBoundedCache[str, tuple[bytes, ...]] = \
            BytesBoundedCache(cache_bytes)

    def options(self) -> dict[str, Any]:
        return {}

    def _prefixes(self, topic: str, key: TopicKey) -> tuple[bytes, ...]:
        prefixes = self._index_prefixes.get(topic)
        if prefixes is None:
            prefixes = tuple(index_prefix(key.static, number, level)
                             for number, level in enumerate(key.varying, start=1))
            # a tuple of equally long bytes: 40 + 8 a slot, each 33 + its length
            self._index_prefixes.put(topic, prefixes, 40 + len(prefixes) * (
                8 + 33 + (len(prefixes[0]) if prefixes else 0)))
        return prefixes

    def clear_cache(self) -> None:
        self._index_prefixes.clear()

    def encode(self, topic: str, key: TopicKey, timestamp: int,
               value: bytes) -> list[tuple[bytes, bytes]]:
        ts = _TS.pack(timestamp)
        entries = [(key.static + _DATA_LEVEL + ts, value)]
        if key.varying:
            entries += [(prefix + ts, b"") for prefix in self._prefixes(topic, key)]
        return entries

    def read_one(self, data: KeyValueReader, static: StaticIndex,
                 timestamp: int) -> bytes | None:
        value = data.get(data_key(static, timestamp))
        return value if isinstance(value, bytes) else None

    def read(self, data: KeyValueReader, static: StaticIndex, pattern: tuple[str, ...],
             filter_levels: list[str], after: int, batch_size: int, stats: ReadStats,
             horizon: int | None = None,
             stream_of: StreamOf | None = None) -> list[tuple[bytes, bytes]]:
        # Keys are in timestamp order and every stream has its own: neither the
        # horizon nor stream membership matters.
        constrained = [index_prefix(static, number, level)
                       for number, level in enumerate(pattern, start=1) if level != PLUS]
        if not constrained:
            return self._scan(data, static, after, batch_size, stats)
        return self._zigzag(data, static, constrained, filter_levels, after, batch_size, stats)

    def _scan(self, data: KeyValueReader, static: StaticIndex, after: int, batch_size: int,
              stats: ReadStats) -> list[tuple[bytes, bytes]]:
        prefix = data_prefix(static)
        read_options = ReadOptions()
        upper = after_prefix(prefix)
        if upper is not None:
            read_options.set_iterate_upper_bound(upper)
        stats.seeks += 1
        # islice walks the RocksDB iterator in C: this runs on a thread that must
        # hold the GIL for every Python step, and the event loop waits for it
        found: list[tuple[bytes, bytes]] = list(islice(
            data.items(from_key=prefix + _TS.pack(after + 1), read_opt=read_options),
            batch_size))
        stats.nexts += len(found)
        return found

    def _zigzag(self, data: KeyValueReader, static: StaticIndex, prefixes: list[bytes],
                filter_levels: list[str], after: int, batch_size: int,
                stats: ReadStats) -> list[tuple[bytes, bytes]]:
        iterators = [data.iter() for _ in prefixes]
        found: list[tuple[bytes, bytes]] = []
        candidate = after + 1
        while len(found) < batch_size:
            # Seek each index to `candidate`; whenever one lands later, that becomes
            # the new candidate. All agree after at most one full round without moves.
            agreed = 0
            position = 0
            while agreed < len(prefixes):
                prefix = prefixes[position]
                iterator = iterators[position]
                iterator.seek(prefix + _TS.pack(candidate))
                stats.seeks += 1
                if not iterator.valid():
                    return found
                key = iterator.key()
                if not key.startswith(prefix):
                    return found
                timestamp = _TS.unpack_from(key, len(prefix))[0]
                if timestamp == candidate:
                    agreed += 1
                else:
                    candidate = timestamp
                    agreed = 1
                position = (position + 1) % len(prefixes)
            key = data_key(static, candidate)
            value = data.get(key)
            stats.nexts += 1
            if value is not None:
                if levels_match(filter_levels, peek_topic(value).split("/")):
                    found.append((key, value))
                else:
                    stats.hash_collisions += 1
            candidate += 1
        return found
