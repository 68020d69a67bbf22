"""A TEST DOUBLE for unit tests only: an in-memory stand-in for the part of
`DurableStorage` a `Session` reads through (`MessageReader`, in
broker/session/reader.py), so the session's own logic can be tested fast and
deterministically. It is never used by the broker, nor by integration tests (those
run real RocksDB).

What it models, and how it simplifies the real storage:
- a stream is (shard, generation, static) and holds the messages of ONE topic (the
  real storage groups topics by their static levels); a filter reads the streams
  whose topic it matches;
- messages get increasing timestamps as they are stored (`store`), in the current
  generation of their shard;
- an iterator is positioned by timestamp: `next` returns the messages after it;
  once a closed generation is read out it returns `EndOfStream`, and an open one
  returns an empty batch;
- `stream_version` grows by one per stream learned, and `get_streams_since` answers
  with the streams learned after a version, as the real database does;
- dropping a generation forgets its streams: `make_iterator` on them raises
  `InvalidIteratorError`, `read_message` finds nothing, `next` ends.
It also counts the reads of each stream, so tests can tell a stream is not read again.
`fail_reads` makes every read (`next`, `read_message`) raise, as a real read can (a
closed database, a failing disk); `failed_reads` counts the reads that raised.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from dataclasses import dataclass, field

from stratamq.broker.ds import (
    END_OF_STREAM,
    EndOfStream,
    GenerationInfo,
    Iterator,
    Message,
    NextResult,
    Rank,
    Stream,
)
from stratamq.broker.errors import InvalidIteratorError, UnknownDatabaseError
from stratamq.broker.topic import topic_matches, validate_filter

StreamList = list[tuple[Rank, Stream]]


def static_of(topic: str) -> bytes:
    return hashlib.blake2b(topic.encode(), digest_size=8).digest()


@dataclass
class _Generation:
    info: GenerationInfo
    # static -> (topic, messages in timestamp order)
    streams: dict[bytes, tuple[str, list[Message]]] = field(default_factory=dict)


class FakeDatabase:
    """One messages database: shards of generations of streams."""

    def __init__(self, name: str, n_shards: int) -> None:
        self.name = name
        self._shards: list[dict[int, _Generation]] = [
            {1: _Generation(GenerationInfo(1, "fake"))} for _ in range(n_shards)]
        self._clock = 0
        self._stream_version = 0
        self._stream_log: list[tuple[int, Stream]] = []
        self.reads: Counter[Stream] = Counter()  # `next` calls per stream
        self.fail_reads: Exception | None = None  # set: every read raises it
        self.failed_reads = 0

    # -- what the tests do to it -----------------------------------------------------

    def store(self, topic: str, payload: bytes = b"", *, qos: int = 1, shard: int = 0,
              client_id: str = "publisher", retain: bool = False) -> tuple[Stream, Message]:
        """Store a message in the current generation of `shard`; returns its stream
        and the message with its timestamp (what the commit feed hands a session)."""
        self._clock += 1000
        generation_id = self.current_generation(shard)
        generation = self._shards[shard][generation_id]
        static = static_of(topic)
        stream = Stream(shard, generation_id, static)
        if static not in generation.streams:
            generation.streams[static] = (topic, [])
            self._stream_version += 1
            self._stream_log.append((self._stream_version, stream))
        message = Message(topic, payload, client_id, qos, retain, timestamp=self._clock)
        generation.streams[static][1].append(message)
        return stream, message

    def current_generation(self, shard: int) -> int:
        return max(gid for gid, g in self._shards[shard].items() if g.info.is_current)

    def add_generation(self, shard: int) -> int:
        """Close the current generation of the shard and open the next one."""
        self._clock += 1000
        current = self.current_generation(shard)
        generations = self._shards[shard]
        generations[current].info = generations[current].info.closed(self._clock)
        new_id = current + 1
        generations[new_id] = _Generation(GenerationInfo(new_id, "fake", since=self._clock))
        return new_id

    def drop_generation(self, shard: int, generation_id: int) -> None:
        del self._shards[shard][generation_id]
        self._stream_log = [entry for entry in self._stream_log
                            if (entry[1].shard, entry[1].generation) != (shard, generation_id)]

    # -- the surface a session reads -------------------------------------------------

    @property
    def stream_version(self) -> int:
        return self._stream_version

    def get_streams_since(self, topic_filter: str, version: int) -> tuple[int, StreamList]:
        validate_filter(topic_filter)
        found = [(stream.rank, stream) for learned, stream in self._stream_log
                 if learned > version and self._reads(topic_filter, stream)]
        found.sort(key=lambda pair: (pair[0], pair[1].static))
        return self._stream_version, found

    def get_streams(self, topic_filter: str, start_time: int = 0) -> StreamList:
        validate_filter(topic_filter)
        found: StreamList = []
        for shard, generations in enumerate(self._shards):
            for generation_id, generation in sorted(generations.items()):
                if generation.info.until is not None and generation.info.until <= start_time:
                    continue
                for static in sorted(generation.streams):
                    stream = Stream(shard, generation_id, static)
                    if self._reads(topic_filter, stream):
                        found.append((stream.rank, stream))
        return found

    def make_iterator(self, stream: Stream, topic_filter: str, start_time: int = 0) -> Iterator:
        validate_filter(topic_filter)
        if self._generation(stream) is None:
            raise InvalidIteratorError(f"no generation {stream.generation} (dropped?)")
        if not self._reads(topic_filter, stream):
            raise InvalidIteratorError(f"filter {topic_filter!r} does not read {stream}")
        return Iterator(stream, topic_filter, (), max(start_time - 1, 0))

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        await asyncio.sleep(0)  # a real read leaves the event loop too
        self._maybe_fail()
        self.reads[iterator.stream] += 1
        generation = self._generation(iterator.stream)
        if generation is None:
            return END_OF_STREAM
        _topic, messages = generation.streams[iterator.stream.static]
        after = [m for m in messages if m.timestamp > iterator.last_timestamp
                 and topic_matches(iterator.topic_filter, m.topic)][:batch_size]
        if not after:
            return END_OF_STREAM if not generation.info.is_current else (iterator, [])
        return (iterator.advanced_to(after[-1].timestamp),
                [(m.timestamp.to_bytes(8, "big"), m) for m in after])

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        await asyncio.sleep(0)
        self._maybe_fail()
        generation = self._generation(stream)
        if generation is None or stream.static not in generation.streams:
            return None
        return next((m for m in generation.streams[stream.static][1]
                     if m.timestamp == timestamp), None)

    def list_generations(self) -> dict[tuple[int, int], GenerationInfo]:
        return {(shard, gid): generation.info
                for shard, generations in enumerate(self._shards)
                for gid, generation in sorted(generations.items())}

    def _maybe_fail(self) -> None:
        if self.fail_reads is not None:
            self.failed_reads += 1
            raise self.fail_reads

    def _generation(self, stream: Stream) -> _Generation | None:
        if not 0 <= stream.shard < len(self._shards):
            return None
        generation = self._shards[stream.shard].get(stream.generation)
        if generation is None or stream.static not in generation.streams:
            return None
        return generation

    def _reads(self, topic_filter: str, stream: Stream) -> bool:
        generation = self._generation(stream)
        return generation is not None and \
            topic_matches(topic_filter, generation.streams[stream.static][0])


class FakeStorage:
    """The `DurableStorage` methods a session calls, over `FakeDatabase`s."""

    def __init__(self, db_name: str = "messages", n_shards: int = 2) -> None:
        self._databases = {db_name: FakeDatabase(db_name, n_shards)}

    def db(self, name: str) -> FakeDatabase:
        database = self._databases.get(name)
        if database is None:
            raise UnknownDatabaseError(f"no database {name!r}")
        return database

    def get_streams(self, db: str, topic_filter: str, start_time: int = 0) -> StreamList:
        return self.db(db).get_streams(topic_filter, start_time)

    def make_iterator(self, db: str, stream: Stream, topic_filter: str,
                      start_time: int = 0) -> Iterator:
        return self.db(db).make_iterator(stream, topic_filter, start_time)

    async def next(self, db: str, iterator: Iterator,
                   batch_size: int) -> NextResult | EndOfStream:
        return await self.db(db).next(iterator, batch_size)

    async def read_message(self, db: str, stream: Stream, timestamp: int) -> Message | None:
        return await self.db(db).read_message(stream, timestamp)

    def list_generations(self, db: str) -> dict[tuple[int, int], GenerationInfo]:
        return self.db(db).list_generations()

    def generations_known(self, db: str, shard: int) -> bool:
        self.db(db)
        return True  # every shard is held here
