"""The write buffer of one shard, with group commit.

Messages wait here until `max_items` or `max_bytes` is reached or the oldest has
waited `flush_interval`; then they are committed as one batch by the flush the
database's backend gave the buffer (`backend.py`: one RocksDB write off the event
loop, or one entry of the shard's replication log). `max_bytes` also bounds what a
shard queues for callers that wait for room (`wait_for_room`) before they add. While
a flush is in flight new messages gather for the next one, so many concurrent
writers share each write. The messages of one `store_batch` call always go into the
same batch (atomic per shard)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..errors import (
    ForwardRefusedError,
    StorageBusyError,
    StorageClosedError,
    WriteAbandonedError,
)
from . import metrics
from .fence import Fence, FencedError
from .message import Message

# How a shard's buffered writes are committed, given by the database's backend
# (`backend.py`): one flush (messages, record puts, record deletes, the fences of its
# fenced writes, whether it holds writes other sites forwarded); returns once
# committed and visible to readers, or raises (FencedError: some fences refused,
# nothing written; ForwardRefusedError: it holds forwarded writes and this site no
# longer leads, nothing appended; anything else: the batch failed).
Flush = Callable[[list[Message], list[tuple[bytes, bytes]], list[bytes], list[Fence],
                  bool], Awaitable[None]]

# Queued bytes, in multiples of `max_bytes`, past which new messages are refused.
OVERFULL = 4
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
    """`abandon_behind_failure`: a failed flush fails the writes queued behind it too
    (a replicated flush: committed later through a new leader, a client's later
    messages would land before its resend of the failed ones, MQTT-4.6.0-5)."""

    def __init__(self, db_name: str, shard_id: int, *, max_items: int, max_bytes: int,
                 flush_interval: float, flush: Flush, abandon_behind_failure: bool) -> None:
        self._labels = (db_name, str(shard_id))
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._flush_interval = flush_interval
        self._commit = flush
        self._abandon_behind_failure = abandon_behind_failure
        self._pending: deque[_Pending] = deque()
        self._items = 0
        self._bytes = 0
        self._peak_bytes = 0  # the most ever queued: the bound publishers keep to
        # the labelled children, made once: .labels() locks and checks on every call
        self._batches = metrics.BUFFER_BATCHES.labels(*self._labels)
        self._batch_messages = metrics.BUFFER_MESSAGES.labels(*self._labels)
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
        self._task = asyncio.create_task(self._run(), name=f"ds-buffer-{db_name}-{shard_id}")

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
        if record_puts:  # most writes have none: no generator made for them
            size += sum(len(key) + len(value) for key, value in record_puts)
        if record_deletes:
            size += sum(len(key) for key in record_deletes)
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

    @property
    def holds_writes(self) -> bool:
        """Whether writes are queued here, not yet taken by a flush."""
        return bool(self._pending)

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
        """Commit the writes taken through the backend's flush; writers are answered
        once it is committed."""
        # One plain loop: this runs for every flush, and a generator (`any(...)`) would
        # be resumed once per write taken.
        messages: list[Message] = []
        fences: list[Fence] = []
        forwarded = False
        for entry in taken:
            messages += entry.messages
            if entry.fences:
                fences += entry.fences
            forwarded = forwarded or entry.forwarded
        record_puts, record_deletes = _final_records(taken)
        record_bytes = sum(len(key) + len(value) for key, value in record_puts) \
            + sum(len(key) for key in record_deletes)
        started = time.perf_counter()
        try:
            await self._commit(messages, record_puts, record_deletes, fences, forwarded)
        except FencedError as exc:
            self._refuse(taken, exc)
            return
        except ForwardRefusedError as exc:
            self._send_back(taken, exc)
            return
        except Exception as exc:  # handed to every waiting writer
            self._fail(taken, len(messages), exc)
            return
        self._batches.inc()
        self._batch_messages.inc(len(messages))
        self._record_bytes.inc(record_bytes)
        self._flush_time.observe(time.perf_counter() - started)
        self._commit_latency.observe(time.monotonic() - taken[0].queued_at)
        _settle(taken, lambda done: done.set_result(None))

    def _fail(self, taken: list[_Pending], n_messages: int, failure: Exception) -> None:
        metrics.BUFFER_BATCHES_FAILED.labels(*self._labels).inc()
        if not self._abandon_behind_failure:
            log.error("shard %s: batch of %d messages not written: %s",
                      self._labels, n_messages, failure)
            _settle(taken, lambda done: done.set_exception(failure))
            return
        # What is queued behind fails too: committed now (through a new leader,
        # say), a client's later messages would land before its resend of the
        # failed ones (order per publisher and topic, MQTT-4.6.0-5).
        behind = self._take_all()
        log.error("shard %s: batch of %d messages not committed: %s; %d writes queued "
                  "behind it dropped", self._labels, n_messages, failure, len(behind))
        abandoned = WriteAbandonedError(
            f"shard {self._labels[1]} of {self._labels[0]!r}: an earlier write failed "
            f"({failure})")
        _settle(taken, lambda done: done.set_exception(failure))
        _settle(behind, lambda done: done.set_exception(abandoned))

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
