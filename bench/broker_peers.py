"""The brokers the broker benchmark compares, as subprocesses on free loopback ports,
each with its own configuration file and data/persistence directory:

- stratamq: `python -m stratamq.broker broker --config FILE`, the defaults of
  config/stratamq.yaml apart from the listen addresses and the data directory;
- Mosquitto (Debian package): `persistence true`, `max_queued_messages 0` and one
  listener, everything else at its documented default (autosave_interval 1800 s);
- amqtt (PyPI): the `amqtt` command with its own default_broker.yaml, the listener's
  address changed and `allow_anonymous: false` (then its AnonymousAuthPlugin accepts
  any client with a user name): amqtt keeps no offline messages for anonymous
  clients, so the persistent-session loads could not run on it otherwise.

`cpu_seconds()` reads utime + stime of the broker process (all its threads) from
/proc/<pid>/stat.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

import yaml

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"
ADMIN_TOKEN = "broker-bench-0123456789"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # the name in (...) may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat


class BrokerProcess:
    """One broker process; `start` may be called again after `kill` (same data dir)."""

    name = "broker"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.log_path = workdir / "broker.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.write_config()

    def write_config(self) -> None:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        assert self.process is not None, "broker not started"
        return self.process.pid

    def start(self, timeout: float = 60.0) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(), cwd=self.workdir, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n"
                                   + self.log_tail())
            try:
                with socket.create_connection((HOST, self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start:\n{self.log_tail()}")

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def kill(self) -> None:
        """SIGKILL: no flush, no save, no goodbye."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._close_log()

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, size: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-size:]


class Stratamq(BrokerProcess):
    name = "stratamq"

    def write_config(self) -> None:
        self.config_path = self.workdir / "stratamq.yaml"
        self.admin_port = free_port()
        config = {
            "durable_storage": {"messages": {"data_dir": str(self.workdir / "data")}},
            "listeners": {"tcp": {"bind": f"{HOST}:{self.port}"},
                          "ws": {"bind": f"{HOST}:{free_port()}"}},
            "admin": {"bind": f"{HOST}:{self.admin_port}", "token": ADMIN_TOKEN},
        }
        self.config_path.write_text(yaml.safe_dump(config))

    def dropped(self) -> dict[str, float]:
        """stratamq_messages_dropped_total by reason, from the admin API's /metrics."""
        request = urllib.request.Request(f"http://{HOST}:{self.admin_port}/metrics",
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        found = {}
        for match in re.finditer(r'^stratamq_messages_dropped_total\{reason="([^"]+)"\} (\S+)$',
                                 text, re.MULTILINE):
            found[match[1]] = float(match[2])
        return found

    def command(self) -> list[str]:
        return [sys.executable, "-m", "stratamq.broker", "broker", "--config",
                str(self.config_path)]


class Mosquitto(BrokerProcess):
    name = "mosquitto"

    def write_config(self) -> None:
        persistence = self.workdir / "persistence"
        persistence.mkdir(exist_ok=True)
        if os.geteuid() == 0:  # mosquitto started as root runs as user mosquitto
            shutil.chown(persistence, "mosquitto", "mosquitto")
        self.config_path = self.workdir / "mosquitto.conf"
        self.config_path.write_text(
            f"listener {self.port} {HOST}\n"
            "allow_anonymous true\n"
            "persistence true\n"
            f"persistence_location {persistence}/\n"
            "max_queued_messages 0\n")

    def command(self) -> list[str]:
        return [mosquitto_binary(), "-c", str(self.config_path)]


class Amqtt(BrokerProcess):
    name = "amqtt"

    def write_config(self) -> None:
        default = importlib.resources.files("amqtt.scripts") / "default_broker.yaml"
        config = yaml.safe_load(default.read_text())
        config["listeners"]["default"]["bind"] = f"{HOST}:{self.port}"
        config["plugins"]["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {
            "allow_anonymous": False}
        self.config_path = self.workdir / "amqtt.yaml"
        self.config_path.write_text(yaml.safe_dump(config))

    def command(self) -> list[str]:
        return [str(VENV_BIN / "amqtt"), "-c", str(self.config_path)]


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/sbin")
    if found is None:
        raise RuntimeError("mosquitto is not installed: apt-get install -y mosquitto "
                           "mosquitto-clients")
    return found


def missing_peers() -> list[str]:
    """What the benchmark needs and cannot find."""
    missing = []
    try:
        mosquitto_binary()
    except RuntimeError:
        missing.append("mosquitto (Debian package mosquitto)")
    for client in ("mosquitto_pub", "mosquitto_sub"):
        if shutil.which(client) is None:
            missing.append(f"{client} (Debian package mosquitto-clients)")
    if not (VENV_BIN / "amqtt").exists():
        missing.append("amqtt (pip install amqtt into .venv)")
    return missing


BROKERS: dict[str, type[BrokerProcess]] = {
    "stratamq": Stratamq, "mosquitto": Mosquitto, "amqtt": Amqtt}
