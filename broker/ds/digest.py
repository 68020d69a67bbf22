"""A digest of one shard's content, to compare the replicas of a shard (`stratamq ctl
ds verify`): two replicas that applied the same log offset hold the same content, so
any difference names a replica that diverged.

The digest is a BLAKE2b over every key and value of every column family of the shard's
RocksDB, families by name and keys in RocksDB's order, each framed by its length. It
is taken on a checkpoint of the shard (hard links and a flushed memtable, made under
the shard's lock, so it is consistent and carries the applied offset), read in the
executor and deleted: the shard takes writes meanwhile.

One field is the site's own and is left out: when a site creates a shard it starts
its first generation at its own clock (`created_at`, `since` of generation 1); every
later generation starts where the leader's log entry says."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import struct
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from rocksdict import AccessType, Options, Rdict

from .checkpoint import checkpoint_shard
from .generation import GenerationInfo
from .rocks import as_bytes
from .shard import GENERATION_PREFIX
from .shard_set import ShardSet

DIGEST_DIR = "digests"
_LENGTH = struct.Struct(">Q")
_DEFAULT_FAMILY = "default"


@dataclass(frozen=True, slots=True)
class ShardDigest:
    applied: int  # the shard log offset the content is at (0 without replication)
    digest: str  # hex
    keys: int  # key-value pairs digested


def digest_folder(folder: Path) -> tuple[str, int]:
    """The digest of the RocksDB in `folder` (a shard's checkpoint) and how many keys
    it covers. Blocking."""
    names = sorted(Rdict.list_cf(str(folder), Options(raw_mode=True)))
    db = Rdict(str(folder), Options(raw_mode=True),
               column_families={name: Options(raw_mode=True) for name in names
                                if name != _DEFAULT_FAMILY},
               access_type=AccessType.read_only())
    digest = hashlib.blake2b(digest_size=16)
    keys = 0
    try:
        for name in names:
            family = db if name == _DEFAULT_FAMILY else db.get_column_family(name)
            digest.update(_framed(name.encode()))
            for raw_key, raw_value in family.items():
                key, value = as_bytes(raw_key), as_bytes(raw_value)
                if name == _DEFAULT_FAMILY and key.startswith(GENERATION_PREFIX):
                    value = _replicated_part(value)
                digest.update(_framed(key))
                digest.update(_framed(value))
                keys += 1
    finally:
        db.close()
    return digest.hexdigest(), keys


def _framed(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def _replicated_part(raw: bytes) -> bytes:
    """A generation's record without the site's own clock (see the module's doc)."""
    info = GenerationInfo.from_json(raw)
    if info.id == 1:
        info = replace(info, created_at=0, since=0)
    return info.to_json()


async def digest_shard(database: ShardSet, shard_id: int, work_dir: Path) -> ShardDigest:
    """The digest of one shard of `database` as applied now. The caller makes one at a
    time per `work_dir` (a folder of its own: what is left there is removed)."""
    loop = asyncio.get_running_loop()
    folder = work_dir / f"{database.name}-{shard_id}-{uuid.uuid4().hex}"

    def prepare() -> None:
        shutil.rmtree(work_dir, ignore_errors=True)  # left by a site that stopped
        work_dir.mkdir(parents=True)

    await loop.run_in_executor(database.executor, prepare)
    try:
        applied = await checkpoint_shard(database, shard_id, folder)
        digest, keys = await loop.run_in_executor(database.executor, digest_folder, folder)
    finally:
        await loop.run_in_executor(database.executor, shutil.rmtree, folder, True)
    return ShardDigest(applied, digest, keys)
