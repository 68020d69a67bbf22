"""The index of the streams this site knows of one database: every stream in the
order it was learned, with a version number, and a per-filter cache of the streams
each topic filter reads (`Database.get_streams`)."""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from ..topic import validate_filter
from .generation import GenerationInfo
from .iterator import Rank, Stream
from .lts import END, Edge, Trie

StreamList = list[tuple[Rank, Stream]]

# Streams kept by the per-filter cache of `get_streams`, over all filters.
_STREAM_CACHE_ENTRIES = 1_000_000


class GenerationView(Protocol):
    """What stream discovery needs of a generation: its info and its learned trie
    (a local shard's `Generation`, or a mirror of another site's)."""

    @property
    def info(self) -> GenerationInfo: ...

    @property
    def trie(self) -> Trie: ...


# A shard's generations as this site reads them: its own, or a mirror of a replica's.
GenerationsOf = Callable[[int], Mapping[int, GenerationView]]


class StreamIndex:
    def __init__(self) -> None:
        # Every stream in the order this site learned it, with a version number, so a
        # caller can ask for the streams new since the version it last saw.
        self._stream_version = 0
        self._stream_log: list[tuple[int, Stream]] = []
        # per filter: the version it was computed at and its streams per
        # (shard, generation), each list sorted by static index
        self._stream_cache: dict[str, tuple[int, dict[tuple[int, int], list[Stream]]]] = {}
        self._stream_cache_size = 0

    def note(self, shard_id: int, generation_id: int, edges: Iterable[Edge]) -> None:
        """Learn the streams that end among `edges` of a shard's generation."""
        for edge in edges:
            if edge.label == END:
                self._stream_version += 1
                self._stream_log.append(
                    (self._stream_version, Stream(shard_id, generation_id, edge.child)))

    @property
    def version(self) -> int:
        """Grows whenever this site learns a stream (see `streams_since`)."""
        return self._stream_version

    def streams_since(self, topic_filter: str, version: int,
                      generations_of: GenerationsOf) -> tuple[int, StreamList]:
        """The streams learned after `version` that the filter reads, in rank order,
        and the version to ask with next time. Costs the new streams, not all."""
        levels = validate_filter(topic_filter)
        found: StreamList = []
        for _version, stream in self._stream_log[bisect_right(self._stream_log, version,
                                                              key=lambda entry: entry[0]):]:
            generation = generations_of(stream.shard).get(stream.generation)
            if generation is not None \
                    and generation.trie.match_static(levels, stream.static) is not None:
                found.append((stream.rank, stream))
        found.sort(key=lambda pair: (pair[0], pair[1].static))
        return self._stream_version, found

    def streams(self, topic_filter: str, start_time: int, shard_ids: range,
                generations_of: GenerationsOf) -> StreamList:
        """The streams that may hold messages matching the filter at or after
        `start_time` (µs), in rank order. Cached per filter and brought up to date
        with the streams learned since, so a wide filter over many streams does not
        walk the whole trie again."""
        cached = self._stream_cache.pop(topic_filter, None)
        if cached is None:  # one walk of each trie is cheaper than path by path
            levels = validate_filter(topic_filter)
            by_generation: dict[tuple[int, int], list[Stream]] = defaultdict(list)
            for shard_id in shard_ids:
                for generation_id, walked in generations_of(shard_id).items():
                    statics = sorted(match.static for match in walked.trie.match(levels))
                    by_generation[(shard_id, generation_id)] = [
                        Stream(shard_id, generation_id, static) for static in statics]
            new: StreamList = []
            version = self._stream_version
        else:
            cached_version, by_generation = cached
            self._stream_cache_size -= sum(len(v) for v in by_generation.values())
            version, new = self.streams_since(topic_filter, cached_version, generations_of)
        for rank, stream in new:
            streams = by_generation[(rank.x, rank.y)]
            streams.append(stream)
            if len(streams) > 1 and streams[-2].static > stream.static:
                streams.sort(key=lambda s: s.static)
        self._cache_streams(topic_filter, version, by_generation)
        found: StreamList = []
        for (shard_id, generation_id), streams in sorted(by_generation.items()):
            generation = generations_of(shard_id).get(generation_id)
            if generation is None or (generation.info.until is not None
                                      and generation.info.until <= start_time):
                continue
            rank = Rank(shard_id, generation_id)
            found += [(rank, stream) for stream in streams]
        return found

    def _cache_streams(self, topic_filter: str, version: int,
                       by_generation: dict[tuple[int, int], list[Stream]]) -> None:
        size = sum(len(streams) for streams in by_generation.values())
        while self._stream_cache and self._stream_cache_size + size > _STREAM_CACHE_ENTRIES:
            oldest = next(iter(self._stream_cache))
            _version, evicted = self._stream_cache.pop(oldest)
            self._stream_cache_size -= sum(len(streams) for streams in evicted.values())
        self._stream_cache[topic_filter] = (version, by_generation)
        self._stream_cache_size += size

    def forget_generation(self, shard_id: int, generation_id: int) -> None:
        """A generation is gone: its streams go from the log and every cached filter."""
        self._stream_log = [entry for entry in self._stream_log
                            if (entry[1].shard, entry[1].generation) != (shard_id, generation_id)]
        for _version, by_generation in self._stream_cache.values():
            self._stream_cache_size -= len(by_generation.pop((shard_id, generation_id), []))

    def forget_cached(self) -> None:
        """Where a shard is read from changed: the per-filter stream cache is rebuilt
        from the generations as they are now."""
        self._stream_cache.clear()
        self._stream_cache_size = 0
