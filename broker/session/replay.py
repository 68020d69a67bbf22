"""How a session's messages reach its outbox: from storage through its cursors
(replay), or from the live commit feed.

A durable session reads every stream of its subscriptions from storage until a
cursor has caught up; then that cursor takes the live feed, and goes back to storage
whenever the feed would overtake it (the queue full, an older generation not ended,
a gap in the feed).

A transient session takes the live feed straight into its queue. When a QoS 1/2
message finds the queue full, it does not drop it: it opens in-memory cursors on
that stream from that message on and reads from storage like a durable session
until it has caught up. Only QoS 0 messages are ever dropped for a full queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ..deadlines import Deadlines
from ..ds import EndOfStream, Message, Stream
from ..errors import InvalidIteratorError, StorageError
from ..flag import Flag
from ..supervise import RESTART_PAUSE, note_failure
from .cursors import Cursor
from .model import CursorState, Subscription, cursor_key
from .outbox import Delivery, Outbox
from .reader import MessageReader
from .routes import Routes, delivery_for
from .streams import Streams

log = logging.getLogger(__name__)

# Storage reads a replay pass makes before it lets the event loop run others: a read
# on the loop does not yield, and a wildcard filter may have thousands of streams.
REPLAY_SLICE = 32


class Replay:
    """`offer` hands a delivery to the session (which asks the ACL once more).

    The reader is a task only while there is something to read from storage (a
    cursor off the live feed, the queue waiting for room, a durable connection's
    first look and resends): `wake` starts it again (streams call it through the
    session). An idle connection's session held one more task and its frames, 1 KB
    (issue 25), waiting for nothing."""

    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_batch_size", "_client_id", "_cursors", "_db", "_durable", "_idle_poll_interval",
                 "_offer", "_outbox", "_polls", "_reader", "_routes", "_storage", "_streams",
                 "_turn", "_waiting_for_room", "_wake")


    def __init__(self, client_id: str, *, storage: MessageReader, messages_db: str,
                 batch_size: int, idle_poll_interval: float, streams: Streams,
                 routes: Routes, outbox: Outbox, offer: Callable[[Delivery], None],
                 durable: Callable[[], bool], polls: Deadlines) -> None:
        self._client_id = client_id
        self._storage = storage
        self._db = messages_db
        self._batch_size = batch_size
        self._idle_poll_interval = idle_poll_interval
        self._streams = streams
        self._cursors = streams.cursors
        self._routes = routes
        self._outbox = outbox
        self._offer = offer
        self._durable = durable
        self._wake = Flag()  # there may be something to read: a waiting reader reads
        self._polls = polls  # the site's sessions' safety-net polls, on one timer
        self._reader: asyncio.Task[None] | None = None
        # Set while the replay has streams to read and the queue has no room for them:
        # the live feed then queues nothing more either (its cursors read storage in
        # their turn), or streams on the live feed would keep a backlog from the queue.
        self._waiting_for_room = False
        # where the next replay round starts: each stream gets its turn at the queue
        self._turn = 0

    # -- the reader task -------------------------------------------------------------

    def start(self) -> None:
        """A durable session's connection came: resend what it has not acknowledged,
        read what it has not had."""
        self._streams.prune_dropped_generations()
        self._streams.renew()
        if self._reader is None:
            self._start_reader()

    def wake(self) -> None:
        """There may be something new to read: the reader reads it, started if
        there is something to read and none is running."""
        self._wake.set()
        if self._reader is None and self._outbox.outlet is not None \
                and (self._waiting_for_room or self._cursors.any_to_read()):
            self._start_reader()

    def _start_reader(self) -> None:
        self._reader = asyncio.create_task(self._supervised_replay(),
                                           name=f"replay-{self._client_id}")

    async def stop(self) -> None:
        """The connection is gone: stop reading (after the outbox has disconnected)."""
        self._wake.set()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None

    def finished(self, delivery: Delivery) -> None:
        """The outbox is done with a delivery (sent at QoS 0, acknowledged, expired,
        refused): its cursor moves on."""
        cursor = delivery.cursor
        if cursor is not None:
            cursor.done(delivery.message.timestamp)
            self._streams.forget_if_complete(cursor)

    def room_made(self) -> None:
        """The outbox's queue is under its replay mark: a replay waiting for room
        reads on."""
        if self._waiting_for_room:
            self.wake()

    async def _resend_in_order(self) -> None:
        """Unacknowledged messages go out again in the order they were first sent,
        across streams (MQTT-4.6.0-1), before replay reads anything new. Within a
        stream they are a prefix of what follows its position, so replay then goes
        on after the last one."""
        for key, timestamp in self._outbox.resends.in_order():
            cursor = self._cursors.get(key)
            if cursor is None or self._outbox.outlet is None:
                continue
            message = await self._storage.read_message(self._db, cursor.stream, timestamp)
            if (key, timestamp) not in self._outbox.resends \
                    or self._cursors.get(key) is not cursor:
                continue
            if message is None:  # its generation was dropped by retention meanwhile
                self._outbox.resends.drop((key, timestamp))
                self._streams.report_loss(
                    1, f"{cursor.stream.shard}/{cursor.stream.generation}")
                continue
            self._offer_stored(cursor, message)

    async def _supervised_replay(self) -> None:
        # A failed read must neither leave the session without its stored messages
        # nor make stop() (which awaits this task) raise while a session closes.
        try:
            while self._outbox.outlet is not None:
                try:
                    await self._replay()
                    return
                except StorageError as exc:
                    if not exc.recoverable:
                        note_failure("session-replay")
                    else:  # a shard's replicas out of reach for now: read on later
                        log.info("session %s: a read failed, retrying: %s", self._client_id,
                                 exc.message)
                except Exception:
                    note_failure("session-replay")
                await asyncio.sleep(RESTART_PAUSE)
        finally:
            # With no await since its last look: a wake-up from now on starts another.
            self._reader = None

    async def _replay(self) -> None:
        await self._resend_in_order()
        while self._outbox.outlet is not None:
            self._wake.clear()
            progressed = False
            self._waiting_for_room = False
            cursors = list(self._cursors.values())
            start = self._turn % len(cursors) if cursors else 0
            reads = 0
            for turn, cursor in enumerate(cursors[start:] + cursors[:start]):
                if reads == REPLAY_SLICE:
                    reads = 0
                    await asyncio.sleep(0)  # reads on the loop do not yield: let others in
                if self._outbox.outlet is None:
                    break
                if cursor.live or cursor.ended or self._cursors.blocked(cursor) \
                        or self._cursors.get(cursor.key) is not cursor:
                    continue
                reads += 1
                if not self._outbox.has_room_for_backlog:
                    self._waiting_for_room = True  # acks wake us (see finished)
                    self._turn = start + turn
                    break
                cursor.dirty = False
                result = await self._storage.next(self._db, cursor.reader(), self._batch_size)
                if self._cursors.get(cursor.key) is not cursor \
                        or self._streams.going(cursor.stream):
                    continue  # unsubscribed meanwhile, or counted as lost to retention
                if isinstance(result, EndOfStream):
                    self._cursors.end(cursor)
                    self._streams.forget_if_complete(cursor)
                    progressed = True
                    continue
                iterator, batch = result
                for _key, message in batch:
                    if message.timestamp in cursor.done_early:
                        cursor.last_handed = message.timestamp
                        continue
                    self._offer_stored(cursor, message)
                cursor.iterator = iterator
                cursor.last_handed = iterator.last_timestamp
                if batch:
                    progressed = True
                elif not cursor.dirty:
                    cursor.live = True
                else:
                    progressed = True
            if not progressed:
                if not self._cursors.any_to_read():
                    # Every cursor on the live feed or ended: nothing to read until a
                    # wake-up says so (a cursor leaves the feed only with one), which
                    # starts a reader again.
                    return
                # Woken by the feed, acks and new streams. The poll is a safety net
                # should a wake-up ever be missed (on the registry's one timer: an
                # idle session's own held 0.8 KB); a poll of every idle durable
                # connection each interval was a site's idle work that grew with its
                # connections (issue 25).
                tick = self._polls.add(self, asyncio.get_running_loop().time()
                                       + self._idle_poll_interval)
                try:
                    await self._wake.wait()
                finally:
                    self._polls.discard(self, tick)

    def expire(self) -> None:
        """The safety-net poll's time (`polls`): read again."""
        self.wake()

    # -- the live feed -------------------------------------------------------------

    def on_feed(self, stream: Stream, message: Message) -> None:
        """A committed message that matches at least one of this session's
        subscriptions (the commit feed calls this once per session and message)."""
        outlet = self._outbox.outlet
        durable = self._durable()
        if outlet is None and not durable:
            return
        routes = self._routes.reaching(message.topic, outlet)
        if not routes:
            return
        if durable:
            for subscription in routes:
                opened: list[Cursor] = []
                cursor = self._streams.cursor_for(subscription, stream, opened)
                self._cursors.retire_older(opened)
                if cursor is not None:
                    self._feed_cursor(cursor, message)
            return
        if self._cursors and any(self._reads_from_storage(subscription, stream)
                                 for subscription in routes):
            self._catch_up(routes, stream, message)
            return
        self._offer_live(routes, stream, message)

    def on_feed_gap(self, shard: int, since: int) -> None:
        """The site may have missed committed messages of a shard in its feed, from
        timestamp `since` on: the cursors on it read from storage again, from their
        positions; a connected transient session opens cursors on the shard's streams
        it reads from `since` (or its subscription's start), as when its queue is
        full, so it loses no QoS 1/2 message and gets none twice."""
        for cursor in self._cursors.values():
            if cursor.stream.shard == shard:
                cursor.live = False
                cursor.dirty = True
        if not self._durable() and self._outbox.outlet is not None:
            for subscription in self._routes.subscriptions.values():
                if subscription.share_group is not None:
                    continue
                start = max(since, subscription.since)
                for _rank, stream in self._storage.get_streams(
                        self._db, subscription.topic_filter, start):
                    key = cursor_key(subscription.topic_filter, stream)
                    if stream.shard == shard and key not in self._cursors:
                        self._catch_up_cursor(key, subscription, stream, start)
        self.wake()

    def _feed_cursor(self, cursor: Cursor, message: Message) -> None:
        if cursor.live and not self._waiting_for_room and not self._cursors.blocked(cursor) \
                and self._outbox.has_room:
            if message.timestamp > cursor.last_handed:
                self._offer_stored(cursor, message)
        else:
            cursor.live = False
            cursor.dirty = True
            self.wake()

    def _offer_live(self, routes: list[Subscription], stream: Stream,
                    message: Message) -> None:
        """A transient session's live delivery. With the queue full, a QoS 0 message
        already queued makes room (or the new QoS 0 message is dropped), counted; a
        QoS 1/2 message sends this stream's readers to storage from it on."""
        receivers = [subscription for subscription in routes
                     if not (subscription.no_local and message.client_id == self._client_id)]
        if not receivers:
            return
        delivery = delivery_for(receivers, message)
        # A QoS 0 one the outbox drops itself (counted) when nothing makes room.
        if delivery.qos > 0 and not self._outbox.has_room and not self._outbox.make_room():
            self._catch_up(routes, stream, message)
            return
        self._outbox.enqueue(delivery)

    def _reads_from_storage(self, subscription: Subscription, stream: Stream) -> bool:
        """Whether a transient session reads this stream of the subscription from
        storage: it has a cursor on it, or on an older generation of its shard that
        has not ended (generations are read in order)."""
        if cursor_key(subscription.topic_filter, stream) in self._cursors:
            return True
        return any(cursor.subscription.key == subscription.key
                   and cursor.stream.shard == stream.shard
                   and cursor.stream.generation < stream.generation and not cursor.ended
                   for cursor in self._cursors.values())

    def _catch_up(self, routes: list[Subscription], stream: Stream, message: Message) -> None:
        """Feed the message to a transient session's cursors on its stream; a
        subscription without one gets one that starts at this message. Every
        message after it on the stream reaches the subscription through the cursor,
        so there is no gap and, with its position, no duplicate."""
        for subscription in routes:
            key = cursor_key(subscription.topic_filter, stream)
            cursor = self._cursors.get(key)
            if cursor is None:
                cursor = self._catch_up_cursor(key, subscription, stream, message.timestamp)
            if cursor is not None:
                self._feed_cursor(cursor, message)

    def _catch_up_cursor(self, key: str, subscription: Subscription, stream: Stream,
                         timestamp: int) -> Cursor | None:
        try:
            iterator = self._storage.make_iterator(self._db, stream, subscription.topic_filter,
                                                   timestamp)
        except InvalidIteratorError:  # its generation was dropped: nothing left to read
            return None
        cursor = Cursor(key, subscription, stream, iterator, CursorState(timestamp - 1))
        self._cursors.add(cursor)
        return cursor

    def _offer_stored(self, cursor: Cursor, message: Message) -> None:
        """Offer a message a cursor has reached. When several subscriptions reach it,
        the cursor of the first of them delivers it and the others pass it by; so
        does every cursor when no subscription may deliver it (no local, ACL): it is
        skipped, never blocking the cursor. A resend keeps its packet identifier and
        goes out through the cursor it was first sent from."""
        timestamp = message.timestamp
        packet_id = self._outbox.resends.take((cursor.key, timestamp))
        receivers = self._routes.receivers(message, self._outbox.outlet)
        own = cursor.subscription
        delivers = bool(receivers) and (
            receivers[0] is own or receivers[0].key == own.key
            or (packet_id is not None and own.key in {s.key for s in receivers}))
        cursor.handed_out(timestamp)
        if not delivers:
            if packet_id is not None:
                self._outbox.resends.release(packet_id)
            cursor.done(timestamp)
            return
        delivery = delivery_for(receivers, message)
        delivery.cursor = cursor
        if packet_id is not None:
            delivery.packet_id = packet_id
            delivery.dup = True
        self._offer(delivery)
