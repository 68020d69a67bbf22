"""Where a database's writes, committed reads and generation changes go: its
backend, built over this site's copy of it (`ShardSet`) before the `Database`
facade, which takes it (as `emqx_ds` takes `emqx_ds_builtin_local` or its
replicated backend). Each backend makes the write buffers of the shards with its own
flush. `LocalBackend` is the site without replication; the replicated one is
`replication.backend.ReplicatedBackend`."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Protocol

from prometheus_client import Counter

from . import metrics
from .buffer import Flush, WriteBuffer
from .fence import Fence, check_fences
from .generation import RetentionPlan
from .iterator import EndOfStream, Iterator, Stream
from .message import Message
from .shard_set import NextResult, ShardSet
from .streams import GenerationView

log = logging.getLogger(__name__)



class Consistency(Enum):
    """What a read of records sees. LOCAL: this site's copy as it is now (on a
    replicated site it may lag the shard's leader, or not be kept at all). COMMITTED:
    every write committed before the call (on a replicated site past a read barrier
    here, or at a replica elsewhere; a recoverable StorageError when that cannot be
    made sure in time, and the reader must then not guess from what it has)."""

    LOCAL = "local"
    COMMITTED = "committed"


def make_buffers(shard_set: ShardSet, flush_of: Callable[[int], Flush],
                 abandon_behind_failure: bool) -> list[WriteBuffer]:
    """The write buffers of a database's shards, each flushing with `flush_of(shard)`."""
    options = shard_set.options
    return [WriteBuffer(shard_set.name, shard_id, max_items=options.max_items,
                        max_bytes=options.max_bytes, flush_interval=options.flush_interval,
                        flush=flush_of(shard_id),
                        abandon_behind_failure=abandon_behind_failure)
            for shard_id in range(len(shard_set.shards))]


class Backend(Protocol):
    """What the `Database` facade asks of its backend, shard by shard."""

    @property
    def replicated(self) -> bool:
        """Whether other sites write this database too (a cache of it kept here would
        not see their writes)."""

    @property
    def buffers(self) -> Sequence[WriteBuffer]:
        """Each shard's write buffer, flushing through this backend."""

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        """The shard's replica set and leader as this site knows them (none and ""
        before the first placement)."""

    def reads_elsewhere(self, shard_id: int) -> bool:
        """Whether this site reads the shard at another site (it holds no replica
        of it, or one still catching up)."""

    def generations_of(self, shard_id: int) -> Mapping[int, GenerationView]:
        """The shard's generations as this site reads them."""

    def generations_known(self, shard_id: int) -> bool:
        """Whether `generations_of` knows them (a shard read elsewhere: once its
        mirror first loads)."""

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        """`Database.next`, wherever the shard is read."""

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        """`Database.read_message`, wherever the shard is read."""

    async def read_records(self, shard_id: int, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """The shard's records under `prefix` (the first `limit` after `after`), every
        write committed before the call included (`Consistency.COMMITTED`)."""

    async def get_records(self, shard_id: int, keys: list[bytes]) -> list[bytes | None]:
        """Several records of a shard as `read_records` sees them."""

    async def add_generation(self, shard_id: int) -> bool:
        """Start a new generation of a shard (on a replicated site: on its leader,
        through its log; False elsewhere)."""

    async def drop_generation(self, shard_id: int, generation_id: int) -> None:
        """Drop a closed generation of a shard (on a replicated site: at its leader,
        wherever that is); returns once applied there."""

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]]) -> None:
        """`Shard.gc_write` on every copy of a shard."""

    async def set_topic_seed(self, shard_id: int, patterns: tuple[str, ...]) -> None:
        """`Shard.set_topic_seed` on every copy of a shard."""

    async def retain(self, plans: list[RetentionPlan]) -> tuple[bool, int]:
        """Carry out one pass of the retention rule's plans, one a shard; returns
        (a generation added, generations dropped)."""

    async def close(self) -> None:
        """Write what the buffers hold and stop: the shards are about to close."""


class LocalBackend:
    """The backend of a site without replication: a flush is written straight to
    the shard, reads read this site's copy, and this site alone places every shard."""

    replicated = False

    def __init__(self, shard_set: ShardSet) -> None:
        self._shards = shard_set
        self._site_id = shard_set.site_id
        self.buffers = make_buffers(shard_set, self._flush_of, abandon_behind_failure=False)

    def _flush_of(self, shard_id: int) -> Flush:
        # the lock and the labelled metric found once, not on every flush
        return functools.partial(
            self._flush, shard_id, self._shards.shard_lock(shard_id),
            metrics.BUFFER_BYTES.labels(self._shards.name, str(shard_id)))

    async def _flush(self, shard_id: int, lock: asyncio.Lock, batch_bytes: Counter,
                     messages: list[Message], record_puts: list[tuple[bytes, bytes]],
                     record_deletes: list[bytes], fences: list[Fence],
                     _forwarded: bool) -> None:
        """Cook one batch, write it in one RocksDB write and apply it, under the
        shard lock (FencedError, nothing written, when a fence does not hold); then
        feed it to the commit listeners."""
        shard = self._shards.shards[shard_id]
        async with lock:
            if fences:  # point reads of the applied state, which this lock keeps current
                record_puts = [*record_puts, *check_fences(fences, shard.get_record)]
            cooked = None
            try:
                cooked = shard.prepare(messages, record_puts, record_deletes)
                if not self._shards.write_inline(shard, cooked):
                    await self._shards.run(shard.write, cooked)
            except Exception:
                if cooked is not None:
                    shard.forget(cooked)
                raise
            shard.apply(cooked)
        batch_bytes.inc(cooked.payload_bytes)
        try:
            self._shards.feed.committed(cooked)
        except Exception:  # a listener's bug must not stop the writer
            log.exception("commit listener failed on shard %s",
                          (self._shards.name, str(shard_id)))

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        return (self._site_id,), self._site_id

    def reads_elsewhere(self, shard_id: int) -> bool:
        return False

    def generations_of(self, shard_id: int) -> Mapping[int, GenerationView]:
        return self._shards.shards[shard_id].generations

    def generations_known(self, shard_id: int) -> bool:
        return True

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        return await self._shards.next(iterator, batch_size)

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        return await self._shards.read_message(stream, timestamp)

    async def read_records(self, shard_id: int, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        return await self._shards.scan_records(shard_id, prefix, limit, after)

    async def get_records(self, shard_id: int, keys: list[bytes]) -> list[bytes | None]:
        return await self._shards.get_records(shard_id, keys)

    async def add_generation(self, shard_id: int) -> bool:
        await self._shards.add_generation(shard_id)
        return True

    async def drop_generation(self, shard_id: int, generation_id: int) -> None:
        await self._shards.drop_generation(shard_id, generation_id)

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]]) -> None:
        await self._shards.gc_write(shard_id, generation_id, deletes, record_puts)

    async def set_topic_seed(self, shard_id: int, patterns: tuple[str, ...]) -> None:
        await self._shards.set_topic_seed(shard_id, patterns)

    async def retain(self, plans: list[RetentionPlan]) -> tuple[bool, int]:
        """A shard due a new generation starts one in every shard."""
        added = any(plan.add_generation for plan in plans)
        if added:
            for shard_id in range(len(plans)):
                await self._shards.add_generation(shard_id)
        dropped = 0
        for shard_id, plan in enumerate(plans):
            for generation_id in plan.drop:
                await self._shards.drop_generation(shard_id, generation_id)
                dropped += 1
        return added, dropped

    async def close(self) -> None:
        await asyncio.gather(*(buffer.close() for buffer in self.buffers))
