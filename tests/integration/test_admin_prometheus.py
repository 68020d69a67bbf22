"""A real Prometheus (the Debian `prometheus` package) scrapes a real broker's
`/metrics` on loopback; its query API then sees the broker's counters."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import yaml
from paho.mqtt.enums import CallbackAPIVersion

from tests.support.harness import BrokerProcess, free_port

PROMETHEUS = shutil.which("prometheus")


@pytest.fixture
def prometheus(tmp_path: Path, broker: BrokerProcess) -> Iterator[str]:
    """Prometheus scraping the broker every 500 ms; yields its base URL."""
    assert PROMETHEUS is not None, "prometheus is not installed: `make test` installs it"
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
        "scrape_configs": [{"job_name": "stratamq", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [
                                f"127.0.0.1:{broker.admin_port}"]}]}],
    }))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            answer = json.load(response)
    except (urllib.error.URLError, ConnectionError):
        return []  # still starting
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


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
