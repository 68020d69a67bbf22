"""A replicated storage through its life on real nodes (tests/support/realnode.py):
the chart's operator as a pod, every site a container of the built image on a node of
its own, host networking (these nodes' pod network reaches nothing). The stand-in kubelet's
module tests/kube/test_operator_replication.py covers the same plans in more detail
(phases, frozen sites, the operator's metrics); this one shows them on containers the
kubelet and containerd really run, stop and kill (issue 21).

One DurableStorage (`rs`: 3 sites, replication factor 3, 2 shards per database) lives
through the module; the tests run in order. From the third test on, a publisher per
shard (QoS 1 and 2 in turn) and a durable QoS 2 subscriber run on pod rs-0, whose
history check at the end says nothing acknowledged was lost, QoS 2 came once and
order was kept.

The nodes a site's pod could move to are cordoned whenever the storage is at 3 sites
(a pod binds its node's address, so a pod that moved would change its clients'
address; the sites themselves follow it through the operator).

The five nodes are in three zones (`topology.kubernetes.io/zone`: two, two and one
node), which the operator reads off each site's node.

1. Ready: every shard of every database placed on 3 replicas; each site's zone in
   status;
2. `kubectl delete pod` of a site leading shards: its leaderships are handed over
   while it stops (no failover), it comes back as the same site;
3. scale 3 -> 5 under load: ReplicaTransitions to Done, seen by
   `kubectl get replicatransitions -w`; every shard's three replicas in three zones
   (the only site of the third zone holds a replica of each);
4. scale 5 -> 3 with the operator's container killed (-9) mid-plan: the restarted
   operator resumes the plan; the StatefulSet shrinks once the departing sites hold
   nothing;
5. a config change rolls the sites one at a time: each hands its leaderships over
   before it stops, the next stops only once the restarted one's replicas caught up
   (its /readyz): no failover, no pause of acknowledgements as long as a failover takes on a
   connection that stays;
6. `kill -9` of the container of a site leading shards: the container restarts as
   the same site, its shards are led again (by it, or failed over) and written to;
7. the history check;
8. the storage deleted and created again over its volumes: Ready again with its data
   (the placement adopted, a PlacementAdopted event);
9. `helm uninstall` completes.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.processes import REPO
from harness.waiting import wait_for
from stratamq.broker.controller.decisions import MISSED_HEARTBEATS
from stratamq.operator import resources
from stratamq.operator.kept_state import read_text
from tests.support.clients import PahoClient
from tests.support.kube import kube_binary
from tests.support.realnode import RealKubeCluster
from tests.support.recorder import (
    ShardLoad,
    all_connected,
    more_acknowledged,
    stop_and_drain,
    wait_delivered,
)
from tests.support.storage_status import every_shard, placed_shards, site_of_pod, watched

CHART = REPO / "charts" / "stratamq"
NAMESPACE = "realnode-storage"
RELEASE = "rs-op"
NAME = "rs"
N_SHARDS = 2
CLIENT_POD = f"{NAME}-0"  # stays for the whole module (rolled and killed last or never)
# Generous: five sites, an operator and the control plane on 2 cores.
TIMEOUT = 300.0
PACE = 0.01  # seconds between two messages of a publisher
# A short log tail kept: a replica added to a longer log bootstraps from a checkpoint.
SPEC: dict[str, Any] = {
    "sites": 3, "hostNetwork": True, "image": {"pullPolicy": "Never"},
    "messages": {"nShards": N_SHARDS, "replicationFactor": 3},
    "cluster": {"logRetainEntries": 5}, "storage": {"size": "1Gi"}}
# The acknowledgements of a connection that stays pause during a roll for a handover
# only, never for as long as a failover takes: the controller fails a shard over only
# after its leader missed MISSED_HEARTBEATS heartbeats (1 s each: SPEC keeps the
# default heartbeat interval), so a pause that long is an outage. (A fixed 1.0 s here
# failed once at 1.13-1.15 s on 2 loaded cores with no failover in the operator's log:
# a time, not a property.)
ROLL_PAUSE_LIMIT = MISSED_HEARTBEATS * 1.0
# Each node's zone: node-0 and node-1 in zone-a, node-2 and node-3 in zone-b, node-4
# alone in zone-c.
ZONES = ("zone-a", "zone-a", "zone-b", "zone-b", "zone-c")
# What the operator logs when it fails a shard over (broker/controller/decisions.py).
FAILOVER = re.compile(r"leader \S+ (is gone|has heard from no majority)")



def storage(cluster: RealKubeCluster) -> dict[str, Any]:
    found: dict[str, Any] = cluster.get_json(NAMESPACE, "durablestorage", NAME)
    return found


def pods(cluster: RealKubeCluster) -> dict[str, dict[str, Any]]:
    """The sites' pods by name."""
    return {pod["metadata"]["name"]: pod for pod in cluster.get_json(
        NAMESPACE, "pods", "-l", resources.site_selector(NAME))["items"]}


