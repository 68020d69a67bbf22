"""Sharded key-value databases (`sessions`, `retained`), sharded by a routing key (a
client id, a topic). A key-value database is a `Database` that takes records only:
its puts and deletes become cooked batches of the same shard log as messages (write
buffer -> cook -> write -> apply -> commit), so one mechanism buffers, commits and
replicates both. Nothing here writes to RocksDB itself.

On a replicated site reads see every committed write: a shard this site holds a
replica of is read here past a read barrier, any other at a replica elsewhere."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence

from ..errors import ConfigError
from .backend import Consistency
from .database import Database
from .fence import FENCE_PREFIX, Fence, fence_key, stored_epoch, stored_owner
from .options import DbOptions

# Entries read from storage per call by a scan.
SCAN_PAGE = 1000


def kv_options(name: str, n_shards: int, sync_writes: bool) -> DbOptions:
    """The options of a key-value database."""
    if n_shards < 1:
        raise ConfigError(f"database {name!r}: n_shards must be at least 1")
    return DbOptions(n_shards=n_shards, sync_writes=sync_writes, key_value=True)


class KvDatabase:
    def __init__(self, database: Database) -> None:
        self.name = database.name
        self.database = database

    def shard_of(self, routing_key: str) -> int:
        return self.database.shard_of(routing_key)

    async def get(self, routing_key: str, key: bytes) -> bytes | None:
        return await self.database.get_record(self.shard_of(routing_key), key,
                                              Consistency.COMMITTED)

    async def write(self, routing_key: str, puts: Iterable[tuple[bytes, bytes]] = (),
                    deletes: Iterable[bytes] = ()) -> None:
        """Apply puts and deletes to one shard atomically; returns once durable.
        Writes of one routing key are applied in call order."""
        waits = self.database.submit([], True, records_of=routing_key,
                                     record_puts=list(puts), record_deletes=list(deletes))
        await asyncio.gather(*waits)

    async def write_fenced(self, routing_key: str, fence: Fence,
                           puts: Iterable[tuple[bytes, bytes]] = (),
                           deletes: Iterable[bytes] = ()) -> None:
        """`write`, if `fence` holds where the shard's write is cooked; FencedError
        (nothing written) when a newer owner epoch of its key is stored."""
        waits = self.database.submit([], True, records_of=routing_key,
                                     record_puts=list(puts), record_deletes=list(deletes),
                                     fence=fence)
        await asyncio.gather(*waits)

    async def fence_of(self, routing_key: str, key: bytes) -> tuple[int, bytes]:
        """The owner epoch stored for `key` (0 before any fenced write of it) and the
        owner its claim named."""
        stored = await self.get(routing_key, fence_key(key))
        return stored_epoch(stored), stored_owner(stored)

    async def get_many(self, entries: Sequence[tuple[str, bytes]]) -> list[bytes | None]:
        """The values of (routing key, key) pairs, in their order (None where there is
        none): one storage read per shard, not one per key."""
        by_shard: dict[int, list[int]] = defaultdict(list)
        for position, (routing_key, _key) in enumerate(entries):
            by_shard[self.shard_of(routing_key)].append(position)
        values: list[bytes | None] = [None] * len(entries)
        for shard_id, positions in by_shard.items():
            keys = [entries[position][1] for position in positions]
            found = await self.database.get_records(shard_id, keys, Consistency.COMMITTED)
            for position, value in zip(positions, found, strict=True):
                values[position] = value
        return values

    async def scan_pages(self, prefix: bytes = b"", shard_id: int | None = None,
                         page_size: int = SCAN_PAGE) -> AsyncIterator[list[tuple[bytes, bytes]]]:
        """Entries whose key starts with `prefix`, from one shard or all, a page of at
        most `page_size` at a time (so a caller holds one page, not the database). On a
        replicated site each page is read at a replica of its shard."""
        shard_ids = range(self.database.shard_count) if shard_id is None else [shard_id]
        for number in shard_ids:
            after: bytes | None = None
            while True:
                page = await self.database.read_records(number, prefix, Consistency.COMMITTED,
                                                        page_size, after)
                # owner epochs of fenced keys are not entries
                entries = [entry for entry in page if not entry[0].startswith(FENCE_PREFIX)]
                if entries:
                    yield entries
                if len(page) < page_size:
                    break
                after = page[-1][0]

    async def scan(self, prefix: bytes = b"", shard_id: int | None = None,
                   limit: int | None = None) -> list[tuple[bytes, bytes]]:
        """Entries whose key starts with `prefix`, from one shard or all: every one,
        or the first `limit`."""
        found: list[tuple[bytes, bytes]] = []
        async for page in self.scan_pages(prefix, shard_id):
            found += page
            if limit is not None and len(found) >= limit:
                return found[:limit]
        return found

    async def close(self) -> None:
        await self.database.close()

