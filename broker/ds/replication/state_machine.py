"""The state machine of a replicated database's shard logs: each committed entry
applied to this site's copy of the database (`ShardSet`), in log order, recording
its offset as applied in the same RocksDB write. Every replica applies the same
entries the same way, refusals included, so their copies stay the same."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...errors import GenerationError
from ..cooked import CookedBatch
from ..shard_set import ShardSet
from . import entries

log = logging.getLogger(__name__)


class LogStateMachine:
    """`reads_elsewhere(shard)`: whether this site reads the shard at another site
    (a replica still catching up), whose applied batches then feed only the
    listeners that push them on (see `CommitFeed.add_commit_listener`)."""

    def __init__(self, shard_set: ShardSet, reads_elsewhere: Callable[[int], bool]) -> None:
        self._shards = shard_set
        self._reads_elsewhere = reads_elsewhere

    async def apply(self, shard_id: int, offset: int, change: entries.Change,
                    own: CookedBatch | None) -> None:
        """Apply the entry at `offset`; `own`: this leader's batch at that offset,
        applied from memory as it was cooked (the leader's copy carries the messages)."""
        if isinstance(change, bytes):
            await self.apply_batch(shard_id, own or CookedBatch.from_bytes(change), offset)
        elif isinstance(change, entries.AddGeneration):
            await self._shards.add_generation(shard_id, change.at, change.seed, applied=offset)
        elif isinstance(change, entries.DropGeneration):
            await self.apply_drop_generation(shard_id, change.generation, offset)
        elif isinstance(change, entries.GcWrite):
            await self._shards.gc_write(shard_id, change.generation, list(change.deletes),
                                        list(change.record_puts), applied=offset)
        elif isinstance(change, entries.SetTopicSeed):
            await self._shards.set_topic_seed(shard_id, change.patterns, applied=offset)
        else:
            await self._shards.record_applied(shard_id, offset)

    async def apply_batch(self, shard_id: int, cooked: CookedBatch, offset: int) -> None:
        """Write and apply a committed batch of a shard's log, recording `offset` as
        applied in the same write, then feed it to the commit listeners."""
        await self._shards.write_applied(shard_id, cooked, offset)
        try:
            self._shards.feed.committed(cooked,
                                        read_elsewhere=self._reads_elsewhere(shard_id))
        except Exception:  # a listener's bug must not stop applying
            log.exception("commit listener failed on %s/%d", self._shards.name, shard_id)

    async def apply_drop_generation(self, shard_id: int, generation_id: int,
                                    offset: int) -> None:
        """Drop a generation as a log entry says. One that is not there, or current,
        is refused the same way on every replica: the entry is then only recorded."""
        try:
            await self._shards.drop_generation(shard_id, generation_id, applied=offset)
        except GenerationError as exc:
            log.warning("%s/%d: log entry %d drops no generation: %s", self._shards.name,
                        shard_id, offset, exc)
            await self._shards.record_applied(shard_id, offset)
