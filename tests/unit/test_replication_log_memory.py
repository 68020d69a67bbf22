"""The newest entries a shard log keeps in memory (`ShardLog.read_in_memory`): a
leader ships them to followers right behind it, and applies them, without reading
them back from RocksDB. Whatever the log goes through (appends of any size, a
divergent tail cut, truncates, trims, a checkpoint's reset), memory agrees with disk,
and holds no more than RECENT_ENTRIES and RECENT_BYTES."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratamq.broker.ds.replication import Entry, Position, ShardLog
from stratamq.broker.ds.replication.log import RECENT_BYTES, RECENT_ENTRIES
from tests.support.shard_log import check_memory_matches_disk

SIZES = st.sampled_from([1, 100, 4096, RECENT_BYTES // 3, RECENT_BYTES + 1])
operation = st.one_of(
    st.tuples(st.just("lead"), st.lists(SIZES, min_size=1, max_size=RECENT_ENTRIES // 2)),
    # a new leader's entries from `back` entries before this log's end on (a cut)
    st.tuples(st.just("follow"), st.integers(0, 5), st.lists(SIZES, min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), st.integers(0, 5)),
    st.tuples(st.just("trim"), st.integers(0, 80)),
    st.tuples(st.just("reset"), st.integers(0, 3)),
)


def check_bounded(log: ShardLog) -> None:
    """Memory holds at most RECENT_ENTRIES entries of RECENT_BYTES in all."""
    oldest = next((offset for offset in range(log.first_offset, log.last.offset + 1)
                   if log.read_in_memory(offset) is not None), None)
    if oldest is None:
        return
    held = log.read_in_memory(oldest, max_entries=10_000, max_bytes=10 * RECENT_BYTES)
    assert held is not None
    assert len(held.entries) <= RECENT_ENTRIES
    assert sum(len(entry.batch) for entry in held.entries) <= RECENT_BYTES


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, max_size=30))
def test_memory_holds_what_disk_holds(operations: list[tuple]) -> None:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as folder:
        log = ShardLog(Path(folder) / "log")
        epoch = 1
        try:
            for number, (kind, *args) in enumerate(operations):
                if kind == "lead":
                    log.append_as_leader(epoch, [bytes([number % 256]) * size
                                                 for size in args[0]], sync=number % 2 == 0)
                    # what was just written is served from memory, unless too big
                    if args[0][-1] <= RECENT_BYTES:
                        assert log.read_in_memory(log.last.offset) is not None
                elif kind == "follow":
                    epoch += 1
                    keep = max(log.last.offset - args[0], log.first_offset - 1, log.committed)
                    previous = Position(log.epoch_at(keep) or 0, keep)
                    entries = [Entry(Position(epoch, keep + 1 + k), bytes([number % 256]) * size)
                               for k, size in enumerate(args[1])]
                    assert log.append_from_leader(epoch, previous, entries).accepted
                elif kind == "truncate":
                    log.truncate_after(max(log.last.offset - args[0], log.first_offset - 1,
                                           log.committed))
                elif kind == "trim":
                    log.trim_before(log.first_offset + args[0])
                else:
                    log.reset_to(Position(epoch, log.last.offset + args[0]))
                check_memory_matches_disk(log)
                check_bounded(log)
        finally:
            log.close()


def test_a_leaders_newest_entries_come_from_memory(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    log.append_as_leader(1, [b"a", b"b"])
    log.append_as_leader(1, [b"c"], sync=False)
    recent = log.read_in_memory(2)
    assert recent is not None
    assert recent.previous == Position(1, 1)
    assert [entry.batch for entry in recent.entries] == [b"b", b"c"]
    past_the_end = log.read_in_memory(4)  # nothing to read yet, as on disk
    assert past_the_end is not None and past_the_end.entries == ()
    # a reopened log holds nothing in memory: it reads from disk
    log.close()
    log = ShardLog(tmp_path / "log")
    assert log.read_in_memory(3) is None
    assert [entry.batch for entry in log.read(2)] == [b"b", b"c"]
    log.close()
