"""A shared group whose members have no room, or whose site's feed had a gap, reads
its share from storage (shared/backlog.py, `Backlog` in shared/groups.py): no
QoS 1/2 message is dropped for a slow group, none is lost to a gap, none comes twice.
Driven through the dispatcher's commit feed against the in-memory fake storage and
recording connections of test_session.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from stratamq.broker.core.dispatch import Dispatcher
from stratamq.broker.ds import CookedBatch, Message, Stream
from stratamq.broker.routing.interest import ShareMember
from stratamq.broker.session.model import Subscription
from stratamq.broker.session.session import Session
from stratamq.broker.shared.backlog import SharedBacklog
from stratamq.broker.shared.choice import SiteChoice
from tests.support.fake_storage import FakeDatabase, FakeStorage
from tests.support.storage import run
from tests.unit.test_session import (
    DB,
    RecordingOutlet,
    acknowledge_new,
    dropped_for_full_queue,
    make_session,
    settle,
    wait_until,
)

SHARE = Subscription("t/#", qos=1, share_group="g", since=1)


def a_site(on_interest: Callable[[frozenset[str], dict[str, dict[int, int]]], None]
           | None = None,
           members_with: Callable[[str], Sequence[ShareMember]] | None = None
           ) -> tuple[FakeStorage, FakeDatabase, Dispatcher, SharedBacklog]:
    """The fake storage with its messages database, a dispatcher, and its backlogs."""
    storage = FakeStorage()
    choice = SiteChoice("", members_with)
    backlog = SharedBacklog(storage, DB, choice)
    dispatcher = Dispatcher(choice=choice, backlog=backlog, on_interest=on_interest)
    return storage, storage.db(DB), dispatcher, backlog


def fed(dispatcher: Dispatcher, stream: Stream, message: Message) -> None:
    """The commit feed hands the dispatcher one committed message."""
    dispatcher.on_commit(CookedBatch(stream.shard, stream.generation, message.timestamp, 1,
                                     messages=[(stream.static, message)]))


def member(storage: FakeStorage, dispatcher: Dispatcher, name: str, *, max_queued: int,
           receive_maximum: int) -> tuple[Session, RecordingOutlet]:
    session = make_session(storage, durable=False, max_queued=max_queued, client_id=name,
                           on_shared_loss=dispatcher.on_shared_loss)
    session.subscribe(SHARE)
    outlet = RecordingOutlet(receive_maximum)
    session.attach(outlet)
    dispatcher.route(session, SHARE)
    return session, outlet


def publish(db: FakeDatabase, dispatcher: Dispatcher, payloads: list[bytes], *,
            qos: int = 1, feed: bool = True) -> None:
    for payload in payloads:
        stream, message = db.store("t/x", payload, qos=qos)
        if feed:
            fed(dispatcher, stream, message)


async def acknowledge_all(members: list[tuple[Session, RecordingOutlet]], count: int) -> None:
    """Acknowledge what comes until `count` PUBLISH packets came to the members."""
    async with asyncio.timeout(5):
        while sum(len(outlet.publishes) for _s, outlet in members) < count:
            for session, outlet in members:
                await acknowledge_new(session, outlet)
            await asyncio.sleep(0.01)
        await settle()


def received(members: list[tuple[Session, RecordingOutlet]]) -> list[bytes]:
    return [sent.payload for _s, outlet in members for sent in outlet.publishes]


def test_a_slow_group_reads_what_its_members_had_no_room_for_from_storage() -> None:
    """One member, one message in flight, a queue of 3: of 30 QoS 1 messages, 26 find
    no room. None is dropped: all 30 arrive, once each, in order, and the live feed
    takes over again once the group has caught up."""
    async def main() -> None:
        storage, db, dispatcher, backlog = a_site()
        slow = member(storage, dispatcher, "slow", max_queued=3, receive_maximum=1)
        dropped_before = dropped_for_full_queue()
        sent = [b"m%d" % n for n in range(30)]
        publish(db, dispatcher, sent)
        await acknowledge_all([slow], len(sent))
        assert received([slow]) == sent
        assert dropped_for_full_queue() == dropped_before
        await wait_until(lambda: all(b.caught_up for g in dispatcher.groups
                                     for b in g.backlogs.values()), "caught up")
        publish(db, dispatcher, [b"live"])  # the feed delivers again, past the backlog
        await acknowledge_all([slow], len(sent) + 1)
        assert received([slow]) == [*sent, b"live"]
        assert not any(g.backlogs for g in dispatcher.groups)
        await slow[0].detach()
        await backlog.close()

    run(main())


def test_a_message_fed_while_the_group_reads_storage_comes_once() -> None:
    """Messages fed while the backlog reads are passed by (storage has them); a late
    feed of one storage gave already is passed over."""
    async def main() -> None:
        storage, db, dispatcher, backlog = a_site()
        members = [member(storage, dispatcher, f"m{n}", max_queued=2, receive_maximum=1)
                   for n in range(2)]
        first = [b"a%d" % n for n in range(10)]
        publish(db, dispatcher, first)
        late = db.store("t/x", b"late", qos=1)  # read from storage before it is fed
        await acknowledge_all(members, len(first) + 1)
        fed(dispatcher, *late)
        more = [b"b%d" % n for n in range(10)]
        publish(db, dispatcher, more)
        await acknowledge_all(members, len(first) + 1 + len(more))
        got = received(members)
        assert sorted(got) == sorted([*first, b"late", *more]), got
        for session, _outlet in members:
            await session.detach()
        await backlog.close()

    run(main())


def test_a_feed_gap_delivers_the_groups_missed_share_from_storage() -> None:
    """Messages committed and never fed here (a leader dropped its pushes) reach the
    group once the gap is told, each once; what was fed before it is not sent again,
    and another shard's messages are not read."""
    async def main() -> None:
        storage, db, dispatcher, backlog = a_site()
        only = member(storage, dispatcher, "only", max_queued=100, receive_maximum=100)
        publish(db, dispatcher, [b"fed"])
        last_fed = db.store("t/x", b"fed-2", qos=1)
        fed(dispatcher, *last_fed)
        publish(db, dispatcher, [b"missed-1", b"missed-2"], feed=False)
        db.store("t/y", b"other-shard", qos=1, shard=1)
        dispatcher.on_feed_gap(0, last_fed[1].timestamp + 1)
        await acknowledge_all([only], 4)
        assert received([only]) == [b"fed", b"fed-2", b"missed-1", b"missed-2"]
        await only[0].detach()
        await backlog.close()

    run(main())


