"""A shared group's backlogs: the streams whose share it reads from storage, not
from the live feed (see `Backlog` in groups.py).

A group gets a backlog on a stream when none of its members has room in its queue
for a QoS 1/2 message (a slow group), and on every stream of a shard when the site's
feed of that shard had a gap (a leader dropped pushes to this site, or changed).
Deliveries a member lost when it left (queued, or in flight unacknowledged) that no
other member has room for are held, and offered first.
From there on the feed passes the stream's messages by, and this reads them, a
batch at a time, and offers each one this site is chosen for (`SiteChoice`) to a
member with room, waiting for room as long as the group has members. Memory stays
bounded: a position per stream and one batch.

At the stream's end with nothing fed meanwhile the backlog is caught up and the
live feed delivers again; a message storage gave already that the feed brings late
is passed over. So the group gets each message once, in stream order.

The positions live in memory only: a site that dies takes its groups' backlogs with
it, and the sites left replay only its last moments (replay.py)."""

from __future__ import annotations

import asyncio
import logging

from ..ds import EndOfStream, Message, Stream
from ..errors import InvalidIteratorError, StorageError
from ..session.reader import MessageReader
from ..supervise import RESTART_PAUSE, note_failure
from .choice import SiteChoice
from .groups import Backlog, SharedGroup

log = logging.getLogger(__name__)

BATCH = 256
# How often a delivery held up by the members' full queues looks again: room comes
# as clients acknowledge, and no session tells its groups of it.
ROOM_POLL = 0.05


async def deliver_when_room(group: SharedGroup, message: Message, stream: Stream) -> bool:
    """Offer a message read from storage (or held) to a member of the group with room,
    waiting for one; False when the group's last member here went meanwhile."""
    while not group.deliver(message, stream, needs_room=True):
        await asyncio.sleep(ROOM_POLL)
        if group.gone:
            return False
    return True


class SharedBacklog:
    """Reads the backlogs the dispatcher tells of (`start`), each message this site is
    chosen for by `choice`."""

    def __init__(self, storage: MessageReader, db: str, choice: SiteChoice) -> None:
        self._storage = storage
        self._db = db
        self._choice = choice
        self._readers: dict[SharedGroup, asyncio.Task[None]] = {}

    def add(self, group: SharedGroup, stream: Stream, since: int) -> None:
        """Read the group's share of the stream from storage from `since` on (a feed
        gap: the site may have missed messages from there; a member back: the group
        stopped settling there). A backlog that began later reads again from `since`."""
        backlog = group.backlogs.get(stream)
        if backlog is None or since < backlog.since:
            group.backlogs[stream] = Backlog(since)
        else:  # what it read is delivered; it reads on from there
            backlog.caught_up = False
            backlog.dirty = True
        self.start(group)

    def on_back(self, group: SharedGroup, since: dict[int, int]) -> None:
        """A group whose members were all away has one again: it reads its streams
        from where they stopped settling messages, per shard (at least once: what
        was sent and not acknowledged comes again)."""
        if not since:
            return
        for _rank, stream in self._storage.get_streams(self._db, group.topic_filter,
                                                       min(since.values())):
            if stream.shard in since:
                self.add(group, stream, since[stream.shard])

    def on_feed_gap(self, group: SharedGroup, shard: int, since: int) -> None:
        """The site may have missed the shard's messages from `since` on: the group
        reads its streams of the shard from there."""
        for _rank, stream in self._storage.get_streams(self._db, group.topic_filter, since):
            if stream.shard == shard:
                self.add(group, stream, since)

    async def close(self) -> None:
        for task in list(self._readers.values()):
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)

    def start(self, group: SharedGroup) -> None:
        """A group has a backlog: make sure a reader reads it. A reader that returned
        (nothing behind) is done at once, before anything else runs."""
        reader = self._readers.get(group)
        if reader is None or reader.done():
            reader = asyncio.create_task(self._read_group(group),
                                         name=f"shared-backlog-{group.key}")
            self._readers[group] = reader
            reader.add_done_callback(lambda task: self._ended(group, task))

    def _ended(self, group: SharedGroup, task: asyncio.Task[None]) -> None:
        if self._readers.get(group) is task:
            del self._readers[group]

    async def _read_group(self, group: SharedGroup) -> None:
        while not group.gone:
            if group.held:
                await self._offer_held(group)
                continue
            behind = [(stream, backlog) for stream, backlog in group.backlogs.items()
                      if not backlog.caught_up]
            if not behind:
                return  # a new backlog starts another reader
            for stream, backlog in behind:
                if group.gone:
                    return
                try:
                    await self._read(group, stream, backlog)
                except StorageError as exc:
                    if not exc.recoverable:  # a generation dropped by retention
                        log.error("shared group %s: stream %s not read further: %s",
                                  group.key, stream, exc.message)
                        if group.backlogs.get(stream) is backlog:
                            del group.backlogs[stream]
                        continue
                    log.info("shared group %s: a read failed, retrying: %s", group.key,
                             exc.message)
                    await asyncio.sleep(RESTART_PAUSE)
                except Exception:  # a bug: counted and logged, and the reader goes on
                    note_failure("shared-backlog")
                    await asyncio.sleep(RESTART_PAUSE)

    async def _offer_held(self, group: SharedGroup) -> None:
        """The deliveries members lost when they left, each to a member with room."""
        while group.held:
            delivery = group.held[0]
            assert delivery.stream is not None  # every shared delivery has its stream
            if not await deliver_when_room(group, delivery.message, delivery.stream):
                return
            group.held.popleft()

    async def _read(self, group: SharedGroup, stream: Stream, backlog: Backlog) -> None:
        """One batch of the stream's backlog, each message this site is chosen for
        offered to a member with room."""
        if backlog.iterator is None:
            try:
                backlog.iterator = self._storage.make_iterator(
                    self._db, stream, group.topic_filter, backlog.since)
            except InvalidIteratorError:  # its generation was dropped by retention
                del group.backlogs[stream]
                return
        backlog.dirty = False
        result = await self._storage.next(self._db, backlog.iterator, BATCH)
        if group.backlogs.get(stream) is not backlog:
            return
        if isinstance(result, EndOfStream):  # a closed generation, read to its end
            del group.backlogs[stream]
            return
        iterator, batch = result
        for _key, message in batch:
            if self._choice.delivers_here(group, message) \
                    and not await deliver_when_room(group, message, stream):
                return
            # settled: should the group go from here now, another site takes its
            # share on after this message
            backlog.iterator = iterator.advanced_to(message.timestamp)
        backlog.iterator = iterator
        if not batch and not backlog.dirty:
            backlog.caught_up = True