def operator_pod(cluster: RealKubeCluster) -> dict[str, Any]:
    [found] = [pod for pod in cluster.get_json(NAMESPACE, "pods", "-l",
                                               "app.kubernetes.io/component=operator")["items"]
               if not pod["metadata"].get("deletionTimestamp")]
    return found  # type: ignore[no-any-return]


def operator_log(cluster: RealKubeCluster, check: bool = True) -> str:
    """The log of the operator's running container (`kubectl logs`, through its
    node's kubelet)."""
    result = cluster.plane.kubectl("logs", "-n", NAMESPACE,
                                   operator_pod(cluster)["metadata"]["name"], check=check)
    return result.stdout + result.stderr


def ready_with(cluster: RealKubeCluster, sites: int) -> dict[str, Any] | None:
    """The storage when Ready with `sites` sites, balanced and fully replicated."""
    found = storage(cluster)
    status = found.get("status", {})
    if (status.get("phase") == "Ready" and len(status.get("sites", [])) == sites
            and status.get("observedGeneration") == found["metadata"]["generation"]
            and status.get("readyReplicas") == sites and status.get("databases")
            and status.get("underReplicatedShards") == 0):
        return found
    return None


class Phases:
    """The storage's phases seen while waiting (`ready`), and its Warning events then
    (defect 7: Degraded and Warning events during planned, healthy changes)."""

    def __init__(self, cluster: RealKubeCluster) -> None:
        self.cluster = cluster
        self.seen: set[str] = set()
        self.warnings_before = set(warnings(cluster))

    def ready(self, sites: int) -> dict[str, Any] | None:
        self.seen.add(storage(self.cluster).get("status", {}).get("phase", ""))
        return ready_with(self.cluster, sites)

    def warnings_since(self) -> list[str]:
        return [event for event in warnings(self.cluster) if event not in self.warnings_before]


def warnings(cluster: RealKubeCluster) -> list[str]:
    """The storage's Warning events, as `uid reason: message`."""
    found = cluster.get_json(NAMESPACE, "events", "--field-selector",
                             f"type=Warning,involvedObject.kind=DurableStorage,involvedObject.name={NAME}")
    return [f"{event['metadata']['uid']} {event['reason']}: {event['message']}"
            for event in found["items"]]


def explainer(cluster: RealKubeCluster) -> Callable[[], str]:
    def text() -> str:
        status = {key: value for key, value in storage(cluster).get("status", {}).items()
                  if key != "controller"}
        table = cluster.plane.kubectl("get", "-n", NAMESPACE, "pods,replicatransitions", "-o",
                                      "wide", check=False).stdout
        return (f"status: {json.dumps(status, indent=1)}\n{table}\n"
                f"operator log:\n{operator_log(cluster, check=False)[-4000:]}")
    return text


def wait(cluster: RealKubeCluster, what: str, check: Callable[[], Any],
         timeout: float = TIMEOUT) -> Any:
    return wait_for(what, check, timeout=timeout, explain=explainer(cluster))


