"""A real Prometheus (the Debian `prometheus` package) scraping real brokers, and a
small client of its query API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from harness.processes import free_port

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


@contextmanager
def running_prometheus(folder: Path, targets: list[str]) -> Iterator[str]:
    """Prometheus scraping `targets` (host:port of admin APIs) every 500 ms; yields
    its base URL. Its log is `folder/prometheus.log`."""
    assert PROMETHEUS is not None, "prometheus is not installed: `make test` installs it"
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "500ms", "scrape_timeout": "400ms"},
        "scrape_configs": [{"job_name": "stratamq", "metrics_path": "/metrics",
                            "static_configs": [{"targets": targets}]}],
    }))
    port = free_port()
    with (folder / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_until_ready(base, process)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_until_ready(base: str, process: subprocess.Popen[bytes],
                      timeout: float = 60.0) -> None:
    """Return once Prometheus answers `/-/ready` (it answers queries with 503 until it
    has replayed its write-ahead log, which takes seconds on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"prometheus exited with {process.returncode}"
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"prometheus at {base} not ready within {timeout:.0f} s")


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's result; [] while Prometheus is still starting. A query
    Prometheus refuses (bad PromQL) fails the test with its error."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as error:
        raise AssertionError(f"Prometheus refused {promql!r}: {error.read().decode()}") \
            from error
    except (urllib.error.URLError, ConnectionError):
        return []  # still starting
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result
