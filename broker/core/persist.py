"""The ordered save of a session: one write of a session at a time, its record taken
when the write starts, and callers that come while one is under way share the next."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..ds import FencedError
from ..session.session import Session
from ..session.store import SessionStore


class SessionWriter:
    """`on_taken_over`: called with a session whose write was refused because another
    site owns it now (the registry drops it and closes its connection)."""

    def __init__(self, store: SessionStore, on_taken_over: Callable[[Session], None]) -> None:
        self._store = store
        self._on_taken_over = on_taken_over
        # per client id: the write of its session that callers wait for while one is
        # under way (see persist)
        self._next_persist: dict[str, tuple[Session, asyncio.Future[None]]] = {}

    async def persist(self, session: Session, disconnected: bool = False,
                      connecting: bool = False) -> None:
        """`connecting`: the write before CONNACK, the session not attached to its
        connection yet but connected (no disconnect time: its expiry does not run)."""
        if disconnected or connecting or not session.persist_lock.locked():
            await self._persist_now(session, disconnected, connecting)
            return
        # A write of the session is under way: callers meanwhile share the one after
        # it, which takes the session's state when it starts (theirs included). On a
        # replicated site a write waits for a majority of a shard's replicas: one
        # write per QoS 2 acknowledgement would bound a session's throughput by it.
        shared = self._next_persist.get(session.client_id)
        if shared is None or shared[0] is not session or shared[1].done():
            task = asyncio.ensure_future(self._persist_next(session))
            # its callers see its error; none may be left to, once they are cancelled
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
            shared = self._next_persist[session.client_id] = (session, task)
        await asyncio.shield(shared[1])

    async def _persist_next(self, session: Session) -> None:
        async with session.persist_lock:
            found = self._next_persist.get(session.client_id)
            if found is not None and found[0] is session:
                del self._next_persist[session.client_id]  # later callers: the next one
            await self._persist_locked(session, False)

    async def _persist_now(self, session: Session, disconnected: bool,
                           connecting: bool = False) -> None:
        # One write of a session at a time, its record taken inside the lock: writes
        # go through a thread pool, and an older record must never land last.
        async with session.persist_lock:
            await self._persist_locked(session, disconnected, connecting)

    async def _persist_locked(self, session: Session, disconnected: bool,
                              connecting: bool = False) -> None:
        if not session.durable:
            return
        # A session not attached is disconnected, but while its CONNECT is answered:
        # recorded so, it expired after a crash of this site though its client stayed
        # connected (a quiet subscriber's session, written only at CONNECT).
        record = session.to_record(
            None if connecting else
            time.time() if disconnected or session.outlet is None else None)
        try:
            session.stored_parts = await self._store.save(record, session.stored_parts)
        except FencedError:
            self._on_taken_over(session)
            raise
        except BaseException:  # it may have been written or not: read what is, next time
            session.stored_parts = None
            raise