def pin_sites(cluster: RealKubeCluster) -> None:
    """Cordon every node no site runs on: a site's pod deleted or rolled comes back on
    its own node, at its own address."""
    used = {pod["spec"]["nodeName"] for pod in pods(cluster).values()}
    for kubelet in cluster.kubelets:
        cluster.plane.kubectl("uncordon" if kubelet.node in used else "cordon", kubelet.node)


def unpin_sites(cluster: RealKubeCluster, check: bool = True) -> None:
    for kubelet in cluster.kubelets:
        cluster.plane.kubectl("uncordon", kubelet.node, check=check)


@pytest.fixture(scope="module")
def cluster(real_kube_cluster: RealKubeCluster) -> Iterator[RealKubeCluster]:
    real_kube_cluster.add_volumes(5)
    # One operator replica: the tests kill its container mid-plan and read its log
    # (test_chart_on_real_nodes.py runs the default two).
    real_kube_cluster.install_chart(CHART, RELEASE, NAMESPACE, "--set", "operator.replicas=1")
    try:
        for kubelet, zone in zip(real_kube_cluster.kubelets, ZONES, strict=True):
            real_kube_cluster.plane.kubectl("label", "node", kubelet.node,
                                            f"{resources.ZONE_KEY}={zone}")
        yield real_kube_cluster
    finally:
        # The nodes serve the other modules' storages after this one: zones off again.
        for kubelet in real_kube_cluster.kubelets:
            real_kube_cluster.plane.kubectl("label", "node", kubelet.node, f"{resources.ZONE_KEY}-",
                                            check=False)
        unpin_sites(real_kube_cluster, check=False)
        real_kube_cluster.plane.kubectl("delete", "namespace", NAMESPACE, "--wait=true",
                                        "--timeout=120s", check=False,
                                        timeout=150)


@pytest.fixture(scope="module")
def load(cluster: RealKubeCluster) -> Iterator[ShardLoad]:
    host = pods(cluster)[CLIENT_POD]["status"]["podIP"]
    made = ShardLoad("rs", host, N_SHARDS, (1, 2), 2, PACE)
    yield made
    made.close()


def zone_of_node(cluster: RealKubeCluster) -> dict[str, str]:
    return {kubelet.node: zone for kubelet, zone in zip(cluster.kubelets, ZONES, strict=True)}


def zones_shown(cluster: RealKubeCluster) -> dict[str, str] | None:
    """Site -> its zone as status.sites shows it, once every site's is its node's."""
    node_of = {name: pod["spec"]["nodeName"] for name, pod in pods(cluster).items()}
    sites = storage(cluster).get("status", {}).get("sites", [])
    expected = zone_of_node(cluster)
    if sites and all(site.get("zone") == expected.get(node_of.get(site["pod"], ""))
                     for site in sites):
        return {site["id"]: site["zone"] for site in sites}
    return None


def placed_replicas(status: dict[str, Any]) -> dict[tuple[str, int], list[str]]:
    """(database, shard) -> its replicas in the placement the operator's controller
    keeps (status.controller)."""
    placement = json.loads(read_text(status["controller"]["placement"]))
    return {(database, entry["shard"]): entry["replicas"]
            for database, entries in placement["databases"].items() for entry in entries}


def leaders_moved(cluster: RealKubeCluster, before: dict[tuple[str, int], dict[str, Any]],
                  keys: set[tuple[str, int]], victim: str) -> bool:
    """Whether the controller's placement (`before`: as `placed_shards` read it
    earlier) has the shards `keys` led by another site than `victim`, at a higher
    epoch."""
    now = placed_shards(storage(cluster)["status"])
    return all(now[key]["leader"] != victim
               and now[key]["leaderEpoch"] > before[key]["leaderEpoch"] for key in keys)


