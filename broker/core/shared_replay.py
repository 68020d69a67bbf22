"""The share of a shared group's messages that a lost site was chosen for.

Each message of a `$share` group goes to one site with members of the group, chosen
alike by every site (`Dispatcher.delivers_here`). A site that goes silent (killed,
cut off) stays chosen until the others forget it (`INTEREST_EXPIRY` after it last
told them its filters): the messages hashed to it meanwhile reach no member. When it
is forgotten, each site with members of such a group reads the group's messages
from storage, from a little before the lost site last spoke (its feed lags its
tellings) up to the moment it was forgotten, and delivers those the lost site was
chosen for and this site is chosen for now. Every site left computes the same
choice, so each such message goes to one of them: at least once, since what the
lost site did deliver in that window reaches the group again. QoS 0 messages are
not delivered again (at most once).

The sites left forget the lost one each in its own interest loop, up to about a
second apart. Between the two, a message another site left was chosen for before
and this one is chosen for now may be passed over by both (the first has moved on
to the new choice, this one still uses the old): so for the last FORGET_SKEW before
this site forgot, it also delivers those, and some come twice."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from ..ds import DurableStorage, EndOfStream, Message, Stream
from ..errors import InvalidIteratorError, StorageError
from ..supervise import RESTART_PAUSE
from .dispatch import Dispatcher, SharedGroup

log = logging.getLogger(__name__)

BATCH = 256
# How far apart the sites left may forget a lost site (each in its interest loop,
# run every second), with room for a loaded machine.
FORGET_SKEW = 2.0
# How often a replay held up by its members' full queues looks again.
ROOM_POLL = 0.05
# A read that fails (a shard's replicas out of reach) is tried again this many times.
READ_TRIES = 10


class SharedReplay:
    def __init__(self, storage: DurableStorage, db: str, dispatcher: Dispatcher) -> None:
        self._storage = storage
        self._db = db
        self._dispatcher = dispatcher
        self._tasks: set[asyncio.Task[None]] = set()

    def on_site_lost(self, site: str, share_filters: frozenset[str], since_us: int,
                     until_us: int) -> None:
        """`site` held these `$share/group/filter`s and was forgotten at `until_us`,
        having last spoken after `since_us` (a storage timestamp, µs)."""
        for share_filter in sorted(share_filters):
            group = self._dispatcher.group_of(share_filter)
            if group is None:
                continue  # no member here
            task = asyncio.create_task(self._replay(group, site, since_us, until_us),
                                       name=f"shared-replay-{group.key}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _replay(self, group: SharedGroup, lost: str, since_us: int,
                      until_us: int) -> None:
        chosen_before = sorted({*self._dispatcher.sites_of(group), lost})
        moved_since = until_us - int(FORGET_SKEW * 1_000_000)
        delivered = 0
        for _rank, stream in self._storage.get_streams(self._db, group.topic_filter,
                                                       since_us):
            async for batch in self._read(group, stream, since_us, until_us):
                for message in batch:
                    if self._dispatcher.takes_lost_share(group, message, chosen_before,
                                                         lost, moved_since):
                        # The members' queues are half full: they drain as clients
                        # acknowledge (the other half is the live feed's). Polling,
                        # for a replay that is rare, instead of a wake-up on every
                        # send of every session.
                        while not group.takes_backlog:  # noqa: ASYNC110
                            await asyncio.sleep(ROOM_POLL)
                        self._dispatcher.deliver_shared(group, message)
                        delivered += 1
        log.info("shared group %s: %d messages chosen for the lost site %s delivered "
                 "here", group.key, delivered, lost)

    async def _read(self, group: SharedGroup, stream: Stream, since_us: int,
                    until_us: int) -> AsyncIterator[list[Message]]:
        """The QoS 1 and 2 messages of a stream from `since_us` to `until_us`, a
        batch at a time."""
        try:
            iterator = self._storage.make_iterator(self._db, stream, group.topic_filter,
                                                   since_us)
        except InvalidIteratorError:  # dropped by retention meanwhile
            return
        failures = 0
        while True:
            try:
                result = await self._storage.next(self._db, iterator, BATCH)
            except StorageError as exc:
                failures += 1
                if not exc.recoverable or failures >= READ_TRIES:
                    log.warning("shared group %s: the lost share of %s not read further: "
                                "%s", group.key, stream, exc.message)
                    return
                await asyncio.sleep(RESTART_PAUSE)
                continue
            if isinstance(result, EndOfStream):
                return
            iterator, batch = result
            if not batch:
                return  # the stream's end so far: newer messages came live
            within = [message for _key, message in batch if message.timestamp <= until_us]
            yield [message for message in within if message.qos > 0]
            if len(within) < len(batch):
                return
