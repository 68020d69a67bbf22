"""Two controllers on different data folders over the same sites (issue 22, the
controller term; docs/replication.md, "The controller").

Three sites and a controller A; a second controller B is started later from a copy
of A's folder (a backup restored beside the running one, or an operator's mistake).
B takes a term above the one the sites hold; the sites keep it and refuse A's
pushes from then on, and A, which learns of the newer term, steps aside: it says so
in its log and on `/healthz`, and decides nothing more. The site leading messages/0
is then killed: exactly one controller (B) fails it over, once (the shard's epoch
moves by one), every live site keeps the same placement document, and QoS 1 writes
to the shard through another site are acknowledged again. The figures (how long A
took to step aside, how long writes took to resume) are printed, never asserted
beyond wide bounds."""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.cluster import Cluster, ControllerProcess, http_json, poll
from tests.integration.test_cluster_stale_controller import (
    N_SHARDS,
    acknowledged_within,
    client_for_shard,
    real_leaders,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SITES = 3
HEARTBEAT = 0.5
STEP_ASIDE_WITHIN = 15.0  # seconds; without the term A never does
RESUME_WITHIN = 30.0


def health(controller: ControllerProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{controller.url}/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def leader_changes(controller: ControllerProcess) -> float:
    with urllib.request.urlopen(f"{controller.url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    found = re.search(r"^stratamq_cluster_leader_changes_total (\S+)$", text, re.M)
    assert found is not None, text
    return float(found.group(1))


def held(cluster: Cluster, index: int) -> Any:
    return http_json("GET", f"{cluster.sites[index].admin_url}/api/v1/ds/placement")


def shard_epoch(placement: Any, db: str, shard: int) -> int:
    return int(next(entry["epoch"] for entry in placement["databases"][db]
                    if entry["shard"] == shard))


def test_a_second_controller_fences_the_first_and_only_it_fails_over(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, SITES, n_shards=N_SHARDS, heartbeat_interval=HEARTBEAT)
    first = cluster.controller
    second = ControllerProcess(tmp_path / "controller-b", "127.0.0.1", cluster.sites,
                               replication_factor=3, n_shards=N_SHARDS,
                               heartbeat_interval=HEARTBEAT)
    report: list[str] = []
    try:
        cluster.start()
        shutil.copytree(first.workdir / "state", second.workdir / "state")
        before = held(cluster, 0)["placement"]
        started = time.monotonic()
        second.start()
        stepped_aside = poll(lambda: health(first)[0] == 503, STEP_ASIDE_WITHIN, 0.2)
        report.append("controller A " + (
            f"stepped aside {time.monotonic() - started:.2f}s after B started"
            if stepped_aside else f"still pushing {STEP_ASIDE_WITHIN:.0f}s after B started"))
        changes_before = leader_changes(first), leader_changes(second)

        victim = real_leaders(cluster)[0]
        other = next(site for site in cluster.sites if site.index != victim)
        cluster.sites[victim].kill()
        resumed = acknowledged_within(other.host, other.port, client_for_shard(0),
                                      RESUME_WITHIN)
        report.append(f"site-{victim} (leader of messages/0) killed; writes through "
                      f"site-{other.index} " + (
                          f"acknowledged again after {resumed:.2f}s" if resumed is not None
                          else f"not acknowledged within {RESUME_WITHIN:.0f}s"))
        time.sleep(6 * HEARTBEAT)  # rounds enough for a second failover, were there one
        changes = (leader_changes(first) - changes_before[0],
                   leader_changes(second) - changes_before[1])
        report.append(f"leader changes after the kill: A {changes[0]:.0f}, B {changes[1]:.0f}")
        live = [site.index for site in cluster.sites if site.index != victim]
        documents = [held(cluster, index)["placement"] for index in live]
        epochs = [shard_epoch(document, "messages", 0) for document in documents]
        report.append(f"messages/0 epoch {shard_epoch(before, 'messages', 0)} before, "
                      f"{epochs} on the live sites after")
        status, said = health(first)
        first_log, second_log = first.log(), second.log()
        final = cluster.describe()
    finally:
        second.kill()
        cluster.close()
    print("\n" + "\n".join(report))
    context = f"{report}\n{final}\nA: {first_log[-3000:]}\nB: {second_log[-3000:]}"
    assert stepped_aside and status == 503 and "fenced" in said, context
    assert "fenced" in first_log, context
    assert changes[0] == 0 and changes[1] >= 1, context
    assert all(document == documents[0] for document in documents), context
    assert epochs[0] == shard_epoch(before, "messages", 0) + 1, context
    assert resumed is not None, context
    for text in (first_log, second_log):
        assert "Traceback" not in text, context


def test_two_controllers_started_at_once_end_with_one(tmp_path: Path) -> None:
    """Two fresh controllers over three fresh sites, started together (processes start
    a second or so apart, so the later one usually takes the higher number; the tie of
    numbers, broken by the controller id, is tested on a real site in
    test_replication_replica.py): one steps aside, the cluster is placed once (every
    site keeps the same placement and term) and neither takes another term."""
    cluster = Cluster(tmp_path, SITES, n_shards=N_SHARDS, heartbeat_interval=HEARTBEAT)
    controllers = [cluster.controller,
                   ControllerProcess(tmp_path / "controller-b", "127.0.0.1", cluster.sites,
                                     replication_factor=3, n_shards=N_SHARDS,
                                     heartbeat_interval=HEARTBEAT)]
    try:
        for site in cluster.sites:
            site.start()
        cluster.site_ids = [site.replication()["site"] for site in cluster.sites]
        for controller in controllers:
            controller.start()
        placed = cluster.wait_ready(60)
        one_fenced = poll(lambda: sorted(health(c)[0] for c in controllers) == [200, 503],
                          STEP_ASIDE_WITHIN, 0.2)
        time.sleep(4 * HEARTBEAT)
        healths = [health(controller) for controller in controllers]
        documents = [held(cluster, site.index) for site in cluster.sites]
        logs = [controller.log() for controller in controllers]
        final = cluster.describe()
    finally:
        controllers[1].kill()
        cluster.close()
    context = f"{healths}\n{final}\nA: {logs[0][-3000:]}\nB: {logs[1][-3000:]}"
    assert placed and one_fenced, context
    assert sorted(status for status, _ in healths) == [200, 503], context
    terms = [document["term"] for document in documents]
    assert all(term == terms[0] for term in terms), context
    assert all(document["placement"] == documents[0]["placement"] for document in documents), \
        context
    winner = next(said for status, said in healths if status == 200)
    assert json.loads(winner)["term"] == terms[0], context
    for text in logs:  # each took one term, at its start: no bump loop
        assert len(re.findall(r"controller term \S+ taken", text)) == 1, context
        assert "Traceback" not in text, context
