"""One database (`messages`, `sessions`, `retained`) on this site: the facade of
the storage API over this site's copy of it (`shard_set.ShardSet`): validation, the
write buffers of its shards, iterators, and where each read and change goes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from typing import Protocol

from ..errors import (
    ForwardRefusedError,
    GenerationError,
    InvalidIteratorError,
    InvalidMessageError,
    InvalidTopicFilterError,
    PayloadTooLargeError,
)
from ..topic import check_topic, validate_filter
from . import metrics
from .buffer import WriteBuffer
from .cooked import CookedBatch
from .feed import CommitListener, FeedGapListener
from .fence import Fence
from .generation import GenerationInfo, RetentionPlan, plan_retention
from .iterator import EndOfStream, Iterator, Stream
from .lts import Edge
from .message import Message
from .options import DbOptions
from .shard import Shard, now_us
from .shard_set import DropListener, NextResult, PreDropListener, ShardSet, shard_of
from .streams import GenerationView, StreamList

log = logging.getLogger(__name__)


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



class Database:
    def __init__(self, shard_set: ShardSet) -> None:
        self.shard_set = shard_set
        self.name = shard_set.name
        self.site_id = shard_set.site_id
        self.path = shard_set.path
        self.options = shard_set.options
        self.executor = shard_set.executor
        self.feed = shard_set.feed
        self._store_batch_time = metrics.STORE_BATCH_TIME.labels(self.name)
        options = self.options
        self._buffers = [
            WriteBuffer(shard, self.name, max_items=options.max_items,
                        max_bytes=options.max_bytes, flush_interval=options.flush_interval,
                        executor=self.executor, lock=shard_set.shard_lock(shard.shard_id),
                        on_commit=self.feed.committed)
            for shard in shard_set.shards]
        self._replication: Replication | None = None
        self._remote: RemoteShards | None = None

    @property
    def shards(self) -> list[Shard]:
        return self.shard_set.shards

    @classmethod
    async def open(cls, name: str, data_dir: Path, options: DbOptions,
                   executor: Executor, site_id: str = "") -> Database:
        return cls(await ShardSet.open(name, data_dir, options, executor, site_id))

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
        return self.shard_set.shard_lock(shard_id)

    def has_room(self, shard_id: int) -> bool:
        """Whether shard `shard_id`'s write buffer is under its byte bound."""
        return self._buffers[shard_id].has_room()

    async def wait_for_room(self, client_id: str) -> None:
        """Return once the write buffer of `client_id`'s shard is under its byte bound:
        a connection awaits this before reading more from a publisher's socket."""
        await self._buffers[shard_of(client_id, self.options.n_shards)].wait_for_room()

    async def scan_records(self, records_of: str, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The records of client `records_of` whose key starts with `prefix`."""
        return await self.shard_set.scan_records(
            shard_of(records_of, self.options.n_shards), prefix)

    async def scan_shard_records(self, shard_id: int, prefix: bytes, limit: int,
                                 after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """Up to `limit` records of one shard whose key starts with `prefix` and comes
        after `after` (None: from the first)."""
        return await self.shard_set.scan_records(shard_id, prefix, limit, after)

    async def get_shard_records(self, shard_id: int, keys: list[bytes]) -> list[bytes | None]:
        """Several records of one shard in one read, None where there is none."""
        return await self.shard_set.get_records(shard_id, keys)

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
            return await self.shard_set.get_record(shard_id, key)
        # a key sorts first among the keys it is a prefix of
        found = await self._replication.read_records(shard_id, key, 1)
        return found[0][1] if found and found[0][0] == key else None

    @property
    def replicated(self) -> bool:
        return self._replication is not None

    async def get_record(self, records_of: str, key: bytes) -> bytes | None:
        """One record of `records_of`'s shard, None when there is none."""
        return await self.shard_set.get_record(shard_of(records_of, self.options.n_shards),
                                               key)

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
        """See `CommitFeed.add_commit_listener`."""
        self.feed.add_commit_listener(listener, of_applied=of_applied)

    def remove_commit_listener(self, listener: CommitListener) -> None:
        self.feed.remove_commit_listener(listener)

    def feed_remote(self, shard_id: int, generation_id: int,
                    messages: list[tuple[bytes, Message]]) -> None:
        """Committed messages of a shard this site holds no replica of, pushed by its
        leader: fed to the commit listeners like a batch applied here (each message
        once per site, whichever way it came first). A push of a shard this site reads
        here (its placement here is newer or older than the leader's) is not fed: the
        site's applied batches feed it, or, once it reads the shard elsewhere, storage
        after the feed gap that switch declares."""
        if self._is_remote(shard_id):
            self.feed.pushed(shard_id, generation_id, messages)

    def add_feed_gap_listener(self, listener: FeedGapListener) -> None:
        """See `CommitFeed.add_feed_gap_listener`."""
        self.feed.add_feed_gap_listener(listener)

    def feed_gap(self, shard_id: int) -> None:
        self.feed.feed_gap(shard_id)

    def fed_through(self) -> list[int]:
        """Per shard, the last timestamp fed to the commit listeners here."""
        return self.feed.fed_through()

    # -- replication --------------------------------------------------------------

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        """The shard's replica set and leader: this site alone without replication."""
        if self._replication is None:
            return (self.site_id,), self.site_id
        return self._replication.placement_of(shard_id)

    async def replace_shard(self, shard_id: int) -> None:
        """`ShardSet.replace_shard`, its write buffer writing to the new shard."""
        await self.shard_set.replace_shard(shard_id)
        self._buffers[shard_id].replace_shard(self.shards[shard_id])

    def attach_replication(self, replication: Replication) -> None:
        """From now on, writes and generation changes go through `replication`."""
        self._replication = replication
        for shard, buffer in zip(self.shards, self._buffers, strict=True):
            shard.replicated = True
            buffer.replicate = partial(replication.write, shard.shard_id)

    async def apply_batch(self, shard_id: int, cooked: CookedBatch, offset: int) -> None:
        """Write and apply a committed batch of a shard's log, recording `offset` as
        applied in the same write, then feed it to the commit listeners."""
        await self.shard_set.write_applied(shard_id, cooked, offset)
        try:
            self.feed.committed(cooked, read_elsewhere=self._is_remote(shard_id))
        except Exception:  # a listener's bug must not stop applying
            log.exception("commit listener failed on %s/%d", self.name, shard_id)

    async def apply_add_generation(self, shard_id: int, at: int, seed: tuple[str, ...],
                                   offset: int) -> None:
        await self.shard_set.add_generation(shard_id, at, seed, applied=offset)

    async def apply_drop_generation(self, shard_id: int, generation_id: int,
                                    offset: int) -> None:
        """Drop a generation as a log entry says. One that is not there, or current,
        is refused the same way on every replica: the entry is then only recorded."""
        try:
            await self.shard_set.drop_generation(shard_id, generation_id, applied=offset)
        except GenerationError as exc:
            log.warning("%s/%d: log entry %d drops no generation: %s", self.name,
                        shard_id, offset, exc)
            await self.shard_set.record_applied(shard_id, offset)

    async def apply_gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                             record_puts: list[tuple[bytes, bytes]], offset: int) -> None:
        """Delete expired messages of a closed generation as a log entry says. Deletes in
        a generation that is gone, or current, are refused the same way on every
        replica: only the entry's records are put."""
        shard = self.shards[shard_id]
        async with self.shard_set.shard_lock(shard_id):
            generation = shard.generations.get(generation_id)
            if deletes and (generation is None or generation.info.is_current):
                log.warning("%s/%d: log entry %d deletes nothing: generation %d is gone or "
                            "current", self.name, shard_id, offset, generation_id)
                deletes = []
            await self.shard_set.run(shard.gc_write, generation_id, deletes, record_puts,
                                     applied=offset)

    async def apply_topic_seed(self, shard_id: int, patterns: tuple[str, ...],
                               offset: int) -> None:
        await self.shard_set.set_topic_seed(shard_id, patterns, applied=offset)

    async def apply_noop(self, shard_id: int, offset: int) -> None:
        await self.shard_set.record_applied(shard_id, offset)

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
        self.shard_set.streams.note(shard_id, generation_id, edges)

    def forget_cached_streams(self) -> None:
        """Where a shard is read from changed: the per-filter stream cache is rebuilt
        from the generations as they are now."""
        self.shard_set.streams.forget_cached()

    # -- reading ------------------------------------------------------------------

    @property
    def stream_version(self) -> int:
        """Grows whenever this site learns a stream (see `get_streams_since`)."""
        return self.shard_set.streams.version

    def get_streams_since(self, topic_filter: str, version: int) -> tuple[int, StreamList]:
        """The streams learned after `version` that the filter reads, in rank order,
        and the version to ask with next time. Costs the new streams, not all."""
        return self.shard_set.streams.streams_since(topic_filter, version,
                                                    self._generations_of)

    def get_streams(self, topic_filter: str, start_time: int = 0) -> StreamList:
        """The streams that may hold messages matching the filter at or after
        `start_time` (µs), in rank order (see `StreamIndex.streams`)."""
        return self.shard_set.streams.streams(topic_filter, start_time,
                                              range(len(self.shards)), self._generations_of)

    def make_iterator(self, stream: Stream, topic_filter: str, start_time: int = 0) -> Iterator:
        self.shard_set.shard(stream.shard)
        generation = self._generations_of(stream.shard).get(stream.generation)
        if generation is None:
            raise InvalidIteratorError(
                f"shard {stream.shard} has no generation {stream.generation} (dropped?)")
        return Iterator.start(generation.trie, stream, topic_filter, start_time)

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        """Up to `batch_size` messages after the iterator's position, and the iterator
        moved past them; END_OF_STREAM once a closed generation is read out."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.shard_set.shard(iterator.stream.shard)
        if self._remote is not None and self._remote.is_remote(iterator.stream.shard):
            return await self._remote.next(iterator, batch_size)
        return await self.shard_set.next(iterator, batch_size)

    async def next_local(self, iterator: Iterator,
                         batch_size: int) -> NextResult | EndOfStream:
        """`next` on this site's copy of the shard (`ShardSet.next`)."""
        return await self.shard_set.next(iterator, batch_size)

    def reading(self, shard_id: int, generation_id: int
                ) -> contextlib.AbstractAsyncContextManager[None]:
        """See `ShardSet.reading`."""
        return self.shard_set.reading(shard_id, generation_id)

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        """The message of a stream at a timestamp; None when it (or its generation)
        is not there. A replica here that has not applied that far yet (a session
        handed the message out at a site whose copy is ahead) reads it elsewhere:
        its absence here would look like a drop by retention."""
        shard = self.shard_set.shard(stream.shard)
        if self._remote is not None and (self._remote.is_remote(stream.shard)
                                         or shard.last_timestamp < timestamp):
            return await self._remote.read_message(stream, timestamp)
        return await self.shard_set.read_message(stream, timestamp)

    async def read_message_local(self, stream: Stream, timestamp: int) -> Message | None:
        """`read_message` on this site's copy of the shard."""
        return await self.shard_set.read_message(stream, timestamp)

    # -- generations --------------------------------------------------------------

    async def add_generation(self) -> None:
        """Start a new generation in every shard; the old ones stop taking writes.
        On a replicated site: in every shard this site leads, through its log."""
        for shard in self.shards:
            if self._replication is not None:
                await self._replication.add_generation(shard.shard_id)
            else:
                await self.shard_set.add_generation(shard.shard_id)

    async def set_topic_seed(self, patterns: list[str]) -> None:
        """Seed the learned topic structure of every shard's next generation with
        stream patterns (`fleet/north/+/temp`: literal and `+` levels, no `#`), as
        `stratamq spark learn-topics` makes them. The current generations keep theirs."""
        for pattern in patterns:
            levels = validate_filter(pattern)
            if "#" in levels:
                raise InvalidTopicFilterError(f"seed pattern {pattern!r}: a stream pattern "
                                              "has literal and + levels only, no #")
        for shard in self.shards:
            if self._replication is not None:  # every replica, through each shard's log
                await self._replication.set_topic_seed(shard.shard_id, tuple(patterns))
            else:
                await self.shard_set.set_topic_seed(shard.shard_id, patterns)

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]]) -> None:
        """Delete data entries of a closed generation and put records (generation GC,
        `Shard.gc_write`); on a replicated site on every replica, through the shard's
        log (at its leader, wherever that is)."""
        if self._replication is not None:
            await self._replication.gc_write(shard_id, generation_id, deletes, record_puts)
            return
        async with self.shard_set.shard_lock(shard_id):
            await self.shard_set.run(self.shards[shard_id].gc_write, generation_id, deletes,
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
        self.shard_set.shard(shard_id)
        if self._replication is not None:
            await self._replication.drop_generation_at_leader(shard_id, generation_id)
            return
        await self.shard_set.drop_generation(shard_id, generation_id)

    async def before_remote_drop(self, shard_id: int, generation_id: int) -> None:
        """The leader of a shard this site holds no replica of is about to drop a
        generation of it (it asked over the peer port): the pre-drop listeners run as
        on a replica, reading the generation at a replica while it is still there."""
        if self._is_remote(shard_id) \
                and generation_id in self._generations_of(shard_id):
            await self.shard_set.tell_pre_drop_listeners(shard_id, generation_id)

    def remote_generation_dropped(self, shard_id: int, generation_id: int) -> None:
        """A mirror of a shard held elsewhere found a generation gone (dropped by
        retention at its replicas): its streams and every reader's trace of it go, as
        after a drop here."""
        self.shard_set.after_drop(shard_id, generation_id)

    def add_generation_pre_drop_listener(self, listener: PreDropListener) -> None:
        """See `ShardSet.add_generation_pre_drop_listener`."""
        self.shard_set.add_generation_pre_drop_listener(listener)

    def add_generation_drop_listener(self, listener: DropListener) -> None:
        """See `ShardSet.add_generation_drop_listener`."""
        self.shard_set.add_generation_drop_listener(listener)

    def remove_generation_drop_listener(self, listener: DropListener) -> None:
        self.shard_set.remove_generation_drop_listener(listener)

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
        plans = [plan_retention(infos, at, retention_us, drop_after_us, period_us)
                 for infos in self.shard_set.local_generations()]
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

    def disk_usage(self) -> int:
        return self.shard_set.disk_usage()

    async def close(self) -> None:
        """Write what the buffers hold, then close every shard."""
        await asyncio.gather(*(buffer.close() for buffer in self._buffers))
        if self._replication is not None:
            await self._replication.close()
        await self.shard_set.close()
