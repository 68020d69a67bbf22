"""`Deadlines`: many deadlines on one timer (issue 25). An idle connection held a timer
of its own for its keep alive (broker/net/read_loop.py), and an idle durable session
one more for its replay's safety-net poll (broker/session/replay.py): a TimerHandle
with its bound method and context, 0.6-0.8 KB of the 9-13 KB an idle connection cost.

Time is cut into ticks; a deadline waits in the set of its tick (its time rounded up)
and one timer, armed while any deadline waits, wakes once a tick and calls back every
deadline of the ticks that have passed. A deadline is called back at most about two
ticks late, which a keep alive or a poll of seconds does not notice."""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

# Seconds per tick: ten wakes a second while any deadline waits; a deadline is late by
# at most two ticks.
TICK = 0.1


class Expiring(Protocol):
    def expire(self) -> None:
        """Its deadline has passed (or is about to: it checks for itself)."""
        ...


class Deadlines:
    """Deadlines to call back, by tick, with one timer for all of them."""

    __slots__ = ("_done_until", "_due", "_tick", "_timer", "_waiting")

    def __init__(self, tick: float = TICK) -> None:
        self._tick = tick
        self._due: dict[int, set[Expiring]] = {}
        self._waiting = 0
        self._timer: asyncio.TimerHandle | None = None
        self._done_until = -1  # the last tick whose deadlines were called back

    def add(self, deadline: Expiring, at: float) -> int:
        """Call `deadline.expire()` once the loop's time has passed `at`; the tick to
        give `discard`."""
        if self._timer is None:  # nothing waits: the ticks before now are done
            loop = asyncio.get_running_loop()
            self._done_until = max(self._done_until, math.floor(loop.time() / self._tick))
            self._timer = loop.call_later(self._tick, self._wake)
        tick = max(math.ceil(at / self._tick), self._done_until + 1)
        self._due.setdefault(tick, set()).add(deadline)
        self._waiting += 1
        return tick

    def discard(self, deadline: Expiring, tick: int) -> None:
        waiting = self._due.get(tick)
        if waiting is None or deadline not in waiting:
            return
        waiting.discard(deadline)
        self._waiting -= 1
        if not waiting:
            del self._due[tick]

    def __len__(self) -> int:
        return self._waiting

    def _wake(self) -> None:
        loop = asyncio.get_running_loop()
        now = math.floor(loop.time() / self._tick)
        while self._done_until < now:
            self._done_until += 1
            for deadline in self._due.pop(self._done_until, ()):
                self._waiting -= 1
                deadline.expire()
        self._timer = loop.call_later(self._tick, self._wake) if self._waiting else None
