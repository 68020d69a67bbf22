"""The peer port and the cluster controller's API under attack: anyone who reaches
them must not stall replication (and so every QoS 1/2 acknowledgement of the
cluster) or the controller.

Three sites and a controller, each with 1,024 file descriptors (a default `ulimit
-n`). Before, both listeners held every connection for ever, whether it sent
nothing or half a request: 1,500 of them took a process's descriptors, after which
it accepted no connection of its peers and could open none of its own, and a QoS 1
publish through another site was not acknowledged. Now each listener holds a bounded
number of connections (`broker/http/guard.py`): when full, the one that has waited
longest for its first request is closed to make room, and a connection whose
request headers are not in within the header timeout (10 s) is closed."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from harness.cluster import Cluster
from stratamq.broker.mqtt import Puback
from tests.support.clients import RawClient, unique
from tests.support.half_open import close_all, few_descriptors, open_half_open, still_open
from tests.support.shards import client_id_on_shard

pytestmark = pytest.mark.cluster

SITES = 3
N_SHARDS = 2
SHARD = 0
ATTACK = 1500  # connections: above a process's 1,024 descriptors
HEADER_TIMEOUT = 10.0  # the guard's, on the peer port and the controller's API
ACK_WITHIN = 5.0  # a QoS 1 round trip through two sites, on a loaded machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = Cluster(tmp_path_factory.mktemp("peer-port"), SITES, n_shards=N_SHARDS,
                      site_config={"cluster": {"write_timeout": "3s"}})
    try:
        with few_descriptors(ATTACK):
            started.start()
        yield started
    finally:
        started.close()


def publish_qos1(host: str, port: int, client_id: str) -> float:
    """Seconds from CONNECT to the PUBACK of one QoS 1 publish (accepted) at the site
    on host:port; an AssertionError when it is not acknowledged in time."""
    started = time.monotonic()
    try:
        client = RawClient(port, host=host)
        client.connect(client_id)
        puback = client.publish(unique("peer/attack"), b"x", qos=1)
        client.disconnect()
    except (OSError, AssertionError) as error:  # TimeoutError too
        raise AssertionError(f"no PUBACK after {time.monotonic() - started:.1f}s: "
                             f"{error!r}") from error
    assert isinstance(puback, Puback) and puback.reason_code == 0, puback
    return time.monotonic() - started


def metric(url: str, name: str, **labels: str) -> float:
    """One series of a /metrics page (0 when absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        page = response.read().decode()
    wanted = name + ("{" + ",".join(f'{key}="{value}"' for key, value in labels.items())
                     + "}" if labels else "")
    for line in page.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def test_half_open_peer_connections_do_not_stall_replication(cluster: Cluster) -> None:
    attacked = cluster.sites[cluster.leaders()[SHARD]]
    publisher = next(site for site in cluster.sites if site is not attacked)
    client_id = client_id_on_shard(unique("through"), SHARD, N_SHARDS)
    quiet = publish_qos1(publisher.host, publisher.port, client_id)
    sockets: list[socket.socket] = []
    try:
        began = time.monotonic()
        sockets = open_half_open(attacked.host, attacked.peer_port, ATTACK)
        opened = time.monotonic() - began
        # Through another site: its pooled connections to the attacked leader carry
        # the write (before too).
        during = publish_qos1(publisher.host, publisher.port, client_id)
        # At the attacked site itself: before, out of descriptors, it accepted no
        # MQTT connection (reset).
        local = publish_qos1(attacked.host, attacked.port,
                             client_id_on_shard(unique("local"), SHARD, N_SHARDS))
        held = len(sockets) - still_open(sockets)
        time.sleep(HEADER_TIMEOUT + 4.0)  # a wide margin on a loaded machine
        left = still_open(sockets)
        after = publish_qos1(publisher.host, publisher.port, client_id)
        print(f"{len(sockets)} of {ATTACK} connections opened in {opened:.1f}s "
              f"({held} already closed); QoS 1 through site {publisher.index}: quiet "
              f"{quiet:.2f}s, during {during:.2f}s, after {after:.2f}s; at the attacked site "
              f"during {local:.2f}s; {left} still "
              f"open {HEADER_TIMEOUT + 4.0:.0f}s later")
        assert during < ACK_WITHIN and local < ACK_WITHIN, (during, local)
        assert left == 0, left
        peer = {"listener": "peer"}
        shed = metric(attacked.admin_url, "stratamq_http_connections_evicted_total", **peer) \
            + metric(attacked.admin_url, "stratamq_http_connections_refused_total", **peer)
        timed_out = metric(attacked.admin_url, "stratamq_http_connections_timed_out_total",
                           **peer)
        assert shed > 0 and timed_out > 0, (shed, timed_out)
    finally:
        close_all(sockets)
    assert cluster.tracebacks() == {f"site-{k}": 0 for k in range(SITES)} | \
        {"controller": 0}, cluster.logs()


def test_half_open_controller_connections_leave_its_api_answering(cluster: Cluster) -> None:
    controller = cluster.controller
    sockets: list[socket.socket] = []
    try:
        sockets = open_half_open(controller.host, controller.port, ATTACK)
        began = time.monotonic()
        try:  # before: the controller, out of descriptors, accepts nothing
            with urllib.request.urlopen(f"{controller.url}/healthz", timeout=10) as answer:
                status = answer.status
        except (OSError, urllib.error.URLError) as error:
            raise AssertionError(f"/healthz not answered: {error!r}") from error
        answered = time.monotonic() - began
        storage = controller.storage()  # and its probes of the sites still go
        print(f"{len(sockets)} of {ATTACK} connections opened; /healthz answered "
              f"{status} in {answered:.2f}s")
        assert status == 200 and answered < 2.0, (status, answered)
        assert all(shard["leader"] for shard in storage["shards"]), storage
        refused = metric(controller.url, "stratamq_http_connections_evicted_total",
                         listener="controller")
        assert refused > 0, refused
    finally:
        close_all(sockets)

