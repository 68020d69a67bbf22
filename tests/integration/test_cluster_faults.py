"""Fault injection with real processes (issue 22, "Tests"; docs/replication.md,
"Tested under faults"; docs/architecture.md, "Guarantees" 1, 2).

Each test runs real `stratamq` site processes and the controller, publishers of
numbered QoS 1 and QoS 2 messages and durable subscribers recording into a `History`,
and ends with the history check (every acknowledged message delivered, QoS 2 once,
order kept) and with every replica of every shard holding the same content (the
digests `stratamq ctl ds verify` compares).

1. Leaders frozen (SIGSTOP) one after the other, each past the failover time and then
   thawed (SIGCONT): the thawed site steps down to follow the new epoch, and
   whatever it held of its old epoch that no majority took is dropped, not committed.
2. Replication factor 3 -> 5 while the joining sites are cut from the shard's leader
   (their peer traffic only, not the controller's): the plan takes the first `+site`
   and waits for it to catch up; writes go on. Then one of the old followers is cut
   from the leader too, which then hears 2 of its 4 replicas: the shard fails over
   to a replica that reaches the others, the joiners catch up from it and the plan
   finishes, all before the cuts are healed.

Figures (failover time, time to the first PUBACK after a freeze, messages acknowledged
meanwhile, how long the plan waited, failed over and finished) are printed; the
assertions leave wide margins for a loaded 2-core machine."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.cluster import DATABASES, DB, Cluster, ctl_ds, poll
from harness.netns import namespaces_unavailable, open_network
from harness.processes import http_json
from harness.waiting import wait_until
from stratamq.broker.core.broker import SESSIONS_DB
from stratamq.broker.ds import DbOptions, DurableStorage, EndOfStream
from stratamq.broker.ds.shard_set import shard_of
from stratamq.broker.session.model import SessionRecord, cursor_key
from stratamq.broker.session.store import SessionStore
from tests.support.history import History, Message, runs_of
from tests.support.recorder import (
    RecordingClient,
    RecordingPublisher,
    RecordingSubscriber,
    all_connected,
    describe_clients,
    more_acknowledged,
    stop_and_drain,
    wait_delivered,
)
from tests.support.shards import client_id_on_shard
from tests.support.storage import run

pytestmark = pytest.mark.cluster

HEARTBEAT = 0.5
WRITE_TIMEOUT = "3s"
# A frozen leader stays frozen this long after its shards failed over: long enough for
# the new leaders to commit in their epoch what it may still hold uncommitted.
FROZEN_AFTER_FAILOVER = 3.0
# How long the joining sites stay cut from the leader before a follower is cut too:
# many of the controller's rounds (a heartbeat each), so an ungated plan would have
# gone on.
JOINER_CUT = 8.0


def acknowledged_by(history: History, names: set[str]) -> int:
    return sum(1 for m in history.acknowledged_messages() if m.publisher in names)


def start_load(cluster: Cluster, history: History, prefix: str, clients: list[RecordingClient],
               site_of: dict[str, int]) -> list[RecordingPublisher]:
    """A durable subscriber to `prefix/#` on every site, then on every site a publisher
    of QoS 1 and QoS 2 messages per shard of `messages`, all connected."""
    subscribers = []
    for site in cluster.sites:
        subscriber = RecordingSubscriber(history, f"{prefix}-sub-{site.index}", site.host,
                                         site.port, f"{prefix}/#")
        subscriber.start()
        subscribers.append(subscriber)
        clients.append(subscriber)
        site_of[subscriber.name] = site.index
    for subscriber in subscribers:
        assert subscriber.subscribed.wait(15), f"no SUBACK for {subscriber.name}"
    publishers = []
    for site in cluster.sites:
        for shard in range(cluster.n_shards):
            name = client_id_on_shard(f"{prefix}-pub-{site.index}", shard, cluster.n_shards)
            publisher = RecordingPublisher(history, name, site.host, site.port,
                                           [f"{prefix}/{name}"], pace=0.005)
            publisher.start()
            publishers.append(publisher)
            clients.append(publisher)
            site_of[name] = site.index
    assert all_connected(clients, 30), f"clients did not connect: {describe_clients(clients)}"
    return publishers


@dataclass(frozen=True)
class StoredAs:
    """A stored message's place: the key of the cursor a session subscribed to the
    filter keeps on its stream, and its timestamp there."""

    cursor: str
    timestamp: int


def stored_at(cluster: Cluster, topic_filter: str) -> dict[int, dict[Message, StoredAs]]:
    """Site index -> the messages its copy of `messages` holds under `topic_filter`,
    each with its stream and timestamp, read from its data folder (the sites must be
    down)."""

    async def read(data_dir: Path) -> dict[Message, StoredAs]:
        storage = DurableStorage(data_dir)
        await storage.open_db(DB, DbOptions(n_shards=cluster.n_shards))
        found: dict[Message, StoredAs] = {}
        try:
            for _rank, stream in storage.get_streams(DB, topic_filter, 0):
                iterator = storage.make_iterator(DB, stream, topic_filter, 0)
                while True:
                    result = await storage.next(DB, iterator, 1000)
                    if isinstance(result, EndOfStream) or not result[1]:
                        break
                    iterator, batch = result
                    for _key, stored in batch:
                        message = Message.decode(stored.payload)
                        if message:
                            found[message] = StoredAs(cursor_key(topic_filter, stream),
                                                      stored.timestamp)
        finally:
            await storage.close()
        return found

    return {site.index: run(read(site.workdir / "data")) for site in cluster.sites}


def session_record(cluster: Cluster, index: int, client_id: str) -> SessionRecord | None:
    """The durable session `client_id` as site `index`'s copy of `sessions` holds it
    (the sites must be down)."""

    async def read(data_dir: Path) -> SessionRecord | None:
        storage = DurableStorage(data_dir)
        sessions = await storage.open_kv_db(SESSIONS_DB, cluster.n_shards)
        messages = await storage.open_db(DB, DbOptions(n_shards=cluster.n_shards))
        try:
            return await SessionStore(sessions, messages).load(client_id)
        finally:
            await storage.close()

    return run(read(cluster.sites[index].workdir / "data"))


def where_cursor(record: SessionRecord | None, stored: StoredAs) -> str:
    """Where the session's cursor on a missing message's stream is: past it (the
    session counts it done: skipped), short of it (not reached), or absent."""
    if record is None:
        return "no session record"
    state = record.cursors.get(stored.cursor)
    if state is None:
        finished = "finished" if stored.cursor in record.done else "not finished"
        return f"no cursor on {stored.cursor} ({finished})"
    resend = [entry for entry in record.resend if entry[1] == stored.cursor
              and entry[2] == stored.timestamp]
    place = ("past it (counted done)" if stored.timestamp <= state.position
             or stored.timestamp in state.done_above else "short of it")
    return (f"timestamp {stored.timestamp}, cursor at {state.position} {place}"
            f"{', in flight' if resend else ''}")


def where_missing(cluster: Cluster, history: History, topic_filter: str,
                  site_of: dict[str, int]) -> str:
    """For the acknowledged messages some session lacks: which sites' copies hold
    them, with each publisher's shard, and where the session's stored cursors are on
    the first few (read once the sites are down)."""
    missing = history.missing()
    if not missing:
        return "nothing missing"
    stored = stored_at(cluster, topic_filter)
    lines = []
    for session, lost in sorted(missing.items()):
        held = {k: len(set(lost) & copy.keys()) for k, copy in stored.items()}
        shards = sorted({shard_of(m.publisher, cluster.n_shards) for m in lost})
        lines.append(f"{session} lacks {len(lost)} (shards {shards}), held by "
                     f"site copies {held}: {runs_of(lost)}")
        client_id = session.rsplit("[", 1)[0]
        home = site_of.get(client_id)
        if home is None:
            continue
        record = session_record(cluster, home, client_id)
        for message in lost[:5]:
            found = stored[home].get(message)
            lines.append(f"  {message}: " + (f"not in site-{home}'s copy" if found is None
                                             else where_cursor(record, found)))
    return "\n".join(lines)


def sessions_at_sites(cluster: Cluster, clients: list[RecordingClient],
                      site_of: dict[str, int]) -> str:
    """What each subscriber's site says of its connection (in flight, queued)."""
    lines = []
    for client in clients:
        if isinstance(client, RecordingSubscriber):
            site = cluster.sites[site_of[client.name]]
            # paho holds a QoS 2 message it received until the PUBREL comes
            awaiting = len(client.client._in_messages)
            try:
                view = http_json("GET", f"{site.admin_url}/api/v1/clients/{client.name}")
                lines.append(f"{view}; QoS 2 awaiting PUBREL at the client: {awaiting}")
            except (OSError, ValueError) as error:
                lines.append(f"{client.name} at site-{site.index}: {error}")
    return "\n".join(lines)


