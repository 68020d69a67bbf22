"""What the operator keeps per storage in Kopf's memo (operator/handlers.py): the
generation last applied, which the timers read and the reconcile raises, and its spec,
which the controller's rounds follow while the storage's spec is one the broker would
refuse."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import kopf

from stratamq.operator.handlers import applied_generation, applied_of, spec_to_follow


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
    assert spec_to_follow(good, 2, applied_of(memo)) == (good, 2)
    # Started on a refused spec: nothing applied here yet, nothing to follow.
    assert spec_to_follow(refused, 3, applied_of(memo)) is None
    applied_of(memo).note(2, good)
    assert spec_to_follow(refused, 3, applied_of(memo)) == (good, 2)
    # An older body's reconcile does not replace the spec applied.
    applied_of(memo).note(1, {"sites": 1})
    assert applied_of(memo).last() == (good, 2)
    fixed = {**good, "sites": 5}
    applied_of(memo).note(4, fixed)
    assert spec_to_follow(fixed, 4, applied_of(memo)) == (fixed, 4)
