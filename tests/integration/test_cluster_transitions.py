"""Transitions under load (issue 7, "Tests (real processes)"; docs/replication.md,
"The controller").

Three sites and a controller, replication factor 3, four shards. Publishers on sites 0
and 1 stream numbered QoS 1 and QoS 2 messages, durable subscribers (clean start
false) on sites 0 and 1 take all of them, so each publisher's messages reach a
subscriber on the other site too. While they run:

1. grow: two more sites are started and added to the controller (`POST
   /api/v1/ds/sites`), then `ctl ds set-replicas messages <all five>` spreads the
   shards' replicas (still 3 each) over five sites;
2. drain: `ctl ds leave messages <site-2>` moves every replica off site 2 (then
   the same for `sessions` and `retained`, grown the same way after `messages`);
3. remove: site 2 is stopped and `ctl ds forget` drops it.

A thread samples `stratamq ctl ds info` (the real CLI, against the controller) all
along; the distinct pending `+site` / `-site` lists it showed are printed step by step.
At the end: some pending transition was seen, none is left, every shard has 3 replicas
and a leader, all replicas of a shard report the same applied offset, and the history
check passes in full (no QoS 2 duplicate, order kept, durable sessions kept, nothing
acknowledged lost), also for subscribers on a site that stopped holding a replica of
the publisher's shard: they read it from a replica elsewhere and take its commit feed
from the shard's leader. Any loss is printed per shard, with whether the subscriber's
site held a replica all along. Durations are printed, never asserted."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.cluster import (
    DB,
    Cluster,
    SiteProcess,
    ctl_ds,
    http_json,
    poll,
)
from harness.waiting import wait_until
from stratamq.broker.ds.shard_set import shard_of
from tests.support.history import History, Message, runs_of
from tests.support.recorder import (
    RecordingClient,
    RecordingPublisher,
    RecordingSubscriber,
    all_connected,
    describe_clients,
    more_acknowledged,
    wait_delivered,
)
from tests.support.shards import client_id_on_shard

pytestmark = pytest.mark.cluster

SITES = 3
GROWN = 5
N_SHARDS = 4
HEARTBEAT = 0.5
CLIENT_SITES = (0, 1)  # sites that stay for the whole test
LEAVING = 2  # an original site: it holds a replica of every shard from the start
PLAN_TIMEOUT = 120.0  # generous: five sites on a shared 2-core machine
SITE_ID = r"[0-9A-F]{16}"
STEP = re.compile(rf"[+-]{SITE_ID}(?: \(catching up\))?")


class InfoSampler:
    """Runs `stratamq ctl ds info` against the controller again and again on a thread
    and keeps, in the order first seen, each distinct pending-transitions list per
    shard and each distinct plan it printed."""

    def __init__(self, cluster: Cluster) -> None:
        controller = cluster.controller
        self.command = [sys.executable, "-m", "stratamq.broker", "ctl", "ds", "info",
                        "--url", controller.url, "--token-file", str(controller.token_file)]
        self.samples = 0
        self.failures: list[str] = []
        self.events: list[str] = []  # "<phase>: messages/N: +A -B" / "<phase>: plan ..."
        self.phase = "start"
        self.replica_sets: dict[int, set[frozenset[str]]] = {}  # shard -> replica sets seen
        self._seen: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds-info", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def pending_seen(self) -> list[str]:
        return [event for event in self.events if ": plan" not in event]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                done = subprocess.run(self.command, capture_output=True, text=True,
                                      timeout=30, check=False)
            except subprocess.TimeoutExpired:
                self.failures.append("ctl ds info timed out")
                continue
            self.samples += 1
            if done.returncode != 0:
                self.failures.append(
                    (done.stderr.strip().splitlines() or [f"rc {done.returncode}"])[-1])
            else:
                self._take(done.stdout)
            self._stop.wait(0.2)

    def _take(self, output: str) -> None:
        lines = output.splitlines()
        for line in lines:
            if not line.startswith(f"{DB}/"):
                continue
            shard, replicas = line.split()[:2]
            self.replica_sets.setdefault(int(shard.split("/")[1]), set()).add(
                frozenset(replicas.split(",")))
            steps = STEP.findall(line)
            if steps:
                self._note(shard, " ".join(steps))
        if any(line.startswith("PLAN (") for line in lines):
            start = next(i for i, line in enumerate(lines) if line.startswith("PLAN ("))
            self._note("plan", "; ".join(line.strip() for line in lines[start + 1:]
                                          if line.strip()))

    def _note(self, what: str, steps: str) -> None:
        if (what, steps) not in self._seen:
            self._seen.add((what, steps))
            self.events.append(f"{self.phase}: {what}: {steps}")


KV_DATABASES = ("sessions", "retained")


def plan_done(cluster: Cluster, db: str = DB) -> bool:
    """No plan left and no shard with a pending transition, every shard with 3 replicas."""
    storage = cluster.controller.storage(db)
    return not storage["plan"] and all(
        not shard["transitions"] and len(shard["replicas"]) == 3
        for shard in storage["shards"])


def applied_per_shard(cluster: Cluster, storage: dict[str, Any]
                      ) -> dict[int, dict[str, tuple[int, int, int]]]:
    """Shard -> replica site id -> (last offset, committed, applied) as it reports."""
    by_id = {cluster.site_ids[site.index]: site for site in cluster.sites}
    found: dict[int, dict[str, tuple[int, int, int]]] = {}
    for shard in storage["shards"]:
        found[shard["id"]] = {}
        for replica in shard["replicas"]:
            report = {s["shard"]: s for s in by_id[replica].replication()["shards"]
                      if s["db"] == DB}[shard["id"]]
            found[shard["id"]][replica] = (report["last"][1], report["committed"],
                                           report["applied"])
    return found


def lost_by_shard(history: History, site_of: dict[str, str],
                  replica_sets: dict[int, set[frozenset[str]]]) -> list[str]:
    """The acknowledged messages each subscriber misses, per shard of their publisher,
    and whether the subscriber's site was a replica of that shard all along."""
    lines = []
    for session, lost in sorted(history.missing().items()):
        name = session.split("[")[0]  # the History names sessions "client[n]"
        by_shard: dict[int, list[Message]] = {}
        for message in lost:
            by_shard.setdefault(shard_of(message.publisher, N_SHARDS), []).append(message)
        for shard, missed in sorted(by_shard.items()):
            held = all(site_of[name] in replicas for replicas in replica_sets.get(shard, ()))
            lines.append(f"{session} (site {site_of[name]}) misses {len(missed)} messages of "
                         f"{DB}/{shard}: " + ("its site held a replica of it all along" if held
                                              else "its site stopped being a replica of it")
                         + f" ({runs_of(missed)})")
    return lines


