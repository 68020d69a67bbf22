"""`Flag`: asyncio.Event's set, clear, is_set and wait, holding no queue of waiters
until a task waits. A site keeps several per connection (the room in a session's
queue, its replay's wake-up, a takeover waiting for the end of a connection) and an
idle connection is never waited on: asyncio.Event makes a deque when it is made,
which holds a block of 64 slots (about 760 bytes) from the start."""

from __future__ import annotations

import asyncio


class Flag:
    __slots__ = ("_value", "_waiters")

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        """Wake every task waiting now; later waits return at once until `clear`."""
        if self._value:
            return
        self._value = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._value = False

    async def wait(self) -> bool:
        """Until the flag is set; True (as asyncio.Event.wait)."""
        if self._value:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
            return True
        finally:
            # a cancelled wait leaves no waiter behind (a set one took the list along)
            if self._waiters is not None and waiter in self._waiters:
                self._waiters.remove(waiter)
