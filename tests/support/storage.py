"""Helpers shared by the tests (imported as `tests.support`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from harness.processes import HOST, free_port
from stratamq.broker.config import Config, load_config
from stratamq.broker.ds import Database, DbOptions, DurableStorage, EndOfStream, Message
from stratamq.broker.ds.shard_set import ShardSet
from stratamq.broker.site import RunningSite, start_site

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine on a fresh event loop (no plugin needed)."""
    return asyncio.run(coroutine)


async def open_with_shards(storage: DurableStorage, name: str,
                           options: DbOptions) -> tuple[Database, ShardSet]:
    """A database and its copy on this site, for a test that looks into (or holds) its
    shards: the `Database` hands out none."""
    shard_set = await storage.open_shards(name, options)
    return await storage.open_db(name, options), shard_set


async def read_filter(storage: DurableStorage, db: str, topic_filter: str,
                      start_time: int = 0, batch_size: int = 7) -> list[Message]:
    """Every message matching the filter, stream by stream in rank order, the way a
    session replays."""
    found: list[Message] = []
    for _rank, stream in storage.get_streams(db, topic_filter, start_time):
        iterator = storage.make_iterator(db, stream, topic_filter, start_time)
        while True:
            result = await storage.next(db, iterator, batch_size)
            if isinstance(result, EndOfStream):
                break
            iterator, batch = result
            if not batch:
                break
            found.extend(message for _key, message in batch)
    return found



def site_config(data_dir: Path, port: int) -> Config:
    """A single site's configuration for `stratamq.broker.site.start_site` in this
    process (so a test can reach into its storage): MQTT over TCP on `port`, two
    shards, no WebSocket listener or admin API."""
    return load_config(env={
        "STRATAMQ__DURABLE_STORAGE__MESSAGES__DATA_DIR": str(data_dir),
        "STRATAMQ__DURABLE_STORAGE__MESSAGES__N_SHARDS": "2",
        "STRATAMQ__LISTENERS__TCP__BIND": f"{HOST}:{port}",
        "STRATAMQ__LISTENERS__WS__ENABLE": "false",
        "STRATAMQ__ADMIN__ENABLE": "false"})


@contextlib.asynccontextmanager
async def running_site(data_dir: Path) -> AsyncIterator[tuple[RunningSite, int]]:
    """A single site (`site_config`) started in this process on a free port, stopped
    on the way out: the site and its MQTT port."""
    port = free_port()
    site = await start_site(site_config(data_dir, port))
    try:
        yield site, port
    finally:
        await site.stop()
