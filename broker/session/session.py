"""A session at runtime: subscriptions, the in-flight window, the queue, and (for a
durable session) one cursor per (subscription, stream) that replays from storage
until it has caught up and then takes the live commit feed.

A transient session takes the live feed into its queue. When a QoS 1/2 message finds
the queue full, the session does not drop it: it opens in-memory cursors on that
stream from that message on and reads from storage like a durable session until it
has caught up. Only QoS 0 messages are ever dropped for a full queue (counted).

A message that matches several subscriptions of a session is delivered once, at the
highest QoS they grant, with all their identifiers; each delivery is checked against
the ACL of the connection (the filter as subscribed, and the topic).

The connection it is attached to is an `Outlet`; with none attached a durable session
stays in storage only (nothing queues in memory for it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

from ..ds import DurableStorage, EndOfStream, Message, Stream
from ..errors import InvalidIteratorError, StorageError
from ..metrics import MESSAGES_DROPPED, SESSION_MESSAGES_EXPIRED
from ..supervise import RESTART_PAUSE, note_failure
from .cursors import Cursor, CursorTable
from .inbound_qos2 import InboundQos2
from .model import (
    CursorState,
    SessionRecord,
    StoredParts,
    Subscription,
    WillRecord,
    cursor_key,
    parse_cursor_key,
)
from .outbox import Delivery, Outbox, Outlet
from .routes import Routes, delivery_for

log = logging.getLogger(__name__)

_T = TypeVar("_T")
# Messages one read takes when counting what a dropped generation takes with it.
_COUNT_BATCH = 1000
# Storage reads a replay pass makes before it lets the event loop run others: a read
# on the loop does not yield, and a wildcard filter may have thousands of streams.
REPLAY_SLICE = 32


class Session:
    def __init__(self, client_id: str, *, durable: bool, expiry_interval: int,
                 storage: DurableStorage, messages_db: str, max_queued: int, batch_size: int,
                 idle_poll_interval: float,
                 persist: Callable[[Session], Awaitable[None]],
                 on_shared_loss: Callable[[Delivery], None]) -> None:
        self.client_id = client_id
        self.durable = durable
        self.expiry_interval = expiry_interval
        self.routes = Routes(client_id)
        self.will: WillRecord | None = None
        self.owner_epoch = 0
        self.username: str | None = None  # the user it belongs to
        self.persist_lock = asyncio.Lock()
        self.inbound_qos2 = InboundQos2()
        self._storage = storage
        self._db = messages_db
        self._batch_size = batch_size
        self._idle_poll_interval = idle_poll_interval
        # Set while the replay has streams to read and the queue has no room for them:
        # the live feed then queues nothing more either (its cursors read storage in
        # their turn), or streams on the live feed would keep a backlog from the queue.
        self._waiting_for_room = False
        # where the next replay round starts: each stream gets its turn at the queue
        self._replay_turn = 0
        self._persist = persist
        self._on_shared_loss = on_shared_loss
        self.outbox = Outbox(max_queued, save=self.persist_now,
                             request_save=self.request_persist, finished=self._finished,
                             durable=lambda: self.durable)
        self._cursors = CursorTable()
        self._wake = asyncio.Event()
        self._replayer: asyncio.Task[None] | None = None
        self._persist_pending = False
        self._persist_task: asyncio.Task[None] | None = None
        # The parts of this session known to be in storage (None: not known, after a
        # write whose outcome is not): a save writes only what differs from them.
        # Kept by the registry, which saves; a new session has none stored.
        self.stored_parts: StoredParts | None = StoredParts()
        # cursor progress of streams not being read right now (offline, or restored)
        self._restored_cursors: dict[str, CursorState] = {}
        # cursors complete in their closed generation (see `_forget_if_complete`)
        self._done_cursors: set[str] = set()
        # the storage's stream version at the last look for streams (see renew_*)
        self._stream_version = 0
        # (shard, generation)s retention is about to drop, their loss already counted:
        # nothing more of them is read or sent (see `before_generation_drop`)
        self._going: set[tuple[int, int]] = set()

    # -- persisted form -----------------------------------------------------------

    def to_record(self, disconnected_at: float | None) -> SessionRecord:
        return SessionRecord(
            client_id=self.client_id,
            expiry_interval=self.expiry_interval,
            subscriptions=list(self.subscriptions.values()),
            cursors={**{key: CursorState(state.position, list(state.done_above))
                        for key, state in self._restored_cursors.items()},
                     **{key: CursorState(c.state.position, list(c.state.done_above))
                        for key, c in self._cursors.items()}},
            pubrel_pending=self.outbox.pubrel_pending(),
            # in the order they were first sent: resent in that order too
            resend=[(pid, key, timestamp)
                    for (key, timestamp), pid in self.outbox.unacknowledged().items()],
            done=sorted(self._done_cursors),
            will=self.will,
            disconnected_at=disconnected_at,
            owner_epoch=self.owner_epoch,
            username=self.username,
        )

    def restore(self, record: SessionRecord) -> None:
        """Take over the state a durable session left in storage."""
        self.routes.replace_all(record.subscriptions)
        self.owner_epoch = record.owner_epoch + 1
        self.username = record.username
        # Messages past PUBREC are never published again: only their PUBREL is.
        self.outbox.restore(record.pubrel_pending, record.resend)
        # copies: the cursors move on from them, and the record's are the stored parts
        self._restored_cursors = {key: CursorState(state.position, list(state.done_above))
                                  for key, state in record.cursors.items()}
        self.stored_parts = record.as_parts()
        self._done_cursors = set(record.done)

    # -- settings of the connection that holds it ----------------------------------

    def configure(self, expiry_interval: int, durable: bool) -> None:
        self.expiry_interval = expiry_interval
        self.durable = durable

    def set_owner(self, username: str | None) -> None:
        self.username = username

    def drop_subscriptions(self, allowed: Callable[[str], bool]) -> list[Subscription]:
        """Remove the subscriptions whose filter (as the client wrote it) is no longer
        allowed; returns them."""
        denied = [key for key in self.subscriptions if not allowed(key)]
        return [removed for key in denied
                if (removed := self.unsubscribe(key)) is not None]

    def set_expiry_interval(self, expiry_interval: int) -> None:
        self.expiry_interval = expiry_interval

    def end_durability(self) -> None:
        """No later persist may write the record (back)."""
        self.durable = False

    def set_will(self, will: WillRecord | None) -> None:
        self.will = will

    def take_will(self) -> WillRecord | None:
        """The will, once: it is cleared."""
        will, self.will = self.will, None
        return will

    # -- subscriptions ------------------------------------------------------------

    def subscribe(self, subscription: Subscription) -> bool:
        """Add or replace a subscription; True when it is new."""
        return self.routes.add(subscription)

    def unsubscribe(self, key: str) -> Subscription | None:
        subscription = self.routes.remove(key)
        if subscription is not None and subscription.share_group is None:
            self._forget_cursors(lambda cursor_key: parse_cursor_key(cursor_key)[0]
                                 == subscription.topic_filter)
        return subscription

    # -- durable replay -----------------------------------------------------------

    def renew_streams(self, subscriptions: Iterable[Subscription] | None = None) -> None:
        """Look for streams the durable subscriptions do not read yet: those of
        `subscriptions` only (the new ones of a SUBSCRIBE), or of all."""
        if not self.durable:
            return
        if subscriptions is None:
            subscriptions = self.subscriptions.values()
            self._stream_version = self._storage.db(self._db).stream_version
        opened: list[Cursor] = []
        for subscription in subscriptions:
            if subscription.share_group is not None:
                continue
            for _rank, stream in self._storage.get_streams(self._db, subscription.topic_filter,
                                                           subscription.since):
                self._cursor_for(subscription, stream, opened)
        self._cursors.retire_older(opened)
        self._wake.set()

    def renew_new_streams(self) -> None:
        """Look only at the streams the storage learned since the last look (the
        periodic look: nothing to do while no stream is new)."""
        if not self.durable:
            return
        # The replay is woken on every look, new streams or not, as before this look
        # became incremental: a crash test (test_broker_crash) then lost a stream's
        # tail now and then without it, so some wake-up is missed somewhere.
        self._wake.set()
        database = self._storage.db(self._db)
        if database.stream_version == self._stream_version:
            return
        version = database.stream_version
        opened: list[Cursor] = []
        for subscription in self.subscriptions.values():
            if subscription.share_group is not None:
                continue
            version, found = database.get_streams_since(subscription.topic_filter,
                                                        self._stream_version)
            for _rank, stream in found:
                self._cursor_for(subscription, stream, opened)
        self._cursors.retire_older(opened)
        self._stream_version = version
        self._wake.set()

    def _cursor_for(self, subscription: Subscription, stream: Stream,
                    opened: list[Cursor]) -> Cursor | None:
        """The subscription's cursor on the stream, opened if need be (then appended
        to `opened`: the caller hands those to `CursorTable.retire_older`); None for
        a stream done or going."""
        key = cursor_key(subscription.topic_filter, stream)
        cursor = self._cursors.get(key)
        if cursor is not None:
            return cursor
        if key in self._done_cursors or (stream.shard, stream.generation) in self._going:
            return None  # read to its end already, or about to be dropped
        state = self._restored_cursors.get(key) or CursorState(max(subscription.since - 1, 0))
        try:
            iterator = self._storage.make_iterator(self._db, stream, subscription.topic_filter,
                                                   state.position + 1)
        except InvalidIteratorError:  # dropped since: the next attach prunes its state
            return None
        self._restored_cursors.pop(key, None)
        cursor = Cursor(key, subscription, stream, iterator, state,
                        done_early=set(state.done_above))
        self._cursors.add(cursor)
        opened.append(cursor)
        return cursor

    async def _resend_in_order(self) -> None:
        """Unacknowledged messages go out again in the order they were first sent,
        across streams (MQTT-4.6.0-1), before replay reads anything new. Within a
        stream they are a prefix of what follows its position, so replay then goes
        on after the last one."""
        for key, timestamp in self.outbox.resend_keys():
            cursor = self._cursors.get(key)
            if cursor is None or self.outlet is None:
                continue
            message = await self._storage.read_message(self._db, cursor.stream, timestamp)
            if not self.outbox.is_resend((key, timestamp)) \
                    or self._cursors.get(key) is not cursor:
                continue
            if message is None:  # its generation was dropped by retention meanwhile
                self.outbox.drop_resend((key, timestamp))
                self._report_loss(1, f"{cursor.stream.shard}/{cursor.stream.generation}")
                continue
            self._offer_durable(cursor, message)

    async def _supervised_replay(self) -> None:
        # A failed read must neither leave the session without its stored messages
        # nor make detach() (which awaits this task) raise while a session closes.
        while self.outlet is not None:
            try:
                await self._replay()
                return
            except StorageError as exc:
                if not exc.recoverable:
                    note_failure("session-replay")
                else:  # a shard's replicas out of reach for now: read on later
                    log.info("session %s: a read failed, retrying: %s", self.client_id,
                             exc.message)
            except Exception:
                note_failure("session-replay")
            await asyncio.sleep(RESTART_PAUSE)

    async def _replay(self) -> None:
        await self._resend_in_order()
        while self.outlet is not None:
            self._wake.clear()
            progressed = False
            self._waiting_for_room = False
            cursors = list(self._cursors.values())
            start = self._replay_turn % len(cursors) if cursors else 0
            reads = 0
            for turn, cursor in enumerate(cursors[start:] + cursors[:start]):
                if reads == REPLAY_SLICE:
                    reads = 0
                    await asyncio.sleep(0)  # reads on the loop do not yield: let others in
                if self.outlet is None:
                    break
                if cursor.live or cursor.ended or self._cursors.blocked(cursor) \
                        or self._cursors.get(cursor.key) is not cursor:
                    continue
                reads += 1
                if not self.outbox.has_room_for_backlog:
                    self._waiting_for_room = True  # acks wake us (see _finished)
                    self._replay_turn = start + turn
                    break
                cursor.dirty = False
                result = await self._storage.next(self._db, cursor.reader(), self._batch_size)
                if self._cursors.get(cursor.key) is not cursor \
                        or (cursor.stream.shard, cursor.stream.generation) in self._going:
                    continue  # unsubscribed meanwhile, or counted as lost to retention
                if isinstance(result, EndOfStream):
                    self._cursors.end(cursor)
                    self._forget_if_complete(cursor)
                    progressed = True
                    continue
                iterator, batch = result
                for _key, message in batch:
                    if message.timestamp in cursor.done_early:
                        cursor.last_handed = message.timestamp
                        continue
                    self._offer_durable(cursor, message)
                cursor.iterator = iterator
                cursor.last_handed = iterator.last_timestamp
                if batch:
                    progressed = True
                elif not cursor.dirty:
                    cursor.live = True
                else:
                    progressed = True
            if not progressed:
                # Woken by the feed, acks and new streams; the timeout is a safety net
                # should a wake-up ever be missed.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._idle_poll_interval):
                        await self._wake.wait()

    def _forget_if_complete(self, cursor: Cursor) -> None:
        if cursor.ended and not cursor.in_flight and self._cursors.get(cursor.key) is cursor:
            # A closed generation's streams keep coming back from get_streams: the
            # mark stops a later look from reading this one again from the start.
            self._done_cursors.add(cursor.key)
            self._cursors.remove(cursor.key)
            self.request_persist()
            self._wake.set()

    def _forget_cursors(self, doomed: Callable[[str], bool]) -> tuple[int, int]:
        """Drop every trace of the cursors whose key is `doomed`: the cursor, its saved
        progress, its done mark and its resends (their packet identifiers are free
        again). Returns (cursor states and marks forgotten, resends forgotten): the
        resends are messages that will not be sent again."""
        states = [k for k in self._cursors if doomed(k)]
        for key in states:
            self._cursors.remove(key)
        restored = [k for k in self._restored_cursors if doomed(k)]
        for key in restored:
            del self._restored_cursors[key]
        done = {k for k in self._done_cursors if doomed(k)}
        self._done_cursors -= done
        resends = self.outbox.forget_resends(doomed)
        return len(states) + len(restored) + len(done), resends

    # -- retention ----------------------------------------------------------------

    async def before_generation_drop(self, shard: int, generation: int) -> None:
        """Retention is about to drop a generation: count (and log) the messages of it
        this session has not finished, none of which it can deliver afterwards. From
        now on it reads and resends nothing more of it, so what is counted is what is
        lost. Sent messages awaiting an acknowledgement are not counted: the client
        has them (should they be resent later, the resend counts its loss)."""
        self._going.add((shard, generation))
        if not self.durable:
            return
        resends: dict[str, set[int]] = {}
        for key, timestamp in self.outbox.resend_keys():
            if _in_generation(key, shard, generation):
                resends.setdefault(key, set()).add(timestamp)
        lost = sum(len(timestamps) for timestamps in resends.values())
        for subscription in list(self.subscriptions.values()):
            if subscription.share_group is not None:
                continue
            for rank, stream in self._storage.get_streams(self._db, subscription.topic_filter,
                                                          subscription.since):
                key = cursor_key(subscription.topic_filter, stream)
                if (rank.x, rank.y) != (shard, generation) or key in self._done_cursors:
                    continue
                unread = await self._unread(subscription, stream, key)
                lost += len(unread - resends.get(key, set()))
        self._report_loss(lost, f"{shard}/{generation}")

    async def _unread(self, subscription: Subscription, stream: Stream, key: str) -> set[int]:
        """Timestamps of the messages of a stream this session has not handed out."""
        cursor = self._cursors.get(key)
        if cursor is not None:
            position, done = cursor.last_handed, set(cursor.done_early)
        else:
            state = self._restored_cursors.get(key) or \
                CursorState(max(subscription.since - 1, 0))
            position, done = state.position, set(state.done_above)
        try:
            iterator = self._storage.make_iterator(self._db, stream, subscription.topic_filter,
                                                   position + 1)
        except InvalidIteratorError:
            return set()
        unread: set[int] = set()
        while True:
            result = await self._storage.next(self._db, iterator, _COUNT_BATCH)
            if isinstance(result, EndOfStream):
                return unread
            iterator, batch = result
            if not batch:  # not closed: cannot happen for a generation retention drops
                return unread
            unread.update(message.timestamp for _key, message in batch
                          if message.timestamp not in done and not (
                              subscription.no_local and message.client_id == self.client_id))

    def after_generation_drop(self, shard: int, generation: int) -> None:
        """A generation is gone: forget every trace of it, and look for streams
        again (newer generations may have waited on cursors into it)."""
        counted = (shard, generation) in self._going
        self._going.discard((shard, generation))
        states, resends = self._forget_cursors(
            lambda key: _in_generation(key, shard, generation))
        if not counted:  # this session came into memory after the count
            self._report_loss(resends, f"{shard}/{generation}")
        if self.outlet is not None:
            if states or resends:
                self.request_persist()
            self.renew_streams()
        self._wake.set()

    def prune_dropped_generations(self) -> None:
        """Forget cursors, done marks and resends into generations that no longer
        exist (dropped while this session was not in memory). The unacknowledged
        resends are counted as lost; unread messages of them cannot be counted any
        more, but the loss is logged."""
        existing = self._storage.list_generations(self._db)
        gone = {(stream.shard, stream.generation)
                for stream in (parse_cursor_key(key)[1] for key in
                               [*self._restored_cursors, *self._done_cursors,
                                *(key for key, _timestamp in self.outbox.resend_keys())])
                if (stream.shard, stream.generation) not in existing
                and self._storage.generations_known(self._db, stream.shard)}
        if not gone:
            return
        _states, resends = self._forget_cursors(lambda key: _generation_of(key) in gone)
        names = ", ".join(f"{shard}/{generation}" for shard, generation in sorted(gone))
        if resends:
            self._report_loss(resends, names)
        else:
            log.warning("session %s: generation(s) %s (shard/generation) dropped by "
                        "retention while it was away; any unread messages in them are lost",
                        self.client_id, names)
        self.request_persist()

    def _report_loss(self, lost: int, generations: str) -> None:
        if lost <= 0:
            return
        SESSION_MESSAGES_EXPIRED.labels("retention").inc(lost)
        # Not persisted here: a write of an offline session would move its expiry.
        log.warning("session %s lost %d messages to retention: generation(s) %s "
                    "(shard/generation) dropped before it delivered them", self.client_id,
                    lost, generations)

    # -- the live feed ------------------------------------------------------------

    def on_feed(self, stream: Stream, message: Message) -> None:
        """A committed message that matches at least one of this session's
        subscriptions (the commit feed calls this once per session and message)."""
        if self.outlet is None and not self.durable:
            return
        routes = self.routes.reaching(message.topic, self.outlet)
        if not routes:
            return
        if self.durable:
            for subscription in routes:
                opened: list[Cursor] = []
                cursor = self._cursor_for(subscription, stream, opened)
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
        if not self.durable and self.outlet is not None:
            for subscription in self.subscriptions.values():
                if subscription.share_group is not None:
                    continue
                start = max(since, subscription.since)
                for _rank, stream in self._storage.get_streams(
                        self._db, subscription.topic_filter, start):
                    key = cursor_key(subscription.topic_filter, stream)
                    if stream.shard == shard and key not in self._cursors:
                        self._catch_up_cursor(key, subscription, stream, start)
            if self._cursors and self._replayer is None:
                self._replayer = asyncio.create_task(self._supervised_replay(),
                                                     name=f"catch-up-{self.client_id}")
        self._wake.set()

    def _feed_cursor(self, cursor: Cursor, message: Message) -> None:
        if cursor.live and not self._waiting_for_room and not self._cursors.blocked(cursor) \
                and self.outbox.has_room:
            if message.timestamp > cursor.last_handed:
                self._offer_durable(cursor, message)
        else:
            cursor.live = False
            cursor.dirty = True
            self._wake.set()

    def _offer_live(self, routes: list[Subscription], stream: Stream,
                    message: Message) -> None:
        """A transient session's live delivery. With the queue full, a QoS 0 message
        already queued makes room (or the new QoS 0 message is dropped), counted; a
        QoS 1/2 message sends this stream's readers to storage from it on."""
        receivers = [subscription for subscription in routes
                     if not (subscription.no_local and message.client_id == self.client_id)]
        if not receivers:
            return
        delivery = delivery_for(receivers, message)
        if not self.outbox.has_room and not self.outbox.make_room():
            if delivery.qos == 0:
                MESSAGES_DROPPED.labels("queue_full").inc()
            else:
                self._catch_up(routes, stream, message)
            return
        self.outbox.enqueue(delivery)

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
        if self._replayer is None and self.outlet is not None:
            # supervised like a durable replay: a failed read is retried, and the
            # failure never surfaces in detach(), which awaits this task
            self._replayer = asyncio.create_task(self._supervised_replay(),
                                                 name=f"catch-up-{self.client_id}")

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

    def _offer_durable(self, cursor: Cursor, message: Message) -> None:
        """Offer a message a cursor has reached. When several subscriptions reach it,
        the cursor of the first of them delivers it and the others pass it by; so
        does every cursor when no subscription may deliver it (no local, ACL): it is
        skipped, never blocking the cursor. A resend keeps its packet identifier and
        goes out through the cursor it was first sent from."""
        timestamp = message.timestamp
        packet_id = self.outbox.take_resend((cursor.key, timestamp))
        receivers = self.routes.receivers(message, self.outlet)
        own = cursor.subscription
        delivers = bool(receivers) and (
            receivers[0] is own or receivers[0].key == own.key
            or (packet_id is not None and own.key in {s.key for s in receivers}))
        cursor.handed_out(timestamp)
        if not delivers:
            if packet_id is not None:
                self.outbox.release_id(packet_id)
            cursor.done(timestamp)
            return
        delivery = delivery_for(receivers, message)
        delivery.cursor = cursor
        if packet_id is not None:
            delivery.packet_id = packet_id
            delivery.dup = True
        self.offer(delivery)

    # -- sending ------------------------------------------------------------------

    def offer(self, delivery: Delivery) -> None:
        """Queue a delivery and send what the window allows. The ACL is asked once
        more here, for deliveries that come from elsewhere (retained messages)."""
        if self.outlet is None:
            if delivery.share_group is not None:
                self._on_shared_loss(delivery)
            return
        if not self.routes.may_see(delivery.message.topic, self.outlet):
            self._finished(delivery)
            return
        self.outbox.enqueue(delivery)

    def _finished(self, delivery: Delivery) -> None:
        cursor = delivery.cursor
        if cursor is not None:
            cursor.done(delivery.message.timestamp)
            self._forget_if_complete(cursor)
            self.request_persist()
        if self._waiting_for_room and self.outbox.queued_count < self.outbox.replay_room:
            self._wake.set()

    # -- connection lifecycle -----------------------------------------------------

    def attach(self, outlet: Outlet) -> None:
        """A connection takes the session: resend what is unacknowledged, in order."""
        self.outbox.attach(outlet)
        if self.durable:
            self.prune_dropped_generations()
            self.renew_streams()
            self._replayer = asyncio.create_task(self._supervised_replay(),
                                                 name=f"replay-{self.client_id}")
        self.outbox.pump()

    async def detach(self) -> None:
        """The connection is gone. A durable session drops its in-memory queue (it
        is in storage); shared deliveries move to another member of their group."""
        self.outbox.disconnect()
        self._wake.set()
        self.routes.forget_decisions()
        if self._replayer is not None:
            self._replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
            self._replayer = None
        for delivery in self.outbox.drop():
            if delivery.share_group is not None:
                self._on_shared_loss(delivery)
        if self.durable:
            # Reading resumes after the last done message of each cursor.
            for key, cursor in list(self._cursors.items()):
                self._restored_cursors[key] = cursor.state
            self._cursors.clear()

    @property
    def subscriptions(self) -> Mapping[str, Subscription]:
        return self.routes.subscriptions

    def may_receive(self, subscription: Subscription, message: Message) -> bool:
        """Whether the ACL lets this session's connection receive the message through
        the subscription (a shared one included)."""
        outlet = self.outlet
        return outlet is not None and self.routes.may_receive(subscription, message.topic,
                                                              outlet)

    @property
    def outlet(self) -> Outlet | None:
        """The connection attached, if any."""
        return self.outbox.outlet

    @property
    def outlives_connection(self) -> bool:
        """Whether the session (and its subscriptions) stays when its connection ends."""
        return self.durable and self.expiry_interval != 0

    def shared_unsettled(self, group_key: str) -> dict[int, int]:
        """Per shard, the first timestamp of this member's deliveries of a shared
        group not settled yet: queued, or sent and not acknowledged (a QoS 2 one
        the client has released has reached it)."""
        first: dict[int, int] = {}
        for delivery in self.outbox.pending():
            if delivery.share_group == group_key and delivery.stream is not None:
                shard, timestamp = delivery.stream.shard, delivery.message.timestamp
                first[shard] = min(first.get(shard, timestamp), timestamp)
        return first

    # -- persistence --------------------------------------------------------------

    def request_persist(self) -> None:
        """Persist soon; progress written late only means more redelivery."""
        if not self.durable or self._persist_pending:
            return
        self._persist_pending = True
        self._persist_task = asyncio.get_running_loop().create_task(self._persist_soon())

    async def _persist_soon(self) -> None:
        await asyncio.sleep(0.05)
        self._persist_pending = False
        try:
            await self._persist(self)
        except Exception:  # nobody awaits this task: note it and try again later
            note_failure("session-persist")
            await asyncio.sleep(RESTART_PAUSE)
            self.request_persist()

    def cancel_persist(self) -> None:
        """Drop a persist requested and not done yet."""
        if self._persist_task is not None:
            self._persist_task.cancel()
        self._persist_pending = False

    async def persist_now(self) -> None:
        if self.durable:
            await self._persist(self)


def _generation_of(key: str) -> tuple[int, int]:
    stream = parse_cursor_key(key)[1]
    return stream.shard, stream.generation


def _in_generation(key: str, shard: int, generation: int) -> bool:
    return _generation_of(key) == (shard, generation)
