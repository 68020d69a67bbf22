"""A real Prometheus (the Debian `prometheus` package) scrapes a real broker's
`/metrics` on loopback; its query API then sees the broker's counters."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.support.clients import PahoClient
from tests.support.harness import REPO, BrokerProcess
from tests.support.prometheus import query, running_prometheus

DASHBOARDS = REPO / "charts" / "stratamq" / "dashboards"
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


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL with the Grafana variables filled in)."""
    found = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = (target["expr"].replace("$__rate_interval", "1m")
                        .replace('instance=~"$instance"', 'instance=~".*"'))
                assert "$" not in expr, f"{path.name}/{panel['title']}: unknown variable"
                found.append((path.name, panel["title"], expr))
    return found


def rule_queries() -> list[tuple[str, str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(RULES.name, rule["alert"], rule["expr"]) for group in groups
            for rule in group["rules"]]


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
    for source, title, expr in dashboard_queries() + rule_queries():
        result = query(prometheus, expr)  # fails the test on a query Prometheus refuses
        if source.endswith(".json") and not result \
                and not any(name in expr for name in ONLY_ON_TROUBLE):
            empty.append(f"{source}: {title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
