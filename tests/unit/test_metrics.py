"""The hot path's lock-free counters read like prometheus-client's own Counter."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest

from stratamq.broker.metrics import LoopCounter


def test_loop_counter_is_exposed_like_a_counter() -> None:
    counter = LoopCounter("stratamq_test_loop_counter", "A test counter", ("kind",))
    plain = LoopCounter("stratamq_test_loop_plain", "Another test counter")
    try:
        counter.labels("a").inc()
        counter.labels("a").inc(2)
        counter.labels("b").inc()
        plain.inc(64)
        text = generate_latest(REGISTRY).decode()
        assert "# TYPE stratamq_test_loop_counter_total counter" in text
        assert 'stratamq_test_loop_counter_total{kind="a"} 3.0' in text
        assert 'stratamq_test_loop_counter_total{kind="b"} 1.0' in text
        assert "stratamq_test_loop_plain_total 64.0" in text
        assert REGISTRY.get_sample_value("stratamq_test_loop_counter_total",
                                         {"kind": "a"}) == 3.0
    finally:
        REGISTRY.unregister(counter)
        REGISTRY.unregister(plain)


def test_loop_counter_refuses_wrong_labels() -> None:
    counter = LoopCounter("stratamq_test_loop_labels", "A test counter", ("kind",))
    try:
        with pytest.raises(ValueError, match="labels"):
            counter.labels("a", "b")
    finally:
        REGISTRY.unregister(counter)
