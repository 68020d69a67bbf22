"""Background loops are supervised: a pass that raises is logged, counted in
`stratamq_background_failures_total{loop}` and started again, and the loop goes on
doing its work afterwards. In process, on real RocksDB (no broker process: the
failure is made by writing a corrupt session record straight into storage)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from stratamq.broker.core.broker import Broker
from stratamq.broker.core.publish import Publisher
from stratamq.broker.core.registry import SessionLimits
from stratamq.broker.ds import DbOptions, DurableStorage, Message, MessageProperties
from stratamq.broker.errors import StorageTimeoutError
from stratamq.broker.session.model import SessionRecord, WillRecord
from tests.support.storage import read_filter, run

TIMEOUT = 30.0


def failures(loop: str) -> float:
    value = REGISTRY.get_sample_value("stratamq_background_failures_total", {"loop": loop})
    return value or 0.0


async def wait_until(condition_name: str, check: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {condition_name}"
        await asyncio.sleep(0.05)


def test_session_gc_goes_on_after_a_pass_that_raises(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        messages = await storage.open_db("messages", DbOptions(n_shards=2))
        before = failures("session-gc")
        sessions_db = await storage.open_kv_db("sessions", 2)
        # not JSON: decoding it makes the GC pass raise
        await sessions_db.write("corrupt", puts=[(b"s/corrupt", b"\xffnot a record")])
        broker = await Broker.assemble(storage, messages, 2, False,
                                    SessionLimits(session_gc_interval=0.1))
        await broker.start()
        try:
            async def failed() -> bool:
                return failures("session-gc") > before
            await wait_until("the GC pass to fail", failed)

            # The fault goes away and an expired session appears: the restarted loop
            # collects it.
            await sessions_db.write("corrupt", deletes=[b"s/corrupt"])
            expired = SessionRecord("expired-client", expiry_interval=1,
                                    disconnected_at=time.time() - 10)
            await sessions_db.write("expired-client",
                                    puts=[(b"s/expired-client", expired.head_to_json())])

            async def collected() -> bool:
                return await sessions_db.get("expired-client", b"s/expired-client") is None
            await wait_until("the expired session to be collected", collected)
            # the loop still runs
            assert [task.get_name() for task in broker.registry._tasks
                    if not task.done()].count("session-gc") == 1
        finally:
            await broker.stop()
            await storage.close()
    run(scenario())


def test_a_will_the_session_gc_could_not_store_is_stored_by_a_later_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An expired session's will is published by the GC pass; its write fails (the
    shard's leader out of reach, say). The pass cleared the will and deleted the
    session without waiting for the write: the will was lost (found by reading).
    Now the pass fails, the session keeps its will, and a later pass stores it."""
    real_publish_will = Publisher.publish_will
    calls: list[str] = []

    def failing_once(publisher: Publisher, message: Message, will_id: int = 0
                     ) -> list[asyncio.Future[None]]:
        calls.append(message.topic)
        if len(calls) == 1:
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(StorageTimeoutError("no majority of replicas in time"))
            return [failed]
        return real_publish_will(publisher, message, will_id)
    monkeypatch.setattr(Publisher, "publish_will", failing_once)

    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        messages = await storage.open_db("messages", DbOptions(n_shards=2))
        sessions_db = await storage.open_kv_db("sessions", 2)
        will = WillRecord("gc/will", b"gone", 1, False, MessageProperties(), 0)
        expired = SessionRecord("expired-client", expiry_interval=1,
                                disconnected_at=time.time() - 10, will=will)
        await sessions_db.write("expired-client",
                                puts=[(b"s/expired-client", expired.head_to_json())])
        broker = await Broker.assemble(storage, messages, 2, False,
                                       SessionLimits(session_gc_interval=0.1))
        await broker.start()
        try:
            async def collected() -> bool:
                return await sessions_db.get("expired-client", b"s/expired-client") is None
            await wait_until("the expired session to be collected", collected)
            assert len(calls) >= 2, calls
            stored = await read_filter(storage, "messages", "gc/will")
            assert [message.payload for message in stored] == [b"gone"]
        finally:
            await broker.stop()
            await storage.close()
    run(scenario())


def test_a_will_whose_write_outcome_was_not_known_is_stored_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GC pass publishes an expired session's will; its write is committed but the
    answer is a failure (a timeout past the commit, say), so the pass fails and a later
    one publishes it again: the will was stored twice (a QoS 2 will delivered twice).
    The will is stored with its id, and a later pass that finds it stored does not
    store it again."""
    real_publish_will = Publisher.publish_will
    calls: list[int] = []

    def committed_but_failed_once(publisher: Publisher, message: Message, will_id: int = 0
                                  ) -> list[asyncio.Future[None]]:
        calls.append(will_id)
        written = real_publish_will(publisher, message, will_id)
        if len(calls) > 1:
            return written

        async def answer_lost() -> None:
            await asyncio.gather(*written)
            raise StorageTimeoutError("no answer in time")
        return [asyncio.ensure_future(answer_lost())]
    monkeypatch.setattr(Publisher, "publish_will", committed_but_failed_once)

    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        messages = await storage.open_db("messages", DbOptions(n_shards=2))
        sessions_db = await storage.open_kv_db("sessions", 2)
        will = WillRecord("gc/once", b"gone", 2, False, MessageProperties(), 0, will_id=42)
        expired = SessionRecord("expired-client", expiry_interval=1,
                                disconnected_at=time.time() - 10, will=will)
        await sessions_db.write("expired-client",
                                puts=[(b"s/expired-client", expired.head_to_json())])
        broker = await Broker.assemble(storage, messages, 2, False,
                                       SessionLimits(session_gc_interval=0.1))
        await broker.start()
        try:
            async def collected() -> bool:
                return await sessions_db.get("expired-client", b"s/expired-client") is None
            await wait_until("the expired session to be collected", collected)
            assert calls == [42], calls  # the later pass found it stored
            stored = await read_filter(storage, "messages", "gc/once")
            assert [message.payload for message in stored] == [b"gone"]
        finally:
            await broker.stop()
            await storage.close()
    run(scenario())
