"""A lock per client id, for the work on its session that must not interleave
(opening, closing, expiry, collection); kept only while held or awaited."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass(slots=True)
class _ClientLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holders and waiters


class ClientLocks:
    def __init__(self) -> None:
        # only while a client id's lock is held or awaited (see hold)
        self._session_locks: dict[str, _ClientLock] = {}

    def __len__(self) -> int:
        return len(self._session_locks)

    @contextlib.asynccontextmanager
    async def hold(self, client_id: str) -> AsyncIterator[None]:
        """Hold `client_id`'s lock; it is forgotten once nobody holds or awaits it, so
        the locks do not pile up with every client id ever seen."""
        entry = self._session_locks.get(client_id)
        if entry is None:
            entry = self._session_locks[client_id] = _ClientLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._session_locks[client_id]
