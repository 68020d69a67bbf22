"""A replica's applier: committed log entries are applied to the shard's data in log
order by the database's `LogStateMachine` (`state_machine.py`), each recording its
offset as applied in the same RocksDB write; writers wait
here for their entry to be applied, and the log is trimmed behind what every replica
holds (docs/replication.md, "In a running site", `trim.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from ...errors import StorageError, StorageTimeoutError
from ..cooked import CookedBatch
from . import entries
from .log import Position
from .replica_context import RETRY_INTERVAL, NotLeaderError, ReplicaContext, ReplicaRole, remaining
from .trim import follower_trim_point, leader_trim_point

log = logging.getLogger(__name__)

# Entries an applier reads from its log at a time.
APPLY_BATCH = 100
# A log is trimmed once this many entries may go, at most TRIM_BATCH per delete.
TRIM_STEP = 100
TRIM_BATCH = 10_000


class Applier:
    """The apply loop of one shard replica, started when it is built. `on_applied`
    is told after each entry applied."""

    def __init__(self, context: ReplicaContext, role: ReplicaRole,
                 on_applied: Callable[[], None]) -> None:
        self._context = context
        self._role = role
        self._log = context.log
        self._on_applied = on_applied
        # Per offset, who waits for it to be applied: a writer for its own entry (its
        # epoch with it: a newer leader may put another entry at that offset), a
        # reader for whatever entry is there (None). And this site's own cooked
        # batches by offset, with their epoch (applied from memory: the leader's copy
        # carries the messages).
        self._applied_waiters: dict[int, list[tuple[int | None, asyncio.Future[None]]]] = {}
        self._own: dict[int, tuple[int, CookedBatch]] = {}
        self._committed_moved = asyncio.Event()
        # Held while committed entries are applied, and while a checkpoint replaces
        # the shard's data (so no entry of the old log lands on the new data).
        self._apply_lock = asyncio.Lock()
        self._closed = False
        # What was applied was committed: known again at once after a restart, not
        # only once the leader speaks.
        self._log.commit_to(self.applied)
        self._task = asyncio.create_task(self._apply_loop(), name=f"ds-apply-{self._context.label}")

    @property
    def applied(self) -> int:
        return self._context.shard.applied_offset

    def committed_moved(self) -> None:
        """The log's commit offset, or how far it holds entries on disk, may have grown."""
        self._committed_moved.set()

    def keep_own(self, position: Position, cooked: CookedBatch) -> None:
        """This leader's batch at `position`: applied from memory, as it was cooked,
        if the entry applied at its offset is still this one."""
        self._own[position.offset] = (position.epoch, cooked)

    def forget_own(self) -> None:
        """This site stopped leading: entries appended but not applied may be cut by
        the new leader, so what their cooking learned in memory goes."""
        shard = self._context.shard
        for _epoch, cooked in self._own.values():
            shard.forget(cooked)
        self._own.clear()

    def expect(self, position: Position) -> asyncio.Future[None]:
        """A future for the writer of the entry at `position`, this leader's own,
        taken before the entry is shipped (so before it can be applied, and before a
        step-down can pass it by): done once that entry is applied; failed with
        NotLeaderError when another entry is applied at its offset (a newer leader's:
        this one was cut) or the site steps down first (`fail_waiters`). Wait for it
        with `wait_for`."""
        return self._waiter(position.offset, position.epoch)

    def _waiter(self, offset: int, epoch: int | None) -> asyncio.Future[None]:
        """A future woken when the entry at `offset` is applied (of `epoch`, or any
        when None): see `_wake_writers`."""
        waiter = asyncio.get_running_loop().create_future()
        self._applied_waiters.setdefault(offset, []).append((epoch, waiter))
        return waiter

    async def wait_for(self, expected: asyncio.Future[None], offset: int,
                       deadline: float) -> None:
        """Wait until `expected` (from `expect`, for the entry at `offset`) is done."""
        try:
            await asyncio.wait_for(asyncio.shield(expected), remaining(deadline))
        except TimeoutError:
            raise StorageTimeoutError(
                f"{self._context.label}: entry {offset} not committed within "
                f"{self._context.settings.write_timeout}s (no majority of replicas "
                f"reached)") from None
        finally:
            give_up(expected)

    async def wait_applied(self, offset: int, deadline: float) -> None:
        """Wait until whatever entry is at `offset` is applied (a read barrier, or a
        write's turn after this leader's earlier entries)."""
        if offset <= self.applied:
            return
        await self.wait_for(self._waiter(offset, None), offset, deadline)

    def fail_waiters(self, error: StorageError) -> None:
        """Fail every writer waiting for an entry to be applied."""
        for waiters in self._applied_waiters.values():
            for _epoch, waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
        self._applied_waiters.clear()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Nothing is applied (nor trimmed) meanwhile: a checkpoint replaces the
        shard's data."""
        async with self._apply_lock:
            yield

    def stop(self) -> None:
        """Apply nothing after the batch in hand (the site is stopping)."""
        self._closed = True

    async def close(self) -> None:
        self.stop()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _appliable(self) -> int:
        """How far entries may be applied: those committed that this site's log holds
        on disk. A leader's own entries may be committed by its followers alone while
        it syncs them; applied before, a power loss left the shard's applied offset
        (synced by a trim, or by every write with `sync_writes`) past the end of the
        log, and the site refused to start."""
        return min(self._log.committed, self._log.durable)

    async def _apply_loop(self) -> None:
        while not self._closed:
            if self.applied >= self._appliable():
                self._committed_moved.clear()
                if self.applied >= self._appliable():
                    await self._committed_moved.wait()
                continue
            try:
                await self._apply_some()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed write: try again, in order, after a pause
                log.exception("%s: applying committed entries failed", self._context.label)
                await asyncio.sleep(RETRY_INTERVAL)

    async def _apply_some(self) -> None:
        async with self._apply_lock:
            start = self.applied + 1
            # Read with the commit offset of that moment, under the log lock: a new
            # leader's append may replace uncommitted entries right after, and the
            # commit offset may then cover the replacements (the log never cuts
            # committed entries, so those read at or below it stay as read).
            async with self._context.log_lock:
                committed = self._appliable()
                recent = self._log.read_in_memory(start, APPLY_BATCH)
                found = list(recent.entries) if recent is not None else \
                    await self._context.run(self._log.read_stored, start, APPLY_BATCH)
            for entry in found:
                offset = entry.position.offset
                if offset > committed or offset != self.applied + 1:
                    break
                await self._context.state_machine.apply(
                    self._context.shard_id, offset, entries.decode(entry.batch),
                    self._own_at(entry.position))
                self._wake_writers(entry.position)
        await self._trim()

    def _own_at(self, position: Position) -> CookedBatch | None:
        """This site's cooked batch for the entry at `position`, if that entry is the
        one it appended there (a newer leader's replaced it otherwise: what its
        cooking learned in memory goes, before the newer entry's is learnt)."""
        kept = self._own.pop(position.offset, None)
        if kept is None:
            return None
        epoch, cooked = kept
        if epoch == position.epoch:
            return cooked
        self._context.shard.forget(cooked)
        return None

    async def _trim(self) -> None:
        """Forget log entries no replica needs any more, keeping the configured tail
        (see `trim.py`); the leader tells its followers with each append. Never past
        what this site's shard holds durably: without `sync_writes` its applied offset
        may be ahead of what a power loss leaves (the log's own writes are synced),
        and a replica that comes back applied below its log's start can never apply
        the entries in between. So the shard's log is synced before a trim."""
        if self._trim_point(self.applied) - self._log.first_offset < TRIM_STEP:
            return
        async with self._apply_lock:  # not while a checkpoint replaces the shard
            durable = await self._context.run(self._context.shard.sync_applied)
        point = self._trim_point(durable)
        if point - self._log.first_offset < TRIM_STEP:
            return
        async with self._context.log_lock:
            await self._context.run(self._log.trim_before, point, TRIM_BATCH)

    def _trim_point(self, applied: int) -> int:
        """Where this site's log may be trimmed, this site having applied `applied`
        (the leader also tells its followers so)."""
        leadership = self._role.leadership
        if leadership is not None:
            point = leader_trim_point(leadership.site, leadership.replica_set,
                                      leadership.matched, applied,
                                      self._context.settings.log_retain_entries)
            leadership.trim_before = point
            return point
        return follower_trim_point(self._log.leader_trims_before, applied)

    def _wake_writers(self, applied: Position) -> None:
        """The entry at `applied` is applied: its waiters go on, and so do those of
        any entry at offsets before it. A writer whose own entry is not the one
        applied at its offset fails: a newer leader's replaced it (or a checkpoint
        jumped past it, and nobody can tell), so its writes were not committed."""
        for offset in [offset for offset in self._applied_waiters if offset <= applied.offset]:
            for epoch, waiter in self._applied_waiters.pop(offset):
                if waiter.done():
                    continue
                if epoch is None or (offset == applied.offset and epoch == applied.epoch):
                    waiter.set_result(None)
                else:
                    waiter.set_exception(NotLeaderError(
                        f"{self._context.label}: the entry of epoch {epoch} at offset "
                        f"{offset} was replaced by a newer leader's before it was "
                        f"committed"))
        self._on_applied()


def give_up(waiter: asyncio.Future[None]) -> None:
    """Nobody waits for `waiter` any more: cancelled if pending (a step-down must not
    fail it with nobody to hear it: asyncio would log "Future exception was never
    retrieved"), its exception read if it has one."""
    if not waiter.done():
        waiter.cancel()
    elif not waiter.cancelled():
        waiter.exception()

