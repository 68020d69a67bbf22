"""Sharded key-value databases (`sessions`, `retained`): one RocksDB per shard under
`data_dir/<db>/<shard>`, sharded by a routing key (a client id, a topic), with
atomic per-shard batches. Durability as for messages: WAL, fsync with sync_writes."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable
from concurrent.futures import Executor
from pathlib import Path

from rocksdict import Rdict, ReadOptions, WriteBatch, WriteOptions

from ..errors import ConfigError
from .rocks import after_prefix, as_bytes, raw_options


class KvDatabase:
    def __init__(self, name: str, shards: list[Rdict], sync_writes: bool,
                 executor: Executor) -> None:
        self.name = name
        self._shards = shards
        self._write_options = WriteOptions()
        self._write_options.sync = sync_writes
        self._executor = executor

    @classmethod
    async def open(cls, name: str, data_dir: Path, n_shards: int, sync_writes: bool,
                   executor: Executor) -> KvDatabase:
        if n_shards < 1:
            raise ConfigError(f"database {name!r}: n_shards must be at least 1")
        loop = asyncio.get_running_loop()
        path = data_dir / name
        shards: list[Rdict] = []
        for shard_id in range(n_shards):
            shard_path = path / str(shard_id)
            shard_path.mkdir(parents=True, exist_ok=True)
            shards.append(await loop.run_in_executor(
                executor, Rdict, str(shard_path), raw_options()))
        return cls(name, shards, sync_writes, executor)

    def shard_of(self, routing_key: str) -> int:
        return zlib.crc32(routing_key.encode("utf-8")) % len(self._shards)

    async def get(self, routing_key: str, key: bytes) -> bytes | None:
        shard = self._shards[self.shard_of(routing_key)]
        value = await asyncio.get_running_loop().run_in_executor(self._executor, shard.get, key)
        return None if value is None else as_bytes(value)

    async def write(self, routing_key: str, puts: Iterable[tuple[bytes, bytes]] = (),
                    deletes: Iterable[bytes] = ()) -> None:
        """Apply puts and deletes to one shard atomically; returns once durable."""
        batch = WriteBatch(raw_mode=True)
        for key, value in puts:
            batch.put(key, value)
        for key in deletes:
            batch.delete(key)
        shard = self._shards[self.shard_of(routing_key)]
        await asyncio.get_running_loop().run_in_executor(
            self._executor, shard.write, batch, self._write_options)

    async def scan(self, prefix: bytes = b"", shard_id: int | None = None,
                   limit: int = 1_000_000) -> list[tuple[bytes, bytes]]:
        """Entries whose key starts with `prefix`, from one shard or all."""
        shards = self._shards if shard_id is None else [self._shards[shard_id]]
        loop = asyncio.get_running_loop()
        found: list[tuple[bytes, bytes]] = []
        for shard in shards:
            found += await loop.run_in_executor(self._executor, _scan_shard, shard, prefix,
                                                limit - len(found))
        return found

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for shard in self._shards:
            await loop.run_in_executor(self._executor, shard.close)


def _scan_shard(shard: Rdict, prefix: bytes, limit: int) -> list[tuple[bytes, bytes]]:
    read_options = ReadOptions()
    upper = after_prefix(prefix)
    if upper is not None:
        read_options.set_iterate_upper_bound(upper)
    found: list[tuple[bytes, bytes]] = []
    for key, value in shard.items(from_key=prefix, read_opt=read_options):
        if len(found) >= limit:
            break
        found.append((as_bytes(key), as_bytes(value)))
    return found
