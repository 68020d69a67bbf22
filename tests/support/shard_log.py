"""Checks of a shard log's state shared by its tests."""

from __future__ import annotations

from stratamq.broker.ds.replication import ShardLog


def check_memory_matches_disk(log: ShardLog, site: str = "") -> None:
    """What the log serves from memory (`read_in_memory`, `epoch_at`) is what RocksDB
    holds; trimmed entries are not served (a reader of them needs a checkpoint)."""
    if log.first_offset > 1:
        assert log.read_in_memory(log.first_offset - 1) is None, site
    stored = {entry.position.offset: entry for entry in log.read_stored(log.first_offset, 10_000)}
    for offset in range(log.first_offset, log.last.offset + 2):
        if offset in stored:
            assert log.epoch_at(offset) == stored[offset].position.epoch, (site, offset)
        recent = log.read_in_memory(offset, max_entries=3)
        if recent is None:
            continue
        assert list(recent.entries) == log.read_stored(offset, 3), (site, offset)
        if offset - 1 in stored:
            assert recent.previous == stored[offset - 1].position, (site, offset)
        else:
            assert recent.previous.offset == offset - 1, (site, offset)
