"""A controller restarted from an older copy of its data folder (issue 22, defect 2;
docs/replication.md, "A controller behind the sites").

Three sites, replication factor 3, and a controller whose folder is copied (the
backup); the placement then moves on (the site leading a messages shard is killed,
the shard fails over, the site comes back). The controller is stopped, the backup
put in place of its folder and the controller started again. It must adopt the
newer placement the sites hold (not push or fail over from its own, which the sites
refuse), so that when the leader of a messages shard is killed next, the shard fails
over and QoS 1 writes to it through another site are acknowledged again. How long the
restored controller took to adopt the sites' placement and how long writes took to
resume are printed, never asserted beyond wide bounds.

A second controller on the same data folder exits at once with a one-line error."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.cluster import Cluster, ControllerProcess, http_json, poll
from harness.processes import REPO
from stratamq.broker.ds.shard_set import shard_of
from tests.support.clients import PahoClient, unique

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SITES = 3
N_SHARDS = 2
RESUME_WITHIN = 30.0  # seconds; without the fix writes never resume


def client_for_shard(shard: int) -> str:
    while True:
        client_id = unique("stale")
        if shard_of(client_id, N_SHARDS) == shard:
            return client_id


def acknowledged_within(host: str, port: int, client_id: str, timeout: float) -> float | None:
    """Seconds until a QoS 1 publish of `client_id` is acknowledged (reconnecting
    as needed), or None."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        client = PahoClient(port, client_id, host=host)
        try:
            if client.connect().reason_code == 0 and \
                    client.publish("stale/t", b"x", qos=1) == 0:
                return time.monotonic() - began
        except Exception:  # no CONNACK or PUBACK in time: try again
            pass
        finally:
            client.stop()
        time.sleep(0.2)
    return None


def site_version(cluster: Cluster) -> int:
    return max(site.replication()["placement_version"] or 0 for site in cluster.sites
               if site.alive())


def real_leaders(cluster: Cluster) -> dict[int, int]:
    """messages shard -> index of the site that reports it leads it."""
    found = {}
    for site in cluster.sites:
        for shard in site.replication()["shards"]:
            if shard["db"] == "messages" and shard["role"] == "leader":
                found[shard["shard"]] = site.index
    return found


def test_a_controller_restored_from_an_old_copy_adopts_the_sites_placement(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, SITES, n_shards=N_SHARDS)
    controller = cluster.controller
    state = controller.workdir / "state"
    backup = tmp_path / "controller-backup"
    report: list[str] = []
    try:
        cluster.start()
        shutil.copytree(state, backup)
        old_version = site_version(cluster)
        # what a site keeps, as a controller adopts it (with the admin token only)
        url = f"{cluster.sites[0].admin_url}/api/v1/ds/placement"
        held = http_json("GET", url)
        assert held["placement"]["version"] == old_version
        assert set(held["peers"]) == set(cluster.site_ids)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        assert refused.value.code == 401

        # the placement moves on: a messages leader fails over and comes back
        first = cluster.leaders()[0]
        cluster.sites[first].kill()
        assert cluster.wait_leaders_moved(first, [0], 30), cluster.describe()
        cluster.restart(first)
        assert cluster.wait_ready(60), cluster.describe()
        new_version = site_version(cluster)
        assert new_version > old_version

        # the controller comes back from the backup
        controller.kill()
        shutil.rmtree(state)
        shutil.copytree(backup, state)
        restored_at = time.monotonic()
        controller.start()
        adopted = poll(lambda: controller.storage()["placement_version"] >= new_version, 20)
        adopted_after = time.monotonic() - restored_at
        report.append(f"placement version {old_version} in the backup, {new_version} on "
                      f"the sites; restored controller " + (
                          f"holds {new_version} after {adopted_after:.2f}s" if adopted
                          else "never took the sites' version"))

        with urllib.request.urlopen(f"{controller.url}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert "stratamq_cluster_placement_adoptions_total 1.0" in metrics, metrics

        # the leader the sites follow now is killed
        time.sleep(1.0)  # a few rounds of the restored controller
        leaders = real_leaders(cluster)
        victim = leaders[0]
        other = next(site for site in cluster.sites if site.index != victim)
        cluster.sites[victim].kill()
        resumed = acknowledged_within(other.host, other.port, client_for_shard(0),
                                      RESUME_WITHIN)
        report.append(f"site-{victim} (leader of messages/0) killed; writes to it through "
                      f"site-{other.index} " + (
                          f"acknowledged again after {resumed:.2f}s" if resumed is not None
                          else f"not acknowledged within {RESUME_WITHIN:.0f}s"))
        final = cluster.describe()
        controller_log = controller.log()
    finally:
        cluster.close()
    print("\n" + "\n".join(report))
    assert resumed is not None, f"{report}\n{final}\n{controller_log[-4000:]}"
    assert adopted, f"{report}\n{final}"
    assert "adopt" in controller_log, controller_log[-4000:]
    assert "Traceback" not in controller_log, controller_log[-4000:]


def test_a_second_controller_on_the_same_folder_exits_with_a_clear_error(
        tmp_path: Path) -> None:
    first = ControllerProcess(tmp_path, "127.0.0.1", [], replication_factor=1, n_shards=1,
                              heartbeat_interval=0.5)
    try:
        first.start()
        second = ControllerProcess(tmp_path / "second", "127.0.0.1", [],
                                   replication_factor=1, n_shards=1, heartbeat_interval=0.5)
        command = [arg if arg != str(second.workdir / "state") else str(tmp_path / "state")
                   for arg in second.command()]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60,
                              check=False)
        assert first.alive()
    finally:
        first.kill()
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "another controller" in lines[0] and str(tmp_path / "state") in lines[0], lines
