"""Real broker processes for the tests and the benchmarks: `stratamq broker` (and, for
the benchmarks, its peers) on free loopback ports with its own data directory, started,
SIGKILLed and restarted like a pod would be."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import yaml

from stratamq.broker.config import merge_config

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
ADMIN_TOKEN = "test-token-0123456789"
HTTP_TIMEOUT = 5.0  # one admin API request
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

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
                probe.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # the name in (...) may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat


def accepts(host: str, port: int, proxied: bool = False) -> bool:
    """Whether a server listens at host:port. Through a proxy, a connection is taken
    for a listener only when the proxy keeps it open a moment (the servers here wait
    for the client to speak first)."""
    try:
        with socket.create_connection((host, port), timeout=0.2) as connection:
            if not proxied:
                return True
            connection.settimeout(0.2)
            try:
                return connection.recv(1) != b""
            except TimeoutError:
                return True
    except OSError:
        return False


class ManagedProcess:
    """One server process; `start` may be called again after `kill` (same data dir).
    Started means every port in `ports()` accepts connections."""

    name = "broker"
    host = HOST  # where its ports are reached
    wrapper: tuple[str, ...] = ()  # a prefix to `command()`, e.g. `ip netns exec NAME`
    # Reached through proxies (harness/netns.py): a proxy accepts a connection
    # whether or not the process listens behind it, and closes it at once when not.
    proxied = False

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = workdir / "broker.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ports(self) -> list[int]:
        return [self.port]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1"}

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} not started"
        return self.process.pid

    def start(self, timeout: float = 30.0) -> ManagedProcess:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [*self.wrapper, *self.command()], cwd=self.workdir, stdout=self._log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.environment())
        deadline = time.monotonic() + timeout
        waiting = list(self.ports())
        while waiting and time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n"
                                   + self.log_tail())
            if accepts(self.host, waiting[0], self.proxied):
                waiting.pop(0)
            else:
                time.sleep(0.05)
        if waiting:
            raise RuntimeError(f"{self.name} did not start:\n{self.log_tail()}")
        return self

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def kill(self) -> None:
        """SIGKILL: no flush, no goodbye."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._close_log()

    def stop(self, timeout: float = 20.0, signum: int = signal.SIGTERM) -> int:
        """SIGTERM (or `signum`) and wait for the clean shutdown; returns the exit
        code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        self._close_log()
        return self.process.returncode

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, size: int = 4000) -> str:
        return self.log()[-size:]


def http_json(method: str, url: str, body: Any = None) -> Any:
    """A request to a site's or the controller's admin API with the admin token."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:
        return json.loads(response.read())


class BrokerProcess(ManagedProcess):
    """One stratamq site. `config` entries are merged over `base_config()`: a fast
    test configuration, or the shipped defaults with `fast=False` (benchmarks)."""

    name = "stratamq"
    ADMIN_TOKEN = ADMIN_TOKEN

    def __init__(self, workdir: Path, config: dict[str, Any] | None = None, *,
                 fast: bool = True) -> None:
        super().__init__(workdir)
        self.ws_port = free_port()
        self.admin_port = free_port()
        self.config = merge_config(self.base_config(fast), config or {})
        self.config_path = workdir / "stratamq.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))

    def base_config(self, fast: bool) -> dict[str, Any]:
        config: dict[str, Any] = {
            "durable_storage": {"messages": {"data_dir": str(self.workdir / "data")}},
            "listeners": {"tcp": {"bind": f"{HOST}:{self.port}"},
                          "ws": {"bind": f"{HOST}:{self.ws_port}"}},
            # Tests make checkpoints in their own temporary folders, and read /metrics
            # right after what they count (a site caches a render for 1 s by default).
            "admin": {"bind": f"{HOST}:{self.admin_port}", "token": self.ADMIN_TOKEN,
                      "checkpoint_dirs": [tempfile.gettempdir()],
                      "metrics_interval": "1ms"},
        }
        if fast:  # fewer shards start faster; streams are found sooner
            config = merge_config(config, {
                "durable_storage": {"messages": {"n_shards": 4}},
                "durable_sessions": {"renew_streams_interval": "200ms"}})
        return config

    def ports(self) -> list[int]:
        listeners = self.config["listeners"]
        found = []
        for name, port in (("tcp", self.port), ("ws", self.ws_port)):
            if listeners.get(name, {}).get("enable", True):
                found.append(port)
        if self.config.get("admin", {}).get("enable", True):
            found.append(self.admin_port)
        return found

    def command(self) -> list[str]:
        return [sys.executable, "-m", "stratamq.broker", "broker", "--config",
                str(self.config_path)]

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        super().start(timeout)
        return self

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    def shared_groups(self) -> list[Any]:
        """`GET /api/v1/shared_groups`: the site's shared groups, with members here or
        absent, and the members away its stored record names (`saved_away`)."""
        return list(http_json("GET", f"{self.admin_url}/api/v1/shared_groups")["data"])


@contextlib.contextmanager
def running_broker(workdir: Path, config: dict[str, Any] | None = None
                   ) -> Iterator[BrokerProcess]:
    """A broker for the duration of the block; afterwards it must still be alive (or
    have been stopped cleanly by the test) and its log free of tracebacks: a client
    must never crash or wedge the site."""
    process = BrokerProcess(workdir, config).start()
    try:
        yield process
        assert process.alive() or process.stop() == 0, process.log_tail()
        assert "Traceback" not in process.log(), process.log_tail()
    finally:
        process.kill()
