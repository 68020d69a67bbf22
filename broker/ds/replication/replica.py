"""One shard of a database on one site: its log, its role under the placement, and
the loops of that role (docs/replication.md, "In a running site").

`ShardReplica` takes the placement and holds the role: it takes over as the leader
(`takeover`), begins and stops leading, and drops its data when this site leaves the
replica set. Its parts, built with it, do the rest:

- `writes`: the leader appends each flush of the shard's write buffer to its log as a
  cooked batch and answers the writers once the entry is committed and applied; a
  site that does not lead the shard forwards its writes to the leader's peer port.
- `senders`: the leader ships the log to every follower (one sender task each,
  heartbeats when idle) and has a follower that lacks trimmed entries bootstrap.
- `applier`: every replica applies committed log entries to the shard's data in log
  order, and trims its log.
- `reads`: read barriers and the reads of the shard's records.
- `installer`: a leader's checkpoint (or an empty shard) in place of this site's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from ...errors import StorageError
from .. import metrics
from ..fence import Fence
from ..message import Message
from . import entries
from .applier import Applier
from .bootstrap import Progress
from .installer import Installer
from .leader import Leadership
from .log import Position, StaleEpochError
from .placement import ShardPlacement
from .reads import Reads
from .replica_context import (
    RETRY_INTERVAL,
    NotLeaderError,
    ReplicaContext,
    remaining,
)
from .senders import Senders
from .takeover import Takeover
from .writes import Writes

log = logging.getLogger(__name__)

Role = Literal["leader", "follower", "none"]


class ShardReplica:
    """One shard's role on this site, and the face its callers see
    (`site_replication`, the peer port's handlers): past ~300 lines only by that
    face, the writes, reads and bootstraps asked of the shard passed on, a line
    each, to the part that does them, so that a caller holds one object a shard."""

    def __init__(self, context: ReplicaContext) -> None:
        self.shard_set = context.shard_set
        self.shard_id = context.shard_id
        self.log = context.log
        self._context = context
        self._settings = context.settings
        self._label = context.label
        self.placement: ShardPlacement | None = None
        self.peers: dict[str, str] = {}
        self.leadership: Leadership | None = None
        self._role_changed = asyncio.Event()
        self._closed = False
        self._dropping: asyncio.Task[None] | None = None
        self._starting: asyncio.Task[None] | None = None  # a takeover (see _take_lead)
        self._starting_since = 0.0  # when that takeover began (monotonic)
        self._leading_listeners: list[Callable[[], None]] = []
        # Leading listeners are told once this offset (committed when this site began
        # to lead, inherited entries included) is applied.
        self._tell_leading_at: int | None = None
        self._applier = Applier(context, self, self._tell_leading)
        self._senders = Senders(context, self, self._applier.committed_moved,
                                lambda: self._writes.append_coming)
        self._writes = Writes(context, self, self._applier, self._appended, self._synced)
        self._reads = Reads(context, self, self._senders, self._applier)
        self._takeover = Takeover(context, self)
        self._installer = Installer(context, self, self._applier)
        labels = (context.shard_set.name, str(context.shard_id))
        metrics.REPLICA_LAG.labels(*labels).set_function(
            lambda: max(0, self.log.last.offset - self.applied))
        metrics.UNDER_REPLICATED.labels(*labels).set_function(self._under_replicated)
        metrics.REPLICA_ROLE.labels(*labels).set_function(
            lambda: 1 if self.leadership is not None else 0)
        metrics.QUORUM_AGE.labels(*labels).set_function(lambda: self.quorum_age() or 0.0)
        self._leader_changes = metrics.LEADER_CHANGES.labels(*labels)

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
        return self._applier.applied

    @property
    def role_changed(self) -> asyncio.Event:
        """Set (and replaced) when the placement or this site's leadership changes:
        a waiter takes it before it looks at the role."""
        return self._role_changed

    @property
    def bootstrap_progress(self) -> Progress | None:
        return self._installer.progress

    @property
    def bootstraps(self) -> int:
        """Checkpoints installed here since the site started."""
        return self._installer.bootstraps

    @property
    def catching_up(self) -> bool:
        """A replica that, since this site started, neither leads the shard (a
        takeover still waiting for a majority counts as not leading) nor was brought
        by a leader's append up to that leader's commit offset (`ShardLog.caught_up`)."""
        return self.role == "follower" and not self.log.caught_up

    def status(self) -> dict[str, object]:
        last = self.log.last
        progress = self.bootstrap_progress
        return {"db": self.shard_set.name, "shard": self.shard_id, "role": self.role,
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
        self._applier.committed_moved()

    # -- taking a placement -------------------------------------------------------

    async def take(self, placement: ShardPlacement, peers: dict[str, str]) -> None:
        """Take this site's role in the shard under a new placement."""
        site = self._settings.site
        self.peers = dict(peers)
        previous, self.placement = self.placement, placement
        if placement.epoch > self.log.epoch:
            async with self._context.log_lock:
                # a newer leader's append may have got in first: nothing to observe then
                with contextlib.suppress(StaleEpochError):
                    await self._context.run(self.log.observe_epoch, placement.epoch)
        leading = self.leadership
        if leading is not None and (placement.leader != site or placement.epoch != leading.epoch
                                    or not leading.current):
            self.step_down(f"placement names {placement.leader} at epoch {placement.epoch}")
        if placement.leader == site and placement.epoch >= self.log.epoch:
            if self.leadership is None:
                self._start_leading()
            elif previous is None or previous.replicas != placement.replicas:
                self._change_replica_set(placement)
        self._tell_role_changed()
        if previous is not None and site in previous.replicas \
                and site not in placement.replicas:
            self._dropping = asyncio.create_task(self._drop_data(),
                                                 name=f"ds-drop-{self._label}")

    async def _drop_data(self) -> None:
        """This site left the shard's replica set: its copy of the shard and its log
        go (an empty shard takes their place, installed like a checkpoint). A site
        that joins again later bootstraps from its leader."""
        def still_left() -> bool:
            placement = self.placement
            return placement is not None and self._settings.site not in placement.replicas

        if not still_left():
            return  # joined again meanwhile
        if await self._installer.install_empty(still_left):
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
        epoch = None
        while not self._closed:
            placement = self.placement
            if placement is None or placement.leader != site or self.leadership is not None \
                    or placement.epoch < self.log.epoch:
                return  # replaced meanwhile
            if placement.epoch != epoch:
                # a takeover of another epoch than the one tried so far: counted from now
                # in `quorum_age`, or the controller takes the new one for stuck too
                epoch, self._starting_since = placement.epoch, time.monotonic()
            try:
                await self._takeover.take_over(placement)
            except StaleEpochError as exc:
                # A newer leader exists: the controller's next push names it, which may
                # be this site again at a newer epoch while this task still runs (the
                # push then starts no other): looked at again after a pause.
                log.warning("%s: not leading epoch %d: %s", self._label, placement.epoch,
                            exc.message)
                await asyncio.sleep(RETRY_INTERVAL)
                continue
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
                and not self._starting.done() and remaining(deadline) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._role_changed.wait(), remaining(deadline))

    async def _begin(self, placement: ShardPlacement) -> None:
        site = self._settings.site
        async with self._context.log_lock:
            try:
                leadership = await self._context.run(
                    Leadership.begin, site, placement.epoch, self.log, placement.replicas,
                    self.log.committed, time.monotonic())
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
        self._senders.start(leadership)
        current = self.placement
        if current is not None and current.leader == site and current.epoch == leadership.epoch \
                and current.replicas != leadership.replica_set:
            # a new replica set pushed while this site took the lead (`take` found no
            # leadership to change then): lead that one
            self._change_replica_set(current)
        self._tell_leading_at = self.log.committed
        self._tell_leading()
        # writers waiting for this site to lead go on
        self._tell_role_changed()
        try:
            await self._writes.open_epoch()
        except (StaleEpochError, NotLeaderError) as exc:
            self.step_down(exc.message)  # the append has stepped down already, if it raised

    def _change_replica_set(self, placement: ShardPlacement) -> None:
        leading = self.leadership
        assert leading is not None
        start = self.log.last.offset + 1
        followers = [site for site in placement.replicas if site != leading.site]
        now = time.monotonic()
        self.leadership = leadership = Leadership(
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
        self._senders.stop()
        self._senders.start(leadership)
        self._advance()

    def _appended(self) -> None:
        """An entry went into this leader's log: the followers get it now."""
        self._advance()
        self._senders.appended()

    def _synced(self) -> None:
        """This leader's own copy of its entries is on disk: it counts towards their
        commit, which the followers learn too (the commit may have waited for it), and
        the entries committed without it may be applied now."""
        if self._advance():
            self._senders.tell_commit()
        else:
            self._applier.committed_moved()

    def _advance(self) -> bool:
        """Recount the commit offset; whether it moved."""
        leadership = self.leadership
        if leadership is not None:
            before = leadership.committed
            leadership.advance()
            if leadership.committed != before:
                self._applier.committed_moved()
                return True
        return False

    def step_down_for_newer_epoch(self) -> None:
        """An append of a newer leader reached this site's log."""
        self.step_down(f"an append of epoch {self.log.epoch} arrived")

    def step_down(self, why: str) -> None:
        """Stop leading the shard (a newer leader exists, or the site stops)."""
        if self.leadership is None:
            return
        log.warning("%s: stops leading epoch %d: %s", self._label, self.leadership.epoch, why)
        self.leadership = None
        self._leader_changes.inc()
        self._tell_leading_at = None
        self._senders.stop()
        self._writes.stopped_leading(why)
        self._tell_role_changed()
        self._senders.tell_answered()  # a read waiting for this leadership's confirmation fails

    def _tell_role_changed(self) -> None:
        self._role_changed.set()
        self._role_changed = asyncio.Event()

    def _tell_leading(self) -> None:
        """Tell the leading listeners, once what was committed when this site began to
        lead is applied."""
        if self._tell_leading_at is None or self.applied < self._tell_leading_at:
            return
        self._tell_leading_at = None
        if self.leadership is not None:
            for listener in self._leading_listeners:
                listener()

    # -- writes (`writes.py`), reads (`reads.py`), bootstraps (`installer.py`) ---------

    async def write(self, messages: list[Message], record_puts: list[tuple[bytes, bytes]],
                    record_deletes: list[bytes], fences: list[Fence] | None = None,
                    forwarded: bool = False) -> None:
        await self._writes.write(messages, record_puts, record_deletes, fences, forwarded)

    async def submit_forwarded(self, messages: list[Message],
                               record_puts: list[tuple[bytes, bytes]],
                               record_deletes: list[bytes],
                               fences: list[Fence] | None = None) -> None:
        await self._writes.submit_forwarded(messages, record_puts, record_deletes, fences)

    async def propose(self, change: entries.Change) -> bool:
        return await self._writes.propose(change)

    async def change(self, change: entries.Change,
                     as_leader: Callable[[entries.Change], Awaitable[bool]]) -> None:
        await self._writes.change(change, as_leader)

    async def add_generation(self) -> bool:
        return await self._writes.add_generation()

    async def barrier_offset(self) -> int:
        return await self._reads.barrier_offset()

    async def read_barrier(self) -> None:
        await self._reads.read_barrier()

    async def read_records(self, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        return await self._reads.read_records(prefix, limit, after)

    async def read_records_for_peer(self, prefix: bytes, limit: int | None = None,
                                    after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        return await self._reads.read_records_for_peer(prefix, limit, after)

    async def bootstrap_from(self, address: str, epoch: int) -> Position:
        return await self._installer.bootstrap_from(address, epoch)

    async def check_bootstrap_epoch(self, epoch: int) -> None:
        await self._installer.check_bootstrap_epoch(epoch)

    async def close(self) -> None:
        self._closed = True
        self._applier.stop()  # as before the split: no batch applied once closing began
        self.step_down("the site is stopping")
        for task in (self._dropping, self._starting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._installer.close()
        await self._applier.close()
