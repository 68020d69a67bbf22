"""`supervise`: a body that raises is counted and run again; one that returns ends it;
cancellation is not a failure."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from stratamq.broker.supervise import supervise
from tests.support.storage import run


def failures(loop: str) -> float:
    value = REGISTRY.get_sample_value("stratamq_background_failures_total", {"loop": loop})
    return value or 0.0


def test_a_body_that_raises_is_restarted_and_counted() -> None:
    calls: list[int] = []

    async def body() -> None:
        calls.append(len(calls))
        if len(calls) < 3:
            raise RuntimeError("boom")

    run(supervise("unit-restart", body, pause=0.01))
    assert calls == [0, 1, 2]
    assert failures("unit-restart") == 2


def test_cancellation_ends_it_without_a_failure() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    async def scenario() -> None:
        task = asyncio.ensure_future(supervise("unit-cancel", forever))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(scenario())
    assert failures("unit-cancel") == 0
