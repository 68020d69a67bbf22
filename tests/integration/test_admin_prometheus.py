"""A real Prometheus (the Debian `prometheus` package) scrapes a real broker's
`/metrics` on loopback; its query API then sees the broker's counters."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from harness.cluster import Cluster
from harness.processes import REPO, BrokerProcess
from harness.waiting import wait_until
from tests.support.clients import PahoClient
from tests.support.prometheus import query, running_prometheus

DASHBOARDS = REPO / "charts" / "stratamq" / "dashboards"
# Read from sites with `cluster.enable` and from the controller: a single broker has none.
REPLICATION_DASHBOARD = DASHBOARDS / "stratamq-replication.json"
RULES = REPO / "charts" / "stratamq" / "rules" / "stratamq.rules.yaml"


@pytest.fixture
def prometheus(tmp_path: Path, broker: BrokerProcess) -> Iterator[str]:
    """Prometheus scraping the broker every 500 ms; yields its base URL."""
    with running_prometheus(tmp_path, [f"127.0.0.1:{broker.admin_port}"]) as base:
        yield base


def test_prometheus_scrapes_broker_metrics(broker: BrokerProcess, prometheus: str,
                                           tmp_path: Path) -> None:
    publisher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="prom-publisher")
    publisher.connect("127.0.0.1", broker.port)
    publisher.loop_start()
    for number in range(5):
        publisher.publish("prom/t", b"%d" % number, qos=1).wait_for_publish(5)
    publisher.disconnect()
    publisher.loop_stop()

    deadline = time.monotonic() + 30
    received = 0.0
    while time.monotonic() < deadline:
        result = query(prometheus, "sum(stratamq_messages_received_total)")
        received = float(result[0]["value"][1]) if result else 0.0
        if received >= 5:
            break
        time.sleep(0.25)
    assert received == 5, (tmp_path / "prometheus.log").read_text()[-3000:]

    up = query(prometheus, 'up{job="stratamq"}')
    assert [float(sample["value"][1]) for sample in up] == [1.0]
    stored = query(prometheus, 'sum(stratamq_ds_buffer_messages_total{db="messages"})')
    assert stored and float(stored[0]["value"][1]) >= 5


# Metrics that only exist once something goes wrong (a drop, a lost message, a failed
# flush, a RocksDB stall, a restarted loop): their panels rightly show "No data" here.
ONLY_ON_TROUBLE = ("stratamq_messages_dropped_total", "stratamq_session_messages_expired_total",
                   "stratamq_background_failures_total",
                   "stratamq_ds_buffer_batches_failed_total",
                   "stratamq_ds_buffer_inline_refused_total",
                   "stratamq_ds_layout_hash_collisions_total")


def filled(expr: str) -> str:
    """A dashboard query with every variable at "All" (outside Kubernetes there is no
    namespace or storage label, which ".*" matches too)."""
    return re.sub(r'=~"\$(instance|namespace|storage)"', '=~".*"',
                  expr.replace("$__rate_interval", "1m"))


def dashboard_queries(paths: list[Path]) -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL with the Grafana variables filled in)."""
    found = []
    for path in paths:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = filled(target["expr"])
                assert "$" not in expr, f"{path.name}/{panel['title']}: unknown variable"
                found.append((path.name, panel["title"], expr))
    return found


