"""The broker of one site: publish path, routing of the commit feed to sessions,
retained messages, session ownership, takeover, expiry and wills."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from .ds import (
    CookedBatch,
    Database,
    DurableStorage,
    KvDatabase,
    Message,
    Stream,
    decode_message,
    encode_message,
)
from .metrics import IN_FLIGHT, MESSAGES_DROPPED, SESSIONS
from .router import SubscriptionIndex
from .session.model import SessionRecord, Subscription
from .session.session import Delivery, Session
from .topic import topic_matches

log = logging.getLogger(__name__)

SESSIONS_DB = "sessions"
RETAINED_DB = "retained"
_SESSION_KEY = b"s/"


def _group_key(subscription: Subscription) -> str:
    return f"{subscription.share_group}/{subscription.topic_filter}"


def _qos2_prefix(client_id: str) -> bytes:
    # length-prefixed, so client "a" never sees the records of client "a/b"
    raw = client_id.encode("utf-8")
    return b"qos2/" + len(raw).to_bytes(2, "big") + raw


def _qos2_key(client_id: str, packet_id: int) -> bytes:
    return _qos2_prefix(client_id) + packet_id.to_bytes(2, "big")


class Connection(Protocol):
    """What the broker needs of a client connection (see server/connection.py)."""

    client_id: str

    async def kick(self, reason_code: int) -> None:
        """Close the connection because another took its session over."""
        ...


@dataclass(slots=True, eq=False)
class SharedGroup:
    """`$share/{group}/{filter}`: each message goes to one member, round robin."""

    name: str
    topic_filter: str
    members: list[tuple[Session, Subscription]] = field(default_factory=list)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def key(self) -> str:
        return f"{self.name}/{self.topic_filter}"

    def pick(self, exclude: Session | None = None) -> tuple[Session, Subscription] | None:
        candidates = [m for m in self.members if m[0].outlet is not None and m[0] is not exclude]
        if not candidates:
            return None
        return candidates[next(self._turn) % len(candidates)]


@dataclass(frozen=True, slots=True)
class BrokerLimits:
    max_queued: int = 1000
    batch_size: int = 100
    idle_poll_interval: float = 10.0
    renew_streams_interval: float = 1.0
    session_gc_interval: float = 600.0
    durable_sessions: bool = True


class Broker:
    def __init__(self, storage: DurableStorage, messages: Database, sessions_db: KvDatabase,
                 retained_db: KvDatabase, limits: BrokerLimits) -> None:
        self.storage = storage
        self.messages = messages
        self._sessions_db = sessions_db
        self._retained_db = retained_db
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        self.connections: dict[str, Connection] = {}
        self._index: SubscriptionIndex[tuple[Session, str] | SharedGroup] = SubscriptionIndex()
        self._groups: dict[str, SharedGroup] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._expiry_timers: dict[str, asyncio.TimerHandle] = {}
        self._will_timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._retain_lock = asyncio.Lock()
        messages.add_commit_listener(self._on_commit)
        IN_FLIGHT.set_function(
            lambda: sum(session.in_flight_count for session in self.sessions.values()))

    @classmethod
    async def start(cls, storage: DurableStorage, messages: Database, n_shards: int,
                    sync_writes: bool, limits: BrokerLimits) -> Broker:
        sessions_db = await storage.open_kv_db(SESSIONS_DB, n_shards, sync_writes)
        retained_db = await storage.open_kv_db(RETAINED_DB, n_shards, sync_writes)
        broker = cls(storage, messages, sessions_db, retained_db, limits)
        broker._tasks.append(asyncio.create_task(broker._session_gc_loop(), name="session-gc"))
        broker._tasks.append(asyncio.create_task(broker._renew_streams_loop(),
                                                 name="renew-streams"))
        return broker

    async def stop(self) -> None:
        """Persist every durable session (connections are closed by the listeners)."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for timer in [*self._expiry_timers.values(), *self._will_timers.values()]:
            timer.cancel()
        for session in list(self.sessions.values()):
            session.cancel_persist()  # a late one would find the storage closed
            if session.durable:
                await self.persist(session, disconnected=session.outlet is None)

    # -- publishing ---------------------------------------------------------------

    def publish(self, message: Message, wait: bool,
                qos2_packet_id: int | None = None) -> list[asyncio.Future[None]]:
        """Store a message (and its retained copy); delivery follows from the commit
        feed. With `wait`, the futures resolve once everything is durable.

        An inbound QoS 2 message's packet id is recorded in the same atomic write as
        the message, so a PUBLISH resent after a crash is recognised, never stored
        twice (exactly once)."""
        if qos2_packet_id is None:
            waits = self.messages.submit([message], wait)
        else:
            waits = self.messages.submit(
                [message], wait, records_of=message.client_id,
                record_puts=[(_qos2_key(message.client_id, qos2_packet_id), b"")])
        if message.retain:
            # The stored message gets its timestamp when its batch is cooked, later; the
            # retained copy needs one now: its expiry interval counts from it.
            retained = dataclasses.replace(message, timestamp=time.time_ns() // 1000)
            task = asyncio.ensure_future(self._store_retained(retained))
            if wait:
                waits.append(task)
        return waits

    def release_qos2(self, client_id: str, packet_id: int) -> list[asyncio.Future[None]]:
        """PUBREL: forget the packet id, durably, before PUBCOMP lets the client
        reuse it."""
        return self.messages.submit([], True, records_of=client_id,
                                    record_deletes=[_qos2_key(client_id, packet_id)])

    async def inbound_qos2_ids(self, client_id: str) -> set[int]:
        records = await self.messages.scan_records(client_id, _qos2_prefix(client_id))
        return {int.from_bytes(key[-2:], "big") for key, _value in records}

    async def _forget_qos2(self, client_id: str) -> None:
        records = await self.messages.scan_records(client_id, _qos2_prefix(client_id))
        if records:
            await asyncio.gather(*self.messages.submit(
                [], True, records_of=client_id, record_deletes=[key for key, _ in records]))

    async def _store_retained(self, message: Message) -> None:
        async with self._retain_lock:  # keeps retained updates in publish order
            key = message.topic.encode("utf-8")
            if message.payload:
                await self._retained_db.write(message.topic, puts=[(key, encode_message(message))])
            else:
                await self._retained_db.write(message.topic, deletes=[key])

    async def retained_matching(self, topic_filter: str) -> list[Message]:
        found = []
        now_us = time.time_ns() // 1000
        for _key, raw in await self._retained_db.scan():
            message = decode_message(raw)
            expiry = message.properties.message_expiry_interval
            if expiry is not None and now_us - message.timestamp >= expiry * 1_000_000:
                continue
            if topic_matches(topic_filter, message.topic):
                found.append(message)
        return found

    def _on_commit(self, cooked: CookedBatch) -> None:
        for static, message in cooked.messages:
            stream = Stream(cooked.shard, cooked.generation, static)
            for subscriber, _filter in list(self._index.match(message.topic)):
                if isinstance(subscriber, SharedGroup):
                    self._deliver_shared(subscriber, message)
                else:
                    session, key = subscriber
                    subscription = session.subscriptions.get(key)
                    if subscription is not None:
                        session.on_feed(subscription, stream, message)

    def _deliver_shared(self, group: SharedGroup, message: Message,
                        exclude: Session | None = None) -> None:
        picked = group.pick(exclude)
        if picked is None:
            MESSAGES_DROPPED.labels("no_shared_member").inc()
            return
        session, subscription = picked
        delivery = Delivery(message, min(message.qos, subscription.qos), False,
                            (subscription.identifier,) if subscription.identifier else (),
                            share_group=group.key)
        session.offer(delivery)

    def _on_shared_loss(self, delivery: Delivery) -> None:
        group = self._groups.get(delivery.share_group or "")
        if group is None or delivery.qos == 0:
            MESSAGES_DROPPED.labels("shared_member_left").inc()
            return
        self._deliver_shared(group, delivery.message)

    # -- subscriptions ------------------------------------------------------------

    def route(self, session: Session, subscription: Subscription) -> None:
        if subscription.share_group is None:
            self._index.add(subscription.topic_filter, (session, subscription.key))
            return
        group_key = _group_key(subscription)
        group = self._groups.get(group_key)
        if group is None:
            group = self._groups[group_key] = SharedGroup(subscription.share_group,
                                                          subscription.topic_filter)
            self._index.add(subscription.topic_filter, group)
        group.members = [m for m in group.members if m[0] is not session]
        group.members.append((session, subscription))

    def unroute(self, session: Session, subscription: Subscription) -> None:
        if subscription.share_group is None:
            self._index.remove(subscription.topic_filter, (session, subscription.key))
            return
        group_key = _group_key(subscription)
        group = self._groups.get(group_key)
        if group is None:
            return
        group.members = [m for m in group.members if m[0] is not session]
        if not group.members:
            del self._groups[group_key]
            self._index.remove(subscription.topic_filter, group)

    # -- sessions -----------------------------------------------------------------

    def _lock(self, client_id: str) -> asyncio.Lock:
        return self._session_locks.setdefault(client_id, asyncio.Lock())

    def _new_session(self, client_id: str, expiry_interval: int) -> Session:
        durable = expiry_interval > 0 and self.limits.durable_sessions
        return Session(client_id, durable=durable, expiry_interval=expiry_interval,
                       storage=self.storage, messages_db=self.messages.name,
                       max_queued=self.limits.max_queued, batch_size=self.limits.batch_size,
                       idle_poll_interval=self.limits.idle_poll_interval,
                       persist=self.persist, on_shared_loss=self._on_shared_loss)

    async def open_session(self, connection: Connection, clean_start: bool,
                           expiry_interval: int) -> tuple[Session, bool]:
        """Give a new connection its session; returns (session, session present)."""
        client_id = connection.client_id
        while True:
            async with self._lock(client_id):
                previous = self.connections.get(client_id)
                if previous is None or previous is connection:
                    self.connections[client_id] = connection
                    return await self._open_session_locked(client_id, clean_start,
                                                           expiry_interval)
            # Outside the lock: the old connection's close_session needs it.
            await previous.kick(0x8E)  # Session taken over
            if self.connections.get(client_id) is previous:  # it ended without a session
                del self.connections[client_id]

    async def _open_session_locked(self, client_id: str, clean_start: bool,
                                   expiry_interval: int) -> tuple[Session, bool]:
        self._cancel_timers(client_id)
        session = self.sessions.get(client_id)
        if session is None and not clean_start:
            record = await self._load_record(client_id)
            if record is not None and not record.expired(time.time()):
                session = self._new_session(client_id, expiry_interval)
                session.restore(record)
                session.inbound_qos2 = await self.inbound_qos2_ids(client_id)
                self.sessions[client_id] = session
        if clean_start and session is not None:
            await self._discard(session)
            session = None
        if clean_start:
            await self._sessions_db.write(client_id,
                                          deletes=[_SESSION_KEY + client_id.encode()])
            await self._forget_qos2(client_id)
        present = session is not None
        if session is None:
            session = self._new_session(client_id, expiry_interval)
            self.sessions[client_id] = session
        session.expiry_interval = expiry_interval
        session.durable = expiry_interval > 0 and self.limits.durable_sessions
        for subscription in session.subscriptions.values():
            self.route(session, subscription)
        self._update_gauges()
        return session, present

    async def close_session(self, connection: Connection, session: Session,
                            publish_will: bool) -> None:
        """The connection of a session has ended."""
        client_id = session.client_id
        async with self._lock(client_id):
            if self.connections.get(client_id) is connection:
                del self.connections[client_id]
            if session.outlet is None and self.sessions.get(client_id) is not session:
                return
            await session.detach()
            for subscription in session.subscriptions.values():
                self.unroute(session, subscription)
            will = session.will if publish_will else None
            if not publish_will:
                session.will = None
            if not session.durable or session.expiry_interval == 0:
                stored = session.durable  # expiry set to 0 by the DISCONNECT
                session.durable = False  # no later persist may bring the record back
                if self.sessions.get(client_id) is session:
                    del self.sessions[client_id]
                if stored:
                    async with session.persist_lock:
                        await self._sessions_db.write(
                            client_id, deletes=[_SESSION_KEY + client_id.encode()])
                await self._forget_qos2(client_id)
                if will is not None:
                    self._publish_will(client_id, session)
                self._update_gauges()
                return
            await self.persist(session, disconnected=True)
            loop = asyncio.get_running_loop()
            if will is not None:
                delay = min(will.delay, session.expiry_interval)
                if delay == 0:  # now, before a taking-over connection cancels timers
                    self._publish_will(client_id, session)
                else:
                    self._will_timers[client_id] = loop.call_later(
                        delay, self._publish_will, client_id, session)
            if session.expiry_interval < 0xFFFFFFFF:
                self._expiry_timers[client_id] = loop.call_later(
                    session.expiry_interval, self._expire_now, client_id, session)
            self._update_gauges()

    def _publish_will(self, client_id: str, session: Session) -> None:
        self._will_timers.pop(client_id, None)
        will = session.will
        if will is None:
            return
        session.will = None
        self.publish(will.to_message(client_id), wait=False)
        session.request_persist()

    def _expire_now(self, client_id: str, session: Session) -> None:
        self._expiry_timers.pop(client_id, None)
        if self.sessions.get(client_id) is session and session.outlet is None:
            task = asyncio.ensure_future(self._expire(session))
            self._tasks.append(task)

    async def _expire(self, session: Session) -> None:
        async with self._lock(session.client_id):
            if session.outlet is not None:
                return
            if session.will is not None:
                self._publish_will(session.client_id, session)
            await self._discard(session)
            self._update_gauges()

    async def _discard(self, session: Session) -> None:
        session.durable = False  # a pending persist must not write the record back
        session.cancel_persist()
        for subscription in session.subscriptions.values():
            self.unroute(session, subscription)
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        async with session.persist_lock:  # after any write of it already under way
            await self._sessions_db.write(session.client_id,
                                          deletes=[_SESSION_KEY + session.client_id.encode()])
        await self._forget_qos2(session.client_id)

    def _cancel_timers(self, client_id: str) -> None:
        for timers in (self._will_timers, self._expiry_timers):
            timer = timers.pop(client_id, None)
            if timer is not None:
                timer.cancel()

    async def persist(self, session: Session, disconnected: bool = False) -> None:
        # One write of a session at a time, its record taken inside the lock: writes
        # go through a thread pool, and an older record must never land last.
        async with session.persist_lock:
            if not session.durable:
                return
            record = session.to_record(time.time() if disconnected or session.outlet is None
                                       else None)
            await self._sessions_db.write(session.client_id, puts=[
                (_SESSION_KEY + session.client_id.encode(), record.to_json())])

    async def _load_record(self, client_id: str) -> SessionRecord | None:
        raw = await self._sessions_db.get(client_id, _SESSION_KEY + client_id.encode())
        return None if raw is None else SessionRecord.from_json(raw)

    # -- background work ----------------------------------------------------------

    async def _session_gc_loop(self) -> None:
        await self.collect_expired_sessions()
        while True:
            await asyncio.sleep(self.limits.session_gc_interval)
            await self.collect_expired_sessions()

    async def collect_expired_sessions(self) -> int:
        """Delete stored sessions that expired while no site held them in memory
        (after a restart, say) and publish their wills. Returns how many."""
        now = time.time()
        removed = 0
        for key, raw in await self._sessions_db.scan(_SESSION_KEY):
            record = SessionRecord.from_json(raw)
            if record.client_id in self.sessions:
                continue
            if record.disconnected_at is None:
                # It was connected when the site stopped without saying goodbye: its
                # expiry (and will delay) count from now, when the site is back.
                record.disconnected_at = now
                await self._sessions_db.write(record.client_id, puts=[(key, record.to_json())])
            if record.will is not None and record.disconnected_at + min(
                    record.will.delay, record.expiry_interval) <= now:
                self.publish(record.will.to_message(record.client_id), wait=False)
                record.will = None
                await self._sessions_db.write(record.client_id, puts=[(key, record.to_json())])
            if record.expired(now):
                await self._sessions_db.write(record.client_id, deletes=[key])
                removed += 1
        return removed

    async def _renew_streams_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.renew_streams_interval)
            for session in list(self.sessions.values()):
                if session.durable and session.outlet is not None:
                    session.renew_streams()

    def _update_gauges(self) -> None:
        durable = sum(1 for s in self.sessions.values() if s.durable)
        SESSIONS.labels("durable").set(durable)
        SESSIONS.labels("transient").set(len(self.sessions) - durable)

