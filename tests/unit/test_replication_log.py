"""The shard log (real RocksDB in a temporary folder) and the commit rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.broker.ds.replication import (
    START,
    Entry,
    Leadership,
    LogGapError,
    Position,
    ShardLog,
    StaleEpochError,
    commit_offset,
    majority,
)
from stratamq.broker.ds.replication.log import AppendResult, BootstrapNeededError


def batches(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def content(log: ShardLog) -> list[tuple[int, int, bytes]]:
    return [(entry.position.epoch, entry.position.offset, entry.batch)
            for entry in log.read(log.first_offset, 10_000)]


def test_leader_appends_at_the_next_offsets_and_it_survives_a_reopen(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    assert log.last == START and log.read(1) == []
    assert log.append_as_leader(1, batches("a", "b")) == [Position(1, 1), Position(1, 2)]
    assert log.append_as_leader(3, batches("c")) == [Position(3, 3)]
    log.close()
    log = ShardLog(tmp_path / "log")
    assert (log.epoch, log.last) == (3, Position(3, 3))
    assert content(log) == [(1, 1, b"a"), (1, 2, b"b"), (3, 3, b"c")]
    assert [entry.batch for entry in log.read(2, max_entries=1)] == [b"b"]
    # one entry at least, whatever max_bytes says
    assert len(log.read(1, max_bytes=1)) == 1


def test_older_epochs_are_refused(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    log.observe_epoch(5)
    with pytest.raises(StaleEpochError):
        log.append_as_leader(4, batches("x"))
    with pytest.raises(StaleEpochError):
        log.append_from_leader(4, START, [Entry(Position(4, 1), b"x")])
    with pytest.raises(StaleEpochError):
        log.observe_epoch(3)
    assert log.last == START
    log.close()
    assert ShardLog(tmp_path / "log").epoch == 5  # kept on disk


def test_a_follower_asks_for_what_it_lacks(tmp_path: Path) -> None:
    follower = ShardLog(tmp_path / "f")
    result = follower.append_from_leader(1, Position(1, 4), [Entry(Position(1, 5), b"e")])
    assert not result.accepted and result.retry_from == 1
    entries = [Entry(Position(1, offset), b"%d" % offset) for offset in range(1, 6)]
    result = follower.append_from_leader(1, START, entries)
    assert result.accepted and result.matched == 5 and follower.last == Position(1, 5)
    # a resend of what it holds changes nothing and cuts nothing
    result = follower.append_from_leader(1, Position(1, 1), entries[1:3])
    assert result.accepted and result.matched == 3 and follower.last == Position(1, 5)
    assert len(content(follower)) == 5


def test_a_divergent_tail_is_cut_against_a_new_leader(tmp_path: Path) -> None:
    follower = ShardLog(tmp_path / "f")
    follower.append_as_leader(1, batches("a", "b", "c", "d"))  # it led epoch 1, uncommitted tail
    # the leader of epoch 2 has a at 1, then its own entries from 2 on
    result = follower.append_from_leader(2, Position(2, 3), [Entry(Position(2, 4), b"z")])
    assert not result.accepted and result.retry_from == 1  # its whole epoch-1 run may differ
    result = follower.append_from_leader(2, Position(1, 1), [Entry(Position(2, 2), b"x"),
                                                              Entry(Position(2, 3), b"y")])
    assert result.accepted and result.matched == 3
    assert content(follower) == [(1, 1, b"a"), (2, 2, b"x"), (2, 3, b"y")]
    assert follower.last == Position(2, 3)
    follower.close()
    assert content(ShardLog(tmp_path / "f")) == [(1, 1, b"a"), (2, 2, b"x"), (2, 3, b"y")]


def test_every_entry_from_the_first_that_differs_is_written(tmp_path: Path) -> None:
    """Past the first entry that differs, an entry of the same epoch at the same
    offset (two leaders at one epoch: never planned, but a log must not make it
    worse) was left out of the write after the tail was cut: the log ended short of
    what it answered matched, or held a hole."""
    follower = ShardLog(tmp_path / "f")
    follower.append_as_leader(1, batches("a", "b"))
    follower.append_from_leader(2, Position(1, 2), [Entry(Position(2, 3), b"c")])
    # a leader of epoch 2 whose log has x at 2 and its own c at 3
    result = follower.append_from_leader(2, Position(1, 1), [Entry(Position(2, 2), b"x"),
                                                              Entry(Position(2, 3), b"c")])
    assert result.accepted and result.matched == 3
    assert content(follower) == [(1, 1, b"a"), (2, 2, b"x"), (2, 3, b"c")]
    assert follower.last == Position(2, 3)
    follower.close()


def test_trim_and_truncate(tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    log.append_as_leader(1, batches("a", "b", "c"))
    log.append_as_leader(2, batches("d", "e"))
    log.trim_before(3)
    assert log.first_offset == 3
    with pytest.raises(BootstrapNeededError, match="bootstrap from a checkpoint") as raised:
        log.read(2)
    assert raised.value.first_offset == 3
    assert [entry.batch for entry in log.read(3)] == [b"c", b"d", b"e"]
    log.truncate_after(4)
    assert log.last == Position(2, 4)
    with pytest.raises(LogGapError):
        log.truncate_after(1)
    log.trim_before(10)  # everything, up to the end
    assert (log.first_offset, log.last, log.read(5)) == (5, Position(2, 4), [])
    log.close()
    log = ShardLog(tmp_path / "log")
    assert (log.first_offset, log.last) == (5, Position(2, 4))
    # a follower append that starts right after the trimmed end still lines up
    assert log.append_from_leader(2, Position(2, 4), [Entry(Position(2, 5), b"f")]).accepted
    assert log.epoch_at(4) == 2 and log.epoch_at(3) is None


def test_commit_needs_a_majority_of_the_leaders_epoch() -> None:
    epochs = {1: 1, 2: 1, 3: 2, 4: 2}
    sites = ["a", "b", "c"]
    assert majority(1) == 1 and majority(3) == 2 and majority(4) == 3 and majority(5) == 3
    # a alone holds 4: not a majority; a and b hold 3 (epoch 2): committed
    assert commit_offset(2, sites, {"a": 4, "b": 3, "c": 0}, epochs.get, 0) == 3
    # a majority holds 2, but 2 is of epoch 1: a leader of epoch 2 may not count it
    assert commit_offset(2, sites, {"a": 4, "b": 2, "c": 1}, epochs.get, 0) == 0
    # never back
    assert commit_offset(2, sites, {"a": 4, "b": 0, "c": 0}, epochs.get, 3) == 3
    assert commit_offset(2, ["a"], {"a": 4}, epochs.get, 0) == 4
    with pytest.raises(ValueError):
        commit_offset(2, [], {}, epochs.get, 0)


def test_leadership_of_one_replica_commits_at_once_and_steps_down_when_fenced(
        tmp_path: Path) -> None:
    log = ShardLog(tmp_path / "log")
    with pytest.raises(ValueError):
        Leadership.begin("b", 1, log, ("a",))
    leadership = Leadership.begin("a", 1, log, ("a",))
    assert leadership.append(batches("x", "y")) == [Position(1, 1), Position(1, 2)]
    assert leadership.committed == 2
    log.observe_epoch(2)  # the controller made another site leader
    assert not leadership.current
    with pytest.raises(StaleEpochError):
        leadership.append(batches("z"))


def test_a_follower_that_lacks_what_it_answered_matched_before_counts_no_more(
        tmp_path: Path) -> None:
    """A follower that once matched the leader's log up to some offset, then answers
    that it lacks entries below it (its copy was replaced, say), is counted as
    holding only what comes before them: it stood in for copies nobody had."""
    log = ShardLog(tmp_path / "a")
    leadership = Leadership.begin("a", 1, log, ("a", "b", "c"))
    leadership.append(batches("x", "y", "z"))
    leadership.on_result("b", AppendResult(True, 3, Position(1, 3)))
    assert leadership.matched["b"] == 3 and leadership.committed == 3
    leadership.on_result("b", AppendResult(False, 0, START, retry_from=1))
    assert leadership.matched["b"] == 0 and leadership.next_offset["b"] == 1
    assert leadership.committed == 3  # what was committed stays so


def test_a_leader_counts_its_own_copy_towards_a_majority_once_synced(
        tmp_path: Path) -> None:
    """The leader ships an entry while it syncs its own copy: until synced, that copy
    is not one of the majority (a power loss would take it); the followers' are, as
    they answer only once theirs are on disk."""
    log, b, c = (ShardLog(tmp_path / name) for name in "abc")
    leadership = Leadership.begin("a", 1, log, ("a", "b", "c"))
    assert leadership.append(batches("x"), sync=False) == [Position(1, 1)]
    assert (log.last.offset, log.durable) == (1, 0)
    request = leadership.request_for("b")
    leadership.on_result("b", b.append_from_leader(request.epoch, request.previous,
                                                   request.entries))
    assert leadership.committed == 0  # b's copy and an unsynced one: not two on disk
    log.sync()
    assert log.durable == 1 and leadership.advance() == 1
    # or the two followers' copies, the leader's still unsynced
    leadership.append(batches("y"), sync=False)
    for follower, follower_log in (("b", b), ("c", c)):
        request = leadership.request_for(follower)
        leadership.on_result(follower, follower_log.append_from_leader(
            request.epoch, request.previous, request.entries))
    assert (leadership.committed, log.durable) == (2, 1)


def test_an_unsynced_append_of_a_former_leader_is_synced_before_it_counts(
        tmp_path: Path) -> None:
    """A leader's own append, written but not synced when it stepped down, is held
    already when the next leader sends the same entry: the answer that counts it is
    given once it is on disk."""
    log = ShardLog(tmp_path / "a")
    log.append_as_leader(1, batches("x"), sync=False)
    assert log.durable == 0
    result = log.append_from_leader(2, START, [Entry(Position(1, 1), b"x")])
    assert result.accepted and result.matched == 1
    assert log.durable == 1


def test_a_synced_write_puts_what_was_written_before_it_on_disk(tmp_path: Path) -> None:
    """A cut of the tail (synced) makes the unsynced entries it keeps durable; a sync
    reaches what was written before it."""
    log = ShardLog(tmp_path / "a")
    log.append_as_leader(1, batches("x", "y", "z"), sync=False)
    log.truncate_after(1)  # synced: all before it on disk, the tail cut
    assert (log.last.offset, log.durable) == (1, 1)
    log.append_as_leader(1, batches("y2"), sync=False)
    assert log.durable == 1
    log.sync()
    assert log.durable == 2


def test_leadership_sends_followers_what_they_lack(tmp_path: Path) -> None:
    leader_log, follower_log = ShardLog(tmp_path / "a"), ShardLog(tmp_path / "b")
    follower_log.append_as_leader(1, batches("a", "stale"))  # it led epoch 1 once
    leader_log.append_from_leader(1, START, follower_log.read(1, max_entries=1))
    leadership = Leadership.begin("a", 2, leader_log, ("a", "b", "c"))
    leadership.append(batches("b"))  # (2, 2)
    assert leadership.committed == 0  # one of three
    for _ in range(3):
        request = leadership.request_for("b")
        leadership.on_result("b", follower_log.append_from_leader(
            request.epoch, request.previous, request.entries))
    assert leadership.committed == 2 and leadership.matched == {"b": 2}
    assert content(follower_log) == [(1, 1, b"a"), (2, 2, b"b")]
    leader_log.trim_before(3)
    leadership.next_offset["c"] = 1
    with pytest.raises(BootstrapNeededError):
        leadership.request_for("c")  # c needs a checkpoint first


def test_a_leader_counts_how_long_no_majority_has_answered_it(tmp_path: Path) -> None:
    three = Leadership.begin("a", 1, ShardLog(tmp_path / "3"), ("a", "b", "c"), now=10.0)
    assert three.quorum_age(11.0) == 1.0  # nobody heard yet: counted from the start
    three.heard_from("b", 12.0)
    assert three.quorum_age(12.5) == 0.5  # a and b are a majority of three
    three.heard_from("b", 11.0)  # a late answer does not move it back
    assert three.quorum_age(20.0) == 8.0
    three.heard_from("c", 19.0)
    assert three.quorum_age(20.0) == 1.0
    five = Leadership.begin("a", 1, ShardLog(tmp_path / "5"), tuple("abcde"), now=0.0)
    five.heard_from("b", 9.0)
    assert five.quorum_age(10.0) == 10.0  # a and b are not three of five
    five.heard_from("e", 7.0)
    assert five.quorum_age(10.0) == 3.0  # a, b and e: the oldest of them counts
    alone = Leadership.begin("a", 1, ShardLog(tmp_path / "1"), ("a",), now=0.0)
    assert alone.quorum_age(100.0) == 0.0  # a majority by itself


def test_a_leader_confirms_it_leads_only_by_answers_to_requests_sent_after_a_read(
        tmp_path: Path) -> None:
    """Issue 22, "a deposed leader answers reads": what proves leadership for a read
    that began at some moment is a majority answering requests sent from then on; an
    answer that arrives later to a request sent earlier proves nothing of that moment."""
    three = Leadership.begin("a", 1, ShardLog(tmp_path / "3"), ("a", "b", "c"), now=0.0)
    assert not three.confirmed_since(5.0)
    three.confirmed_by("b", 4.9)  # sent before the read began
    assert not three.confirmed_since(5.0)
    three.confirmed_by("c", 5.0)
    assert three.confirmed_since(5.0) and not three.confirmed_since(5.1)
    three.confirmed_by("c", 3.0)  # a late answer to an older request: no step back
    assert three.confirmed_since(5.0)
    five = Leadership.begin("a", 1, ShardLog(tmp_path / "5"), tuple("abcde"), now=0.0)
    five.confirmed_by("b", 7.0)
    assert not five.confirmed_since(6.0)  # a and b are not three of five
    five.confirmed_by("e", 6.5)
    assert five.confirmed_since(6.0) and not five.confirmed_since(7.0)
    alone = Leadership.begin("a", 1, ShardLog(tmp_path / "1"), ("a",), now=0.0)
    assert alone.confirmed_since(100.0)  # a majority by itself


def test_a_follower_commits_only_what_is_known_to_be_the_leaders(tmp_path: Path) -> None:
    follower = ShardLog(tmp_path / "f")
    follower.append_as_leader(1, batches("a", "b", "stale"))  # (1, 3) never committed
    # the leader of epoch 2 has (1, 1), (1, 2), (2, 3), committed up to 3; it sends 2
    result = follower.append_from_leader(2, Position(1, 1), [Entry(Position(1, 2), b"b")],
                                         committed=3)
    assert result.accepted and result.matched == 2
    assert follower.committed == 2  # not 3: its own (1, 3) is not the leader's
    result = follower.append_from_leader(2, Position(1, 2), [Entry(Position(2, 3), b"c")],
                                         committed=3)
    assert follower.committed == 3 and content(follower)[-1] == (2, 3, b"c")
    follower.append_from_leader(2, Position(2, 3), [], committed=1)
    assert follower.committed == 3  # never back


def test_a_follower_refuses_to_cut_committed_entries_and_counts_it(tmp_path: Path) -> None:
    """Issue 22, "log invariants": a leader whose log lacks entries this follower
    knows committed (a bug, or a leader elected on stale positions) must not make it
    drop them silently."""
    from stratamq.broker.ds import metrics
    from stratamq.broker.ds.replication.log import CommittedCutError

    log = ShardLog(tmp_path / "log", labels=("db", "0"))
    assert log.append_from_leader(1, START, [Entry(Position(1, 1), b"a"),
                                             Entry(Position(1, 2), b"b")], committed=2).accepted
    assert log.committed == 2
    refused = metrics.LOG_CUTS_REFUSED.labels("db", "0")
    before = refused._value.get()
    with pytest.raises(CommittedCutError):
        log.append_from_leader(2, Position(1, 1), [Entry(Position(2, 2), b"other")])
    assert content(log) == [(1, 1, b"a"), (1, 2, b"b")]
    assert refused._value.get() == before + 1
    with pytest.raises(CommittedCutError):
        log.truncate_after(1)
    assert content(log) == [(1, 1, b"a"), (1, 2, b"b")]
    # an uncommitted tail is still cut as before
    log.append_from_leader(2, Position(1, 2), [Entry(Position(2, 3), b"c")], committed=2)
    assert log.append_from_leader(3, Position(1, 2), [Entry(Position(3, 3), b"d")]).accepted
    assert content(log)[-1] == (3, 3, b"d")
