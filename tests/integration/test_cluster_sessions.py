"""Sessions and retained messages across the sites of a cluster (issue 7): a durable
session moves to another site and resumes there as it would on one site; a client id
taken over on another site closes the old connection with 0x8E (Session taken over)
and the old owner's late writes are refused; a session stays whole when the leader
of its `sessions` shard is killed while it moves; retained messages set on one site
are read (and deleted) on the others. Real site and controller processes
(harness/cluster.py), paho clients, the history checker where messages flow."""

from __future__ import annotations

import os
import signal
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from harness.cluster import DATABASES, Cluster, SiteProcess, ctl_ds, poll
from harness.netns import open_network
from harness.processes import HOST
from harness.waiting import wait_until
from stratamq.broker.mqtt import Disconnect, Suback, Subscribe, SubscriptionOptions, Will
from stratamq.broker.mqtt import Properties as WireProperties
from tests.support.clients import PahoClient, RawClient, paho_properties, unique
from tests.support.history import History, Message
from tests.support.recorder import (
    SESSION_EXPIRY,
    RecordingPublisher,
    RecordingSubscriber,
    stop_and_drain,
)

pytestmark = pytest.mark.cluster

N_SHARDS = 4
WAIT = 60.0  # generous: four processes share two cores with other tests
SESSION_TAKEN_OVER = 0x8E
SERVER_BUSY = 0x89


def shard_of(client_id: str) -> int:
    """The shard of a client id (the broker's `ds.shard_of`)."""
    return zlib.crc32(client_id.encode()) % N_SHARDS


def client_id_where(prefix: str, condition: Callable[[int], bool]) -> str:
    """A fresh client id whose shard satisfies `condition(shard)`."""
    for _ in range(10_000):
        candidate = unique(prefix)
        if condition(shard_of(candidate)):
            return candidate
    raise AssertionError(f"no client id for {prefix} found")


