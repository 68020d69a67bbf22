"""Zones reach the planner (issue 23): four real sites and a real controller,
replication factor 2, sites 0 and 1 in zone x, 2 and 3 in zone y (`cluster.zone`).
Their ids are chosen so that the zone-free placement puts shards on sites 0 and 1
(both in x); with the zones each shard of every database has one replica in each."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from harness.cluster import Cluster, ctl_ds
from stratamq.broker.config import merge_config
from stratamq.broker.ds.site_id import SITE_ID_FILE

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ZONES = ["x", "x", "y", "y"]
DATABASES = ["messages", "retained", "sessions"]


def test_each_shard_has_a_replica_in_each_zone(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, len(ZONES), n_shards=4, replication_factor=2)
    for index, (site, zone) in enumerate(zip(cluster.sites, ZONES, strict=True)):
        # Ids in index order: the round-robin placement without zones pairs 0-1, 2-3.
        data_dir = Path(site.config["durable_storage"]["messages"]["data_dir"])
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / SITE_ID_FILE).write_text(f"{index:016X}\n")
        site.config = merge_config(site.config, {"cluster": {"zone": zone}})
        site.config_path.write_text(yaml.safe_dump(site.config))
    try:
        cluster.start()
        assert [site.replication()["zone"] for site in cluster.sites] == ZONES
        for database in DATABASES:
            replicas = cluster.replicas(database)
            assert len(replicas) == 4
            for shard, sites in replicas.items():
                assert sorted(ZONES[site] for site in sites) == ["x", "y"], (
                    database, shard, sites)
        # `ctl ds info` says each site's zone.
        info = ctl_ds(cluster, "info")
        for index, zone in enumerate(ZONES):
            [row] = [line for line in info.splitlines() if line.startswith(f"{index:016X} ")]
            assert row.split()[1:3] == ["up", zone], info
    finally:
        cluster.close()
