"""A GC write (`ShardSet.gc_write`): refused on a site's own copy when its deletes
are in a generation that is gone or current, but only stripped of those deletes
when it is a replicated log entry, which every replica must apply the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.broker.ds import DbOptions, DurableStorage
from stratamq.broker.ds.replication import entries
from stratamq.broker.ds.replication.state_machine import LogStateMachine
from stratamq.broker.errors import GenerationError
from tests.support.storage import open_with_shards, run


def test_a_local_gc_write_refuses_deletes_in_the_current_generation(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database, shard_set = await open_with_shards(storage, "messages", DbOptions(n_shards=1))
        current = shard_set.shards[0].current.info.id
        with pytest.raises(GenerationError):
            await database.gc_write(0, current, [b"key"], [(b"mark", b"1")])
        assert shard_set.shards[0].get_record(b"mark") is None  # nothing written
        await database.gc_write(0, current, [], [(b"mark", b"2")])  # records alone
        assert shard_set.shards[0].get_record(b"mark") == b"2"
        await storage.close()
    run(scenario())


def test_a_gc_log_entry_in_the_current_generation_puts_only_its_records(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        shard_set = await storage.open_shards("messages", DbOptions(n_shards=1),
                                              replicated=True)
        shard = shard_set.shards[0]
        entry = entries.GcWrite(shard.current.info.id, (b"key",), ((b"mark", b"1"),))
        await LogStateMachine(shard_set, lambda _shard: False).apply(0, 7, entry, None)
        assert shard.get_record(b"mark") == b"1"
        assert shard.applied_offset == 7
        await storage.close()
    run(scenario())
