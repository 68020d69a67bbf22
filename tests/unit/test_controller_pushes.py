"""The placement push as every controller makes it (`broker/controller/pushes.py`):
whom it goes to, what it carries, and what a site's answer means."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from stratamq.broker.controller.pushes import (
    Fenced,
    Refused,
    peers_of,
    push_answer,
    push_body,
    push_targets,
)
from stratamq.broker.controller.sites import SiteState
from stratamq.broker.ds.replication import Placement, ShardPlacement
from stratamq.broker.ds.replication.term import NO_TERM, ControllerTerm

OWN = ControllerTerm(3, "me")


def site(name: str, *, answered: bool = True, version: int | None = None,
         peer: str | None = None) -> SiteState:
    return SiteState(id=name, admin_url="", last_seen=0.0, answered=answered,
                     placement_version=version, peer=peer)


def test_a_push_goes_to_the_sites_that_answered_behind_or_to_all_of_them() -> None:
    sites = [site("a", version=4), site("b", version=3), site("c"),
             site("d", answered=False, version=1)]
    assert [found.id for found in push_targets(sites, 4, everyone=False)] == ["b", "c"]
    assert [found.id for found in push_targets(sites, 4, everyone=True)] == ["a", "b", "c"]


def test_a_push_carries_the_placement_the_peers_the_forgotten_and_the_term() -> None:
    placement = Placement(version=2, shards=(ShardPlacement("messages", 0, ("a",), "a", 1),))
    peers = peers_of([site("a", peer="10.0.0.1:1"), site("b")])
    assert peers == {"a": "10.0.0.1:1"}
    body = push_body(placement, peers, {"z", "y"}, OWN)
    assert body == {"placement": json.loads(placement.to_json()), "peers": peers,
                    "forgotten": ["y", "z"], "term": [3, "me"]}
    assert list(body) == ["placement", "peers", "forgotten", "term"]


def test_an_answer_is_taken_refused_for_the_placement_or_fenced_by_a_newer_term() -> None:
    assert push_answer(None, OWN) is None  # no answer: pushed again next round
    assert push_answer({"accepted": True, "version": 2, "term": [9, "x"]}, OWN) is None
    assert push_answer({"accepted": False, "version": 5, "term": [3, "me"]}, OWN) == \
        Refused(5)
    assert push_answer({"accepted": False, "version": 2}, OWN) == Refused(2)
    assert push_answer({"accepted": False, "term": "not a term"}, OWN) == Refused(None)
    assert push_answer({"accepted": False, "term": [3, "zz"]}, OWN) == \
        Fenced(ControllerTerm(3, "zz"))
    assert Refused(5).note("B", 4) == ("site B refused placement version 4: it keeps "
                                       "version 5; adopting the placement the sites keep")


@given(accepted=st.sampled_from([True, False, None, 0]),
       term=st.one_of(st.none(), st.builds(ControllerTerm, st.integers(1, 5),
                                           st.sampled_from(("aa", "me", "zz")))))
def test_only_a_refusal_with_a_newer_term_fences(accepted: object,
                                                 term: ControllerTerm | None) -> None:
    found: dict[str, Any] = {"accepted": accepted, "version": 1,
                             "term": None if term is None else term.to_json()}
    answer = push_answer(found, OWN)
    if accepted is not False:
        assert answer is None
    elif (term or NO_TERM) > OWN:
        assert answer == Fenced(term or NO_TERM)
    else:
        assert answer == Refused(1)
