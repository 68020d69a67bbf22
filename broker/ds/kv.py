"""Sharded key-value databases (`sessions`, `retained`), sharded by a routing key (a
client id, a topic). A key-value database is a `Database` that takes records only:
its puts and deletes become cooked batches of the same shard log as messages (write
buffer -> cook -> write -> apply -> commit), so one mechanism buffers, commits and
(later) replicates both. Nothing here writes to RocksDB itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from concurrent.futures import Executor
from pathlib import Path

from rocksdict import Rdict, WriteBatch, WriteOptions

from ..errors import ConfigError
from .database import META_FILE, Database, shard_of
from .options import DbOptions
from .rocks import as_bytes, raw_options
from .shard import RECORD_PREFIX

log = logging.getLogger(__name__)

# Outside the record prefix, so no record can clash with it.
_MIGRATED_KEY = b"kv-format-migrated"


class KvDatabase:
    def __init__(self, database: Database) -> None:
        self.name = database.name
        self.database = database

    @classmethod
    async def open(cls, name: str, data_dir: Path, n_shards: int, sync_writes: bool,
                   executor: Executor, site_id: str = "") -> KvDatabase:
        if n_shards < 1:
            raise ConfigError(f"database {name!r}: n_shards must be at least 1")
        await asyncio.get_running_loop().run_in_executor(
            executor, migrate_direct_kv, data_dir / name, n_shards)
        options = DbOptions(n_shards=n_shards, sync_writes=sync_writes, key_value=True)
        return cls(await Database.open(name, data_dir, options, executor, site_id))

    def shard_of(self, routing_key: str) -> int:
        return shard_of(routing_key, self.database.options.n_shards)

    async def get(self, routing_key: str, key: bytes) -> bytes | None:
        return await self.database.get_record(routing_key, key)

    async def write(self, routing_key: str, puts: Iterable[tuple[bytes, bytes]] = (),
                    deletes: Iterable[bytes] = ()) -> None:
        """Apply puts and deletes to one shard atomically; returns once durable.
        Writes of one routing key are applied in call order."""
        waits = self.database.submit([], True, records_of=routing_key,
                                     record_puts=list(puts), record_deletes=list(deletes))
        await asyncio.gather(*waits)

    async def scan(self, prefix: bytes = b"", shard_id: int | None = None,
                   limit: int = 1_000_000) -> list[tuple[bytes, bytes]]:
        """Entries whose key starts with `prefix`, from one shard or all."""
        shard_ids = range(len(self.database.shards)) if shard_id is None else [shard_id]
        found: list[tuple[bytes, bytes]] = []
        for number in shard_ids:
            found += await self.database.scan_shard_records(number, prefix, limit - len(found))
        return found

    async def close(self) -> None:
        await self.database.close()


def migrate_direct_kv(path: Path, n_shards: int) -> None:
    """Move a key-value database written before the shard log (plain keys in each
    shard's RocksDB, no `db.json`) under the record prefix, so its data stays
    readable. Runs once: afterwards `db.json` exists. Blocking."""
    if (path / META_FILE).exists() or not path.is_dir():
        return
    for shard_id in range(n_shards):
        shard_path = path / str(shard_id)
        if not (shard_path / "CURRENT").exists():
            continue
        rdict = Rdict(str(shard_path), raw_options())
        try:
            if rdict.get(_MIGRATED_KEY) is not None:  # moved before a crash
                continue
            batch = WriteBatch(raw_mode=True)
            # in the same atomic batch, so a crash never moves a key twice
            batch.put(_MIGRATED_KEY, b"1")
            moved = 0
            for key, value in rdict.items():
                raw_key = as_bytes(key)
                batch.put(RECORD_PREFIX + raw_key, as_bytes(value))
                batch.delete(raw_key)
                moved += 1
            options = WriteOptions()
            options.sync = True
            rdict.write(batch, options)
        finally:
            rdict.close()
        log.info("%s: moved %d keys of the old key-value format into records", shard_path,
                 moved)
