"""A bootstrap request from a leader that is not (or no longer) the shard's leader
cannot roll a follower back (issue 22, "a bootstrap request carries no epoch").

Three sites, one shard, replication factor 2: one site holds no replica of the shard,
so its copy is empty (applied offset 0), like the checkpoint of a deposed leader far
behind. A few QoS 1 messages are acknowledged; then the follower is asked on its peer
port, as a leader would ask it, to bootstrap from that site:

- with an epoch older than the follower's: refused before anything is fetched;
- with the current epoch: the checkpoint comes, but its position is below what the
  follower has applied, so it is refused, its staged folder removed, the refusal
  counted (`stratamq_ds_log_cuts_refused_total`, as any refused cut of applied
  entries) and logged.

The stale request is counted too (`stratamq_ds_bootstraps_refused_total`).

Either way the follower keeps its data and log (nothing it acknowledged is reset),
and the replicas still hold the same content."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.cluster import DB, Cluster, poll
from tests.support.clients import PahoClient

pytestmark = pytest.mark.cluster

MESSAGES = 20


def ask_bootstrap(site_host: str, peer_port: int, source: str, epoch: int | None
                  ) -> tuple[int, dict[str, Any]]:
    """POST a bootstrap request to a site's peer port, as a shard's leader does: the
    status and, for a 200 (lines of progress, then the outcome), the last line."""
    body: dict[str, Any] = {"from": source}
    if epoch is not None:
        body["epoch"] = epoch
    request = urllib.request.Request(
        f"http://{site_host}:{peer_port}/peer/v1/bootstraps/{DB}/0",
        data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read().splitlines()[-1])
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def counter(cluster: Cluster, index: int, name: str) -> float:
    """A counter of shard 0 of `messages` on a site, from its `/metrics` (0 when it
    is not there yet)."""
    with urllib.request.urlopen(f"{cluster.sites[index].admin_url}/metrics",
                                timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series == f'{name}{{db="{DB}",shard="0"}}':
            return float(value)
    return 0.0


def shard_report(cluster: Cluster, index: int) -> dict[str, Any]:
    return next(s for s in cluster.sites[index].replication()["shards"]
                if s["db"] == DB and s["shard"] == 0)


def test_a_bootstrap_below_the_followers_epoch_or_applied_offset_is_refused(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, 3, n_shards=1, replication_factor=2)
    try:
        cluster.start()
        leader = cluster.leaders()[0]
        replicas = cluster.replicas()[0]
        follower = next(index for index in replicas if index != leader)
        outsider = next(index for index in range(3) if index not in replicas)
        start = shard_report(cluster, leader)["applied"]
        publisher = PahoClient(cluster.sites[leader].port, "epochs-pub",
                               host=cluster.sites[leader].host)
        publisher.connect()
        for number in range(MESSAGES):
            publisher.publish("epochs/t", str(number).encode(), qos=1)
        publisher.disconnect()
        assert poll(lambda: shard_report(cluster, follower)["applied"]
                    == shard_report(cluster, leader)["applied"] > start, 20), \
            cluster.describe()
        before = shard_report(cluster, follower)
        site = cluster.sites[follower]
        out = cluster.sites[outsider]
        source = f"{out.host}:{out.peer_port}"

        stale = ask_bootstrap(site.host, site.peer_port, source, before["epoch"] - 1)
        after_stale = shard_report(cluster, follower)
        current = ask_bootstrap(site.host, site.peer_port, source, before["epoch"])
        after_current = shard_report(cluster, follower)
        refused = {name: counter(cluster, follower, name)
                   for name in ("stratamq_ds_bootstraps_refused_total",
                                "stratamq_ds_log_cuts_refused_total")}
        staged = sorted(str(path) for path in (tmp_path / f"site-{follower}").rglob("*.staged"))
        same = cluster.same_content(DB)
        site_log = site.log()
        tracebacks = cluster.tracebacks()
    finally:
        cluster.close()
    print(f"\nfollower before: applied {before['applied']}, last {before['last']}, "
          f"epoch {before['epoch']}\nold epoch: {stale} -> applied "
          f"{after_stale['applied']}, bootstraps {after_stale['bootstraps']}\n"
          f"current epoch, checkpoint at 0: {current} -> applied {after_current['applied']}, "
          f"bootstraps {after_current['bootstraps']}\nrefused: {refused}")
    assert not any(tracebacks.values()), tracebacks
    assert stale[0] == 409 and stale[1]["error"] == "stale_epoch", stale
    assert current[0] == 200 and current[1]["error"] == "BootstrapRefusedError", current
    for after in (after_stale, after_current):
        assert after["bootstraps"] == 0, after
        assert after["applied"] >= before["applied"], after
        assert after["last"][1] >= before["last"][1], after
        assert after["log_start"] == before["log_start"], after
    assert refused == {"stratamq_ds_bootstraps_refused_total": 1.0,
                       "stratamq_ds_log_cuts_refused_total": 1.0}, refused
    assert "below what this replica has applied" in site_log, site_log[-3000:]
    assert not staged, staged
    assert same
