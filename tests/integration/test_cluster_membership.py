"""Membership changes lose nothing acknowledged (issue 22, defect 1; docs/replication.md,
"Rounds and decisions").

Five sites and a controller, replication factor 5, one shard. The shard's leader is
cut from the two replicas that a lower replication factor keeps (their peer traffic
only: the controller still reaches everyone, so nobody is taken for gone), and
commits QoS 1 publishes with the two replicas the plan removes. The controller is
restarted at replication factor 3 and `ctl ds set-replicas` plans the two `-site`
steps. Then the leader is killed, and a durable subscriber whose session was made
before the cut must get every PUBACKed message from whichever replica leads next.

Without a gate on membership changes the two removals go in consecutive rounds, the
shard is left with the leader and the two lagging replicas, and the failover after the
kill can only pick a lagging one: every message acknowledged during the cut is lost.
With it, a removal waits until a majority of the replica set it leaves holds what the
leader committed."""

from __future__ import annotations

import asyncio
import json
import queue
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from paho.mqtt.packettypes import PacketTypes

from harness.cluster import DB, Cluster, SiteProcess, ctl_ds, poll
from harness.netns import open_network
from stratamq.broker.ds.replication import Position, entries
from stratamq.broker.ds.replication.leader import AppendRequest
from stratamq.broker.ds.replication.log import Entry
from stratamq.broker.ds.replication.peer import PeerClient, PeerError
from tests.support.clients import PahoClient, paho_properties

pytestmark = pytest.mark.cluster

SITES = 5
PUBLISHED = 20
HEARTBEAT = 0.5
# long enough for an ungated plan to take both steps (a round each) many times over
PLAN_WINDOW = 8.0
SUBSCRIBER = "gate-durable-sub"
TOPIC = "gate/t"


def durable_connect(client: PahoClient) -> bool:
    """Connect with clean start false and a long session; whether a session was there."""
    properties = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=3600)
    connack = client.connect(clean_start=False, properties=properties)
    assert connack.reason_code == 0, connack
    return connack.session_present


@pytest.mark.slow
def test_lowering_the_replication_factor_keeps_what_a_lagging_majority_lacks(
        tmp_path: Path) -> None:
    with open_network(SITES + 1, force_proxy=True) as network:
        cluster = Cluster(tmp_path, SITES, n_shards=1, replication_factor=SITES,
                          heartbeat_interval=HEARTBEAT, network=network,
                          site_config={"cluster": {"write_timeout": "3s"}})
        subscriber: PahoClient | None = None
        publisher: PahoClient | None = None
        try:
            cluster.start()
            ids = cluster.site_ids
            leader = cluster.leaders()[0]
            # the planner gives up the non-leaders first, the smallest site ids first
            others = sorted((k for k in range(SITES) if k != leader), key=lambda k: ids[k])
            removed, staying = others[:2], others[2:]

            site = cluster.sites[staying[0]]
            subscriber = PahoClient(site.port, SUBSCRIBER, host=site.host)
            assert not durable_connect(subscriber)
            assert subscriber.subscribe(f"{TOPIC}/#", 1) == [1]
            subscriber.disconnect()
            subscriber.stop()

            network.separate([leader], staying)
            publisher = PahoClient(cluster.sites[leader].port, "gate-pub",
                                   host=cluster.sites[leader].host)
            publisher.connect()
            acknowledged = []
            for number in range(PUBLISHED):
                code = publisher.publish(f"{TOPIC}/{number}", str(number).encode(), 1)
                assert code == 0, f"message {number}: PUBACK {code:#x}"
                acknowledged.append(number)
            publisher.stop()
            lag = {k: (s["last"], s["committed"]) for k in staying
                   for s in cluster.sites[k].replication()["shards"] if s["db"] == DB}

            cluster.controller.kill()
            arguments = cluster.controller.arguments
            arguments[arguments.index("--replication-factor") + 1] = "3"
            cluster.controller.start()
            planned = ctl_ds(cluster, "set-replicas", DB, *ids)
            for k in removed:
                assert f"-{ids[k]}" in planned, planned  # the plan the test arranged
            began = time.monotonic()
            shrunk = poll(lambda: len(cluster.replicas()[0]) == 3, PLAN_WINDOW, 0.1)
            steps_taken = SITES - len(cluster.replicas()[0])
            print(f"\nafter {time.monotonic() - began:.1f}s the plan has taken "
                  f"{steps_taken} of 2 steps (shrunk to 3: {shrunk}); "
                  f"replicas {cluster.replicas()[0]}")

            cluster.sites[leader].kill()
            killed_at = time.monotonic()
            assert poll(lambda: cluster.leaders()[0] != leader, 60, 0.1), cluster.describe()
            failover_after = time.monotonic() - killed_at
            network.heal()

            site = cluster.sites[staying[0]]
            subscriber = PahoClient(site.port, SUBSCRIBER, host=site.host)
            assert durable_connect(subscriber)
            received: set[int] = set()
            deadline = time.monotonic() + 30
            while len(received) < PUBLISHED and time.monotonic() < deadline:
                try:
                    message = subscriber.messages.get(timeout=1)
                except queue.Empty:
                    continue
                received.add(int(message.payload))
            lost = sorted(set(acknowledged) - received)
            # the plan goes on once the replicas it keeps hold what was committed
            finished = poll(lambda: not cluster.controller.storage()["plan"]
                            and len(cluster.replicas()[0]) == 3, 60, 0.2)
            state = cluster.describe()
        finally:
            for client in (subscriber, publisher):
                if client is not None:
                    client.stop()
            cluster.close()
    print(f"leader site-{leader} cut from {staying} (removed by the plan: {removed}); "
          f"the staying replicas' (last, committed) before the change: {lag}; new leader "
          f"after {failover_after:.1f}s; {len(lost)} of {len(acknowledged)} PUBACKed "
          f"messages lost: {lost}; plan finished after healing: {finished}")
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged messages lost: " \
                     f"{lost}\n{state}"
    assert finished, f"the plan did not finish after healing:\n{state}"