def report_of(cluster: Cluster, index: int, shard: int) -> dict[str, object]:
    return next(s for s in cluster.sites[index].replication()["shards"]
                if s["db"] == DB and s["shard"] == shard)


def acks_grow(history: History, names: set[str], timeout: float) -> bool:
    """One of the publishers `names` gets an acknowledgement within `timeout` seconds."""
    before = acknowledged_by(history, names)
    return wait_until(lambda: acknowledged_by(history, names) > before, timeout, every=0.1)


def freeze_and_thaw(cluster: Cluster, history: History, publishers: list[RecordingPublisher],
                    site_of: dict[str, int], victim: int) -> str:
    """Freeze the site `victim` (SIGSTOP) until its shards of `messages` have new
    leaders and a while more, thaw it (SIGCONT), and check that the shards failed over
    and that it follows their new epochs; the figures."""
    n_shards = cluster.n_shards
    led = sorted(s for s, leader in cluster.leaders().items() if leader == victim)
    assert led, f"site-{victim} leads nothing:\n{cluster.describe()}"
    epochs = cluster.epochs()
    # writers from the other sites to the shards it leads
    affected = {p.name for p in publishers if site_of[p.name] != victim
                and shard_of(p.name, n_shards) in led}
    acked_before = len(history.acknowledged_messages())
    held = {s: report_of(cluster, victim, s)["last"] for s in led}
    site = cluster.sites[victim]
    frozen_at = time.monotonic()
    os.kill(site.pid, signal.SIGSTOP)
    try:
        moved = cluster.wait_leaders_moved(victim, led, 30)
        moved_after = time.monotonic() - frozen_at
        resumed = acks_grow(history, affected, 30)
        resumed_after = time.monotonic() - frozen_at
        time.sleep(FROZEN_AFTER_FAILOVER)
        acked_frozen = len(history.acknowledged_messages()) - acked_before
        new_epochs = cluster.epochs()
        frozen_for = time.monotonic() - frozen_at
    finally:
        os.kill(site.pid, signal.SIGCONT)
    thawed_at = time.monotonic()
    # It takes the new epoch as a follower of every shard it led.
    stepped_down = cluster.wait_ready(30)
    stepped_down_after = time.monotonic() - thawed_at
    after = {s: (report_of(cluster, victim, s)["role"], report_of(cluster, victim, s)["epoch"])
             for s in led}
    figures = (f"site-{victim} (leader of messages/{led} at epochs "
               f"{[epochs[s] for s in led]}, log ends {held}) frozen {frozen_for:.1f}s: new "
               f"leaders after {moved_after:.2f}s at epochs {[new_epochs[s] for s in led]}; "
               f"first PUBACK for those shards from the other sites {resumed_after:.2f}s "
               f"after the freeze; {acked_frozen} messages acknowledged while frozen; "
               f"thawed, it followed the new epochs after {stepped_down_after:.2f}s: {after}")
    print(figures)
    assert moved, f"no failover off frozen site-{victim}:\n{cluster.describe()}"
    assert resumed, f"writes to {led} not acknowledged again: {history.summary()}"
    assert all(new_epochs[s] > epochs[s] for s in led), (epochs, new_epochs)
    assert stepped_down, f"thawed site-{victim} did not step down:\n{cluster.describe()}"
    assert all(role == "follower" and epoch == new_epochs[s]
               for s, (role, epoch) in after.items()), after
    return figures


