"""A durable write of a shard log or a shard (real RocksDB) is put on disk by
`flush_wal(True)` after it, never by a write with `sync=True`: rocksdict holds the GIL
through such a write's fsync, which froze the site's event loop and every other
thread for as long as the disk took; `flush_wal` lets go of it while it syncs. That
what is synced this way survives a power loss is the power-loss tests' part
(`tests/integration/test_cluster_trim_power_loss.py`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratamq.broker.ds.message import Message
from stratamq.broker.ds.replication import Entry, Position, ShardLog
from stratamq.broker.ds.shard import Shard
from tests.support.rocks_calls import NotedRocks


def test_the_log_syncs_each_durable_write_after_it(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    notes = NotedRocks(log._db)
    log._db = notes  # type: ignore[assignment]
    log.observe_epoch(2)
    assert notes.taken() == ["put", "flush_wal(True)"]
    log.append_as_leader(2, [b"a", b"b", b"c"])
    assert notes.taken() == ["write", "flush_wal(True)"]
    assert log.durable == 3
    log.append_as_leader(2, [b"d"], sync=False)
    assert notes.taken() == ["write"] and log.durable == 3
    log.truncate_after(3)
    assert notes.taken() == ["write", "flush_wal(True)"]
    assert log.append_from_leader(3, Position(2, 3), [Entry(Position(3, 4), b"e")]).accepted
    assert notes.taken() == ["put", "flush_wal(True)", "write", "flush_wal(True)"]
    log.trim_before(2)
    assert notes.taken() == ["write", "flush_wal(True)"]
    log.reset_to(Position(3, 10))
    assert notes.taken() == ["write", "flush_wal(True)"]
    log.close()


def test_a_shard_syncs_each_durable_write_after_it(tmp_path: Path) -> None:
    shard = Shard(tmp_path / "shard", 0, "wildcard_optimized_v2", {}, (2,), sync_writes=True)
    notes = NotedRocks(shard._db)
    shard._db = notes  # type: ignore[assignment]
    cooked = shard.prepare([Message("a/1", b"x")], [(b"k", b"v")])
    shard.write(cooked, applied=1)
    shard.apply(cooked, applied=1)
    assert notes.taken() == ["write", "flush_wal(True)"]
    shard.record_applied(2)
    assert notes.taken() == ["write", "flush_wal(True)"]
    shard.set_topic_seed(["a/+"], applied=3)
    assert notes.taken() == ["write", "flush_wal(True)"]
    shard.close()

    unsynced = Shard(tmp_path / "unsynced", 0, "wildcard_optimized_v2", {}, (2,),
                     sync_writes=False)
    notes = NotedRocks(unsynced._db)
    unsynced._db = notes  # type: ignore[assignment]
    unsynced.write(unsynced.prepare([Message("a/1", b"x")], []), applied=1)
    unsynced.set_topic_seed(["a/+"], applied=2)  # synced whatever sync_writes says
    assert notes.taken() == ["write", "write", "flush_wal(True)"]
    unsynced.close()


class SlowDisk(NotedRocks):
    """A sync that takes until `go_on` is set (`syncing` is set once it started)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.syncing, self.go_on = threading.Event(), threading.Event()

    def flush_wal(self, sync: bool) -> None:
        self.syncing.set()
        self.go_on.wait(10)
        super().flush_wal(sync)


def closes_only_after_the_sync_in_flight(sync: Callable[[], object],
                                         close: Callable[[], None], disk: SlowDisk) -> None:
    """`sync` on one thread, then `close` on another while the sync is under way (a
    sync whose task was cancelled as its site stops goes on in its executor thread):
    the close waits for it, and the sync fails nothing."""
    failed: list[BaseException] = []

    def run_sync() -> None:
        try:
            sync()
        except BaseException as error:  # what the test looks for
            failed.append(error)

    syncing = threading.Thread(target=run_sync)
    syncing.start()
    assert disk.syncing.wait(10)
    closing = threading.Thread(target=close)
    closing.start()
    closing.join(0.3)
    waited = closing.is_alive()
    disk.go_on.set()
    syncing.join(10)
    closing.join(10)
    assert waited and failed == []


def test_a_log_closes_only_after_a_sync_in_flight(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    log.append_as_leader(1, [b"a"], sync=False)
    disk = SlowDisk(log._db)
    log._db = disk  # type: ignore[assignment]
    closes_only_after_the_sync_in_flight(log.sync, log.close, disk)
    assert log.durable == 1


def test_a_shard_closes_only_after_a_sync_in_flight(tmp_path: Path) -> None:
    shard = Shard(tmp_path / "shard", 0, "wildcard_optimized_v2", {}, (2,), sync_writes=False)
    disk = SlowDisk(shard._db)
    shard._db = disk  # type: ignore[assignment]
    closes_only_after_the_sync_in_flight(shard.sync_applied, shard.close, disk)
