"""Consistent reads of one shard: a read barrier (here past the leader's confirmed
log end, or asked of the leader), and the shard's records read here or at its
leader (docs/replication.md, "Reads"; docs/peer-protocol.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ...errors import StorageTimeoutError
from .applier import Applier
from .peer import PeerError
from .replica_context import RETRY_INTERVAL, NotLeaderError, ReplicaContext, ReplicaRole, remaining
from .senders import Senders

log = logging.getLogger(__name__)

# A scan's limit when the caller gives none (Shard.scan_records' own).
SCAN_ALL = 1_000_000


class Reads:
    """The reads of one shard replica: its leader confirms its leadership with a
    majority (`senders`) and a replica waits until it applied that far (`applier`)."""

    def __init__(self, context: ReplicaContext, role: ReplicaRole, senders: Senders,
                 applier: Applier) -> None:
        self._context = context
        self._role = role
        self._senders = senders
        self._applier = applier

    async def barrier_offset(self) -> int:
        """As the shard's leader: the end of its log once the writes queued in its
        write buffer (forwarded ones among them) have been tried, and once a majority
        confirmed that this site still leads (`confirm_leadership`). A replica that has
        applied that far has every write acknowledged before the call, by this leader
        or any other, and every write whose outcome was still open here decided one
        way or the other."""
        asked = time.monotonic()
        deadline = asked + self._context.settings.write_timeout
        await self._role.until_leading()
        leadership = self._role.leadership
        if leadership is None or not leadership.current:
            raise NotLeaderError(f"{self._context.label}: this site does not lead the shard")
        await self._context.buffer.drain()
        if self._role.leadership is not leadership or not leadership.current:
            raise NotLeaderError(f"{self._context.label}: this site stopped leading the shard")
        await self.confirm_leadership(asked, deadline)
        return self._context.log.last.offset

    async def confirm_leadership(self, since: float, deadline: float) -> None:
        """Return once a majority of the replica set answered this leader requests
        sent at `since` (monotonic) or later (`Leadership.confirmed_since`): the
        followers are sent a heartbeat at once. A leader cut off from its peers takes
        itself for the leader until a placement tells it otherwise, while the
        controller may have named another that took writes: its own copy must not
        answer a read then. NotLeaderError when it stops leading meanwhile,
        StorageTimeoutError when no majority answers by `deadline`."""
        self._senders.send_now()
        leadership = self._role.leadership
        while leadership is not None and leadership.current \
                and not leadership.confirmed_since(since):
            try:
                await asyncio.wait_for(self._senders.next_answer(), remaining(deadline))
            except TimeoutError:
                raise StorageTimeoutError(
                    f"{self._context.label}: no majority of replicas confirmed within "
                    f"{self._context.settings.write_timeout}s that this site still leads the "
                    f"shard; it answers no read") from None
            leadership = self._role.leadership  # a changed replica set replaces it
        if leadership is None or not leadership.current:
            raise NotLeaderError(f"{self._context.label}: this site stopped leading the shard")

    async def read_barrier(self) -> None:
        """Return once this replica has applied everything its leader had appended
        when asked, so that a read here sees every committed write (a replica may lag
        its leader; a site may restart behind it). StorageTimeoutError when that does
        not happen within `write_timeout`: the reader must not guess then."""
        deadline = time.monotonic() + self._context.settings.write_timeout
        while True:
            placement = self._role.placement
            changed = self._role.role_changed
            if self._role.leadership is not None:
                target = await self.barrier_offset()
                break
            if placement is not None and placement.leader != self._context.settings.site \
                    and placement.leader in self._role.peers:
                try:
                    target = await self._context.client.barrier(
                        self._role.peers[placement.leader], self._context.shard_set.name,
                        self._context.shard_id, max(0.001, remaining(deadline)))
                    break
                except PeerError as exc:
                    # a leader that is gone or stepped down: the next placement names
                    # another; try again until the deadline
                    log.debug("%s: read barrier: %s", self._context.label, exc.message)
            if remaining(deadline) <= 0:
                raise StorageTimeoutError(
                    f"{self._context.label}: no leader answered a read barrier within "
                    f"{self._context.settings.write_timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(RETRY_INTERVAL, remaining(deadline)))
        try:
            await self._applier.wait_applied(target, deadline)
        except StorageTimeoutError:
            raise StorageTimeoutError(
                f"{self._context.label}: a read barrier: this replica did not apply up to offset "
                f"{target} within {self._context.settings.write_timeout}s") from None

    async def read_records(self, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """The shard's records under `prefix` (the first `limit` after `after`), every
        committed write included: read here past a read barrier when this site holds
        a replica, else at the leader (this site's copy of a shard it does not
        replicate is not kept up)."""
        if self._holds_replica():
            await self.read_barrier()
            shard = self._context.shard
            if limit is None and after is None:
                return await self._context.run(shard.scan_records, prefix)
            return await self._context.run(shard.scan_records, prefix,
                                           SCAN_ALL if limit is None else limit, after)
        deadline = time.monotonic() + self._context.settings.write_timeout
        while True:
            placement = self._role.placement
            changed = self._role.role_changed
            if placement is not None and placement.leader in self._role.peers:
                try:
                    return await self._context.client.read_records(
                        self._role.peers[placement.leader], self._context.shard_set.name,
                        self._context.shard_id, prefix, max(0.001, remaining(deadline)), limit,
                        after)
                except PeerError as exc:
                    log.debug("%s: reading records at the leader: %s", self._context.label,
                              exc.message)
            if remaining(deadline) <= 0:
                raise StorageTimeoutError(f"{self._context.label}: records not read at the shard's "
                                          f"leader within {self._context.settings.write_timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(RETRY_INTERVAL, remaining(deadline)))

    async def read_records_for_peer(self, prefix: bytes, limit: int | None = None,
                                    after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """`read_records` asked by a site that holds no replica: only a replica
        answers (no request goes on from here)."""
        if not self._holds_replica():
            raise NotLeaderError(f"{self._context.label}: this site holds no replica of the shard")
        return await self.read_records(prefix, limit, after)

    def _holds_replica(self) -> bool:
        placement = self._role.placement
        return self._role.leadership is not None or (
            placement is not None and self._context.settings.site in placement.replicas)