@pytest.mark.slow
def test_frozen_leaders_are_replaced_and_step_down_when_thawed(tmp_path: Path) -> None:
    sites = 3
    cluster = Cluster(tmp_path, sites, n_shards=2, heartbeat_interval=HEARTBEAT,
                      site_config={"cluster": {"write_timeout": WRITE_TIMEOUT}})
    history = History()
    clients: list[RecordingClient] = []
    site_of: dict[str, int] = {}
    try:
        cluster.start()
        publishers = start_load(cluster, history, "fz", clients, site_of)
        frozen: list[int] = []
        for _ in range(2):
            assert more_acknowledged(history, 100, 30), history.summary()
            # the second freeze takes another site, one that leads shards by then
            victim = max((k for k in range(sites) if k not in frozen),
                         key=list(cluster.leaders().values()).count)
            frozen.append(victim)
            freeze_and_thaw(cluster, history, publishers, site_of, victim)

        assert more_acknowledged(history, 100, 30), history.summary()
        drained = stop_and_drain(publishers, 60)
        delivered = wait_delivered(history)
        subscribers = "" if delivered else sessions_at_sites(cluster, clients, site_of)
        converged = wait_until(cluster.converged, 60, every=0.5)
        same = cluster.same_content(*DATABASES)
        final_state = cluster.describe()
    finally:
        client_state = describe_clients(clients)
        for client in clients:
            client.close()
        alive = [site.alive() for site in cluster.sites]
        cluster.close()
    print(history.summary(), f"\nclients: {client_state}")
    assert all(alive), f"a site died by itself: {alive}"
    assert drained, f"publishers still wait for acknowledgements: {history.summary()}"
    assert delivered, (f"deliveries stopped: {history.summary()}\n{subscribers}\n"
                       f"{where_missing(cluster, history, 'fz/#', site_of)}\n"
                       f"{final_state}")
    assert converged and same, f"replicas differ at the end:\n{final_state}"
    history.check()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["netns", "proxy"])
