"""The session's own logic (packet identifiers, the in-flight window, QoS 2, the queue,
durable replay and resend, done marks, overlapping subscriptions), driven through its
public methods against an in-memory fake of the storage (tests/support/fake_storage.py)
and a recording fake connection. No broker process, no RocksDB: the integration tests
cover those; these cover the session in isolation, fast.

Waits are for counts and contents, with generous timeouts. The replay's safety-net
poll interval is set far beyond them, so a missed wake-up fails a test instead of
being hidden by the poll."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from prometheus_client import REGISTRY

from stratamq.broker.deadlines import Deadlines, Expiring
from stratamq.broker.ds import Message, MessageProperties, Stream
from stratamq.broker.errors import StorageTimeoutError
from stratamq.broker.session.model import (
    SessionRecord,
    Subscription,
    WillRecord,
    cursor_from_json,
    cursor_key,
    cursor_to_json,
    subscription_from_json,
    subscription_to_json,
)
from stratamq.broker.session.outbox import MAX_PACKET_ID, Delivery
from stratamq.broker.session.session import Session
from tests.support.fake_storage import FakeDatabase, FakeStorage
from tests.support.storage import run

DB = "messages"
WAIT_TIMEOUT = 3.0  # s; everything here happens in milliseconds
IDLE_POLL = 600.0  # s: never reached within a test (see the module docstring)


@dataclass(frozen=True)
class Sent:
    """One packet the session asked its connection to send."""

    kind: str  # "publish" or "pubrel"
    packet_id: int | None
    dup: bool = False
    topic: str = ""
    payload: bytes = b""
    qos: int = 0
    subscription_ids: tuple[int, ...] = ()
    timestamp: int = 0


class RecordingOutlet:
    """A connection that records what the session sends through it (a test double)."""

    def __init__(self, receive_maximum: int = 100) -> None:
        self.receive_maximum = receive_maximum
        self.sent: list[Sent] = []
        self.acknowledged = 0  # PUBLISH packets `acknowledge_until` has dealt with

    def send_publish(self, delivery: Delivery, packet_id: int | None, dup: bool) -> bool:
        message = delivery.message
        self.sent.append(Sent("publish", packet_id, dup, message.topic, message.payload,
                              delivery.qos, delivery.subscription_ids, message.timestamp))
        return True

    def send_pubrel(self, packet_id: int) -> None:
        self.sent.append(Sent("pubrel", packet_id))

    def may_subscribe(self, topic_filter: str) -> bool:
        return True

    def may_receive(self, topic: str) -> bool:
        return True

    @property
    def publishes(self) -> list[Sent]:
        return [sent for sent in self.sent if sent.kind == "publish"]

    @property
    def pubrels(self) -> list[int | None]:
        return [sent.packet_id for sent in self.sent if sent.kind == "pubrel"]


def stored_form(record: SessionRecord) -> SessionRecord:
    """`record` as the session store writes and reads it back: its head and each of
    its parts through their JSON forms."""
    found = SessionRecord.head_from_json(record.head_to_json())
    found.subscriptions = [subscription_from_json(subscription_to_json(subscription))
                           for subscription in record.subscriptions]
    found.cursors = {key: cursor_from_json(cursor_to_json(state))
                     for key, state in record.cursors.items()}
    found.done = list(record.done)
    return found


class SavedSessions:
    """The `persist` callback: keeps every record written, through its JSON forms as
    the real session store does."""

    def __init__(self) -> None:
        self.records: list[SessionRecord] = []
        self.gate = asyncio.Event()  # cleared: writes wait (a slow store)
        self.gate.set()

    async def persist(self, session: Session) -> None:
        record = stored_form(session.to_record(None))
        await self.gate.wait()
        self.records.append(record)


def make_session(storage: FakeStorage, *, durable: bool, max_queued: int = 1000,
                 batch_size: int = 100, saved: SavedSessions | None = None,
                 client_id: str = "c1",
                 on_shared_loss: Callable[[Delivery], None] = lambda _delivery: None,
                 polls: Deadlines | None = None) -> Session:
    saved = saved or SavedSessions()
    return Session(client_id, durable=durable, expiry_interval=3600 if durable else 0,
                   storage=storage, messages_db=DB, max_queued=max_queued,
                   batch_size=batch_size, idle_poll_interval=IDLE_POLL,
                   persist=saved.persist, on_shared_loss=on_shared_loss,
                   polls=polls if polls is not None else Deadlines())


def delivery(topic: str, qos: int, payload: bytes = b"") -> Delivery:
    return Delivery(Message(topic, payload, "publisher", qos), qos, False)


def record_roundtrip(session: Session) -> SessionRecord:
    return stored_form(session.to_record(1.0))


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll: the conditions are over plain state that nothing signals."""
    try:
        async with asyncio.timeout(WAIT_TIMEOUT):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def settle() -> None:
    """Let every runnable task run until it waits (the fake storage never blocks)."""
    for _ in range(200):
        await asyncio.sleep(0)


async def acknowledge(session: Session, sent: Sent) -> None:
    assert sent.packet_id is not None
    if sent.qos == 1:
        assert session.outbox.on_puback(sent.packet_id)
    else:
        assert await session.outbox.on_pubrec(sent.packet_id, failed=False)
        assert session.outbox.on_pubcomp(sent.packet_id)


async def acknowledge_until(session: Session, outlet: RecordingOutlet, count: int) -> None:
    """Acknowledge every QoS 1/2 PUBLISH as it comes (those not acknowledged by an
    earlier call), until `count` have come on this connection."""
    while True:
        await wait_until(lambda: len(outlet.publishes) > outlet.acknowledged
                         or len(outlet.publishes) >= count,
                         f"{count} PUBLISH packets (got {len(outlet.publishes)})")
        await acknowledge_new(session, outlet)
        if outlet.acknowledged >= count:
            return


async def acknowledge_new(session: Session, outlet: RecordingOutlet) -> None:
    """Acknowledge the QoS 1/2 PUBLISH packets not acknowledged yet (each ack may
    send the next: those are left for the next call)."""
    publishes = outlet.publishes
    for sent in publishes[outlet.acknowledged:]:
        if sent.qos > 0:
            await acknowledge(session, sent)
    outlet.acknowledged = len(publishes)


def key_of(sent: Sent) -> tuple[str, int]:
    return sent.topic, sent.timestamp


# -- packet identifiers ------------------------------------------------------------


def test_packet_ids_are_allocated_in_order_and_not_reused_while_in_flight() -> None:
    async def main() -> None:
        session = make_session(FakeStorage(), durable=False)
        outlet = RecordingOutlet(receive_maximum=10)
        session.attach(outlet)
        for n in range(3):
            session.offer(delivery("t", 1, bytes([n])))
        assert [s.packet_id for s in outlet.publishes] == [1, 2, 3]
        assert not any(s.dup for s in outlet.publishes)
        assert session.outbox.on_puback(2)
        assert not session.outbox.on_puback(2)  # acknowledged already
        assert not session.outbox.on_puback(9)  # never sent
        for n in range(3):
            session.offer(delivery("t", 1, bytes([n])))
        assert [s.packet_id for s in outlet.publishes] == [1, 2, 3, 4, 5, 6]
        assert session.outbox.in_flight_count == 5
        session.offer(delivery("t", 0))
        assert outlet.publishes[-1].packet_id is None  # QoS 0 takes none
        await session.detach()

    run(main())


