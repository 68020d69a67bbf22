"""`stratamq ctl ds verify` (issue 22, "Content digests"): three real sites and a
controller. After some QoS 1 publishes every shard's replicas hold the same content,
and verify says so (exit status 0). Then one follower's copy of a shard is changed
while its site is stopped (one record put into its RocksDB, as a bug or a disk could),
the site started again: its log offsets still match the others', but verify names
exactly that replica of that shard and exits with 1."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from harness.cluster import DB, Cluster
from harness.waiting import wait_until
from stratamq.broker.ds.shard_set import shard_of
from tests.support.clients import PahoClient

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

N_SHARDS = 2
MESSAGES = 20


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    running = Cluster(tmp_path, 3, n_shards=N_SHARDS).start()
    try:
        yield running
    finally:
        running.close()


def ctl_verify(cluster: Cluster, *arguments: str) -> subprocess.CompletedProcess[str]:
    controller = cluster.controller
    return subprocess.run(
        [sys.executable, "-m", "stratamq.broker", "ctl", "ds", "verify", *arguments,
         "--url", controller.url, "--token-file", str(controller.token_file)],
        capture_output=True, text=True, timeout=120, check=False)


def put_record_offline(shard_folder: Path, key: bytes, value: bytes) -> None:
    """Write one record straight into a stopped site's shard RocksDB (its metadata
    family, where records live)."""
    families = Rdict.list_cf(str(shard_folder), Options(raw_mode=True))
    db = Rdict(str(shard_folder), Options(raw_mode=True),
               column_families={name: Options(raw_mode=True) for name in families
                                if name != "default"})
    try:
        db[b"rec/" + key] = value
    finally:
        db.close()


def test_verify_names_the_replica_whose_content_differs(cluster: Cluster) -> None:
    site = cluster.sites[0]
    publisher = PahoClient(site.port, "verify-publisher", host=site.host)
    assert publisher.connect().reason_code == 0
    try:
        for number in range(MESSAGES):
            assert publisher.publish(f"verify/{number}", b"payload %d" % number, qos=1) == 0
    finally:
        publisher.stop()
    shard = shard_of("verify-publisher", N_SHARDS)
    assert wait_until(cluster.converged, 60), cluster.describe()

    same = ctl_verify(cluster)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "all replicas of" in same.stdout and "DIFFER" not in same.stdout, same.stdout

    follower = next(index for index in range(3) if index != cluster.leaders()[shard])
    victim = cluster.sites[follower]
    victim.kill()
    put_record_offline(victim.workdir / "data" / DB / str(shard), b"planted", b"by the test")
    victim.start()
    assert cluster.wait_ready(60), cluster.describe()
    offsets_agree = wait_until(lambda: len({cluster.positions()[index][shard][2]
                                            for index in range(3)}) == 1, 60)
    assert offsets_agree, cluster.describe()

    differ = ctl_verify(cluster, DB)
    victim_id = cluster.site_ids[follower]
    print(differ.stdout)
    assert differ.returncode == 1, differ.stdout + differ.stderr
    assert f"{DB}/{shard} on {victim_id}: digest" in differ.stdout, differ.stdout
    found = json.loads(ctl_verify(cluster, DB, "--json").stdout)
    verdicts = {verdict["shard"]: verdict for verdict in found["shards"]}
    assert not found["same"] and set(verdicts) == {f"{DB}/{n}" for n in range(N_SHARDS)}
    changed = verdicts.pop(f"{DB}/{shard}")
    assert (changed["status"], changed["odd"]) == ("differ", [victim_id]), changed
    assert all(verdict["status"] == "same" for verdict in verdicts.values()), verdicts
    assert not cluster.converged()
