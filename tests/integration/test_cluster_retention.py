"""Retention across sites (issue 7, with the retention guarantee of issue "One site
you can trust"): when a shard's leader drops a generation, a durable session on a
site that holds no replica of the shard loses the messages of it that it had not
read, as it would on a replica, and never silently: its own site counts them in
`stratamq_session_messages_expired_total{reason="retention"}` and logs them (the
leader asks that site before the drop, and the site reads what its sessions had not
read at a replica while it is still there), then prunes the session's state of that
generation, so the session resumes and later messages arrive."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes

from harness.cluster import Cluster, http_json
from stratamq.broker.ds.shard_set import shard_of
from tests.support.clients import PahoClient, metric_value, paho_properties, unique

pytestmark = pytest.mark.cluster

RETENTION = "2s"
LOST = 5
N_SHARDS = 3
SITES = 3


def client_id_on_site(prefix: str, cluster: Cluster, site: int) -> str:
    """A client id whose messages go to a shard held by `site` only."""
    held = cluster.replicas()
    for _ in range(10_000):
        candidate = unique(prefix)
        if held[shard_of(candidate, N_SHARDS)] == [site]:
            return candidate
    raise AssertionError(f"no client id whose shard is held by site {site}: {held}")


def generations_at(cluster: Cluster, site: int, shard: int) -> list[int]:
    view = http_json("GET", f"{cluster.sites[site].admin_url}/api/v1/ds/storages/messages")
    return next([generation["id"] for generation in found["generations"]]
                for found in view["shards"] if found["id"] == shard)


def test_a_remote_shards_retention_loss_is_counted_where_the_session_lives(
        tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, SITES, n_shards=N_SHARDS, replication_factor=1,
                      site_config={"durable_sessions":
                                   {"message_retention_period": RETENTION}})
    clients: list[PahoClient] = []
    try:
        cluster.start()
        here, holder = cluster.sites[0], cluster.sites[1]
        publisher_id = client_id_on_site("far-pub", cluster, 1)
        shard = shard_of(publisher_id, N_SHARDS)
        subscriber_id = unique("far-sub")
        topic = unique("far") + "/t"
        expiry = paho_properties(PacketTypes.CONNECT, SessionExpiryInterval=3600)

        subscriber = PahoClient(here.port, subscriber_id, host=here.host)
        clients.append(subscriber)
        assert subscriber.connect(clean_start=False, properties=expiry).reason_code == 0
        assert subscriber.subscribe(topic, 1) == [1]
        subscriber.client.disconnect()
        subscriber.client.loop_stop()
        expired_before = metric_value(here, "stratamq_session_messages_expired_total",
                                      reason="retention")

        publisher = PahoClient(holder.port, publisher_id, host=holder.host)
        clients.append(publisher)
        assert publisher.connect().reason_code == 0
        for number in range(LOST):
            assert publisher.publish(topic, b"doomed-%d" % number, 1) == 0
        # read after publishing: a rollover in between only makes the wait longer
        doomed_generation = max(generations_at(cluster, 1, shard))
        deadline = time.monotonic() + 30
        while min(generations_at(cluster, 1, shard)) <= doomed_generation:
            assert time.monotonic() < deadline, "the generation was never dropped"
            time.sleep(0.2)

        # Counted where the session lives (the drop waited for it), and logged.
        expired = metric_value(here, "stratamq_session_messages_expired_total",
                               reason="retention") - expired_before
        assert expired == LOST, f"{expired} of {LOST} lost messages counted on site 0"
        assert any(subscriber_id in line and "retention" in line
                   for line in here.log().splitlines()), \
            "the session's loss was not logged on its site"

        again = PahoClient(here.port, subscriber_id, host=here.host)
        clients.append(again)
        connack = again.connect(clean_start=False, properties=expiry)
        assert (connack.reason_code, connack.session_present) == (0, True)
        later = [b"later-%d" % number for number in range(3)]
        for payload in later:
            assert publisher.publish(topic, payload, 1) == 0
        assert [message.payload for message in again.expect(len(later))] == later
        again.quiet()
    finally:
        for client in clients:
            client.client.loop_stop()
        cluster.close()
