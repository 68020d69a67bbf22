"""Writes to one shard: as its leader, a flush of the shard's write buffer is cooked
against the applied state and appended to the log, and its writers wait until it is
applied; elsewhere the flush is forwarded to the leader's peer port. Generation
changes go the same ways (docs/replication.md, "In a running site").

One write is in flight per shard: a flush waits until the previous entry this site
appended is applied before it cooks the next (the buffer gathers writes meanwhile),
so a batch is always cooked against the shard's applied state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from ...errors import ForwardRefusedError, StorageTimeoutError
from ..cooked import CookedBatch
from ..fence import Fence, check_fences
from ..message import Message
from ..shard import now_us
from ..shard_set import INLINE_WRITE_BYTES
from . import entries
from .applier import Applier, give_up
from .log import Position, StaleEpochError
from .peer import PeerError
from .replica_context import RETRY_INTERVAL, NotLeaderError, ReplicaContext, ReplicaRole, remaining
from .wire import encode_submit

log = logging.getLogger(__name__)


class Writes:
    """The writes of one shard replica: appended here while this site leads (the
    `applier` applies them; `on_appended` is told of each, to ship it, and
    `on_durable` once it is on disk here, to count this site's copy towards its
    commit), forwarded to the leader else."""

    def __init__(self, context: ReplicaContext, role: ReplicaRole, applier: Applier,
                 on_appended: Callable[[], None], on_durable: Callable[[], None]) -> None:
        self._context = context
        self._role = role
        self._applier = applier
        self._on_appended = on_appended
        self._on_durable = on_durable
        self._append_lock = asyncio.Lock()
        # The last offset this site appended as leader: the next write waits for it.
        self._last_own = 0
        # The offset of this leader's first entry of its epoch: writes wait until it
        # is applied (every entry it inherited is applied by then).
        self._ready_at: int | None = None
        # writes of this leader on their way to its log (cooked, or waiting to be)
        self._to_append = 0

    @property
    def append_coming(self) -> bool:
        """Whether this leader will append soon: a write is queued in the shard's
        buffer or on its way to the log."""
        return self._to_append > 0 or self._context.buffer.holds_writes

    async def open_epoch(self) -> None:
        """As a new leader: append the first entry of its epoch, which commits
        everything inherited before it; writes wait until it is applied. Under the
        append lock: a write woken by this site's leading must not cook before
        `_ready_at` is known, against a shard that has not applied the tail it
        inherited (its fences checked against old records, its topics learnt again,
        the trie of a generation it has not seen added yet)."""
        async with self._append_lock:
            position, applied = await self._append(entries.encode(entries.Noop()))
            give_up(applied)  # writes wait for `_ready_at` to be applied instead
            self._ready_at = position.offset
        await self._sync_own(position.offset)

    def _check_ready(self) -> int:
        """The offset of this leader's first entry, which a write waits for (with the
        append lock held); NotLeaderError when its epoch did not open."""
        if self._ready_at is None:
            raise NotLeaderError(f"{self._context.label}: this site's epoch as the shard's "
                                 f"leader has not opened")
        return self._ready_at

    def stopped_leading(self, why: str) -> None:
        """This site stopped leading: entries appended but not applied may be cut by
        the new leader, so their writers fail (they may retry), and writes other
        sites forwarded here go back to them."""
        self._ready_at = None
        self._applier.forget_own()
        self._last_own = 0
        self._applier.fail_waiters(
            NotLeaderError(f"{self._context.label}: this site stopped leading ({why})"))
        self._context.buffer.refuse_forwarded(ForwardRefusedError(
            f"{self._context.label}: this site stopped leading ({why}) before it wrote a forwarded "
            f"write; it goes back to its site"))

    async def write(self, messages: list[Message], record_puts: list[tuple[bytes, bytes]],
                    record_deletes: list[bytes], fences: list[Fence] | None = None,
                    forwarded: bool = False) -> None:
        """Commit one flush of the shard's write buffer: as its leader, or at the
        leader. Raises a recoverable StorageError when that does not happen within
        `write_timeout` (the writers are then not acknowledged). A flush holding
        writes other sites `forwarded` here is never sent on to another leader
        (ForwardRefusedError instead): the next leader may be one of those sites, its
        write buffer waiting on its forward here."""
        deadline = time.monotonic() + self._context.settings.write_timeout
        while True:
            placement = self._role.placement
            changed = self._role.role_changed
            if forwarded and self._role.leadership is None:
                raise ForwardRefusedError(f"{self._context.label}: this site no longer leads the "
                                      f"shard; a forwarded write goes back to its site")
            try:
                if self._role.leadership is not None:
                    await self._write_as_leader(messages, record_puts, record_deletes,
                                                deadline, fences or [])
                    return
                if placement is not None and placement.leader != self._context.settings.site \
                        and placement.leader in self._role.peers:
                    await self._forward(placement.leader, messages, record_puts,
                                        record_deletes, deadline, fences or [])
                    return
            except (PeerError, NotLeaderError) as exc:
                # Records alone (a key-value database's puts and deletes) are written
                # again as they are: a second write of one that did commit changes
                # nothing (a fenced one is checked again). Messages are not: their
                # writers resend them, so that a QoS 2 one is recognised.
                if messages or remaining(deadline) <= 0:
                    raise
                log.info("%s: a write of records goes to the shard's next leader: %s",
                         self._context.label, exc.message)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(),
                                           min(RETRY_INTERVAL, remaining(deadline)))
                continue
            # no leader known yet (or this site is about to lead): wait for a placement
            try:
                await asyncio.wait_for(changed.wait(), remaining(deadline))
            except TimeoutError:
                raise StorageTimeoutError(f"{self._context.label}: no leader known within "
                                          f"{self._context.settings.write_timeout}s") from None

    async def _write_as_leader(self, messages: list[Message],
                               record_puts: list[tuple[bytes, bytes]],
                               record_deletes: list[bytes], deadline: float,
                               fences: list[Fence]) -> None:
        self._to_append += 1
        try:
            async with self._append_lock:
                # cook against the applied state: this site's earlier entries first
                await self._applier.wait_applied(max(self._last_own, self._check_ready()),
                                                 deadline)
                shard = self._context.shard
                if fences:
                    # the applied state is current here (one write in flight): a fence
                    # that holds now holds when the entry applies
                    record_puts = [*record_puts, *check_fences(fences, shard.get_record)]
                cooked = shard.prepare(messages, record_puts, record_deletes)
                try:
                    position, applied = await self._append(
                        entries.encode_batch(cooked.to_bytes()), cooked)
                except BaseException:
                    shard.forget(cooked)
                    raise
        finally:
            self._to_append -= 1
        await self._until_applied(position, applied, deadline)

    async def propose(self, change: entries.Change) -> bool:
        """Append a generation change as the shard's leader and wait until it is
        applied here; False (nothing done) when this site does not lead the shard."""
        if self._role.leadership is None:
            return False
        deadline = time.monotonic() + self._context.settings.write_timeout
        async with self._append_lock:
            await self._applier.wait_applied(max(self._last_own, self._check_ready()),
                                             deadline)
            position, applied = await self._append(entries.encode(change))
        await self._until_applied(position, applied, deadline)
        return True

    async def change(self, change: entries.Change,
                     as_leader: Callable[[entries.Change], Awaitable[bool]]) -> None:
        """Append a generation change (a drop, GC deletes, a topic seed) as the shard's
        leader, or have the leader append it; returns once applied where it was
        appended. Such changes are safe to append twice (a drop or delete of what is
        gone is only recorded, a seed is set again), so a change that may or may not
        have landed is sent again, to the next leader, until `write_timeout`.
        `as_leader` appends it when this site leads (`ReplicatedBackend.propose`:
        `propose` here, after telling a drop to the sites that read the shard here)."""
        deadline = time.monotonic() + self._context.settings.write_timeout
        while True:
            placement = self._role.placement
            changed = self._role.role_changed
            try:
                if await as_leader(change):
                    return
                if placement is not None and placement.leader != self._context.settings.site \
                        and placement.leader in self._role.peers:
                    await self._context.client.change(self._role.peers[placement.leader],
                                              self._context.shard_set.name, self._context.shard_id,
                                              entries.encode(change), remaining(deadline))
                    return
            except (PeerError, NotLeaderError) as exc:
                if remaining(deadline) <= 0:
                    raise
                log.info("%s: a generation change goes to the shard's next leader: %s",
                         self._context.label, exc.message)
            try:
                await asyncio.wait_for(changed.wait(), min(RETRY_INTERVAL, remaining(deadline)))
            except TimeoutError:
                if remaining(deadline) <= 0:
                    raise StorageTimeoutError(
                        f"{self._context.label}: no leader took the change within "
                        f"{self._context.settings.write_timeout}s") from None

    async def add_generation(self) -> bool:
        if self._role.leadership is None:
            return False
        shard = self._context.shard
        # after every timestamp this leader has handed out
        at = max(now_us(), shard.last_timestamp + 1)
        return await self.propose(entries.AddGeneration(at, shard.topic_seed))

    async def _append(self, raw: bytes, own: CookedBatch | None = None
                      ) -> tuple[Position, asyncio.Future[None]]:
        """Append one entry as leader and ship it; its position, and the future of
        its writers (`Applier.expect`: taken before it is shipped). `own`: the batch
        as cooked, applied from memory. With followers the entry is written unsynced:
        `_sync_own` puts it on disk while they append theirs (a replicated write
        waits for one fsync's time, not the leader's and then the followers'), and
        it commits once a majority holds it on disk, this site counted once synced."""
        leadership = self._role.leadership
        if leadership is None or not leadership.current:
            raise NotLeaderError(f"{self._context.label}: this site does not lead the shard")
        alone = len(leadership.replica_set) == 1
        shard_log = self._context.log
        try:
            async with self._context.log_lock:
                positions = self._append_inline(leadership.epoch, raw, alone)
                if positions is None:
                    positions = await self._context.run(shard_log.append_as_leader,
                                                        leadership.epoch, [raw], alone)
        except StaleEpochError as exc:
            self._role.step_down(str(exc))
            raise NotLeaderError(f"{self._context.label}: {exc.message}") from exc
        position = positions[0]
        now = self._role.leadership
        if now is None or now.epoch != leadership.epoch or not now.current:
            # It stepped down while the entry was written (a newer leader's follower
            # refused an append): that leader may cut it. Its writers fail, and may
            # retry; the step-down failed the writers it knew of already. (A new
            # replica set at the same epoch replaces the Leadership, not the leader:
            # its senders ship the entry.)
            raise NotLeaderError(f"{self._context.label}: this site stopped leading the "
                                 f"shard while it appended an entry")
        self._last_own = position.offset
        # before it is shipped: it may be applied from then on
        applied = self._applier.expect(position)
        if own is not None:
            self._applier.keep_own(position, own)
        self._on_appended()
        return position, applied

    def _append_inline(self, epoch: int, raw: bytes, alone: bool) -> list[Position] | None:
        """Append a small entry on the loop, unsynced (`_sync_own` syncs it on the
        executor while the followers append it): an executor hand-off less before the
        entry is shipped. None (nothing written) when it must go to the executor: a
        leader alone syncs with its append, a large entry, an epoch the log has not
        recorded yet (a synced write), a write RocksDB would stall."""
        shard_log = self._context.log
        if alone or len(raw) > INLINE_WRITE_BYTES or shard_log.epoch != epoch:
            return None
        try:
            return shard_log.append_as_leader(epoch, [raw], False, no_stall=True)
        except StaleEpochError:
            raise
        except Exception:  # a stall (or a real error, which the executor append reports)
            return None

    async def _until_applied(self, position: Position, applied: asyncio.Future[None],
                             deadline: float) -> None:
        """This leader's entry at `position` on disk here, then committed and applied
        (`applied`, from `_append`): its writers are answered then. NotLeaderError
        when a newer leader's entry is applied at its offset instead."""
        try:
            await self._sync_own(position.offset)
            await self._applier.wait_for(applied, position.offset, deadline)
        finally:
            give_up(applied)

    async def _sync_own(self, offset: int) -> None:
        """Put this leader's entries through `offset` on disk, while its followers
        append theirs (`_append` shipped them); its copy counts towards their commit
        from then on. Under the log lock, as every write of the log: the site closes
        its logs only once it holds that lock."""
        shard_log = self._context.log
        if shard_log.durable < offset:  # else synced already, by a later entry's sync
            async with self._context.log_lock:
                await self._context.run(shard_log.sync)
        # told even when another sync put it on disk: the commit may wait for it
        self._on_durable()

    async def _forward(self, leader: str, messages: list[Message],
                       record_puts: list[tuple[bytes, bytes]], record_deletes: list[bytes],
                       deadline: float, fences: list[Fence]) -> None:
        body = encode_submit(messages, record_puts, record_deletes, fences)
        await self._context.client.submit(self._role.peers[leader], self._context.shard_set.name,
                                  self._context.shard_id, body, remaining(deadline))

    async def submit_forwarded(self, messages: list[Message],
                               record_puts: list[tuple[bytes, bytes]],
                               record_deletes: list[bytes],
                               fences: list[Fence] | None = None) -> None:
        """A write another site forwarded to this site as the shard's leader."""
        await self._role.until_leading()
        if self._role.leadership is None:
            raise NotLeaderError(f"{self._context.label}: this site does not lead the shard")
        # The messages and records go into one batch of this shard, as they were in the
        # sender's; its topics and sizes were checked where the client published.
        size = sum(len(message.payload) + len(message.topic) for message in messages)
        done = self._context.buffer.add(messages, size, True, record_puts, record_deletes,
                                        fences, forwarded=True)
        assert done is not None
        await done
