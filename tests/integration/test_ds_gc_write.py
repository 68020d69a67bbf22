"""A GC write (`ShardSet.gc_write`): refused on a site's own copy when its deletes
are in a generation that is gone or current, but only stripped of those deletes
when it is a replicated log entry, which every replica must apply the same way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stratamq.broker.ds import DbOptions, DurableStorage, Message, RetentionRules, gc
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


def test_a_rewrite_reads_the_keys_to_delete_a_run_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GC rewrite collected the keys of every expired message of a generation before
    deleting any: a generation of millions of expired messages was held whole in the
    site's memory. The keys come a run of about DELETE_BATCH_BYTES at a time, read as
    they are deleted, every one of them once."""
    monkeypatch.setattr(gc, "DELETE_BATCH_BYTES", 500)

    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database, shard_set = await open_with_shards(storage, "messages", DbOptions(n_shards=1))
        for number in range(300):
            await database.submit([Message(f"old/{number % 7}", b"x", "pub", 1)])[0]
        await database.add_generation()
        shard = shard_set.shards[0]
        closed = min(shard.generations)
        generation = shard.generations[closed]
        rules, later = RetentionRules(1.0), time.time_ns() // 1000 + 10_000_000
        scan = gc.scan_generation(generation, rules, later)
        assert (scan.messages, scan.expired) == (300, 300)
        runs = gc.expired_keys(generation, rules, later)
        first = next(runs)
        # lazily: one run read, not the whole generation
        assert 500 <= sum(map(len, first)) < 500 + 200
        rest = list(runs)
        keys = [key for run in [first, *rest] for key in run]
        assert len(keys) == len(set(keys)) and len(rest) >= 5
        assert all(sum(map(len, run)) < 500 + 200 for run in rest)
        await storage.close()
    run(scenario())