def test_packet_ids_wrap_past_65535_skipping_those_in_use() -> None:
    async def main() -> None:
        session = make_session(FakeStorage(), durable=False, max_queued=10)
        outlet = RecordingOutlet(receive_maximum=MAX_PACKET_ID)
        session.attach(outlet)
        for _ in range(MAX_PACKET_ID):
            session.offer(delivery("t", 1))
        assert [s.packet_id for s in outlet.publishes] == list(range(1, MAX_PACKET_ID + 1))
        session.offer(delivery("t", 1, b"waits"))  # every identifier is in use
        assert len(outlet.publishes) == MAX_PACKET_ID
        assert session.outbox.queued_count == 1
        kept = {1, 2, 4, MAX_PACKET_ID}
        for packet_id in range(3, MAX_PACKET_ID):
            if packet_id not in kept:
                assert session.outbox.on_puback(packet_id)
        session.offer(delivery("t", 1))
        session.offer(delivery("t", 1))
        # after 65535 comes 1 (not 0); 1 and 2 are in use, 3 is free again, 4 is not
        assert [s.packet_id for s in outlet.publishes[MAX_PACKET_ID:]] == [3, 5, 6]
        assert outlet.publishes[MAX_PACKET_ID].payload == b"waits"
        await session.detach()

    run(main())


# -- the in-flight window ----------------------------------------------------------


def test_in_flight_window_respects_receive_maximum_and_acks_release_the_next() -> None:
    async def main() -> None:
        session = make_session(FakeStorage(), durable=False)
        outlet = RecordingOutlet(receive_maximum=2)
        session.attach(outlet)
        for payload, qos in [(b"a", 1), (b"b", 2), (b"c", 1), (b"d", 0), (b"e", 1)]:
            session.offer(delivery("t", qos, payload))
        assert [s.payload for s in outlet.publishes] == [b"a", b"b"]
        assert (session.outbox.in_flight_count, session.outbox.queued_count) == (2, 3)
        assert session.outbox.on_puback(1)
        # c takes the free slot; d (QoS 0) follows in queue order; e waits
        assert [(s.payload, s.packet_id) for s in outlet.publishes[2:]] == \
            [(b"c", 3), (b"d", None)]
        assert (session.outbox.in_flight_count, session.outbox.queued_count) == (2, 1)
        assert await session.outbox.on_pubrec(2, failed=False)
        assert len(outlet.publishes) == 4  # b still holds its slot until PUBCOMP
        assert session.outbox.on_pubcomp(2)
        assert [(s.payload, s.packet_id) for s in outlet.publishes[4:]] == [(b"e", 4)]
        assert (session.outbox.in_flight_count, session.outbox.queued_count) == (2, 0)
        await session.detach()

    run(main())


# -- outbound QoS 2 ----------------------------------------------------------------


def test_qos2_pubrec_gets_pubrel_and_pubcomp_frees_the_id() -> None:
    async def main() -> None:
        session = make_session(FakeStorage(), durable=False)
        outlet = RecordingOutlet(receive_maximum=1)
        session.attach(outlet)
        session.offer(delivery("t", 2, b"a"))
        session.offer(delivery("t", 2, b"b"))
        assert [(s.payload, s.packet_id, s.qos) for s in outlet.publishes] == [(b"a", 1, 2)]
        assert not session.outbox.on_puback(1)  # not a QoS 1 exchange
        assert not session.outbox.on_pubcomp(1)  # no PUBREC yet
        assert await session.outbox.on_pubrec(1, failed=False)
        assert outlet.pubrels == [1]
        assert await session.outbox.on_pubrec(1, failed=False)  # a repeated PUBREC: PUBREL again
        assert outlet.pubrels == [1, 1]
        assert len(outlet.publishes) == 1 and session.outbox.in_flight_count == 1
        assert session.outbox.on_pubcomp(1)
        assert not session.outbox.on_pubcomp(1)
        assert session.outbox.in_flight_count == 1
        assert [(s.payload, s.packet_id) for s in outlet.publishes[1:]] == [(b"b", 2)]
        assert session.outbox.on_puback(2) is False
        await session.detach()

    run(main())


def test_qos2_failed_pubrec_frees_the_id_without_pubrel() -> None:
    async def main() -> None:
        session = make_session(FakeStorage(), durable=False)
        outlet = RecordingOutlet(receive_maximum=1)
        session.attach(outlet)
        session.offer(delivery("t", 2, b"a"))
        session.offer(delivery("t", 2, b"b"))
        assert await session.outbox.on_pubrec(1, failed=True)
        assert outlet.pubrels == []
        assert not session.outbox.on_pubcomp(1)  # the exchange is over
        assert [(s.payload, s.packet_id) for s in outlet.publishes] == [(b"a", 1), (b"b", 2)]
        assert session.outbox.in_flight_count == 1
        assert not await session.outbox.on_pubrec(1, failed=False)
        await session.detach()

    run(main())


def test_an_inbound_qos2_store_that_failed_leaves_its_packet_id_unknown_not_free() -> None:
    """A store that failed may have been committed all the same (a leader stepped down
    after the entry reached a majority): its packet id is neither pending nor free,
    until the storage tells (a resend asks it rather than storing again)."""
    async def main() -> None:
        session = make_session(FakeStorage(), durable=True)
        loop = asyncio.get_running_loop()
        failed, stored = loop.create_future(), loop.create_future()
        session.inbound_qos2.storing(7, failed)
        session.inbound_qos2.storing(8, stored)
        failed.set_exception(StorageTimeoutError("no majority in time"))
        stored.set_result(None)
        await asyncio.sleep(0)  # the done callbacks
        assert (session.inbound_qos2.pending(7), session.inbound_qos2.unknown(7)) \
            == (False, True)
        assert (session.inbound_qos2.pending(8), session.inbound_qos2.unknown(8)) \
            == (True, False)
        session.inbound_qos2.known(7, stored=True)
        assert (session.inbound_qos2.pending(7), session.inbound_qos2.unknown(7)) \
            == (True, False)
        released = loop.create_future()
        session.inbound_qos2.releasing(7, released)
        released.set_result(None)
        await asyncio.sleep(0)
        assert not session.inbound_qos2.pending(7)
        assert not session.inbound_qos2.to_release(7)

    run(main())


