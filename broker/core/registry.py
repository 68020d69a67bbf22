"""The sessions of a site: which connection owns each, opening with takeover,
closing, expiry timers. Its collaborators: the ordered save of a session
(`persist.py`), wills (`wills.py`), the collection of sessions that expired while no
site held them (`session_gc.py`), the upkeep of the sessions' streams
(`stream_upkeep.py`), the lock per client id (`client_locks.py`).

In a cluster a client id is owned by one site at a time (`ownership`): opening a
session takes it over from the site that had it (`takeover.py`), and a site whose
session was taken over lets go of it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from ..deadlines import Deadlines
from ..ds import DurableStorage, FencedError
from ..errors import StratamqError
from ..metrics import IN_FLIGHT, SESSIONS
from ..mqtt.reason_codes import ReasonCode
from ..session.model import NEVER_EXPIRES, SessionRecord
from ..session.session import Session
from ..session.store import SessionStore
from ..shared.groups import AbsentGroup
from ..supervise import note_task_failure, supervise
from .client_locks import ClientLocks
from .dispatch import Dispatcher
from .ownership import Ownership
from .persist import SessionWriter
from .publish import Publisher
from .session_gc import SessionCollector
from .session_takeover import NotSessionOwner, SessionTakeover, resumable
from .stream_upkeep import StreamUpkeep
from .wills import Wills

log = logging.getLogger(__name__)

class Owner(Protocol):
    """What the registry needs of the client connection that holds a session."""

    client_id: str

    async def kick(self, reason_code: int) -> None:
        """Close the connection because another took its session over."""
        ...


@dataclass(frozen=True, slots=True)
class SessionLimits:
    max_queued: int = 1000
    batch_size: int = 100
    idle_poll_interval: float = 10.0
    renew_streams_interval: float = 1.0
    session_gc_interval: float = 600.0
    durable_sessions: bool = True


class SessionRegistry:
    """`ownership` on a cluster: who owns each client id is decided across sites.
    `groups_kept_for`: (client id, site, group keys) -> the shared groups that site
    keeps for the client (`shared/positions.py`), which move here with its session.

    Past ~300 lines for a reason: it keeps the table of the sessions in memory and
    of their connections, and every change of them is here, under the lock per
    client id: opening (with takeover), closing, expiry, and letting go of a session
    another site took over. Split apart, several classes would change one table.
    What only reads the table, or needs none of it, is in the collaborators."""

    def __init__(self, storage: DurableStorage, messages_db: str, store: SessionStore,
                 publisher: Publisher, dispatcher: Dispatcher, limits: SessionLimits, *,
                 ownership: Ownership | None = None,
                 groups_kept_for: Callable[[str, str, Collection[str]],
                                           Awaitable[dict[str, AbsentGroup]]] | None = None
                 ) -> None:
        self._storage = storage
        self._messages_db = messages_db
        self._store = store
        self._dispatcher = dispatcher
        self.limits = limits
        # every session's safety-net poll on one timer (an idle session waits on it)
        self._polls = Deadlines()
        self.sessions: dict[str, Session] = {}
        self.connections: dict[str, Owner] = {}
        self._locks = ClientLocks()
        self._expiry_timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # a finished one leaves the set
        self._writer = SessionWriter(store, on_taken_over=self._lost)
        self._wills = Wills(publisher, self._spawn)
        self._collector = SessionCollector(store, publisher, dispatcher, self._locks,
                                           self.sessions, limits.session_gc_interval,
                                           ownership)
        self._streams = StreamUpkeep(self.sessions, limits.renew_streams_interval,
                                     lambda: storage.db(messages_db).stream_version)
        self._takeover = None if ownership is None else SessionTakeover(
            store, ownership, self._locks, self.sessions, self._forget_here, groups_kept_for)
        # Computed when scraped, so a connect costs nothing that grows with the
        # number of sessions.
        IN_FLIGHT.set_function(
            lambda: sum(session.outbox.in_flight_count for session in self.sessions.values()))
        SESSIONS.labels("durable").set_function(
            lambda: sum(1 for session in self.sessions.values() if session.durable))
        SESSIONS.labels("transient").set_function(
            lambda: sum(1 for session in self.sessions.values() if not session.durable))

    def start(self) -> None:
        self._spawn(supervise("session-gc", self._collector.run), "session-gc")
        self._spawn(supervise("renew-streams", self._streams.renew_loop), "renew-streams")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str, loop: str = "") -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if loop:
            task.add_done_callback(functools.partial(note_task_failure, loop))

    def held_state(self) -> dict[str, int]:
        """Sizes of the per-client state kept here (for tests and admin views): all
        of it goes when the sessions and connections it belongs to are gone."""
        return {"sessions": len(self.sessions), "connections": len(self.connections),
                "locks": len(self._locks), "expiry_timers": len(self._expiry_timers),
                "will_timers": self._wills.pending(), "tasks": len(self._tasks)}

    async def stop(self) -> None:
        """Persist every durable session (connections are closed by the listeners)."""
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for timer in self._expiry_timers.values():
            timer.cancel()
        self._wills.cancel_all()
        for session in list(self.sessions.values()):
            session.cancel_persist()  # a late one would find the storage closed
            if session.durable:
                with contextlib.suppress(FencedError):  # taken over: not ours to write
                    await self.persist(session, disconnected=session.outlet is None)

    # -- opening and closing ------------------------------------------------------

    def _new_session(self, client_id: str, expiry_interval: int, durable: bool) -> Session:
        return Session(client_id, durable=durable, expiry_interval=expiry_interval,
                       storage=self._storage, messages_db=self._messages_db,
                       max_queued=self.limits.max_queued, batch_size=self.limits.batch_size,
                       idle_poll_interval=self.limits.idle_poll_interval,
                       persist=self.persist, on_shared_loss=self._dispatcher.on_shared_loss,
                       polls=self._polls)

    async def open_session(self, connection: Owner, clean_start: bool, expiry_interval: int,
                           username: str | None,
                           may_subscribe: Callable[[str], bool]) -> tuple[Session, bool]:
        """Give a new connection its session; returns (session, session present).

        Raises NotSessionOwner, before anything is done to the session or the
        connection holding it, when the session belongs to another user. A resumed
        session keeps only the subscriptions `may_subscribe` still allows."""
        client_id = connection.client_id
        epoch = None
        groups_along: dict[str, AbsentGroup] = {}
        if self._takeover is not None:
            epoch, groups_along = await self._takeover.take(client_id, username)
        while True:
            async with self._locks.hold(client_id):
                session = self.sessions.get(client_id)
                record = None
                ended = None  # the record left of a session that has ended
                if session is None:
                    record = await self._store.load(client_id)
                    if record is not None and not resumable(record):
                        record, ended = None, record
                owner = session.username if session is not None \
                    else record.username if record is not None else username
                if owner != username:
                    raise NotSessionOwner(client_id)
                previous = self.connections.get(client_id)
                if previous is None or previous is connection:
                    self.connections[client_id] = connection
                    try:
                        return await self._open_session_locked(
                            client_id, clean_start, expiry_interval, username,
                            may_subscribe, record, ended, epoch, groups_along)
                    except BaseException:
                        if self.connections.get(client_id) is connection:
                            del self.connections[client_id]
                        raise
            # Outside the lock: the old connection's close_session needs it.
            await previous.kick(ReasonCode.SESSION_TAKEN_OVER)
            if self.connections.get(client_id) is previous:  # it ended without a session
                del self.connections[client_id]

    async def _open_session_locked(self, client_id: str, clean_start: bool,
                                   expiry_interval: int, username: str | None,
                                   may_subscribe: Callable[[str], bool],
                                   record: SessionRecord | None,
                                   ended: SessionRecord | None,
                                   epoch: int | None,
                                   groups_along: dict[str, AbsentGroup]
                                   ) -> tuple[Session, bool]:
        self._cancel_timers(client_id)
        session = self.sessions.get(client_id)
        if session is None and not clean_start:
            if record is not None:
                session = self._new_session(client_id, record.expiry_interval, True)
                session.restore(record)
                if epoch is not None:
                    session.owner_epoch = epoch
                session.inbound_qos2.load(await self._store.inbound_qos2_ids(
                    client_id, session.incarnation))
                self.sessions[client_id] = session
            elif ended is not None:
                # the ids of a session that ended must not pass for the new one's
                await self._store.forget_qos2(client_id, epoch or 0)
        if clean_start and session is not None:
            await self._discard(session)
            session = None
        if clean_start:
            await self._store.delete(client_id, epoch or 0)
            await self._store.forget_qos2(client_id, epoch or 0)
        present = session is not None
        durable = expiry_interval > 0 and self.limits.durable_sessions
        if session is None:
            session = self._new_session(client_id, expiry_interval, durable)
            if ended is not None and not clean_start:
                # its parts are still stored: the first save deletes them
                session.stored_parts = ended.as_parts()
            session.set_owner(username)
            if epoch is not None:
                session.owner_epoch = epoch
            self.sessions[client_id] = session
        else:
            # the ACL may have changed since the session subscribed
            session.drop_subscriptions(may_subscribe)
            kept_keys = {subscription.group_key
                         for subscription in session.subscriptions.values()}
            self._dispatcher.adopt_absent({key: group for key, group in groups_along.items()
                                           if key in kept_keys})
        # A stored session stays durable for the connection that resumes it, whatever
        # expiry this CONNECT asks for: the new expiry applies when the connection ends
        # (MQTT-3.1.2-4/5; close_session deletes the record then if it is 0).
        session.configure(expiry_interval, durable or (present and session.durable))
        for subscription in session.subscriptions.values():
            self._dispatcher.route(session, subscription)
        return session, present

    async def close_session(self, connection: Owner, session: Session,
                            publish_will: bool) -> None:
        """The connection of a session has ended."""
        client_id = session.client_id
        async with self._locks.hold(client_id):
            if self.connections.get(client_id) is connection:
                del self.connections[client_id]
            if session.outlet is None and self.sessions.get(client_id) is not session:
                return
            await session.detach()
            for subscription in session.subscriptions.values():
                self._dispatcher.unroute(session, subscription,
                                         stays_subscribed=session.outlives_connection)
            will = session.will if publish_will else None
            if not publish_will:
                session.set_will(None)
            if not session.outlives_connection:
                stored = session.durable  # expiry set to 0 by the DISCONNECT
                session.end_durability()
                if self.sessions.get(client_id) is session:
                    del self.sessions[client_id]
                if stored:
                    async with session.persist_lock:
                        try:
                            await self._store.delete(client_id, session.owner_epoch)
                        except FencedError:  # another site holds the session now
                            return
                        except StratamqError as exc:  # no majority in reach, say
                            # Not tried again: a later try could delete the state of
                            # a session this client id starts next.
                            log.warning("ended session %r: its stored state not deleted: "
                                        "%s", client_id, exc.message)
                await session.inbound_qos2.settled()  # or a late one outlives the forget
                try:
                    await self._store.forget_qos2(client_id, session.owner_epoch)
                except StratamqError as exc:  # no leader to read past, say: the will goes on
                    log.warning("QoS 2 packet ids of ended session %r not forgotten: %s",
                                client_id, exc)
                if will is not None:
                    self._wills.publish(client_id, session)
                return
            try:
                await self.persist(session, disconnected=True)
            except FencedError:  # another site holds the session now: it is not ours
                return
            except StratamqError as exc:  # no majority in reach, say
                # The session lives on here all the same: its will and its expiry
                # are timed below, and its state is written once it can be.
                log.warning("session %r closed; its state not stored (%s): tried again "
                            "later", client_id, exc.message)
                session.request_persist()
            loop = asyncio.get_running_loop()
            if will is not None:
                delay = min(will.delay, session.expiry_interval)
                if delay == 0:  # now, before a taking-over connection cancels timers
                    self._wills.publish(client_id, session)
                else:
                    self._wills.publish_later(client_id, session, delay)
            if session.expiry_interval < NEVER_EXPIRES:
                self._expiry_timers[client_id] = loop.call_later(
                    session.expiry_interval, self._expire_now, client_id, session)

    # -- expiry ------------------------------------------------------------------

    def _expire_now(self, client_id: str, session: Session) -> None:
        self._expiry_timers.pop(client_id, None)
        if self.sessions.get(client_id) is session and session.outlet is None:
            self._spawn(self._expire(session), f"expire-{client_id}", "session-expiry")

    async def _expire(self, session: Session) -> None:
        async with self._locks.hold(session.client_id):
            # A connection that took the session while this waited for the lock holds
            # it, attached or not yet (its CONNACK under way): not expired.
            if (session.outlet is not None or self.sessions.get(session.client_id)
                    is not session or session.client_id in self.connections):
                return
            if session.will is not None:
                self._wills.publish(session.client_id, session)
            await self._discard(session)

    async def _discard(self, session: Session) -> None:
        session.end_durability()  # a pending persist must not write the record back
        session.cancel_persist()
        for subscription in session.subscriptions.values():
            self._dispatcher.unroute(session, subscription)
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        async with session.persist_lock:  # after any write of it already under way
            try:
                await self._store.delete(session.client_id, session.owner_epoch)
            except FencedError:  # another site holds the session now
                return
        await session.inbound_qos2.settled()
        try:
            await self._store.forget_qos2(session.client_id, session.owner_epoch)
        except FencedError:  # taken over meanwhile: the ids are the new owner's
            return

    def _cancel_timers(self, client_id: str) -> None:
        self._wills.cancel(client_id)
        timer = self._expiry_timers.pop(client_id, None)
        if timer is not None:
            timer.cancel()

    async def persist(self, session: Session, disconnected: bool = False,
                      connecting: bool = False) -> None:
        """Write a durable session's state (in order: see `SessionWriter`)."""
        await self._writer.persist(session, disconnected, connecting)

    # -- letting go of a session another site took over (a cluster) ----------------

    async def release(self, client_id: str, username: str | None) -> bool:
        """Another site takes `client_id` over: close its connection here (0x8E
        Session taken over; a durable session persists what it has on the way) and
        drop this site's copy of the session. False (nothing done) when the session
        here is another user's."""
        session = self.sessions.get(client_id)
        if session is not None and session.username != username:
            return False
        previous = self.connections.get(client_id)
        if previous is not None:
            await previous.kick(ReasonCode.SESSION_TAKEN_OVER)
            if self.connections.get(client_id) is previous:
                del self.connections[client_id]
        async with self._locks.hold(client_id):
            session = self.sessions.get(client_id)
            if session is not None and session.outlet is None:
                self._forget_here(session)
        return True

    def _forget_here(self, session: Session) -> None:
        """Drop this site's copy of a session another site owns, writing nothing."""
        session.end_durability()
        session.cancel_persist()
        self._cancel_timers(session.client_id)
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            for subscription in session.subscriptions.values():
                self._dispatcher.unroute(session, subscription)

    def _lost(self, session: Session) -> None:
        """A write of the session was refused: another site took it over (and this
        one was not told, or not in time). Drop it here and close its connection."""
        log.warning("session %r: taken over by another site (epoch %d here is behind); "
                    "dropping this site's copy", session.client_id, session.owner_epoch)
        connected = session.outlet is not None
        session.end_durability()
        self._cancel_timers(session.client_id)
        if self.sessions.get(session.client_id) is session and not connected:
            del self.sessions[session.client_id]
            for subscription in session.subscriptions.values():
                self._dispatcher.unroute(session, subscription)
        connection = self.connections.get(session.client_id)
        if connected and connection is not None:
            # not awaited: its close_session needs the lock a caller may hold
            self._spawn(connection.kick(ReasonCode.SESSION_TAKEN_OVER),
                        f"kick-{session.client_id}")

    # -- done by collaborators, for the broker and tests ---------------------------

    async def collect_expired_sessions(self) -> int:
        """One pass of the collection of expired stored sessions (`SessionCollector`)."""
        return await self._collector.collect_expired_sessions()

    async def before_generation_drop(self, shard: int, generation: int) -> None:
        await self._streams.before_generation_drop(shard, generation)

    def on_feed_gap(self, shard: int, since: int) -> None:
        self._streams.on_feed_gap(shard, since)

    def after_generation_drop(self, shard: int, generation: int) -> None:
        self._streams.after_generation_drop(shard, generation)