def test_a_groups_backlog_goes_with_its_last_member() -> None:
    async def main() -> None:
        storage, db, dispatcher, backlog = a_site()
        session, _outlet = member(storage, dispatcher, "m", max_queued=1, receive_maximum=1)
        publish(db, dispatcher, [b"m%d" % n for n in range(5)])
        assert dispatcher.groups[0].backlogs
        dispatcher.unroute(session, SHARE)
        await settle()
        assert not dispatcher.groups
        await session.detach()
        await backlog.close()  # its reader has ended: nothing left to cancel

    run(main())


def test_a_leaving_members_unacknowledged_messages_wait_for_room_in_the_others() -> None:
    """A member goes with messages in flight while the other member's queue is full:
    they are read again from storage once it has room, none lost."""
    async def main() -> None:
        storage, db, dispatcher, backlog = a_site()
        leaving = member(storage, dispatcher, "leaving", max_queued=100, receive_maximum=5)
        staying = member(storage, dispatcher, "staying", max_queued=2, receive_maximum=1)
        sent = [b"m%d" % n for n in range(8)]
        publish(db, dispatcher, sent)
        held = [s.payload for s in leaving[1].publishes]  # in flight, never acknowledged
        assert held
        await leaving[0].detach()
        dispatcher.unroute(leaving[0], SHARE)
        await acknowledge_all([staying], len(sent) - len(leaving[1].publishes) + len(held))
        assert sorted(received([staying])) == sorted(sent)
        await staying[0].detach()
        await backlog.close()

    run(main())


