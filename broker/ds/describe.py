"""What a database looks like on this site, for admin views and `ctl`: shards with
their replica set, leader, committed position, disk usage and generations. The one
place outside the engine that looks at shard internals."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .shard import Shard
from .shard_set import ShardSet

# a shard's replica set and leader (`Database.placement_of`)
PlacementOf = Callable[[int], tuple[tuple[str, ...], str]]


@dataclass(frozen=True, slots=True)
class GenerationDescription:
    id: int
    layout: str
    layout_options: dict[str, Any]
    created_at: int
    # [since, until) in µs since the epoch; until is None while current
    since: int
    until: int | None
    current: bool
    bytes: int


@dataclass(frozen=True, slots=True)
class ShardDescription:
    id: int
    replicas: tuple[str, ...]
    leader: str
    # the last timestamp committed in this shard (µs): its position in the log
    committed_timestamp: int
    disk_bytes: int
    generations: tuple[GenerationDescription, ...]


@dataclass(frozen=True, slots=True)
class DbDescription:
    name: str
    site_id: str
    key_value: bool
    n_shards: int
    layout: str
    layout_options: dict[str, Any]
    wildcard_thresholds: tuple[int, ...]
    sync_writes: bool
    message_retention_period: float
    shards: tuple[ShardDescription, ...]

    @property
    def disk_bytes(self) -> int:
        return sum(shard.disk_bytes for shard in self.shards)


async def describe(db: ShardSet, placement_of: PlacementOf) -> DbDescription:
    """The database as this site holds it. Reads file sizes off the event loop.
    On one site, this site is every shard's only replica and its leader; with
    replication, replicas and leader are the placement's."""
    loop = asyncio.get_running_loop()
    shards = []
    for shard in list(db.shards):
        # under the shard's lock, so no generation is dropped while its size is read
        async with db.shard_lock(shard.shard_id):
            shards.append(await loop.run_in_executor(db.executor, _describe_shard, shard,
                                                     placement_of(shard.shard_id)))
    options = db.options
    return DbDescription(db.name, db.site_id, options.key_value, options.n_shards,
                         options.layout, dict(options.layout_options),
                         tuple(options.wildcard_thresholds), options.sync_writes,
                         options.message_retention_period, tuple(shards))


def _describe_shard(shard: Shard, placement: tuple[tuple[str, ...], str]) -> ShardDescription:
    generations = []
    for _id, generation in sorted(shard.generations.items()):
        info = generation.info
        generations.append(GenerationDescription(
            info.id, info.layout, dict(info.layout_options), info.created_at, info.since,
            info.until, info.is_current, shard.generation_bytes(generation)))
    replicas, leader = placement
    return ShardDescription(shard.shard_id, replicas, leader, shard.last_timestamp,
                            shard.disk_usage(), tuple(generations))