@pytest.fixture(params=[3, 1], ids=["rf3", "rf1"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path, sites=3, n_shards=N_SHARDS,
                      replication_factor=request.param)
    try:
        running.start(timeout=WAIT)
        yield running
    finally:
        running.close()


@pytest.fixture
def cluster_rf3(tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path, sites=3, n_shards=N_SHARDS, replication_factor=3)
    try:
        running.start(timeout=WAIT)
        yield running
    finally:
        running.close()


def move(subscriber: RecordingSubscriber, cluster: Cluster, index: int) -> None:
    """Connect the same paho client (its session state kept: clean start false) to
    site `index`."""
    site = cluster.sites[index]
    subscriber.client.connect_async(site.host, site.port, keepalive=10, clean_start=False,
                                    properties=subscriber_properties())
    subscriber.client.loop_start()


def subscriber_properties() -> Properties:
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.SessionExpiryInterval = SESSION_EXPIRY
    return properties


def leave(subscriber: RecordingSubscriber) -> None:
    subscriber.client.disconnect()
    subscriber.client.loop_stop()


def all_delivered(history: History) -> bool:
    return not any(history.missing().values())


def test_a_durable_session_moves_to_another_site(cluster: Cluster) -> None:
    """Subscribed on site 0, disconnected, messages published on site 1, resumed on
    site 2 (clean start false): every acknowledged message arrives, QoS 2 once, in
    order. With replication factor 1 the session's `sessions` shard lives on site 1
    (so both sites read and write it remotely) and the publisher's messages shard on
    site 2 (a site replays streams it holds: remote stream reads are not built)."""
    rf1 = len(cluster.replicas()[0]) == 1
    sessions_on = cluster.replicas("sessions")
    messages_on = cluster.replicas()
    name = client_id_where("mover", lambda shard: not rf1 or sessions_on[shard] == [1])
    publisher_id = client_id_where("pub", lambda shard: not rf1 or messages_on[shard] == [2])
    history = History()
    prefix = unique("move")
    site0, site1 = cluster.sites[0], cluster.sites[1]
    subscriber = RecordingSubscriber(history, name, site0.host, site0.port, f"{prefix}/#")
    publishers: list[RecordingPublisher] = []
    try:
        subscriber.start()
        assert subscriber.subscribed.wait(WAIT), "no SUBACK on site 0"
        if not rf1:  # live on site 0 first: its positions move with the session
            live = RecordingPublisher(history, unique("pub-live"), site1.host, site1.port,
                                      [f"{prefix}/live"])
            publishers.append(live)
            live.start()
            assert wait_until(lambda: len(history.acknowledged_messages()) >= 40, WAIT)
            assert stop_and_drain([live], WAIT)
            assert wait_until(lambda: all_delivered(history), WAIT), history.summary()
        leave(subscriber)

        offline = RecordingPublisher(history, publisher_id, site1.host, site1.port,
                                     [f"{prefix}/a", f"{prefix}/b"])
        publishers.append(offline)
        offline.start()
        assert wait_until(lambda: len(offline_acked(history, publisher_id)) >= 60, WAIT)
        assert stop_and_drain([offline], WAIT)

        move(subscriber, cluster, 2)
        assert wait_until(lambda: all_delivered(history), WAIT), (
            f"{history.summary()}\n{cluster.logs()}")
        assert subscriber.connects == 2
        time.sleep(1.0)  # room for a duplicate to show up (the check counts them)
        history.check()
        print(f"\nmoved {name} from site 0 to site 2: {history.summary()}")
    finally:
        for publisher in publishers:
            publisher.close()
        subscriber.close()


def offline_acked(history: History, publisher: str) -> list[Message]:
    return [m for m in history.acknowledged_messages() if m.publisher == publisher]


def test_a_client_id_taken_over_on_another_site(cluster_rf3: Cluster) -> None:
    """Connected on site 0, then on site 1: site 0 closes the first connection with
    0x8E. Then, with site 0 frozen (SIGSTOP) so that it hears nothing of a second
    takeover, the client id moves on to site 2 behind its back; thawed, site 0's
    connection writes the session (a SUBSCRIBE) with its old owner epoch: the
    `sessions` shard's leader refuses it, site 0 drops its copy and closes that
    connection with 0x8E too, and the session site 2 holds never has that
    subscription."""
    cluster = cluster_rf3
    sessions_leaders = cluster.leaders("sessions")
    messages_leaders = cluster.leaders()
    # the client's shards led by site 1 or 2, so a frozen site 0 holds no write up
    name = client_id_where("owned", lambda shard: sessions_leaders[shard] != 0
                           and messages_leaders[shard] != 0)
    site0, site1, site2 = cluster.sites
    expiry = subscriber_properties()
    first = PahoClient(site0.port, name, host=site0.host)
    second = PahoClient(site1.port, name, host=site1.host)
    third = PahoClient(site2.port, name, host=site2.host)
    again = PahoClient(site0.port, name, host=site0.host)
    topic = unique("owned")
    try:
        assert first.connect(clean_start=False, properties=expiry).reason_code == 0
        assert first.subscribe(f"{topic}/kept", qos=1) == [1]
        assert second.connect(clean_start=False, properties=expiry) \
            .session_present is True
        assert first.wait_disconnected(WAIT) == SESSION_TAKEN_OVER

        # site 1 -> site 0 once more, then site 0 frozen while site 2 takes it over
        assert again.connect(clean_start=False, properties=expiry).session_present is True
        assert second.wait_disconnected(WAIT) == SESSION_TAKEN_OVER
        assert site0.alive()
        os.kill(site0.pid, signal.SIGSTOP)
        try:
            # the release request to site 0 times out (cluster.write_timeout); the
            # claim goes ahead on the shard's leader
            third.client.connect(site2.host, site2.port, clean_start=False,
                                 properties=expiry)
            third.client.loop_start()
            connack = third.connacks.get(timeout=WAIT)
            assert connack.reason_code == 0 and connack.session_present
        finally:
            os.kill(site0.pid, signal.SIGCONT)
        # site 0 still believes it owns the session: its write is refused
        again.client.subscribe(f"{topic}/late", qos=1)
        assert again.wait_disconnected(WAIT) == SESSION_TAKEN_OVER
        assert poll(lambda: "taken over by another site" in site0.log(), WAIT)

        # what site 2 holds: the subscription made on site 0 before, not the late one
        assert third.publish(f"{topic}/kept", b"kept", qos=1) == 0
        assert third.publish(f"{topic}/late", b"late", qos=1) == 0
        got = third.expect(1, timeout=WAIT)
        assert [(m.topic, m.payload) for m in got] == [(f"{topic}/kept", b"kept")]
        third.quiet()
    finally:
        for client in (first, second, third, again):
            client.stop()


def test_a_session_stays_whole_when_its_shard_leader_is_killed_as_it_moves(
        cluster_rf3: Cluster) -> None:
    """The `sessions` shard of a durable session is led by site 1; the session moves
    from site 0 to site 2 and site 1 is killed with -9 right as it does (its client
    retries until the shard has a new leader), then started again. Every message
    acknowledged while the session was away arrives, QoS 2 once, in order."""
    cluster = cluster_rf3
    leaders = cluster.leaders("sessions")
    name = client_id_where("whole", lambda shard: leaders[shard] == 1)
    history = History()
    prefix = unique("whole")
    site0 = cluster.sites[0]
    subscriber = RecordingSubscriber(history, name, site0.host, site0.port, f"{prefix}/#")
    publisher = RecordingPublisher(history, unique("pub"), site0.host, site0.port,
                                   [f"{prefix}/a", f"{prefix}/b"])
    try:
        subscriber.start()
        assert subscriber.subscribed.wait(WAIT)
        publisher.start()
        assert wait_until(lambda: len(history.acknowledged_messages()) >= 30, WAIT)
        leave(subscriber)
        assert wait_until(lambda: len(history.acknowledged_messages()) >= 80, WAIT)
        assert stop_and_drain([publisher], WAIT)

        move(subscriber, cluster, 2)
        assert cluster.sites[1].alive()
        os.kill(cluster.sites[1].pid, signal.SIGKILL)
        assert wait_until(lambda: all_delivered(history), WAIT), (
            f"{history.summary()}\n{cluster.logs()}")
        cluster.restart(1)
        assert cluster.wait_ready(WAIT)
        time.sleep(1.0)  # room for a duplicate to show up
        history.check()
        print(f"\n{name} moved while its shard's leader died: {history.summary()}")
    finally:
        publisher.close()
        subscriber.close()


def test_retained_messages_are_cluster_wide(tmp_path: Path) -> None:
    """Replication factor 1: each `retained` shard lives on one site, so most reads
    are of shards held elsewhere. Set on site 0, read on sites 1 and 2 (by topic name
    and by wildcard); deleted on site 1, gone everywhere."""
    cluster = Cluster(tmp_path, sites=3, n_shards=N_SHARDS, replication_factor=1)
    clients: list[PahoClient] = []
    try:
        cluster.start(timeout=WAIT)
        assert {site for sites in cluster.replicas("retained").values()
                for site in sites} == {0, 1, 2} or N_SHARDS < 3
        prefix = unique("kept")
        topics = [f"{prefix}/{number}" for number in range(12)]
        setter = PahoClient(cluster.sites[0].port, unique("setter"),
                            host=cluster.sites[0].host)
        clients.append(setter)
        assert setter.connect().reason_code == 0
        for topic in topics:
            assert setter.publish(topic, topic.encode(), qos=1, retain=True) == 0

        def retained_on(index: int, topic_filter: str, count: int) -> set[bytes]:
            reader = PahoClient(cluster.sites[index].port, unique("reader"),
                                host=cluster.sites[index].host)
            clients.append(reader)
            assert reader.connect().reason_code == 0
            assert reader.subscribe(topic_filter, qos=1) == [1]
            got = {bytes(m.payload) for m in reader.expect(count, timeout=WAIT)}
            reader.quiet()
            reader.stop()
            return got

        for index in (1, 2):
            assert retained_on(index, f"{prefix}/#", len(topics)) == \
                {topic.encode() for topic in topics}
            assert retained_on(index, topics[3], 1) == {topics[3].encode()}
            assert retained_on(index, f"{prefix}/+", len(topics)) == \
                {topic.encode() for topic in topics}

        deleter = PahoClient(cluster.sites[1].port, unique("deleter"),
                             host=cluster.sites[1].host)
        clients.append(deleter)
        assert deleter.connect().reason_code == 0
        assert deleter.publish(topics[0], b"", qos=1, retain=True) == 0
        for index in (0, 2):
            assert retained_on(index, f"{prefix}/#", len(topics) - 1) == \
                {topic.encode() for topic in topics[1:]}
            assert retained_on(index, topics[0], 0) == set()
    finally:
        for client in clients:
            client.stop()
        cluster.close()


@pytest.mark.slow
def test_the_sessions_of_a_forgotten_site_expire_and_publish_their_wills(
        tmp_path: Path) -> None:
    """A client's site is killed and never comes back: its replicas are moved off
    (`ctl ds leave`) and it is forgotten (`ctl ds forget`). Another site adopts the
    client's stored session: its will is published and, once its expiry has passed,
    the session is gone."""
    expiry = 3
    cluster = Cluster(tmp_path, sites=3, n_shards=N_SHARDS, replication_factor=2,
                      site_config={"durable_sessions": {"session_gc_interval": "1s"}})
    watcher = lost = None
    try:
        cluster.start(timeout=WAIT)
        first, gone = cluster.sites[0], cluster.sites[2]
        watcher = PahoClient(first.port, unique("watcher"), host=first.host)
        assert watcher.connect().reason_code == 0
        assert watcher.subscribe("gone/#", 1) == [1]
        client_id = unique("lost")
        lost = PahoClient(gone.port, client_id, host=gone.host)
        lost.client.will_set(f"gone/{client_id}", b"site lost", 1)
        assert lost.connect(clean_start=False, properties=paho_properties(
            PacketTypes.CONNECT, SessionExpiryInterval=expiry)).reason_code == 0

        gone_id = cluster.site_ids[gone.index]
        gone.kill()
        for db in DATABASES:
            ctl_ds(cluster, "leave", db, gone_id)
        assert poll(lambda: all(gone.index not in replicas for db in DATABASES
                                for replicas in cluster.replicas(db).values()), WAIT), \
            cluster.describe()
        ctl_ds(cluster, "forget", gone_id)
        assert poll(lambda: all(gone_id in site.replication()["forgotten"]
                                for site in cluster.sites[:2]), WAIT)

        [will] = watcher.expect(1, timeout=WAIT)
        assert (will.topic, will.payload) == (f"gone/{client_id}", b"site lost")
        expired = f"stored session of {client_id!r} expired"
        assert poll(lambda: any(expired in site.log() for site in cluster.sites[:2]),
                    WAIT), cluster.logs()
        back = PahoClient(first.port, client_id, host=first.host)
        connack = back.connect(clean_start=False)
        back.disconnect()
        assert connack.session_present is False
    finally:
        for client in (watcher, lost):
            if client is not None:
                client.client.loop_stop()
        cluster.close()


def saved_away(site: SiteProcess) -> set[str]:
    """The members away that the site's stored records of its shared groups name."""
    return {client for group in site.shared_groups() for client in group["saved_away"] or []}


def leave_site0(cluster: Cluster, member: PahoClient, left_site: str) -> None:
    """The member on site 0 goes: it disconnects, or site 0 is killed with -9 and the
    cluster gets over it (new leaders everywhere, and site 1 no longer counts site 0's
    member: there is nobody left to take what site 0 had not settled
    (shared/replay.py) when the member comes back)."""
    if left_site == "running":
        member.disconnect()
    else:
        cluster.sites[0].kill()
        assert all(cluster.wait_leaders_moved(0, list(range(N_SHARDS)), WAIT, db)
                   for db in DATABASES), cluster.describe()
        gone = cluster.site_ids[0]
        assert wait_until(lambda: gone not in cluster.sites[1].replication().get(
            "interest", {}), WAIT), cluster.sites[1].replication()
    member.stop()


@pytest.mark.parametrize("left_site", ["running", "killed"])
def test_a_shared_groups_messages_follow_its_member_to_another_site(
        cluster_rf3: Cluster, left_site: str) -> None:
    """The only member of a shared group, on site 0, with receive maximum 1 holds one
    message unacknowledged and has the rest queued when it goes (it disconnects, or
    site 0 is killed with -9). More are published on site 1 while it is away. It
    comes back on site 1: the group's positions moved with its session (read from
    site 0's record in the replicated `sessions` database), so it gets all 40, at
    least once. (A group used to start again from the live feed on a site it had not
    been on: the 39 held or published while it was away were lost.)"""
    cluster = cluster_rf3
    topic = unique("follow")
    client_id = unique("member")
    keep_session = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=3600,
                                   ReceiveMaximum=1)
    site0, site1 = cluster.sites[0], cluster.sites[1]
    member = PahoClient(site0.port, client_id, host=site0.host, manual_ack=True)
    publisher = PahoClient(site1.port, unique("pub"), host=site1.host)
    back = PahoClient(site1.port, client_id, host=site1.host)
    try:
        assert member.connect(clean_start=False, properties=keep_session).reason_code == 0
        assert member.subscribe(f"$share/g/{topic}/#", 1) == [1]
        assert publisher.connect().reason_code == 0
        for number in range(20):
            assert publisher.publish(f"{topic}/{number % 3}", b"%d" % number, 1) == 0
        first = member.expect(1, timeout=WAIT)[0]  # never acknowledged
        # once site 0 has stored the group with this member: any position saved since
        # it subscribed is at or before its first message
        assert wait_until(lambda: client_id in saved_away(site0), WAIT), site0.shared_groups()
        leave_site0(cluster, member, left_site)
        for number in range(20, 40):
            assert publisher.publish(f"{topic}/{number % 3}", b"%d" % number, 1) == 0

        connack = back.connect(clean_start=False, properties=keep_session)
        assert (connack.reason_code, connack.session_present) == (0, True)
        got = [int(message.payload) for message in back.expect(40, timeout=WAIT)]
        assert sorted(got) == list(range(40)), (int(first.payload), got)
    finally:
        for client in (member, publisher, back):
            client.stop()


