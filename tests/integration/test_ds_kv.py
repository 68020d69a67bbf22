"""Key-value databases (`sessions`, `retained`) written through the shard log."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from stratamq.broker.ds import CookedBatch, DurableStorage, Message
from stratamq.broker.ds.shard import Shard
from stratamq.broker.errors import ConfigError, InvalidMessageError
from tests.support.storage import run


def test_writes_through_the_buffer_are_readable_and_survive_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        kv = await storage.open_kv_db("sessions", 4)
        committed: list[CookedBatch] = []
        kv.database.add_commit_listener(committed.append)
        await asyncio.gather(*(kv.write(f"c{n}", puts=[(b"s/c%d" % n, b"v%d" % n)])
                               for n in range(200)))
        await kv.write("c7", deletes=[b"s/c7"])
        assert await kv.get("c3", b"s/c3") == b"v3"
        assert await kv.get("c7", b"s/c7") is None
        assert len(await kv.scan(b"s/")) == 199
        # the writes went through the shard log, as cooked batches of records
        assert sum(len(batch.record_puts) for batch in committed) == 200
        assert [batch.record_deletes for batch in committed][-1] == [b"rec/s/c7"]
        assert len(committed) < 201  # buffered: writers shared batches
        await storage.close()
        storage = DurableStorage(tmp_path)
        kv = await storage.open_kv_db("sessions", 4)
        assert await kv.get("c3", b"s/c3") == b"v3"
        assert await kv.get("c7", b"s/c7") is None
        assert len(await kv.scan(b"s/c1", limit=3)) == 3
        assert len(await kv.scan(b"s/c1")) == 111
        await storage.close()
    run(scenario())


def test_scans_page_through_every_entry_and_get_many_reads_across_shards(
        tmp_path: Path) -> None:
    """A scan reads a shard a page at a time and returns every entry (it used to stop
    silently at a fixed count); `get_many` answers in the order asked."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        kv = await storage.open_kv_db("retained", 3)
        keys = [b"t/%03d" % n for n in range(100)]
        await asyncio.gather(*(kv.write(key.decode(), puts=[(key, key + b"!")])
                               for key in keys))
        pages = [page async for page in kv.scan_pages(b"t/", page_size=7)]
        assert all(0 < len(page) <= 7 for page in pages)
        assert len(pages) > 100 // 7  # it paged
        assert sorted(key for page in pages for key, _value in page) == keys
        assert len(await kv.scan(b"t/")) == 100
        asked = [("t/042", b"t/042"), ("nope", b"nope"), ("t/007", b"t/007")]
        assert await kv.get_many(asked) == [b"t/042!", None, b"t/007!"]
        await storage.close()
    run(scenario())


def test_last_write_of_a_key_wins_within_one_flush(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        kv = await storage.open_kv_db("sessions", 1)
        # queued in one loop turn, so they share one cooked batch
        writes = [kv.write("c", puts=[(b"k", b"1")]), kv.write("c", deletes=[b"k"]),
                  kv.write("c", puts=[(b"k", b"3")]), kv.write("c", puts=[(b"gone", b"x")]),
                  kv.write("c", deletes=[b"gone"])]
        await asyncio.gather(*writes)
        assert await kv.get("c", b"k") == b"3"
        assert await kv.get("c", b"gone") is None
        await storage.close()
    run(scenario())


def test_a_key_value_database_takes_no_messages_and_keeps_its_kind(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        kv = await storage.open_kv_db("retained", 2)
        with pytest.raises(InvalidMessageError):
            kv.database.submit([Message("a", b"x", client_id="c")])
        await kv.write("a", puts=[(b"a", b"x")])
        # retention never drops records
        await kv.database.add_generation()
        assert await kv.database.apply_retention(now=2**62) == (False, 0)
        assert await kv.get("a", b"a") == b"x"
        with pytest.raises(ConfigError):
            await storage.open_db("retained")
        await storage.close()
        storage = DurableStorage(tmp_path)
        with pytest.raises(ConfigError):
            await storage.open_db("retained")  # created as key-value
        await storage.close()
    run(scenario())


def test_cooked_kv_batch_round_trips_and_applies_twice_harmlessly(tmp_path: Path) -> None:
    leader = Shard(tmp_path / "leader", 0, "wildcard_optimized_v2", {}, (2,), False)
    replica = Shard(tmp_path / "replica", 0, "wildcard_optimized_v2", {}, (2,), False)
    leader.commit(leader.prepare([], [(b"old", b"1")]))
    replica.commit(replica.prepare([], [(b"old", b"1")]))
    cooked = leader.prepare([], [(b"a", b"1"), (b"b", b"2")], [b"old"])
    leader.commit(cooked)
    shipped = CookedBatch.from_bytes(cooked.to_bytes())
    assert shipped == cooked and shipped.record_puts and shipped.record_deletes
    replica.commit(shipped)
    replica.commit(shipped)  # a retried apply changes nothing
    for shard in (leader, replica):
        assert shard.scan_records(b"") == [(b"a", b"1"), (b"b", b"2")]
        assert shard.get_record(b"old") is None
    leader.close()
    replica.close()