def replicas_agree(cluster: Cluster) -> bool:
    storage = cluster.controller.storage()
    positions = applied_per_shard(cluster, storage)
    return all(len({applied for _, _, applied in replicas.values()}) == 1
               for replicas in positions.values()) and cluster.same_content(DB)


@pytest.mark.slow
def test_grow_to_five_sites_then_drain_and_forget_one_under_load(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, SITES, n_shards=N_SHARDS, heartbeat_interval=HEARTBEAT)
    history = History()
    clients: list[RecordingClient] = []
    publishers: list[RecordingPublisher] = []
    sampler = InfoSampler(cluster)
    timeline: list[str] = []
    began = time.monotonic()

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - began:6.1f}s {what}")
        sampler.phase = what.split(":")[0]

    try:
        cluster.start()
        mark("started: 3 sites")
        for index in CLIENT_SITES:
            site = cluster.sites[index]
            subscriber = RecordingSubscriber(history, f"tr-sub-{index}", site.host, site.port,
                                             "tr/#")
            subscriber.start()
            clients.append(subscriber)
        for client in clients:
            assert isinstance(client, RecordingSubscriber)
            assert client.subscribed.wait(15), f"no SUBACK for {client.name}"
        for index in CLIENT_SITES:
            site = cluster.sites[index]
            for number in range(2):  # one publisher per shard over both sites
                shard = 2 * index + number
                name = client_id_on_shard(f"tr-pub-{index}-{number}", shard, N_SHARDS)
                publisher = RecordingPublisher(history, name, site.host, site.port,
                                               [f"tr/{name}/a", f"tr/{name}/b"])
                publishers.append(publisher)
                clients.append(publisher)
                publisher.start()
        assert all_connected(clients, 30), f"clients did not connect: " \
                                           f"{describe_clients(clients)}"
        assert more_acknowledged(history, 100, 30), history.summary()
        sampler.start()
        site_of = {f"tr-sub-{index}": cluster.site_ids[index] for index in CLIENT_SITES}

        # 1. grow: two more sites, known to the controller, then given replicas
        for index in range(SITES, GROWN):
            site = SiteProcess(tmp_path / f"site-{index}", index, f"127.0.0.{index + 1}",
                               n_shards=N_SHARDS, heartbeat_interval=HEARTBEAT)
            cluster.sites.append(site)
            site.start()
            cluster.site_ids.append(site.replication()["site"])
            answer = http_json("POST", f"{cluster.controller.url}/api/v1/ds/sites",
                               {"admin_url": site.admin_url})
            assert answer["probed"], answer
        assert poll(lambda: {s["site"] for s in http_json(
            "GET", f"{cluster.controller.url}/api/v1/ds/sites")["data"] if s["up"]}
            == set(cluster.site_ids), 60), "the new sites are not up in the controller"
        mark("grow: set-replicas to 5 sites")
        planned = ctl_ds(cluster, "set-replicas", DB, *cluster.site_ids)
        print(f"\n{planned}")
        assert "steps planned" in planned, planned
        assert poll(lambda: plan_done(cluster), PLAN_TIMEOUT, 0.2), \
            f"growing did not finish:\n{cluster.describe()}"
        # the key-value databases spread the same way
        for other in KV_DATABASES:
            print(ctl_ds(cluster, "set-replicas", other, *cluster.site_ids))
            assert poll(functools.partial(plan_done, cluster, other), PLAN_TIMEOUT, 0.2), \
                f"growing {other} did not finish:\n{cluster.describe()}"
        assert cluster.wait_ready(60), f"roles not taken after growing:\n{cluster.describe()}"
        mark("grown")
        grown = cluster.controller.storage()
        assert {site for shard in grown["shards"] for site in shard["replicas"]} \
            == set(cluster.site_ids), grown
        assert more_acknowledged(history, 50, 30), history.summary()

        # 2. drain site 2
        leaving = cluster.site_ids[LEAVING]
        mark(f"drain: leave {leaving}")
        planned = ctl_ds(cluster, "leave", DB, leaving)
        print(planned)
        assert f"-{leaving}" in planned, planned
        assert poll(lambda: plan_done(cluster), PLAN_TIMEOUT, 0.2), \
            f"draining did not finish:\n{cluster.describe()}"
        drained_storage = cluster.controller.storage()
        assert all(leaving not in shard["replicas"] for shard in drained_storage["shards"])
        # the key-value databases leave it too: a site holding replicas is not forgotten
        for other in KV_DATABASES:
            print(ctl_ds(cluster, "leave", other, leaving))
            assert poll(functools.partial(plan_done, cluster, other), PLAN_TIMEOUT, 0.2), \
                f"draining {other} did not finish:\n{cluster.describe()}"
            assert all(leaving not in shard["replicas"]
                       for shard in cluster.controller.storage(other)["shards"])
        staying = [index for index in range(GROWN) if index != LEAVING]
        assert cluster.wait_ready(60, staying), \
            f"roles not taken after draining:\n{cluster.describe()}"
        mark("drained")

        # 3. remove it: stopped, then forgotten
        mark(f"forget: stop and forget {leaving}")
        assert cluster.sites[LEAVING].stop() == 0, cluster.sites[LEAVING].log_tail()
        assert poll(lambda: any(s["site"] == leaving and not s["up"] for s in http_json(
            "GET", f"{cluster.controller.url}/api/v1/ds/sites")["data"]), 60)
        ctl_ds(cluster, "forget", leaving)
        known = [s["site"] for s in http_json(
            "GET", f"{cluster.controller.url}/api/v1/ds/sites")["data"]]
        assert sorted(known) == sorted(cluster.site_ids[i] for i in staying), known
        mark("forgotten")
        assert more_acknowledged(history, 50, 30), history.summary()

        for publisher in publishers:
            publisher.stop_publishing()
        mark("publishers stopped")
        drained = wait_until(lambda: all(p.unacked() == 0 for p in publishers), 60)
        delivered = wait_delivered(history)
        time.sleep(0.5)  # resends on their way arrive too
        sampler.stop()
        # every replica applies what its leader committed once the writes stop
        agreed = poll(lambda: replicas_agree(cluster), 30, 0.2)
        final = cluster.controller.storage()
        positions = applied_per_shard(cluster, final)
        final_state = cluster.describe()
        losses = lost_by_shard(history, site_of, sampler.replica_sets)
    finally:
        sampler.stop()
        client_state = describe_clients(clients)
        for client in clients:
            client.close()
        tracebacks = cluster.tracebacks() if cluster.site_ids else {}
        alive = {site.index: site.alive() for site in cluster.sites if site.index != LEAVING}
        cluster.close()
    print("\n".join(["", "timeline:", *timeline,
                     f"ctl ds info: {sampler.samples} samples, {len(sampler.failures)} failed"
                     f"{': ' + sampler.failures[-1] if sampler.failures else ''}",
                     "pending transitions and plans shown by ctl ds info, step by step:",
                     *(f"  {event}" for event in sampler.events),
                     "final (last offset, committed, applied) per shard and replica:",
                     *(f"  {DB}/{shard}: {replicas}" for shard, replicas in positions.items()),
                     "acknowledged messages not delivered:", *(f"  {line}" for line in losses),
                     history.summary(), f"clients: {client_state}",
                     f"tracebacks in logs: {tracebacks}"]))
    assert all(alive.values()), f"a site died by itself: {alive}\n{cluster.logs()}"
    assert sampler.pending_seen(), "ctl ds info never showed a pending transition"
    assert not final["plan"], final
    for shard in final["shards"]:
        assert len(shard["replicas"]) == 3, shard
        assert shard["leader"] in shard["replicas"], shard
        assert not shard["transitions"], shard
    assert agreed, f"replicas report different applied offsets or content: {positions}\n" \
                   f"{final_state}"
    assert drained, f"publishers still wait for acknowledgements: {history.summary()}"
    assert not losses, "\n".join(losses)
    assert delivered
    history.check()
