"""A takeover: before a site leads a shard at a new epoch, it fences a majority of
the replica set at that epoch and appends the tail of the most advanced of them
(docs/replication.md, "Takeover"; docs/peer-protocol.md, fence and tail); every
replica, when it leads again an epoch it led before it (re)started."""

from __future__ import annotations

import asyncio
import logging

from ...errors import StorageError
from .commit import majority
from .log import Position, StaleEpochError
from .peer import PeerError
from .placement import ShardPlacement
from .replica_context import ReplicaContext, ReplicaRole

log = logging.getLogger(__name__)


class Takeover:
    """The takeovers of one shard by this site."""

    def __init__(self, context: ReplicaContext, role: ReplicaRole) -> None:
        self._context = context
        self._role = role
        self._log = context.log

    async def take_over(self, placement: ShardPlacement) -> None:
        """Before leading at `placement.epoch`: fence a majority of the replica set at
        it (from then on they refuse the old leader's appends) and append the tail of
        the most advanced of them, which holds every committed entry. The controller
        chose this site on positions that may have moved since: the old leader may
        have committed more meanwhile (a planned handover, or a leader only the
        controller lost). Raises StaleEpochError when a replica knows a newer epoch,
        another StorageError when no majority answers or the tail does not come."""
        site = self._context.settings.site
        needed = majority(len(placement.replicas)) - 1  # this site is fenced already
        if placement.epoch <= self._log.epoch_at_open:
            # This site led this epoch before it (re)started. Its own appends of it
            # were shipped while it synced them: a power loss may have taken some
            # that a follower holds, under this very epoch, which no log can tell
            # from the entries it would append in their place. A majority may not
            # include that follower: every replica is fenced, and the furthest tail
            # taken (until they all answer, the shard waits, or the controller fails
            # it over to the others when they are a majority).
            needed = len(placement.replicas) - 1
        if needed <= 0:
            return
        within = self._context.settings.write_timeout
        peers = self._role.peers
        db, shard_id = self._context.shard_set.name, self._context.shard_id
        asking = {asyncio.create_task(self._context.client.fence(
            peers[other], db, shard_id, placement.epoch, within)):
            other for other in placement.replicas if other != site and other in peers}
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
        if end > self._log.last:
            await self._append_tail(placement.epoch, furthest, end)

    async def _append_tail(self, epoch: int, source: str, end: Position) -> None:
        """Append the log of `source` up to `end`, as a follower of it would."""
        start = self._log.last.offset + 1
        before = self._log.last
        while self._log.last < end:
            address = self._role.peers.get(source)
            if address is None:
                raise PeerError(f"{self._context.label}: the address of {source} is not known")
            request = await self._context.client.tail(
                address, self._context.shard_set.name, self._context.shard_id, start,
                self._context.settings.write_timeout)
            async with self._context.log_lock:
                result = await self._context.run(self._log.append_from_leader, epoch,
                                                 request.previous, request.entries,
                                                 request.committed)
            if not result.accepted:
                start = result.retry_from
            elif not request.entries:
                break  # its log ends here
            else:
                start = result.matched + 1
        log.info("%s: taking over at epoch %d: appended %s's tail, %s -> %s", self._context.label,
                 epoch, source, tuple(before), tuple(self._log.last))
