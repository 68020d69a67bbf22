"""Replica bootstrap from a checkpoint and log trimming (issue 7, "Replica
transitions"; docs/replication.md, "Log trimming and replica bootstrap"), with real
processes.

Three sites at replication factor 3, two shards, `cluster.log_retain_entries` small.
A publisher per shard on site 0 streams numbered QoS 1 and QoS 2 messages; every
replica's log stays bounded in entries while the logs grow far past that bound. A
fourth site starts with a durable subscriber on it and is joined (`ctl ds join`):
the shards it gets have trimmed logs, so it bootstraps each from a checkpoint of
the leader (sent at `cluster.checkpoint_rate`, slow enough for the test to see it).
The moment it reports `bootstrapping`, the leader it fetches from is
paused (SIGSTOP) so the transfer is certainly under way, the new site is killed -9,
the leader resumed, the new site restarted: it bootstraps again and completes.
At the end: the plan is done, every replica of a shard applied the same offset, the
new site's status and log say it bootstrapped, and the history check passes for every
shard: the new site's subscriber gets the messages of the shards it holds no replica of
through the commit feed and reads at a replica (docs/replication.md, "Every site sees
every shard")."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from harness.cluster import DB, Cluster, SiteProcess, ctl_ds, http_json, poll
from harness.waiting import wait_until
from tests.support.history import History
from tests.support.recorder import (
    RecordingClient,
    RecordingPublisher,
    RecordingSubscriber,
    all_connected,
    describe_clients,
    wait_delivered,
)
from tests.support.shards import client_id_on_shard

pytestmark = pytest.mark.cluster

N_SHARDS = 2
HEARTBEAT = 0.5
RETAIN = 20
# trimming runs once TRIM_STEP (100) entries may go; a replica's log may also hold
# what its leader has not yet counted as held everywhere (entries in flight)
BOUND = RETAIN + 100 + 100
PLAN_TIMEOUT = 180.0
# Checkpoints sent at 128 KiB/s: the new site's bootstrap lasts long enough for the
# poll to see it (unpaced, a checkpoint of 180 KB went in 0.04 s, and the poll missed
# it now and then).
SITE_CONFIG: dict[str, Any] = {"cluster": {"log_retain_entries": RETAIN,
                                           "checkpoint_rate": "128KiB"}}


def shard_reports(site: SiteProcess) -> dict[int, dict[str, Any]]:
    return {s["shard"]: s for s in site.replication()["shards"] if s["db"] == DB}


def log_entries(report: dict[str, Any]) -> int:
    """Entries a replica's log holds (from its start to its end)."""
    return int(report["last"][1]) - int(report["log_start"]) + 1


def plan_done(cluster: Cluster) -> bool:
    storage = cluster.controller.storage()
    return not storage["plan"] and all(not shard["transitions"] and len(shard["replicas"]) == 3
                                       for shard in storage["shards"])


def logs_bounded_while_growing(cluster: Cluster, sites: list[int], past: int,
                               samples: list[str]) -> bool:
    """Wait until every replica's log on `sites` ends past offset `past`; meanwhile
    note each replica's entry count. False if one ever held more than BOUND."""
    bounded = True

    def grown() -> bool:
        nonlocal bounded
        ends = []
        for index in sites:
            for shard, report in shard_reports(cluster.sites[index]).items():
                if report["role"] == "none":  # not a replica (any more): not kept up
                    continue
                entries = log_entries(report)
                if entries > BOUND:
                    bounded = False
                    samples.append(f"site {index} shard {shard}: {entries} entries "
                                   f"({report['log_start']}..{report['last'][1]})")
                ends.append(int(report["last"][1]))
        return min(ends) > past

    assert poll(grown, 240, 0.2), f"logs did not grow past {past}:\n{cluster.describe()}"
    for index in sites:
        for shard, report in shard_reports(cluster.sites[index]).items():
            if report["role"] == "none":
                continue
            samples.append(f"site {index} shard {shard}: log {report['log_start']}.."
                           f"{report['last'][1]} ({log_entries(report)} entries)")
    return bounded


