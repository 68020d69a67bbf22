"""A partition with real network separation (issue 7, "Partitions"; docs/architecture.md
"Guarantees" 1).

Three sites and the controller, each in its own network namespace
(harness/netns.py), or, where namespaces cannot be made (and here too, forced,
as the `proxy` variant), each on its own loopback address with the peer and admin
ports behind proxies that refuse connections by source address: every site's peer
client and the controller's client connect from their own address. Publishers and
durable subscribers on every site. The site that leads the most shards is cut off from
the other sites and the controller (the test still reaches it): while cut, it
acknowledges none of the messages handed to its publisher after the cut; the majority
gets new leaders and goes on acknowledging.
After healing, the old leader takes the role the controller gives it, all replicas
end at the same log position, committed and applied, and the history check passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.cluster import Cluster
from harness.netns import namespaces_unavailable, open_network
from harness.waiting import wait_until
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

pytestmark = pytest.mark.cluster

SITES = 3
WRITE_TIMEOUT = "3s"



def acknowledged_by(history: History, publisher: str) -> set[Message]:
    return {m for m in history.acknowledged_messages() if m.publisher == publisher}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["netns", "proxy"])
def test_a_leader_cut_off_acknowledges_nothing_and_catches_up_after_healing(
        tmp_path: Path, kind: str) -> None:
    if kind == "netns" and namespaces_unavailable() is not None:
        pytest.skip(f"no network namespaces here ({namespaces_unavailable()}); the proxy "
                    "variant makes the partition by blocking the peer and admin ports")
    history = History()
    subscribers: list[RecordingSubscriber] = []
    publishers: list[RecordingPublisher] = []
    with open_network(SITES + 1, force_proxy=kind == "proxy") as network:
        cluster = Cluster(tmp_path, SITES, network=network,
                          site_config={"cluster": {"write_timeout": WRITE_TIMEOUT}})
        try:
            cluster.start()
            for site in cluster.sites:
                subscriber = RecordingSubscriber(history, f"pt-sub-{site.index}", site.host,
                                                 site.port, "pt/#")
                subscriber.start()
                subscribers.append(subscriber)
            for subscriber in subscribers:
                assert subscriber.subscribed.wait(15), f"no SUBACK for {subscriber.name}"
            for site in cluster.sites:
                publishers.append(RecordingPublisher(
                    history, f"pt-pub-{site.index}", site.host, site.port,
                    [f"pt/{site.index}/a", f"pt/{site.index}/b"]))
                publishers[-1].start()
            clients: list[RecordingClient] = [*subscribers, *publishers]
            assert all_connected(clients, 30, clients), "clients did not connect"
            assert more_acknowledged(history, 200, 30), history.summary()

            cut = cluster.busiest_leader()
            led = [shard for shard, leader in cluster.leaders().items() if leader == cut]
            epochs = cluster.epochs()
            minority = publishers[cut]
            majority = [p for p in publishers if p is not minority]
            cut_at = time.monotonic()
            network.cut(cut)
            # Taken once the cut is in effect: a message handed over just before it
            # may be committed before it, and rightly acknowledged afterwards.
            before_cut = set(history.published_messages())
            # every message of this one is handed over after the cut, its first ones
            # before it connects, whatever the cut-off site does with the connection
            late = RecordingPublisher(history, f"pt-late-{cut}", cluster.sites[cut].host,
                                      cluster.sites[cut].port, [f"pt/{cut}/late"],
                                      prefill=10)
            late.start()
            publishers.append(late)
            moved = cluster.wait_leaders_moved(cut, led, 60)
            moved_after = time.monotonic() - cut_at
            assert moved, f"no new leaders for {led} after cutting site-{cut} off:\n" \
                          f"{cluster.describe()}"
            assert all(cluster.epochs()[shard] > epochs[shard] for shard in led)
            acked_majority = sum(len(acknowledged_by(history, p.name)) for p in majority)
            assert wait_until(lambda: sum(len(acknowledged_by(history, p.name))
                                          for p in majority) >= acked_majority + 200, 60,
                              every=0.25), \
                f"the majority does not go on: {history.summary()}\n{cluster.describe()}"
            cut_side = {minority.name, late.name}
            # the cut lasts until the cut-off site gave up a write of the late publisher
            # (write_timeout) and dropped it (bounded: not waited for beyond 30s)
            timed_out = wait_until(lambda: late.connects >= 2, 30)
            published_while_cut = {m for m in history.published_messages()
                                   if m.publisher in cut_side} - before_cut
            acked_while_cut = {m for m in history.acknowledged_messages()
                               if m.publisher in cut_side} & published_while_cut
            # what the old leader holds of its shards now: entries past what it knows
            # committed are a tail that the new leaders' logs do not have
            old_tails = {s["shard"]: (s["last"], s["committed"])
                         for s in cluster.sites[cut].replication()["shards"]
                         if s["db"] == "messages" and s["shard"] in led}
            network.heal(cut)
            healed_at = time.monotonic()

            assert cluster.wait_ready(60), f"site-{cut} did not take its role after " \
                                           f"healing:\n{cluster.describe()}"
            ready_after = time.monotonic() - healed_at
            assert more_acknowledged(history, 100, 30), history.summary()
            drained = stop_and_drain(publishers, 60)
            drained_at = time.monotonic()
            delivered = wait_delivered(history)
            delivered_after = time.monotonic() - drained_at
            missing_then = {name: runs_of(lost) for name, lost in history.missing().items()}
            time.sleep(0.5)  # resends on their way arrive too
            converged = wait_until(cluster.converged, 60)
            final_state = cluster.describe()
        finally:
            everyone: list[RecordingClient] = [*subscribers, *publishers]
            client_state = describe_clients(everyone)
            for client in everyone:
                client.close()
            tracebacks = cluster.tracebacks() if cluster.site_ids else {}
            alive = [site.alive() for site in cluster.sites]
            cluster.close()
    print(f"\nsite-{cut} (leader of shards {led}) cut off: new leaders after "
          f"{moved_after:.2f}s; after healing its roles taken after {ready_after:.2f}s; "
          f"its publishers had {len(published_while_cut)} messages published while cut, "
          f"{len(acked_while_cut)} acknowledged while cut; the late publisher "
          f"{'was' if timed_out else 'was not'} dropped and back while cut")
    print(f"old leader at healing, shard: (last, committed): {old_tails}; at the end every "
          f"replica at the same position: {converged}; every acknowledged message "
          f"delivered {delivered_after:.1f}s after the publishers were drained")
    print(history.summary(), f"\nclients: {client_state}\ntracebacks in logs: {tracebacks}")
    assert all(alive), f"a site died by itself: {alive}"
    assert published_while_cut
    assert not acked_while_cut, \
        f"the cut-off side acknowledged {sorted(acked_while_cut)[:5]}"
    assert drained, f"publishers still wait for acknowledgements: {history.summary()}"
    assert converged, f"replicas differ at the end:\n{final_state}"
    history.check()
    assert delivered, f"deliveries stopped; missing then: {missing_then}"