def test_a_packet_id_whose_release_failed_is_released_again_not_free() -> None:
    """PUBREL's durable delete of the id failed (a write queued behind a failed one):
    the id's record may still be stored, and comes back when the session is loaded
    again. It was free at once, so a PUBREL resent on a new connection was answered
    "not found", the client reused the id, and a new message with it was taken for a
    resend: acknowledged, never stored (found by reading). Now it is unknown until a
    release succeeds, and a PUBREL resent while one is under way releases it again."""
    async def main() -> None:
        session = make_session(FakeStorage(), durable=True)
        loop = asyncio.get_running_loop()
        stored = loop.create_future()
        session.inbound_qos2.storing(7, stored)
        stored.set_result(None)
        await asyncio.sleep(0)
        first, again = loop.create_future(), loop.create_future()
        session.inbound_qos2.releasing(7, first)
        assert session.inbound_qos2.to_release(7)  # a resend meets the release under way
        first.set_exception(StorageTimeoutError("an earlier write failed"))
        await asyncio.sleep(0)
        assert (session.inbound_qos2.pending(7), session.inbound_qos2.unknown(7),
                session.inbound_qos2.to_release(7)) == (False, True, True)
        session.inbound_qos2.releasing(7, again)
        again.set_result(None)
        await asyncio.sleep(0)
        assert (session.inbound_qos2.unknown(7), session.inbound_qos2.to_release(7)) \
            == (False, False)

    run(main())


# -- a transient session's full queue ----------------------------------------------


def dropped_for_full_queue() -> float:
    value = REGISTRY.get_sample_value("stratamq_messages_dropped_total",
                                      {"reason": "queue_full"})
    return value or 0.0


def test_transient_full_queue_drops_qos0_only_and_reads_qos1_2_from_storage() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        session = make_session(storage, durable=False, max_queued=2)
        session.subscribe(Subscription("t/#", qos=2))
        outlet = RecordingOutlet(receive_maximum=1)
        session.attach(outlet)
        dropped_before = dropped_for_full_queue()
        qos_of = {b"1": 1, b"2": 1, b"3": 0, b"4": 0, b"5": 1, b"6": 0, b"7": 2,
                  b"8": 0, b"9": 1}
        for payload, qos in qos_of.items():
            session.replay.on_feed(*db.store("t/x", payload, qos=qos))
        # 1 is in flight and 2 waits behind it; the queue (2) is full from 3 on: 3 is
        # pushed out by 4, 4 by 5; 6 finds only QoS 1 queued and is dropped; 7 finds
        # no QoS 0 to push out: it and all after it on the stream (8 too) come from
        # storage
        expected = [b"1", b"2", b"5", b"7", b"8", b"9"]
        await acknowledge_until(session, outlet, len(expected))
        await settle()
        assert [s.payload for s in outlet.publishes] == expected
        assert [s.qos for s in outlet.publishes] == [qos_of[p] for p in expected]
        assert dropped_for_full_queue() - dropped_before == 3
        # caught up: the next one comes live again, exactly once
        session.replay.on_feed(*db.store("t/x", b"10", qos=1))
        await acknowledge_until(session, outlet, len(expected) + 1)
        await settle()
        assert [s.payload for s in outlet.publishes] == [*expected, b"10"]
        await session.detach()

    run(main())


# -- durable replay and resend -----------------------------------------------------


def store_interleaved(db: FakeDatabase, count: int) -> list[tuple[Stream, Message]]:
    stored = []
    for n in range(count):
        stored.append(db.store("d/a", f"a{n}".encode(), qos=1))
        stored.append(db.store("d/b", f"b{n}".encode(), qos=1))
    return stored


def run_resend_test(restore: bool) -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        stored = store_interleaved(db, 3)
        session = make_session(storage, durable=True, batch_size=1)
        session.subscribe(Subscription("d/#", qos=1))
        first = RecordingOutlet(receive_maximum=3)
        session.attach(first)
        await wait_until(lambda: len(first.publishes) == 3, "the first window")
        assert session.outbox.on_puback(first.publishes[1].packet_id or 0)  # out of order
        await wait_until(lambda: len(first.publishes) == 4, "the slot freed by the ack")
        await settle()
        unacked = [first.publishes[i] for i in (0, 2, 3)]
        await session.detach()
        record = record_roundtrip(session)
        assert [(pid, ts) for pid, _key, ts in record.resend] == \
            [(s.packet_id, s.timestamp) for s in unacked]  # in first-sent order
        if restore:
            session = make_session(storage, durable=True, batch_size=1)
            session.restore(record)
        second = RecordingOutlet(receive_maximum=10)
        session.attach(second)
        await acknowledge_until(session, second, len(stored) - 1)
        await settle()
        resent = second.publishes[:3]
        assert [(s.packet_id, s.timestamp, s.payload, s.dup) for s in resent] == \
            [(s.packet_id, s.timestamp, s.payload, True) for s in unacked]
        fresh = second.publishes[3:]
        assert not any(s.dup for s in fresh)
        assert {key_of(s) for s in fresh}.isdisjoint(key_of(s) for s in first.publishes)
        assert sorted(key_of(s) for s in [*first.publishes, *fresh]) == \
            sorted((m.topic, m.timestamp) for _stream, m in stored)
        assert not {s.packet_id for s in fresh} & {s.packet_id for s in unacked}
        # everything acknowledged: a third connection gets nothing again
        await session.detach()
        record = record_roundtrip(session)
        assert record.resend == []
        session = make_session(storage, durable=True, batch_size=1)
        session.restore(record)
        third = RecordingOutlet()
        session.attach(third)
        await settle()
        assert third.sent == []
        await session.detach()

    run(main())


def test_durable_resends_unacknowledged_with_dup_and_ids_in_sent_order_after_restore() -> None:
    run_resend_test(restore=True)


def test_durable_resends_unacknowledged_with_dup_and_ids_on_reattach() -> None:
    run_resend_test(restore=False)


def test_resend_order_is_first_sent_order_not_packet_id_order() -> None:
    async def main() -> None:
        storage = FakeStorage()
        for n in range(6):
            storage.db(DB).store("r/x", bytes([n]), qos=1)
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("r/#", qos=1))
        first = RecordingOutlet(receive_maximum=3)
        session.attach(first)
        await wait_until(lambda: len(first.publishes) == 3, "the first window")
        assert session.outbox.on_puback(1) and session.outbox.on_puback(2)
        await wait_until(lambda: len(first.publishes) == 5, "two more")
        await session.detach()
        record = record_roundtrip(session)
        session = make_session(storage, durable=True)
        session.restore(record)
        second = RecordingOutlet()
        session.attach(second)
        await wait_until(lambda: len(second.publishes) == 4, "3 resends and the last one")
        await settle()
        # a fresh session counts from 1 again: the last message takes 1, sent after 3-5
        assert [(s.packet_id, s.payload, s.dup) for s in second.publishes] == \
            [(3, b"\x02", True), (4, b"\x03", True), (5, b"\x04", True), (1, b"\x05", False)]
        await session.detach()
        record = record_roundtrip(session)
        assert [pid for pid, _key, _ts in record.resend] == [3, 4, 5, 1]
        session = make_session(storage, durable=True)
        session.restore(record)
        third = RecordingOutlet()
        session.attach(third)
        await wait_until(lambda: len(third.publishes) == 4, "the 4 resends")
        await settle()
        assert [(s.packet_id, s.dup) for s in third.publishes] == \
            [(3, True), (4, True), (5, True), (1, True)]
        assert [s.payload for s in third.publishes] == [bytes([n]) for n in range(2, 6)]
        await session.detach()

    run(main())


