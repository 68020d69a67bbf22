"""One database (`messages`, `sessions`, `retained`) on this site: its shards, their
write buffers, and the asyncio operations of the storage API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import zlib
from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import Protocol

from ..errors import (
    ConfigError,
    ForwardRefusedError,
    GenerationError,
    InvalidIteratorError,
    InvalidMessageError,
    InvalidTopicFilterError,
    PayloadTooLargeError,
)
from ..files import write_atomically
from ..metrics import Tally
from ..topic import check_topic, levels_match, validate_filter
from . import metrics
from .buffer import CommitListener, WriteBuffer
from .cooked import CookedBatch
from .fence import Fence
from .generation import GenerationInfo, RetentionPlan, plan_retention
from .install import recover_shard_folder, swap_in_staged
from .iterator import END_OF_STREAM, EndOfStream, Iterator, Rank, Stream
from .layouts import ReadStats
from .lts import END, Edge, Trie, TrieBounds
from .message import Message, decode_message, peek_timestamp
from .options import DbOptions
from .shard import Shard, now_us

log = logging.getLogger(__name__)

DB_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
META_FILE = "db.json"

NextResult = tuple[Iterator, list[tuple[bytes, Message]]]
DropListener = Callable[[int, int], None]
PreDropListener = Callable[[int, int], Awaitable[None]]
StreamList = list[tuple[Rank, Stream]]

# A read of up to this many entries runs on the event loop. rocksdict holds the GIL
# while it iterates (measured: a thread iterating left the loop ~5% of its time), so
# an executor read blocks the loop just the same, and adds a thread hand-off that
# cost ~10% of the loop in an offline drain. Larger reads go to the executor, where
# the GIL's switch interval at least lets the loop run now and then.
INLINE_READ_ENTRIES = 256
# Streams kept by the per-filter cache of `get_streams`, over all filters.
_STREAM_CACHE_ENTRIES = 1_000_000


class Replication(Protocol):
    """What a replicated site puts between a database and its shards (see
    `replication.site_replication`): writes and generation changes go through each shard's
    log, and come back to the database through its `apply_*` methods, in log order."""

    async def write(self, shard_id: int, messages: list[Message],
                    record_puts: list[tuple[bytes, bytes]], record_deletes: list[bytes],
                    fences: list[Fence]) -> None:
        """Commit one flush of a shard's write buffer; returns once applied here.
        FencedError (nothing written) when the shard's leader finds a fence that
        does not hold."""

    async def add_generation(self, shard_id: int) -> bool:
        """Start a new generation of a shard on its leader; False elsewhere."""

    async def drop_generation(self, shard_id: int, generation_id: int) -> bool:
        """Drop a closed generation of a shard on its leader; False elsewhere."""

    async def drop_generation_at_leader(self, shard_id: int, generation_id: int) -> None:
        """Drop a closed generation of a shard through its log, at its leader wherever
        that is; returns once applied there."""

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]]) -> None:
        """`Shard.gc_write` on every replica of a shard, through its log."""

    async def set_topic_seed(self, shard_id: int, patterns: tuple[str, ...]) -> None:
        """`Shard.set_topic_seed` on every replica of a shard, through its log."""

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        """The shard's replica set and leader as this site knows them (none and ""
        before the first placement)."""

    async def read_records(self, shard_id: int, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """The shard's records under `prefix` (the first `limit` after `after`), every
        write committed before the call included; a recoverable StorageError when that
        cannot be made sure in time."""

    async def close(self) -> None:
        """Stop applying: the shards are about to close."""


class GenerationView(Protocol):
    """What stream discovery needs of a generation: its info and its learned trie
    (a local shard's `Generation`, or a mirror of another site's)."""

    @property
    def info(self) -> GenerationInfo: ...

    @property
    def trie(self) -> Trie: ...


class RemoteShards(Protocol):
    """Reads of the shards this site holds no replica of (see
    `replication.remote`): their streams from a mirror of a replica's tries, their
    messages from a replica over the peer port."""

    def is_remote(self, shard_id: int) -> bool:
        """Whether this site reads the shard at another site."""

    def generations(self, shard_id: int) -> Mapping[int, GenerationView]:
        """The shard's generations as last mirrored from a replica."""

    def loaded(self, shard_id: int) -> bool:
        """Whether the shard's generations were mirrored at least once."""

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        """`Database.next` at a replica; a recoverable StorageError when none answers."""

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        """`Database.read_message` at a replica."""


FeedGapListener = Callable[[int, int], None]


def shard_of(client_id: str, n_shards: int) -> int:
    """Messages are sharded by publisher client id, so a client's messages, its QoS 2
    records and its session share a shard."""
    return zlib.crc32(client_id.encode("utf-8")) % n_shards


