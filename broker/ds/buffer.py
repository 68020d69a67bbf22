"""The local write buffer of one shard, with group commit.

Messages wait here until `max_items` or `max_bytes` is reached or the oldest has
waited `flush_interval`; then the shard cooks them into one batch and writes it in
one RocksDB write, off the event loop. `max_bytes` also bounds what a shard queues
for callers that wait for room (`wait_for_room`) before they add. While a write is
in flight new messages gather for the next one, so many concurrent writers share
each write. The messages
of one `store_batch` call always go into the same cooked batch (atomic per shard)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from ..errors import (
    ForwardRefusedError,
    StorageBusyError,
    StorageClosedError,
    WriteAbandonedError,
)
from . import metrics
from .cooked import CookedBatch
from .feed import CommitListener
from .fence import Fence, FencedError, check_fences
from .message import Message
from .shard import Shard

# On a replicated site: commit one flush (messages, record puts, record deletes, the
# fences of its fenced writes, whether it holds writes other sites forwarded) through
# the shard's log; returns once committed and applied, or raises (FencedError: some
# fences refused, nothing appended; ForwardRefusedError: it holds forwarded writes and
# this site no longer leads, nothing appended).
Replicate = Callable[[list[Message], list[tuple[bytes, bytes]], list[bytes], list[Fence],
                      bool], Awaitable[None]]

# Queued bytes, in multiples of `max_bytes`, past which new messages are refused.
OVERFULL = 4
# A batch up to this size is written on the event loop: handing it to the executor
# costs ~65 us of CPU (thread wake-up, GIL, result back to the loop), more than the
# RocksDB write of a few hundred small entries. Larger batches, and any write RocksDB
# would stall, go to the executor, where rocksdict releases the GIL and the write
# overlaps the loop (with 256 KiB, 1 KiB payloads in batches of 1000 wrote 13-20%
# slower than from the executor).
INLINE_WRITE_ENTRIES = 256
INLINE_WRITE_BYTES = 32 * 1024

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    messages: list[Message]
    size: int
    done: asyncio.Future[None] | None
    record_puts: list[tuple[bytes, bytes]]
    record_deletes: list[bytes]
    queued_at: float  # time.monotonic() when it was added
    # the fences of a fenced write (one, or a forwarded batch's): it fails with
    # FencedError when one does not hold, and the rest of its batch is tried again
    fences: list[Fence] = field(default_factory=list)
    # forwarded by another site to this one as the shard's leader
    forwarded: bool = False


class WriteBuffer:
    def __init__(self, shard: Shard, db_name: str, *, max_items: int, max_bytes: int,
                 flush_interval: float, executor: Executor, lock: asyncio.Lock,
                 on_commit: CommitListener) -> None:
        self._shard = shard
        self._labels = (db_name, str(shard.shard_id))
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._flush_interval = flush_interval
        self._executor = executor
        self._lock = lock
        self._on_commit = on_commit
        self._pending: deque[_Pending] = deque()
        self._items = 0
        self._bytes = 0
        self._peak_bytes = 0  # the most ever queued: the bound publishers keep to
        # the labelled children, made once: .labels() locks and checks on every call
        self._batches = metrics.BUFFER_BATCHES.labels(*self._labels)
        self._batch_messages = metrics.BUFFER_MESSAGES.labels(*self._labels)
        self._batch_bytes = metrics.BUFFER_BYTES.labels(*self._labels)
        self._record_bytes = metrics.BUFFER_RECORD_BYTES.labels(*self._labels)
        self._flush_time = metrics.BUFFER_FLUSH_TIME.labels(*self._labels)
        self._commit_latency = metrics.COMMIT_LATENCY.labels(*self._labels)
        metrics.BUFFER_QUEUED_BYTES.labels(*self._labels).set_function(lambda: self._bytes)
        metrics.BUFFER_QUEUED_BYTES_PEAK.labels(*self._labels).set_function(
            lambda: self._peak_bytes)
        self._oldest_at = 0.0
        self._wakeup = asyncio.Event()
        self._full = asyncio.Event()
        # Set while the queued bytes are under `max_bytes`: publishers wait on it, so
        # what a shard holds in memory is bounded by what they respect.
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False
        self._flushing = False  # a flush is under way
        # Set on a replicated site (`Database.attach_replication`): flushes go through
        # the shard's log instead of straight to RocksDB.
        self.replicate: Replicate | None = None
        self._task = asyncio.create_task(self._run(), name=f"ds-buffer-{db_name}-{shard.shard_id}")

    def replace_shard(self, shard: Shard) -> None:
        """The shard was replaced by a checkpoint (`Database.replace_shard`, under
        the shard lock, so no flush is writing to the old one)."""
        self._shard = shard

    def add(self, messages: list[Message], size: int, wait: bool,
            record_puts: list[tuple[bytes, bytes]] | None = None,
            record_deletes: list[bytes] | None = None,
            fences: list[Fence] | None = None,
            forwarded: bool = False) -> asyncio.Future[None] | None:
        """Queue messages (and records to write with them); the future (when `wait`)
        resolves once they are durable. A write with `fences` fails with FencedError when
        one does not hold where its batch is cooked. A `forwarded` one (another site's,
        to this site as the shard's leader) fails with ForwardRefusedError should this site
        stop leading before it is appended."""
        if self._closed:
            raise StorageClosedError("the storage is closing; nothing more is accepted")
        done = asyncio.get_running_loop().create_future() if wait else None
        # records take buffer room like payloads do
        size += sum(len(key) + len(value) for key, value in record_puts or ())
        size += sum(len(key) for key in record_deletes or ())
        now = time.monotonic()
        if not self._pending:
            self._oldest_at = now
        self._pending.append(_Pending(messages, size, done, record_puts or [],
                                      record_deletes or [], now, fences or [], forwarded))
        self._items += len(messages)
        self._bytes += size
        if self._bytes > self._peak_bytes:
            self._peak_bytes = self._bytes
        self._wakeup.set()
        if self._items >= self._max_items or self._bytes >= self._max_bytes:
            self._full.set()
        if self._bytes >= self._max_bytes:
            self._room.clear()
        return done

    def refuse_forwarded(self, error: ForwardRefusedError) -> None:
        """This site stopped leading the shard: the forwarded writes queued here fail
        now, unwritten (their sites write them again at the next leader), rather
        than wait behind this site's own writes, which may wait for those sites."""
        kept: deque[_Pending] = deque()
        for entry in self._pending:
            if not entry.forwarded:
                kept.append(entry)
                continue
            self._items -= len(entry.messages)
            self._bytes -= entry.size
            if entry.done is not None and not entry.done.done():
                entry.done.set_exception(error)
        self._pending = kept
        if self._items < self._max_items and self._bytes < self._max_bytes:
            self._full.clear()
        if self._bytes < self._max_bytes:
            self._room.set()

    def refuse_when_overfull(self) -> None:
        """Raise StorageBusyError when the queued bytes reach OVERFULL times
        `max_bytes`: a publisher that does not wait for room is refused rather than
        let memory grow without bound."""
        if self._bytes >= OVERFULL * self._max_bytes:
            raise StorageBusyError(
                f"shard {self._labels[1]} of {self._labels[0]!r} has {self._bytes} bytes "
                f"queued, over {OVERFULL}x its max_bytes; retry later")

    def has_room(self) -> bool:
        """Whether the queued bytes are under `max_bytes`."""
        return self._room.is_set()

    async def wait_for_room(self) -> None:
        """Return once the queued bytes are under `max_bytes` (or the buffer closes).
        The caller must add without awaiting anything first."""
        # Room wakes every waiter at once, and the first to add may fill the buffer
        # again: each looks once more when its turn comes, or a crowd of publishers
        # would all add at once, pass OVERFULL and be refused (Server busy).
        while not self._room.is_set():
            await self._room.wait()

    async def drain(self) -> None:
        """Return once every write queued before the call has been tried (committed
        or failed): an empty write queued behind them is flushed after them."""
        if not self._pending and not self._flushing:
            return
        if self._closed:
            raise StorageClosedError("the storage is closing")
        done = self.add([], 0, True)
        assert done is not None
        with contextlib.suppress(Exception):  # failed is tried too
            await done

    async def close(self) -> None:
        """Write what is queued, then stop."""
        self._closed = True
        self._room.set()  # nobody waits for a closed buffer; `add` refuses
        self._full.set()
        self._wakeup.set()
        await self._task

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            if not self._pending:
                if self._closed:
                    return
                self._wakeup.clear()
                continue
            wait = self._oldest_at + self._flush_interval - time.monotonic()
            if wait > 0 and not self._full.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), wait)
            self._flushing = True
            try:
                await self._flush(self._take())
            finally:
                self._flushing = False

    def _take(self) -> list[_Pending]:
        taken: list[_Pending] = []
        items = 0
        size = 0
        while self._pending and (not taken or (items < self._max_items
                                               and size < self._max_bytes)):
            entry = self._pending.popleft()
            taken.append(entry)
            items += len(entry.messages)
            size += entry.size
        self._items -= items
        self._bytes -= size
        self._oldest_at = time.monotonic()
        if self._items < self._max_items and self._bytes < self._max_bytes:
            self._full.clear()
        if self._bytes < self._max_bytes:
            self._room.set()
        if not self._pending and not self._closed:
            self._wakeup.clear()
        return taken

    def _take_all(self) -> list[_Pending]:
        taken = list(self._pending)
        self._pending.clear()
        self._items = 0
        self._bytes = 0
        self._full.clear()
        self._room.set()
        if not self._closed:
            self._wakeup.clear()
        return taken

    async def _flush(self, taken: list[_Pending]) -> None:
        messages = [message for entry in taken for message in entry.messages]
        record_puts, record_deletes = _final_records(taken)
        fences = [fence for entry in taken for fence in entry.fences]
        record_bytes = sum(len(key) + len(value) for key, value in record_puts) \
            + sum(len(key) for key in record_deletes)
        if self.replicate is not None:
            await self._flush_replicated(taken, messages, record_puts, record_deletes, fences,
                                         any(entry.forwarded for entry in taken), record_bytes)
            return
        started = time.perf_counter()
        error: BaseException | None = None
        cooked = None
        async with self._lock:
            if fences:
                try:  # point reads of the applied state, which this lock keeps current
                    record_puts = [*record_puts,
                                   *check_fences(fences, self._shard.get_record)]
                except FencedError as exc:
                    self._refuse(taken, exc)
                    return
            try:
                cooked = self._shard.prepare(messages, record_puts, record_deletes)
                if not self._write_inline(cooked):
                    await asyncio.get_running_loop().run_in_executor(
                        self._executor, self._shard.write, cooked)
            except Exception as exc:  # handed to every waiting writer below
                if cooked is not None:
                    self._shard.forget(cooked)
                error = exc
            else:
                self._shard.apply(cooked)
        if error is not None or cooked is None:
            metrics.BUFFER_BATCHES_FAILED.labels(*self._labels).inc()
            log.error("shard %s: batch of %d messages not written: %s",
                      self._labels, len(messages), error)
            failure = error or RuntimeError("batch not cooked")
            _settle(taken, lambda done: done.set_exception(failure))
            return
        self._batches.inc()
        self._batch_messages.inc(len(messages))
        self._batch_bytes.inc(cooked.payload_bytes)
        self._record_bytes.inc(record_bytes)
        self._flush_time.observe(time.perf_counter() - started)
        self._commit_latency.observe(time.monotonic() - taken[0].queued_at)
        _settle(taken, lambda done: done.set_result(None))
        try:
            self._on_commit(cooked)
        except Exception:  # a listener's bug must not stop the writer
            log.exception("commit listener failed on shard %s", self._labels)


    async def _flush_replicated(self, taken: list[_Pending], messages: list[Message],
                                record_puts: list[tuple[bytes, bytes]],
                                record_deletes: list[bytes], fences: list[Fence],
                                forwarded: bool, record_bytes: int) -> None:
        """The flush of a replicated site: the shard's replication commits the batch
        (here or at the shard's leader) and feeds the commit listeners when it
        applies it; writers are answered only once it is committed."""
        assert self.replicate is not None
        started = time.perf_counter()
        try:
            await self.replicate(messages, record_puts, record_deletes, fences, forwarded)
        except FencedError as exc:
            self._refuse(taken, exc)
            return
        except ForwardRefusedError as exc:
            self._send_back(taken, exc)
            return
        except Exception as exc:  # handed to every waiting writer
            failure = exc
            metrics.BUFFER_BATCHES_FAILED.labels(*self._labels).inc()
            # What is queued behind fails too: committed now (through a new leader,
            # say), a client's later messages would land before its resend of the
            # failed ones (order per publisher and topic, MQTT-4.6.0-5).
            behind = self._take_all()
            log.error("shard %s: batch of %d messages not committed: %s; %d writes queued "
                      "behind it dropped", self._labels, len(messages), failure, len(behind))
            abandoned = WriteAbandonedError(
                f"shard {self._labels[1]} of {self._labels[0]!r}: an earlier write failed "
                f"({failure})")
            _settle(taken, lambda done: done.set_exception(failure))
            _settle(behind, lambda done: done.set_exception(abandoned))
            return
        self._batches.inc()
        self._batch_messages.inc(len(messages))
        self._record_bytes.inc(record_bytes)
        self._flush_time.observe(time.perf_counter() - started)
        self._commit_latency.observe(time.monotonic() - taken[0].queued_at)
        _settle(taken, lambda done: done.set_result(None))

    def _refuse(self, taken: list[_Pending], refused: FencedError) -> None:
        """Nothing of the batch was written: its writes whose fences were refused
        fail, the others go back to the head of the queue, in order, for the next
        flush (only fenced writes refuse, so no order is at stake)."""
        again: list[_Pending] = []
        for entry in taken:
            keys = refused.keys & {fence.key for fence in entry.fences}
            if keys or not refused.keys:
                if entry.done is not None and not entry.done.done():
                    entry.done.set_exception(FencedError(refused.message, frozenset(keys)))
            else:
                again.append(entry)
        self._requeue(again)

    def _send_back(self, taken: list[_Pending], error: ForwardRefusedError) -> None:
        """Nothing of the batch was written, and this site no longer leads: the
        forwarded writes in it fail (their sites write them again at the next
        leader), this site's own go back to the head of the queue, in order, and go
        to that leader with the next flush."""
        again = [entry for entry in taken if not entry.forwarded]
        _settle([entry for entry in taken if entry.forwarded],
                lambda done: done.set_exception(error))
        self._requeue(again)

    def _requeue(self, again: list[_Pending]) -> None:
        for entry in reversed(again):
            self._pending.appendleft(entry)
            self._items += len(entry.messages)
            self._bytes += entry.size
        if again:
            self._wakeup.set()
            self._full.set()  # flush at once: they have waited their turn

    def _write_inline(self, cooked: CookedBatch) -> bool:
        """Write a small batch on the loop; False when it must go to the executor
        (large, synced, or RocksDB would stall it)."""
        if (self._shard.sync_writes
                or len(cooked.entries) + len(cooked.record_puts) > INLINE_WRITE_ENTRIES
                or cooked.payload_bytes + sum(len(value) for _, value in cooked.record_puts)
                > INLINE_WRITE_BYTES):
            return False
        try:
            self._shard.write(cooked, no_stall=True)
        except Exception:  # a stall (or a real error, which the executor write reports)
            metrics.BUFFER_INLINE_REFUSED.labels(*self._labels).inc()
            return False
        return True


def _final_records(taken: list[_Pending]) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The records of many writes as one batch's puts and deletes. A batch writes its
    puts before its deletes, so a key put, deleted and put again by three writes must
    become one put: the last write of each key wins. Within one write a delete wins
    over a put of the same key."""
    final: dict[bytes, bytes | None] = {}
    for entry in taken:
        for key, value in entry.record_puts:
            final[key] = value
        for key in entry.record_deletes:
            final[key] = None
    puts = [(key, value) for key, value in final.items() if value is not None]
    deletes = [key for key, value in final.items() if value is None]
    return puts, deletes


def _settle(taken: list[_Pending], settle: Callable[[asyncio.Future[None]], None]) -> None:
    for entry in taken:
        if entry.done is not None and not entry.done.done():
            settle(entry.done)
