"""Streams, ranks and iterators: positions that survive restarts and travel between
sites as bytes."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from ..errors import InvalidIteratorError
from ..topic import validate_filter
from .lts import STATIC_INDEX_BYTES, StaticIndex, Trie
from .rocks import blob, read_blob

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True, order=True)
class Rank:
    """Streams with different `x` (shard) replay in parallel; within one `x`, replay
    in increasing `y` (generation)."""

    x: int
    y: int


@dataclass(frozen=True, slots=True)
class Stream:
    shard: int
    generation: int
    static: StaticIndex

    @property
    def rank(self) -> Rank:
        return Rank(self.shard, self.generation)


@dataclass(frozen=True, slots=True)
class Iterator:
    """A position in a stream: the stream, the filter it reads, the varying-level
    pattern of that filter on this stream, and the last timestamp delivered."""

    stream: Stream
    topic_filter: str
    pattern: tuple[str, ...]
    last_timestamp: int

    @classmethod
    def start(cls, trie: Trie, stream: Stream, topic_filter: str,
              start_time: int = 0) -> Iterator:
        """An iterator over the messages of `stream` (a stream of `trie`'s generation)
        matching `topic_filter`, from `start_time` (µs) on. Walks the stream's own
        path (O(levels)), not the trie: a wildcard read opens one iterator per
        stream, and matching the whole trie for each was quadratic."""
        levels = validate_filter(topic_filter)
        match = trie.match_static(levels, stream.static)
        if match is not None:
            return cls(stream, topic_filter, match.pattern, max(start_time - 1, 0))
        raise InvalidIteratorError(f"filter {topic_filter!r} does not read stream {stream}")

    def advanced_to(self, timestamp: int) -> Iterator:
        return Iterator(self.stream, self.topic_filter, self.pattern, timestamp)

    def to_bytes(self) -> bytes:
        body = b"".join((
            _HEAD.pack(FORMAT_VERSION, self.stream.shard, self.stream.generation,
                       self.last_timestamp),
            self.stream.static,
            blob(self.topic_filter.encode("utf-8")),
            _U16.pack(len(self.pattern)),
            *(blob(level.encode("utf-8")) for level in self.pattern),
        ))
        return body + _U32.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, raw: bytes) -> Iterator:
        try:
            body, (checksum,) = raw[:-4], _U32.unpack(raw[-4:])
            if zlib.crc32(body) != checksum:
                raise ValueError("checksum mismatch")
            version, shard, generation, last_timestamp = _HEAD.unpack_from(body)
            if version != FORMAT_VERSION:
                raise ValueError(f"unknown iterator version {version}")
            pos = _HEAD.size
            static = body[pos:pos + STATIC_INDEX_BYTES]
            pos += STATIC_INDEX_BYTES
            topic_filter, pos = read_blob(body, pos)
            (count,) = _U16.unpack_from(body, pos)
            pos += 2
            pattern = []
            for _ in range(count):
                level, pos = read_blob(body, pos)
                pattern.append(level.decode("utf-8"))
            if pos != len(body) or len(static) != STATIC_INDEX_BYTES:
                raise ValueError("length mismatch")
            text_filter = topic_filter.decode("utf-8")
            validate_filter(text_filter)
        except Exception as exc:  # any failure to decode means the bytes are corrupt
            raise InvalidIteratorError(f"iterator does not decode: {exc}") from exc
        return cls(Stream(shard, generation, static), text_filter, tuple(pattern),
                   last_timestamp)


@dataclass(frozen=True, slots=True)
class EndOfStream:
    """The stream is complete: its generation is closed (or dropped) and read out."""


END_OF_STREAM = EndOfStream()

_HEAD = struct.Struct(">BIIQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
