"""The wills of sessions whose connection ended: published now or once their delay is
up, and stored again and again while the storage cannot take them yet."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

from ..ds import Message
from ..errors import StratamqError
from ..session.session import Session
from ..supervise import RESTART_PAUSE
from .publish import Publisher

log = logging.getLogger(__name__)


class Spawn(Protocol):
    """Start background work nobody awaits (`loop`: the name its failures count
    under)."""

    def __call__(self, work: Coroutine[Any, Any, None], name: str, loop: str = "") -> None:
        ...


class Wills:
    """The will timers of the sessions here, by client id."""

    def __init__(self, publisher: Publisher, spawn: Spawn) -> None:
        self._publisher = publisher
        self._spawn = spawn
        self._will_timers: dict[str, asyncio.TimerHandle] = {}

    def pending(self) -> int:
        """How many wills wait for their delay."""
        return len(self._will_timers)

    def publish_later(self, client_id: str, session: Session, delay: float) -> None:
        self._will_timers[client_id] = asyncio.get_running_loop().call_later(
            delay, self.publish, client_id, session)

    def cancel(self, client_id: str) -> None:
        timer = self._will_timers.pop(client_id, None)
        if timer is not None:
            timer.cancel()

    def cancel_all(self) -> None:
        for timer in self._will_timers.values():
            timer.cancel()

    def publish(self, client_id: str, session: Session) -> None:
        self._will_timers.pop(client_id, None)
        will = session.take_will()
        if will is None:
            return
        self._spawn(self._store(session, will.to_message(client_id), will.will_id),
                    f"will-{client_id}", "session-will")

    async def _store(self, session: Session, will: Message, will_id: int) -> None:
        """Store a will, again and again while the storage cannot take it yet (a site
        that reaches no majority of the shard's replicas, say), once: a try after one
        whose outcome is not known stores it only if that one did not
        (`Publisher.publish_will_once`); then write the session without it. A site
        that stops meanwhile has the session stored with it."""
        retried = False
        while True:
            try:
                await self._publisher.publish_will_once(will, will_id, retried)
                break
            except StratamqError as exc:
                if not exc.recoverable:
                    raise
                log.warning("will of %r not stored yet (%s): tried again", will.client_id,
                            exc.message)
                retried = True
                await asyncio.sleep(RESTART_PAUSE)
        session.request_persist()
        if will_id and not session.durable:
            # no record of the session holds the will (deleted, or never written):
            # no try of it comes again, and its record would stay (a client id each)
            await self._publisher.forget_will(will.client_id)
