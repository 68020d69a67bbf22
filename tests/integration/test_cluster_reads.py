"""A deposed leader answers no reads (issue 22, "a deposed leader answers reads";
docs/replication.md, "Key-value reads and the read index").

Three sites and the controller behind the partition proxies (harness/netns.py).
The leader of the one `retained` shard is cut off from the other sites and from the
controller; an MQTT client already connected to it stays connected (clients go
direct). The controller fails the shard over, and a new retained value is set and
acknowledged on another site. The cut-off site never heard of the new leader, so it
still takes itself for the leader: a SUBSCRIBE there read its own copy at once and
got the old value, a read that misses an acknowledged write. A leader now confirms
it still leads (a majority answers a heartbeat sent after the read began) before a
read barrier passes, so the read fails instead (the retained messages are not sent,
as when their shard is out of reach) and after healing the site sends the new one."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest

from harness.cluster import Cluster
from harness.netns import open_network
from tests.support.clients import PahoClient, unique

pytestmark = pytest.mark.cluster

SITES = 3
WRITE_TIMEOUT = 2.0
WAIT = 30.0


def publish_retained(cluster: Cluster, index: int, topic: str, payload: bytes,
                     timeout: float) -> bool:
    """Set `topic`'s retained message on site `index`, trying again (a new client
    each time) until a PUBACK comes: the shard may be between leaders."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client = PahoClient(cluster.sites[index].port, unique("setter"),
                            host=cluster.sites[index].host)
        try:
            if client.connect().reason_code == 0 and \
                    client.publish(topic, payload, qos=1, retain=True) == 0:
                return True
        except (AssertionError, OSError):
            time.sleep(0.2)
        finally:
            client.stop()
    return False


def retained_within(client: PahoClient, topic: str, wait: float) -> list[bytes]:
    """Subscribe (without waiting for the SUBACK, which the retained read may hold
    up) and collect what arrives within `wait` seconds."""
    client.client.subscribe(topic, 1)
    got: list[bytes] = []
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        try:
            got.append(bytes(client.messages.get(timeout=left).payload))
        except queue.Empty:
            break
    return got


def test_a_deposed_leader_does_not_answer_a_read(tmp_path: Path) -> None:
    clients: list[PahoClient] = []
    with open_network(SITES + 1, force_proxy=True) as network:
        cluster = Cluster(tmp_path, SITES, n_shards=1, network=network,
                          site_config={"cluster": {"write_timeout": f"{WRITE_TIMEOUT}s"}})
        try:
            cluster.start()
            old = cluster.leaders("retained")[0]
            other = next(k for k in range(SITES) if k != old)
            topic = unique("reads") + "/kept"
            assert publish_retained(cluster, other, topic, b"v1", WAIT)
            reader = PahoClient(cluster.sites[old].port, unique("reader"),
                                host=cluster.sites[old].host)
            clients.append(reader)
            assert reader.connect().reason_code == 0

            network.cut(old)
            cut_at = time.monotonic()
            assert cluster.wait_leaders_moved(old, [0], WAIT, db="retained"), \
                f"no failover of retained/0 away from site-{old}:\n{cluster.describe()}"
            assert publish_retained(cluster, other, topic, b"v2", WAIT), \
                f"v2 not acknowledged on site-{other}:\n{cluster.describe()}"
            set_after = time.monotonic() - cut_at
            # still cut off: the old leader has not heard of the new one
            stale = next(shard for shard in cluster.sites[old].replication()["shards"]
                         if shard["db"] == "retained")
            during = retained_within(reader, topic, WRITE_TIMEOUT + 2.0)

            network.heal(old)
            assert cluster.wait_ready(WAIT), f"site-{old} did not rejoin:\n{cluster.describe()}"
            after_heal = PahoClient(cluster.sites[old].port, unique("reader"),
                                    host=cluster.sites[old].host)
            clients.append(after_heal)
            assert after_heal.connect().reason_code == 0
            healed = retained_within(after_heal, topic, 5.0)
        finally:
            for client in clients:
                client.stop()
            cluster.close()
    print(f"\nsite-{old} cut off while leading retained/0 (it reports role "
          f"{stale['role']}, epoch {stale['epoch']}); v2 acknowledged on site-{other} "
          f"{set_after:.1f}s after the cut; a SUBSCRIBE on site-{old} got {during}; "
          f"after healing {healed}")
    assert stale["role"] == "leader", "the cut-off site knew it no longer leads: no test"
    assert b"v1" not in during, \
        "the deposed leader answered a read with the value an acknowledged write replaced"
    assert healed == [b"v2"], f"after healing site-{old} sent {healed}"
