"""One shard of a database on one site: its log, its role under the placement, and
the loops of that role (docs/replication.md, "In a running site").

- Every replica runs an applier: committed log entries are applied to the shard's
  data in log order, each recording its offset as applied in the same RocksDB write.
- The leader appends each flush of the shard's write buffer to its log as a cooked
  batch, ships the log to every follower (one sender task each, heartbeats when
  idle) and answers the writers once the entry is committed and applied.
- A site that does not lead the shard forwards its writes to the leader's peer port.

One write is in flight per shard: a flush waits until the previous entry this site
appended is applied before it cooks the next (the buffer gathers writes meanwhile),
so a batch is always cooked against the shard's applied state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from ...errors import NotRelayedError, StorageError, StorageTimeoutError
from .. import metrics
from ..cooked import CookedBatch
from ..database import Database
from ..fence import Fence, check_fences
from ..message import Message
from ..shard import now_us
from . import entries
from .bootstrap import (
    Progress,
    check_install,
    fetch_checkpoint,
    finish_install,
    remove_staged,
    request_bootstrap,
    should_bootstrap,
    stage_empty_shard,
)
from .commit import majority
from .leader import Leadership
from .log import BootstrapNeededError, LogGapError, Position, ShardLog, StaleEpochError
from .peer import PeerClient, PeerError
from .placement import ShardPlacement
from .trim import follower_trim_point, leader_trim_point
from .wire import encode_submit

log = logging.getLogger(__name__)

Role = Literal["leader", "follower", "none"]
T = TypeVar("T")

# How long a sender waits before it tries an unreachable follower again.
RETRY_INTERVAL = 0.5
# Entries an applier reads from its log at a time.
APPLY_BATCH = 100
# A log is trimmed once this many entries may go, at most TRIM_BATCH per delete.
TRIM_STEP = 100
TRIM_BATCH = 10_000
# A scan's limit when the caller gives none (Shard.scan_records' own).
SCAN_ALL = 1_000_000


class NotLeaderError(StorageError):
    """This site stopped leading the shard (a newer leader exists) before a write
    was committed: the writer may retry, and reaches the new leader."""

    recoverable = True


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    site: str
    write_timeout: float
    heartbeat_interval: float
    # log entries kept beyond what every replica holds (`trim.py`)
    log_retain_entries: int = 10_000
    # bytes per second a checkpoint is sent at to a bootstrapping replica; None: as
    # fast as it goes
    checkpoint_rate: int | None = None
    # the site's failure zone (`cluster.zone`), reported to the controller; None: not
    # known
    zone: str | None = None


class ShardReplica:
    def __init__(self, database: Database, shard_id: int, log_: ShardLog,
                 log_lock: asyncio.Lock, executor: Executor, client: PeerClient,
                 settings: ReplicaSettings) -> None:
        self.database = database
        self.shard_id = shard_id
        self.log = log_
        self._log_lock = log_lock  # shared with the peer server's appends to this log
        self._executor = executor
        self._client = client
        self._settings = settings
        self._label = f"{database.name}/{shard_id}"
        self.placement: ShardPlacement | None = None
        self.peers: dict[str, str] = {}
        self.leadership: Leadership | None = None
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._send_now: dict[str, asyncio.Event] = {}
        # Applied offsets that writers wait for, and this site's own cooked batches by
        # offset (applied from memory: the leader's copy carries the messages).
        self._applied_waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._own: dict[int, CookedBatch] = {}
        # The last offset this site appended as leader: the next write waits for it.
        self._last_own = 0
        # The offset of this leader's first entry of its epoch: writes wait until it
        # is applied (every entry it inherited is applied by then).
        self._ready_at: int | None = None
        self._append_lock = asyncio.Lock()
        self._committed_moved = asyncio.Event()
        self._placement_changed = asyncio.Event()
        # set (and replaced) each time a follower answers this leader
        self._answered = asyncio.Event()
        self._closed = False
        # Held while committed entries are applied, and while a checkpoint replaces
        # the shard's data (so no entry of the old log lands on the new data).
        self._apply_lock = asyncio.Lock()
        self._bootstrap_task: asyncio.Task[Position] | None = None
        self.bootstrap_progress: Progress | None = None
        self.bootstraps = 0  # checkpoints installed here since the site started
        self._dropping: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None  # a takeover (see _take_lead)
        self._starting_since = 0.0  # when that takeover began (monotonic)
        self._installing: asyncio.Task[None] | None = None
        self._leading_listeners: list[Callable[[], None]] = []
        # Leading listeners are told once this offset (committed when this site began
        # to lead, inherited entries included) is applied.
        self._tell_leading_at: int | None = None
        # What was applied was committed: known again at once after a restart, not
        # only once the leader speaks.
        self.log.commit_to(self.applied)
        labels = (database.name, str(shard_id))
        metrics.REPLICA_LAG.labels(*labels).set_function(
            lambda: max(0, self.log.last.offset - self.applied))
        metrics.UNDER_REPLICATED.labels(*labels).set_function(self._under_replicated)
        metrics.REPLICA_ROLE.labels(*labels).set_function(
            lambda: 1 if self.leadership is not None else 0)
        metrics.QUORUM_AGE.labels(*labels).set_function(lambda: self.quorum_age() or 0.0)
        self._leader_changes = metrics.LEADER_CHANGES.labels(*labels)
        self._bootstraps_refused = metrics.BOOTSTRAPS_REFUSED.labels(*labels)
        self._cuts_refused = metrics.LOG_CUTS_REFUSED.labels(*labels)
        self._applier = asyncio.create_task(self._apply_loop(), name=f"ds-apply-{self._label}")

    def add_leading_listener(self, listener: Callable[[], None]) -> None:
        """`listener` runs each time this site begins to lead the shard, once what
        it knew committed then (what it took over included) is applied here."""
        self._leading_listeners.append(listener)

    # -- what the site sees -------------------------------------------------------

    @property
    def role(self) -> Role:
        if self.leadership is not None:
            return "leader"
        if self.placement is not None and self._settings.site in self.placement.replicas:
            return "follower"
        return "none"

    @property
    def applied(self) -> int:
        return self.database.shards[self.shard_id].applied_offset

    @property
    def catching_up(self) -> bool:
        """A replica that, since this site started, neither leads the shard (a
        takeover still waiting for a majority counts as not leading) nor was brought
        by a leader's append up to that leader's commit offset (`ShardLog.caught_up`)."""
        return self.role == "follower" and not self.log.caught_up

    def status(self) -> dict[str, object]:
        last = self.log.last
        progress = self.bootstrap_progress
        return {"db": self.database.name, "shard": self.shard_id, "role": self.role,
                "epoch": self.log.epoch, "last": [last.epoch, last.offset],
                "committed": self.log.committed, "applied": self.applied,
                "state": "ok" if progress is None else "bootstrapping",
                "bootstrap": None if progress is None else progress.as_dict(),
                "bootstraps": self.bootstraps, "log_start": self.log.first_offset,
                "catching_up": self.catching_up,
                "quorum_age": self.quorum_age()}

    def quorum_age(self) -> float | None:
        """As the shard's leader: seconds since a majority of its replicas last
        answered (`Leadership.quorum_age`); while this site takes over as leader: since
        it began to (a takeover that reaches no majority is no better). None
        otherwise. The controller fails over a shard whose leader reports more than a
        site's allowance of missed heartbeats, though the leader itself answers it."""
        now = time.monotonic()
        leadership = self.leadership
        if leadership is not None:
            return round(leadership.quorum_age(now), 3)
        if self._starting is not None and not self._starting.done():
            return round(now - self._starting_since, 3)
        return None

    def _under_replicated(self) -> int:
        leadership = self.leadership
        if leadership is None:
            return 0
        return int(any(leadership.matched.get(site, 0) < leadership.committed
                       for site in leadership.replica_set if site != leadership.site))

    def committed_moved(self) -> None:
        """The log's commit offset may have grown (a leader's append arrived)."""
        self._committed_moved.set()

    # -- taking a placement -------------------------------------------------------

    async def take(self, placement: ShardPlacement, peers: dict[str, str]) -> None:
        """Take this site's role in the shard under a new placement."""
        site = self._settings.site
        self.peers = dict(peers)
        previous, self.placement = self.placement, placement
        if placement.epoch > self.log.epoch:
            async with self._log_lock:
                # a newer leader's append may have got in first: nothing to observe then
                with contextlib.suppress(StaleEpochError):
                    await self._run(self.log.observe_epoch, placement.epoch)
        leading = self.leadership
        if leading is not None and (placement.leader != site or placement.epoch != leading.epoch
                                    or not leading.current):
            self._step_down(f"placement names {placement.leader} at epoch {placement.epoch}")
        if placement.leader == site and placement.epoch >= self.log.epoch:
            if self.leadership is None:
                self._start_leading()
            elif previous is None or previous.replicas != placement.replicas:
                self._change_replica_set(placement)
        self._placement_changed.set()
        self._placement_changed = asyncio.Event()
        if previous is not None and site in previous.replicas \
                and site not in placement.replicas:
            self._dropping = asyncio.create_task(self._drop_data(),
                                                 name=f"ds-drop-{self._label}")

    async def _drop_data(self) -> None:
        """This site left the shard's replica set: its copy of the shard and its log
        go (an empty shard takes their place, installed like a checkpoint). A site
        that joins again later bootstraps from its leader."""
        site = self._settings.site
        shard_path = self.database.shards[self.shard_id].path
        placement = self.placement
        if placement is None or site in placement.replicas:
            return  # joined again meanwhile
        await self._run(stage_empty_shard, shard_path)
        await self._install(shard_path)
        log.info("%s: this site left the replica set: its data of the shard is deleted",
                 self._label)

    def _start_leading(self) -> None:
        """Lead the shard as the placement says, once taken over: in the background,
        since a takeover waits for a majority of the replicas and a push must not."""
        if self._starting is None or self._starting.done():
            self._starting = asyncio.create_task(self._take_lead(),
                                                 name=f"ds-lead-{self._label}")
            self._starting_since = time.monotonic()

    async def _take_lead(self) -> None:
        site = self._settings.site
        while not self._closed:
            placement = self.placement
            if placement is None or placement.leader != site or self.leadership is not None \
                    or placement.epoch < self.log.epoch:
                return  # replaced meanwhile
            try:
                await self._take_over(placement)
            except StaleEpochError as exc:
                log.warning("%s: not leading epoch %d: %s", self._label, placement.epoch,
                            exc.message)
                return  # a newer leader exists: the controller's next push names it
            except StorageError as exc:
                log.warning("%s: not leading epoch %d yet: %s", self._label, placement.epoch,
                            exc.message)
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            except Exception:  # a bug must not leave the shard without its leader
                log.exception("%s: taking over epoch %d failed", self._label, placement.epoch)
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            if self.placement is placement:
                await self._begin(placement)
                return

    async def until_leading(self) -> None:
        """While this site is named the leader and still takes over, wait for it (up
        to `write_timeout`): a request sent to the new leader right after the push
        is not refused for arriving a moment early."""
        deadline = time.monotonic() + self._settings.write_timeout
        while self.leadership is None and self._starting is not None \
                and not self._starting.done() and self._remaining(deadline) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._placement_changed.wait(),
                                       self._remaining(deadline))

    async def _take_over(self, placement: ShardPlacement) -> None:
        """Before leading at `placement.epoch`: fence a majority of the replica set at
        it (from then on they refuse the old leader's appends) and append the tail of
        the most advanced of them, which holds every committed entry. The controller
        chose this site on positions that may have moved since: the old leader may
        have committed more meanwhile (a planned handover, or a leader only the
        controller lost). Raises StaleEpochError when a replica knows a newer epoch,
        another StorageError when no majority answers or the tail does not come."""
        site = self._settings.site
        needed = majority(len(placement.replicas)) - 1  # this site is fenced already
        if needed <= 0:
            return
        within = self._settings.write_timeout
        asking = {asyncio.create_task(self._client.fence(
            self.peers[other], self.database.name, self.shard_id, placement.epoch, within)):
            other for other in placement.replicas if other != site and other in self.peers}
        ends: dict[str, Position] = {}
        failures: list[str] = []
        newer: StaleEpochError | None = None
        pending = set(asking)
        try:
            while pending and len(ends) < needed and newer is None:
                done, pending = await asyncio.wait(pending,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    try:
                        ends[asking[task]] = task.result()
                    except StaleEpochError as exc:
                        newer = exc
                    except StorageError as exc:
                        failures.append(exc.message)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if newer is not None:
            raise newer
        if len(ends) < needed:
            raise PeerError(f"{len(ends) + 1} of {len(placement.replicas)} replicas fenced "
                            f"at epoch {placement.epoch}, a majority needed: "
                            f"{'; '.join(failures) or 'their addresses are not known'}")
        furthest, end = max(ends.items(), key=lambda item: (item[1], item[0]))
        if end > self.log.last:
            await self._append_tail(placement.epoch, furthest, end)

    async def _append_tail(self, epoch: int, source: str, end: Position) -> None:
        """Append the log of `source` up to `end`, as a follower of it would."""
        start = self.log.last.offset + 1
        before = self.log.last
        while self.log.last < end:
            address = self.peers.get(source)
            if address is None:
                raise PeerError(f"{self._label}: the address of {source} is not known")
            request = await self._client.tail(address, self.database.name, self.shard_id,
                                              start, self._settings.write_timeout)
            async with self._log_lock:
                result = await self._run(self.log.append_from_leader, epoch,
                                         request.previous, request.entries, request.committed)
            if not result.accepted:
                start = result.retry_from
            elif not request.entries:
                break  # its log ends here
            else:
                start = result.matched + 1
        log.info("%s: taking over at epoch %d: appended %s's tail, %s -> %s", self._label,
                 epoch, source, tuple(before), tuple(self.log.last))

    async def _begin(self, placement: ShardPlacement) -> None:
        site = self._settings.site
        async with self._log_lock:
            try:
                leadership = await self._run(Leadership.begin, site, placement.epoch,
                                             self.log, placement.replicas, self.log.committed,
                                             time.monotonic())
            except StaleEpochError as exc:
                # A kept (or late) placement that a failover replaced, and the new
                # leader's append got here first: follow it; the controller's next
                # push names it.
                log.warning("%s: not leading epoch %d: %s", self._label, placement.epoch,
                            exc.message)
                return
        self.leadership = leadership
        self._leader_changes.inc()
        log.info("%s: leading at epoch %d, replicas %s", self._label, placement.epoch,
                 ", ".join(placement.replicas))
        self._start_senders()
        self._tell_leading_at = self.log.committed
        self._tell_leading()
        # writers waiting for this site to lead go on
        self._placement_changed.set()
        self._placement_changed = asyncio.Event()
        # The first entry of the epoch commits everything inherited before it; writes
        # wait until it is applied.
        try:
            self._ready_at = await self._append(entries.encode(entries.Noop()))
        except (StaleEpochError, NotLeaderError) as exc:
            self._step_down(exc.message)  # _append has stepped down already, if it raised

    def _change_replica_set(self, placement: ShardPlacement) -> None:
        leading = self.leadership
        assert leading is not None
        start = self.log.last.offset + 1
        followers = [site for site in placement.replicas if site != leading.site]
        now = time.monotonic()
        self.leadership = Leadership(
            leading.site, leading.epoch, leading.log, placement.replicas,
            {site: leading.next_offset.get(site, start) for site in followers},
            {site: offset for site, offset in leading.matched.items() if site in followers},
            leading.committed,
            # a replica that joins now counts as heard from now on
            heard={site: leading.heard.get(site, leading.began
                                           if site in leading.replica_set else now)
                   for site in followers},
            began=leading.began,
            confirmed={site: sent for site, sent in leading.confirmed.items()
                       if site in followers})
        self._stop_senders()
        self._start_senders()
        self._advance()

    def step_down_for_newer_epoch(self) -> None:
        """An append of a newer leader reached this site's log."""
        self._step_down(f"an append of epoch {self.log.epoch} arrived")

    def _step_down(self, why: str) -> None:
        if self.leadership is None:
            return
        log.warning("%s: stops leading epoch %d: %s", self._label, self.leadership.epoch, why)
        self.leadership = None
        self._leader_changes.inc()
        self._ready_at = None
        self._tell_leading_at = None
        self._stop_senders()
        # Entries appended but not applied may be cut by the new leader: what their
        # cooking learned in memory goes, and their writers fail (they may retry).
        shard = self.database.shards[self.shard_id]
        for cooked in self._own.values():
            shard.forget(cooked)
        self._own.clear()
        self._last_own = 0
        error = NotLeaderError(f"{self._label}: this site stopped leading ({why})")
        for waiters in self._applied_waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
        self._applied_waiters.clear()
        self.database.refuse_forwarded(self.shard_id, NotRelayedError(
            f"{self._label}: this site stopped leading ({why}) before it wrote a forwarded "
            f"write; it goes back to its site"))
        self._placement_changed.set()
        self._placement_changed = asyncio.Event()
        self._answered.set()  # a read waiting for this leadership's confirmation fails
        self._answered = asyncio.Event()

    # -- writing ------------------------------------------------------------------

    async def write(self, messages: list[Message], record_puts: list[tuple[bytes, bytes]],
                    record_deletes: list[bytes], fences: list[Fence] | None = None,
                    forwarded: bool = False) -> None:
        """Commit one flush of the shard's write buffer: as its leader, or at the
        leader. Raises a recoverable StorageError when that does not happen within
        `write_timeout` (the writers are then not acknowledged). A flush holding
        writes other sites `forwarded` here is never sent on to another leader
        (NotRelayedError instead): the next leader may be one of those sites, its
        write buffer waiting on its forward here."""
        deadline = time.monotonic() + self._settings.write_timeout
        while True:
            placement = self.placement
            changed = self._placement_changed
            if forwarded and self.leadership is None:
                raise NotRelayedError(f"{self._label}: this site no longer leads the shard; "
                                      f"a forwarded write goes back to its site")
            try:
                if self.leadership is not None:
                    await self._write_as_leader(messages, record_puts, record_deletes,
                                                deadline, fences or [])
                    return
                if placement is not None and placement.leader != self._settings.site \
                        and placement.leader in self.peers:
                    await self._forward(placement.leader, messages, record_puts,
                                        record_deletes, deadline, fences or [])
                    return
            except (PeerError, NotLeaderError) as exc:
                # Records alone (a key-value database's puts and deletes) are written
                # again as they are: a second write of one that did commit changes
                # nothing (a fenced one is checked again). Messages are not: their
                # writers resend them, so that a QoS 2 one is recognised.
                if messages or self._remaining(deadline) <= 0:
                    raise
                log.info("%s: a write of records goes to the shard's next leader: %s",
                         self._label, exc.message)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(),
                                           min(RETRY_INTERVAL, self._remaining(deadline)))
                continue
            # no leader known yet (or this site is about to lead): wait for a placement
            try:
                await asyncio.wait_for(changed.wait(), self._remaining(deadline))
            except TimeoutError:
                raise StorageTimeoutError(f"{self._label}: no leader known within "
                                          f"{self._settings.write_timeout}s") from None

    async def _write_as_leader(self, messages: list[Message],
                               record_puts: list[tuple[bytes, bytes]],
                               record_deletes: list[bytes], deadline: float,
                               fences: list[Fence]) -> None:
        async with self._append_lock:
            # cook against the applied state: this site's earlier entries first
            await self._wait_applied(max(self._last_own, self._ready_at or 0), deadline)
            shard = self.database.shards[self.shard_id]
            if fences:
                # the applied state is current here (one write in flight): a fence that
                # holds now holds when the entry applies
                record_puts = [*record_puts, *check_fences(fences, shard.get_record)]
            cooked = shard.prepare(messages, record_puts, record_deletes)
            try:
                offset = await self._append(entries.encode_batch(cooked.to_bytes()))
            except BaseException:
                shard.forget(cooked)
                raise
            self._own[offset] = cooked
        await self._wait_applied(offset, deadline)

    async def propose(self, change: entries.Change) -> bool:
        """Append a generation change as the shard's leader and wait until it is
        applied here; False (nothing done) when this site does not lead the shard."""
        if self.leadership is None:
            return False
        deadline = time.monotonic() + self._settings.write_timeout
        async with self._append_lock:
            await self._wait_applied(max(self._last_own, self._ready_at or 0), deadline)
            offset = await self._append(entries.encode(change))
        await self._wait_applied(offset, deadline)
        return True

    async def change(self, change: entries.Change,
                     as_leader: Callable[[entries.Change], Awaitable[bool]]) -> None:
        """Append a generation change (a drop, GC deletes, a topic seed) as the shard's
        leader, or have the leader append it; returns once applied where it was
        appended. Such changes are safe to append twice (a drop or delete of what is
        gone is only recorded, a seed is set again), so a change that may or may not
        have landed is sent again, to the next leader, until `write_timeout`.
        `as_leader` appends it when this site leads (`DatabaseReplication.propose`:
        `propose` here, after telling a drop to the sites that read the shard here)."""
        deadline = time.monotonic() + self._settings.write_timeout
        while True:
            placement = self.placement
            changed = self._placement_changed
            try:
                if await as_leader(change):
                    return
                if placement is not None and placement.leader != self._settings.site \
                        and placement.leader in self.peers:
                    await self._client.change(self.peers[placement.leader],
                                              self.database.name, self.shard_id,
                                              entries.encode(change), self._remaining(deadline))
                    return
            except (PeerError, NotLeaderError) as exc:
                if self._remaining(deadline) <= 0:
                    raise
                log.info("%s: a generation change goes to the shard's next leader: %s",
                         self._label, exc.message)
            try:
                await asyncio.wait_for(changed.wait(),
                                       min(RETRY_INTERVAL, self._remaining(deadline)))
            except TimeoutError:
                if self._remaining(deadline) <= 0:
                    raise StorageTimeoutError(
                        f"{self._label}: no leader took the change within "
                        f"{self._settings.write_timeout}s") from None

    async def add_generation(self) -> bool:
        if self.leadership is None:
            return False
        shard = self.database.shards[self.shard_id]
        # after every timestamp this leader has handed out
        at = max(now_us(), shard.last_timestamp + 1)
        return await self.propose(entries.AddGeneration(at, shard.topic_seed))

    async def _append(self, raw: bytes) -> int:
        """Append one entry as leader; its offset."""
        leadership = self.leadership
        if leadership is None or not leadership.current:
            raise NotLeaderError(f"{self._label}: this site does not lead the shard")
        try:
            async with self._log_lock:
                positions = await self._run(self.log.append_as_leader, leadership.epoch, [raw])
        except StaleEpochError as exc:
            self._step_down(str(exc))
            raise NotLeaderError(f"{self._label}: {exc.message}") from exc
        offset = positions[0].offset
        self._last_own = offset
        if self.leadership is leadership:
            self._advance()
            for event in self._send_now.values():
                event.set()
        return offset

    async def _wait_applied(self, offset: int, deadline: float) -> None:
        if offset <= self.applied:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._applied_waiters.setdefault(offset, []).append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._remaining(deadline))
        except TimeoutError:
            raise StorageTimeoutError(
                f"{self._label}: entry {offset} not committed within "
                f"{self._settings.write_timeout}s (no majority of replicas reached)") from None
        finally:
            # given up on: a step-down must not fail it with nobody left to hear it
            # (asyncio would log "Future exception was never retrieved")
            if not waiter.done():
                waiter.cancel()

    async def _forward(self, leader: str, messages: list[Message],
                       record_puts: list[tuple[bytes, bytes]], record_deletes: list[bytes],
                       deadline: float, fences: list[Fence]) -> None:
        body = encode_submit(messages, record_puts, record_deletes, fences)
        await self._client.submit(self.peers[leader], self.database.name, self.shard_id, body,
                                  self._remaining(deadline))

    async def submit_forwarded(self, messages: list[Message],
                               record_puts: list[tuple[bytes, bytes]],
                               record_deletes: list[bytes],
                               fences: list[Fence] | None = None) -> None:
        """A write another site forwarded to this site as the shard's leader."""
        await self.until_leading()
        if self.leadership is None:
            raise NotLeaderError(f"{self._label}: this site does not lead the shard")
        done = self.database.submit_to_shard(self.shard_id, messages, record_puts,
                                             record_deletes, fences)
        await done

    # -- reading ------------------------------------------------------------------

    async def barrier_offset(self) -> int:
        """As the shard's leader: the end of its log once the writes queued in its
        write buffer (forwarded ones among them) have been tried, and once a majority
        confirmed that this site still leads (`confirm_leadership`). A replica that has
        applied that far has every write acknowledged before the call, by this leader
        or any other, and every write whose outcome was still open here decided one
        way or the other."""
        asked = time.monotonic()
        deadline = asked + self._settings.write_timeout
        await self.until_leading()
        leadership = self.leadership
        if leadership is None or not leadership.current:
            raise NotLeaderError(f"{self._label}: this site does not lead the shard")
        await self.database.drain_shard(self.shard_id)
        if self.leadership is not leadership or not leadership.current:
            raise NotLeaderError(f"{self._label}: this site stopped leading the shard")
        await self.confirm_leadership(asked, deadline)
        return self.log.last.offset

    async def confirm_leadership(self, since: float, deadline: float) -> None:
        """Return once a majority of the replica set answered this leader requests
        sent at `since` (monotonic) or later (`Leadership.confirmed_since`): the
        followers are sent a heartbeat at once. A leader cut off from its peers takes
        itself for the leader until a placement tells it otherwise, while the
        controller may have named another that took writes: its own copy must not
        answer a read then. NotLeaderError when it stops leading meanwhile,
        StorageTimeoutError when no majority answers by `deadline`."""
        for event in self._send_now.values():
            event.set()  # a request in flight now is sent again once answered
        leadership = self.leadership
        while leadership is not None and leadership.current \
                and not leadership.confirmed_since(since):
            answered = self._answered
            try:
                await asyncio.wait_for(answered.wait(), self._remaining(deadline))
            except TimeoutError:
                raise StorageTimeoutError(
                    f"{self._label}: no majority of replicas confirmed within "
                    f"{self._settings.write_timeout}s that this site still leads the "
                    f"shard; it answers no read") from None
            leadership = self.leadership  # a changed replica set replaces it
        if leadership is None or not leadership.current:
            raise NotLeaderError(f"{self._label}: this site stopped leading the shard")

    async def read_barrier(self) -> None:
        """Return once this replica has applied everything its leader had appended
        when asked, so that a read here sees every committed write (a replica may lag
        its leader; a site may restart behind it). StorageTimeoutError when that does
        not happen within `write_timeout`: the reader must not guess then."""
        deadline = time.monotonic() + self._settings.write_timeout
        while True:
            placement = self.placement
            changed = self._placement_changed
            if self.leadership is not None:
                target = await self.barrier_offset()
                break
            if placement is not None and placement.leader != self._settings.site \
                    and placement.leader in self.peers:
                try:
                    target = await self._client.barrier(
                        self.peers[placement.leader], self.database.name, self.shard_id,
                        max(0.001, self._remaining(deadline)))
                    break
                except PeerError as exc:
                    # a leader that is gone or stepped down: the next placement names
                    # another; try again until the deadline
                    log.debug("%s: read barrier: %s", self._label, exc.message)
            if self._remaining(deadline) <= 0:
                raise StorageTimeoutError(f"{self._label}: no leader answered a read barrier "
                                          f"within {self._settings.write_timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(),
                                       min(RETRY_INTERVAL, self._remaining(deadline)))
        try:
            await self._wait_applied(target, deadline)
        except StorageTimeoutError:
            raise StorageTimeoutError(
                f"{self._label}: a read barrier: this replica did not apply up to offset "
                f"{target} within {self._settings.write_timeout}s") from None

    async def read_records(self, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """The shard's records under `prefix` (the first `limit` after `after`), every
        committed write included: read here past a read barrier when this site holds
        a replica, else at the leader (this site's copy of a shard it does not
        replicate is not kept up)."""
        placement = self.placement
        if self.leadership is not None or (
                placement is not None and self._settings.site in placement.replicas):
            await self.read_barrier()
            shard = self.database.shards[self.shard_id]
            if limit is None and after is None:
                return await self._run(shard.scan_records, prefix)
            return await self._run(shard.scan_records, prefix,
                                   SCAN_ALL if limit is None else limit, after)
        deadline = time.monotonic() + self._settings.write_timeout
        while True:
            placement = self.placement
            changed = self._placement_changed
            if placement is not None and placement.leader in self.peers:
                try:
                    return await self._client.read_records(
                        self.peers[placement.leader], self.database.name, self.shard_id,
                        prefix, max(0.001, self._remaining(deadline)), limit, after)
                except PeerError as exc:
                    log.debug("%s: reading records at the leader: %s", self._label,
                              exc.message)
            if self._remaining(deadline) <= 0:
                raise StorageTimeoutError(f"{self._label}: records not read at the shard's "
                                          f"leader within {self._settings.write_timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(),
                                       min(RETRY_INTERVAL, self._remaining(deadline)))

    async def read_records_for_peer(self, prefix: bytes, limit: int | None = None,
                                    after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """`read_records` asked by a site that holds no replica: only a replica
        answers (no request goes on from here)."""
        placement = self.placement
        if self.leadership is None and (placement is None
                                        or self._settings.site not in placement.replicas):
            raise NotLeaderError(f"{self._label}: this site holds no replica of the shard")
        return await self.read_records(prefix, limit, after)

    def _remaining(self, deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    # -- the leader's senders -------------------------------------------------------

    def _start_senders(self) -> None:
        leadership = self.leadership
        assert leadership is not None
        for follower in leadership.replica_set:
            if follower == leadership.site:
                continue
            self._send_now[follower] = asyncio.Event()
            self._send_now[follower].set()
            self._senders[follower] = asyncio.create_task(
                self._send_loop(leadership, follower),
                name=f"ds-send-{self._label}-{follower}")

    def _stop_senders(self) -> None:
        for task in self._senders.values():
            task.cancel()
        self._senders.clear()
        self._send_now.clear()

    async def _send_loop(self, leadership: Leadership, follower: str) -> None:
        told_committed = -1
        wake = self._send_now[follower]
        while self.leadership is leadership and leadership.current:
            behind = leadership.next_offset.get(follower, 0) <= self.log.last.offset
            if not behind and told_committed >= leadership.committed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self._settings.heartbeat_interval)
            wake.clear()
            if self.leadership is not leadership:
                return
            address = self.peers.get(follower)
            if address is None:
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            try:
                if should_bootstrap(leadership.next_offset.get(follower, 0),
                                    self.log.first_offset, self.log.last.offset,
                                    self._settings.log_retain_entries):
                    raise BootstrapNeededError(f"{follower} holds nothing of a log of "
                                               f"{self.log.last.offset} entries",
                                               self.log.first_offset)
                request = await self._run(leadership.request_for, follower)
                sent = time.monotonic()
                result = await self._client.append(address, self.database.name,
                                                   self.shard_id, request)
            except BootstrapNeededError as exc:
                await self._bootstrap_follower(leadership, follower, address, exc.message)
                continue
            except StaleEpochError as exc:
                if self.leadership is leadership:
                    self._step_down(f"{follower} knows a newer leader: {exc.message}")
                return
            except (PeerError, LogGapError) as exc:
                log.debug("%s: append to %s failed: %s", self._label, follower, exc)
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            if self.leadership is not leadership:
                return
            leadership.heard_from(follower, time.monotonic())
            leadership.confirmed_by(follower, sent)
            self._answered.set()
            self._answered = asyncio.Event()
            told_committed = request.committed
            before = leadership.committed
            leadership.on_result(follower, result)
            if leadership.committed != before:
                self._committed_moved.set()
                for event in self._send_now.values():
                    event.set()

    async def _bootstrap_follower(self, leadership: Leadership, follower: str, address: str,
                                  why: str) -> None:
        """Have `follower` install a checkpoint of this leader's shard; it reads the
        log from where the checkpoint was taken on."""
        own = self.peers.get(self._settings.site)
        if own is None:
            log.warning("%s: cannot bootstrap %s (%s): this site's peer address is "
                        "unknown", self._label, follower, why)
            await asyncio.sleep(RETRY_INTERVAL)
            return
        log.info("%s: %s bootstraps from a checkpoint: %s", self._label, follower, why)
        try:
            position = await request_bootstrap(self._client.session, address,
                                               self.database.name, self.shard_id, own,
                                               leadership.epoch)
        except StaleEpochError as exc:
            if self.leadership is leadership:
                self._step_down(f"{follower} knows a newer leader: {exc.message}")
            return
        except PeerError as exc:
            log.warning("%s: bootstrap of %s failed (tried again): %s", self._label,
                        follower, exc.message)
            await asyncio.sleep(RETRY_INTERVAL)
            return
        if self.leadership is leadership:
            leadership.heard_from(follower, time.monotonic())
            log.info("%s: %s bootstrapped up to offset %d", self._label, follower,
                     position.offset)
            leadership.next_offset[follower] = position.offset + 1

    async def bootstrap_from(self, address: str, epoch: int) -> Position:
        """As a follower: install a checkpoint of the shard from its leader of `epoch`
        at `address` (asked by that leader); the position this log then ends at. One
        bootstrap at a time: a repeated ask waits for the one under way.
        StaleEpochError when this log has seen a newer epoch (checked again, under the
        log lock, before the checkpoint goes in), BootstrapRefusedError when the
        checkpoint was taken below what this replica applied."""
        await self.check_bootstrap_epoch(epoch)
        task = self._bootstrap_task
        if task is None or task.done():
            task = asyncio.create_task(self._bootstrap(address, epoch),
                                       name=f"ds-bootstrap-{self._label}")
            self._bootstrap_task = task
        return await asyncio.shield(task)

    async def check_bootstrap_epoch(self, epoch: int) -> None:
        """Take a bootstrap request of the leader of `epoch` as an append of it would
        be taken (from now on older leaders are refused); StaleEpochError, counted and
        logged, when this log has seen a newer one."""
        async with self._log_lock:
            try:
                await self._run(self.log.observe_epoch, epoch)
            except StaleEpochError as exc:
                self._refuse_bootstrap(exc)
                raise

    def _refuse_bootstrap(self, error: StorageError) -> None:
        if isinstance(error, StaleEpochError):
            self._bootstraps_refused.inc()
        else:
            self._cuts_refused.inc()
        log.error("%s: bootstrap refused: %s", self._label, error.message)

    async def _bootstrap(self, address: str, epoch: int) -> Position:
        if self.leadership is not None:
            raise NotLeaderError(f"{self._label}: this site leads the shard")
        progress = self.bootstrap_progress = Progress(address)
        shard_path = self.database.shards[self.shard_id].path
        log.info("%s: bootstrapping from a checkpoint at %s (epoch %d)", self._label,
                 address, epoch)
        try:
            position = await fetch_checkpoint(self._client.session, address,
                                              self.database.name, self.shard_id, shard_path,
                                              progress, self._executor)

            def check() -> None:
                # under the apply and log locks: nothing moves the epoch or the
                # applied offset between this check and the swap
                if epoch < self.log.epoch:
                    raise StaleEpochError(f"the bootstrap of epoch {epoch} was overtaken "
                                          f"by epoch {self.log.epoch}")
                check_install(position, self.applied)

            await self._install(shard_path, check)
        finally:
            self.bootstrap_progress = None
        self.bootstraps += 1
        log.info("%s: bootstrapped from %s at offset %d, epoch %d: %d bytes in %d files "
                 "in %.1fs", self._label, address, position.offset, position.epoch,
                 progress.bytes_done, progress.files, progress.as_dict()["seconds"])
        self._committed_moved.set()
        return self.log.last

    async def _install(self, shard_path: Path, check: Callable[[], None] | None = None
                       ) -> None:
        """Put the staged shard folder in place of the shard's and reset the log to
        its marker's position, with the applier paused. `check` runs first under the
        same locks; when it raises StorageError the staged folder is dropped (and the
        refusal counted and logged) instead. Not cancelled halfway: a stopping site
        waits for it (`close`), so the shard is not closed under it."""
        async def install() -> None:
            async with self._apply_lock, self._log_lock:
                if check is not None:
                    try:
                        check()
                    except StorageError as exc:
                        self._refuse_bootstrap(exc)
                        await self._run(remove_staged, shard_path)
                        raise
                await self.database.replace_shard(self.shard_id)
                await self._run(finish_install, shard_path, self.log)

        self._installing = asyncio.create_task(install(), name=f"ds-install-{self._label}")
        await asyncio.shield(self._installing)

    def _advance(self) -> None:
        leadership = self.leadership
        if leadership is not None:
            before = leadership.committed
            leadership.advance()
            if leadership.committed != before:
                self._committed_moved.set()

    # -- applying ---------------------------------------------------------------------

    async def _apply_loop(self) -> None:
        while not self._closed:
            if self.applied >= self.log.committed:
                self._committed_moved.clear()
                if self.applied >= self.log.committed:
                    await self._committed_moved.wait()
                continue
            try:
                await self._apply_some()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed write: try again, in order, after a pause
                log.exception("%s: applying committed entries failed", self._label)
                await asyncio.sleep(RETRY_INTERVAL)

    async def _apply_some(self) -> None:
        async with self._apply_lock:
            start = self.applied + 1
            # Read with the commit offset of that moment, under the log lock: a new
            # leader's append may replace uncommitted entries right after, and the
            # commit offset may then cover the replacements (the log never cuts
            # committed entries, so those read at or below it stay as read).
            async with self._log_lock:
                committed = self.log.committed
                found = await self._run(self.log.read, start, APPLY_BATCH)
            for entry in found:
                offset = entry.position.offset
                if offset > committed or offset != self.applied + 1:
                    break
                await self._apply(offset, entries.decode(entry.batch))
                self._wake_writers()
        await self._trim()

    async def _trim(self) -> None:
        """Forget log entries no replica needs any more, keeping the configured tail
        (see `trim.py`); the leader tells its followers with each append. Never past
        what this site's shard holds durably: without `sync_writes` its applied offset
        may be ahead of what a power loss leaves (the log's own writes are synced),
        and a replica that comes back applied below its log's start can never apply
        the entries in between. So the shard's log is synced before a trim."""
        if self._trim_point(self.applied) - self.log.first_offset < TRIM_STEP:
            return
        async with self._apply_lock:  # not while a checkpoint replaces the shard
            durable = await self._run(self.database.shards[self.shard_id].sync_applied)
        point = self._trim_point(durable)
        if point - self.log.first_offset < TRIM_STEP:
            return
        async with self._log_lock:
            await self._run(self.log.trim_before, point, TRIM_BATCH)

    def _trim_point(self, applied: int) -> int:
        """Where this site's log may be trimmed, this site having applied `applied`
        (the leader also tells its followers so)."""
        leadership = self.leadership
        if leadership is not None:
            point = leader_trim_point(leadership.site, leadership.replica_set,
                                      leadership.matched, applied,
                                      self._settings.log_retain_entries)
            leadership.trim_before = point
            return point
        return follower_trim_point(self.log.leader_trims_before, applied)

    async def _apply(self, offset: int, change: entries.Change) -> None:
        database = self.database
        if isinstance(change, bytes):
            cooked = self._own.pop(offset, None) or CookedBatch.from_bytes(change)
            await database.apply_batch(self.shard_id, cooked, offset)
        elif isinstance(change, entries.AddGeneration):
            await database.apply_add_generation(self.shard_id, change.at, change.seed, offset)
        elif isinstance(change, entries.DropGeneration):
            await database.apply_drop_generation(self.shard_id, change.generation, offset)
        elif isinstance(change, entries.GcWrite):
            await database.apply_gc_write(self.shard_id, change.generation,
                                          list(change.deletes), list(change.record_puts),
                                          offset)
        elif isinstance(change, entries.SetTopicSeed):
            await database.apply_topic_seed(self.shard_id, change.patterns, offset)
        else:
            await database.apply_noop(self.shard_id, offset)

    def _wake_writers(self) -> None:
        applied = self.applied
        for offset in [offset for offset in self._applied_waiters if offset <= applied]:
            for waiter in self._applied_waiters.pop(offset):
                if not waiter.done():
                    waiter.set_result(None)
        self._tell_leading()

    def _tell_leading(self) -> None:
        if self._tell_leading_at is None or self.applied < self._tell_leading_at:
            return
        self._tell_leading_at = None
        if self.leadership is not None:
            for listener in self._leading_listeners:
                listener()

    # -- helpers ----------------------------------------------------------------------

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def close(self) -> None:
        self._closed = True
        self._step_down("the site is stopping")
        for task in (self._bootstrap_task, self._dropping, self._starting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._installing is not None:
            with contextlib.suppress(Exception):
                await self._installing
        self._applier.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._applier
