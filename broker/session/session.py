"""A session at runtime, composed of its parts:

- `Routes` (routes.py): its subscriptions, and which of them a message reaches
  through the ACL of the connection;
- `Outbox` (outbox.py): the queue, the in-flight window, packet identifiers,
  acknowledgements and resends in order, and the writes a packet waits for;
- `Streams` (streams.py): the cursors a durable session reads its streams with, their
  progress, and what retention takes from them;
- `Replay` (replay.py): how messages reach the outbox, from storage through the
  cursors or from the live commit feed;
- `InboundQos2` (inbound_qos2.py): the client's QoS 2 messages awaiting PUBREL.

The session itself holds what is saved (`to_record`, `restore`), the settings of the
connection that holds it, and the connection's coming and going. The connection it
is attached to is an `Outlet`; with none attached a durable session stays in storage
only (nothing queues in memory for it)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping

from ..deadlines import Deadlines
from ..ds import Message
from ..supervise import RESTART_PAUSE, note_failure
from .inbound_qos2 import InboundQos2
from .model import SessionRecord, StoredParts, Subscription, WillRecord
from .outbox import Delivery, Outbox, Outlet
from .reader import MessageReader
from .replay import Replay
from .routes import Routes
from .streams import Streams


class Session:
    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_inbound_qos2", "_incarnation", "_on_shared_loss", "_persist",
                 "_persist_pending",
                 "_persist_task", "client_id", "durable", "expiry_interval", "outbox",
                 "owner_epoch", "persist_lock", "replay", "routes", "stored_parts", "streams",
                 "username", "will")

    def __init__(self, client_id: str, *, durable: bool, expiry_interval: int,
                 storage: MessageReader, messages_db: str, max_queued: int, batch_size: int,
                 idle_poll_interval: float,
                 persist: Callable[[Session], Awaitable[None]],
                 on_shared_loss: Callable[[Delivery], None], polls: Deadlines) -> None:
        self.client_id = client_id
        self.durable = durable
        self.expiry_interval = expiry_interval
        self.will: WillRecord | None = None
        self.owner_epoch = 0
        self.username: str | None = None  # the user it belongs to
        self.persist_lock = asyncio.Lock()
        self._persist = persist
        self._on_shared_loss = on_shared_loss
        self._persist_pending = False
        self._persist_task: asyncio.Task[None] | None = None
        # The parts of this session known to be in storage (None: not known, after a
        # write whose outcome is not): a save writes only what differs from them.
        # Kept by the registry, which saves; a new session has none stored.
        self.stored_parts: StoredParts | None = StoredParts()
        self._inbound_qos2: InboundQos2 | None = None  # see inbound_qos2
        self._incarnation: int | None = None  # see incarnation
        self.routes = Routes(client_id)
        self.outbox = Outbox(max_queued, save=self.persist_now,
                             request_save=self.request_persist, finished=self._finished,
                             room=self._room_made, durable=self._is_durable)
        self.streams = Streams(client_id, storage=storage, messages_db=messages_db,
                               outbox=self.outbox, subscriptions=lambda: self.subscriptions,
                               durable=self._is_durable, request_save=self.request_persist,
                               wake=self._wake_replay)
        self.replay = Replay(client_id, storage=storage, messages_db=messages_db,
                             batch_size=batch_size, idle_poll_interval=idle_poll_interval,
                             streams=self.streams, routes=self.routes, outbox=self.outbox,
                             offer=self.offer, durable=self._is_durable,
                             polls=polls)

    def _is_durable(self) -> bool:
        return self.durable

    @property
    def inbound_qos2(self) -> InboundQos2:
        """Made when first asked for: most clients never publish at QoS 2, and its two
        empty sets and a dict cost ~600 bytes per connection."""
        if self._inbound_qos2 is None:
            self._inbound_qos2 = InboundQos2()
        return self._inbound_qos2

    @property
    def incarnation(self) -> int:
        """Which session of its client id this is: drawn at random when first asked
        for (most sessions never need it), kept in its record, taken back by
        `restore`; 0 for a session stored before incarnations. Its inbound QoS 2
        records carry it (`SessionStore`, `qos2_tag`), so that those another session
        of the client id left behind are never taken for its own."""
        if self._incarnation is None:
            self._incarnation = secrets.randbits(63) or 1
        return self._incarnation

    # -- persisted form -----------------------------------------------------------

    def to_record(self, disconnected_at: float | None) -> SessionRecord:
        return SessionRecord(
            client_id=self.client_id,
            expiry_interval=self.expiry_interval,
            subscriptions=list(self.subscriptions.values()),
            cursors=self.streams.states(),
            pubrel_pending=self.outbox.pubrel_pending(),
            # in the order they were first sent: resent in that order too
            resend=[(pid, key, timestamp)
                    for (key, timestamp), pid in self.outbox.unacknowledged().items()],
            done=self.streams.done_keys(),
            will=self.will,
            disconnected_at=disconnected_at,
            owner_epoch=self.owner_epoch,
            username=self.username,
            incarnation=self.incarnation,
        )

    def restore(self, record: SessionRecord) -> None:
        """Take over the state a durable session left in storage."""
        self.routes.replace_all(record.subscriptions)
        self.owner_epoch = record.owner_epoch + 1
        self.username = record.username
        self._incarnation = record.incarnation
        # Messages past PUBREC are never published again: only their PUBREL is.
        self.outbox.restore(record.pubrel_pending, record.resend)
        self.streams.restore(record.cursors, record.done)
        self.stored_parts = record.as_parts()

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

    @property
    def subscriptions(self) -> Mapping[str, Subscription]:
        return self.routes.subscriptions

    def subscribe(self, subscription: Subscription) -> bool:
        """Add or replace a subscription; True when it is new."""
        return self.routes.add(subscription)

    def unsubscribe(self, key: str) -> Subscription | None:
        subscription = self.routes.remove(key)
        if subscription is not None and subscription.share_group is None:
            self.streams.forget_subscription(subscription.topic_filter)
        return subscription

    def may_receive(self, subscription: Subscription, message: Message) -> bool:
        """Whether the ACL lets this session's connection receive the message through
        the subscription (a shared one included)."""
        outlet = self.outlet
        return outlet is not None and self.routes.may_receive(subscription, message.topic,
                                                              outlet)

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
        self.replay.finished(delivery)
        if delivery.cursor is not None:
            self.request_persist()

    def _room_made(self) -> None:
        self.replay.room_made()

    def _wake_replay(self) -> None:
        self.replay.wake()

    # -- connection lifecycle -----------------------------------------------------

    def attach(self, outlet: Outlet) -> None:
        """A connection takes the session: resend what is unacknowledged, in order."""
        self.outbox.attach(outlet)
        if self.durable:
            self.replay.start()
        self.outbox.pump()

    async def detach(self) -> None:
        """The connection is gone. A durable session drops its in-memory queue (it
        is in storage); shared deliveries move to another member of their group."""
        self.outbox.disconnect()
        self.routes.forget_decisions()
        await self.replay.stop()
        for delivery in self.outbox.drop():
            if delivery.share_group is not None:
                self._on_shared_loss(delivery)
        if self.durable:
            self.streams.park()

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