def open_shard(db_name: str, path: Path, shard_id: int, options: DbOptions) -> Shard:
    """Open one shard of a database with its share of the database's bounds. Blocking."""
    return Shard(path, shard_id, options.layout, options.layout_options,
                 options.wildcard_thresholds, options.sync_writes,
                 options.topic_cache_bytes // options.n_shards,
                 TrieBounds(options.learned_topic_max_levels,
                            options.learned_topic_bytes // options.n_shards),
                 metrics.LTS_FOLDED_TOPICS.labels(db_name))


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


class Database:
    def __init__(self, name: str, path: Path, options: DbOptions, shards: list[Shard],
                 executor: Executor, site_id: str = "") -> None:
        self.name = name
        # the site holding this copy: on one site, every shard's replica and leader
        self.site_id = site_id
        self.path = path
        self.options = options
        self.shards = shards
        self._executor = executor
        self.executor = executor
        self._locks = [asyncio.Lock() for _ in shards]
        # read metrics, their labelled children made once (each .labels() call locks)
        self._layout_tallies: dict[str, tuple[Tally, Tally, Tally]] = {}
        self._next_time = metrics.NEXT_TIME.labels(name)
        self._store_batch_time = metrics.STORE_BATCH_TIME.labels(name)
        self._commit_listeners: list[CommitListener] = []
        self._applied_listeners: set[CommitListener] = set()
        self._drop_listeners: list[DropListener] = []
        self._pre_drop_listeners: list[PreDropListener] = []
        # Every stream in the order this site learned it, with a version number, so a
        # caller can ask for the streams new since the version it last saw.
        self._stream_version = 0
        self._stream_log: list[tuple[int, Stream]] = []
        # per filter: the version it was computed at and its streams per
        # (shard, generation), each list sorted by static index
        self._stream_cache: dict[str, tuple[int, dict[tuple[int, int], list[Stream]]]] = {}
        self._stream_cache_size = 0
        for shard in shards:
            for generation_id, generation in sorted(shard.generations.items()):
                self._note_streams(shard.shard_id, generation_id, generation.trie.edges())
        self._buffers = [
            WriteBuffer(shard, name, max_items=options.max_items, max_bytes=options.max_bytes,
                        flush_interval=options.flush_interval, executor=executor, lock=lock,
                        on_commit=self._feed)
            for shard, lock in zip(shards, self._locks, strict=True)]
        self._reads_in_flight: Counter[tuple[int, int]] = Counter()
        self._read_finished = asyncio.Condition()
        self._replication: Replication | None = None
        self._remote: RemoteShards | None = None
        # The last timestamp fed per shard: a message reaches the commit listeners
        # once, whether it came from this site's apply or a leader's push (timestamps
        # are strictly increasing per shard).
        self._last_fed = [0] * len(shards)
        self._gap_listeners: list[FeedGapListener] = []
        self._update_generation_gauges()
        for shard in shards:
            metrics.LTS_BYTES.labels(name, str(shard.shard_id)).set_function(
                partial(self._trie_bytes, shard.shard_id))

    def _trie_bytes(self, shard_id: int) -> int:
        return sum(generation.trie.bytes
                   for generation in list(self.shards[shard_id].generations.values()))

    @classmethod
    async def open(cls, name: str, data_dir: Path, options: DbOptions,
                   executor: Executor, site_id: str = "") -> Database:
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
                    executor, open_shard, name, path / str(shard_id), shard_id, options))
        except BaseException:
            for shard in shards:
                shard.close()
            raise
        return cls(name, path, options, shards, executor, site_id)

    # -- writing ------------------------------------------------------------------

    def _validate(self, message: Message, topics_checked: bool) -> int:
        if self.options.key_value:
            raise InvalidMessageError(
                f"database {self.name!r} is a key-value database; it takes no messages")
        if not topics_checked:
            check_topic(message.topic)
        if len(message.payload) > self.options.max_payload_bytes:
            raise PayloadTooLargeError(
                f"payload of {len(message.payload)} bytes on {message.topic!r} is over the "
                f"limit of {self.options.max_payload_bytes} bytes")
        if message.qos not in (0, 1, 2):
            raise InvalidMessageError(f"QoS must be 0, 1 or 2, got {message.qos}")
        return len(message.payload) + len(message.topic)

    def submit(self, messages: list[Message], wait: bool = True, *,
               topics_checked: bool = False, records_of: str | None = None,
               record_puts: list[tuple[bytes, bytes]] | None = None,
               record_deletes: list[bytes] | None = None,
               fence: Fence | None = None) -> list[asyncio.Future[None]]:
        """Queue messages for writing now, in call order; with `wait`, the futures
        resolve once they are durable. Every message is checked before any is queued,
        so a bad one means nothing of the call is written. A shard whose buffer is
        far over its byte bound refuses messages (StorageBusyError, recoverable);
        records alone are always taken (they finish protocol flows).

        Records (small key-value pairs) of client `records_of` are written in the same
        atomic batch as that client's messages, in its shard.

        `topics_checked`: the caller has validated every topic name already (the
        broker's publish path, at the channel), so it is not checked again here.
        `fence`: a fenced write of `records_of`'s records and messages (`ds.fence`),
        all or nothing; it is always waited for."""
        if fence is not None:
            if records_of is None or any(m.client_id != records_of for m in messages):
                raise InvalidMessageError("a fenced write carries the records and "
                                          "messages of one client only")
            buffer = self._buffers[shard_of(records_of, self.options.n_shards)]
            size = sum(self._validate(message, topics_checked) for message in messages)
            if messages:
                buffer.refuse_when_overfull()
            done = buffer.add(messages, size, True, record_puts, record_deletes, [fence])
            assert done is not None
            return [done]
        if len(messages) == 1 and records_of is None:  # the broker's common case
            message = messages[0]
            size = self._validate(message, topics_checked)
            buffer = self._buffers[shard_of(message.client_id, self.options.n_shards)]
            buffer.refuse_when_overfull()
            done = buffer.add(messages, size, wait)
            return [] if done is None else [done]
        by_shard: dict[int, list[Message]] = defaultdict(list)
        sizes: Counter[int] = Counter()
        n_shards = self.options.n_shards
        for message in messages:
            size = self._validate(message, topics_checked)
            shard_id = shard_of(message.client_id, n_shards)
            by_shard[shard_id].append(message)
            sizes[shard_id] += size
        for shard_id in by_shard:  # before anything is queued: all or nothing
            self._buffers[shard_id].refuse_when_overfull()
        record_shard = None
        if records_of is not None:
            record_shard = shard_of(records_of, n_shards)
            by_shard.setdefault(record_shard, [])
        waits = [self._buffers[shard_id].add(
                     batch, sizes[shard_id], wait,
                     record_puts if shard_id == record_shard else None,
                     record_deletes if shard_id == record_shard else None)
                 for shard_id, batch in by_shard.items()]
        return [w for w in waits if w is not None]

    def submit_to_shard(self, shard_id: int, messages: list[Message],
                        record_puts: list[tuple[bytes, bytes]],
                        record_deletes: list[bytes],
                        fences: list[Fence] | None = None) -> asyncio.Future[None]:
        """Queue a write forwarded by another site to this shard's leader: the
        messages and records go into one batch of this shard, as they were in the
        sender's. Its topics and sizes were checked where the client published."""
        if not 0 <= shard_id < len(self._buffers):
            raise InvalidIteratorError(f"database {self.name!r} has no shard {shard_id}")
        size = sum(len(message.payload) + len(message.topic) for message in messages)
        done = self._buffers[shard_id].add(messages, size, True, record_puts, record_deletes,
                                           fences, forwarded=True)
        assert done is not None
        return done

    def refuse_forwarded(self, shard_id: int, error: ForwardRefusedError) -> None:
        """This site stopped leading the shard: the writes other sites forwarded to
        it that wait in its buffer fail now, unwritten (`WriteBuffer.refuse_forwarded`)."""
        self._buffers[shard_id].refuse_forwarded(error)

    def shard_lock(self, shard_id: int) -> asyncio.Lock:
        """Held while a shard writes, adds or drops a generation: a holder sees its
        generations stay put."""
        return self._locks[shard_id]

    def has_room(self, shard_id: int) -> bool:
        """Whether shard `shard_id`'s write buffer is under its byte bound."""
        return self._buffers[shard_id].has_room()

    async def wait_for_room(self, client_id: str) -> None:
        """Return once the write buffer of `client_id`'s shard is under its byte bound:
        a connection awaits this before reading more from a publisher's socket."""
        await self._buffers[shard_of(client_id, self.options.n_shards)].wait_for_room()

    async def scan_records(self, records_of: str, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The records of client `records_of` whose key starts with `prefix`."""
        shard = self.shards[shard_of(records_of, self.options.n_shards)]
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, shard.scan_records, prefix)

    async def scan_shard_records(self, shard_id: int, prefix: bytes, limit: int,
                                 after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """Up to `limit` records of one shard whose key starts with `prefix` and comes
        after `after` (None: from the first)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.shards[shard_id].scan_records, prefix, limit, after)

    async def get_shard_records(self, shard_id: int, keys: list[bytes]) -> list[bytes | None]:
        """Several records of one shard in one read, None where there is none."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.shards[shard_id].get_records, keys)

    async def drain_shard(self, shard_id: int) -> None:
        """Return once every write queued in the shard's write buffer before the call
        has been tried (committed or failed)."""
        await self._buffers[shard_id].drain()

    async def read_records(self, records_of: str,
                           prefix: bytes) -> list[tuple[bytes, bytes]]:
        """`scan_records`, but sure to see every write committed before the call: on
        a replicated site this site's copy may lag the shard's leader (or not be kept
        at all), so the read passes a read barrier or goes to a replica. A recoverable
        StorageError when that cannot be made sure in time: a reader must then not
        guess from what it has. On a site without replication: `scan_records`."""
        if self._replication is None:
            return await self.scan_records(records_of, prefix)
        return await self._replication.read_records(
            shard_of(records_of, self.options.n_shards), prefix)

    async def read_shard_records(self, shard_id: int, prefix: bytes, limit: int,
                                 after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """`scan_shard_records`, but sure to see every write committed before the call
        (see `read_records`): on a replicated site read at a replica of the shard, past
        a read barrier, wherever that replica is."""
        if self._replication is None:
            return await self.scan_shard_records(shard_id, prefix, limit, after)
        return await self._replication.read_records(shard_id, prefix, limit, after)

    async def read_shard_record(self, shard_id: int, key: bytes) -> bytes | None:
        """One record of a shard, as `read_shard_records` sees it."""
        if self._replication is None:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self.shards[shard_id].get_record, key)
        # a key sorts first among the keys it is a prefix of
        found = await self._replication.read_records(shard_id, key, 1)
        return found[0][1] if found and found[0][0] == key else None

    @property
    def replicated(self) -> bool:
        return self._replication is not None

    async def get_record(self, records_of: str, key: bytes) -> bytes | None:
        """One record of `records_of`'s shard, None when there is none."""
        shard = self.shards[shard_of(records_of, self.options.n_shards)]
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, shard.get_record, key)

    async def store_batch(self, messages: list[Message], sync: bool = True) -> None:
        """Store messages. With `sync`, return once they are durable (in RocksDB's
        write-ahead log, fsynced when `sync_writes`)."""
        started = time.perf_counter()
        waits = self.submit(messages, sync)
        if sync:
            await asyncio.gather(*waits)
            self._store_batch_time.observe(time.perf_counter() - started)

    # -- the commit feed ----------------------------------------------------------

    def add_commit_listener(self, listener: CommitListener, *, of_applied: bool = False
                            ) -> None:
        """Call `listener` on the event loop with every committed batch, after it is
        durable and visible to readers, in commit order per shard. A listener that
        feeds this site's readers gets no batch this site applies to a shard it reads
        elsewhere (a replica still catching up): what was pushed to the site and what
        it applies need not meet, so its readers get that shard from storage once the
        replica has caught up (a feed gap). `of_applied` listeners (the commit feed's
        pushes, as the shard's leader) get every applied batch."""
        self._commit_listeners.append(listener)
        if of_applied:
            self._applied_listeners.add(listener)

    def remove_commit_listener(self, listener: CommitListener) -> None:
        self._commit_listeners.remove(listener)

    # -- replication --------------------------------------------------------------

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        """The shard's replica set and leader: this site alone without replication."""
        if self._replication is None:
            return (self.site_id,), self.site_id
        return self._replication.placement_of(shard_id)

    async def replace_shard(self, shard_id: int) -> None:
        """Put the shard folder staged next to the shard's (see `install.py`) in its
        place and open it: a checkpoint of another replica, with its data, generations
        and applied offset. Waits for reads in flight on the shard; streams of the old
        shard's generations are forgotten, those of the new one learned; readers of the
        shard get a feed gap."""
        loop = asyncio.get_running_loop()
        old = self.shards[shard_id]
        async with self._locks[shard_id]:
            async with self._read_finished:
                await self._read_finished.wait_for(
                    lambda: not any(count for (shard, _generation), count
                                    in self._reads_in_flight.items() if shard == shard_id))
            old_generations = set(old.generations)
            for generation_id in old_generations:
                self._forget_generation_streams(shard_id, generation_id)
            await loop.run_in_executor(self._executor, old.close)
            await loop.run_in_executor(self._executor, swap_in_staged, old.path)
            options = self.options
            new = await loop.run_in_executor(
                self._executor, open_shard, self.name, old.path, shard_id, options)
            new.replicated = old.replicated
            self.shards[shard_id] = new
            self._buffers[shard_id].replace_shard(new)
            for generation_id, generation in sorted(new.generations.items()):
                self._note_streams(shard_id, generation_id, generation.trie.edges())
            # What the checkpoint brought was fed to no reader here: readers of the
            # shard go back to storage before the next applied batch reaches them.
            self.feed_gap(shard_id)
        self._update_generation_gauges()
        for generation_id in sorted(old_generations - new.generations.keys()):
            for listener in self._drop_listeners:
                try:
                    listener(shard_id, generation_id)
                except Exception:  # a listener's bug must not stop the install
                    log.exception("generation drop listener failed on %s/%d/%d",
                                  self.name, shard_id, generation_id)

    def attach_replication(self, replication: Replication) -> None:
        """From now on, writes and generation changes go through `replication`."""
        self._replication = replication
        for shard, buffer in zip(self.shards, self._buffers, strict=True):
            shard.replicated = True
            buffer.replicate = partial(replication.write, shard.shard_id)

    async def apply_batch(self, shard_id: int, cooked: CookedBatch, offset: int) -> None:
        """Write and apply a committed batch of a shard's log, recording `offset` as
        applied in the same write, then feed it to the commit listeners."""
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, partial(shard.write, cooked, applied=offset))
            shard.apply(cooked)
        if not cooked.messages and cooked.message_count:
            cooked.messages = shard.messages_of(cooked)
        try:
            self._feed(cooked, applied=True)
        except Exception:  # a listener's bug must not stop applying
            log.exception("commit listener failed on %s/%d", self.name, shard_id)

    async def apply_add_generation(self, shard_id: int, at: int, seed: tuple[str, ...],
                                   offset: int) -> None:
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            info = await asyncio.get_running_loop().run_in_executor(
                self._executor, partial(shard.add_generation, at, seed, applied=offset))
            self._note_streams(shard_id, info.id, shard.generations[info.id].trie.edges())
        self._update_generation_gauges()

    async def apply_drop_generation(self, shard_id: int, generation_id: int,
                                    offset: int) -> None:
        """Drop a generation as a log entry says. One that is not there, or current,
        is refused the same way on every replica: the entry is then only recorded."""
        shard = self.shards[shard_id]
        loop = asyncio.get_running_loop()
        about_to_go = shard.generations.get(generation_id)
        if about_to_go is not None and not about_to_go.info.is_current:
            await self._tell_pre_drop_listeners(shard_id, generation_id)
        async with self._locks[shard_id]:
            try:
                generation = shard.detach_generation(generation_id)
            except GenerationError as exc:
                log.warning("%s/%d: log entry %d drops no generation: %s", self.name,
                            shard_id, offset, exc)
                await loop.run_in_executor(self._executor, shard.record_applied, offset)
                return
            async with self._read_finished:
                await self._read_finished.wait_for(
                    lambda: not self._reads_in_flight[(shard_id, generation_id)])
            await loop.run_in_executor(self._executor, partial(
                shard.destroy_generation, generation, applied=offset))
        self._after_drop(shard_id, generation_id)

    async def apply_gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                             record_puts: list[tuple[bytes, bytes]], offset: int) -> None:
        """Delete expired messages of a closed generation as a log entry says. Deletes in
        a generation that is gone, or current, are refused the same way on every
        replica: only the entry's records are put."""
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            generation = shard.generations.get(generation_id)
            if deletes and (generation is None or generation.info.is_current):
                log.warning("%s/%d: log entry %d deletes nothing: generation %d is gone or "
                            "current", self.name, shard_id, offset, generation_id)
                deletes = []
            await asyncio.get_running_loop().run_in_executor(self._executor, partial(
                shard.gc_write, generation_id, deletes, record_puts, applied=offset))

    async def apply_topic_seed(self, shard_id: int, patterns: tuple[str, ...],
                               offset: int) -> None:
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            await asyncio.get_running_loop().run_in_executor(self._executor, partial(
                shard.set_topic_seed, patterns, applied=offset))

    async def apply_noop(self, shard_id: int, offset: int) -> None:
        shard = self.shards[shard_id]
        async with self._locks[shard_id]:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, shard.record_applied, offset)

    def _feed(self, cooked: CookedBatch, applied: bool = False) -> None:
        if cooked.edges:
            self._note_streams(cooked.shard, cooked.generation, cooked.edges)
        if applied and self._is_remote(cooked.shard):
            for listener in self._commit_listeners:
                if listener in self._applied_listeners:
                    listener(cooked)
            return
        last = self._last_fed[cooked.shard]
        if cooked.messages and cooked.messages[0][1].timestamp <= last:
            cooked.messages = [(static, message) for static, message in cooked.messages
                               if message.timestamp > last]
        if cooked.messages:
            self._last_fed[cooked.shard] = cooked.messages[-1][1].timestamp
        for listener in self._commit_listeners:
            listener(cooked)

    def feed_remote(self, shard_id: int, generation_id: int,
                    messages: list[tuple[bytes, Message]]) -> None:
        """Committed messages of a shard this site holds no replica of, pushed by its
        leader: fed to the commit listeners like a batch applied here (each message
        once per site, whichever way it came first). A push of a shard this site reads
        here (its placement here is newer or older than the leader's) is not fed: the
        site's applied batches feed it, or, once it reads the shard elsewhere, storage
        after the feed gap that switch declares."""
        if not messages or not self._is_remote(shard_id):
            return
        cooked = CookedBatch(shard_id, generation_id, messages[-1][1].timestamp,
                             len(messages), messages=messages)
        self._feed(cooked)

    def add_feed_gap_listener(self, listener: FeedGapListener) -> None:
        """Call `listener(shard, since)` when this site may have missed committed
        messages of a shard in its commit feed (a leader dropped a push, a leader
        changed): readers of that shard go back to storage, from their positions or
        from `since`, the first timestamp after everything fed here."""
        self._gap_listeners.append(listener)

    def feed_gap(self, shard_id: int) -> None:
        since = self._last_fed[shard_id] + 1
        for listener in self._gap_listeners:
            try:
                listener(shard_id, since)
            except Exception:  # a listener's bug must not stop the feed
                log.exception("feed gap listener failed on %s/%d", self.name, shard_id)

    def fed_through(self) -> list[int]:
        """Per shard, the last timestamp fed to the commit listeners here."""
        return list(self._last_fed)

    # -- reads of shards held elsewhere -------------------------------------------

    def attach_remote(self, remote: RemoteShards) -> None:
        """From now on, reads of the shards `remote` says are held elsewhere go there."""
        self._remote = remote
        self.forget_cached_streams()

    def _is_remote(self, shard_id: int) -> bool:
        return self._remote is not None and self._remote.is_remote(shard_id)

    def _generations_of(self, shard_id: int) -> Mapping[int, GenerationView]:
        if self._remote is not None and self._remote.is_remote(shard_id):
            return self._remote.generations(shard_id)
        return self.shards[shard_id].generations

    def generations_known(self, shard_id: int) -> bool:
        """Whether `list_generations` knows the shard's generations: not for a shard
        held elsewhere until its mirror first loads (a generation missing then is
        not known to be dropped)."""
        return self._remote is None or not self._remote.is_remote(shard_id) \
            or self._remote.loaded(shard_id)

    def streams_learned(self, shard_id: int, generation_id: int, edges: Iterable[Edge]) -> None:
        """A mirror of another site's shard learned edges: its streams become known."""
        self._note_streams(shard_id, generation_id, edges)

    def forget_cached_streams(self) -> None:
        """Where a shard is read from changed: the per-filter stream cache is rebuilt
        from the generations as they are now."""
        self._stream_cache.clear()
        self._stream_cache_size = 0

    # -- reading ------------------------------------------------------------------

    def _note_streams(self, shard_id: int, generation_id: int, edges: Iterable[Edge]) -> None:
        for edge in edges:
            if edge.label == END:
                self._stream_version += 1
                self._stream_log.append(
                    (self._stream_version, Stream(shard_id, generation_id, edge.child)))

    @property
    def stream_version(self) -> int:
        """Grows whenever this site learns a stream (see `get_streams_since`)."""
        return self._stream_version

    def get_streams_since(self, topic_filter: str, version: int) -> tuple[int, StreamList]:
        """The streams learned after `version` that the filter reads, in rank order,
        and the version to ask with next time. Costs the new streams, not all."""
        levels = validate_filter(topic_filter)
        found: StreamList = []
        for _version, stream in self._stream_log[bisect_right(self._stream_log, version,
                                                              key=lambda entry: entry[0]):]:
            generation = self._generations_of(stream.shard).get(stream.generation)
            if generation is not None \
                    and generation.trie.match_static(levels, stream.static) is not None:
                found.append((stream.rank, stream))
        found.sort(key=lambda pair: (pair[0], pair[1].static))
        return self._stream_version, found

    def get_streams(self, topic_filter: str, start_time: int = 0) -> StreamList:
        """The streams that may hold messages matching the filter at or after
        `start_time` (µs), in rank order. Cached per filter and brought up to date
        with the streams learned since, so a wide filter over many streams does not
        walk the whole trie again."""
        cached = self._stream_cache.pop(topic_filter, None)
        if cached is None:  # one walk of each trie is cheaper than path by path
            levels = validate_filter(topic_filter)
            by_generation: dict[tuple[int, int], list[Stream]] = defaultdict(list)
            for shard in self.shards:
                for generation_id, walked in self._generations_of(shard.shard_id).items():
                    statics = sorted(match.static for match in walked.trie.match(levels))
                    by_generation[(shard.shard_id, generation_id)] = [
                        Stream(shard.shard_id, generation_id, static) for static in statics]
            new: StreamList = []
            version = self._stream_version
        else:
            cached_version, by_generation = cached
            self._stream_cache_size -= sum(len(v) for v in by_generation.values())
            version, new = self.get_streams_since(topic_filter, cached_version)
        for rank, stream in new:
            streams = by_generation[(rank.x, rank.y)]
            streams.append(stream)
            if len(streams) > 1 and streams[-2].static > stream.static:
                streams.sort(key=lambda s: s.static)
        self._cache_streams(topic_filter, version, by_generation)
        found: StreamList = []
        for (shard_id, generation_id), streams in sorted(by_generation.items()):
            generation = self._generations_of(shard_id).get(generation_id)
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

    def _forget_generation_streams(self, shard_id: int, generation_id: int) -> None:
        self._stream_log = [entry for entry in self._stream_log
                            if (entry[1].shard, entry[1].generation) != (shard_id, generation_id)]
        for _version, by_generation in self._stream_cache.values():
            self._stream_cache_size -= len(by_generation.pop((shard_id, generation_id), []))

    def make_iterator(self, stream: Stream, topic_filter: str, start_time: int = 0) -> Iterator:
        self._shard(stream)
        generation = self._generations_of(stream.shard).get(stream.generation)
        if generation is None:
            raise InvalidIteratorError(
                f"shard {stream.shard} has no generation {stream.generation} (dropped?)")
        return Iterator.start(generation.trie, stream, topic_filter, start_time)

    def _shard(self, stream: Stream) -> Shard:
        if not 0 <= stream.shard < len(self.shards):
            raise InvalidIteratorError(
                f"database {self.name!r} has no shard {stream.shard}")
        return self.shards[stream.shard]

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        """Up to `batch_size` messages after the iterator's position, and the iterator
        moved past them; END_OF_STREAM once a closed generation is read out."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self._shard(iterator.stream)
        if self._remote is not None and self._remote.is_remote(iterator.stream.shard):
            return await self._remote.next(iterator, batch_size)
        return await self.next_local(iterator, batch_size)

    async def next_local(self, iterator: Iterator,
                         batch_size: int) -> NextResult | EndOfStream:
        """`next` on this site's copy of the shard, wherever the shard is held. A
        generation newer than any here reads as empty (this copy is behind), one older
        than the newest and gone as its end (dropped)."""
        started = time.perf_counter()
        stream = iterator.stream
        shard = self._shard(stream)
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
                        self._executor, shard.read, stream.generation, stream.static,
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
        """The message of a stream at a timestamp; None when it (or its generation)
        is not there. A replica here that has not applied that far yet (a session
        handed the message out at a site whose copy is ahead) reads it elsewhere:
        its absence here would look like a drop by retention."""
        shard = self._shard(stream)
        if self._remote is not None and (self._remote.is_remote(stream.shard)
                                         or shard.last_timestamp < timestamp):
            return await self._remote.read_message(stream, timestamp)
        return await self.read_message_local(stream, timestamp)

    async def read_message_local(self, stream: Stream, timestamp: int) -> Message | None:
        """`read_message` on this site's copy of the shard."""
        shard = self._shard(stream)
        generation = shard.generations.get(stream.generation)
        if generation is None:
            return None
        read_key = (stream.shard, stream.generation)
        self._reads_in_flight[read_key] += 1
        try:
            raw = await asyncio.get_running_loop().run_in_executor(
                self._executor, generation.layout.read_one, generation.data, stream.static,
                timestamp)
        finally:
            self._reads_in_flight[read_key] -= 1
            async with self._read_finished:
                self._read_finished.notify_all()
        return None if raw is None else decode_message(raw)

    # -- generations --------------------------------------------------------------

    async def add_generation(self) -> None:
        """Start a new generation in every shard; the old ones stop taking writes.
        On a replicated site: in every shard this site leads, through its log."""
        if self._replication is not None:
            for shard in self.shards:
                await self._replication.add_generation(shard.shard_id)
            return
        loop = asyncio.get_running_loop()
        for shard, lock in zip(self.shards, self._locks, strict=True):
            async with lock:
                info = await loop.run_in_executor(self._executor, shard.add_generation)
                # the new generation starts with the wildcard streams it inherited
                self._note_streams(shard.shard_id, info.id,
                                   shard.generations[info.id].trie.edges())
        self._update_generation_gauges()

    async def set_topic_seed(self, patterns: list[str]) -> None:
        """Seed the learned topic structure of every shard's next generation with
        stream patterns (`fleet/north/+/temp`: literal and `+` levels, no `#`), as
        `stratamq spark learn-topics` makes them. The current generations keep theirs."""
        for pattern in patterns:
            levels = validate_filter(pattern)
            if "#" in levels:
                raise InvalidTopicFilterError(f"seed pattern {pattern!r}: a stream pattern "
                                              "has literal and + levels only, no #")
        if self._replication is not None:  # every replica, through each shard's log
            for shard in self.shards:
                await self._replication.set_topic_seed(shard.shard_id, tuple(patterns))
            return
        loop = asyncio.get_running_loop()
        for shard, lock in zip(self.shards, self._locks, strict=True):
            async with lock:
                await loop.run_in_executor(self._executor, shard.set_topic_seed, patterns)

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]]) -> None:
        """Delete data entries of a closed generation and put records (generation GC,
        `Shard.gc_write`); on a replicated site on every replica, through the shard's
        log (at its leader, wherever that is)."""
        if self._replication is not None:
            await self._replication.gc_write(shard_id, generation_id, deletes, record_puts)
            return
        async with self._locks[shard_id]:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self.shards[shard_id].gc_write, generation_id, deletes,
                record_puts)

    def holds(self, shard_id: int) -> bool:
        """Whether this site holds the shard's data (always, but on a replicated site
        whose `messages` shard is held only by other sites)."""
        return not self._is_remote(shard_id)

    def list_generations(self) -> dict[tuple[int, int], GenerationInfo]:
        return {(shard.shard_id, generation_id): generation.info
                for shard in self.shards
                for generation_id, generation in sorted(
                    self._generations_of(shard.shard_id).items())}

    async def drop_generation(self, shard_id: int, generation_id: int) -> None:
        """Delete a closed generation of one shard, once reads in flight are done."""
        if not 0 <= shard_id < len(self.shards):
            raise InvalidIteratorError(f"database {self.name!r} has no shard {shard_id}")
        if self._replication is not None:
            await self._replication.drop_generation_at_leader(shard_id, generation_id)
            return
        shard = self.shards[shard_id]
        about_to_go = shard.generations.get(generation_id)
        if about_to_go is not None and not about_to_go.info.is_current:
            await self._tell_pre_drop_listeners(shard_id, generation_id)
        async with self._locks[shard_id]:
            generation = shard.detach_generation(generation_id)
            async with self._read_finished:
                await self._read_finished.wait_for(
                    lambda: not self._reads_in_flight[(shard_id, generation_id)])
            await asyncio.get_running_loop().run_in_executor(
                self._executor, shard.destroy_generation, generation)
        self._after_drop(shard_id, generation_id)

    def _after_drop(self, shard_id: int, generation_id: int) -> None:
        self._forget_generation_streams(shard_id, generation_id)
        self._update_generation_gauges()
        for listener in self._drop_listeners:
            try:
                listener(shard_id, generation_id)
            except Exception:  # a listener's bug must not stop retention
                log.exception("generation drop listener failed on %s/%d/%d", self.name,
                              shard_id, generation_id)

    async def before_remote_drop(self, shard_id: int, generation_id: int) -> None:
        """The leader of a shard this site holds no replica of is about to drop a
        generation of it (it asked over the peer port): the pre-drop listeners run as
        on a replica, reading the generation at a replica while it is still there."""
        if self._is_remote(shard_id) \
                and generation_id in self._generations_of(shard_id):
            await self._tell_pre_drop_listeners(shard_id, generation_id)

    def remote_generation_dropped(self, shard_id: int, generation_id: int) -> None:
        """A mirror of a shard held elsewhere found a generation gone (dropped by
        retention at its replicas): its streams and every reader's trace of it go, as
        after a drop here."""
        self._after_drop(shard_id, generation_id)

    async def _tell_pre_drop_listeners(self, shard_id: int, generation_id: int) -> None:
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

    def remove_generation_drop_listener(self, listener: DropListener) -> None:
        self._drop_listeners.remove(listener)

    async def apply_retention(self, now: int | None = None) -> tuple[bool, int]:
        """One pass of the retention rule; returns (generation added, generations
        dropped)."""
        if self.options.key_value:  # records are never dropped by retention
            return False, 0
        at = now_us() if now is None else now
        retention_us = int(self.options.message_retention_period * 1_000_000)
        longest = self.options.longest_retention_period
        drop_after_us = None if longest is None else int(longest * 1_000_000)
        period = self.options.generation_period
        period_us = None if period is None else int(period * 1_000_000)
        plans = [plan_retention([g.info for g in shard.generations.values()], at, retention_us,
                                drop_after_us, period_us)
                 for shard in self.shards]
        if self._replication is not None:
            return await self._replicated_retention(plans)
        added = any(plan.add_generation for plan in plans)
        if added:
            await self.add_generation()
        dropped = 0
        for shard, plan in zip(self.shards, plans, strict=True):
            for generation_id in plan.drop:
                await self.drop_generation(shard.shard_id, generation_id)
                dropped += 1
        return added, dropped

    async def _replicated_retention(self, plans: list[RetentionPlan]) -> tuple[bool, int]:
        """Retention on a replicated site: each shard's leader changes its
        generations through the shard's log; the other replicas follow it there."""
        assert self._replication is not None
        added = False
        dropped = 0
        for shard, plan in zip(self.shards, plans, strict=True):
            if plan.add_generation:
                added |= await self._replication.add_generation(shard.shard_id)
            for generation_id in plan.drop:
                dropped += await self._replication.drop_generation(shard.shard_id,
                                                                   generation_id)
        return added, dropped

    def _update_generation_gauges(self) -> None:
        for shard in self.shards:
            metrics.GENERATIONS.labels(self.name, str(shard.shard_id)).set(len(shard.generations))

    def disk_usage(self) -> int:
        return sum(shard.disk_usage() for shard in self.shards)

    async def close(self) -> None:
        """Write what the buffers hold, then close every shard."""
        await asyncio.gather(*(buffer.close() for buffer in self._buffers))
        if self._replication is not None:
            await self._replication.close()
        loop = asyncio.get_running_loop()
        for shard in self.shards:
            await loop.run_in_executor(self._executor, shard.close)
