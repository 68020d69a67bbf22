"""The backend of one replicated database (`backend.Backend`): the replicas of its
shards on this site. A flush of a shard's write buffer is committed through the
shard's log (here as its leader, or forwarded to it), and comes back to this site's
copy through the database's `LogStateMachine`, in log order, with every other
committed entry; generation changes go through the log too. The first database
(`messages`, whose streams subscribers read) reads the shards this site holds no
replica of at a replica elsewhere (`RemoteReads`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..backend import make_buffers
from ..buffer import Flush
from ..fence import Fence
from ..generation import RetentionPlan
from ..iterator import EndOfStream, Iterator, Stream
from ..message import Message
from ..shard_set import NextResult, ShardSet
from ..streams import GenerationView
from . import entries
from .log import ShardLog
from .remote import RemoteReads
from .replica import ShardReplica
from .replica_context import ReplicaContext, ReplicaSettings
from .state_machine import LogStateMachine

if TYPE_CHECKING:  # the site builds its databases' backends, which call back into it
    from .site_replication import SiteReplication


class ReplicatedBackend:
    """The site's `SiteReplication` owns the peer port and the placement, and builds
    this with the shard logs it opened; `remote_reads` for the first database."""

    replicated = True

    def __init__(self, site: SiteReplication, shard_set: ShardSet, logs: list[ShardLog],
                 settings: ReplicaSettings, remote_reads: bool) -> None:
        self._site = site
        self.shard_set = shard_set
        self.logs = logs
        self.remote = RemoteReads(site.site, shard_set, self.placement_of, lambda: site.kept.peers,
                                  self._barrier, site.peer_session, site.peer_timeout) \
            if remote_reads else None
        self.state_machine = LogStateMachine(shard_set, self.reads_elsewhere)
        self.buffers = make_buffers(shard_set, self._flush_of, abandon_behind_failure=True)
        self.replicas = [
            ShardReplica(ReplicaContext(shard_set, self.buffers[shard], self.state_machine,
                                        shard, shard_log, site.log_lock(shard_set.name, shard),
                                        site.executor, site.client, settings))
            for shard, shard_log in enumerate(logs)]

    def _flush_of(self, shard_id: int) -> Flush:
        return functools.partial(self.write, shard_id)

    async def write(self, shard_id: int, messages: list[Message],
                    record_puts: list[tuple[bytes, bytes]], record_deletes: list[bytes],
                    fences: list[Fence], forwarded: bool = False) -> None:
        """Commit one flush of a shard's write buffer; returns once applied here.
        FencedError (nothing written) when the shard's leader finds a fence that
        does not hold."""
        await self.replicas[shard_id].write(messages, record_puts, record_deletes, fences,
                                            forwarded)

    async def _barrier(self, shard_id: int) -> None:
        await self.replicas[shard_id].read_barrier()

    # -- reads ----------------------------------------------------------------------

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        placement = self.replicas[shard_id].placement
        return ((), "") if placement is None else (placement.replicas, placement.leader)

    def _elsewhere(self, shard_id: int) -> RemoteReads | None:
        """The reads at a replica elsewhere when this site reads the shard there;
        None when it reads its own copy."""
        if self.remote is not None and self.remote.is_remote(shard_id):
            return self.remote
        return None

    def reads_elsewhere(self, shard_id: int) -> bool:
        return self._elsewhere(shard_id) is not None

    def generations_of(self, shard_id: int) -> Mapping[int, GenerationView]:
        remote = self._elsewhere(shard_id)
        if remote is not None:
            return remote.generations(shard_id)
        return self.shard_set.shards[shard_id].generations

    def generations_known(self, shard_id: int) -> bool:
        remote = self._elsewhere(shard_id)
        return remote is None or remote.loaded(shard_id)

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        remote = self._elsewhere(iterator.stream.shard)
        if remote is not None:
            return await remote.next(iterator, batch_size)
        return await self.shard_set.next(iterator, batch_size)

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        """A replica here that has not applied that far yet (a session handed the
        message out at a site whose copy is ahead) reads it elsewhere: its absence
        here would look like a drop by retention."""
        shard = self.shard_set.shards[stream.shard]
        if self.remote is not None and (self.remote.is_remote(stream.shard)
                                        or shard.last_timestamp < timestamp):
            return await self.remote.read_message(stream, timestamp)
        return await self.shard_set.read_message(stream, timestamp)

    async def read_records(self, shard_id: int, prefix: bytes, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """Read here past a read barrier, or at a replica of the shard elsewhere."""
        return await self.replicas[shard_id].read_records(prefix, limit, after)

    async def get_records(self, shard_id: int, keys: list[bytes]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self._get_record(shard_id, key) for key in keys)))

    async def _get_record(self, shard_id: int, key: bytes) -> bytes | None:
        # a key sorts first among the keys it is a prefix of
        found = await self.read_records(shard_id, key, 1)
        return found[0][1] if found and found[0][0] == key else None

    # -- generation changes, through each shard's log ---------------------------------

    async def add_generation(self, shard_id: int) -> bool:
        return await self.replicas[shard_id].add_generation()

    async def drop_generation(self, shard_id: int, generation_id: int) -> None:
        await self._change(shard_id, entries.DropGeneration(generation_id))

    async def gc_write(self, shard_id: int, generation_id: int, deletes: list[bytes],
                       record_puts: list[tuple[bytes, bytes]]) -> None:
        await self._change(shard_id,
                           entries.GcWrite(generation_id, tuple(deletes), tuple(record_puts)))

    async def set_topic_seed(self, shard_id: int, patterns: tuple[str, ...]) -> None:
        await self._change(shard_id, entries.SetTopicSeed(patterns))

    async def retain(self, plans: list[RetentionPlan]) -> tuple[bool, int]:
        """Each shard's leader changes its generations through the shard's log; the
        other replicas follow it there."""
        added = False
        dropped = 0
        for shard_id, plan in enumerate(plans):
            if plan.add_generation:
                added |= await self.add_generation(shard_id)
            for generation_id in plan.drop:
                dropped += await self.propose(shard_id, entries.DropGeneration(generation_id))
        return added, dropped

    async def _change(self, shard_id: int, change: entries.Change) -> None:
        """Append a generation change here as the leader (`propose`), or at the leader."""
        await self.replicas[shard_id].change(change, functools.partial(self.propose, shard_id))

    async def propose(self, shard_id: int, change: entries.Change) -> bool:
        """Append a generation change as the shard's leader (False elsewhere); a drop
        is first told to the sites that read the shard here without a replica."""
        replica = self.replicas[shard_id]
        if replica.leadership is None:
            return False
        if isinstance(change, entries.DropGeneration) and self.remote is not None:
            await self.remote.before_drop(shard_id, change.generation)
        return await replica.propose(change)

    async def close(self) -> None:
        """Write what the buffers hold, stop this database's replicas' loops and close
        their logs; the peer port stops with the last database of the site."""
        await asyncio.gather(*(buffer.close() for buffer in self.buffers))
        for replica in self.replicas:
            await replica.close()
        loop = asyncio.get_running_loop()
        # From now on the peer port answers appends to these logs "no replica here"
        # (the site stops while a leader still sends); one in flight finishes first.
        logs, self.logs = self.logs, []
        for shard, shard_log in enumerate(logs):
            async with self._site.log_lock(self.shard_set.name, shard):
                await loop.run_in_executor(self._site.executor, shard_log.close)
        await self._site.database_closed(self)