def test_a_removed_replica_refuses_its_old_leaders_appends_and_bootstraps(
        tmp_path: Path) -> None:
    """A replica the placement took away is sent an append and a bootstrap request by
    the shard's leader, as a leader that has not taken the placement yet would: it
    must refuse both (its log and data stay as they are), or it would hold, and
    count towards a commit, a copy nobody tracks any more."""
    cluster = Cluster(tmp_path, 4, n_shards=1, replication_factor=3,
                      heartbeat_interval=HEARTBEAT)
    try:
        cluster.start()
        ids = cluster.site_ids
        replicas, leader = cluster.replicas()[0], cluster.leaders()[0]
        outsider = next(k for k in range(4) if k not in replicas)
        leaving = next(k for k in replicas if k != leader)
        goal = [ids[k] for k in range(4) if k != leaving]
        ctl_ds(cluster, "set-replicas", DB, *goal)
        assert poll(lambda: cluster.replicas()[0] == sorted({*replicas, outsider} - {leaving})
                    and not cluster.controller.storage()["plan"], 60, 0.2), cluster.describe()
        removed = cluster.sites[leaving]
        # Taken off the replica set, the site drops its copy of the shard in the
        # background (`ShardReplica._drop_data`: an empty shard, its log at [0, 0]):
        # what the refused requests must leave as it is comes after that.
        assert poll(lambda: shard_report(removed)["role"] == "none"
                    and shard_report(removed)["last"] == [0, 0], 30), cluster.describe()
        before = shard_report(removed)
        epoch = cluster.epochs()[0]
        leader_peer = cluster.sites[cluster.leaders()[0]].replication()["peer"]
        peer = removed.replication()["peer"]

        previous = Position(*before["last"])
        request = AppendRequest(epoch=epoch, previous=previous, entries=[Entry(
            Position(epoch, previous.offset + 1), entries.encode(entries.Noop()))])
        appended = asyncio.run(append_to(peer, request))
        bootstrap = http_post(f"http://{peer}/peer/v1/bootstraps/{DB}/0",
                              {"from": leader_peer})
        after = shard_report(removed)
    finally:
        cluster.close()
    print(f"\nremoved replica site-{leaving} ({before['last']}, {before['bootstraps']} "
          f"bootstraps): append answered {appended}; bootstrap answered {bootstrap}; "
          f"then ({after['last']}, {after['bootstraps']} bootstraps)")
    assert appended.startswith("refused"), appended
    assert bootstrap[0] == 403, bootstrap
    assert (after["last"], after["bootstraps"]) == (before["last"], before["bootstraps"])


def shard_report(site: SiteProcess) -> dict[str, Any]:
    return next(s for s in site.replication()["shards"] if s["db"] == DB and s["shard"] == 0)


async def append_to(peer: str, request: AppendRequest) -> str:
    """An append sent to the site at `peer` the way a leader sends it: what came back."""
    async with aiohttp.ClientSession() as session:
        try:
            result = await PeerClient(session, timeout=5).append(peer, DB, 0, request)
        except PeerError as error:
            return f"refused: {error.message}"
        return f"taken: {result}"


def http_post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()[-300:]
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()[-300:]