def rule_queries(group_names: tuple[str, ...] | None = None) -> list[tuple[str, str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(RULES.name, rule["alert"], rule["expr"]) for group in groups
            if group_names is None or group["name"] in group_names
            for rule in group["rules"]]


def test_dashboards_narrow_by_namespace_storage_and_site() -> None:
    """Issue 23: dashboards chose by site (`instance`) only. Each now has Namespace,
    Storage and Site variables, each listing what the one before allows, and every
    query of a site's metrics filters by all three; the controller's (the operator's,
    per storage) by namespace and storage."""
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        variables = {item["name"]: item for item in board["templating"]["list"]}
        assert [name for name in variables if name != "datasource"] == [
            "namespace", "storage", "instance"], path.name
        assert variables["storage"]["definition"].endswith(
            '{namespace=~"$namespace"}, storage)'), path.name
        assert '{namespace=~"$namespace", storage=~"$storage"}, instance)' in variables[
            "instance"]["definition"], path.name
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                # every site metric, and every controller metric (the operator's, by
                # the storage's `namespace` and `name`), narrowed
                sites = re.findall(r"stratamq_(?!cluster_)[a-z_]+(\{[^}]*\})?", expr)
                # a shard without a leader: on no site of the storage, whichever is chosen
                site_filter = ('{namespace=~"$namespace", storage=~"$storage"}'
                               if "== bool 0" in expr else
                               '{namespace=~"$namespace", storage=~"$storage", '
                               'instance=~"$instance"')
                assert all(found.startswith(site_filter) for found in sites), (path.name, expr)
                controller = re.findall(r"stratamq_cluster_[a-z_]+(\{[^}]*\})?", expr)
                assert all(found == '{namespace=~"$namespace", name=~"$storage"}'
                           for found in controller), (path.name, expr)


def test_panels_of_two_units_put_the_second_on_its_own_axis() -> None:
    """Issue 23: CPU cores and memory bytes, and transitions and the placement
    version, shared one axis: the second series of each is on a right axis of its own
    unit."""
    for file, title, unit in (("stratamq-broker.json", "Process CPU and memory", "bytes"),
                              ("stratamq-replication.json",
                               "Transitions pending (controller)", "none")):
        board = json.loads((DASHBOARDS / file).read_text())
        panel = next(panel for panel in board["panels"] if panel["title"] == title)
        [override] = panel["fieldConfig"]["overrides"]
        assert override["matcher"] == {"id": "byFrameRefID", "options": "B"}
        properties = {item["id"]: item["value"] for item in override["properties"]}
        assert properties["custom.axisPlacement"] == "right" and properties["unit"] == unit
        assert [target["refId"] for target in panel["targets"]] == ["A", "B"]


def test_dashboard_and_alert_queries_see_a_real_broker(
        broker: BrokerProcess, prometheus: str, clients: list[PahoClient]) -> None:
    """Every query of the dashboards and alert rules is valid PromQL for a real
    Prometheus, and every dashboard query finds data on a broker carrying traffic
    (except the panels of trouble that has not happened)."""
    subscriber = PahoClient(broker.port, "dash-sub")
    clients.append(subscriber)
    subscriber.connect()
    subscriber.subscribe("dash/#", qos=1)
    # a durable session that is away while messages come: it replays them from
    # storage when it is back (the layout panels count those reads)
    away = PahoClient(broker.port, "dash-away")
    clients.append(away)
    expiry = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    expiry.SessionExpiryInterval = 300
    away.connect(clean_start=True, properties=expiry)
    away.subscribe("dash/#", qos=1)
    away.client.disconnect()
    away.client.loop_stop()
    publisher = PahoClient(broker.port, "dash-pub")
    clients.append(publisher)
    publisher.connect()

    def seen(promql: str) -> float:
        result = query(prometheus, promql)
        return float(result[0]["value"][1]) if result else 0.0

    deadline = time.monotonic() + 60
    sent = 0
    # traffic over several scrapes, so rates over 1m have two samples or more
    while time.monotonic() < deadline:
        for _ in range(20):
            publisher.publish(f"dash/{sent % 3}", b"x" * 100, qos=1)
            sent += 1
        if sent == 100:
            back = PahoClient(broker.port, "dash-away")
            clients.append(back)
            back.connect(clean_start=False, properties=expiry)
            assert len(back.expect(100)) == 100  # from storage
        if seen('count(rate(stratamq_messages_delivered_total[1m]) > 0)') >= 1 and \
                seen("count(rate(stratamq_ds_layout_next_total[1m]) > 0)") >= 1 and \
                seen("count(stratamq_ds_disk_bytes > 0)") == 3:
            break
        time.sleep(0.3)
    assert seen("count(stratamq_ds_disk_bytes > 0)") == 3  # messages, sessions, retained
    free = seen("stratamq_ds_filesystem_free_bytes")
    assert 0 < free <= seen("stratamq_ds_filesystem_size_bytes")
    assert seen('sum(stratamq_ds_commit_latency_seconds_count{db="messages"})') > 0

    empty = []
    boards = [path for path in sorted(DASHBOARDS.glob("*.json"))
              if path != REPLICATION_DASHBOARD]
    for source, title, expr in dashboard_queries(boards) + rule_queries():
        result = query(prometheus, expr)  # fails the test on a query Prometheus refuses
        if source.endswith(".json") and not result \
                and not any(name in expr for name in ONLY_ON_TROUBLE):
            empty.append(f"{source}: {title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


@pytest.mark.cluster
def test_replication_dashboard_and_alerts_see_a_real_cluster(tmp_path: Path) -> None:
    """A real cluster (3 sites, a controller, 4 shards, replication factor 3) scraped by a
    real Prometheus: every replication dashboard query finds data, and the replication
    alerts are valid PromQL that find nothing to fire on in a healthy cluster."""
    cluster = Cluster(tmp_path / "cluster", 3, n_shards=4)
    try:
        cluster.start()
        targets = [f"{site.host}:{site.admin_port}" for site in cluster.sites]
        targets.append(f"{cluster.controller.host}:{cluster.controller.port}")
        (tmp_path / "prometheus").mkdir()
        with running_prometheus(tmp_path / "prometheus", targets) as base:
            site = cluster.sites[0]
            publisher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="repl-publisher")
            publisher.connect(site.host, site.port)
            publisher.loop_start()
            for number in range(20):
                publisher.publish(f"repl/{number % 4}", b"%d" % number,
                                  qos=1).wait_for_publish(10)
            publisher.disconnect()
            publisher.loop_stop()

            def seen(promql: str) -> float:
                result = query(base, promql)
                return float(result[0]["value"][1]) if result else 0.0

            alerts = rule_queries(("stratamq.replication",))

            # messages, sessions and retained: 4 shards each, 3 replicas of each shard
            shards, replicas = 3 * 4, 3 * 4 * 3

            def settled() -> bool:
                # every replica of every shard reported, one leader per shard, the
                # controller seeing 3 sites up, two scrapes or more for the rates, and
                # no replication alert expression true
                return (seen("count(stratamq_ds_replica_leader)") == replicas
                        and seen("sum(stratamq_ds_replica_leader)") == shards
                        and seen('sum(stratamq_cluster_sites{state="up"})') == 3
                        and seen("count(stratamq_cluster_replica_lag)") == replicas
                        and seen("count(rate(stratamq_ds_leader_changes_total[1m]))")
                        == replicas
                        and not any(query(base, expr) for _, _, expr in alerts))

            deadline = time.monotonic() + 60
            while not settled() and time.monotonic() < deadline:
                time.sleep(0.3)
            assert settled(), (tmp_path / "prometheus" / "prometheus.log").read_text()[-3000:]
            empty = [f"{title}: {expr}"
                     for _, title, expr in dashboard_queries([REPLICATION_DASHBOARD])
                     if not query(base, expr)]
            assert not empty, "replication dashboard queries without data:\n" + "\n".join(empty)
            for _, title, expr in alerts:
                assert query(base, expr) == [], f"{title} fires on a healthy cluster"
            led = query(base, "sum by (db, shard) (stratamq_ds_replica_leader)")
            assert sorted((s["metric"]["db"], s["metric"]["shard"], s["value"][1])
                          for s in led) == \
                [(db, str(shard), "1") for db in ("messages", "retained", "sessions")
                 for shard in range(4)]

            # With the controller gone nobody fails over: once the busiest leader is
            # killed, its shards are led by no site, and the no-leader alert's query
            # finds exactly those.
            leaders = cluster.leaders()
            victim = cluster.busiest_leader()
            orphaned = sorted(str(shard) for shard, index in leaders.items()
                              if index == victim)
            orphaned_elsewhere = {db: sum(1 for index in cluster.leaders(db).values()
                                          if index == victim)
                                  for db in ("sessions", "retained")}
            assert orphaned  # 4 shards on 3 sites: the busiest leads 2 or more
            no_leader = next(expr for _, title, expr in alerts
                             if title == "StratamqShardWithoutLeader")
            cluster.controller.kill()
            cluster.sites[victim].kill()

            def leaderless() -> list[str]:
                return sorted(s["metric"]["shard"] for s in query(base, no_leader)
                              if s["metric"]["db"] == "messages")

            def leaderless_counts() -> dict[str, float]:
                panel = next(filled(target["expr"]) for panel in json.loads(
                    REPLICATION_DASHBOARD.read_text())["panels"]
                    for target in panel["targets"]
                    if target["legendFormat"] == "{{db}} without a leader")
                return {s["metric"]["db"]: float(s["value"][1]) for s in query(base, panel)}

            deadline = time.monotonic() + 30
            while leaderless() != orphaned and time.monotonic() < deadline:
                time.sleep(0.3)
            assert leaderless() == orphaned
            assert leaderless_counts() == {"messages": len(orphaned), **orphaned_elsewhere}
    finally:
        cluster.close()


def test_the_restarts_panel_counts_a_site_started_again(
        broker_factory: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    """Issue 23: pod restarts on the dashboards, from each site's own
    process_start_time_seconds (no kube-state-metrics needed): a site stopped and
    started again on its port counts one restart; the volume panel shows bytes used
    no larger than the volume."""
    site = broker_factory()
    [(_source, _title, restarts)] = [
        query_ for query_ in dashboard_queries([DASHBOARDS / "stratamq-broker.json"])
        if query_[1] == "Restarts"]
    [used, size] = [expr for _source, title, expr in
                    dashboard_queries([DASHBOARDS / "stratamq-storage.json"])
                    if title == "Volume used"]
    with running_prometheus(tmp_path, [f"127.0.0.1:{site.admin_port}"]) as prometheus:

        def value(promql: str) -> float | None:
            result = query(prometheus, promql)
            return float(result[0]["value"][1]) if result else None

        assert wait_until(lambda: value(restarts) == 0.0, 30), value(restarts)
        assert 0 < (value(used) or 0) <= (value(size) or 0)
        site.stop()
        site.start()
        assert wait_until(lambda: value(restarts) == 1.0, 30), value(restarts)
