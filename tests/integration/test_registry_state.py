"""The session registry frees what it keeps per client: after many clients have
connected and gone (transient sessions, durable ones that expire, takeovers), its
locks, timers, tasks and maps are back to their size before. In process, on real
RocksDB, with the registry's own open/close calls as a connection makes them."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from stratamq.broker.core.broker import SESSIONS_DB, Broker
from stratamq.broker.core.registry import SessionLimits
from stratamq.broker.ds import DbOptions, DurableStorage, Message, MessageProperties
from stratamq.broker.session.model import SessionRecord, WillRecord
from stratamq.broker.session.session import Session
from stratamq.broker.session.store import SessionStore
from tests.support.storage import read_filter, run

CLIENTS = 300


class Connection:
    """A client connection as the registry sees it: an id, and a way to end it when
    another connection takes its session over (closing the session as a channel
    does)."""

    def __init__(self, broker: Broker, client_id: str) -> None:
        self.client_id = client_id
        self.broker = broker
        self.session: Session | None = None

    async def open(self, clean_start: bool, expiry: int) -> None:
        self.session, _present = await self.broker.registry.open_session(
            self, clean_start, expiry, username=None, may_subscribe=lambda _filter: True)

    async def close(self) -> None:
        assert self.session is not None
        await self.broker.registry.close_session(self, self.session, publish_will=True)

    async def kick(self, reason_code: int) -> None:
        await self.close()


def test_per_client_state_is_freed_when_clients_are_gone(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        messages = await storage.open_db("messages", DbOptions(n_shards=2))
        broker = await Broker.assemble(storage, messages, 2, False, SessionLimits())
        await broker.start()
        try:
            before = broker.registry.held_state()
            # transient sessions, all at once
            transient = [Connection(broker, f"t-{n}") for n in range(CLIENTS)]
            await asyncio.gather(*(c.open(True, 0) for c in transient))
            assert broker.registry.held_state()["sessions"] == before["sessions"] + CLIENTS
            await asyncio.gather(*(c.close() for c in transient))
            # durable sessions expiring a second after they close, each taken over
            # once by a second connection of the same client id
            durable = [Connection(broker, f"d-{n}") for n in range(CLIENTS // 3)]
            await asyncio.gather(*(c.open(False, 1) for c in durable))
            takers = [Connection(broker, c.client_id) for c in durable]
            await asyncio.gather(*(c.open(False, 1) for c in takers))
            await asyncio.gather(*(c.close() for c in takers))
            assert broker.registry.held_state()["expiry_timers"] == len(durable)
            deadline = time.monotonic() + 30
            while broker.registry.held_state() != before:
                assert time.monotonic() < deadline, (broker.registry.held_state(), before)
                await asyncio.sleep(0.1)
        finally:
            await broker.stop()
            await storage.close()
    run(scenario())


def test_collecting_expired_sessions_spares_clients_that_reconnect_meanwhile(
        tmp_path: Path) -> None:
    """A site restarts with many stored sessions, expired or cut off by the crash;
    their clients reconnect while the collector walks the records. The collector must
    neither delete the session a client has just made (nor the ids of its inbound
    QoS 2 messages), nor write an old record over it."""

    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        messages = await storage.open_db("messages", DbOptions(n_shards=2))
        sessions_db = await storage.open_kv_db(SESSIONS_DB, 2, False)
        store = SessionStore(sessions_db, messages)
        now = time.time()
        for n in range(CLIENTS):  # half expired long ago, half connected at the crash
            await store.save(SessionRecord(
                f"gc-{n}", expiry_interval=10,
                disconnected_at=now - 100 if n % 2 else None))
        broker = await Broker.assemble(storage, messages, 2, False,
                                    SessionLimits(session_gc_interval=3600))
        await broker.start()
        try:
            connections = [Connection(broker, f"gc-{n}") for n in range(CLIENTS)]

            async def reconnect(connection: Connection, delay: float) -> None:
                await asyncio.sleep(delay)  # spread over the collector's walk
                await connection.open(False, 600)
                assert connection.session is not None
                await broker.registry.persist(connection.session)  # as CONNECT does

            rng = random.Random(5)
            await asyncio.gather(broker.registry.collect_expired_sessions(),
                                 *(reconnect(c, rng.uniform(0, 0.1)) for c in connections))
            lost = []
            for connection in connections:
                record = await store.load(connection.client_id)
                if record is None or record.expiry_interval != 600:
                    lost.append((connection.client_id, record))
            assert not lost, f"{len(lost)} reconnected sessions lost or overwritten: {lost[:3]}"
        finally:
            await broker.stop()
            await storage.close()
    run(scenario())


def test_a_session_resumed_while_its_expiry_waited_is_not_expired(tmp_path: Path) -> None:
    """A session's expiry fired while a new connection was resuming it (the client's
    lock held by the CONNECT): once the lock was free, the expiry found the session
    not attached yet (its CONNACK under way) and discarded it (its will published, its
    record deleted), and the connection went on with an orphan that receives nothing.
    A session a connection holds is not expired."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        messages = await storage.open_db("messages", DbOptions(n_shards=2))
        broker = await Broker.assemble(storage, messages, 2, False, SessionLimits())
        await broker.start()
        try:
            first = Connection(broker, "resumed")
            await first.open(False, 60)
            await first.close()
            session = broker.registry.sessions["resumed"]
            second = Connection(broker, "resumed")
            await second.open(False, 60)  # resumed, not attached yet
            assert second.session is session
            await broker.registry._expire(session)  # the expiry that waited for the lock
            assert broker.registry.sessions.get("resumed") is session
            store = SessionStore(await storage.open_kv_db(SESSIONS_DB, 2), messages)
            assert await store.load("resumed") is not None
        finally:
            await broker.stop()
            await storage.close()
    run(scenario())


def test_a_will_leaves_no_record_once_stored_and_its_session_gone(tmp_path: Path) -> None:
    """A will is stored with a record of its id (so that a retry stores it once); that
    record stayed for ever, one per client id that ever had a will (clients with
    random ids: without bound). It goes once the will is stored and no record of the
    session holds it, and with the session's QoS 2 ids when a session ends."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        messages = await storage.open_db("messages", DbOptions(n_shards=2))
        broker = await Broker.assemble(storage, messages, 2, False, SessionLimits())
        await broker.start()
        store = SessionStore(await storage.open_kv_db(SESSIONS_DB, 2), messages)
        try:
            gone = Connection(broker, "gone")
            await gone.open(True, 0)
            assert gone.session is not None
            gone.session.set_will(WillRecord("wills/gone", b"bye", 1, False,
                                             MessageProperties(), 0, will_id=7))
            await gone.close()
            stored = await read_filter(storage, "messages", "wills/gone")
            deadline = time.monotonic() + 10
            while not stored or await store.will_stored("gone", 7):
                assert time.monotonic() < deadline, "the will's record stayed"
                await asyncio.sleep(0.05)
                stored = await read_filter(storage, "messages", "wills/gone")
            assert [message.payload for message in stored] == [b"bye"]
            # a will record left behind goes with the next session's end
            for done in store.submit_will(Message("wills/left", b"x", "left", 1), 9):
                await done
            assert await store.will_stored("left", 9)
            await store.forget_qos2("left")
            assert not await store.will_stored("left", 9)
        finally:
            await broker.stop()
            await storage.close()
    run(scenario())
