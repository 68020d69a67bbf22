"""What the operator keeps per storage in Kopf's memo (operator/handlers.py): the
generation last applied, which the timers read and the reconcile raises, and its spec,
which the controller's rounds follow while the storage's spec is one the broker would
refuse."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from stratamq.operator.handlers import (
    Following,
    applied_generation,
    applied_of,
    spec_to_follow,
    still_applied,
)
from stratamq.operator.resources import (
    APPLIED_SPEC_ANNOTATION,
    Owner,
    applied_spec_of,
    stateful_set,
)


def test_the_status_speaks_for_a_storage_until_a_generation_is_applied_here() -> None:
    memo = kopf.Memo()
    assert applied_generation(memo, {"observedGeneration": 3}) == 3
    applied_of(memo).note(5)
    assert applied_generation(memo, {"observedGeneration": 3}) == 5
    # A reconcile with an older body never lowers it.
    applied_of(memo).note(4)
    assert applied_generation(memo, {}) == 5


def test_handlers_in_threads_share_one_record_per_storage() -> None:
    memo, other = kopf.Memo(), kopf.Memo()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda generation: applied_of(memo).note(generation), range(1, 201)))
    assert applied_of(memo).get() == 200
    assert applied_of(other).get() is None  # another storage's memo


def test_a_spec_the_broker_would_refuse_leaves_the_controller_on_the_last_applied() -> None:
    """Issue 23: a spec the broker would refuse (the reconcile applies nothing of it)
    stopped the controller's rounds: no failover, no disruption budget kept up to date,
    until the spec was fixed. The rounds follow the spec last applied instead."""
    memo = kopf.Memo()
    good = {"sites": 3, "messages": {"nShards": 4, "replicationFactor": 3}}
    refused = {**good, "mqtt": {"maxPacketSize": 2**30}}  # above what the broker takes

    def no_stateful_set() -> None:
        return None

    # not applied here yet: followed, but nothing scaled by it
    assert spec_to_follow(good, 2, applied_of(memo), no_stateful_set) == Following(
        good, 2, False)
    # Started on a refused spec, nothing applied yet, no StatefulSet: nothing to follow.
    assert spec_to_follow(refused, 3, applied_of(memo), no_stateful_set) is None
    applied_of(memo).note(2, good)
    assert spec_to_follow(good, 2, applied_of(memo), no_stateful_set) == Following(
        good, 2, True)
    assert spec_to_follow(refused, 3, applied_of(memo), no_stateful_set) == Following(
        good, 2, True)
    # An older body's reconcile does not replace the spec applied.
    applied_of(memo).note(1, {"sites": 1})
    assert applied_of(memo).last() == (good, 2)
    fixed = {**good, "sites": 5}
    applied_of(memo).note(4, fixed)
    assert spec_to_follow(fixed, 4, applied_of(memo), no_stateful_set) == Following(
        fixed, 4, True)
    # Another replica of the operator acted meanwhile: nothing applied here is known.
    applied_of(memo).forget()
    assert applied_of(memo).get() is None
    assert spec_to_follow(refused, 5, applied_of(memo), no_stateful_set) is None


def test_an_operator_started_on_a_refused_spec_follows_the_one_its_sites_run() -> None:
    """An operator (re)started while the storage's spec is one the broker would refuse
    has applied nothing: it follows the spec the sites' StatefulSet was last applied
    from (an annotation on it), so failovers go on across an operator's restart. The
    generation applied stays unknown (the status keeps the one it observed)."""
    good = {"sites": 3, "messages": {"nShards": 4, "replicationFactor": 3}}
    refused = {**good, "mqtt": {"maxPacketSize": 2**30}}
    made = stateful_set(Owner(name="mq", namespace="brokers", uid="u"), good)
    assert applied_spec_of(made) == good
    memo = kopf.Memo()
    reads: list[int] = []

    def read() -> dict[str, Any]:
        reads.append(1)
        return made

    assert spec_to_follow(refused, 7, applied_of(memo), read) == Following(good, 0, True)
    assert spec_to_follow(refused, 7, applied_of(memo), read) == Following(good, 0, True)
    assert len(reads) == 1  # read once, then kept
    assert applied_generation(memo, {"observedGeneration": 6}) == 6
    # None there, or one the broker would refuse too: nothing to follow.
    unusable: list[dict[str, Any]] = [
        {"metadata": {}}, stateful_set(Owner("mq", "brokers", "u"), refused),
        {"metadata": {"annotations": {APPLIED_SPEC_ANNOTATION: "[1"}}}]
    for found in unusable:
        assert spec_to_follow(refused, 7, applied_of(kopf.Memo()),
                              functools.partial(dict, found)) is None


def test_the_scale_and_budget_follow_only_the_spec_still_applied() -> None:
    """A round that read spec N must not scale the StatefulSet or set the budget by it
    once the reconcile of N+1 noted N+1 (it would shrink what N+1 grew); the spec the
    StatefulSet runs (generation 0) counts only while nothing was applied here.
    Another operator having acted, what was applied here is forgotten and applied
    again at the next round (`stale`)."""
    applied = applied_of(kopf.Memo())
    spec = {"sites": 3}
    assert still_applied(Following(spec, 0, True), applied)
    applied.note(4, spec)
    assert still_applied(Following(spec, 4, True), applied)
    assert not still_applied(Following(spec, 0, True), applied)
    applied.note(5, {"sites": 5})
    assert not still_applied(Following(spec, 4, True), applied)
    assert not applied.is_stale()
    applied.forget()
    assert applied.is_stale() and applied.get() is None
    applied.note(6, spec)
    assert not applied.is_stale()
