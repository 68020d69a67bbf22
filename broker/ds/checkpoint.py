"""Consistent, read-only checkpoints of a database on this site, for batch jobs (the
Spark data pipeline) and for bootstrapping replicas.

A checkpoint folder looks like the database's own folder (`db.json`, one RocksDB per
shard in `0/`, `1/`, ...: every shard, or those asked for) plus `manifest.json`: the
site, the shards it holds, their committed positions and generations with time ranges
and layouts, and the time it was made.
It is built under a temporary name and renamed when complete, so a folder with a
manifest is always a whole checkpoint."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError
from ..files import write_atomically
from .shard import now_us
from .shard_set import META_FILE, ShardSet
from .snapshot import MANIFEST_FILE, Snapshot, describe_snapshot

_PARTIAL_SUFFIX = ".partial"


async def create_checkpoint(database: ShardSet, target: str | Path,
                            shards: Collection[int] | None = None) -> dict[str, Any]:
    """Checkpoint the shards `shards` of `database` (None: every one) into the new
    folder `target` and return its manifest, which lists the shards it holds. Each
    shard is copied under its lock, so no batch and no generation change lands halfway;
    the RocksDB work runs on the storage's executor."""
    wanted = sorted(set(range(len(database.shards)) if shards is None else shards))
    unknown = [shard_id for shard_id in wanted
               if not 0 <= shard_id < len(database.shards)]
    if unknown:
        raise ValueError(f"no shard {', '.join(map(str, unknown))} in database "
                         f"{database.name!r} ({len(database.shards)} shards)")
    final = Path(target)
    partial = final.with_name(final.name + _PARTIAL_SUFFIX)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(database.executor, _prepare, final, partial)
    try:
        for shard_id in wanted:
            await checkpoint_shard(database, shard_id, partial / str(shard_id))
        return await loop.run_in_executor(
            database.executor, _finish, database, partial, final, now_us())
    except BaseException:
        await loop.run_in_executor(database.executor, shutil.rmtree, partial, True)
        raise


async def checkpoint_shard(database: ShardSet, shard_id: int, target: Path) -> int:
    """Checkpoint one shard of `database` into the new folder `target` (a RocksDB
    folder) under the shard's lock; returns the log offset the shard had applied then
    (recorded in the checkpoint too), 0 on a site without replication."""
    async with database.shard_lock(shard_id):
        shard = database.shards[shard_id]
        await asyncio.get_running_loop().run_in_executor(database.executor, shard.checkpoint,
                                                         target)
        return shard.applied_offset


def _prepare(final: Path, partial: Path) -> None:
    if final.exists():
        raise CheckpointExistsError(f"checkpoint folder {final} already exists; "
                                    "give a new folder")
    if partial.exists():
        raise CheckpointExistsError(f"{partial} exists: another checkpoint to {final} is "
                                    "being made (or one failed; remove the folder)")
    final.parent.mkdir(parents=True, exist_ok=True)
    partial.mkdir()


def _finish(database: ShardSet, partial: Path, final: Path, created_at: int) -> dict[str, Any]:
    shutil.copyfile(database.path / META_FILE, partial / META_FILE)
    with Snapshot(partial) as snapshot:
        manifest = describe_snapshot(snapshot, database.site_id, database.name, created_at)
    write_atomically(partial / MANIFEST_FILE, json.dumps(manifest, indent=2))
    partial.rename(final)
    return manifest
