"""The outbox alone (broker/session/outbox.py): packet identifiers, the order of
resends and PUBRELs, and the writes sends wait for. No storage and no session: the
outbox needs neither, only a connection (the recording one of test_session)."""

from __future__ import annotations

import asyncio

from stratamq.broker.ds import Message
from stratamq.broker.session.outbox import MAX_PACKET_ID, Delivery, Outbox
from tests.support.storage import run
from tests.unit.test_session import RecordingOutlet, settle


class Writes:
    """The session's writes as the outbox sees them: `save` waits on `gate`."""

    def __init__(self) -> None:
        self.saved = 0
        self.requested = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def save(self) -> None:
        await self.gate.wait()
        self.saved += 1

    def request(self) -> None:
        self.requested += 1


def an_outbox(writes: Writes, *, durable: bool, max_queued: int = 100
              ) -> tuple[Outbox, list[Delivery]]:
    finished: list[Delivery] = []
    outbox = Outbox(max_queued, save=writes.save, request_save=writes.request,
                    finished=finished.append, room=lambda: None, durable=lambda: durable)
    return outbox, finished


def delivery(n: int, qos: int) -> Delivery:
    return Delivery(Message("t", bytes([n % 256]), qos=qos, timestamp=n + 1), qos, False)


def test_packet_ids_wrap_and_a_reattach_resends_in_first_sent_order() -> None:
    """A connection that lives long goes past packet identifier 65535 and starts
    again from 1: what is in flight then goes out again in the order it was first
    sent (MQTT-4.6.0-1), 65535 before 1, not sorted."""
    async def main() -> None:
        outbox, _finished = an_outbox(Writes(), durable=False)
        first = RecordingOutlet(receive_maximum=3)
        outbox.attach(first)
        for n in range(MAX_PACKET_ID - 1):  # each acknowledged: ids 1..65534 used
            outbox.enqueue(delivery(n, 1))
            assert outbox.on_puback(first.sent[-1].packet_id or 0)
        for n in range(3):
            outbox.enqueue(delivery(MAX_PACKET_ID + n, 1))
        assert [s.packet_id for s in first.sent[-3:]] == [MAX_PACKET_ID, 1, 2]
        outbox.disconnect()
        assert outbox.drop() == []  # a transient session keeps what is in flight
        second = RecordingOutlet(receive_maximum=3)
        outbox.attach(second)
        assert [(s.packet_id, s.dup) for s in second.sent] == \
            [(MAX_PACKET_ID, True), (1, True), (2, True)]

    run(main())


def test_pubrels_follow_pubrec_order_on_a_reattach() -> None:
    async def main() -> None:
        outbox, _finished = an_outbox(Writes(), durable=False)
        first = RecordingOutlet()
        outbox.attach(first)
        for n in range(3):
            outbox.enqueue(delivery(n, 2))
        for packet_id in (2, 3, 1):
            assert await outbox.on_pubrec(packet_id, failed=False)
        assert first.pubrels == [2, 3, 1]
        outbox.disconnect()
        second = RecordingOutlet()
        outbox.attach(second)
        assert second.pubrels == [2, 3, 1]

    run(main())


def test_a_durable_pubrel_waits_for_the_write_and_one_write_covers_several() -> None:
    """PUBRECs that come while a write is under way share the next write; each PUBREL
    goes out only once a write after its PUBREC is done."""
    async def main() -> None:
        writes = Writes()
        outbox, finished = an_outbox(writes, durable=True)
        outlet = RecordingOutlet()
        outbox.attach(outlet)
        for n in range(3):
            outbox.enqueue(delivery(n, 2))
        writes.gate.clear()
        for packet_id in (1, 2, 3):
            assert await outbox.on_pubrec(packet_id, failed=False)
        await settle()
        assert outlet.pubrels == [] and len(finished) == 3
        writes.gate.set()
        await settle()
        assert outlet.pubrels == [1, 2, 3]
        assert writes.saved <= 2  # the first PUBREC's write, and one for the others
        assert outbox.pubrel_pending() == [1, 2, 3]
        for packet_id in (1, 2, 3):
            assert outbox.on_pubcomp(packet_id)
        assert outbox.pubrel_pending() == [] and outbox.in_flight_count == 0

    run(main())


def test_a_full_queue_drops_live_qos0_first_and_counts_room_for_the_replay() -> None:
    async def main() -> None:
        outbox, _finished = an_outbox(Writes(), durable=False, max_queued=4)
        outlet = RecordingOutlet(receive_maximum=1)
        outbox.attach(outlet)
        outbox.enqueue(delivery(0, 1))  # in flight: the window is full from here
        for n in range(1, 5):
            outbox.enqueue(delivery(n, 0 if n == 2 else 1))  # one QoS 0 behind a QoS 1
        assert outbox.queued_count == 4 and not outbox.has_room
        assert not outbox.has_room_for_backlog  # the replay reads below half
        outbox.enqueue(delivery(5, 1))  # the queued QoS 0 message makes room
        assert [d.message.payload for d in outbox.pending()][:5] == \
            [bytes([n]) for n in (1, 3, 4, 5, 0)]

    run(main())



def test_outboxes_that_never_queued_share_nothing_once_they_do() -> None:
    """Idle outboxes start on one shared empty queue (no deque each): the first
    delivery gives an outbox a queue of its own, and the others stay empty."""
    async def main() -> None:
        (first, _), (second, _), (idle, _) = (an_outbox(Writes(), durable=False)
                                              for _ in range(3))
        first.enqueue(delivery(1, 1))  # no connection: they stay queued
        second.enqueue(delivery(2, 1))
        second.enqueue(delivery(3, 1))
        assert [d.message.timestamp for d in first.pending()] == [2]
        assert [d.message.timestamp for d in second.pending()] == [3, 4]
        assert idle.queued_count == 0 and list(idle.pending()) == []
    run(main())