def back_ready(cluster: RealKubeCluster, pod: str, old: str, sites: int = 3,
               field: str = "uid") -> dict[str, Any]:
    """The storage once `pod` runs again (a new pod, or with `field` "restarts" a
    restarted container), is Ready by its kubelet's probe (the site's /readyz: its
    replicas caught up), and all sites are ready. The pod's own condition, since the
    storage's status may still show the pod as it was before (it is refreshed every
    10 s): the next test must start from a storage really whole."""
    def back() -> dict[str, Any] | None:
        found = pods(cluster).get(pod)
        if found is None:
            return None
        now = (found["metadata"]["uid"] if field == "uid"
               else str(found["status"]["containerStatuses"][0]["restartCount"]))
        ready = any(condition["type"] == "Ready" and condition["status"] == "True"
                    for condition in found["status"].get("conditions", []))
        return ready_with(cluster, sites) if now != old and ready else None
    found: dict[str, Any] = wait(cluster, f"{pod} back and the storage Ready", back)
    return found


def leading_victim(status: dict[str, Any]) -> tuple[
        dict[str, str], dict[tuple[str, int], dict[str, Any]], str, set[tuple[str, int]]]:
    """From the status: pod by site, every shard's entry, a site leading shards whose
    pod is not CLIENT_POD, and the shards it leads."""
    pod_of = {site: pod for pod, site in site_of_pod(status).items()}
    before = every_shard(status)
    victim = next(site for site in sorted({shard["leader"] for shard in before.values()})
                  if pod_of[site] != CLIENT_POD)
    return pod_of, before, victim, {key for key, shard in before.items()
                                    if shard["leader"] == victim}


# --- the tests, in order ------------------------------------------------------------------

@pytest.mark.timeout(1800)  # the first test of the session starts the nodes
def test_ready_with_every_shard_placed(cluster: RealKubeCluster) -> None:
    started = time.monotonic()
    cluster.plane.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME}, "spec": SPEC}))
    found = wait(cluster, "3 sites ready and placed", lambda: ready_with(cluster, 3))
    print(f"\nstorage Ready with 3 sites in {time.monotonic() - started:.1f} s")
    status = found["status"]
    ids = set(site_of_pod(status).values())
    assert len(ids) == 3
    for shard in every_shard(status).values():
        assert set(shard["replicas"]) == ids and shard["leader"] in ids
    # Each site in its node's zone (status.sites is refreshed every 10 s).
    zones = wait(cluster, "each site's zone in status", lambda: zones_shown(cluster), timeout=60)
    print(f"sites' zones: {zones}")
    pin_sites(cluster)


@pytest.mark.timeout(600)
def test_a_deleted_pod_hands_its_leaderships_over(cluster: RealKubeCluster) -> None:
    """The kubelet's SIGTERM makes the site report `stopping` and serve on; the
    operator hands its leaderships over (defect 3: it skipped terminating pods)."""
    status = storage(cluster)["status"]
    pod_of, _, victim, _ = leading_victim(status)
    # Its shards as the controller has them now (status.databases may lag a round).
    placed = placed_shards(status)
    its_shards = {key for key, shard in placed.items() if shard["leader"] == victim}
    assert its_shards, placed
    old_uid = pods(cluster)[pod_of[victim]]["metadata"]["uid"]
    started = time.monotonic()
    cluster.plane.kubectl("delete", "-n", NAMESPACE, "pod", pod_of[victim], "--wait=false")
    # The controller's placement shows the handover at once (status.databases only
    # at the next status refresh).
    wait(cluster, "the victim's leaderships handed over",
         lambda: leaders_moved(cluster, placed, its_shards, victim), timeout=60)
    handed = time.monotonic() - started
    logs = operator_log(cluster)
    print("\n".join(line for line in logs.splitlines() if victim in line)[-3000:])
    for database, shard in its_shards:
        assert f"{database}/{shard}: leader {victim} is stopping; " in logs, logs[-6000:]
        assert f"{database}/{shard}: leader {victim} is gone" not in logs, logs[-6000:]
    found = back_ready(cluster, pod_of[victim], old_uid)
    assert site_of_pod(found["status"])[pod_of[victim]] == victim
    print(f"\n{len(its_shards)} leaderships handed over {handed:.1f} s after the delete; "
          f"back and Ready {time.monotonic() - started:.1f} s after it")


