"""The controller term (issue 22): its order and parsing, the sites' acceptance rule
and its file (`broker/ds/replication/term.py`), and the controller's pure choices and
`TermKeeper` under both rules (`broker/controller/terms.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratamq.broker.controller import terms
from stratamq.broker.controller.terms import TermKeeper, TermRule
from stratamq.broker.ds.replication import Placement, ShardPlacement, majority
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


def test_under_majority_claim_the_term_is_taken_claimed_and_held_by_a_majority() -> None:
    keeper = TermKeeper(TermRule.MAJORITY_CLAIM, "me", ControllerTerm(4, "me"))
    empty = Placement.empty()
    # one site of the three given answered: no term yet, said why
    step = keeper.take({"a": NO_TERM}, empty, 3)
    assert not step.goes_on and "(1 of 3)" in step.waiting and keeper.term is None
    reported = {"a": NO_TERM, "b": ControllerTerm(2, "x")}
    step = keeper.take(reported, empty, 3)
    assert step.goes_on and step.taken and step.claim_at == ("a", "b")
    assert keeper.term == keeper.last_term == ControllerTerm(5, "me") and not keeper.in_charge
    step = keeper.settle(reported, ["a"], empty, 3)
    assert not step.goes_on and "held by 1 of 3" in step.waiting
    step = keeper.settle(reported, ["a", "b"], empty, 3)
    assert step.goes_on and step.held_now and keeper.in_charge
    # held from now on: it claims where a site reports another term, but goes on
    held = {"a": keeper.term, "b": keeper.term, "c": NO_TERM}
    step = keeper.take(held, placement_on("a", "b", "c"), 3)
    assert step.goes_on and not step.taken and step.claim_at == ("c",)
    assert keeper.settle(held, [], placement_on("a", "b", "c"), 3) == terms.TermStep(True)


def test_under_first_reports_the_term_is_taken_at_once_and_never_claimed() -> None:
    keeper = TermKeeper(TermRule.FIRST_REPORTS, "op", NO_TERM)
    assert keeper.take({}, Placement.empty(), 0) == terms.TermStep(goes_on=True)
    assert keeper.term is None and not keeper.in_charge  # decides, pushes nothing
    step = keeper.take({"a": ControllerTerm(2, "c")}, Placement.empty(), 1)
    assert step == terms.TermStep(goes_on=True, taken=True) and keeper.in_charge
    assert keeper.term == ControllerTerm(3, "op")


def test_a_keeper_fenced_once_stays_fenced_and_says_it_once() -> None:
    keeper = TermKeeper(TermRule.FIRST_REPORTS, "op", NO_TERM)
    keeper.take({"a": NO_TERM}, Placement.empty(), 1)
    assert not keeper.fence(ControllerTerm(1, "aa"))  # not newer than 1/op
    assert keeper.fence(ControllerTerm(1, "zz")) and not keeper.fence(ControllerTerm(9, "z"))
    assert keeper.fenced_by == ControllerTerm(1, "zz") and not keeper.in_charge
    assert keeper.take({"a": NO_TERM}, Placement.empty(), 1) == terms.TermStep(False)


SITE_IDS = ("a", "b", "c", "d", "e")
some_terms = st.one_of(st.none(), st.builds(ControllerTerm, st.integers(1, 4),
                                            st.sampled_from(("k", "m", "z"))))


@settings(max_examples=300, deadline=None)
@given(rule=st.sampled_from(TermRule), last=some_terms,
       rounds=st.lists(st.tuples(st.dictionaries(st.sampled_from(SITE_IDS), some_terms),
                                 st.sets(st.sampled_from(SITE_IDS))), max_size=4),
       placed=st.booleans())
def test_a_keeper_takes_a_term_above_all_it_heard_and_decides_only_by_its_rule(
        rule: TermRule, last: ControllerTerm | None,
        rounds: list[tuple[dict[str, ControllerTerm | None], set[str]]],
        placed: bool) -> None:
    keeper = TermKeeper(rule, "me", last or NO_TERM)
    placement = placement_on("a", "b", "c") if placed else Placement.empty()
    for reported, claimed in rounds:
        was_fenced, had = keeper.fenced_by is not None, keeper.term
        step = keeper.take(reported, placement, 3)
        if step.taken:  # above the last term taken and every one reported now
            assert had is None and keeper.term is not None and keeper.term > (last or NO_TERM)
            assert all(keeper.term.number > term.number for term in reported.values()
                       if term is not None)
        if was_fenced:
            assert step == terms.TermStep(False)
            continue
        members, size = terms.electorate(placement, reported, 3)
        if rule is TermRule.MAJORITY_CLAIM and had is None:
            assert step.taken == terms.has_quorum(members, size, reported)
        if rule is TermRule.FIRST_REPORTS:
            assert step.claim_at == () and step.taken == (had is None and bool(reported))
        newer = None if keeper.term is None else terms.newer_term(keeper.term,
                                                                  reported.values())
        assert (step.fenced_by == newer) and (keeper.fenced_by == newer)
        if not step.goes_on:
            continue
        held_before = keeper.holds
        settled = keeper.settle(reported, claimed & set(step.claim_at), placement, 3)
        if rule is TermRule.FIRST_REPORTS:
            assert settled.goes_on and keeper.holds == (keeper.term is not None)
            continue
        holding = {site for site, term in reported.items() if term == keeper.term} | (
            claimed & set(step.claim_at))
        assert settled.goes_on == keeper.holds
        assert settled.held_now == (keeper.holds and not held_before)
        if not held_before:
            assert keeper.holds == (len(members & holding) >= majority(size))


def test_an_operator_fenced_by_a_term_its_shared_state_holds_yields_to_it() -> None:
    """Issue 23: a replica of the operator that Kopf's peering paused while another took
    a newer term acts again once the other is paused or gone; it used to stay fenced
    for good, and no failover happened until it restarted. It yields to the kept
    state (whose term is above every one the sites hold); a term the kept state does
    not hold (a local controller's) still fences it."""
    keeper = TermKeeper(TermRule.FIRST_REPORTS, "op-a", NO_TERM)
    keeper.take({"a": NO_TERM}, Placement.empty(), 1)
    theirs, local = ControllerTerm(2, "op-b"), ControllerTerm(3, "local")
    assert keeper.fence(theirs) and not keeper.in_charge
    assert not keeper.yields_to(ControllerTerm(1, "op-a"), [theirs])  # older kept
    assert keeper.yields_to(theirs, [theirs, None])  # the other replica kept it
    # ... but not while a site holds a newer one still (a local controller's)
    assert not keeper.yields_to(theirs, [theirs, local])
    assert keeper.fenced_by == theirs  # nothing changed
    # The next keeper, from the kept state, takes a term above it.
    after = TermKeeper(TermRule.FIRST_REPORTS, "op-a", theirs)
    assert after.take({"a": theirs}, Placement.empty(), 1).taken
    assert after.term == ControllerTerm(3, "op-a")
    # Not fenced yet (the site holding the other's term is about to say so): it
    # yields to a kept term above its own.
    assert not after.yields_to(ControllerTerm(3, "op-a"), [])
    assert after.yields_to(ControllerTerm(4, "op-b"), [ControllerTerm(4, "op-b")])
    # The local controller's fence is for good.
    held = TermKeeper(TermRule.MAJORITY_CLAIM, "c", NO_TERM)
    held.take({"a": NO_TERM}, Placement.empty(), 1)
    assert held.fence(theirs) and not held.yields_to(theirs, [theirs])
