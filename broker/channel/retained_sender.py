"""The retained messages a connection's SUBSCRIBEs ask for, sent a page at a time,
each message only when the session's queue has room: a QoS 1/2 retained message is
never dropped for a full queue (a slow subscriber loses none, as of the live feed),
and however many a filter matches, one page of them is in memory.

One sender per connection works through the subscriptions in the order they came,
in the background, so the client's acknowledgements (which make the room) are read
meanwhile. A subscription asked for again before its turn is sent once; one asked
for again while it is being sent starts over; one unsubscribed stops. The first page
is read before the SUBACK when nothing else is being sent: a small retained set then
reaches the client right after its SUBACK, ahead of any message published after it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from ..core.retained import RetainedStore
from ..ds import Message
from ..errors import StorageError
from ..session.model import Subscription
from ..session.outbox import Delivery
from ..session.session import Session
from ..supervise import note_task_failure

log = logging.getLogger(__name__)

# Jobs kept before those no longer wanted are looked for (see `add`).
_MIN_PENDING = 16


@dataclass(eq=False)
class _Job:
    session: Session
    subscription: Subscription
    asked_us: int  # retained messages set from then on reached the subscription live
    superseded: bool = False

    @property
    def wanted(self) -> bool:
        return not self.superseded and self.session.outlet is not None \
            and self.session.subscriptions.get(self.subscription.key) is not None


class RetainedSender:
    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_job", "_page", "_pages", "_pending", "_store", "_task")

    def __init__(self, store: RetainedStore) -> None:
        self._store = store
        self._pending: dict[str, _Job] = {}  # by subscription key, in the order asked
        self._job: _Job | None = None  # the one being sent
        self._pages: AsyncGenerator[list[Message], None] | None = None  # ... its pages
        # ... what is read and not offered yet, last first (popped from the end): an
        # empty list is 56 bytes, an empty deque holds a block of 64 slots (~760)
        self._page: list[Message] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, session: Session, subscription: Subscription, asked_us: int) -> None:
        """A SUBSCRIBE asks for the retained messages of this subscription, those set
        before `asked_us` (microseconds since the epoch: once its route was made, so
        later ones reach it live)."""
        if self._job is not None and self._job.subscription.key == subscription.key:
            self._job.superseded = True
        self._pending.pop(subscription.key, None)
        self._pending[subscription.key] = _Job(session, subscription, asked_us)
        # The jobs still wanted are at most one per subscription the session holds:
        # those unsubscribed meanwhile go now and then, so a client that subscribes
        # and unsubscribes without reading grows nothing here.
        if len(self._pending) > 2 * max(len(session.subscriptions), _MIN_PENDING):
            self._pending = {key: job for key, job in self._pending.items() if job.wanted}

    async def read_ahead(self) -> None:
        """Before the SUBACK: with nothing being sent, read the next job's first page."""
        if self._task is None and self._job is None and self._pending:
            await self._read_page()

    def start(self) -> None:
        """After the SUBACK: offer what the queue takes of the page read ahead, and
        send the rest in the background."""
        self._offer()
        if self._task is None and (self._job is not None or self._pending):
            self._task = asyncio.create_task(self._run(), name="retained-send")
            self._task.add_done_callback(lambda task: note_task_failure("retained-send", task))

    async def close(self) -> None:
        """The connection ends: nothing more is sent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pending.clear()
        await self._end_job()

    async def _run(self) -> None:
        try:
            while self._job is not None or self._pending:
                if not self._page:
                    await self._read_page()
                    continue
                job = self._job
                assert job is not None
                if not job.wanted:
                    await self._end_job()
                elif not await job.session.outbox.wait_for_room():
                    return  # the connection is gone
                self._offer()
        finally:
            self._task = None

    async def _read_page(self) -> None:
        """Read the next page of the job being sent, or start the next job (a job
        read to its end, or no longer wanted, ends here)."""
        if self._job is not None and not self._job.wanted:
            await self._end_job()
        if self._job is None:
            self._job = self._pending.pop(next(iter(self._pending)))
            self._pages = self._store.pages(self._job.subscription.topic_filter,
                                            self._job.asked_us)
        assert self._pages is not None
        try:
            page = await anext(self._pages, None)
        except StorageError as exc:  # its shards' replicas out of reach, say
            log.warning("%s: the retained messages of %s could not be read: %s",
                        self._job.session.client_id, self._job.subscription.topic_filter,
                        exc.message)
            page = None
        if page is None:
            await self._end_job()
        else:
            self._page = page[::-1] + self._page  # after what is left of the last

    def _offer(self) -> None:
        """Queue what the session has room for of the page read."""
        job = self._job
        if job is None or not job.wanted:
            return
        subscription = job.subscription
        identifiers = (subscription.identifier,) if subscription.identifier else ()
        while self._page and job.session.outbox.has_room_for_backlog:
            message = self._page.pop()
            job.session.offer(Delivery(message, min(message.qos, subscription.qos), True,
                                       identifiers))

    async def _end_job(self) -> None:
        self._job = None
        self._page.clear()
        pages, self._pages = self._pages, None
        if pages is not None:
            await pages.aclose()
