"""broker/flag.py: asyncio.Event's behaviour without a waiter queue until one waits."""

from __future__ import annotations

import asyncio

import pytest

from stratamq.broker.flag import Flag


def test_set_wakes_every_waiter_and_later_waits_pass_until_cleared() -> None:
    async def scenario() -> None:
        flag = Flag()
        waiters = [asyncio.create_task(flag.wait()) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(waiter.done() for waiter in waiters)
        flag.set()
        assert await asyncio.gather(*waiters) == [True, True, True]
        assert flag.is_set()
        assert await asyncio.wait_for(flag.wait(), 1) is True
        flag.clear()
        assert not flag.is_set()
        late = asyncio.create_task(flag.wait())
        await asyncio.sleep(0.01)
        assert not late.done()
        flag.set()
        await asyncio.wait_for(late, 1)
    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_no_waiter_and_others_still_wake() -> None:
    async def scenario() -> None:
        flag = Flag()
        cancelled = asyncio.create_task(flag.wait())
        kept = asyncio.create_task(flag.wait())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert flag._waiters is not None and len(flag._waiters) == 1
        flag.set()
        await asyncio.wait_for(kept, 1)
        assert flag._waiters is None
    asyncio.run(scenario())