def test_resend_order_survives_a_reconnect_with_a_smaller_window() -> None:
    async def main() -> None:
        storage = FakeStorage()
        for payload in (b"A", b"B", b"C"):
            storage.db(DB).store("w/x", payload, qos=1)
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("w/#", qos=1))
        first = RecordingOutlet(receive_maximum=3)
        session.attach(first)
        await wait_until(lambda: len(first.publishes) == 3, "A, B and C")
        await session.detach()
        record = record_roundtrip(session)
        assert [pid for pid, _key, _ts in record.resend] == [1, 2, 3]
        session = make_session(storage, durable=True)
        session.restore(record)
        second = RecordingOutlet(receive_maximum=1)  # A goes out again; B and C wait
        session.attach(second)
        await wait_until(lambda: len(second.publishes) == 1, "A again")
        await settle()
        assert [(s.payload, s.packet_id, s.dup) for s in second.publishes] == [(b"A", 1, True)]
        await session.detach()  # none of them acknowledged
        record = record_roundtrip(session)
        assert [pid for pid, _key, _ts in record.resend] == [1, 2, 3]
        session = make_session(storage, durable=True)
        session.restore(record)
        third = RecordingOutlet()
        session.attach(third)
        await wait_until(lambda: len(third.publishes) == 3, "the 3 resends")
        await settle()
        assert [(s.payload, s.packet_id, s.dup) for s in third.publishes] == \
            [(b"A", 1, True), (b"B", 2, True), (b"C", 3, True)]
        await session.detach()

    run(main())


def test_durable_replays_from_saved_position_after_restore() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        stream, _ = db.store("p/x", bytes([0]), qos=1)
        for n in range(1, 5):
            db.store("p/x", bytes([n]), qos=1)
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("p/#", qos=1))
        first = RecordingOutlet()
        session.attach(first)
        await acknowledge_until(session, first, 5)
        await session.detach()
        record = record_roundtrip(session)
        assert list(record.cursors) == [cursor_key("p/#", stream)]
        assert record.cursors[cursor_key("p/#", stream)].position == \
            first.publishes[-1].timestamp
        for n in range(5, 8):  # stored while the client was away
            db.store("p/x", bytes([n]), qos=1)
        session = make_session(storage, durable=True)
        session.restore(record)
        second = RecordingOutlet()
        session.attach(second)
        await acknowledge_until(session, second, 3)
        await settle()
        assert [s.payload for s in second.publishes] == [bytes([n]) for n in range(5, 8)]
        assert not any(s.dup for s in second.publishes)
        await session.detach()

    run(main())


def test_durable_qos2_past_pubrec_is_released_not_published_again_after_restore() -> None:
    async def main() -> None:
        storage = FakeStorage()
        storage.db(DB).store("q/x", b"once", qos=2)
        saved = SavedSessions()
        session = make_session(storage, durable=True, saved=saved)
        session.subscribe(Subscription("q/#", qos=2))
        first = RecordingOutlet()
        session.attach(first)
        await wait_until(lambda: len(first.publishes) == 1, "the QoS 2 message")
        packet_id = first.publishes[0].packet_id
        assert packet_id is not None
        saved.gate.clear()  # a slow store: the PUBREL waits for the write
        assert await session.outbox.on_pubrec(packet_id, failed=False)
        await settle()
        assert first.pubrels == []
        saved.gate.set()
        # saved before PUBREL went out: a crash now never publishes it again
        await wait_until(lambda: first.pubrels == [packet_id], "the PUBREL")
        assert saved.records[-1].pubrel_pending == [packet_id]
        await session.detach()
        record = record_roundtrip(session)
        session = make_session(storage, durable=True)
        session.restore(record)
        second = RecordingOutlet()
        session.attach(second)
        await settle()
        assert second.sent == [Sent("pubrel", packet_id)]
        assert session.outbox.on_pubcomp(packet_id)
        assert record_roundtrip(session).pubrel_pending == []
        await session.detach()

    run(main())


def test_pubrels_after_a_restore_follow_pubrec_order_not_packet_id_order() -> None:
    """A restored session numbers new messages from 1 again while its resends keep
    their old, higher packet identifiers. When a crash finds both past PUBREC, the
    PUBRELs must go in the order the PUBRECs came (MQTT-4.6.0-3), not by packet
    identifier: a client delivers a QoS 2 message at its PUBREL, so the other order
    is an order breach (the site-killed-twice history test saw one)."""
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        for n in range(5):
            db.store("q/x", bytes([n]), qos=2)
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("q/#", qos=2))
        first = RecordingOutlet(receive_maximum=3)
        session.attach(first)
        await wait_until(lambda: len(first.publishes) == 3, "the first window")
        for sent in first.publishes[:2]:  # packet ids 1 and 2 completed
            await acknowledge(session, sent)
        await wait_until(lambda: len(first.publishes) == 5, "two more, unacknowledged")
        await session.detach()

        session = restored(storage, record_roundtrip(session))  # the site restarted
        second = RecordingOutlet()
        session.attach(second)
        await wait_until(lambda: len(second.publishes) == 3, "the three resent")
        for n in (5, 6):
            session.replay.on_feed(*db.store("q/x", bytes([n]), qos=2))
        await wait_until(lambda: len(second.publishes) == 5, "two new ones")
        assert [(s.payload, s.packet_id, s.dup) for s in second.publishes] == [
            (bytes([2]), 3, True), (bytes([3]), 4, True), (bytes([4]), 5, True),
            (bytes([5]), 1, False), (bytes([6]), 2, False)]
        for sent in second.publishes:  # PUBREC each, in the order they came
            assert sent.packet_id is not None
            assert await session.outbox.on_pubrec(sent.packet_id, failed=False)
        await wait_until(lambda: len(second.pubrels) == 5, "five PUBRELs")
        assert second.pubrels == [3, 4, 5, 1, 2]
        await session.detach()  # crashed before any PUBCOMP came

        record = record_roundtrip(session)
        assert record.pubrel_pending == [3, 4, 5, 1, 2]
        session = restored(storage, record)
        third = RecordingOutlet()
        session.attach(third)
        await settle()
        assert third.pubrels == [3, 4, 5, 1, 2]
        await session.detach()

    run(main())


def test_pubrels_go_in_pubrec_order_when_the_client_acknowledges_out_of_order() -> None:
    async def main() -> None:
        storage = FakeStorage()
        for n in range(3):
            storage.db(DB).store("q/x", bytes([n]), qos=2)
        session = make_session(storage, durable=False)
        session.subscribe(Subscription("q/#", qos=2))
        first = RecordingOutlet()
        session.attach(first)
        session.replay.on_feed_gap(0, 1)  # read the three from storage
        await wait_until(lambda: len(first.publishes) == 3, "three QoS 2 messages")
        for packet_id in (2, 1, 3):
            assert await session.outbox.on_pubrec(packet_id, failed=False)
        await session.detach()
        second = RecordingOutlet()
        session.attach(second)
        await settle()
        assert second.pubrels == [2, 1, 3]
        await session.detach()

    run(main())


