"""What a shard log may trim, the log's start across a reopen, a checkpoint's reset of
the log, and the install of a shard folder after a crash at each step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratamq.broker.ds.install import recover_shard_folder, staged_folder, swap_in_staged
from stratamq.broker.ds.replication import Entry, Leadership, Position, ShardLog
from stratamq.broker.ds.replication.bootstrap import MARKER, finish_install, should_bootstrap
from stratamq.broker.ds.replication.log import BootstrapNeededError
from stratamq.broker.ds.replication.trim import follower_trim_point, leader_trim_point

SET = ("a", "b", "c")


def test_the_leader_trims_below_every_replica_and_itself_keeping_the_tail() -> None:
    assert leader_trim_point("a", SET, {"b": 500, "c": 300}, 400, 100) == 201
    assert leader_trim_point("a", SET, {"b": 500, "c": 300}, 250, 100) == 151
    assert leader_trim_point("a", SET, {"b": 500, "c": 300}, 400, 0) == 301
    # a follower not heard from yet (new to the set, or after a failover) holds nothing
    assert leader_trim_point("a", SET, {"b": 500}, 400, 100) == 1
    # a site that left the set no longer holds trimming back
    assert leader_trim_point("a", ("a", "b"), {"b": 500, "c": 3}, 400, 100) == 301
    assert leader_trim_point("a", ("a",), {}, 50, 100) == 1


def test_a_follower_trims_what_the_leader_said_and_it_applied() -> None:
    assert follower_trim_point(200, 500) == 200
    assert follower_trim_point(200, 120) == 121
    assert follower_trim_point(0, 500) == 1


def test_when_a_follower_bootstraps() -> None:
    assert should_bootstrap(next_offset=5, first_offset=10, last_offset=50, retain=100)
    assert not should_bootstrap(next_offset=10, first_offset=10, last_offset=50, retain=100)
    # new to the shard: a checkpoint once the log is longer than the kept tail
    assert should_bootstrap(next_offset=1, first_offset=1, last_offset=101, retain=100)
    assert not should_bootstrap(next_offset=1, first_offset=1, last_offset=100, retain=100)


def test_the_log_start_survives_a_reopen_and_bounded_trims(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    log.append_as_leader(1, [b"x"] * 10)
    log.append_as_leader(2, [b"y"] * 10)
    log.trim_before(15, max_entries=4)
    assert log.first_offset == 5
    log.trim_before(15, max_entries=100)
    assert log.first_offset == 15
    log.close()
    log = ShardLog(tmp_path / "log")
    assert (log.first_offset, log.last, log.epoch_at(14)) == (15, Position(2, 20), 2)
    with pytest.raises(BootstrapNeededError):
        log.read(14)
    assert [entry.position.offset for entry in log.read(15)] == list(range(15, 21))
    # a leader whose follower needs trimmed entries asks for a bootstrap
    leadership = Leadership.begin("a", 2, log, ("a", "b"))
    leadership.next_offset["b"] = 3
    with pytest.raises(BootstrapNeededError) as raised:
        leadership.request_for("b")
    assert raised.value.first_offset == 15
    log.close()


def test_a_checkpoint_resets_the_log_to_its_position(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    log.append_as_leader(1, [b"x"] * 3)
    log.reset_to(Position(4, 1000))
    assert (log.first_offset, log.last, log.committed, log.epoch) == (
        1001, Position(4, 1000), 1000, 4)
    assert log.read(1001) == []
    log.close()
    log = ShardLog(tmp_path / "log")
    assert (log.first_offset, log.last, log.epoch) == (1001, Position(4, 1000), 4)
    # the leader's next entries line up after it
    result = log.append_from_leader(4, Position(4, 1000), [Entry(Position(4, 1001), b"z")])
    assert result.accepted and log.last == Position(4, 1001)
    log.close()


def test_finish_install_resets_the_log_once(tmp_path: Path) -> None:
    shard = tmp_path / "0"
    shard.mkdir()
    log = ShardLog(tmp_path / "log")
    log.append_as_leader(1, [b"x"] * 3)
    assert finish_install(shard, log) is None
    (shard / MARKER).write_text(json.dumps({"epoch": 2, "offset": 50}))
    assert finish_install(shard, log) == Position(2, 50)
    assert not (shard / MARKER).exists() and log.last == Position(2, 50)
    log.close()


def _folder(path: Path, content: str) -> None:
    path.mkdir()
    (path / "data").write_text(content)


@pytest.mark.parametrize("crash_after", ["staged", "renamed_old", "swapped"])
def test_an_interrupted_install_leaves_the_old_shard_or_the_new(tmp_path: Path,
                                                                crash_after: str) -> None:
    shard = tmp_path / "0"
    old = tmp_path / "0.old"
    _folder(shard, "old")
    _folder(staged_folder(shard), "new")
    if crash_after in ("renamed_old", "swapped"):
        shard.rename(old)
    if crash_after == "swapped":
        staged_folder(shard).rename(shard)
    recover_shard_folder(shard)
    expected = "new" if crash_after == "swapped" else "old"
    assert (shard / "data").read_text() == expected
    assert not old.exists() and not staged_folder(shard).exists()


def test_swap_in_staged(tmp_path: Path) -> None:
    shard = tmp_path / "0"
    _folder(shard, "old")
    _folder(staged_folder(shard), "new")
    swap_in_staged(shard)
    assert (shard / "data").read_text() == "new"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["0"]
