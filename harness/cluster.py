"""A cluster of real processes for the end-to-end tests of issue 7: N sites
(`stratamq broker` with `cluster.enable`) and one controller (`stratamq cluster
controller`), each on free ports, started, SIGKILLed and restarted one by one.

On loopback (as `stratamq cluster` lays it out) site k is 127.0.0.(k+1) and the
controller 127.0.0.1; in a `NetnsNetwork` site k is member k and the controller the
last member, each in its own network namespace, so that `network.cut(k)` separates
a site from the other sites and the controller while the test still reaches all:
each process binds its member's address and is reached by the others there, and by
the test at `host` (127.0.0.(k+1)), through the network's proxies (`reach`). In
a `ProxyNetwork` site k is member k on 127.0.0.(k+1) and the controller the last
member; the sites and the controller reach each site's peer and admin ports through
proxies in front of them (`ProxyNetwork.front`), which `network.cut(k)` makes refuse
the connections between k and the others (the test and MQTT clients go direct)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from harness.netns import NetnsNetwork, Network, ProxyNetwork
from harness.processes import BrokerProcess, ManagedProcess, free_port
from harness.processes import http_json as http_json  # for the tests that import it here
from harness.waiting import wait_until
from stratamq.broker.admin.ctl import AdminClient
from stratamq.broker.admin.verify import Verdict, verify
from stratamq.broker.config import merge_config

DB = "messages"
# every site replicates these (a connect writes to `sessions`)
DATABASES = ("messages", "sessions", "retained")


# What asking a site that is down or still starting raises: "not yet" while waiting.
SITE_UNREACHABLE = (OSError, urllib.error.URLError, ValueError, KeyError)


def poll(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """`wait_until`, with a site that is down counting as not yet."""
    return wait_until(condition, timeout, every=interval, tolerate=SITE_UNREACHABLE)


def reports_its_roles(site: str, db: str, shards: list[dict[str, Any]],
                      reported: list[dict[str, Any]]) -> bool:
    """Whether `site`, whose replication status lists the shards `reported`, reports
    in every shard of `db` that the placement's `shards` give it the role (leader or
    follower) and the epoch they give it."""
    by_shard = {(entry["db"], entry["shard"]): entry for entry in reported}
    for shard in shards:
        if site not in shard["replicas"]:
            continue
        mine = by_shard.get((db, shard["id"]))
        role = "leader" if shard["leader"] == site else "follower"
        if mine is None or mine["role"] != role or mine["epoch"] != shard["epoch"]:
            return False
    return True


class SiteProcess(BrokerProcess):
    """One site: the harness's test configuration, bound to `bind_host` (`host`,
    where the test reaches it, unless told), with the cluster section on; its peer
    port is one of the ports waited for at start."""

    name = "site"

    def __init__(self, workdir: Path, index: int, host: str, *, n_shards: int,
                 heartbeat_interval: float, wrapper: tuple[str, ...] = (),
                 config: dict[str, Any] | None = None, bind_host: str | None = None) -> None:
        self.index = index
        self.host = host
        self.bind_host = bind_host or host
        self.wrapper = wrapper
        self.peer_port = free_port()
        # where the controller reaches the admin API (a proxy in front of it, with a
        # ProxyNetwork); the test itself always uses `admin_url`
        self.controller_url = ""
        self._cluster_config = {
            "durable_storage": {"messages": {"n_shards": n_shards}},
            "durable_sessions": {"heartbeat_interval": f"{int(heartbeat_interval * 1000)}ms"},
            "cluster": {"enable": True, "peer_bind": f"{self.bind_host}:{self.peer_port}"},
        }
        super().__init__(workdir, config)

    def base_config(self, fast: bool) -> dict[str, Any]:
        return merge_config(super().base_config(fast), {
            **self._cluster_config,
            "listeners": {"tcp": {"bind": f"{self.bind_host}:{self.port}"},
                          "ws": {"bind": f"{self.bind_host}:{self.ws_port}"}},
            "admin": {"bind": f"{self.bind_host}:{self.admin_port}"},
        })

    def ports(self) -> list[int]:
        return [*super().ports(), self.peer_port]

    def advertise_peer(self, address: str) -> None:
        """Have other sites reach the peer port at `address` (before `start`)."""
        self.config = merge_config(self.config, {"cluster": {"advertise": address}})
        self.config_path.write_text(yaml.safe_dump(self.config))

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def replication(self) -> Any:
        """`GET /api/v1/ds/replication`: the site's id, peer, placement version and
        per shard its role, epoch, last (epoch, offset), committed and applied."""
        return http_json("GET", f"{self.admin_url}/api/v1/ds/replication")


class ControllerProcess(ManagedProcess):
    name = "controller"

    def __init__(self, workdir: Path, host: str, sites: list[SiteProcess], *,
                 replication_factor: int, n_shards: int, heartbeat_interval: float,
                 wrapper: tuple[str, ...] = (), bind_host: str | None = None,
                 max_concurrent_moves: int = 1) -> None:
        super().__init__(workdir)
        self.host = host
        self.bind_host = bind_host = bind_host or host
        self.wrapper = wrapper
        self.log_path = workdir / "controller.log"
        self.token_file = workdir / "admin-token"
        self.token_file.write_text(BrokerProcess.ADMIN_TOKEN)
        self.arguments = [
            "--data-dir", str(workdir / "state"), "--bind", f"{bind_host}:{self.port}",
            "--token-file", str(self.token_file),
            "--replication-factor", str(replication_factor), "--n-shards", str(n_shards),
            "--heartbeat-interval", f"{int(heartbeat_interval * 1000)}ms",
            "--max-concurrent-moves", str(max_concurrent_moves),
            *[argument for site in sites
              for argument in ("--site", site.controller_url or site.admin_url)]]

    def command(self) -> list[str]:
        return [sys.executable, "-m", "stratamq.broker", "cluster", "controller",
                *self.arguments]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def storage(self, db: str = DB) -> Any:
        """`GET /api/v1/ds/storages/{db}`: per shard replicas, leader, epoch,
        committed, lag, pending transitions."""
        return http_json("GET", f"{self.url}/api/v1/ds/storages/{db}")


class Cluster:
    """Sites 0..n-1 and a controller; `start` waits until every shard has a leader
    that knows it leads."""

    def __init__(self, workdir: Path, sites: int = 3, *, n_shards: int = 4,
                 replication_factor: int = 3, heartbeat_interval: float = 0.5,
                 network: Network | None = None,
                 site_config: dict[str, Any] | None = None,
                 max_concurrent_moves: int = 1) -> None:
        self.n_shards = n_shards
        self.network = network
        binds: list[str | None] = [None for _ in range(sites + 1)]
        if isinstance(network, NetnsNetwork):
            binds = [network.address(k) for k in range(sites + 1)]
            hosts = [network.reach_host(k) for k in range(sites + 1)]
            wrappers = [tuple(network.command(k, [])) for k in range(sites + 1)]
        elif isinstance(network, ProxyNetwork):
            hosts = [network.address(k) for k in range(sites + 1)]
            wrappers = [() for _ in range(sites + 1)]
        else:
            hosts = [f"127.0.0.{k + 1}" for k in range(sites)] + ["127.0.0.1"]
            wrappers = [() for _ in range(sites + 1)]
        self.sites = [SiteProcess(workdir / f"site-{k}", k, hosts[k], n_shards=n_shards,
                                  heartbeat_interval=heartbeat_interval, wrapper=wrappers[k],
                                  config=site_config, bind_host=binds[k])
                      for k in range(sites)]
        if isinstance(network, NetnsNetwork):
            # The test reaches every port through the network's proxies; the
            # controller reaches the sites' admin ports inside the network.
            for site in self.sites:
                for port in site.ports():
                    network.reach(site.index, port)
                site.proxied = True
                site.controller_url = f"http://{site.bind_host}:{site.admin_port}"
        if isinstance(network, ProxyNetwork):
            # Every site and the controller bind their outgoing connections to their
            # own address; a proxy in front of each site's peer and admin port tells
            # them apart by it, and refuses those a cut separates.
            for site in self.sites:
                site.advertise_peer("{}:{}".format(*network.front(site.index, site.peer_port)))
                site.controller_url = "http://{}:{}".format(
                    *network.front(site.index, site.admin_port))
        self.controller = ControllerProcess(
            workdir / "controller", hosts[sites], self.sites,
            replication_factor=replication_factor, n_shards=n_shards,
            heartbeat_interval=heartbeat_interval, wrapper=wrappers[sites],
            bind_host=binds[sites], max_concurrent_moves=max_concurrent_moves)
        if isinstance(network, NetnsNetwork):
            for port in self.controller.ports():
                network.reach(sites, port)
            self.controller.proxied = True
        self.site_ids: list[str] = []

    def start(self, timeout: float = 60.0) -> Cluster:
        for site in self.sites:
            site.start()
        self.site_ids = [site.replication()["site"] for site in self.sites]
        self.controller.start()
        assert self.wait_ready(timeout), f"no placement taken by every site: {self.describe()}"
        return self

    def restart(self, index: int) -> None:
        """Start a killed site again."""
        self.sites[index].start()

    def index_of(self, site_id: str) -> int:
        return self.site_ids.index(site_id)

    def leaders(self, db: str = DB) -> dict[int, int]:
        """Shard -> index of its leader's site, as the controller has it."""
        return {shard["id"]: self.index_of(shard["leader"])
                for shard in self.controller.storage(db)["shards"]}

    def replicas(self, db: str = DB) -> dict[int, list[int]]:
        """Shard -> indexes of its replicas' sites, as the controller has it."""
        return {shard["id"]: sorted(self.index_of(site) for site in shard["replicas"])
                for shard in self.controller.storage(db)["shards"]}

    def epochs(self) -> dict[int, int]:
        return {shard["id"]: shard["epoch"] for shard in self.controller.storage()["shards"]}

    def busiest_leader(self) -> int:
        """The index of a site that leads the most shards."""
        led = list(self.leaders().values())
        return max(range(len(self.sites)), key=led.count)

    def roles_taken(self, sites: list[int] | None = None) -> bool:
        """Every shard of every database in the controller's placement has a leader,
        and each of `sites` (all by default) reports the role and epoch that placement
        gives it."""
        for db in DATABASES:
            shards = self.controller.storage(db)["shards"]
            if len(shards) != self.n_shards or any(not s.get("leader") for s in shards):
                return False
            for index in range(len(self.sites)) if sites is None else sites:
                if not reports_its_roles(self.site_ids[index], db, shards,
                                         self.sites[index].replication()["shards"]):
                    return False
        return True

    def wait_ready(self, timeout: float, sites: list[int] | None = None) -> bool:
        return poll(lambda: self.roles_taken(sites), timeout)

    def positions(self) -> dict[int, dict[int, tuple[tuple[int, int], int, int]]]:
        """Site index -> shard -> (last, committed, applied) as the site reports it."""
        found = {}
        for site in self.sites:
            found[site.index] = {s["shard"]: (tuple(s["last"]), s["committed"], s["applied"])
                                 for s in site.replication()["shards"] if s["db"] == DB}
        return found

    def converged(self) -> bool:
        """Every site holds every shard up to the same log position, committed and
        applied all of it (every site is a replica when replication factor = sites),
        and then the same content: the digests of its shards' replicas agree."""
        positions = self.positions()
        for shard in range(self.n_shards):
            seen = {positions[site].get(shard) for site in positions}
            if len(seen) != 1:
                return False
            only = seen.pop()
            if only is None or not only[0][1] == only[1] == only[2]:
                return False
        return self.same_content(DB)

    def verify(self, *databases: str, wait: float = 10.0) -> list[Verdict]:
        """What `stratamq ctl ds verify` finds for `databases` (all when none): per
        shard whether its replicas hold the same content."""
        authorization = f"Bearer {BrokerProcess.ADMIN_TOKEN}"
        if isinstance(self.network, NetnsNetwork):
            # the controller gives the sites' admin URLs inside the network
            inside = f"http://{self.controller.bind_host}:{self.controller.port}"
            return self.network.from_hub(lambda: verify(
                AdminClient(inside, authorization, timeout=wait + 30), list(databases), wait))
        controller = AdminClient(self.controller.url, authorization, timeout=wait + 30)
        return verify(controller, list(databases), wait)

    def same_content(self, *databases: str) -> bool:
        """The replicas of every shard of `databases` (all when none) hold the same
        content at the same applied offset (compared by digest)."""
        return all(verdict.status == "same" for verdict in self.verify(*databases))

    def wait_leaders_moved(self, away_from: int, shards: list[int], timeout: float,
                           db: str = DB) -> bool:
        """The controller gave each of `shards` of `db` a leader other than site
        `away_from`."""
        return poll(lambda: all(self.leaders(db)[s] != away_from for s in shards), timeout)

    def describe(self) -> str:
        parts = []
        try:
            parts.append(f"controller: {json.dumps(self.controller.storage())}")
        except (OSError, ValueError) as exc:
            parts.append(f"controller: {exc}")
        for site in self.sites:
            try:
                parts.append(f"site-{site.index}: {json.dumps(site.replication())}")
            except (OSError, ValueError) as exc:
                parts.append(f"site-{site.index}: {exc}")
        return "\n".join(parts)

    def logs(self, size: int = 3000) -> str:
        return "\n".join(f"--- {process.name} {process.workdir.name}\n"
                         f"{process.log_tail(size) if process.log_path.exists() else ''}"
                         for process in [self.controller, *self.sites])

    def tracebacks(self) -> dict[str, int]:
        return {process.workdir.name: process.log().count("Traceback")
                for process in [self.controller, *self.sites] if process.log_path.exists()}

    def close(self) -> None:
        for process in [self.controller, *self.sites]:
            process.kill()


def ctl_ds(cluster: Cluster, *arguments: str) -> str:
    """`stratamq ctl ds ARGUMENTS` against the cluster's controller; its output (the
    command must succeed)."""
    controller = cluster.controller
    done = subprocess.run(
        [sys.executable, "-m", "stratamq.broker", "ctl", "ds", *arguments,
         "--url", controller.url, "--token-file", str(controller.token_file)],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"ctl ds {' '.join(arguments)}: {done.stderr}"
    return done.stdout
