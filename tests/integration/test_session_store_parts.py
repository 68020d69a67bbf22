"""A session is stored as a head and one part per subscription, cursor and finished
cursor (`SessionStore`): a save writes the parts that changed and a delete removes
every part. On one real storage, the sessions database read back directly."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from stratamq.broker.core.broker import SESSIONS_DB
from stratamq.broker.ds import DbOptions, DurableStorage, FencedError, KvDatabase
from stratamq.broker.session.model import CursorState, SessionRecord, Subscription
from stratamq.broker.session.store import SessionStore
from tests.support.storage import run

CLIENT = "sensor-7"


def record(subscriptions: int, owner_epoch: int = 0) -> SessionRecord:
    return SessionRecord(
        CLIENT, 300, [Subscription(f"t/{n}", 1, since=n) for n in range(subscriptions)],
        {"0:1:ab:t/0": CursorState(5, [7])}, done=["0:0:ab:t/0"], username="u",
        owner_epoch=owner_epoch)


def comparable(found: SessionRecord | None) -> tuple[object, ...]:
    assert found is not None
    return (found.client_id, found.expiry_interval, sorted(
        (s.key, s.qos, s.since) for s in found.subscriptions), found.cursors,
            sorted(found.done), found.resend, found.username, found.owner_epoch)


def record_bytes_written() -> float:
    """`stratamq_ds_buffer_record_bytes` of the sessions database, every shard."""
    return sum(sample.value for metric in REGISTRY.collect()
               if metric.name == "stratamq_ds_buffer_record_bytes"
               for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels["db"] == SESSIONS_DB)


async def session_entries(db: KvDatabase) -> dict[bytes, bytes]:
    return {key: value for key, value in await db.scan() if CLIENT.encode() in key}


def test_a_save_writes_the_changed_parts_and_a_delete_removes_all(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        try:
            messages = await storage.open_db("messages", DbOptions(n_shards=2))
            sessions_db = await storage.open_kv_db(SESSIONS_DB, 2, False)
            store = SessionStore(sessions_db, messages)
            first = record(100)
            stored = await store.save(first, None)  # nothing known: read, then written
            assert comparable(await store.load(CLIENT)) == comparable(first)
            assert len(await session_entries(sessions_db)) == 1 + 100 + 1 + 1

            before = dict(await session_entries(sessions_db))
            written_before = record_bytes_written()
            second = record(100)
            second.subscriptions = [*first.subscriptions[1:], Subscription("t/new", 2)]
            second.cursors = {"0:1:ab:t/0": CursorState(9)}
            second.done = []
            stored = await store.save(second, stored)
            after = await session_entries(sessions_db)
            changed = {key for key in before.keys() | after.keys()
                       if before.get(key) != after.get(key)}
            # t/0 gone, t/new, the cursor, the finished cursor gone (the head is the same)
            assert len(changed) == 4, changed
            # and only they (with the head) were written
            written = record_bytes_written() - written_before
            assert 0 < written < 600, written
            assert comparable(await store.load(CLIENT)) == comparable(second)

            # an unknown state (a write whose outcome is not known) is read back
            third = record(3)
            await store.save(third, None)
            assert comparable(await store.load(CLIENT)) == comparable(third)
            assert len(await session_entries(sessions_db)) == 1 + 3 + 1 + 1

            await store.delete(CLIENT)
            assert await store.load(CLIENT) is None
            assert await session_entries(sessions_db) == {}
            assert await store.client_ids() == []
        finally:
            await storage.close()
    run(scenario())



def test_parts_are_fenced_with_the_head(tmp_path: Path) -> None:
    """A site that lost the client id writes no part of its session either."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        try:
            messages = await storage.open_db("messages", DbOptions(n_shards=2))
            sessions_db = await storage.open_kv_db(SESSIONS_DB, 2, False)
            old = SessionStore(sessions_db, messages, owner="site-a")
            new = SessionStore(sessions_db, messages, owner="site-b")
            await old.claim(CLIENT, 1)
            stored = await old.save(record(10, owner_epoch=1), None)
            await new.claim(CLIENT, 2)
            late = record(11, owner_epoch=1)
            with pytest.raises(FencedError):
                await old.save(late, stored)
            with pytest.raises(FencedError):
                await old.delete(CLIENT, 1)
            kept = await new.load(CLIENT)
            assert kept is not None and len(kept.subscriptions) == 10
        finally:
            await storage.close()
    run(scenario())
