"""Storage defects, each pinned by a test that failed before its fix."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stratamq.broker.ds import (
    Consistency,
    DbOptions,
    DurableStorage,
    EndOfStream,
    Iterator,
    Message,
)
from stratamq.broker.ds.cooked import CookedBatch
from stratamq.broker.ds.shard import Shard
from stratamq.broker.errors import StorageBusyError
from tests.support.rocks_calls import NotedRocks
from tests.support.storage import open_with_shards, read_filter, run

FAST = DbOptions(n_shards=2, flush_interval=0.001, wildcard_thresholds=(3, 2))


def test_a_batch_written_during_an_empty_read_at_a_generation_switch_is_read(
        tmp_path: Path) -> None:
    """The reader's empty read of generation 1 finishes; before next() looks at the
    generation, a batch lands in generation 1 and generation 2 starts. The reader
    must not take the empty read as the end of generation 1."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        _database, shard_set = await open_with_shards(storage, "messages",
                                                      DbOptions(n_shards=1))
        await storage.store_batch("messages", [Message("t", b"first", client_id="c")])
        (_rank, stream), = storage.get_streams("messages", "t")
        iterator = storage.make_iterator("messages", stream, "t")
        result = await storage.next("messages", iterator, 10)
        assert not isinstance(result, EndOfStream)
        iterator = result[0]
        shard = shard_set.shards[0]
        real_read = shard.read
        read_done = threading.Event()
        release = threading.Event()

        def read_then_hold(*args: Any) -> Any:
            rows = real_read(*args)
            read_done.set()
            release.wait(30)
            return rows

        shard.read = read_then_hold  # type: ignore[method-assign,assignment]
        pending = asyncio.create_task(storage.next("messages", iterator, 10))
        await asyncio.get_running_loop().run_in_executor(None, read_done.wait, 30)
        await storage.store_batch("messages", [Message("t", b"second", client_id="c")])
        await storage.add_generation("messages")
        release.set()
        result = await pending
        shard.read = real_read  # type: ignore[method-assign]
        got: list[bytes] = []
        while not isinstance(result, EndOfStream):
            iterator, batch = result
            got += [message.payload for _key, message in batch]
            result = await storage.next("messages", iterator, 10)
        assert got == [b"second"]
        await storage.close()
    run(scenario())


