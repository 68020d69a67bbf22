"""Where a write buffer's flush writes a batch on a site without replication
(`LocalBackend`): small ones on the event loop (the hand-off
to a thread costs more than the write), large or synced ones in the executor. Real
shards, real RocksDB. (A write RocksDB would stall is retried in the executor; no test
here makes RocksDB stall for real.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from stratamq.broker.ds.backend import LocalBackend
from stratamq.broker.ds.cooked import CookedBatch
from stratamq.broker.ds.message import Message
from stratamq.broker.ds.options import DbOptions
from stratamq.broker.ds.shard import Shard
from stratamq.broker.ds.shard_set import INLINE_WRITE_ENTRIES, ShardSet

T = TypeVar("T")


class CountingExecutor(ThreadPoolExecutor):
    """A real thread pool that remembers what it was given."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.calls: list[str] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        called = getattr(fn, "func", fn)  # a functools.partial: the function it calls
        self.calls.append(getattr(called, "__name__", repr(called)))
        return super().submit(fn, *args, **kwargs)


def _open_shard(path: Path, sync_writes: bool = False) -> Shard:
    return Shard(path, 0, "wildcard_optimized_v2", {}, (3, 2), sync_writes)


async def _store(shard: Shard, executor: CountingExecutor, count: int) -> list[CookedBatch]:
    committed: list[CookedBatch] = []
    options = DbOptions(n_shards=1, max_items=100_000, max_bytes=64 << 20,
                        flush_interval=0.0, sync_writes=shard.sync_writes)
    shard_set = ShardSet("messages", shard.path, options, [shard], executor)
    shard_set.feed.add_commit_listener(committed.append)
    backend = LocalBackend(shard_set)
    done = backend.buffers[0].add([Message(f"t/{i % 7}", b"x" * 10) for i in range(count)],
                                  10 * count, wait=True)
    assert done is not None
    await done
    await backend.close()
    return committed


def _stored_keys(shard: Shard, committed: list[CookedBatch]) -> int:
    family = shard.generations[committed[0].generation].data
    return sum(1 for _ in family.items())


def test_small_batch_is_written_on_the_loop(tmp_path: Path) -> None:
    shard = _open_shard(tmp_path)
    executor = CountingExecutor()
    committed = asyncio.run(_store(shard, executor, 10))
    assert executor.calls == []
    assert sum(c.message_count for c in committed) == 10
    assert _stored_keys(shard, committed) == sum(len(c.entries) for c in committed)


def test_large_batch_goes_to_the_executor(tmp_path: Path) -> None:
    shard = _open_shard(tmp_path)
    executor = CountingExecutor()
    committed = asyncio.run(_store(shard, executor, INLINE_WRITE_ENTRIES + 1))
    assert executor.calls == ["write"]
    assert _stored_keys(shard, committed) == sum(len(c.entries) for c in committed)


def test_synced_writes_never_block_the_loop(tmp_path: Path) -> None:
    shard = _open_shard(tmp_path, sync_writes=True)
    executor = CountingExecutor()
    asyncio.run(_store(shard, executor, 1))
    assert executor.calls == ["write"]


def test_a_replica_applies_a_small_committed_batch_on_the_loop(tmp_path: Path) -> None:
    """A replicated site applies a committed batch (its leader's own, a follower's
    copy) on the loop as a site without replication writes its flush: two executor
    hand-offs fewer on every replicated write's way to its acknowledgement. A large
    one goes to the executor."""
    leader = _open_shard(tmp_path / "leader")
    replica = _open_shard(tmp_path / "replica")
    executor = CountingExecutor()
    shard_set = ShardSet("messages", replica.path, DbOptions(n_shards=1), [replica], executor)
    small = CookedBatch.from_bytes(leader.prepare([Message("t/1", b"x")]).to_bytes())
    large = CookedBatch.from_bytes(leader.prepare(
        [Message(f"t/{number}", b"x") for number in range(INLINE_WRITE_ENTRIES + 1)]).to_bytes())

    async def apply_both() -> list[tuple[list[str], int]]:
        seen = []
        for offset, cooked in enumerate((small, large), start=1):
            await shard_set.write_applied(0, cooked, offset)
            seen.append((list(executor.calls), replica.applied_offset))
        return seen

    assert asyncio.run(apply_both()) == [([], 1), (["write"], 2)]
    assert _stored_keys(replica, [small]) >= INLINE_WRITE_ENTRIES + 2
    leader.close()
    replica.close()
