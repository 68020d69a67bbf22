"""broker/deadlines.py: every connection's read deadline on one timer, called back
not before its time and at most two ticks after it, never once discarded."""

from __future__ import annotations

import asyncio

from stratamq.broker.deadlines import Deadlines

TICK = 0.02


class Recorded:
    def __init__(self, at: float, log: list[tuple[Recorded, float]]) -> None:
        self.at = at
        self.log = log

    def expire(self) -> None:
        self.log.append((self, asyncio.get_running_loop().time()))


def test_deadlines_are_called_back_in_time_and_never_once_discarded() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(TICK)
        log: list[tuple[Recorded, float]] = []
        now = loop.time()
        # in the past, now, soon, later; two discarded
        kept = [Recorded(now + offset, log) for offset in (-1.0, 0.0, 0.05, 0.013, 0.2)]
        dropped = [Recorded(now + offset, log) for offset in (0.05, 0.3)]
        ticks = {deadline: deadlines.add(deadline, deadline.at) for deadline in kept + dropped}
        assert len(deadlines) == 7
        for deadline in dropped:
            deadlines.discard(deadline, ticks[deadline])
        deadlines.discard(dropped[0], ticks[dropped[0]])  # twice: nothing more
        assert len(deadlines) == 5
        await asyncio.sleep(0.5)
        assert {id(called) for called, _ in log} == {id(deadline) for deadline in kept}
        assert len(log) == len(kept)
        for called, at in log:
            assert called.at <= at <= max(called.at, now) + 2 * TICK + 0.05, (called.at, at)
        assert len(deadlines) == 0
    asyncio.run(scenario())


def test_a_deadline_added_again_from_its_call_back_waits_for_its_new_time() -> None:
    """As a connection that read a packet since arms its deadline again."""
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(TICK)
        calls: list[float] = []

        class Again:
            def expire(self) -> None:
                calls.append(loop.time())
                if len(calls) == 1:
                    deadlines.add(self, loop.time() + 0.1)

        start = loop.time()
        deadlines.add(Again(), start + 0.03)
        await asyncio.sleep(0.4)
        assert len(calls) == 2
        assert calls[0] >= start + 0.03 and calls[1] >= calls[0] + 0.1
        # nothing waits: later deadlines start the timer again
        later = Again()
        calls.clear()
        calls.append(0.0)  # not added again from its call back
        deadlines.add(later, loop.time() + 0.03)
        await asyncio.sleep(0.2)
        assert len(calls) == 2
    asyncio.run(scenario())
