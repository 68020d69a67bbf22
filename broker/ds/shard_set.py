"""This site's copy of one database (`messages`, `sessions`, `retained`): its
shards, their locks, the reads in flight on their generations, the streams it knows,
its commit feed, and the reads and changes of the shards here. Built first; the
backends (`backend.py`) write and change it, the `Database` facade reads it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import ParamSpec, TypeVar

from ..errors import ConfigError, InvalidIteratorError
from ..files import write_atomically
from ..metrics import Tally
from ..topic import levels_match
from . import metrics
from .cooked import CookedBatch
from .feed import CommitFeed
from .generation import GenerationInfo
from .install import recover_shard_folder, swap_in_staged
from .iterator import END_OF_STREAM, EndOfStream, Iterator, Stream
from .layouts import ReadStats
from .lts import TrieBounds
from .message import Message, decode_message, peek_timestamp
from .options import DbOptions
from .shard import Shard, now_us
from .streams import StreamIndex

log = logging.getLogger(__name__)

DB_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
META_FILE = "db.json"

NextResult = tuple[Iterator, list[tuple[bytes, Message]]]
DropListener = Callable[[int, int], None]
PreDropListener = Callable[[int, int], Awaitable[None]]

P = ParamSpec("P")
T = TypeVar("T")

# A read of up to this many entries runs on the event loop. rocksdict holds the GIL
# while it iterates (measured: a thread iterating left the loop ~5% of its time), so
# an executor read blocks the loop just the same, and adds a thread hand-off that
# cost ~10% of the loop in an offline drain. Larger reads go to the executor, where
# the GIL's switch interval at least lets the loop run now and then.
INLINE_READ_ENTRIES = 256

# A batch up to this size is written on the event loop (a site's own batch, and a
# replica's committed one as it applies it): handing it to the executor costs ~65 us
# of CPU (thread wake-up, GIL, result back to the loop), more than the RocksDB write
# of a few hundred small entries. Larger batches, and any write RocksDB would stall,
# go to the executor (256 KiB of 1 KiB payloads in batches of 1000 wrote 13-20%
# slower on the loop than from the executor).
INLINE_WRITE_ENTRIES = 256
INLINE_WRITE_BYTES = 32 * 1024


def shard_of(client_id: str, n_shards: int) -> int:
    """Messages are sharded by publisher client id, so a client's messages, its QoS 2
    records and its session share a shard."""
    return zlib.crc32(client_id.encode("utf-8")) % n_shards


def open_shard(db_name: str, path: Path, shard_id: int, options: DbOptions,
               replicated: bool) -> Shard:
    """Open one shard of a database with its share of the database's bounds. Blocking."""
    return Shard(path, shard_id, options.layout, options.layout_options,
                 options.wildcard_thresholds, options.sync_writes,
                 options.topic_cache_bytes // options.n_shards,
                 TrieBounds(options.learned_topic_max_levels,
                            options.learned_topic_bytes // options.n_shards),
                 metrics.LTS_FOLDED_TOPICS.labels(db_name), replicated)


def _check_stored_options(path: Path, name: str, options: DbOptions) -> None:
    meta = path / META_FILE
    if meta.exists():
        stored = json.loads(meta.read_text())
        if stored["n_shards"] != options.n_shards:
            raise ConfigError(
                f"durable_storage.{name}.n_shards: is {options.n_shards} but database "
                f"{name!r} was created with {stored['n_shards']} shards in {path}; "
                "n_shards is fixed when a database is created")
        if stored.get("key_value", False) != options.key_value:
            raise ConfigError(f"database {name!r} in {path} was not created as a "
                              f"{'key-value' if options.key_value else 'messages'} database")
        return
    path.mkdir(parents=True, exist_ok=True)
    write_atomically(meta, json.dumps({"n_shards": options.n_shards, "format": 1,
                                       "key_value": options.key_value}))


class ShardSet:
    """Over ~300 lines: the shards' reads and changes share the reads in flight and
    the shard locks, which must not leave this class (a drop waits for the reads of
    its generation, a replacement for those of its shard)."""

    def __init__(self, name: str, path: Path, options: DbOptions, shards: list[Shard],
                 executor: Executor, site_id: str = "") -> None:
        self.name = name
        # the site holding this copy: on one site, every shard's replica and leader
        self.site_id = site_id
        self.path = path
        self.options = options
        self.shards = shards
        self.executor = executor
        self._locks = [asyncio.Lock() for _ in shards]
        # read metrics, their labelled children made once (each .labels() call locks)
        self._layout_tallies: dict[str, tuple[Tally, Tally, Tally]] = {}
        self._next_time = metrics.NEXT_TIME.labels(name)
        self._drop_listeners: list[DropListener] = []
        self._pre_drop_listeners: list[PreDropListener] = []
        self.streams = StreamIndex()
        for shard in shards:
            for generation_id, generation in sorted(shard.generations.items()):
                self.streams.note(shard.shard_id, generation_id, generation.trie.edges())
        self.feed = CommitFeed(name, len(shards), self.streams, self._messages_of)
        self._reads_in_flight: Counter[tuple[int, int]] = Counter()
        self._read_finished = asyncio.Condition()
        self.update_generation_gauges()
        for shard in shards:
            metrics.LTS_BYTES.labels(name, str(shard.shard_id)).set_function(
                partial(self._trie_bytes, shard.shard_id))

    def _trie_bytes(self, shard_id: int) -> int:
        return sum(generation.trie.bytes
                   for generation in list(self.shards[shard_id].generations.values()))

    @classmethod
    async def open(cls, name: str, data_dir: Path, options: DbOptions,
                   executor: Executor, site_id: str = "", replicated: bool = False
                   ) -> ShardSet:
        """Open (creating on first use) this site's copy of a database; `replicated`:
        its shards apply the batches of their replication logs."""
        if not DB_NAME.match(name):
            raise ConfigError(f"database name {name!r}: use lowercase letters, digits and _")
        if options.n_shards < 1:
            raise ConfigError(f"durable_storage.{name}.n_shards: must be at least 1")
        path = data_dir / name
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(executor, _check_stored_options, path, name, options)
        shards: list[Shard] = []
        try:
            for shard_id in range(options.n_shards):
                await loop.run_in_executor(executor, recover_shard_folder,
                                           path / str(shard_id))
                shards.append(await loop.run_in_executor(
                    executor, open_shard, name, path / str(shard_id), shard_id, options,
                    replicated))
        except BaseException:
            for shard in shards:
                shard.close()
            raise
        return cls(name, path, options, shards, executor, site_id)

    async def run(self, blocking: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`blocking(*args, **kwargs)` in the storage's executor."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, partial(blocking, *args, **kwargs))

    def shard_lock(self, shard_id: int) -> asyncio.Lock:
        """Held while a shard writes, adds or drops a generation: a holder sees its
        generations stay put."""
        return self._locks[shard_id]

    def shard(self, shard_id: int) -> Shard:
        """The shard, InvalidIteratorError when the database has no such shard."""
        if not 0 <= shard_id < len(self.shards):
            raise InvalidIteratorError(f"database {self.name!r} has no shard {shard_id}")
        return self.shards[shard_id]

    # -- reading ------------------------------------------------------------------

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        """`Database.next` on this site's copy of the shard, wherever the shard is
        held. A generation newer than any here reads as empty (this copy is behind),
        one older than the newest and gone as its end (dropped)."""
        started = time.perf_counter()
        stream = iterator.stream
        shard = self.shard(stream.shard)
        generation = shard.generations.get(stream.generation)
        if generation is None:
            if not shard.generations or stream.generation > max(shard.generations):
                # Not made here yet (a replica behind the one the stream came from):
                # nothing to read so far, not the end of a dropped generation.
                return iterator, []
            return END_OF_STREAM
        read_key = (stream.shard, stream.generation)
        filter_levels = iterator.topic_filter.split("/")
        while True:
            stats = ReadStats()
            # Captured before the read: a generation closed before the read started
            # holds nothing the read missed, so an empty read of it is the end. One
            # closed during the read may have taken a batch the read did not see.
            closed_before_read = not generation.info.is_current
            self._reads_in_flight[read_key] += 1
            try:
                if batch_size <= INLINE_READ_ENTRIES:
                    entries = shard.read(stream.generation, stream.static, iterator.pattern,
                                         filter_levels, iterator.last_timestamp, batch_size,
                                         stats)
                else:
                    entries = await asyncio.get_running_loop().run_in_executor(
                        self.executor, shard.read, stream.generation, stream.static,
                        iterator.pattern, filter_levels, iterator.last_timestamp, batch_size,
                        stats)
            finally:
                self._reads_in_flight[read_key] -= 1
                async with self._read_finished:
                    self._read_finished.notify_all()
            self._count_read(generation.layout.name, stats)
            if entries is None or (not entries and closed_before_read):
                return END_OF_STREAM
            if entries or stats.wait_until is None:
                break
            # An open epoch of the `wildcard_optimized` layout holds messages for this
            # reader: they are readable once it closes (at most one epoch from now).
            # An empty answer instead would tell the caller it has caught up.
            await asyncio.sleep(max(stats.wait_until - now_us(), 0) / 1_000_000)
            if shard.generations.get(stream.generation) is not generation:
                return END_OF_STREAM
        self._next_time.observe(time.perf_counter() - started)
        if not entries:
            return iterator, []
        # Iterator bytes come from outside (a client's session, another site): a valid
        # checksum does not make the stream/filter pair honest, so every message is
        # checked against the filter. Those that fail are skipped, not returned.
        messages = []
        matched = None  # runs of one topic are the rule in a stream: check each run once
        for key, value in entries:
            message = decode_message(value)
            if message.topic != matched:
                if not levels_match(filter_levels, message.topic.split("/")):
                    continue
                matched = message.topic
            messages.append((key, message))
        return iterator.advanced_to(peek_timestamp(entries[-1][1])), messages

    def _count_read(self, layout: str, stats: ReadStats) -> None:
        tallies = self._layout_tallies.get(layout)
        if tallies is None:
            tallies = self._layout_tallies[layout] = (
                metrics.LAYOUT_SEEK.labels(self.name, layout),
                metrics.LAYOUT_NEXT.labels(self.name, layout),
                metrics.LAYOUT_HASH_COLLISIONS.labels(self.name, layout))
        tallies[0].value += stats.seeks
        tallies[1].value += stats.nexts
        tallies[2].value += stats.hash_collisions

    @contextlib.asynccontextmanager
    async def reading(self, shard_id: int, generation_id: int) -> AsyncIterator[None]:
        """Count as a read in flight on a generation: a drop of it waits until the
        block ends (for long scans off the event loop, such as generation GC)."""
        read_key = (shard_id, generation_id)
        self._reads_in_flight[read_key] += 1
        try:
            yield
        finally:
            self._reads_in_flight[read_key] -= 1
            async with self._read_finished:
                self._read_finished.notify_all()

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        """`Database.read_message` on this site's copy of the shard."""
        shard = self.shard(stream.shard)
        generation = shard.generations.get(stream.generation)
        if generation is None:
            return None
        async with self.reading(stream.shard, stream.generation):
            raw = await self.run(generation.layout.read_one, generation.data, stream.static,
                                 timestamp)
        return None if raw is None else decode_message(raw)

    async def scan_records(self, shard_id: int, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """Up to `limit` (None: Shard.scan_records' own) records of one shard here
        whose key starts with `prefix` and comes after `after` (None: from the first)."""
        shard = self.shards[shard_id]
        if limit is None:
            return await self.run(shard.scan_records, prefix)
        return await self.run(shard.scan_records, prefix, limit, after)

    async def get_records(self, shard_id: int, keys: list[bytes]) -> list[bytes | None]:
        """Several records of one shard here in one read, None where there is none."""
        return await self.run(self.shards[shard_id].get_records, keys)

    async def get_record(self, shard_id: int, key: bytes) -> bytes | None:
        """One record of a shard here, None when there is none."""
        return await self.run(self.shards[shard_id].get_record, key)

    # -- changes ------------------------------------------------------------------

    async def add_generation(self, shard_id: int, at: int | None = None,
                             seed: Sequence[str] | None = None,
                             applied: int | None = None) -> None:
        """Start a new generation of a shard; the old one stops taking writes.
        `applied`: the log offset of the change, recorded in the same write."""
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            info = await self.run(shard.add_generation, at, seed, applied=applied)
            # the new generation starts with the wildcard streams it inherited
            self.streams.note(shard_id, info.id, shard.generations[info.id].trie.edges())
        self.update_generation_gauges()

    async def set_topic_seed(self, shard_id: int, patterns: Sequence[str],
                             applied: int | None = None) -> None:
        async with self._locks[shard_id]:
            await self.run(self.shards[shard_id].set_topic_seed, patterns, applied=applied)

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]],
                       applied: int | None = None) -> None:
        """`Shard.gc_write` under the shard lock (GenerationError, nothing written,
        when there are deletes and the generation is gone or current). A log entry's
        (`applied`: its offset) cannot be refused, as every replica must apply it the
        same way: its deletes are then dropped, its records put."""
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            if applied is not None and deletes:
                generation = shard.generations.get(generation_id)
                if generation is None or generation.info.is_current:
                    log.warning("%s/%d: log entry %d deletes nothing: generation %d is gone "
                                "or current", self.name, shard_id, applied, generation_id)
                    deletes = []
            await self.run(shard.gc_write, generation_id, deletes, record_puts,
                           applied=applied)

    async def record_applied(self, shard_id: int, applied: int) -> None:
        """Record a log offset as applied to a shard, changing nothing else."""
        async with self._locks[shard_id]:
            await self.run(self.shards[shard_id].record_applied, applied)

    async def drop_generation(self, shard_id: int, generation_id: int,
                              applied: int | None = None) -> None:
        """Delete a closed generation of one shard, once reads in flight are done
        (GenerationError, nothing changed, when it is not there or current)."""
        shard = self.shards[shard_id]
        about_to_go = shard.generations.get(generation_id)
        if about_to_go is not None and not about_to_go.info.is_current:
            await self.tell_pre_drop_listeners(shard_id, generation_id)
        async with self._locks[shard_id]:
            generation = shard.detach_generation(generation_id)
            async with self._read_finished:
                await self._read_finished.wait_for(
                    lambda: not self._reads_in_flight[(shard_id, generation_id)])
            await self.run(shard.destroy_generation, generation, applied=applied)
        self.after_drop(shard_id, generation_id)

    async def write_applied(self, shard_id: int, cooked: CookedBatch, offset: int) -> None:
        """Write and apply a committed batch of a shard's log, recording `offset` as
        applied in the same write."""
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            if not self.write_inline(shard, cooked, offset):
                await self.run(shard.write, cooked, applied=offset)
            shard.apply(cooked, applied=offset)

    def write_inline(self, shard: Shard, cooked: CookedBatch, applied: int | None = None
                     ) -> bool:
        """Write a small batch on the loop (`Shard.write`); False when it must go to
        the executor (large, synced, or RocksDB would stall it)."""
        if (shard.sync_writes
                or len(cooked.entries) + len(cooked.record_puts) > INLINE_WRITE_ENTRIES
                or cooked.payload_bytes + sum(len(value) for _, value in cooked.record_puts)
                > INLINE_WRITE_BYTES):
            return False
        try:
            shard.write(cooked, no_stall=True, applied=applied)
        except Exception:  # a stall (or a real error, which the executor write reports)
            metrics.BUFFER_INLINE_REFUSED.labels(self.name, str(shard.shard_id)).inc()
            return False
        return True

    def _messages_of(self, cooked: CookedBatch) -> list[tuple[bytes, Message]]:
        """The messages of a batch applied here but cooked elsewhere (the commit feed
        decodes them when someone wants them), right after it was applied."""
        return self.shards[cooked.shard].messages_of(cooked)

    async def replace_shard(self, shard_id: int) -> None:
        """Put the shard folder staged next to the shard's (see `install.py`) in its
        place and open it: a checkpoint of another replica, with its data, generations
        and applied offset. Waits for reads in flight on the shard; streams of the old
        shard's generations are forgotten, those of the new one learned; readers of the
        shard get a feed gap."""
        old = self.shards[shard_id]
        async with self._locks[shard_id]:
            async with self._read_finished:
                await self._read_finished.wait_for(
                    lambda: not any(count for (shard, _generation), count
                                    in self._reads_in_flight.items() if shard == shard_id))
            old_generations = set(old.generations)
            for generation_id in old_generations:
                self.streams.forget_generation(shard_id, generation_id)
            await self.run(old.close)
            await self.run(swap_in_staged, old.path)
            new = await self.run(open_shard, self.name, old.path, shard_id, self.options,
                                 old.replicated)
            self.shards[shard_id] = new
            for generation_id, generation in sorted(new.generations.items()):
                self.streams.note(shard_id, generation_id, generation.trie.edges())
            # What the checkpoint brought was fed to no reader here: readers of the
            # shard go back to storage before the next applied batch reaches them.
            self.feed.feed_gap(shard_id)
        self.update_generation_gauges()
        for generation_id in sorted(old_generations - new.generations.keys()):
            self._tell_drop_listeners(shard_id, generation_id)

    # -- generation listeners -----------------------------------------------------

    def after_drop(self, shard_id: int, generation_id: int) -> None:
        """A generation of a shard is gone (here, or at the replicas of a shard read
        elsewhere): its streams and every reader's trace of it go."""
        self.streams.forget_generation(shard_id, generation_id)
        self.update_generation_gauges()
        self._tell_drop_listeners(shard_id, generation_id)

    def _tell_drop_listeners(self, shard_id: int, generation_id: int) -> None:
        for listener in self._drop_listeners:
            try:
                listener(shard_id, generation_id)
            except Exception:  # a listener's bug must not stop retention
                log.exception("generation drop listener failed on %s/%d/%d", self.name,
                              shard_id, generation_id)

    async def tell_pre_drop_listeners(self, shard_id: int, generation_id: int) -> None:
        # Outside the shard lock: a listener reads the generation, writes go on.
        for listener in self._pre_drop_listeners:
            try:
                await listener(shard_id, generation_id)
            except Exception:  # a listener's bug must not stop retention
                log.exception("generation pre-drop listener failed on %s/%d/%d", self.name,
                              shard_id, generation_id)

    def add_generation_pre_drop_listener(self, listener: PreDropListener) -> None:
        """Await `listener(shard, generation)` before a closed generation is dropped,
        while it can still be read (to account for what is lost with it). Reads that
        start later may still see it until the drop itself."""
        self._pre_drop_listeners.append(listener)

    def add_generation_drop_listener(self, listener: DropListener) -> None:
        """Call `listener(shard, generation)` on the event loop after a generation is
        dropped (by retention or by hand): cursors into it will read nothing more."""
        self._drop_listeners.append(listener)

    def local_generations(self) -> list[list[GenerationInfo]]:
        """Per shard, the infos of its generations here."""
        return [[generation.info for generation in shard.generations.values()]
                for shard in self.shards]

    def update_generation_gauges(self) -> None:
        for shard in self.shards:
            metrics.GENERATIONS.labels(self.name, str(shard.shard_id)).set(len(shard.generations))

    async def close(self) -> None:
        """Close every shard (the write buffers are flushed first)."""
        for shard in self.shards:
            await self.run(shard.close)
