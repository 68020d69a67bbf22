"""One database (`messages`, `sessions`, `retained`) on this site: the facade of the
storage API, built last, over this site's copy of it (`shard_set.ShardSet`) and its
backend (`backend.py`): validation, the routing of writes to the shards' write
buffers, streams and iterators, reads of an explicit consistency, generations and
retention, the commit feed's listeners, and the admin's operations (describe, digest,
checkpoint, GC plan). No `Shard` or `ShardSet` leaves it: callers name shards by
number."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..errors import (
    InvalidIteratorError,
    InvalidMessageError,
    InvalidTopicFilterError,
    PayloadTooLargeError,
)
from ..topic import check_topic, validate_filter
from . import metrics
from .backend import Backend, Consistency
from .checkpoint import create_checkpoint
from .describe import DbDescription, describe
from .digest import ShardDigest, digest_shard
from .feed import CommitListener, FeedGapListener, Interest
from .fence import Fence
from .gc import apply_gc_plan
from .generation import GenerationInfo, plan_retention
from .iterator import EndOfStream, Iterator, Stream
from .message import Message
from .shard import now_us
from .shard_set import DropListener, NextResult, PreDropListener, ShardSet, shard_of
from .streams import StreamList

log = logging.getLogger(__name__)


class Database:
    """The facade. It is past ~300 lines because it is the one door to a database:
    each operation is a few lines that hand the work to the module doing it, and a
    second door would have callers reach past it to the shards again."""

    def __init__(self, shard_set: ShardSet, backend: Backend) -> None:
        self._shard_set = shard_set
        self._backend = backend
        self.name = shard_set.name
        self.site_id = shard_set.site_id
        self.options = shard_set.options
        self._feed = shard_set.feed
        self._buffers = backend.buffers
        self._store_batch_time = metrics.STORE_BATCH_TIME.labels(self.name)
        self._closed = False

    @property
    def shard_count(self) -> int:
        """How many shards the database has: they are numbered from 0."""
        return len(self._shard_set.shards)

    @property
    def replicated(self) -> bool:
        """Whether other sites write this database too (`Backend.replicated`)."""
        return self._backend.replicated

    def shard_of(self, routing_key: str) -> int:
        """The shard of a client id (a routing key of a key-value database)."""
        return shard_of(routing_key, self.options.n_shards)

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

    def has_room(self, shard_id: int) -> bool:
        """Whether shard `shard_id`'s write buffer is under its byte bound."""
        return self._buffers[shard_id].has_room()

    async def wait_for_room(self, client_id: str) -> None:
        """Return once the write buffer of `client_id`'s shard is under its byte bound:
        a connection awaits this before reading more from a publisher's socket."""
        await self._buffers[shard_of(client_id, self.options.n_shards)].wait_for_room()

    async def store_batch(self, messages: list[Message], sync: bool = True) -> None:
        """Store messages. With `sync`, return once they are durable (in RocksDB's
        write-ahead log, fsynced when `sync_writes`)."""
        started = time.perf_counter()
        waits = self.submit(messages, sync)
        if sync:
            await asyncio.gather(*waits)
            self._store_batch_time.observe(time.perf_counter() - started)

    # -- records --------------------------------------------------------------------

    async def read_records(self, shard_id: int, prefix: bytes, consistency: Consistency,
                           limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """Up to `limit` (None: a scan's own bound) records of one shard whose key
        starts with `prefix` and comes after `after` (None: from the first), as
        `consistency` sees them."""
        if consistency is Consistency.LOCAL:
            return await self._shard_set.scan_records(shard_id, prefix, limit, after)
        return await self._backend.read_records(shard_id, prefix, limit, after)

    async def get_records(self, shard_id: int, keys: list[bytes],
                          consistency: Consistency) -> list[bytes | None]:
        """Several records of one shard, None where there is none, as `consistency`
        sees them."""
        if consistency is Consistency.LOCAL:
            return await self._shard_set.get_records(shard_id, keys)
        return await self._backend.get_records(shard_id, keys)

    async def get_record(self, shard_id: int, key: bytes,
                         consistency: Consistency) -> bytes | None:
        """One record of a shard, None when there is none (see `get_records`)."""
        (value,) = await self.get_records(shard_id, [key], consistency)
        return value

    # -- the commit feed ----------------------------------------------------------

    def add_commit_listener(self, listener: CommitListener, *, of_applied: bool = False,
                            wants: Interest | None = None) -> None:
        """See `CommitFeed.add_commit_listener`."""
        self._feed.add_commit_listener(listener, of_applied=of_applied, wants=wants)

    def add_feed_gap_listener(self, listener: FeedGapListener) -> None:
        """See `CommitFeed.add_feed_gap_listener`."""
        self._feed.add_feed_gap_listener(listener)

    def fed_through(self) -> list[int]:
        """Per shard, the last timestamp fed to the commit listeners here."""
        return self._feed.fed_through()

    def feed_gap(self, shard_id: int) -> None:
        """Tell the feed gap listeners that this site may have missed committed
        messages of the shard (the relay: a leader changed, a push was dropped)."""
        self._feed.feed_gap(shard_id)

    # -- streams and iterators ----------------------------------------------------

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        """The shard's replica set and leader: this site alone without replication."""
        return self._backend.placement_of(shard_id)

    def holds(self, shard_id: int) -> bool:
        """Whether this site holds the shard's data (always, but on a replicated site
        whose `messages` shard is held only by other sites)."""
        return not self._backend.reads_elsewhere(shard_id)

    def generations_known(self, shard_id: int) -> bool:
        """Whether `list_generations` knows the shard's generations: not for a shard
        held elsewhere until its mirror first loads (a generation missing then is
        not known to be dropped)."""
        return self._backend.generations_known(shard_id)

    @property
    def stream_version(self) -> int:
        """Grows whenever this site learns a stream (see `get_streams_since`)."""
        return self._shard_set.streams.version

    def get_streams_since(self, topic_filter: str, version: int) -> tuple[int, StreamList]:
        """The streams learned after `version` that the filter reads, in rank order,
        and the version to ask with next time. Costs the new streams, not all."""
        return self._shard_set.streams.streams_since(topic_filter, version,
                                                     self._backend.generations_of)

    def get_streams(self, topic_filter: str, start_time: int = 0) -> StreamList:
        """The streams that may hold messages matching the filter at or after
        `start_time` (µs), in rank order (see `StreamIndex.streams`)."""
        return self._shard_set.streams.streams(topic_filter, start_time,
                                               range(self.shard_count),
                                               self._backend.generations_of)

    def make_iterator(self, stream: Stream, topic_filter: str, start_time: int = 0) -> Iterator:
        self._shard_set.shard(stream.shard)
        generation = self._backend.generations_of(stream.shard).get(stream.generation)
        if generation is None:
            raise InvalidIteratorError(
                f"shard {stream.shard} has no generation {stream.generation} (dropped?)")
        return Iterator.start(generation.trie, stream, topic_filter, start_time)

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        """Up to `batch_size` messages after the iterator's position, and the iterator
        moved past them; END_OF_STREAM once a closed generation is read out."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self._shard_set.shard(iterator.stream.shard)
        return await self._backend.next(iterator, batch_size)

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        """The message of a stream at a timestamp; None when it (or its generation)
        is not there."""
        self._shard_set.shard(stream.shard)
        return await self._backend.read_message(stream, timestamp)

    def reading(self, shard_id: int, generation_id: int
                ) -> contextlib.AbstractAsyncContextManager[None]:
        """See `ShardSet.reading`."""
        return self._shard_set.reading(shard_id, generation_id)

    # -- generations --------------------------------------------------------------

    def list_generations(self) -> dict[tuple[int, int], GenerationInfo]:
        return {(shard_id, generation_id): generation.info
                for shard_id in range(self.shard_count)
                for generation_id, generation in sorted(
                    self._backend.generations_of(shard_id).items())}

    async def add_generation(self) -> None:
        """Start a new generation in every shard; the old ones stop taking writes.
        On a replicated site: in every shard this site leads, through its log."""
        for shard_id in range(self.shard_count):
            await self._backend.add_generation(shard_id)

    async def set_topic_seed(self, patterns: list[str]) -> None:
        """Seed the learned topic structure of every shard's next generation with
        stream patterns (`fleet/north/+/temp`: literal and `+` levels, no `#`), as
        `stratamq spark learn-topics` makes them. The current generations keep theirs.
        On a replicated site: every replica, through each shard's log."""
        for pattern in patterns:
            levels = validate_filter(pattern)
            if "#" in levels:
                raise InvalidTopicFilterError(f"seed pattern {pattern!r}: a stream pattern "
                                              "has literal and + levels only, no #")
        for shard_id in range(self.shard_count):
            await self._backend.set_topic_seed(shard_id, tuple(patterns))

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]]) -> None:
        """Delete data entries of a closed generation and put records (generation GC,
        `Shard.gc_write`); on a replicated site on every replica, through the shard's
        log (at its leader, wherever that is)."""
        await self._backend.gc_write(shard_id, generation_id, deletes, record_puts)

    async def drop_generation(self, shard_id: int, generation_id: int) -> None:
        """Delete a closed generation of one shard, once reads in flight are done."""
        self._shard_set.shard(shard_id)
        await self._backend.drop_generation(shard_id, generation_id)

    def add_generation_pre_drop_listener(self, listener: PreDropListener) -> None:
        """See `ShardSet.add_generation_pre_drop_listener`."""
        self._shard_set.add_generation_pre_drop_listener(listener)

    def add_generation_drop_listener(self, listener: DropListener) -> None:
        """See `ShardSet.add_generation_drop_listener`."""
        self._shard_set.add_generation_drop_listener(listener)

    async def apply_retention(self, now: int | None = None) -> tuple[bool, int]:
        """One pass of the retention rule; returns (generation added, generations
        dropped). On a replicated site each shard's leader changes its generations
        through the shard's log; the other replicas follow it there."""
        if self.options.key_value:  # records are never dropped by retention
            return False, 0
        at = now_us() if now is None else now
        retention_us = int(self.options.message_retention_period * 1_000_000)
        longest = self.options.longest_retention_period
        drop_after_us = None if longest is None else int(longest * 1_000_000)
        period = self.options.generation_period
        period_us = None if period is None else int(period * 1_000_000)
        plans = [plan_retention(infos, at, retention_us, drop_after_us, period_us)
                 for infos in self._shard_set.local_generations()]
        return await self._backend.retain(plans)

    # -- the admin's operations ------------------------------------------------------

    async def describe(self) -> DbDescription:
        """The database as this site holds it (`describe.describe`)."""
        return await describe(self._shard_set, self.placement_of)

    def applied_offset(self, shard_id: int) -> int:
        """The shard log offset this site's copy of the shard has applied (0 without
        replication)."""
        return self._shard_set.shards[shard_id].applied_offset

    async def digest(self, shard_id: int, work_dir: Path) -> ShardDigest:
        """The digest of one shard as applied now (`digest.digest_shard`)."""
        return await digest_shard(self._shard_set, shard_id, work_dir)

    async def checkpoint(self, target: str | Path,
                         shards: Collection[int] | None = None) -> dict[str, Any]:
        """Checkpoint the shards `shards` (None: all) into the new folder `target`;
        returns its manifest (`checkpoint.create_checkpoint`)."""
        return await create_checkpoint(self._shard_set, target, shards)

    async def apply_gc_plan(self, plan: Any) -> dict[str, Any]:
        """Apply a generation GC plan of `stratamq spark gc` (`gc.apply_gc_plan`)."""
        return await apply_gc_plan(self, self._shard_set, plan)

    def disk_bytes(self) -> int:
        """The bytes the database takes on disk here. Blocking (reads file sizes)."""
        return sum(shard.disk_usage() for shard in list(self._shard_set.shards))

    async def close(self) -> None:
        """Write what the buffers hold, stop the backend, then close every shard; a
        second call does nothing (RocksDB refuses a second close)."""
        if self._closed:
            return
        self._closed = True
        await self._backend.close()
        await self._shard_set.close()