def test_raising_the_replication_factor_waits_for_a_joiner_cut_from_the_leader(
        tmp_path: Path, kind: str) -> None:
    if kind == "netns" and namespaces_unavailable() is not None:
        pytest.skip(f"no network namespaces here ({namespaces_unavailable()}); the proxy "
                    "variant separates the sites by their peer and admin ports' proxies")
    sites, start_rf = 5, 3
    history = History()
    clients: list[RecordingClient] = []
    site_of: dict[str, int] = {}
    with open_network(sites + 1, force_proxy=kind == "proxy") as network:
        cluster = Cluster(tmp_path, sites, n_shards=1, replication_factor=start_rf,
                          heartbeat_interval=HEARTBEAT, network=network,
                          site_config={"cluster": {"write_timeout": WRITE_TIMEOUT}})
        try:
            cluster.start()
            ids = cluster.site_ids
            leader = cluster.leaders()[0]
            joiners = [k for k in range(sites) if k not in cluster.replicas()[0]]
            publishers = start_load(cluster, history, "rf", clients, site_of)
            assert more_acknowledged(history, 100, 30), history.summary()

            # The joining sites hear nothing from the leader (the controller reaches all).
            network.separate([leader], joiners)
            cluster.controller.kill()
            arguments = cluster.controller.arguments
            arguments[arguments.index("--replication-factor") + 1] = str(sites)
            cluster.controller.start()
            planned = ctl_ds(cluster, "set-replicas", DB, *ids)
            for k in joiners:
                assert f"+{ids[k]}" in planned, planned
            cut_at = time.monotonic()
            acked_at_cut = len(history.acknowledged_messages())
            # The first +site goes (a joiner is up); the catch-up holds the second.
            joined = poll(lambda: len(cluster.replicas()[0]) == start_rf + 1, 30, 0.2)
            time.sleep(JOINER_CUT)
            replicas_in_cut = cluster.replicas()[0]
            plan_in_cut = cluster.controller.storage()["plan"]
            acked_in_cut = len(history.acknowledged_messages()) - acked_at_cut
            waited = time.monotonic() - cut_at

            # Then one of the old followers too: the leader hears 2 of the 4 replicas
            # (itself and the other old follower) and commits nothing; the controller
            # fails the shard over to a replica that reaches the others, which the
            # joiners can catch up from.
            follower = next(k for k in replicas_in_cut if k not in (leader, *joiners))
            network.separate([leader], [follower])
            second_cut_at = time.monotonic()
            acked_at_second_cut = len(history.acknowledged_messages())
            moved = cluster.wait_leaders_moved(leader, [0], 30)
            moved_after = time.monotonic() - second_cut_at
            finished = poll(lambda: not cluster.controller.storage()["plan"]
                            and len(cluster.replicas()[0]) == sites, 60, 0.2)
            finished_after = time.monotonic() - second_cut_at
            # the new leader commits with the cut still there
            goes_on = more_acknowledged(history, 100, 30)
            acked_in_second_cut = len(history.acknowledged_messages()) - acked_at_second_cut
            network.heal()
            ready = cluster.wait_ready(60)

            assert more_acknowledged(history, 100, 30), history.summary()
            drained = stop_and_drain(publishers, 60)
            delivered = wait_delivered(history)
            converged = wait_until(cluster.converged, 60, every=0.5)
            same = cluster.same_content(*DATABASES)
            final_state = cluster.describe()
            logs = cluster.controller.log()
        finally:
            client_state = describe_clients(clients)
            for client in clients:
                client.close()
            alive = [site.alive() for site in cluster.sites]
            cluster.close()
    waits = [line.split("controller: ")[-1] for line in logs.splitlines()
             if f"waiting: {DB}/0:" in line]
    print(f"\n[{kind}] replication factor {start_rf} -> {sites} with joiners {joiners} cut "
          f"from the leader site-{leader}: after {waited:.1f}s cut the shard has replicas "
          f"{replicas_in_cut} (first +site taken: {joined}), plan pending: "
          f"{bool(plan_in_cut)}; {acked_in_cut} messages acknowledged meanwhile")
    print(f"[{kind}] then cut from site-{follower} too: new leader after {moved_after:.1f}s "
          f"({moved}); plan finished {finished_after:.1f}s after that cut ({finished}); "
          f"{acked_in_second_cut} messages acknowledged from that cut until 100 more "
          f"after the plan finished")
    print(f"the controller first noted: {waits[0] if waits else 'no wait'}")
    print(history.summary(), f"\nclients: {client_state}")
    assert all(alive), f"a site died by itself: {alive}"
    assert joined, f"the first +site was not taken:\n{final_state}"
    assert len(replicas_in_cut) == start_rf + 1 and plan_in_cut, \
        f"the plan went past a joiner that cannot catch up: {replicas_in_cut}"
    assert acked_in_cut >= 50, f"only {acked_in_cut} acknowledged in the cut"
    assert moved, f"no failover of a leader that hears 2 of its 4 replicas:\n{final_state}"
    assert finished and ready, f"the plan did not finish under the new leader:\n" \
                               f"{final_state}"
    assert goes_on, f"nothing acknowledged under the new leader: {history.summary()}"
    assert drained, f"publishers still wait for acknowledgements: {history.summary()}"
    assert delivered, f"deliveries stopped: {history.summary()}"
    assert converged and same, f"replicas differ at the end:\n{final_state}"
    history.check()