@pytest.mark.timeout(900)
def test_scale_up_under_load(cluster: RealKubeCluster, load: ShardLoad, tmp_path: Path) -> None:
    load.start()
    assert more_acknowledged(load.history, 100, 60), load.history.summary()
    unpin_sites(cluster)
    watch_path = tmp_path / "watch.txt"
    with watch_path.open("w") as into:
        watch = subprocess.Popen(
            [str(kube_binary("kubectl")), "get", "-n", NAMESPACE, "replicatransitions",
             "-w", "--no-headers", "-o",
             "custom-columns=NAME:.metadata.name,PHASE:.status.phase"],
            stdout=into, stderr=subprocess.STDOUT, text=True, env=cluster.plane.env())
    try:
        started = time.monotonic()
        phases = Phases(cluster)
        cluster.plane.kubectl("scale", "-n", NAMESPACE, "durablestorage", NAME, "--replicas=5")
        found = wait(cluster, "5 sites ready, rebalanced", lambda: phases.ready(5))
        took = time.monotonic() - started
        items = cluster.get_json(NAMESPACE, "replicatransitions")["items"]
        names = {item["metadata"]["name"] for item in items}
        wait_for("the watch to show every step Done", lambda: all(
            watched(watch_path).get(name, [""])[-1] == "Done" for name in names),
            timeout=30, explain=watch_path.read_text)
    finally:
        watch.terminate()
        watch.wait(10)
    assert items and all(item["status"]["phase"] == "Done" for item in items), items
    assert "Degraded" not in phases.seen and not phases.warnings_since(), (
        phases.seen, phases.warnings_since())
    shown_phases = watched(watch_path)
    # Every step went through its phases (an Add caught up and joined, a Remove
    # removed), as `kubectl get -w` showed them.
    for item in items:
        shown = shown_phases[item["metadata"]["name"]]
        assert shown[0] == "Pending" and shown[-1] == "Done", shown
        assert ("Joined" if item["spec"]["action"] == "Add" else "Removing") in shown, shown
    new = {site_of_pod(found["status"])[f"{NAME}-{n}"] for n in (3, 4)}
    held = {site for shard in every_shard(found["status"]).values()
            for site in shard["replicas"]}
    assert held & new
    # Five sites in three zones: every shard's three replicas in three zones, though
    # the balance alone would take some off the one site of zone-c (issue 23).
    zones = wait(cluster, "each site's zone in status", lambda: zones_shown(cluster), timeout=60)
    placed = placed_replicas(storage(cluster)["status"])
    assert len(set(zones.values())) == 3, zones
    assert all(len({zones[site] for site in replicas}) == 3 for replicas in placed.values()), \
        (zones, placed)
    assert more_acknowledged(load.history, 50, 60), load.history.summary()
    print(f"\n3 -> 5 sites with {len(items)} ReplicaTransitions done in {took:.1f} s")


@pytest.mark.timeout(900)
def test_scale_down_resumes_after_the_operator_is_killed(
        cluster: RealKubeCluster, load: ShardLoad) -> None:
    before = {item["metadata"]["name"]
              for item in cluster.get_json(NAMESPACE, "replicatransitions")["items"]}
    departing = {site_of_pod(storage(cluster)["status"])[f"{NAME}-{n}"] for n in (3, 4)}
    started = time.monotonic()
    cluster.plane.kubectl("scale", "-n", NAMESPACE, "durablestorage", NAME, "--replicas=3")

    def mid_plan() -> list[dict[str, Any]] | None:
        made = [item for item in cluster.get_json(NAMESPACE, "replicatransitions")["items"]
                if item["metadata"]["name"] not in before]
        phases = [item.get("status", {}).get("phase") for item in made]
        return made if "Done" in phases and "Pending" in phases else None
    made = wait(cluster, "the drain under way", mid_plan)
    pending = [item["metadata"]["name"] for item in made
               if item["status"]["phase"] == "Pending"]
    killed = operator_pod(cluster)
    cluster.kill_container(killed)

    def restarted() -> bool:
        pod = operator_pod(cluster)
        status = pod["status"]["containerStatuses"][0]
        return status["restartCount"] > killed["status"]["containerStatuses"][0][
            "restartCount"] and bool(status.get("ready"))
    wait(cluster, "the operator's container restarted", restarted)
    found = wait(cluster, "drained and shrunk to 3", lambda: ready_with(cluster, 3))
    took = time.monotonic() - started
    assert "resuming a plan" in operator_log(cluster), operator_log(cluster)[-6000:]
    after = {item["metadata"]["name"]: item
             for item in cluster.get_json(NAMESPACE, "replicatransitions")["items"]}
    assert all(after[name]["status"]["phase"] == "Done" for name in pending), after
    held = {site for shard in every_shard(found["status"]).values()
            for site in shard["replicas"]}
    assert not held & departing
    assert cluster.get_json(NAMESPACE, "statefulset", NAME)["spec"]["replicas"] == 3
    pin_sites(cluster)
    assert more_acknowledged(load.history, 50, 60), load.history.summary()
    print(f"\n5 -> 3 sites, the operator killed mid-plan, done in {took:.1f} s")


