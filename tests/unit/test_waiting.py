"""harness/waiting.py: the one poll loop of the tests."""

from __future__ import annotations

import itertools

import pytest

from harness.waiting import wait_for, wait_until


def test_wait_until_answers_whether_the_condition_held_in_time() -> None:
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 3, timeout=5, every=0.001)
    assert not wait_until(lambda: False, timeout=0.02, every=0.005)


def test_wait_until_looks_once_more_at_the_deadline() -> None:
    assert wait_until(lambda: True, timeout=0)


def test_tolerated_errors_count_as_not_yet_and_others_fail_at_once() -> None:
    calls = itertools.count()

    def flaky() -> bool:
        if next(calls) < 2:
            raise ConnectionRefusedError("site still starting")
        return True
    assert wait_until(flaky, timeout=5, every=0.001, tolerate=(OSError,))
    empty: dict[str, bool] = {}
    with pytest.raises(KeyError):
        wait_until(lambda: empty["missing"], timeout=5)


def test_wait_for_returns_the_first_true_value() -> None:
    values = iter([None, {}, {"phase": "Ready"}])
    assert wait_for("the storage", lambda: next(values), timeout=5, every=0.001) == {
        "phase": "Ready"}


def test_wait_for_says_what_it_waited_for_and_why() -> None:
    def down() -> None:
        raise ConnectionRefusedError("refused")
    with pytest.raises(AssertionError) as failure:
        wait_for("the site", down, timeout=0.02, every=0.005, tolerate=(OSError,),
                 explain=lambda: "pods: none")
    message = str(failure.value)
    assert "timed out waiting for the site" in message
    assert "ConnectionRefusedError('refused')" in message and "pods: none" in message