def restored(storage: FakeStorage, record: SessionRecord) -> Session:
    session = make_session(storage, durable=True)
    session.restore(record)
    return session


def test_durable_qos2_packet_id_is_saved_before_the_publish_goes_out() -> None:
    async def main() -> None:
        storage = FakeStorage()
        storage.db(DB).store("s/x", b"two", qos=2)
        saved = SavedSessions()
        saved.gate.clear()
        session = make_session(storage, durable=True, saved=saved)
        session.subscribe(Subscription("s/#", qos=2))
        outlet = RecordingOutlet()
        session.attach(outlet)
        await settle()
        assert outlet.sent == []  # waits for the write of its packet identifier
        saved.gate.set()
        await wait_until(lambda: len(outlet.publishes) == 1, "the QoS 2 message")
        sent = outlet.publishes[0]
        [(packet_id, _key, timestamp)] = saved.records[0].resend
        assert (packet_id, timestamp) == (sent.packet_id, sent.timestamp)
        # the broker dies here (nothing more of this session is written or called):
        # the next one resumes from the saved record
        session = make_session(storage, durable=True)
        session.restore(saved.records[0])
        again = RecordingOutlet()
        session.attach(again)
        await wait_until(lambda: len(again.publishes) == 1, "the resend")
        await settle()
        assert [(s.packet_id, s.payload, s.dup) for s in again.publishes] == \
            [(sent.packet_id, b"two", True)]
        await session.detach()

    run(main())


# -- closed generations ------------------------------------------------------------


def test_finished_closed_generation_is_not_replayed_after_renew_or_restore() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        old_stream, _ = db.store("g/x", b"1")
        db.store("g/x", b"2")
        db.add_generation(0)
        db.store("g/x", b"3")
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("g/#", qos=1))
        first = RecordingOutlet()
        session.attach(first)
        await acknowledge_until(session, first, 3)
        assert [s.payload for s in first.publishes] == [b"1", b"2", b"3"]  # generations in order
        old_key = cursor_key("g/#", old_stream)
        await wait_until(lambda: old_key in session.to_record(None).done, "the done mark")
        reads = db.reads[old_stream]
        session.streams.renew()
        await settle()
        assert len(first.publishes) == 3
        assert db.reads[old_stream] == reads
        await session.detach()
        record = record_roundtrip(session)
        assert record.done == [old_key]
        assert old_key not in record.cursors
        session = make_session(storage, durable=True)
        session.restore(record)
        second = RecordingOutlet()
        session.attach(second)
        await settle()
        assert second.sent == []
        session.streams.renew()
        session.replay.on_feed(*db.store("g/x", b"4"))
        await acknowledge_until(session, second, 1)
        await settle()
        assert [s.payload for s in second.publishes] == [b"4"]
        assert db.reads[old_stream] == reads
        await session.detach()

    run(main())


def test_closed_generation_with_unacknowledged_message_has_no_done_mark() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        old_stream, _ = db.store("g/x", b"1")
        db.store("g/x", b"2")
        db.add_generation(0)
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("g/#", qos=1))
        first = RecordingOutlet()
        session.attach(first)
        await wait_until(lambda: len(first.publishes) == 2, "both messages")
        assert session.outbox.on_puback(first.publishes[0].packet_id or 0)
        await settle()
        await session.detach()
        record = record_roundtrip(session)
        assert record.done == []
        session = make_session(storage, durable=True)
        session.restore(record)
        second = RecordingOutlet()
        session.attach(second)
        await acknowledge_until(session, second, 1)
        await settle()
        assert [(s.payload, s.dup) for s in second.publishes] == [(b"2", True)]
        await wait_until(lambda: session.to_record(None).done == [cursor_key("g/#", old_stream)],
                         "the done mark once the last message is acknowledged")
        await session.detach()

    run(main())


# -- streams that appear later -----------------------------------------------------


def test_periodic_look_finds_a_new_stream_through_the_stream_version() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        db.store("n/a", b"first")
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("n/#", qos=1))
        outlet = RecordingOutlet()
        session.attach(outlet)
        await acknowledge_until(session, outlet, 1)
        version = db.stream_version
        db.store("n/b", b"new stream", shard=1)  # not fed: only the look can find it
        assert db.stream_version == version + 1
        session.streams.renew_new(db.stream_version)
        await acknowledge_until(session, outlet, 2)
        await settle()
        assert [s.payload for s in outlet.publishes] == [b"first", b"new stream"]
        await session.detach()

    run(main())


