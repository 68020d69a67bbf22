"""The placement document: immutable, canonical, readable JSON that round-trips, and
bad documents refused with an error that says where the problem is."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError
from typing import Any

import pytest

from stratamq.broker.ds.replication import (
    Placement,
    ShardPlacement,
    Transition,
    apply_transition,
)
from stratamq.broker.errors import LastReplicaError, PlacementError


def shard(database: str, number: int, replicas: str, leader: str,
          epoch: int = 1) -> ShardPlacement:
    return ShardPlacement(database=database, shard=number, replicas=tuple(replicas),
                          leader=leader, epoch=epoch)


def sample() -> Placement:
    return Placement(version=7, shards=(
        shard("sessions", 0, "AC", "C", 4),
        shard("messages", 1, "CB", "B"),
        shard("messages", 0, "BA", "A", 2),
    ))


def document() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(sample().to_json())
    return result


def test_shards_are_kept_in_order_with_sorted_replica_sets() -> None:
    placement = sample()
    assert [s.id for s in placement] == [("messages", 0), ("messages", 1), ("sessions", 0)]
    assert placement.shard("messages", 1).replicas == ("B", "C")
    assert placement.databases() == ("messages", "sessions")
    assert placement.n_shards("messages") == 2
    assert placement.n_shards("retained") == 0
    assert placement.sites() == {"A", "B", "C"}
    # The same placement spelled in another order is the same placement.
    assert placement == Placement(version=7, shards=tuple(reversed(placement.shards)))
    assert hash(placement) == hash(Placement(version=7, shards=placement.shards))


def test_constructors_check_their_fields() -> None:
    with pytest.raises(PlacementError, match="messages/0: replicas must be a tuple of site "
                                             "ids, not list"):
        ShardPlacement("messages", 0, ["A"], "A", 1)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="messages/0: epoch: -1 is not a whole number"):
        ShardPlacement("messages", 0, ("A",), "A", -1)
    with pytest.raises(PlacementError, match="shards must be a tuple"):
        Placement(version=1, shards=[])  # type: ignore[arg-type]


def test_placement_is_immutable() -> None:
    placement = sample()
    with pytest.raises(FrozenInstanceError):
        placement.version = 8  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        placement.shards[0].leader = "B"  # type: ignore[misc]


def test_json_is_one_line_per_shard_and_round_trips() -> None:
    text = sample().to_json()
    assert text.splitlines()[:5] == ["{", '  "format": 1,', '  "version": 7,',
                                     '  "databases": {', '    "messages": [']
    assert ('      {"shard": 1, "replicas": ["B", "C"], "leader": "B", "epoch": 1}'
            in text.splitlines())
    assert Placement.from_json(text) == sample()
    assert Placement.from_json(text.encode()) == sample()
    assert Placement.from_json(Placement.empty().to_json()) == Placement.empty()


@pytest.mark.parametrize(("change", "error"), [
    (lambda d: d.update(version=-1), r"placement: version: -1 is not a whole number"),
    (lambda d: d.update(version=True), r"placement: version: True is not"),
    (lambda d: d.update(format=2), r"format 2 is not 1"),
    (lambda d: d.pop("databases"), r"placement: missing databases"),
    (lambda d: d.update(extra=1), r"unknown key\(s\) extra"),
    (lambda d: d.update(databases=[]), r"placement: databases: expected an object, got list"),
    (lambda d: d["databases"].update(Messages=[]), r"'Messages' is not a database name"),
    (lambda d: d["databases"].update(messages={}),
     r"databases.messages: expected a list of shards, got dict"),
    (lambda d: d["databases"]["messages"][1].update(leader="D"),
     r"databases.messages\[1\]: messages/1: the leader 'D' is not one of its replicas"),
    (lambda d: d["databases"]["messages"][1].update(replicas=["B", "B"]),
     r"messages/1: a site appears twice"),
    (lambda d: d["databases"]["messages"][1].update(replicas=[]),
     r"messages/1: the replica set is empty"),
    (lambda d: d["databases"]["messages"][1].update(replicas="BC"),
     r"messages\[1\].replicas: expected a list of site ids, got str"),
    (lambda d: d["databases"]["messages"][1].update(replicas=["B", "a b"]),
     r"messages\[1\].replicas: 'a b' is not a site id"),
    (lambda d: d["databases"]["messages"][1].update(epoch="3"),
     r"messages\[1\].epoch: '3' is not a whole number"),
    (lambda d: d["databases"]["messages"][1].pop("leader"),
     r"databases.messages\[1\]: missing leader"),
    (lambda d: d["databases"]["messages"][1].update(shard=2),
     r"database messages has shards 0..2 but not \[1\]"),
    (lambda d: d["databases"]["messages"][1].update(shard=0),
     r"messages/0 appears twice"),
])
def test_bad_documents_are_refused_saying_where(change: Any, error: str) -> None:
    bad = document()
    change(bad)
    with pytest.raises(PlacementError, match=error):
        Placement.from_json(json.dumps(bad))


@pytest.mark.parametrize("text", ["", "{", '{"format": 1, "version": 3, "datab', "[1, 2]", "null"])
def test_truncated_or_foreign_text_is_refused(text: str) -> None:
    with pytest.raises(PlacementError, match="placement: "):
        Placement.from_json(text)


def test_adding_then_removing_the_leader_hands_over_with_a_new_epoch() -> None:
    placement = sample()
    added = apply_transition(placement, Transition("messages", 0, "add", "C"))
    assert added.version == 8
    assert added.shard("messages", 0) == shard("messages", 0, "ABC", "A", 2)
    removed = apply_transition(added, Transition("messages", 0, "remove", "A", leader="C"))
    assert removed.version == 9
    assert removed.shard("messages", 0) == shard("messages", 0, "BC", "C", 3)
    # Other shards are untouched.
    assert removed.shard("messages", 1) == placement.shard("messages", 1)
    follower_gone = apply_transition(removed, Transition("messages", 0, "remove", "B"))
    assert follower_gone.shard("messages", 0) == shard("messages", 0, "C", "C", 3)


@pytest.mark.parametrize(("transition", "error", "kind"), [
    (Transition("messages", 0, "add", "A"), "A already holds messages/0", PlacementError),
    (Transition("messages", 0, "remove", "C"), "C holds no replica", PlacementError),
    (Transition("messages", 0, "remove", "A"), "must name the replica that takes over",
     PlacementError),
    (Transition("messages", 0, "remove", "A", leader="C"), "not one of the remaining",
     PlacementError),
    (Transition("messages", 0, "remove", "B", leader="A"), "B is not the leader",
     PlacementError),
    (Transition("messages", 5, "add", "C"), "has no shard messages/5", PlacementError),
    (Transition("retained", 0, "add", "C"), "has no shard retained/0", PlacementError),
])
def test_steps_that_do_not_fit_are_refused(transition: Transition, error: str,
                                           kind: type[Exception]) -> None:
    with pytest.raises(kind, match=error):
        apply_transition(sample(), transition)


def test_the_last_replica_is_never_removed() -> None:
    placement = Placement(version=1, shards=(shard("messages", 0, "A", "A"),))
    with pytest.raises(LastReplicaError, match="A holds the last replica of messages/0"):
        apply_transition(placement, Transition("messages", 0, "remove", "A", leader="B"))


def test_transition_is_checked_and_reads_as_plus_minus_site() -> None:
    assert str(Transition("messages", 3, "add", "B")) == "messages/3: +B"
    assert (str(Transition("messages", 3, "remove", "A", leader="C"))
            == "messages/3: -A (leader -> C)")
    with pytest.raises(PlacementError, match="only a removal names a new leader"):
        Transition("messages", 3, "add", "B", leader="C")
    with pytest.raises(PlacementError, match="only a removal names a new leader"):
        Transition("messages", 3, "remove", "B", leader="B")
    with pytest.raises(PlacementError, match="action 'move' is not add or remove"):
        Transition("messages", 3, "move", "B")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="shard: -1 is not a whole number"):
        Transition("messages", -1, "add", "B")
