"""Real broker processes for tests: `stratamq broker` on free loopback ports with its
own data directory, started, SIGKILLed and restarted like a pod would be."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


# Below Linux's ephemeral range (32768-60999 by default), so a port we pick is never
# taken meanwhile by the source port of some client's outgoing connection.
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now and was not handed out before in this run."""
    for _ in range(1000):
        port = random.randint(*_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class BrokerProcess:
    """One site. `config` entries are merged over a fast test configuration."""

    def __init__(self, workdir: Path, config: dict[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.ws_port = free_port()
        self.admin_port = free_port()
        base: dict[str, Any] = {
            "durable_storage": {"messages": {"data_dir": str(workdir / "data"), "n_shards": 4}},
            "durable_sessions": {"renew_streams_interval": "200ms"},
            "listeners": {"tcp": {"bind": f"127.0.0.1:{self.port}"},
                          "ws": {"bind": f"127.0.0.1:{self.ws_port}"}},
            "admin": {"bind": f"127.0.0.1:{self.admin_port}",
                      "token": "test-token-0123456789"},
        }
        self.config = _merge(base, config or {})
        self.config_path = workdir / "stratamq.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = workdir / "broker.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> BrokerProcess:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stratamq.broker", "broker", "--config",
             str(self.config_path)],
            cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"broker exited with {self.process.returncode}:\n"
                                   + self.log_path.read_text()[-4000:])
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("broker did not start:\n" + self.log_path.read_text()[-4000:])

    def kill(self) -> None:
        """SIGKILL: no flush, no goodbye."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait for the clean shutdown; returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text()
