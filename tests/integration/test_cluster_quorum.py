"""A leader cut off from its peers but not from the controller (issue 22, defect 3;
docs/replication.md, "Failure seen in the data plane").

Three sites and the controller, each in its own network namespace or, without them
(and here too, forced, as the `proxy` variant), behind the partition proxies
(harness/netns.py). A publisher on a follower site streams QoS 1 messages to
one shard of `messages`; a durable subscriber on the third site takes them. The
shard's leader is separated from the two other sites, both ways, while the
controller still reaches every site: its heartbeat probe alone sees nothing wrong.
The leader reports how long ago a majority of the shard's replicas last answered it
(`quorum_age`), and the controller fails the shard over once that is past the time a
site takes to be taken for gone. Within the cut the shard gets a new leader and goes
on acknowledging; after healing every acknowledged message is delivered, the history
check passes and the replicas converge. Figures (failover time, acknowledgements in
the cut) are printed; the assertions leave wide margins."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.cluster import Cluster
from harness.netns import namespaces_unavailable, open_network
from harness.waiting import wait_until
from tests.support.history import History
from tests.support.recorder import (
    RecordingClient,
    RecordingPublisher,
    RecordingSubscriber,
    all_connected,
    describe_clients,
    stop_and_drain,
    wait_delivered,
)
from tests.support.shards import client_id_on_shard

pytestmark = pytest.mark.cluster

SITES = 3
N_SHARDS = 2
CUT_SHARD = 0
# How long the leader stays cut off: the controller takes a site for gone after
# 3 heartbeats of 0.5s, so a failover is due within a few seconds of the cut.
CUT_SECONDS = 12.0
GONE_AFTER = 1.5  # the controller's 3 heartbeats of 0.5s (harness/cluster.py)


def leaders_quorum_age(cluster: Cluster) -> float:
    """The largest `quorum_age` any site reports for a shard it leads (any database)."""
    return max(float(shard["quorum_age"]) for site in cluster.sites
               for shard in site.replication()["shards"] if shard["role"] == "leader")


def acknowledged(history: History, publisher: RecordingPublisher) -> int:
    return sum(1 for m in history.acknowledged_messages() if m.publisher == publisher.name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["netns", "proxy"])
def test_a_leader_cut_off_from_its_peers_only_is_replaced(tmp_path: Path, kind: str) -> None:
    if kind == "netns" and namespaces_unavailable() is not None:
        pytest.skip(f"no network namespaces here ({namespaces_unavailable()}); the proxy "
                    "variant separates the sites by their peer and admin ports' proxies")
    history = History()
    clients: list[RecordingClient] = []
    with open_network(SITES + 1, force_proxy=kind == "proxy") as network:
        cluster = Cluster(tmp_path, SITES, n_shards=N_SHARDS, network=network,
                          site_config={"cluster": {"write_timeout": "3s"}})
        try:
            cluster.start()
            cut = cluster.leaders()[CUT_SHARD]
            writer_site, reader_site = (k for k in range(SITES) if k != cut)
            subscriber = RecordingSubscriber(history, "qa-sub", cluster.sites[reader_site].host,
                                             cluster.sites[reader_site].port, "qa/#")
            subscriber.start()
            clients.append(subscriber)
            assert subscriber.subscribed.wait(15), "no SUBACK for the subscriber"
            publisher = RecordingPublisher(
                history, client_id_on_shard("qa-pub", CUT_SHARD, N_SHARDS),
                cluster.sites[writer_site].host, cluster.sites[writer_site].port,
                ["qa/cut"], qos_levels=(1,))
            publisher.start()
            clients.append(publisher)
            assert all_connected(clients, 30), "clients did not connect"
            assert wait_until(lambda: acknowledged(history, publisher) >= 50, 30, every=0.25), \
                f"no acknowledgements before the cut: {history.summary()}"
            epoch = cluster.epochs()[CUT_SHARD]
            # healthy shards, the idle ones among them, hear a majority every heartbeat
            idle_age = 0.0
            for _ in range(5):
                idle_age = max(idle_age, leaders_quorum_age(cluster))
                time.sleep(0.2)

            acked_at_cut = acknowledged(history, publisher)
            cut_at = time.monotonic()
            network.separate([cut], [k for k in range(SITES) if k != cut])
            moved = cluster.wait_leaders_moved(cut, [CUT_SHARD], CUT_SECONDS)
            failover_after = time.monotonic() - cut_at
            acked_at_failover = acknowledged(history, publisher)
            resumed = wait_until(lambda: acknowledged(history, publisher) > acked_at_failover,
                                 max(0.0, CUT_SECONDS - failover_after), every=0.1)
            resumed_after = time.monotonic() - cut_at
            time.sleep(max(0.0, CUT_SECONDS - (time.monotonic() - cut_at)))
            acked_in_cut = acknowledged(history, publisher) - acked_at_cut
            cut_state = cluster.describe()
            new_epoch = cluster.epochs()[CUT_SHARD]
            network.heal(cut)

            ready = cluster.wait_ready(60)
            drained = stop_and_drain([publisher], 60)
            delivered = wait_delivered(history)
            converged = wait_until(cluster.converged, 60, every=0.5)
            final_state = cluster.describe()
        finally:
            client_state = describe_clients(clients)
            for client in clients:
                client.close()
            tracebacks = cluster.tracebacks() if cluster.site_ids else {}
            alive = [site.alive() for site in cluster.sites]
            cluster.close()
    failover = f"new leader after {failover_after:.2f}s" if moved else "no failover"
    resumption = f"after {resumed_after:.2f}s" if resumed else "never"
    print(f"\n[{kind}] before the cut the leaders' quorum age was {idle_age:.2f}s at most")
    print(f"[{kind}] site-{cut}, leader of messages/{CUT_SHARD}, cut off from the other "
          f"sites (not from the controller) for {CUT_SECONDS:.0f}s: {failover}, epoch "
          f"{epoch} -> {new_epoch}; acknowledgements resumed {resumption} after the cut; "
          f"{acked_in_cut} writes acknowledged in the cut window")
    print(history.summary(), f"\nclients: {client_state}\ntracebacks in logs: {tracebacks}")
    assert all(alive), f"a site died by itself: {alive}"
    assert idle_age < GONE_AFTER, f"a healthy leader reported quorum age {idle_age}s"
    assert moved, f"no failover of messages/{CUT_SHARD} within {CUT_SECONDS}s of cutting " \
                  f"its leader site-{cut} off from its peers:\n{cut_state}"
    assert new_epoch > epoch
    # wide: the publisher keeps 20 messages in flight, a round trip takes milliseconds
    assert acked_in_cut >= 50, f"only {acked_in_cut} writes acknowledged in the cut"
    assert ready, f"site-{cut} did not take its role after healing:\n{final_state}"
    assert drained, f"the publisher still waits for acknowledgements: {history.summary()}"
    assert delivered, f"deliveries stopped: {history.summary()}"
    assert converged, f"replicas differ at the end:\n{final_state}"
    history.check()