@pytest.mark.timeout(900)
def test_a_config_change_rolls_the_sites_without_failover(
        cluster: RealKubeCluster, load: ShardLoad) -> None:
    before = {name: pod["metadata"]["uid"] for name, pod in pods(cluster).items()}
    log_before = len(operator_log(cluster))
    phases = Phases(cluster)
    started = time.monotonic()
    cluster.plane.kubectl("patch", "-n", NAMESPACE, "durablestorage", NAME, "--type=merge",
                          "-p", json.dumps({"spec": {"cluster": {"handoverTimeout": "15s"}}}))

    def rolled() -> dict[str, Any] | None:
        now = pods(cluster)
        if len(now) != 3 or any(now[name]["metadata"]["uid"] == uid
                                for name, uid in before.items()):
            return None
        return phases.ready(3)
    # Sampled all along: at most one site's pod is not ready at any time.
    not_ready_together = 0

    def rolled_one_at_a_time() -> dict[str, Any] | None:
        nonlocal not_ready_together
        down = [name for name, pod in pods(cluster).items() if not any(
            condition["type"] == "Ready" and condition["status"] == "True"
            for condition in pod["status"].get("conditions", []))]
        not_ready_together = max(not_ready_together, len(down))
        return rolled()
    found = wait(cluster, "every site rolled and the storage Ready", rolled_one_at_a_time)
    took = time.monotonic() - started
    ended = time.monotonic()
    assert not_ready_together <= 1, not_ready_together
    assert "Degraded" not in phases.seen and not phases.warnings_since(), (
        phases.seen, phases.warnings_since())
    logs = operator_log(cluster)[log_before:]
    # Every leadership was handed over: none failed over (decisions.failovers' notes).
    assert not FAILOVER.search(logs), logs[-6000:]
    assert set(site_of_pod(found["status"])) == set(before)
    pauses = {publisher.name: publisher.longest_pause(started, ended)
              for publisher in load.publishers}
    print(f"\nconfig roll of 3 sites in {took:.1f} s; longest acknowledgement pause per "
          f"publisher: {pauses}")
    assert all(pause < ROLL_PAUSE_LIMIT for pause in pauses.values()), pauses
    assert all_connected([*load.publishers, load.subscriber], 60)
    assert more_acknowledged(load.history, 50, 60), load.history.summary()


