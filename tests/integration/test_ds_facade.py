"""The storage's public face: `Database.describe`, the site id, and the facade's
exports."""

from __future__ import annotations

from pathlib import Path

import pytest

import stratamq.broker.ds as ds
from stratamq.broker.ds import DbOptions, DurableStorage, Message
from stratamq.broker.errors import ConfigError, StorageClosedError
from tests.support.storage import run


def test_describe_shows_shards_generations_replicas_and_positions(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database = await storage.open_db("messages", DbOptions(n_shards=2))
        before = await database.describe()
        assert [shard.committed_timestamp for shard in before.shards] == [0, 0]
        await storage.store_batch("messages", [Message("a/b", b"x" * 5000, client_id="c")])
        await storage.add_generation("messages")
        found = await database.describe()
        assert found.name == "messages" and found.n_shards == 2 and not found.key_value
        assert found.site_id == storage.site_id
        written = ds.shard_of("c", 2)
        for shard in found.shards:
            assert shard.replicas == (storage.site_id,) and shard.leader == storage.site_id
            assert shard.disk_bytes > 0
            first, second = shard.generations
            assert (first.current, second.current) == (False, True)
            assert first.until == second.since and second.until is None
            assert first.since <= first.until
        assert found.shards[written].committed_timestamp > 0
        assert found.shards[1 - written].committed_timestamp == 0
        assert found.shards[written].generations[0].bytes >= 5000
        assert found.disk_bytes == sum(shard.disk_bytes for shard in found.shards)
        await storage.close()
    run(scenario())


def test_the_storage_creates_and_keeps_the_site_id(tmp_path: Path) -> None:
    async def scenario() -> str:
        storage = DurableStorage(tmp_path)
        with pytest.raises(StorageClosedError):
            _ = storage.site_id
        await storage.open_kv_db("sessions", 1)
        site_id = storage.site_id
        await storage.close()
        return site_id

    first = run(scenario())
    assert len(first) == 16 and int(first, 16) >= 0
    assert (tmp_path / "site-id").read_text().strip() == first
    assert run(scenario()) == first  # loaded, not made again

    (tmp_path / "site-id").write_text("not an id\n")
    with pytest.raises(ConfigError):
        run(scenario())


def test_the_facade_exports_what_callers_need() -> None:
    for name in ("KvDatabase", "DbDescription", "encode_message", "decode_message",
                 "Database", "DurableStorage", "Stream", "Iterator", "END_OF_STREAM"):
        assert name in ds.__all__ and hasattr(ds, name)
    assert "ShardSet" not in ds.__all__ and "Shard" not in ds.__all__
    message = Message("t", b"p", client_id="c", qos=1)
    assert ds.decode_message(ds.encode_message(message)).payload == b"p"


def test_the_database_hands_out_no_shard(tmp_path: Path) -> None:
    """Callers name shards by number: the database's attributes are its name, site and
    options, and what they ask of a shard it answers itself."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database = await storage.open_db("messages", DbOptions(n_shards=3))
        assert {name for name in vars(database) if not name.startswith("_")} \
            == {"name", "site_id", "options"}
        for internal in ("shards", "shard_set", "executor"):
            assert not hasattr(database, internal)
        assert database.shard_count == 3
        assert [database.applied_offset(shard) for shard in range(3)] == [0, 0, 0]
        await storage.store_batch("messages", [Message("a/b", b"x" * 5000, client_id="c")])
        assert database.disk_bytes() > 0  # RocksDB's files grow as they like: no more
        await storage.close()
    run(scenario())
