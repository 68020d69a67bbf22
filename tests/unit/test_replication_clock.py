"""The peers' clock offsets (issue 22, clock skew; `ds/replication/clock.py`)."""

from __future__ import annotations

import logging

import pytest

from stratamq.broker.ds.replication.clock import ClockOffsets, better, estimate


def test_an_offset_is_the_peers_time_less_the_middle_of_the_round_trip() -> None:
    # sent at 100.0, answered at 100.2 by a peer whose clock said 110.1: 10 s ahead
    found = estimate(100.0, 110.1, 100.2, 0.2, at=5.0)
    assert found.offset == pytest.approx(10.0) and found.uncertainty == pytest.approx(0.1)
    assert estimate(100.0, 95.05, 100.1, 0.1, at=5.0).offset == pytest.approx(-5.0)


def test_the_estimate_of_the_fastest_recent_round_trip_is_kept() -> None:
    fast = estimate(0.0, 1.0, 0.01, 0.01, at=10.0)
    slow = estimate(0.0, 3.0, 2.0, 2.0, at=11.0)  # a slow answer: offset 2.0, +-1.0
    assert better(fast, slow) is fast
    assert better(fast, slow, window=0.5) is slow  # the fast one is too old by then
    assert better(None, slow) is slow


def test_a_skewed_peer_is_warned_of_once_and_its_deadlines_converted(
        caplog: pytest.LogCaptureFixture) -> None:
    clocks = ClockOffsets(warn_beyond=0.5)
    assert clocks.peer_time("b:1", 100.0) == 100.0  # not heard from: as it is
    with caplog.at_level(logging.WARNING):
        clocks.observe("b:1", estimate(0.0, 10.0, 0.0, 0.001, at=1.0))
        clocks.observe("b:1", estimate(0.0, 10.0, 0.0, 0.001, at=2.0))
        clocks.observe("c:1", estimate(0.0, 0.3, 0.0, 0.001, at=2.0))  # within
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "b:1" in warnings[0] and "ahead" in warnings[0]
    assert clocks.peer_time("b:1", 100.0) == pytest.approx(110.0)
    assert clocks.status()["c:1"]["offset"] == pytest.approx(0.3)
