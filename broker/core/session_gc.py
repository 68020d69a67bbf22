"""The collection of stored sessions that expired while no site held them in memory
(after a restart, say): their wills published once due, their state deleted."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container

from ..ds import FencedError
from ..errors import StratamqError
from ..session.store import SessionStore
from ..supervise import RESTART_PAUSE
from .client_locks import ClientLocks
from .dispatch import Dispatcher
from .ownership import Ownership
from .publish import Publisher

log = logging.getLogger(__name__)


class SessionCollector:
    """`held_here`: the client ids whose session this site holds in memory (the
    registry's table), which are not this one's to collect; `locks`: the registry's
    lock per client id."""

    def __init__(self, store: SessionStore, publisher: Publisher, dispatcher: Dispatcher,
                 locks: ClientLocks, held_here: Container[str], interval: float,
                 ownership: Ownership | None) -> None:
        self._store = store
        self._publisher = publisher
        self._dispatcher = dispatcher
        self._locks = locks
        self._held_here = held_here
        self._interval = interval
        self._ownership = ownership

    async def run(self) -> None:
        first_pause = min(RESTART_PAUSE, self._interval)
        retry_pause = first_pause
        while True:
            try:
                await self.collect_expired_sessions()
            except StratamqError as exc:
                if not exc.recoverable:
                    raise  # a fault: supervised (logged with its traceback, counted)
                # The storage not readable yet (a cluster site before its placement)
                # or slow: expected and passing, so one line, and a pass again soon
                # (sooner than the interval), less and less often.
                log.warning("session GC pass not done (%s); trying again in %.0fs",
                            exc.message, retry_pause)
                await asyncio.sleep(retry_pause)
                retry_pause = min(retry_pause * 2, self._interval)
                continue
            retry_pause = first_pause
            await asyncio.sleep(self._interval)

    async def collect_expired_sessions(self) -> int:
        """Delete stored sessions that expired while no site held them in memory
        (after a restart, say) and publish their wills. Returns how many."""
        now = time.time()
        removed = 0
        for client_id in await self._store.client_ids():
            # Under the client's lock, and read again: a client that reconnected since
            # the scan has its session in memory (or has ended it), whose record and
            # QoS 2 ids must not be touched from here.
            async with self._locks.hold(client_id):
                if client_id in self._held_here:
                    continue
                try:
                    removed += await self._collect(client_id, now)
                except FencedError:  # taken by another site meanwhile: it is that one's
                    continue
                except StratamqError as exc:
                    if not exc.recoverable:
                        raise
                    # its will or record not written (a shard out of reach): the next
                    # pass tries it again; the others go on now
                    log.warning("session of %r not collected yet: %s", client_id,
                                exc.message)
                    continue
        return removed

    async def _collect(self, client_id: str, now: float) -> int:
        """Under the client's lock: expire its stored session if it has (1), publish
        its will once due."""
        epoch = None
        if self._store.fenced and self._ownership is not None:
            epoch = await self._ownership.may_collect(client_id)
            if epoch is None:
                return 0  # its owner site collects it
        record = await self._store.load(client_id)
        if record is None:
            return 0
        if epoch is not None:  # adopted here, maybe
            record.owner_epoch = epoch
        stored = record.as_parts()
        if record.disconnected_at is None:
            # It was connected when its site stopped without saying goodbye: its expiry
            # (and will delay) count from now, when the site is back (or adopted it).
            record.disconnected_at = now
            stored = await self._store.save(record, stored)
        if record.will is not None and record.disconnected_at + min(
                record.will.delay, record.expiry_interval) <= now:
            # stored before the session lets go of it: a failed write fails the
            # pass, and a later one publishes the will again, unless it finds it
            # stored (a pass that published it and failed to save the record)
            await self._publisher.publish_will_once(
                record.will.to_message(record.client_id), record.will.will_id, retried=True)
            record.will = None
            stored = await self._store.save(record, stored)
        if not record.expired(now):
            return 0
        await self._store.delete(record.client_id, record.owner_epoch)
        await self._store.forget_qos2(record.client_id, record.owner_epoch)
        self._dispatcher.session_ended(client_id)
        log.info("stored session of %r expired: deleted", client_id)
        return 1
