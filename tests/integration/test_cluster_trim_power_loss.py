"""A follower trims its log no further than what its shard holds durably (issue 22,
"follower trimming uses the in-memory applied offset").

Without `sync_writes` (the default) a shard's writes reach its RocksDB log unsynced,
while the shard log's own writes are synced. A replica that trimmed its log up to its
in-memory applied offset and then lost power came back with a shard applied below its
log's start: the entries in between were gone from both, so its applier failed on
every try and the replica never caught up (its leader saw a log that ended in the
right place and did not bootstrap it).

Three sites, one shard, `cluster.log_retain_entries` 1, each site run with the sync
journal of `tests/support/powerloss.py`. A few hundred QoS 1 messages make every
replica trim; a follower is killed -9 and loses what it never synced, then restarts:
it must apply the rest from its own log (no bootstrap), and its content must equal
the other replicas'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.cluster import DB, Cluster, poll
from tests.support import powerloss
from tests.support.clients import PahoClient

pytestmark = pytest.mark.cluster

MESSAGES = 300
SITE_CONFIG: dict[str, Any] = {"cluster": {"log_retain_entries": 1}}


def shard_report(cluster: Cluster, index: int) -> dict[str, Any]:
    return next(s for s in cluster.sites[index].replication()["shards"]
                if s["db"] == DB and s["shard"] == 0)


def test_a_follower_that_lost_power_after_trimming_applies_the_rest_from_its_log(
        tmp_path: Path) -> None:
    library = powerloss.build_shim(tmp_path)
    cluster = Cluster(tmp_path, 3, n_shards=1, site_config=SITE_CONFIG)
    for site in cluster.sites:
        site.wrapper = powerloss.wrapper(library, site.workdir / "sync-journal")
    try:
        cluster.start()
        leader = cluster.leaders()[0]
        follower = next(index for index in range(3) if index != leader)
        site = cluster.sites[follower]
        publisher = PahoClient(cluster.sites[leader].port, "trim-pub",
                               host=cluster.sites[leader].host)
        publisher.connect()
        for number in range(MESSAGES):
            publisher.publish("trim/t", str(number).encode(), qos=1)
        publisher.disconnect()
        assert poll(lambda: shard_report(cluster, follower)["log_start"] > 100, 30), \
            cluster.describe()
        before = shard_report(cluster, follower)
        site.kill()
        lost = powerloss.lose_unsynced(site.workdir / "data", site.workdir / "sync-journal")
        site.start()
        restarted = shard_report(cluster, follower)
        caught_up = poll(lambda: shard_report(cluster, follower)["applied"]
                         == shard_report(cluster, leader)["applied"], 30, 0.2)
        after = shard_report(cluster, follower)
        same = cluster.same_content(DB)
        site_log = site.log()
        tracebacks = cluster.tracebacks()
    finally:
        cluster.close()
    print(f"\nfollower before the power loss: applied {before['applied']}, log from "
          f"{before['log_start']} to {before['last'][1]}\nunsynced bytes lost: {lost}\n"
          f"restarted: applied {restarted['applied']}, log from {restarted['log_start']}\n"
          f"after: applied {after['applied']}, bootstraps {after['bootstraps']}")
    assert lost, "the power loss cut nothing: the test shows nothing"
    assert restarted["applied"] + 1 >= restarted["log_start"], \
        f"the shard holds less than the log was trimmed to: {restarted}"
    assert caught_up, f"the follower never caught up: {after}\n{site_log[-3000:]}"
    assert after["bootstraps"] == 0, after
    assert same
    assert not any(tracebacks.values()), tracebacks