@pytest.mark.parametrize("left_site", ["running", "killed"])
def test_a_member_that_goes_right_after_its_suback_takes_its_group_along(
        cluster_rf3: Cluster, left_site: str) -> None:
    """Site 0 stores a durable member's shared group before it answers the SUBSCRIBE.
    So the member can go at once (before the periodic save), and still finds the
    group on site 1 with what was published while it was away. (Without that save,
    nothing named it: the group started from the live feed on site 1, and the 20
    messages were lost.)"""
    cluster = cluster_rf3
    topic = unique("at-once")
    client_id = unique("member")
    keep_session = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=3600)
    site0, site1 = cluster.sites[0], cluster.sites[1]
    member = PahoClient(site0.port, client_id, host=site0.host)
    publisher = PahoClient(site1.port, unique("pub"), host=site1.host)
    back = PahoClient(site1.port, client_id, host=site1.host)
    try:
        assert member.connect(clean_start=False, properties=keep_session).reason_code == 0
        assert member.subscribe(f"$share/g/{topic}/#", 1) == [1]
        leave_site0(cluster, member, left_site)
        assert publisher.connect().reason_code == 0
        for number in range(20):
            assert publisher.publish(f"{topic}/{number % 3}", b"%d" % number, 1) == 0

        connack = back.connect(clean_start=False, properties=keep_session)
        assert (connack.reason_code, connack.session_present) == (0, True)
        got = [int(message.payload) for message in back.expect(20, timeout=WAIT)]
        assert sorted(got) == list(range(20)), got
    finally:
        for client in (member, publisher, back):
            client.stop()