@pytest.mark.timeout(600)
def test_a_killed_container_is_restarted_and_its_shards_led_again(
        cluster: RealKubeCluster, load: ShardLoad) -> None:
    """`kill -9` of the container of a site leading shards. The kubelet restarts it
    at once, usually before the operator takes the site for gone (3 missed
    heartbeats): the site then takes its leaderships back itself (at its kept epoch,
    once a majority of each shard's replicas answers); else the operator fails them
    over to another replica at a higher epoch. Either way every shard is led again,
    by a site that serves it, and the history check (below) finds nothing lost."""
    pod_of, before, victim, its_shards = leading_victim(storage(cluster)["status"])
    pod = pods(cluster)[pod_of[victim]]
    restarts = str(pod["status"]["containerStatuses"][0]["restartCount"])
    acknowledged = {publisher.name: len(publisher.acknowledged_at)
                    for publisher in load.publishers}
    started = time.monotonic()
    cluster.kill_container(pod)
    found = back_ready(cluster, pod_of[victim], restarts, field="restarts")
    took = time.monotonic() - started
    assert site_of_pod(found["status"])[pod_of[victim]] == victim
    now = every_shard(found["status"])
    failed_over = {key for key in its_shards if now[key]["leader"] != victim}
    assert all(now[key]["leaderEpoch"] > before[key]["leaderEpoch"] for key in failed_over)
    # Each publisher writes to a shard of its own: every one goes on being acknowledged.
    wait(cluster, "every publisher acknowledged again", lambda: all(
        len(publisher.acknowledged_at) > acknowledged[publisher.name] + 20
        for publisher in load.publishers), timeout=60)
    print(f"\nkill -9 of {pod_of[victim]}: restarted and Ready in {took:.1f} s; of its "
          f"{len(its_shards)} leaderships {len(failed_over)} failed over, the others "
          f"taken back by the restarted site")


@pytest.mark.timeout(300)
def test_nothing_acknowledged_lost(load: ShardLoad) -> None:
    assert load.started
    assert stop_and_drain(load.publishers, 60), load.history.summary()
    wait_delivered(load.history)
    print(load.history.summary())
    problems = load.history.problems_by_kind()
    assert not problems, {kind: lines[:5] for kind, lines in problems.items()}
    assert len(load.history.acknowledged_messages()) >= 500, load.history.summary()


@pytest.mark.timeout(900)
def test_recreated_over_its_volumes_it_comes_back_with_its_data(
        cluster: RealKubeCluster, load: ShardLoad) -> None:
    load.close()
    host = pods(cluster)[CLIENT_POD]["status"]["podIP"]
    writer = PahoClient(1883, "rs-retainer", host=host)
    try:
        assert writer.connect().reason_code == 0
        for shard in range(4):
            assert writer.publish(f"kept/{shard}", f"kept {shard}".encode(), qos=1,
                                  retain=True) == 0
    finally:
        writer.stop()
    started = time.monotonic()
    cluster.plane.kubectl("delete", "-n", NAMESPACE, "durablestorage", NAME, "--wait=true",
                          "--timeout=120s", timeout=150)
    wait(cluster, "the sites' pods gone", lambda: not pods(cluster), timeout=120)
    print(f"\nthe storage deleted and its pods gone in {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    cluster.plane.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME}, "spec": SPEC}))
    wait(cluster, "Ready again over the volumes", lambda: ready_with(cluster, 3))
    took = time.monotonic() - started
    events = cluster.plane.kubectl("get", "events", "-n", NAMESPACE, "--field-selector",
                                   "reason=PlacementAdopted", "-o", "json").stdout
    assert json.loads(events)["items"], "no PlacementAdopted event"
    host = pods(cluster)[CLIENT_POD]["status"]["podIP"]
    reader = PahoClient(1883, "rs-reader", host=host)
    try:
        assert reader.connect().reason_code == 0
        assert reader.subscribe("kept/#", qos=1) == [1]
        got = sorted(message.payload for message in reader.expect(4))
        assert got == [f"kept {shard}".encode() for shard in range(4)], got
    finally:
        reader.stop()
    print(f"\nre-created over its volumes: Ready with its data in {took:.1f} s")


@pytest.mark.timeout(300)
def test_helm_uninstall_completes(cluster: RealKubeCluster) -> None:
    cluster.plane.kubectl("delete", "-n", NAMESPACE, "durablestorage", NAME, "--wait=true",
                          "--timeout=120s", timeout=150)
    result = cluster.plane.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait",
                                "--timeout=120s", check=False, timeout=150)
    assert result.returncode == 0, result.stderr
    wait(cluster, "every pod gone", lambda: not cluster.get_json(NAMESPACE, "pods")["items"],
         timeout=120)