def test_an_iterator_never_returns_a_topic_outside_its_filter(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        await storage.open_db("messages", FAST)
        await storage.store_batch("messages", [Message("b/x", b"secret", client_id="c"),
                                               Message("a/y", b"ok", client_id="c")])
        for _rank, stream in storage.get_streams("messages", "#"):
            honest = storage.make_iterator("messages", stream, "#")
            # bytes with a valid checksum that pair the stream with another filter
            forged = Iterator.from_bytes(
                Iterator(stream, "a/+", honest.pattern, 0).to_bytes())
            result = await storage.next("messages", forged, 10)
            if isinstance(result, EndOfStream):
                continue
            assert all(message.topic.startswith("a/") for _key, message in result[1])
            # $-topics are never read through a wildcard at the first level
            forged = Iterator(stream, "+/x", honest.pattern, 0)
            result = await storage.next("messages", forged, 10)
            assert not isinstance(result, EndOfStream)
            assert [m.topic for _key, m in result[1]] in ([], ["b/x"])
        await storage.close()
    run(scenario())


def _fsync_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the path of every file or folder fsynced (the real fsync still runs)."""
    synced: list[str] = []
    real_fsync: Callable[[int], None] = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_database_options_are_fsynced_with_their_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = _fsync_spy(monkeypatch)

    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        await storage.open_db("messages", FAST)
        await storage.close()
    run(scenario())
    folder = str(tmp_path / "messages")
    assert folder in synced
    assert any(Path(path).parent == Path(folder) and ".db.json." in path for path in synced)
    assert (tmp_path / "messages" / "db.json").exists()


def test_dropping_a_generation_syncs_its_deletion_before_dropping_its_data(
        tmp_path: Path) -> None:
    shard = Shard(tmp_path / "s", 0, "wildcard_optimized_v2", {}, (2,), sync_writes=False)
    shard.commit(shard.prepare([Message("a", b"1")]))
    shard.add_generation()
    real = shard._db
    noted = NotedRocks(real)
    shard._db = noted  # type: ignore[assignment]
    shard.drop_generation(1)
    shard._db = real
    assert noted.taken() == ["write", "flush_wal(True)", "drop gen1.data", "drop gen1.trie"]
    shard.close()
    reopened = Shard(tmp_path / "s", 0, "wildcard_optimized_v2", {}, (2,), sync_writes=False)
    assert list(reopened.generations) == [2]
    reopened.close()


def test_a_replica_is_known_to_have_applied_a_batch_once_it_reads_its_streams(
        tmp_path: Path) -> None:
    """A replica's applied offset moved with the RocksDB write of a batch, on the
    executor, before the event loop learnt the batch's streams from its edges: a read
    that waited for the offset (a read barrier, a test's wait) could find no stream
    for a topic the batch had just created (a flaky replication test did)."""
    leader = Shard(tmp_path / "leader", 0, "wildcard_optimized_v2", {}, (2,), False)
    replica = Shard(tmp_path / "replica", 0, "wildcard_optimized_v2", {}, (2,), False)
    cooked = CookedBatch.from_bytes(leader.prepare([Message("new/topic", b"m")]).to_bytes())
    replica.write(cooked, applied=1)
    assert (replica.applied_offset, replica.current.trie.match(["new", "topic"])) == (0, [])
    replica.apply(cooked, applied=1)
    assert replica.applied_offset == 1
    assert len(replica.current.trie.match(["new", "topic"])) == 1
    leader.close()
    replica.close()


def test_the_write_buffer_is_bounded_in_bytes_and_callers_can_wait_for_room(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database = await storage.open_db(
            "messages", DbOptions(n_shards=1, flush_interval=3600, max_items=10**6,
                                  max_bytes=10_000))
        assert database.has_room(0)
        waits = database.submit([Message("t", b"x" * 4000, client_id="c")])
        assert database.has_room(0)  # 4 KB of 10 KB queued
        waits += database.submit([Message("t", b"x" * 7000, client_id="c")])
        # the buffer is full: it flushes now, and room comes back once it is taken
        await asyncio.wait_for(database.wait_for_room("c"), 30)
        assert database.has_room(0)
        await asyncio.gather(*waits)
        assert [m.payload[:1] for m in await read_filter(storage, "messages", "t")] == \
            [b"x", b"x"]
        await storage.close()
    run(scenario())


def test_a_full_buffer_holds_callers_until_its_batch_is_taken(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database, shard_set = await open_with_shards(
            storage, "messages", DbOptions(n_shards=1, flush_interval=0.0, max_bytes=1000))
        lock = shard_set.shard_lock(0)
        await lock.acquire()  # the shard is busy writing: nothing is taken
        for _ in range(10):  # one batch of 4 is taken (and waits for the lock)
            database.submit([Message("t", b"y" * 300, client_id="c")], wait=False)
        await asyncio.sleep(0.05)
        assert not database.has_room(0)
        waiter = asyncio.create_task(database.wait_for_room("c"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        lock.release()
        await asyncio.wait_for(waiter, 30)
        await storage.close()
    run(scenario())


def _deep_size(obj: object, seen: set[int] | None = None) -> int:
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, tuple | list):
        size += sum(_deep_size(item, seen) for item in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(_deep_size(getattr(obj, name), seen) for name in obj.__slots__
                    if hasattr(obj, name))
    return size


def test_topic_caches_stay_under_their_byte_bound_with_huge_topics(tmp_path: Path) -> None:
    bound = 2 * 1024 * 1024

    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        _database, shard_set = await open_with_shards(
            storage, "messages", DbOptions(n_shards=2, wildcard_thresholds=(2, 2),
                                           topic_cache_bytes=bound))
        big = "v" * 56_000
        for number in range(200):  # 200 topics of 56 KB: 11 MB of topic names
            await storage.store_batch("messages", [Message(
                f"huge/{number}/{big}{number}/x", b"", client_id=f"c{number}")])
        held = 0
        for shard in shard_set.shards:
            layout: Any = shard.current.layout
            held += _deep_size(shard.current.trie._topic_cache.entries)
            held += _deep_size(layout._index_prefixes.entries)
        assert held <= bound
        assert len(await read_filter(storage, "messages", "huge/#")) == 200
        await storage.close()
    run(scenario())


def test_dropping_a_generation_tells_the_listeners(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database = await storage.open_db("messages", FAST)
        dropped: list[tuple[int, int]] = []
        database.add_generation_drop_listener(lambda shard, gen: dropped.append((shard, gen)))
        await storage.add_generation("messages")
        await storage.drop_generation("messages", 1, 1)
        assert dropped == [(1, 1)]
        # retention drops go through the same path
        await database.apply_retention(now=2**62)  # drops 1 of shard 0, closes 2
        await database.apply_retention(now=2**62)  # drops the 2s
        assert sorted(dropped) == [(0, 1), (0, 2), (1, 1), (1, 2)]
        await storage.close()
    run(scenario())


def test_streams_new_since_a_version_are_found_incrementally(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database = await storage.open_db("messages", FAST)
        version, found = database.get_streams_since("r/#", 0)
        assert found == []
        await storage.store_batch("messages", [Message(f"r/{n}", b"", client_id=f"c{n}")
                                               for n in range(10)])
        await storage.store_batch("messages", [Message("other/1", b"", client_id="c")])
        version2, found = database.get_streams_since("r/#", version)
        assert found == database.get_streams("r/#")
        assert version2 > version
        assert database.get_streams_since("r/#", version2) == (version2, [])
        await storage.store_batch("messages", [Message("r/new/deeper", b"", client_id="c")])
        await storage.add_generation("messages")
        _version3, found = database.get_streams_since("r/#", version2)
        whole = database.get_streams("r/#")
        # the new stream, and the streams the new generations inherited
        assert set(found) <= set(whole) and found
        assert set(whole) - set(found) <= {pair for pair in whole if pair[0].y == 1}
        assert len(await read_filter(storage, "messages", "r/#")) == 11
        _v, same = database.get_streams_since("r/+", 0)
        assert same == database.get_streams("r/+")
        await storage.close()
    run(scenario())


def test_an_overfull_shard_refuses_messages_but_takes_records(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database, shard_set = await open_with_shards(
            storage, "messages", DbOptions(n_shards=1, flush_interval=0.0, max_bytes=1000))
        await shard_set.shard_lock(0).acquire()  # the shard is busy: nothing is written
        refused = 0
        for _ in range(40):
            try:
                database.submit([Message("t", b"z" * 300, client_id="c")], wait=False)
            except StorageBusyError as error:
                assert error.recoverable
                refused += 1
        assert refused > 0
        with pytest.raises(StorageBusyError):  # the many-message path checks first too
            database.submit([Message("t", b"z", client_id="c"),
                             Message("t", b"z", client_id="d")])
        done = database.submit([], records_of="c", record_puts=[(b"k", b"v")])
        shard_set.shard_lock(0).release()
        await asyncio.gather(*done)
        assert await database.read_records(database.shard_of("c"), b"k",
                                           Consistency.LOCAL) == [(b"k", b"v")]
        await storage.close()
    run(scenario())
