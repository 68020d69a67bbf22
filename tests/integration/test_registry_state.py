"""The session registry frees what it keeps per client: after many clients have
connected and gone (transient sessions, durable ones that expire, takeovers), its
locks, timers, tasks and maps are back to their size before. In process, on real
RocksDB, with the registry's own open/close calls as a connection makes them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from stratamq.broker.core.broker import Broker
from stratamq.broker.core.registry import SessionLimits
from stratamq.broker.ds import DbOptions, DurableStorage
from stratamq.broker.session.session import Session
from tests.support.storage import run

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
        broker = await Broker.start(storage, messages, 2, False, SessionLimits())
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
