"""What the operator keeps per storage in Kopf's memo (operator/handlers.py): the
generation last applied, which the timers read and the reconcile raises."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import kopf

from stratamq.operator.handlers import applied_generation, applied_of


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
