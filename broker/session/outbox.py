"""What a session sends its connection: the queue, the in-flight window with its
packet identifiers, acknowledgements, and a durable session's resends in the order
they were first sent.

Two writes of the session come before a packet goes out, so that a crash after
it loses nothing and delivers nothing twice: a durable QoS 2 message's packet
identifier is saved before its PUBLISH (a resend after a crash then carries the
same identifier, and the client recognises it), and a PUBREC is saved before its
PUBREL (a message past PUBREC is never published again). Packets wait behind those
writes in order.

Order (MQTT-4.6.0-1, -3): PUBLISH packets are resent in the order they were first
sent, PUBRELs in the order their PUBRECs came; never by packet identifier, which
wraps and starts from 1 again in a restored session while its resends keep theirs."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..ds import Message, Stream
from ..flag import Flag
from ..metrics import MESSAGES_DROPPED
from ..supervise import RESTART_PAUSE, note_failure
from .expiry import is_expired

if TYPE_CHECKING:
    from .cursors import Cursor

MAX_PACKET_ID = 0xFFFF

# A durable delivery by where it was read from: (cursor key, message timestamp).
ResendKey = tuple[str, int]


class Outlet(Protocol):
    """What a session needs of a connection."""

    receive_maximum: int

    def send_publish(self, delivery: Delivery, packet_id: int | None, dup: bool) -> bool:
        """Send a PUBLISH; False when it could not be sent (too large for the client)."""
        ...

    def send_pubrel(self, packet_id: int) -> None: ...

    def may_subscribe(self, topic_filter: str) -> bool:
        """Whether the ACL lets the client hold this subscription (as subscribed)."""
        ...

    def may_receive(self, topic: str) -> bool:
        """Whether the ACL lets a message on this topic reach the client through a
        subscription it may hold."""
        ...


@dataclass(slots=True, eq=False)
class Delivery:
    message: Message
    qos: int
    retain: bool
    subscription_ids: tuple[int, ...] = ()
    cursor: Cursor | None = None
    share_group: str | None = None  # shared deliveries move to another member on loss
    stream: Stream | None = None  # a shared delivery's: read again from there on loss
    # A resend of a durable delivery the client has not acknowledged: it goes out
    # again with its original packet identifier and DUP set (MQTT-4.4.0-1, 3.3.1-1).
    packet_id: int | None = None
    dup: bool = False


@dataclass(slots=True, eq=False)
class _InFlight:
    delivery: Delivery
    released: bool = False  # outbound QoS 2 past PUBREC: only PUBREL is resent


# The queue of every outbox that has had no delivery yet: shared, so it must stay
# empty (only `enqueue` adds, and it makes the outbox a queue of its own first);
# maxlen 0 makes a slip lose the delivery rather than hand it to another session.
_NO_QUEUE: deque[Delivery] = deque(maxlen=0)


class Outbox:
    """The queue and the in-flight window of one session. `save` writes the session
    (a no-op for one that is not durable), `request_save` asks for a write soon,
    `finished` hears of every delivery that is done with (sent at QoS 0,
    acknowledged, expired, refused), `room` when the queue falls under
    `replay_room`, and `durable` tells whether the session is.
    Past ~300 lines as one state machine: the queue, the in-flight window, the packet
    identifiers and the saves that must come before a PUBLISH or a PUBREL change
    together on every send and acknowledgement (the resend order, `Resends`, is
    already apart)."""

    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_durable", "_finished", "_held", "_in_flight", "_next_packet_id",
                 "_on_room", "_pubrel_sender", "_pubrel_waiting", "_queue", "_releaser",
                 "_request_save", "_room", "_save", "max_queued", "outlet", "replay_room",
                 "resends")


    def __init__(self, max_queued: int, *, save: Callable[[], Awaitable[None]],
                 request_save: Callable[[], None], finished: Callable[[Delivery], None],
                 room: Callable[[], None], durable: Callable[[], bool]) -> None:
        self.outlet: Outlet | None = None
        self.max_queued = max_queued
        # The replay reads while the queue is under this; at least 1, or a queue of
        # one would never let it read at all.
        self.replay_room = max(1, max_queued // 2)
        self._save = save
        self._request_save = request_save
        self._finished = finished
        self._on_room = room
        self._durable = durable
        # made at the first delivery: an idle connection's would be an empty deque,
        # which holds a block of 64 slots (~760 bytes) from the start
        self._queue: deque[Delivery] = _NO_QUEUE
        # by packet identifier, in first-sent order; released ones in PUBREC order
        self._in_flight: dict[int, _InFlight] = {}
        self._next_packet_id = 1
        # deliveries waiting for their packet identifiers to be saved (see pump)
        self._held: list[tuple[Delivery, int | None]] = []
        self._releaser: asyncio.Future[None] | None = None
        # outbound QoS 2 acknowledged by PUBREC, waiting for the session write that
        # covers them before their PUBREL goes out (see on_pubrec)
        self._pubrel_waiting: list[int] = []
        self._pubrel_sender: asyncio.Future[None] | None = None
        self.resends = Resends()
        # set when the queue falls under the replay's mark (or the connection goes):
        # wakes deliveries that wait for room instead of being dropped (wait_for_room)
        self._room = Flag()

    # -- the saved form -------------------------------------------------------------

    def pubrel_pending(self) -> list[int]:
        """Packet identifiers past PUBREC, in PUBREC order."""
        return [packet_id for packet_id, entry in self._in_flight.items() if entry.released]

    def restore(self, pubrel_pending: list[int], resend: list[tuple[int, str, int]]) -> None:
        """Take over what a stored session left: messages past PUBREC (only their
        PUBREL goes out again) and the durable deliveries to resend."""
        placeholder = Message("", b"")
        for packet_id in pubrel_pending:
            self._in_flight[packet_id] = _InFlight(Delivery(placeholder, 2, False), True)
        self.resends.replace({(key, timestamp): pid for pid, key, timestamp in resend})

    def unacknowledged(self) -> dict[ResendKey, int]:
        """Durable deliveries that got a packet identifier and are not acknowledged
        (PUBREC counts): (cursor key, message timestamp) -> packet identifier."""
        # In first-sent order, which resends keep (MQTT-4.6.0-1): what is in flight
        # went out first, then the queue in its order; resends not offered again yet
        # (a disconnect in the middle of them) follow what was offered before them.
        found: dict[ResendKey, int] = {}
        for packet_id, entry in self._in_flight.items():
            cursor = entry.delivery.cursor
            if cursor is not None and not entry.released:
                found[(cursor.key, entry.delivery.message.timestamp)] = packet_id
        for delivery in self._queue:
            if delivery.packet_id is not None and delivery.cursor is not None:
                found[(delivery.cursor.key, delivery.message.timestamp)] = delivery.packet_id
        for key, packet_id in self.resends.items():
            found.setdefault(key, packet_id)
        return found

    # -- the connection ------------------------------------------------------------------

    def attach(self, outlet: Outlet) -> None:
        """A connection takes the session: resend what is unacknowledged, in order."""
        self.outlet = outlet
        # in `_in_flight`'s order: PUBLISHes in first-sent order, PUBRELs in PUBREC
        # order (MQTT-4.6.0-1, -3); packet identifiers wrap and restart after a restore
        for packet_id, entry in list(self._in_flight.items()):
            if entry.released:
                outlet.send_pubrel(packet_id)
            else:
                outlet.send_publish(entry.delivery, packet_id, True)

    def disconnect(self) -> None:
        """The connection is gone: nothing more goes out, nothing waits for room."""
        self.outlet = None
        self._room.set()
        self._held.clear()  # in flight already, or QoS 0
        self._pubrel_waiting.clear()  # released in flight: the record resends their PUBREL

    def drop(self) -> list[Delivery]:
        """After `disconnect` (and once nothing offers any more): empty the queue and
        hand back what is lost with the connection, the queue and shared deliveries
        in flight (those move to another member). A durable session keeps its
        unacknowledged deliveries as resends and only the PUBRELs in flight: the
        rest is in storage and is read again."""
        if self._durable():
            self.resends.replace(self.unacknowledged())
        lost = list(self._queue)
        self._queue.clear()
        for packet_id, entry in list(self._in_flight.items()):
            if entry.delivery.share_group is not None and not entry.released:
                del self._in_flight[packet_id]
                lost.append(entry.delivery)
        if self._durable():
            self._in_flight = {pid: e for pid, e in self._in_flight.items() if e.released}
        return lost

    # -- the queue -------------------------------------------------------------------------

    @property
    def in_flight_count(self) -> int:
        return len(self._in_flight)

    @property
    def queued_count(self) -> int:
        return len(self._queue)

    @property
    def has_room(self) -> bool:
        """Whether a delivery offered now is queued (a full queue drops a delivery
        without a cursor: a shared group waits for a member with room instead)."""
        return self.outlet is not None and len(self._queue) < self.max_queued

    @property
    def has_room_for_backlog(self) -> bool:
        """Whether a delivery that waits for room rather than being dropped (retained
        messages at SUBSCRIBE, the replay) may be queued now: below the mark the
        replay reads to, so the live feed keeps the other half of the queue."""
        return self.outlet is not None and len(self._queue) < self.replay_room

    async def wait_for_room(self) -> bool:
        """Wait until `has_room_for_backlog` (the client's acknowledgements make
        room); False once the connection is gone."""
        while self.outlet is not None and len(self._queue) >= self.replay_room:
            self._room.clear()
            await self._room.wait()
        return self.outlet is not None

    def pending(self) -> Iterator[Delivery]:
        """Deliveries queued, or sent and not acknowledged (a QoS 2 one the client
        has released has reached it)."""
        yield from self._queue
        yield from (entry.delivery for entry in self._in_flight.values() if not entry.released)

    def enqueue(self, delivery: Delivery) -> None:
        """Queue a delivery and send what the window allows. A full queue drops a
        delivery without a cursor (counted), unless a QoS 0 one of the live feed
        makes room; one with a cursor is in storage and always queued (the replay
        stops reading at `replay_room`)."""
        if len(self._queue) >= self.max_queued and delivery.cursor is None \
                and not self.make_room():
            MESSAGES_DROPPED.labels("queue_full").inc()
            return
        if self._queue is _NO_QUEUE:
            self._queue = deque()
        self._queue.append(delivery)
        self.pump()

    def make_room(self) -> bool:
        """Push the oldest queued QoS 0 message of the live feed out (counted)."""
        for index, queued in enumerate(self._queue):
            if queued.qos == 0 and queued.cursor is None:
                del self._queue[index]
                MESSAGES_DROPPED.labels("queue_full").inc()
                return True
        return False

    # -- sending -----------------------------------------------------------------------------

    def pump(self) -> None:
        """Send what the window allows, in queue order. A durable QoS 2 message
        first gets its packet identifier saved with the session, so that after a
        crash it is resent under the same identifier and the client can recognise it:
        sends wait behind that write (and keep their order)."""
        outlet = self.outlet
        batch: list[tuple[Delivery, int | None]] = []
        needs_save = False
        was_at_mark = len(self._queue) >= self.replay_room
        while outlet is not None and self._queue:
            delivery = self._queue[0]
            if delivery.qos > 0 and len(self._in_flight) >= outlet.receive_maximum:
                break
            self._queue.popleft()
            if delivery.packet_id is not None:
                self.resends.release(delivery.packet_id)
            if is_expired(delivery.message):
                MESSAGES_DROPPED.labels("expired").inc()
                self._finished(delivery)
                continue
            if delivery.qos == 0:
                batch.append((delivery, None))
                continue
            packet_id = delivery.packet_id or self._allocate_packet_id()
            self._in_flight[packet_id] = _InFlight(delivery)
            if delivery.qos == 2 and delivery.cursor is not None and delivery.packet_id is None:
                needs_save = True
            batch.append((delivery, packet_id))
        if len(self._queue) < self.replay_room:
            self._room.set()
            if was_at_mark:
                # here, not in `finished`: an acknowledgement (`finished` first) makes
                # room only once its slot in the window took the next queued delivery
                self._on_room()
        if not batch:
            return
        if needs_save or self._releaser is not None:
            self._held.extend(batch)
            if self._releaser is None:
                self._releaser = asyncio.ensure_future(self._save_then_send())
            return
        self._send(batch)

    async def _save_then_send(self) -> None:
        try:
            while self._held and self.outlet is not None:
                batch, self._held = self._held, []
                try:
                    await self._save()  # the packet identifiers of this batch
                except Exception:  # kept, in order, for the next try
                    note_failure("session-save-then-send")
                    if self.outlet is not None:  # else disconnect() has dealt with them
                        self._held[:0] = batch
                    await asyncio.sleep(RESTART_PAUSE)
                    continue
                self._send(batch)
        finally:
            self._releaser = None

    def _send(self, batch: list[tuple[Delivery, int | None]]) -> None:
        outlet = self.outlet
        if outlet is None:
            return  # disconnect() has taken care of what was in flight
        for delivery, packet_id in batch:
            if packet_id is None:
                outlet.send_publish(delivery, None, False)
                self._finished(delivery)
                continue
            entry = self._in_flight.get(packet_id)
            if entry is None or entry.delivery is not delivery:
                continue
            if not outlet.send_publish(delivery, packet_id, delivery.dup):
                del self._in_flight[packet_id]
                self._finished(delivery)
            elif delivery.cursor is not None:
                self._request_save()  # the packet identifier, for a resend after a crash

    def _allocate_packet_id(self) -> int:
        while True:
            packet_id = self._next_packet_id
            self._next_packet_id = packet_id % MAX_PACKET_ID + 1
            if packet_id not in self._in_flight and not self.resends.reserved(packet_id):
                return packet_id

    # -- acknowledgements ------------------------------------------------------------

    def on_puback(self, packet_id: int) -> bool:
        entry = self._in_flight.get(packet_id)
        if entry is None or entry.delivery.qos != 1:
            return False
        del self._in_flight[packet_id]
        self._finished(entry.delivery)
        self.pump()
        return True

    async def on_pubrec(self, packet_id: int, failed: bool) -> bool:
        """Record that the client has the message, durably, before PUBREL goes out:
        a crash after this never publishes it again."""
        entry = self._in_flight.get(packet_id)
        if entry is None or entry.delivery.qos != 2:
            return False
        if failed:  # a PUBREC with an error code ends the exchange (MQTT 5 4.3.3)
            del self._in_flight[packet_id]
            self._finished(entry.delivery)
            self.pump()
            return True
        if not entry.released:
            entry.released = True
            # to the end: released entries stand in `_in_flight` in PUBREC order, the
            # order their PUBRELs are resent in
            self._in_flight[packet_id] = self._in_flight.pop(packet_id)
            self._finished(entry.delivery)
            if self._durable():
                # The PUBREL waits for the write; the connection reads on meanwhile, so
                # one write covers the PUBRECs that arrive while the one before is under
                # way (a replicated write takes a majority's round trip).
                self._pubrel_waiting.append(packet_id)
                if self._pubrel_sender is None:
                    self._pubrel_sender = asyncio.ensure_future(self._save_then_release())
                return True
        elif packet_id in self._pubrel_waiting:
            return True  # its PUBREL follows the write it waits for
        if self.outlet is not None:
            self.outlet.send_pubrel(packet_id)
        return True

    async def _save_then_release(self) -> None:
        try:
            while self._pubrel_waiting and self.outlet is not None:
                waiting, self._pubrel_waiting = self._pubrel_waiting, []
                try:
                    await self._save()
                except Exception:  # kept, in order, for the next try
                    note_failure("session-persist-then-release")
                    if self.outlet is not None:  # else the record resends the PUBRELs
                        self._pubrel_waiting[:0] = waiting
                    await asyncio.sleep(RESTART_PAUSE)
                    continue
                outlet = self.outlet
                if outlet is None:
                    return
                for packet_id in waiting:
                    entry = self._in_flight.get(packet_id)
                    if entry is not None and entry.released:
                        outlet.send_pubrel(packet_id)
        finally:
            self._pubrel_sender = None

    def on_pubcomp(self, packet_id: int) -> bool:
        entry = self._in_flight.get(packet_id)
        if entry is None or not entry.released:
            return False
        del self._in_flight[packet_id]
        self._request_save()
        self.pump()
        return True


class Resends:
    """Durable deliveries sent on an earlier connection and not acknowledged, in
    first-sent order: (cursor key, message timestamp) -> packet identifier. An
    identifier stays reserved until its message goes out again, or is given up."""

    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_by_key", "_reserved")


    def __init__(self) -> None:
        self._by_key: dict[ResendKey, int] = {}
        # a dict used as a set: an idle session holds it empty, and an empty dict holds
        # no table where an empty set holds 216 bytes (issue 25)
        self._reserved: dict[int, None] = {}

    def replace(self, resends: dict[ResendKey, int]) -> None:
        self._by_key = dict(resends)
        self._reserved = dict.fromkeys(self._by_key.values())

    def in_order(self) -> list[ResendKey]:
        """What is still to be resent, in first-sent order."""
        return list(self._by_key)

    def items(self) -> list[tuple[ResendKey, int]]:
        return list(self._by_key.items())

    def __contains__(self, key: ResendKey) -> bool:
        return key in self._by_key

    def take(self, key: ResendKey) -> int | None:
        """The packet identifier a delivery keeps when it goes out again, if it is a
        resend; it stays reserved until sent (or `release`d)."""
        return self._by_key.pop(key, None)

    def reserved(self, packet_id: int) -> bool:
        return packet_id in self._reserved

    def release(self, packet_id: int) -> None:
        """A resend taken has gone out, or will not: its identifier is free again."""
        self._reserved.pop(packet_id, None)

    def drop(self, key: ResendKey) -> None:
        """A resend that will not go out (its message is gone)."""
        self._reserved.pop(self._by_key.pop(key), None)

    def forget(self, doomed: Callable[[str], bool]) -> int:
        """Drop the resends of the cursors whose key is `doomed`; how many."""
        gone = [key for key in self._by_key if doomed(key[0])]
        for key in gone:
            self.drop(key)
        return len(gone)