def test_no_suback_for_a_durable_member_before_its_group_is_stored(tmp_path: Path) -> None:
    """Replication factor 1 on two sites; site 1 is killed and site 0 restarted: site 0
    cannot read the `sessions` shards site 1 holds, so its first load of its shared
    groups' positions fails (again and again), while a durable member whose session
    and group are in shards site 0 holds can connect. Its SUBSCRIBE waits for that
    load, and as the load cannot be done, its connection is closed unanswered, with
    0x89 Server busy and a line in the log (the client tries again): a SUBACK
    must not go out while the group is not stored (a killed site then loses it).
    Once site 1 is back, the SUBACK comes with the group stored. (Before, the SUBACK
    came at once and nothing was stored until the load succeeded: the race of
    test_a_member_that_goes_right_after_its_suback_takes_its_group_along[killed]
    when site 0's first load had failed.)"""
    cluster = Cluster(tmp_path, sites=2, n_shards=N_SHARDS, replication_factor=1,
                      site_config={"cluster": {"write_timeout": "2s"}})
    member = raw = None
    try:
        cluster.start(timeout=WAIT)
        on_site0 = [shard for shard, sites in cluster.replicas("sessions").items()
                    if sites == [0]]
        client_id = client_id_where("member", lambda shard: shard in on_site0)
        topic = unique("joined")
        while shard_of(f"g/{topic}/#") not in on_site0:  # the group's record there too
            topic = unique("joined")
        group_filter = f"$share/g/{topic}/#"
        site0, site1 = cluster.sites
        site1.kill()
        site0.kill()
        cluster.restart(0)
        assert cluster.wait_ready(WAIT, sites=[0]), cluster.describe()
        assert poll(lambda: "shared groups' positions not read yet" in site0.log(), WAIT)

        assert site0.host == HOST  # where RawClient connects
        raw = RawClient(site0.port)
        assert raw.connect(client_id, clean_start=False, properties=WireProperties(
            session_expiry_interval=SESSION_EXPIRY)).reason_code == 0
        raw.send(Subscribe(1, [(group_filter, SubscriptionOptions(1))], WireProperties()))
        answer = raw.recv(WAIT)
        assert not isinstance(answer, Suback), (
            f"SUBACK {answer}; group stored: {client_id in saved_away(site0)}")
        assert isinstance(answer, Disconnect) and answer.reason_code == SERVER_BUSY, \
            answer
        assert client_id not in saved_away(site0)
        # expected while a site cannot read its storage: said in a line, no traceback
        assert site0.log().count("Traceback") == 0, site0.log_tail()

        cluster.restart(1)
        assert cluster.wait_ready(WAIT), cluster.describe()
        member = PahoClient(site0.port, client_id, host=site0.host)
        assert member.connect(clean_start=False, properties=subscriber_properties()) \
            .reason_code == 0
        assert member.subscribe(group_filter, 1) == [1]
        assert client_id in saved_away(site0)  # stored before the SUBACK
    finally:
        if raw is not None:
            raw.close()
        if member is not None:
            member.stop()
        cluster.close()