class CountingPolls(Deadlines):
    """The registry's timer of safety-net polls, counting how often a replay
    registered one: it does so each time it has read what it could and waits."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def add(self, deadline: Expiring, at: float) -> int:
        self.waits += 1
        return super().add(deadline, at)


def test_the_periodic_look_wakes_no_replay_that_has_nothing_to_read() -> None:
    """Issue 25: the look for new streams runs every second over every connected
    durable session, and woke each one's replay for a pass over its cursors: at 12k
    idle durable connections, 160k passes that read nothing in 20 s, which slowed
    every connect. A replay whose cursors are all on the live feed has nothing to
    read: it is not woken. One whose cursor left the live feed is, should the wake-up
    that came with it have been missed."""
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        db.store("q/a", b"first")
        polls = CountingPolls()
        session = make_session(storage, durable=True, polls=polls)
        session.subscribe(Subscription("q/#", qos=1))
        outlet = RecordingOutlet()
        session.attach(outlet)
        await acknowledge_until(session, outlet, 1)
        await settle()
        waits = polls.waits
        for _ in range(5):
            session.streams.renew_new(db.stream_version)
            await settle()
        assert polls.waits == waits, "a caught-up replay was woken for nothing"
        # a message stored and not fed, its cursor off the live feed with no wake-up
        # (one missed): the look wakes the replay, which reads it
        db.store("q/a", b"second")
        for cursor in session.streams.cursors.values():
            cursor.live = False
        session.streams.renew_new(db.stream_version)
        await acknowledge_until(session, outlet, 2)
        assert [s.payload for s in outlet.publishes] == [b"first", b"second"]
        await session.detach()

    run(main())


def replay_tasks(client_id: str) -> int:
    return sum(task.get_name() == f"replay-{client_id}" and not task.done()
               for task in asyncio.all_tasks())


def test_a_caught_up_durable_session_holds_no_reader_until_there_is_something_to_read(
        ) -> None:
    """Issue 25: every connected durable session held a reader task (with its
    frames, 1 KB) waiting on its wake-up, with every cursor on the live feed. The
    reader now ends once nothing is left to read from storage; what sends a cursor
    back to storage (a full queue, a feed gap, a new stream) starts it again."""
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        db.store("r/a", b"0", qos=1)
        session = make_session(storage, durable=True, max_queued=2)
        session.subscribe(Subscription("r/#", qos=1))
        outlet = RecordingOutlet(receive_maximum=1)
        session.attach(outlet)
        await acknowledge_until(session, outlet, 1)
        await settle()
        assert replay_tasks("c1") == 0
        # live: delivered without a reader
        session.replay.on_feed(*db.store("r/a", b"1", qos=1))
        await acknowledge_until(session, outlet, 2)
        await settle()
        assert replay_tasks("c1") == 0
        # a feed gap: what was missed is read from storage, by a reader started for it
        db.store("r/a", b"2", qos=1)
        stream, _message = db.store("r/a", b"3", qos=1)
        session.replay.on_feed_gap(stream.shard, 0)
        assert replay_tasks("c1") == 1
        await acknowledge_until(session, outlet, 4)
        # the queue full (a window of one, a queue of two): more goes to storage
        for n in range(4, 10):
            session.replay.on_feed(*db.store("r/a", str(n).encode(), qos=1))
        await acknowledge_until(session, outlet, 10)
        await settle()
        assert [s.payload for s in outlet.publishes] == [str(n).encode() for n in range(10)]
        assert replay_tasks("c1") == 0
        # a new stream found by the periodic look
        db.store("r/b", b"10", qos=1, shard=1)
        session.streams.renew_new(db.stream_version)
        await acknowledge_until(session, outlet, 11)
        await settle()
        assert outlet.publishes[-1].payload == b"10"
        assert replay_tasks("c1") == 0
        await session.detach()

    run(main())


# -- overlapping subscriptions -----------------------------------------------------


def overlapping_subscriptions(session: Session) -> None:
    session.subscribe(Subscription("o/+", qos=1, identifier=1))
    session.subscribe(Subscription("o/#", qos=2, identifier=2))
    session.subscribe(Subscription("#", qos=0))  # no identifier


def test_overlapping_subscriptions_give_one_transient_delivery_with_all_ids() -> None:
    async def main() -> None:
        storage = FakeStorage()
        session = make_session(storage, durable=False)
        overlapping_subscriptions(session)
        outlet = RecordingOutlet()
        session.attach(outlet)
        session.replay.on_feed(*storage.db(DB).store("o/x", b"m", qos=2))
        session.replay.on_feed(*storage.db(DB).store("other", b"n", qos=2))
        assert [(s.payload, s.qos, sorted(s.subscription_ids)) for s in outlet.publishes] == \
            [(b"m", 2, [1, 2]), (b"n", 0, [])]
        await session.detach()

    run(main())


def test_overlapping_subscriptions_give_one_durable_delivery_with_all_ids() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        db.store("o/x", b"stored", qos=2)
        session = make_session(storage, durable=True)
        overlapping_subscriptions(session)
        outlet = RecordingOutlet()
        session.attach(outlet)
        await acknowledge_until(session, outlet, 1)
        await settle()
        session.replay.on_feed(*db.store("o/x", b"live", qos=1))
        await acknowledge_until(session, outlet, 2)
        await settle()
        assert [(s.payload, s.qos, sorted(s.subscription_ids)) for s in outlet.publishes] == \
            [(b"stored", 2, [1, 2]), (b"live", 1, [1, 2])]
        last = outlet.publishes[-1].timestamp
        await session.detach()
        record = record_roundtrip(session)
        # every subscription's cursor is past both: none sends them again
        assert sorted(key.rsplit(":", 1)[1] for key in record.cursors) == ["#", "o/#", "o/+"]
        assert {state.position for state in record.cursors.values()} == {last}
        session = make_session(storage, durable=True)
        session.restore(record)
        again = RecordingOutlet()
        session.attach(again)
        await settle()
        assert again.sent == []
        await session.detach()

    run(main())


# -- a queue of one ----------------------------------------------------------------
# mqtt.max_queued_messages is a PositiveInt, so 1 is a valid setting. These wait with
# settle() rather than a timeout: the fake storage answers at once, so a few loop turns
# are plenty, and a stuck replay fails fast instead of after WAIT_TIMEOUT.


def test_durable_session_with_a_queue_of_one_replays_stored_messages() -> None:
    async def main() -> None:
        storage = FakeStorage()
        storage.db(DB).store("one/x", b"stored", qos=1)
        session = make_session(storage, durable=True, max_queued=1)
        session.subscribe(Subscription("one/#", qos=1))
        outlet = RecordingOutlet()
        session.attach(outlet)
        await settle()
        assert [s.payload for s in outlet.publishes] == [b"stored"]
        await session.detach()

    run(main())


def test_transient_session_with_a_queue_of_one_catches_up_from_storage() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        session = make_session(storage, durable=False, max_queued=1)
        session.subscribe(Subscription("one/#", qos=1))
        outlet = RecordingOutlet(receive_maximum=1)
        session.attach(outlet)
        for payload in (b"1", b"2", b"3"):  # 1 in flight, 2 queued, 3 from storage
            session.replay.on_feed(*db.store("one/x", payload, qos=1))
        for _ in range(3):
            await settle()
            await acknowledge_new(session, outlet)
        assert [s.payload for s in outlet.publishes] == [b"1", b"2", b"3"]
        await session.detach()

    run(main())


# -- wake-ups of the replay --------------------------------------------------------
# The replay reads while the queue has room and otherwise waits to be woken by an
# acknowledgement. IDLE_POLL (600 s) rules out the safety-net poll: a backlog that is
# not read on after the queue empties fails these tests.


async def acknowledge_qos2_pipelined(session: Session, outlet: RecordingOutlet,
                                     count: int) -> None:
    """Answer like a client that pipelines QoS 2: PUBREC every PUBLISH that has come,
    then (once their PUBRELs are out) PUBCOMP them all; until `count` have come."""
    answered = 0

    def more_came() -> bool:
        return len(outlet.publishes) > answered

    while answered < count:
        await wait_until(more_came, f"{count} PUBLISH packets (got {len(outlet.publishes)})")
        fresh = outlet.publishes[answered:]
        answered += len(fresh)
        for sent in fresh:
            assert sent.packet_id is not None and sent.qos == 2
            assert await session.outbox.on_pubrec(sent.packet_id, failed=False)
        await settle()
        for sent in fresh:
            assert sent.packet_id is not None
            assert session.outbox.on_pubcomp(sent.packet_id)


def test_durable_qos2_backlog_is_pulled_on_by_pubcomps_past_the_window() -> None:
    """QoS 2 frees its place in the window only at PUBCOMP (after the PUBREC that
    completes the cursor's message): the stored messages behind a small window and a
    small queue must still all come."""
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        count = 40
        for n in range(count):
            db.store(f"w/{n % 3}", bytes([n]), qos=2, shard=n % 2)
        session = make_session(storage, durable=True, max_queued=4, batch_size=3)
        session.subscribe(Subscription("w/#", qos=2))
        outlet = RecordingOutlet(receive_maximum=2)
        session.attach(outlet)
        await acknowledge_qos2_pipelined(session, outlet, count)
        await settle()
        assert sorted(s.payload for s in outlet.publishes) == [bytes([n]) for n in range(count)]
        assert (session.outbox.in_flight_count, session.outbox.queued_count) == (0, 0)
        await session.detach()

    run(main())


def test_replay_stopped_by_a_full_queue_is_woken_when_the_queue_drains() -> None:
    """A replay round that ends with the queue full (one read hands out a whole batch,
    more than the queue holds) waits for room; the acknowledgements that drain the
    queue through a window of one must wake it, for the rest of the stream."""
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        count = 30
        for n in range(count):
            db.store("f/x", bytes([n]), qos=1)
        session = make_session(storage, durable=True, max_queued=2, batch_size=7)
        session.subscribe(Subscription("f/#", qos=1))
        outlet = RecordingOutlet(receive_maximum=1)
        session.attach(outlet)
        await acknowledge_until(session, outlet, count)
        await settle()
        assert [s.payload for s in outlet.publishes] == [bytes([n]) for n in range(count)]
        # and a message stored later comes from the live feed
        session.replay.on_feed(*db.store("f/x", b"later", qos=1))
        await acknowledge_until(session, outlet, count + 1)
        assert outlet.publishes[-1].payload == b"later"
        await session.detach()

    run(main())


def backlogged_session(count: int, *, max_queued: int, batch_size: int,
                       receive_maximum: int) -> tuple[FakeStorage, Session, RecordingOutlet]:
    """A durable session on `b/#` with `count` QoS 1 messages stored on `b/x` (each
    payload its number), attached through a window of `receive_maximum`."""
    storage = FakeStorage()
    for n in range(count):
        storage.db(DB).store("b/x", bytes([n]), qos=1)
    session = make_session(storage, durable=True, max_queued=max_queued,
                           batch_size=batch_size)
    session.subscribe(Subscription("b/#", qos=1))
    outlet = RecordingOutlet(receive_maximum=receive_maximum)
    session.attach(outlet)
    return storage, session, outlet


def test_a_replay_waiting_for_room_is_woken_by_the_acknowledgement_that_makes_it() -> None:
    """The replay stops reading at the queue's mark and waits for room; the
    acknowledgement that takes the queue under the mark (its window slot goes to the
    next queued message) must wake it. It was told of the acknowledgement before the
    queue moved on, saw the queue still at the mark and went on waiting, for the
    next acknowledgement: a round trip lost each time the queue filled."""
    async def main() -> None:
        _storage, session, outlet = backlogged_session(20, max_queued=4, batch_size=3,
                                                       receive_maximum=1)
        await settle()
        outbox = session.outbox
        # a batch of 3 read: one in flight, two queued, the mark (2) reached
        assert (len(outlet.publishes), outbox.queued_count) == (1, 2)
        await acknowledge_new(session, outlet)
        await settle()
        # the next went out, the queue fell under the mark: the replay read on
        assert len(outlet.publishes) == 2
        assert outbox.queued_count >= outbox.replay_room, outbox.queued_count
        await acknowledge_until(session, outlet, 20)
        assert [s.payload for s in outlet.publishes] == [bytes([n]) for n in range(20)]
        await session.detach()

    run(main())


# -- a failing replay ----------------------------------------------------------------
# Reads are made to fail in the fake storage (a real one raises the same way when its
# database is closed or its disk fails). A failed replay is retried; it must never make
# the session's close (detach) raise, nor lose what the session has to keep.


def test_failed_durable_replay_does_not_abort_the_close_and_the_session_resumes() -> None:
    async def main() -> None:
        storage, session, outlet = backlogged_session(6, max_queued=1, batch_size=1,
                                                      receive_maximum=2)
        db = storage.db(DB)
        # 0 and 1 in flight, 2 queued: the replay waits for room
        await wait_until(lambda: session.outbox.queued_count == 1, "a queued message")
        db.fail_reads = OSError("the disk is gone")
        assert session.outbox.on_puback(1)  # 2 goes out
        assert session.outbox.on_puback(2)  # room: the replay reads, and fails
        await wait_until(lambda: db.failed_reads > 0, "a failed read")
        await session.detach()  # must not raise
        record = record_roundtrip(session)
        unacknowledged = outlet.publishes[2]
        assert unacknowledged.payload == bytes([2])
        assert [(pid, ts) for pid, _key, ts in record.resend] == \
            [(unacknowledged.packet_id, unacknowledged.timestamp)]
        [state] = record.cursors.values()
        assert state.position == outlet.publishes[1].timestamp

        db.fail_reads = None
        session = make_session(storage, durable=True, max_queued=1, batch_size=1)
        session.restore(record)
        again = RecordingOutlet(receive_maximum=2)
        session.attach(again)
        await acknowledge_until(session, again, 4)
        await settle()
        assert [(s.payload, s.dup) for s in again.publishes] == \
            [(bytes([2]), True), *((bytes([n]), False) for n in range(3, 6))]
        assert again.publishes[0].packet_id == unacknowledged.packet_id
        await session.detach()

    run(main())


def test_failed_catch_up_of_a_transient_session_does_not_abort_the_close() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        session = make_session(storage, durable=False, max_queued=1)
        session.subscribe(Subscription("c/#", qos=1))
        outlet = RecordingOutlet(receive_maximum=1)
        session.attach(outlet)
        db.fail_reads = OSError("the disk is gone")
        for payload in (b"1", b"2", b"3"):  # 1 in flight, 2 queued, 3 from storage
            session.replay.on_feed(*db.store("c/x", payload, qos=1))
        await acknowledge_until(session, outlet, 2)  # room: the catch-up reads, and fails
        await wait_until(lambda: db.failed_reads > 0, "a failed read")
        db.fail_reads = None  # the read is retried and succeeds
        await acknowledge_until(session, outlet, 3)
        assert [s.payload for s in outlet.publishes] == [b"1", b"2", b"3"]
        db.fail_reads = OSError("the disk is gone again")
        for payload in (b"4", b"5", b"6"):
            session.replay.on_feed(*db.store("c/x", payload, qos=1))
        await acknowledge_until(session, outlet, 5)
        await wait_until(lambda: db.failed_reads > 1, "another failed read")
        await session.detach()  # must not raise

    run(main())


# -- feed gaps (a site may have missed a shard's messages in its commit feed) --------


def test_a_feed_gap_sends_a_transient_session_to_storage_from_the_gap() -> None:
    """Messages committed after what the site was fed and never fed here reach a
    connected transient session once a gap is declared, each once, in order; what
    came before the gap is not sent again."""
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        session = make_session(storage, durable=False)
        session.subscribe(Subscription("g/#", qos=1, since=1))
        outlet = RecordingOutlet()
        session.attach(outlet)
        stream, fed = db.store("g/x", b"fed", qos=1)
        session.replay.on_feed(stream, fed)
        for payload in (b"missed-1", b"missed-2"):  # committed, never fed here
            db.store("g/x", payload, qos=1)
        db.store("g/y", b"other-shard", qos=1, shard=1)  # the gap is on shard 0
        session.replay.on_feed_gap(0, fed.timestamp + 1)
        for _ in range(3):
            await settle()
            await acknowledge_new(session, outlet)
        assert [s.payload for s in outlet.publishes] == [b"fed", b"missed-1", b"missed-2"]
        later_stream, later = db.store("g/x", b"later", qos=1)
        session.replay.on_feed(later_stream, later)  # the live feed goes on, through the cursor
        await settle()
        await acknowledge_new(session, outlet)
        assert [s.payload for s in outlet.publishes][-1:] == [b"later"]
        assert len(outlet.publishes) == 4
        await session.detach()

    run(main())


def test_a_feed_gap_makes_a_live_durable_cursor_read_storage_again() -> None:
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        session = make_session(storage, durable=True)
        session.subscribe(Subscription("d/#", qos=1))
        session.streams.renew()
        outlet = RecordingOutlet()
        session.attach(outlet)
        stream, first = db.store("d/x", b"first", qos=1)
        session.replay.on_feed(stream, first)
        await settle()
        await acknowledge_new(session, outlet)
        await settle()  # read to the end: the cursor takes the live feed now
        db.store("d/x", b"missed", qos=1)  # committed, never fed here
        await settle()
        assert [s.payload for s in outlet.publishes] == [b"first"]
        session.replay.on_feed_gap(0, first.timestamp + 1)
        await settle()
        await acknowledge_new(session, outlet)
        assert [s.payload for s in outlet.publishes] == [b"first", b"missed"]
        await session.detach()

    run(main())


def test_a_stream_catching_up_is_not_starved_by_streams_on_the_live_feed() -> None:
    """A durable session with a backlog on one stream (read from storage) and a steady
    live feed on others: every stream gets its turn at the queue, so the backlog is
    delivered while the live feed goes on (not only once publishers stop)."""
    async def main() -> None:
        storage = FakeStorage()
        db = storage.db(DB)
        session = make_session(storage, durable=True, max_queued=4, batch_size=2)
        session.subscribe(Subscription("s/#", qos=1))
        outlet = RecordingOutlet(receive_maximum=2)
        session.attach(outlet)
        live_topics = [f"s/live{n}" for n in range(3)]
        for topic in live_topics:  # these streams come first and read to their end
            session.replay.on_feed(*db.store(topic, b"first", qos=1))
        await settle()
        await acknowledge_new(session, outlet)
        await settle()
        backlog = 12
        for n in range(backlog):  # committed while the site did not feed it here
            db.store("s/behind", bytes([n]), qos=1, shard=1)
        session.replay.on_feed_gap(1, 0)
        session.streams.renew()  # the site learned the stream (its periodic look)
        for _round in range(3 * backlog):
            for topic in live_topics:
                session.replay.on_feed(*db.store(topic, b"live", qos=1))
            await settle()
            await acknowledge_new(session, outlet)
            await settle()
        behind = [s.payload for s in outlet.publishes if s.topic == "s/behind"]
        assert behind == [bytes([n]) for n in range(backlog)], \
            f"{len(behind)} of the {backlog} messages behind delivered"
        await session.detach()

    run(main())


def test_an_idle_session_holds_little() -> None:
    """Issue 25: an idle connection's memory, about half of it its session's. The
    session's empty sets held 216 bytes each (an empty dict, used as a set, none):
    3.9 KB of Python allocations per idle session then, 3.5 KB now."""
    async def scenario() -> None:
        storage, saved = FakeStorage(), SavedSessions()
        for durable in (False, True):
            make_session(storage, durable=durable, client_id="first", saved=saved)
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.take_snapshot()
                sessions = [make_session(storage, durable=durable, client_id=f"c{n:05d}",
                                         saved=saved) for n in range(200)]
                gc.collect()
                grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(
                    before, "filename"))
            finally:
                tracemalloc.stop()
            assert len(sessions) == 200
            assert grown / 200 <= 3700, (durable, grown / 200)
    asyncio.run(scenario())


def published_one(outlet: RecordingOutlet) -> bool:
    return len(outlet.publishes) == 1


def test_waiting_replays_share_one_timer_for_their_polls_and_idle_ones_hold_none() -> None:
    """Issue 25: a durable session's replay waited with a timeout of its own (a
    timer, its handle and context: 0.8 KB); its safety-net poll is on the one timer
    of the registry's `Deadlines`, and only while a cursor reads storage (here: the
    queue full, waiting for the client's acknowledgements). A replay caught up, every
    cursor on the live feed, holds no poll: a site polled each of its idle durable
    connections every interval."""
    async def main() -> None:
        storage = FakeStorage()
        for n in range(6):
            storage.db(DB).store("p/x", bytes([n]), qos=1)

        def timers() -> int:
            """Timers armed (a cancelled one waits in the loop's heap until its time)."""
            gc.collect()
            return sum(isinstance(found, asyncio.TimerHandle) and not found.cancelled()
                       for found in gc.get_objects())

        before = timers()
        polls = Deadlines()
        sessions = []
        for n in range(20):
            session = make_session(storage, durable=True, max_queued=2, client_id=f"c{n}",
                                   polls=polls)
            session.subscribe(Subscription("p/#", qos=1))
            outlet = RecordingOutlet(receive_maximum=1)
            session.attach(outlet)
            await wait_until(partial(published_one, outlet), "a PUBLISH")
            sessions.append((session, outlet))
        await settle()
        await asyncio.sleep(0.2)  # the saves asked for by the sends are done
        assert len(polls) == 20  # every replay waiting for room, a cursor on storage
        assert timers() - before <= 1
        for session, outlet in sessions:
            await acknowledge_until(session, outlet, 6)
        await settle()
        await asyncio.sleep(0.2)  # the saves asked for by the acknowledgements are done
        assert len(polls) == 0  # caught up: on the live feed
        for session, _outlet in sessions:
            await session.detach()
        assert len(polls) == 0

    run(main())


def test_a_session_keeps_its_incarnation_in_its_record_and_takes_it_back() -> None:
    """Which session of its client id a session is (its inbound QoS 2 records carry
    it): drawn once, kept in its record, taken back when restored; a record stored
    before incarnations reads as 0."""
    async def main() -> None:
        first = make_session(FakeStorage(), durable=True)
        incarnation = first.incarnation
        assert incarnation > 0 and first.incarnation == incarnation
        assert make_session(FakeStorage(), durable=True).incarnation != incarnation
        record = first.to_record(None)
        head = SessionRecord.head_from_json(record.head_to_json())
        assert record.incarnation == head.incarnation == incarnation
        restored = make_session(FakeStorage(), durable=True)
        restored.restore(head)
        assert restored.incarnation == incarnation
        legacy = record.head_to_json().replace(
            f',"incarnation":{incarnation}'.encode(), b"")
        assert b"incarnation" not in legacy
        assert SessionRecord.head_from_json(legacy).incarnation == 0

    run(main())


def test_a_will_keeps_its_id_in_the_session_record() -> None:
    """The id a will is published with (so a retried publication stores it once) is
    kept with the session; a will stored before ids reads as 0 (published as before)."""
    will = WillRecord("w/t", b"bye", 2, True, MessageProperties(), 5, will_id=77)
    record = SessionRecord("c", 60, will=will)
    assert SessionRecord.head_from_json(record.head_to_json()).will == will
    legacy = record.head_to_json().replace(b',"will_id":77', b"")
    assert b"will_id" not in legacy
    found = SessionRecord.head_from_json(legacy).will
    assert found is not None and found.will_id == 0
