"""A restarted site is not ready until its replicas have caught up (issue 21, "a
config change rolls the sites one at a time ... the next one waiting until the
restarted site's replicas have caught up").

A StatefulSet's rolling update stops the next pod once the restarted one is Ready; a
site that said Ready as soon as it listened let a roll stop a second replica of a
shard while the first still lacked entries, leaving the shard's leader without the
majority it needs to commit. Here a site is killed and started again while the two
other sites (the leaders of the shards it follows) are frozen: it serves, but its
`/readyz` says 503 with `replicas` failing, and its replication status names the
shards it is catching up on, until the others thaw and their leaders' appends bring
it up to their commit offsets."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.cluster import Cluster, poll

pytestmark = pytest.mark.cluster

# Slow heartbeats: the controller takes the frozen sites for gone only after several,
# and fails nothing over meanwhile (it could not: they are two of three replicas).
HEARTBEAT = 2.0
FROZEN_FOR = 4.0  # seconds the restarted site is watched while the others are frozen


def readyz(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path, sites=3, n_shards=2, heartbeat_interval=HEARTBEAT)
    try:
        yield made.start()
    finally:
        made.close()


def test_a_restarted_site_is_ready_only_once_its_replicas_caught_up(
        cluster: Cluster) -> None:
    site = cluster.sites[2]
    others = cluster.sites[:2]
    assert poll(lambda: readyz(site.admin_url)[0] == 200, 30), readyz(site.admin_url)
    # Replication factor 3 of 3 sites: it holds every shard, following most of them.
    # Those it led it cannot lead again without a majority either: none is ready.
    held = {(shard["db"], shard["shard"]) for shard in site.replication()["shards"]
            if shard["role"] != "none"}
    assert len(held) == 6, cluster.describe()

    site.kill()
    for other in others:
        os.kill(other.pid, signal.SIGSTOP)
    try:
        cluster.restart(2)
        assert poll(lambda: readyz(site.admin_url)[1]["checks"]["listeners"] == "ok", 30)
        watched_until = time.monotonic() + FROZEN_FOR
        while time.monotonic() < watched_until:
            status, body = readyz(site.admin_url)
            assert status == 503 and body["checks"] == {
                "storage": "ok", "listeners": "ok", "running": "ok",
                "replicas": "failing"}, body
            catching_up = {(shard["db"], shard["shard"])
                           for shard in site.replication()["shards"] if shard["catching_up"]}
            assert catching_up == held, (catching_up, held)
            time.sleep(0.5)
    finally:
        for other in others:
            os.kill(other.pid, signal.SIGCONT)
    # Thawed, the leaders' next appends bring it up to their commit offsets.
    assert poll(lambda: readyz(site.admin_url)[0] == 200, 30), (
        readyz(site.admin_url), cluster.describe())
    assert not any(shard["catching_up"] for shard in site.replication()["shards"])
