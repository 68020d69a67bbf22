"""Shard digests (`ds/digest.py`) on real RocksDB shards, and how `ctl ds verify`
judges the replicas' answers (`admin/verify.py`)."""

from __future__ import annotations

import time
from pathlib import Path

from stratamq.broker.admin.verify import Answer, judge
from stratamq.broker.ds.digest import digest_folder
from stratamq.broker.ds.message import Message
from stratamq.broker.ds.shard import Shard


def shard_digest(shard: Shard, folder: Path) -> str:
    shard.checkpoint(folder)
    return digest_folder(folder)[0]


def make_shard(path: Path) -> Shard:
    return Shard(path, 0, "wildcard_optimized_v2", {}, (2,), sync_writes=False)


def test_replicas_that_applied_the_same_batches_have_the_same_digest(tmp_path: Path) -> None:
    leader = make_shard(tmp_path / "leader")
    time.sleep(0.002)  # the first generation starts at each site's own clock
    follower = make_shard(tmp_path / "follower")
    assert leader.current.info.since != follower.current.info.since
    for offset, topic in enumerate(["a/1", "a/2", "b/1"], start=1):
        cooked = leader.prepare([Message(topic, topic.encode())], [(b"k", topic.encode())])
        leader.write(cooked, applied=offset)
        leader.apply(cooked, applied=offset)
        follower.write(cooked, applied=offset)
        follower.apply(cooked, applied=offset)
    leader.add_generation(at=leader.last_timestamp + 1, applied=4)
    follower.add_generation(at=leader.last_timestamp + 1, applied=4)
    same = shard_digest(leader, tmp_path / "c1")
    assert same == shard_digest(follower, tmp_path / "c2")
    follower.gc_write(1, [], [(b"k", b"other")], applied=4)
    assert shard_digest(follower, tmp_path / "c3") != same
    leader.close()
    follower.close()


def test_judge_names_the_replica_outside_the_majority() -> None:
    verdict = judge("m/0", {"a": Answer(5, "x"), "b": Answer(5, "y"), "c": Answer(5, "x")})
    assert (verdict.status, verdict.digest, verdict.odd) == ("differ", "x", ("b",))


def test_judge_names_every_replica_when_no_digest_has_a_majority() -> None:
    verdict = judge("m/0", {"a": Answer(5, "x"), "b": Answer(5, "y")})
    assert (verdict.status, verdict.odd) == ("differ", ("a", "b"))


def test_judge_compares_only_at_one_offset_and_names_the_unreachable() -> None:
    assert judge("m/0", {"a": Answer(5, "x"), "b": Answer(4, "y")}).odd == ("b",)
    assert judge("m/0", {"a": Answer(5, "x"), "b": Answer(4, "y")}).status == "unsettled"
    gone = judge("m/0", {"a": Answer(5, "x"), "b": Answer(error="refused")})
    assert (gone.status, gone.odd) == ("unreachable", ("b",))
    assert judge("m/0", {"a": Answer(5, "x"), "b": Answer(5, "x")}).status == "same"
