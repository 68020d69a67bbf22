"""The durable storage of one site: the asyncio API the broker uses, modelled on
`emqx_ds`; the only way to a database (`Database`, the facade over this site's copy
of it and its backend).

    storage = DurableStorage(data_dir)
    await storage.open_db("messages", DbOptions(n_shards=16))
    await storage.store_batch("messages", [Message("a/b", b"hi", client_id="c1")])
    for rank, stream in storage.get_streams("messages", "a/+", start_time=0):
        iterator = storage.make_iterator("messages", stream, "a/+", 0)
        result = await storage.next("messages", iterator, batch_size=100)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ConfigError, StorageClosedError, UnknownDatabaseError
from ..supervise import note_failure, supervise
from . import metrics
from .backend import Backend, LocalBackend
from .database import Database
from .generation import GenerationInfo
from .iterator import EndOfStream, Iterator, Rank, Stream
from .kv import KvDatabase, kv_options
from .message import Message
from .options import DbOptions
from .shard_set import DropListener, NextResult, ShardSet
from .site_id import load_or_create_site_id

log = logging.getLogger(__name__)

# RocksDB releases the GIL while it reads and writes, so a few threads overlap I/O;
# more would only contend on 2 cores.
DEFAULT_IO_THREADS = 4

# The backend of a database, built over this site's copy of it.
BackendOf = Callable[[ShardSet], Backend]


class DurableStorage:
    def __init__(self, data_dir: str | Path, io_threads: int = DEFAULT_IO_THREADS) -> None:
        self.data_dir = Path(data_dir)
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="ds-io")
        self._databases: dict[str, Database] = {}
        # this site's copies of databases opened before their backends exist
        self._shard_sets: dict[str, ShardSet] = {}
        self._kv_databases: dict[str, KvDatabase] = {}
        self._retention_task: asyncio.Task[None] | None = None
        self._closed = False
        self._site_id: str | None = None

    # -- the site -------------------------------------------------------------------

    async def open_site(self) -> str:
        """Load this site's id from the data dir, creating it on first start. Opening
        any database does this first."""
        if self._site_id is None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._site_id = await asyncio.get_running_loop().run_in_executor(
                self._executor, load_or_create_site_id, self.data_dir)
        return self._site_id

    @property
    def site_id(self) -> str:
        """This site's storage identity (see `open_site`)."""
        if self._site_id is None:
            raise StorageClosedError("the storage is not open yet: no site id")
        return self._site_id

    # -- databases ----------------------------------------------------------------

    async def open_shards(self, name: str, options: DbOptions,
                          replicated: bool = False) -> ShardSet:
        """Open (creating on first use) this site's copy of a database, before its
        backend: a replicated site builds its backends over its copies
        (`SiteReplication.open`), then opens each database with its backend."""
        if self._closed:
            raise StorageClosedError("the storage is closed")
        if name in self._databases or name in self._kv_databases:
            raise ConfigError(f"database {name!r} is open already")
        if name not in self._shard_sets:
            site_id = await self.open_site()
            self._shard_sets[name] = await ShardSet.open(name, self.data_dir, options,
                                                         self._executor, site_id, replicated)
        return self._shard_sets[name]

    async def open_db(self, name: str, options: DbOptions | None = None,
                      backend: BackendOf = LocalBackend) -> Database:
        """Open (creating on first use) a database, over its copy opened by
        `open_shards` if it was. Opening an open one returns it."""
        if self._closed:
            raise StorageClosedError("the storage is closed")
        if name in self._databases:
            return self._databases[name]
        if name in self._kv_databases:
            raise ConfigError(f"database {name!r} is open as a key-value database")
        database = await self._open(name, options or DbOptions(), backend)
        self._databases[name] = database
        return database

    async def open_kv_db(self, name: str, n_shards: int, sync_writes: bool = False,
                         backend: BackendOf = LocalBackend) -> KvDatabase:
        """Open (creating on first use) a key-value database (`sessions`, `retained`)."""
        if self._closed:
            raise StorageClosedError("the storage is closed")
        if name in self._databases:
            raise ConfigError(f"database {name!r} is open as a messages database")
        if name not in self._kv_databases:
            self._kv_databases[name] = KvDatabase(await self._open(
                name, kv_options(name, n_shards, sync_writes), backend))
        return self._kv_databases[name]

    async def _open(self, name: str, options: DbOptions, backend: BackendOf) -> Database:
        shard_set = self._shard_sets.pop(name, None) or await ShardSet.open(
            name, self.data_dir, options, self._executor, await self.open_site())
        return Database(shard_set, backend(shard_set))

    def db(self, name: str) -> Database:
        database = self._databases.get(name)
        if database is None:
            raise UnknownDatabaseError(
                f"no database {name!r} is open (open: {', '.join(sorted(self._databases))})")
        return database

    @property
    def databases(self) -> dict[str, Database]:
        return dict(self._databases)

    @property
    def kv_databases(self) -> dict[str, KvDatabase]:
        return dict(self._kv_databases)

    async def refresh_disk_metrics(self) -> None:
        """Measure what the databases take on disk and what the data directory's
        filesystem has free, off the event loop (the admin server's /metrics calls this
        before each scrape)."""
        databases = {**self._databases,
                     **{name: kv.database for name, kv in self._kv_databases.items()}}
        await asyncio.get_running_loop().run_in_executor(
            self._executor, _measure_disk, self.data_dir, databases)

    # -- the emqx_ds-shaped API ---------------------------------------------------

    async def store_batch(self, db: str, messages: list[Message], sync: bool = True) -> None:
        await self.db(db).store_batch(messages, sync)

    def get_streams(self, db: str, topic_filter: str,
                    start_time: int = 0) -> list[tuple[Rank, Stream]]:
        return self.db(db).get_streams(topic_filter, start_time)

    def make_iterator(self, db: str, stream: Stream, topic_filter: str,
                      start_time: int = 0) -> Iterator:
        return self.db(db).make_iterator(stream, topic_filter, start_time)

    async def next(self, db: str, iterator: Iterator,
                   batch_size: int) -> NextResult | EndOfStream:
        return await self.db(db).next(iterator, batch_size)

    async def read_message(self, db: str, stream: Stream, timestamp: int) -> Message | None:
        """The message of a stream at a timestamp; None when it is not there."""
        return await self.db(db).read_message(stream, timestamp)

    def add_generation_drop_listener(self, db: str, listener: DropListener) -> None:
        """Call `listener(shard, generation)` after a generation of `db` is dropped."""
        self.db(db).add_generation_drop_listener(listener)

    async def add_generation(self, db: str) -> None:
        await self.db(db).add_generation()

    def list_generations(self, db: str) -> dict[tuple[int, int], GenerationInfo]:
        return self.db(db).list_generations()

    def generations_known(self, db: str, shard: int) -> bool:
        """Whether `list_generations` tells the generations of a shard (one read at
        another site is known once its mirror loads)."""
        return self.db(db).generations_known(shard)

    async def drop_generation(self, db: str, shard: int, generation: int) -> None:
        await self.db(db).drop_generation(shard, generation)

    # -- retention ----------------------------------------------------------------

    def start_retention(self, check_interval: float) -> None:
        """Run the retention rule of every open database every `check_interval` s."""
        if self._retention_task is None:
            self._retention_task = asyncio.create_task(
                supervise("ds-retention", lambda: self._retention_loop(check_interval)),
                name="ds-retention")

    async def _retention_loop(self, check_interval: float) -> None:
        while True:
            await asyncio.sleep(check_interval)
            for database in list(self._databases.values()):
                try:
                    added, dropped = await database.apply_retention()
                except Exception:  # one failed pass must not end retention for good
                    note_failure(f"ds-retention-{database.name}")
                    continue
                if added or dropped:
                    log.info("retention on %r: %s a generation, dropped %d", database.name,
                             "added" if added else "did not add", dropped)

    async def close(self) -> None:
        """Flush every write buffer and close every database."""
        if self._closed:
            return
        self._closed = True
        if self._retention_task is not None:
            self._retention_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retention_task
        for database in self._databases.values():
            await database.close()
        self._databases.clear()
        for kv_database in self._kv_databases.values():
            await kv_database.close()
        self._kv_databases.clear()
        for shard_set in self._shard_sets.values():  # never given a backend
            await shard_set.close()
        self._shard_sets.clear()
        self._executor.shutdown(wait=True)


def _measure_disk(data_dir: Path, databases: dict[str, Database]) -> None:
    for name, database in databases.items():
        metrics.DISK_BYTES.labels(name).set(database.disk_bytes())
    usage = shutil.disk_usage(data_dir)
    metrics.FILESYSTEM_FREE_BYTES.set(usage.free)
    metrics.FILESYSTEM_SIZE_BYTES.set(usage.total)
