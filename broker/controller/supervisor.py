"""`stratamq cluster`: a local cluster on one machine. Site k (k = 0..N-1) listens on
its own loopback address 127.0.0.(k+1) with the standard ports (as pods each have
their own IP), keeps its data in D/site-k, and the controller (D/controller) listens
on 127.0.0.1. The supervisor writes each site's configuration, one admin token shared
by all (D/admin-token), starts the controller and the sites, and on Ctrl-C
or SIGTERM stops them all: SIGINT to the sites (a stop without handing leaderships
over), SIGTERM to the controller, a wait, then SIGKILL for any still running.

A controller that exits while the cluster runs (a crash, a `kill -9`, a SIGTERM of its
own) is started again, after 1 s and then a back-off doubling up to 30 s while it keeps
dying soon after its start: without a controller nothing fails over. A site that dies stays
down, as a crashed machine would, until someone restarts it with
`stratamq broker --config D/site-k/stratamq.yaml`: the controller fails its shards over.

`D/cluster.json` says where everything is (addresses, ports, pids, configs, logs).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

import yaml

from ..admin.credentials import TOKEN_FILE, load_or_create_token
from ..config import merge_config
from ..errors import ConfigError
from ..files import write_atomically
from ..yamlfile import load_yaml_file

log = logging.getLogger(__name__)

STANDARD_PORTS = {"mqtt": 1883, "ws": 8083, "admin": 18083, "peer": 18084}
CONTROLLER_PORT = 18090
LAYOUT_FILE = "cluster.json"
STOP_TIMEOUT = 20.0
# A controller that dies is started again after this, doubled after each death soon
# after a start (a controller that cannot start must not spin), up to the cap.
RESTART_DELAY = 1.0
RESTART_DELAY_MAX = 30.0
# A controller that ran this long before dying was healthy: the delay starts over.
HEALTHY_RUN = 60.0


@dataclass(frozen=True)
class SiteLayout:
    index: int
    host: str
    mqtt: int
    ws: int
    admin: int
    peer: int
    folder: str
    config: str
    log: str

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin}"


@dataclass(frozen=True)
class ClusterOptions:
    sites: int
    data_dir: Path
    replication_factor: int
    n_shards: int
    heartbeat_interval: float
    ports_from: int | None = None
    site_config: Path | None = None
    # each site's `cluster.zone`, by index; empty: none known
    zones: tuple[str, ...] = ()
    max_concurrent_moves: int = 1  # the shards a replica plan moves at once


def site_host(index: int) -> str:
    return f"127.0.0.{index + 1}"


def ports(ports_from: int | None) -> tuple[dict[str, int], int]:
    """The site ports (the same on every site's address) and the controller's port:
    the standard ones, or consecutive ones from `ports_from` (tests)."""
    if ports_from is None:
        return dict(STANDARD_PORTS), CONTROLLER_PORT
    return ({name: ports_from + number for number, name in enumerate(STANDARD_PORTS)},
            ports_from + len(STANDARD_PORTS))


def layout(options: ClusterOptions) -> tuple[list[SiteLayout], str]:
    """Every site's addresses and files, and the controller's bind address."""
    site_ports, controller_port = ports(options.ports_from)
    sites = []
    for index in range(options.sites):
        folder = options.data_dir.resolve() / f"site-{index}"
        sites.append(SiteLayout(index=index, host=site_host(index), folder=str(folder),
                                config=str(folder / "stratamq.yaml"),
                                log=str(folder / "broker.log"), **site_ports))
    return sites, f"127.0.0.1:{controller_port}"


def site_config(site: SiteLayout, token: str, options: ClusterOptions,
                base: dict[str, Any]) -> dict[str, Any]:
    """A site's configuration: `base` (the `--site-config` file) with the cluster's
    own settings over it."""
    return merge_config(base, {
        "durable_storage": {"messages": {"data_dir": str(Path(site.folder) / "data"),
                                         "n_shards": options.n_shards}},
        "durable_sessions": {"heartbeat_interval": options.heartbeat_interval},
        "listeners": {"tcp": {"bind": f"{site.host}:{site.mqtt}"},
                      "ws": {"bind": f"{site.host}:{site.ws}"}},
        "admin": {"bind": f"{site.host}:{site.admin}", "token": token},
        "cluster": {"enable": True, "peer_bind": f"{site.host}:{site.peer}",
                    **({"zone": options.zones[site.index]} if options.zones else {})},
    })


def controller_command(options: ClusterOptions, bind: str, sites: list[SiteLayout],
                       token_file: Path) -> list[str]:
    command = [sys.executable, "-m", "stratamq.broker", "cluster", "controller",
               "--data-dir", str(options.data_dir.resolve() / "controller"), "--bind", bind,
               "--token-file", str(token_file),
               "--replication-factor", str(options.replication_factor),
               "--n-shards", str(options.n_shards),
               "--heartbeat-interval", str(options.heartbeat_interval),
               "--max-concurrent-moves", str(options.max_concurrent_moves)]
    for site in sites:
        command += ["--site", site.admin_url]
    return command


class Supervisor:
    """The controller and site processes of one local cluster."""

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.sites, self.controller_bind = layout(options)
        self.token_file = options.data_dir.resolve() / TOKEN_FILE
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._stopping = False
        self._started_at: dict[str, float] = {}

    def prepare(self) -> None:
        """Write the token and every site's configuration."""
        base: dict[str, Any] = {}
        if self.options.site_config is not None:
            loaded = load_yaml_file(self.options.site_config, "site config")
            if loaded is not None and not isinstance(loaded, dict):
                raise ConfigError(f"{self.options.site_config}: expected a mapping")
            base = loaded or {}
        self.options.data_dir.mkdir(parents=True, exist_ok=True)
        token = load_or_create_token(self.token_file)
        for site in self.sites:
            Path(site.folder).mkdir(parents=True, exist_ok=True)
            text = yaml.safe_dump(site_config(site, token, self.options, base),
                                  sort_keys=False)
            write_atomically(Path(site.config), text)  # 0600: it holds the token

    def _spawn(self, name: str, command: list[str], log_path: Path) -> None:
        stream = log_path.open("ab")
        self._logs.append(stream)
        # A session of its own: Ctrl-C reaches the supervisor only, which then stops
        # every process in order.
        self.processes[name] = subprocess.Popen(
            command, stdout=stream, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self._started_at[name] = time.monotonic()

    def _start_controller(self) -> None:
        controller_dir = self.options.data_dir.resolve() / "controller"
        controller_dir.mkdir(parents=True, exist_ok=True)
        self._spawn("controller", controller_command(self.options, self.controller_bind,
                                                     self.sites, self.token_file),
                    controller_dir / "controller.log")

    def start(self) -> None:
        self._start_controller()
        for site in self.sites:
            self._spawn(f"site-{site.index}", [sys.executable, "-m", "stratamq.broker",
                                               "broker", "--config", site.config],
                        Path(site.log))
        self._write_layout()

    def _write_layout(self) -> None:
        document = {
            "controller": {"url": f"http://{self.controller_bind}",
                           "pid": self.processes["controller"].pid,
                           "log": str(self.options.data_dir.resolve() / "controller"
                                      / "controller.log")},
            "token_file": str(self.token_file),
            "replication_factor": self.options.replication_factor,
            "n_shards": self.options.n_shards,
            "sites": [{**asdict(site), "pid": self.processes[f"site-{site.index}"].pid}
                      for site in self.sites],
        }
        write_atomically(self.options.data_dir.resolve() / LAYOUT_FILE,
                         json.dumps(document, indent=2) + "\n")

    def describe(self) -> str:
        lines = [f"controller  http://{self.controller_bind}  (ctl: stratamq ctl ds info "
                 f"--url http://{self.controller_bind} --token-file {self.token_file})"]
        for site in self.sites:
            lines.append(f"site-{site.index}  mqtt {site.host}:{site.mqtt}  ws {site.host}:"
                         f"{site.ws}  admin {site.admin_url}  peer {site.host}:{site.peer}"
                         f"  log {site.log}")
        return "\n".join(lines)

    def watch(self) -> None:
        """Until asked to stop: report processes that exit, and start a controller that
        died again (after `restart_delay`); sites are not restarted."""
        reported: set[str] = set()
        delay = RESTART_DELAY / 2  # the first death waits RESTART_DELAY
        restart_at: float | None = None
        while not self._stopping:
            for name, process in self.processes.items():
                code = process.poll()
                if code is None or name in reported:
                    continue
                reported.add(name)
                if name != "controller":
                    log.warning("%s (pid %d) exited with %d; not restarted", name,
                                process.pid, code)
                    continue
                ran = time.monotonic() - self._started_at[name]
                delay = restart_delay(delay, ran)
                restart_at = time.monotonic() + delay
                log.warning("the controller (pid %d) exited with %d after %.0fs; started "
                            "again in %.0fs", process.pid, code, ran, delay)
            if restart_at is not None and time.monotonic() >= restart_at:
                restart_at = None
                reported.discard("controller")
                self._start_controller()
                self._write_layout()
                log.info("the controller started again (pid %d)",
                         self.processes["controller"].pid)
            time.sleep(0.2)

    def request_stop(self, _signum: int, _frame: FrameType | None) -> None:
        self._stopping = True

    def stop(self) -> None:
        """SIGINT to every site (they all stop: none hands its shards over, there is
        no one to take them) and SIGTERM to the controller, a wait for all, SIGKILL for
        any left."""
        for name, process in self.processes.items():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM if name == "controller" else signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT
        for name, process in self.processes.items():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop in %.0fs: killed", name, process.pid,
                            STOP_TIMEOUT)
                process.kill()
                process.wait()
        for stream in self._logs:
            stream.close()


def restart_delay(previous: float, ran: float) -> float:
    """The wait before starting again a controller that died after running `ran`
    seconds: `RESTART_DELAY` after a healthy run, else the previous wait doubled, within
    `RESTART_DELAY` .. `RESTART_DELAY_MAX`."""
    if ran >= HEALTHY_RUN:
        return RESTART_DELAY
    return min(RESTART_DELAY_MAX, max(RESTART_DELAY, previous * 2))


def run_cluster(options: ClusterOptions) -> int:
    supervisor = Supervisor(options)
    supervisor.prepare()
    signal.signal(signal.SIGTERM, supervisor.request_stop)
    signal.signal(signal.SIGINT, supervisor.request_stop)
    supervisor.start()
    print(supervisor.describe(), flush=True)
    log.info("local cluster of %d sites running. Stop with Ctrl-C or SIGTERM.",
             options.sites)
    try:
        supervisor.watch()
    finally:
        log.info("stopping the controller and the sites")
        supervisor.stop()
        log.info("stopped")
    return 0