def test_a_group_that_goes_with_a_backlog_says_where_its_members_stopped() -> None:
    """The last member goes while the group reads a stream from storage: the site
    tells, per shard, the first message its members did not settle (another site
    delivers from there)."""
    async def main() -> None:
        told: list[dict[str, dict[int, int]]] = []
        storage, db, dispatcher, backlog = a_site(
            on_interest=lambda _filters, left: told.append(left))
        only = member(storage, dispatcher, "only", max_queued=1, receive_maximum=1)
        first_unsent = db.store("t/x", b"x", qos=1)[1].timestamp + 1000  # the next one's
        publish(db, dispatcher, [b"a", b"b", b"c"])  # 1 in flight, 1 queued, 1 behind
        await only[0].detach()
        dispatcher.unroute(only[0], SHARE)
        await settle()
        assert told[-1] == {"$share/g/t/#": {0: first_unsent}}, told
        await backlog.close()

    run(main())


def test_a_groups_unsettled_positions_count_what_its_members_have_not_acknowledged() -> None:
    """What a site tells the others all along of a group (`unsettled_from`), so that
    they deliver its share again from there should it die: the first message per
    shard a member has queued or sent without an acknowledgement, not only what the
    group holds or reads from storage."""
    async def scenario() -> None:
        storage, db, dispatcher, _backlog = a_site()
        slow, outlet = member(storage, dispatcher, "slow", max_queued=10, receive_maximum=1)
        sent = [db.store("t/x", payload) for payload in (b"m1", b"m2", b"m3")]
        for stream, message in sent:
            fed(dispatcher, stream, message)
        await settle()
        assert [p.payload for p in outlet.publishes] == [b"m1"]  # m2 and m3 queued
        m1, m2 = sent[0][1].timestamp, sent[1][1].timestamp
        assert dispatcher.shared_unsettled() == {"$share/g/t/#": {0: m1}}
        await acknowledge_new(slow, outlet)
        await settle()
        assert dispatcher.shared_unsettled() == {"$share/g/t/#": {0: m2}}
        await acknowledge_all([(slow, outlet)], 3)
        await acknowledge_new(slow, outlet)  # the last one
        await settle()
        assert dispatcher.shared_unsettled() == {"$share/g/t/#": {}}
    run(scenario())


def test_a_group_whose_members_are_away_waits_for_them_and_only_for_them() -> None:
    """A group stays (absent) while a member that went away keeps its session, so it
    reads what it missed when one comes back; it goes once no member keeps it (memory
    stays bounded), and is not kept here when another site has members (they take
    this site's share on, as when a site leaves a group)."""
    async def scenario() -> None:
        sites: list[ShareMember] = [("", 0)]  # the sites with members: this one
        storage, _db, dispatcher, _backlog = a_site(members_with=lambda _filter: sites)
        a, _ = member(storage, dispatcher, "a", max_queued=10, receive_maximum=5)
        b, _ = member(storage, dispatcher, "b", max_queued=10, receive_maximum=5)
        dispatcher.unroute(a, SHARE, stays_subscribed=True)  # a disconnects
        dispatcher.unroute(b, SHARE)  # b unsubscribes: the group waits for a
        assert sorted(dispatcher.absent) == ["g/t/#"]
        dispatcher.route(a, SHARE)  # a is back
        assert sorted(dispatcher.absent) == []
        dispatcher.unroute(a, SHARE, stays_subscribed=True)
        assert sorted(dispatcher.absent) == ["g/t/#"]
        dispatcher.unroute(a, SHARE)  # a's session ends while away
        assert sorted(dispatcher.absent) == []

        sites.append(("other", 0))  # another site has members too
        dispatcher.route(a, SHARE)
        dispatcher.unroute(a, SHARE, stays_subscribed=True)
        assert sorted(dispatcher.absent) == []
    run(scenario())


def test_the_dispatcher_wants_committed_messages_only_while_someone_subscribes() -> None:
    """A site's commit feed decodes a replica's batches for the dispatcher only while
    some session or group here subscribes (`Dispatcher.wants`)."""
    async def scenario() -> None:
        storage, _db, dispatcher, _backlog = a_site()
        assert not dispatcher.wants(0)
        a, _ = member(storage, dispatcher, "a", max_queued=10, receive_maximum=5)
        assert dispatcher.wants(0) and dispatcher.wants(3)
        dispatcher.unroute(a, SHARE)
        assert not dispatcher.wants(0)
    run(scenario())