def test_a_site_waiting_for_its_placement_logs_no_traceback(tmp_path: Path) -> None:
    """A site of a cluster whose controller has not placed the shards yet: its storage
    reads time out, an expected, passing state. Its background work (session GC,
    shared groups' positions) says so in a line each and tries again; no traceback
    (the initial session GC pass logged one)."""
    site = SiteProcess(tmp_path, 0, HOST, n_shards=N_SHARDS, heartbeat_interval=0.5,
                       config={"cluster": {"write_timeout": "500ms"}})
    try:
        site.start()
        # two load attempts failed: the GC pass started with the first has failed too
        assert poll(lambda: site.log().count("shared groups' positions not read yet") >= 2,
                    WAIT), site.log_tail()
        assert site.log().count("Traceback") == 0, site.log_tail()
        assert "session GC pass not done" in site.log(), site.log_tail()
    finally:
        site.kill()


def test_a_session_closed_while_its_site_is_cut_off_still_expires(tmp_path: Path) -> None:
    """A durable session whose connection ends while its site reaches no other site:
    the write of its state fails (`write_timeout`). The site says so in a line,
    writes it once it can, and still expires the session after its expiry interval
    and publishes its will: it used to raise out of the connection (a traceback)
    before it set either timer, keeping the session for ever, so a reconnect found
    it present, and dropping the will."""
    expiry = 2
    with open_network(4) as network:
        cluster = Cluster(tmp_path, sites=3, n_shards=N_SHARDS, network=network,
                          site_config={"cluster": {"write_timeout": "1s"}})
        try:
            cluster.start(timeout=WAIT)
            site = cluster.sites[0]
            watcher = PahoClient(cluster.sites[1].port, unique("watch"),
                                 host=cluster.sites[1].host)
            assert watcher.connect().reason_code == 0
            will_topic = unique("cut-will")
            assert watcher.subscribe(will_topic, 1) == [1]
            client_id = unique("cut")
            client = RawClient(site.port, host=site.host)
            connack = client.connect(
                client_id, clean_start=False,
                properties=WireProperties(session_expiry_interval=expiry),
                will=Will(will_topic, b"gone", 1))
            assert (connack.reason_code, connack.session_present) == (0, False)
            network.cut(0)
            client.close()  # no DISCONNECT: the will is due
            # the write of the closed session's state gives up after write_timeout
            assert poll(lambda: "state not stored" in site.log()
                        or "Unhandled exception" in site.log(), WAIT), site.log_tail()
            network.heal(0)
            assert cluster.wait_ready(WAIT), cluster.describe()
            assert [m.payload for m in watcher.expect(1, WAIT)] == [b"gone"]
            time.sleep(expiry + 1)
            again = RawClient(site.port, host=site.host)
            connack = again.connect(client_id, clean_start=False)
            assert (connack.reason_code, connack.session_present) == (0, False), \
                "an expired session was resumed"
            again.disconnect()
            watcher.stop()
            assert "Unhandled exception" not in site.log(), site.log_tail()
        finally:
            cluster.close()