@pytest.mark.slow
def test_a_joining_replica_bootstraps_from_a_checkpoint_even_when_killed_midway(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, 3, n_shards=N_SHARDS, heartbeat_interval=HEARTBEAT,
                      site_config=SITE_CONFIG)
    history = History()
    clients: list[RecordingClient] = []
    publishers: list[RecordingPublisher] = []
    samples: list[str] = []
    killed_midway: dict[str, Any] = {}
    try:
        cluster.start()
        new = SiteProcess(tmp_path / "site-3", 3, "127.0.0.4", n_shards=N_SHARDS,
                          heartbeat_interval=HEARTBEAT, config=SITE_CONFIG)
        cluster.sites.append(new)
        new.start()
        cluster.site_ids.append(new.replication()["site"])
        new_id = cluster.site_ids[3]
        assert http_json("POST", f"{cluster.controller.url}/api/v1/ds/sites",
                         {"admin_url": new.admin_url})["probed"]
        subscriber = RecordingSubscriber(history, "bs-sub", new.host, new.port, "bs/#")
        subscriber.start()
        clients.append(subscriber)
        assert subscriber.subscribed.wait(15), "no SUBACK on the new site"
        for shard in range(N_SHARDS):
            name = client_id_on_shard(f"bs-pub-{shard}", shard, N_SHARDS)
            publisher = RecordingPublisher(history, name, cluster.sites[0].host,
                                           cluster.sites[0].port, [f"bs/{name}"])
            publishers.append(publisher)
            clients.append(publisher)
            publisher.start()
        assert all_connected(clients, 30), describe_clients(clients)

        # 1. logs stay bounded (in entries) while publishing goes on
        bounded = logs_bounded_while_growing(cluster, [0, 1, 2], 3 * BOUND, samples)
        bounded &= logs_bounded_while_growing(cluster, [0, 1, 2], 5 * BOUND, samples)
        starts = {shard: report["log_start"]
                  for shard, report in shard_reports(cluster.sites[0]).items()}
        assert all(start > 1 for start in starts.values()), starts

        # 2. join the new site: it bootstraps; kill it -9 in the middle of it
        planned = ctl_ds(cluster, "join", DB, new_id)
        print(f"\n{planned}")

        def bootstrapping() -> bool:
            for shard, report in shard_reports(new).items():
                if report["state"] == "bootstrapping":
                    killed_midway.update(shard=shard, progress=report["bootstrap"])
                    return True
            return False

        assert poll(bootstrapping, PLAN_TIMEOUT, 0.01), \
            f"the new site never bootstrapped:\n{cluster.describe()}\n{new.log_tail()}"
        source = next(site for site in cluster.sites[:3]
                      if f"{site.host}:{site.peer_port}" == killed_midway["progress"]["from"])
        os.kill(source.pid, signal.SIGSTOP)  # the transfer cannot finish meanwhile
        try:
            assert shard_reports(new)[killed_midway["shard"]]["state"] == "bootstrapping"
            new.kill()
        finally:
            os.kill(source.pid, signal.SIGCONT)
        # The checkpoint may have been in and installing (a transfer of 0.1 s) when
        # the poll saw it: then the restarted site holds it and needs no second one.
        installed_before_kill = f"{DB}/{killed_midway['shard']}: bootstrapped from" \
            in new.log()
        workdir = tmp_path / "site-3"
        print(f"killed -9 while bootstrapping {DB}/{killed_midway['shard']}: "
              f"{killed_midway['progress']}")
        new.start()
        assert poll(lambda: plan_done(cluster), PLAN_TIMEOUT, 0.2), \
            f"joining did not finish:\n{cluster.describe()}"
        held = [shard["id"] for shard in cluster.controller.storage()["shards"]
                if new_id in shard["replicas"]]
        assert held, cluster.describe()
        assert cluster.wait_ready(60), f"roles not taken:\n{cluster.describe()}"

        # 3. the new site goes on following; logs stay bounded on all four
        bounded &= logs_bounded_while_growing(cluster, [0, 1, 2, 3], 7 * BOUND, samples)
        for publisher in publishers:
            publisher.stop_publishing()
        drained = wait_until(lambda: all(p.unacked() == 0 for p in publishers), 60)

        def lost() -> list[str]:
            return [f"{session}: {message}" for session, missing in history.missing().items()
                    for message in missing]

        delivered = wait_delivered(history)
        agreed = poll(lambda: all(
            len({shard_reports(cluster.sites[cluster.index_of(site)])[shard["id"]]["applied"]
                 for site in shard["replicas"]}) == 1
            for shard in cluster.controller.storage()["shards"])
            and cluster.same_content(DB), 30, 0.2)
        reports = shard_reports(new)
        new_log = new.log()
        # a site that left a shard's replica set deleted its copy of it
        left = {(index, shard): report for index in range(3)
                for shard, report in shard_reports(cluster.sites[index]).items()
                if cluster.site_ids[index] not in
                cluster.controller.storage()["shards"][shard]["replicas"]}
        left_logs = {index: cluster.sites[index].log() for index, _shard in left}
        leftovers = sorted(str(path.relative_to(workdir))
                           for path in workdir.rglob("*")
                           if path.name.endswith((".staged", ".old", "bootstrap.json")))
        final_state = cluster.describe()
    finally:
        client_state = describe_clients(clients)
        for client in clients:
            client.close()
        tracebacks = cluster.tracebacks() if cluster.site_ids else {}
        cluster.close()
    print("\n".join(["log sizes seen:", *(f"  {line}" for line in samples),
                     f"new site holds shards {held}; its reports: {reports}",
                     history.summary(), f"clients: {client_state}",
                     f"tracebacks in logs: {tracebacks}"]))
    assert not any(tracebacks.values()), tracebacks
    assert bounded, "a log held more entries than the bound"
    assert drained, history.summary()
    for shard in held:
        # installed by the restarted site, or (the killed one) before the kill
        assert reports[shard]["bootstraps"] >= 1 or (
            shard == killed_midway["shard"] and installed_before_kill), reports
        assert reports[shard]["log_start"] > 1, reports
    assert new_log.count("bootstrapped from") >= len(held), new_log[-4000:]
    assert "bootstrapping from a checkpoint" in new_log
    assert not leftovers, leftovers
    assert agreed, final_state
    assert left, "no site left a replica set when the new site joined"
    for (index, shard), report in left.items():
        assert (report["applied"], report["last"][1]) == (0, 0), (index, shard, report)
        assert f"{DB}/{shard}: this site left the replica set: its data of the shard is " \
               "deleted" in left_logs[index]
    assert delivered, "\n".join(lost()[:20])
    problems = {kind: lines for kind, lines in history.problems_by_kind().items()
                if kind != "lost"}
    assert not problems, problems

