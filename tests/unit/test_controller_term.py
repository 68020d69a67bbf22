"""The controller term (issue 22): its order and parsing, the sites' acceptance rule
and its file (`broker/ds/replication/term.py`), and the controller's pure choices
(`broker/controller/terms.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.broker.controller import terms
from stratamq.broker.ds.replication import Placement, ShardPlacement
from stratamq.broker.ds.replication.term import (
    NO_TERM,
    TERM_FILE,
    ControllerTerm,
    TermStore,
    admits,
    next_term,
    parse_term,
)
from stratamq.broker.errors import CorruptDataError, PlacementError


def test_terms_order_by_number_then_controller_id() -> None:
    assert NO_TERM < ControllerTerm(1, "b") < ControllerTerm(2, "a") < ControllerTerm(2, "c")
    assert max(ControllerTerm(3, "aa"), ControllerTerm(3, "ab")) == ControllerTerm(3, "ab")


def test_parse_term_reads_its_json_and_none_is_term_0() -> None:
    assert parse_term(None) == NO_TERM
    assert parse_term([0, ""]) == NO_TERM
    assert parse_term(ControllerTerm(7, "c1").to_json()) == ControllerTerm(7, "c1")
    for bad in ([1], [-1, "a"], [1, ""], [0, "a"], [True, "a"], "1/a", [1, "a b"]):
        with pytest.raises(PlacementError, match="term"):
            parse_term(bad)


def test_a_starting_controller_takes_a_number_above_its_own_and_every_reported() -> None:
    assert next_term(NO_TERM, [], "me") == ControllerTerm(1, "me")
    assert next_term(ControllerTerm(4, "me"), [ControllerTerm(2, "x")], "new") == \
        ControllerTerm(5, "new")
    assert next_term(NO_TERM, [ControllerTerm(2, "x"), ControllerTerm(6, "y")], "me") == \
        ControllerTerm(7, "me")


def test_a_site_admits_its_own_term_or_a_higher_one_only() -> None:
    kept = ControllerTerm(3, "b")
    assert admits(kept, kept)
    assert admits(kept, ControllerTerm(4, "a"))
    # two controllers that took one number: the higher id wins, everywhere
    assert admits(kept, ControllerTerm(3, "c"))
    assert not admits(kept, ControllerTerm(3, "a"))
    assert not admits(kept, ControllerTerm(2, "z"))
    assert not admits(kept, NO_TERM)  # a placement pushed by hand is fenced too
    assert admits(NO_TERM, NO_TERM)


def test_the_term_store_keeps_the_highest_term_across_restarts(tmp_path: Path) -> None:
    store = TermStore(tmp_path)
    assert store.current == NO_TERM and store.offer(NO_TERM)
    assert not (tmp_path / TERM_FILE).exists()  # nothing to keep yet
    assert store.offer(ControllerTerm(2, "a"))
    assert not store.offer(ControllerTerm(1, "z"))
    assert not store.offer(ControllerTerm(2, "0"))
    assert store.current == ControllerTerm(2, "a")
    assert TermStore(tmp_path).current == ControllerTerm(2, "a")
    assert store.offer(ControllerTerm(2, "b"))
    assert TermStore(tmp_path).current == ControllerTerm(2, "b")


def test_a_damaged_term_file_stops_the_site_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / TERM_FILE).write_text('{"format": 1, "term": [2]}')
    with pytest.raises(CorruptDataError, match="controller term is damaged"):
        TermStore(tmp_path)


def placement_on(*sites: str) -> Placement:
    return Placement(version=1, shards=(ShardPlacement("messages", 0, tuple(sites),
                                                       sites[0], 1),))


def test_the_electorate_is_the_placed_sites_or_before_a_placement_those_given() -> None:
    assert terms.electorate(placement_on("a", "b", "c"), {"a", "d"}, 5) == \
        (frozenset({"a", "b", "c"}), 3)
    assert terms.electorate(Placement.empty(), {"a", "b"}, 3) == (frozenset({"a", "b"}), 3)
    assert terms.electorate(Placement.empty(), set(), 0) == (frozenset(), 1)


def test_a_quorum_is_a_majority_of_the_electorate() -> None:
    members = frozenset({"a", "b", "c"})
    assert terms.has_quorum(members, 3, {"a", "b"})
    assert not terms.has_quorum(members, 3, {"a", "x", "y"})
    # before a placement: 1 site of the 3 given answered
    assert not terms.has_quorum(frozenset({"a"}), 3, {"a"})


def test_a_controller_steps_aside_for_the_highest_newer_term_reported() -> None:
    own = ControllerTerm(3, "b")
    assert terms.newer_term(own, [own, None, NO_TERM, ControllerTerm(3, "a")]) is None
    assert terms.newer_term(own, [ControllerTerm(3, "c"), ControllerTerm(4, "a")]) == \
        ControllerTerm(4, "a")
