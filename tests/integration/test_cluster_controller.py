"""`stratamq cluster --sites 3`: a real supervisor, controller and three real sites on
127.0.0.1..3 (free ports, `--ports-from`). The controller places every shard on all
three sites; `ctl ds info` shows it; bad requests to its API are refused and change
nothing; after `kill -9` of the site leading some shards the controller moves their
leadership (epoch bumped) and QoS 1 publishes to the other sites are acknowledged
again; a controller restart keeps the placement; SIGTERM stops everything cleanly.
Failover times are measured and printed, never asserted."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from harness import waiting
from harness.cluster import SITE_UNREACHABLE, reports_its_roles
from harness.processes import REPO
from stratamq.broker.ds.shard_set import shard_of
from tests.support.clients import PahoClient, unique

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SITES = 3
N_SHARDS = 4
DB = "messages"
WAIT = 60.0  # generous: three sites start on a shared 2-core machine
T = TypeVar("T")


def free_port_block(hosts: list[str], count: int) -> int:
    """A first port P with P..P+count-1 free on every host."""
    for _ in range(200):
        first = random.randint(20000, 31000)
        try:
            for host in hosts:
                for port in range(first, first + count):
                    with socket.socket() as probe:
                        probe.bind((host, port))
        except OSError:
            continue
        return first
    raise RuntimeError("no free block of ports")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT) -> T:
    """The first true value of `probe` (a site or controller down counts as not yet)."""
    return waiting.wait_for(what, probe, timeout, every=0.1, tolerate=SITE_UNREACHABLE)


class LocalCluster:
    """`stratamq cluster` as a user runs it, with its own ports and folder."""

    def __init__(self, workdir: Path, sites: int = SITES) -> None:
        self.workdir = workdir
        self.sites = sites
        self.data_dir = workdir / "cluster"
        self.ports_from = free_port_block([f"127.0.0.{k + 1}" for k in range(sites)], 5)
        base = workdir / "site-base.yaml"
        base.write_text(yaml.safe_dump({
            "durable_sessions": {"renew_streams_interval": "200ms"}}))
        self.command = [sys.executable, "-m", "stratamq.broker", "cluster",
                        "--sites", str(sites), "--data-dir", str(self.data_dir),
                        "--n-shards", str(N_SHARDS), "--ports-from", str(self.ports_from),
                        "--site-config", str(base)]
        self.log_path = workdir / "supervisor.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command, cwd=REPO, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for("the cluster layout", lambda: (self.data_dir / "cluster.json").exists())
        wait_for("the controller", lambda: self.controller("GET", "/healthz")[0] == 200)

    @property
    def layout(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads((self.data_dir / "cluster.json").read_text())
        return found

    @property
    def token(self) -> str:
        return (self.data_dir / "admin-token").read_text().strip()

    def _call(self, url: str, method: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def controller(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return self._call(self.layout["controller"]["url"] + path, method, body)

    def storage(self, db: str = DB) -> dict[str, Any]:
        status, found = self.controller("GET", f"/api/v1/ds/storages/{db}")
        assert status == 200, found
        return dict(found)

    def metrics(self) -> dict[str, float]:
        """The controller's /metrics, sample -> value."""
        url = self.layout["controller"]["url"] + "/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def site(self, index: int) -> dict[str, Any]:
        found: dict[str, Any] = self.layout["sites"][index]
        return found

    def admin_url(self, index: int) -> str:
        return f"http://{self.site(index)['host']}:{self.site(index)['admin']}"

    def replication(self, index: int) -> dict[str, Any]:
        return self.replication_at(self.admin_url(index))

    def replication_at(self, url: str) -> dict[str, Any]:
        status, found = self._call(f"{url}/api/v1/ds/replication", "GET")
        if status != 200:  # a site still starting answers 503: not there yet
            raise ConnectionError(f"{url} answered {status}: {found}")
        return dict(found)

    def site_ids(self) -> dict[int, str]:
        return {index: self.replication(index)["site"] for index in range(self.sites)}

    def ctl(self, *arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stratamq.broker", "ctl", "ds", *arguments,
             "--url", self.layout["controller"]["url"],
             "--token-file", str(self.data_dir / "admin-token")],
            capture_output=True, text=True, timeout=60, check=False)

    def kill_controller(self) -> None:
        """`kill -9` the controller; `stratamq cluster` starts it again by itself (a new
        pid in the layout) with the same arguments and folder: wait until it answers."""
        killed = self.layout["controller"]["pid"]
        os.kill(killed, signal.SIGKILL)
        wait_for("the controller started again", lambda: (
            self.layout["controller"]["pid"] != killed
            and self.controller("GET", "/healthz")[0] == 200), timeout=30)
        assert not pid_alive(killed)
        assert "the controller started again" in self.log_path.read_text()

    def stop(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)

    def kill(self) -> None:
        """SIGKILL the supervisor and the processes it started (those still its
        children: a pid is never signalled once it may belong to someone else)."""
        if self.process is None or self.process.poll() is not None:
            return
        for entry in [self.layout["controller"], *self.layout["sites"]]:
            if parent_of(entry["pid"]) == self.process.pid:
                os.kill(entry["pid"], signal.SIGKILL)
        self.process.kill()
        self.process.wait()


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped) counts as gone.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] != "Z"


def roles_taken(cluster: LocalCluster, urls: list[str] | None = None) -> bool:
    """Every site (of the cluster, or at `urls`) reports a role in every shard the
    placement gives it, at the placement's epoch."""
    storage = cluster.storage()
    if not storage["shards"]:
        return False
    if urls is None:
        urls = [cluster.admin_url(index) for index in range(cluster.sites)]
    for url in urls:
        status = cluster.replication_at(url)
        if not reports_its_roles(status["site"], DB, storage["shards"], status["shards"]):
            return False
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    running = LocalCluster(tmp_path_factory.mktemp("cluster"))
    running.start()
    try:
        wait_for("every site to take its roles", lambda: roles_taken(running))
        yield running
    finally:
        running.kill()


def client_for_shard(shard: int, prefix: str) -> str:
    """A client id whose messages go to `shard` of messages."""
    while True:
        client_id = unique(prefix)
        if shard_of(client_id, N_SHARDS) == shard:
            return client_id


def publish_until_acknowledged(port: int, host: str, client_id: str, topic: str,
                               timeout: float = WAIT) -> tuple[int, float]:
    """Connect and publish QoS 1 until a PUBACK with success comes back; the attempts
    made and the seconds it took."""
    began = time.monotonic()
    attempts = 0
    while time.monotonic() - began < timeout:
        attempts += 1
        client = PahoClient(port, client_id, host=host)
        try:
            if client.connect().reason_code == 0 and \
                    client.publish(topic, b"after failover", qos=1) == 0:
                return attempts, time.monotonic() - began
        except (AssertionError, OSError):
            pass
        finally:
            client.stop()
        time.sleep(0.2)
    raise AssertionError(f"no QoS 1 publish of {client_id} acknowledged in {timeout}s")


# --- tests -----------------------------------------------------------------------------

def test_every_shard_has_three_replicas_and_a_leader(cluster: LocalCluster) -> None:
    storage = cluster.storage()
    ids = set(cluster.site_ids().values())
    assert len(ids) == SITES
    assert len(storage["shards"]) == N_SHARDS
    for shard in storage["shards"]:
        assert set(shard["replicas"]) == ids
        assert shard["leader"] in ids
        assert shard["transitions"] == []
    leaders = {shard["leader"] for shard in storage["shards"]}
    assert len(leaders) > 1  # leadership is spread

    info = cluster.ctl("info")
    assert info.returncode == 0, info.stderr
    lines = info.stdout.splitlines()
    site_rows = [line for line in lines if any(line.startswith(site) for site in ids)]
    assert len(site_rows) == SITES and all(" up " in row for row in site_rows), info.stdout
    shard_rows = [line for line in lines if line.startswith(f"{DB}/")]
    assert len(shard_rows) == N_SHARDS, info.stdout
    for row in shard_rows:
        assert row.split()[1].count(",") == SITES - 1, row


def placement_view(view: dict[str, Any]) -> dict[str, Any]:
    """The storage view less what moves on its own while nothing is asked: each
    shard's commit offset and its replicas' lag (the sites' connect writes, reported
    on the controller's next probe)."""
    return {**view, "shards": [{key: value for key, value in shard.items()
                                if key not in ("committed", "lag")}
                               for shard in view["shards"]]}


def test_bad_requests_get_4xx_and_change_nothing(cluster: LocalCluster) -> None:
    before = placement_view(cluster.storage())
    ids = sorted(cluster.site_ids().values())
    requests = [
        ("PUT", f"/api/v1/ds/storages/{DB}/replicas", ids[:2], 400),   # below the factor
        ("PUT", f"/api/v1/ds/storages/{DB}/replicas", [*ids, "NOSUCHSITE"], 404),
        ("PUT", f"/api/v1/ds/storages/{DB}/replicas", {"sites": "x"}, 400),
        ("PUT", f"/api/v1/ds/storages/{DB}/replicas", [], 400),       # no replica left
        ("PUT", f"/api/v1/ds/storages/{DB}/replicas/NOSUCHSITE", None, 404),
        ("DELETE", f"/api/v1/ds/storages/{DB}/replicas/{ids[0]}", None, 400),
        ("PUT", "/api/v1/ds/storages/nosuchdb/replicas", ids, 404),
        ("DELETE", f"/api/v1/ds/sites/{ids[0]}", None, 409),          # up, holds replicas
        ("DELETE", "/api/v1/ds/sites/NOSUCHSITE", None, 404),
    ]
    for method, path, body, status in requests:
        got, answer = cluster.controller(method, path, body)
        assert got == status, (method, path, body, answer)
        assert answer["message"], answer
    assert placement_view(cluster.storage()) == before

    refused = cluster.ctl("set-replicas", DB, ids[0], ids[1])
    assert refused.returncode == 1 and "400" in refused.stderr, refused.stderr
    # Setting the replicas it has already is accepted and plans nothing.
    same = cluster.ctl("set-replicas", DB, *ids)
    assert same.returncode == 0 and "nothing to move" in same.stdout, same.stderr
    assert cluster.storage()["placement_version"] == before["placement_version"]


def test_kill_9_of_a_leader_moves_its_leadership(cluster: LocalCluster) -> None:
    before = cluster.storage()
    ids = cluster.site_ids()
    # The site leading the most shards.
    led = {index: [shard for shard in before["shards"] if shard["leader"] == site]
           for index, site in ids.items()}
    victim = max(led, key=lambda index: (len(led[index]), index))
    victim_id = ids[victim]
    moved = led[victim]
    assert moved
    killed_at = time.monotonic()
    os.kill(cluster.site(victim)["pid"], signal.SIGKILL)

    def failed_over() -> dict[str, Any] | None:
        storage = cluster.storage()
        shards = {shard["id"]: shard for shard in storage["shards"]}
        for shard in moved:
            now = shards[shard["id"]]
            if now["leader"] == victim_id or now["epoch"] <= shard["epoch"]:
                return None
        return storage

    after = wait_for("the controller to move leadership", failed_over)
    placed_in = time.monotonic() - killed_at
    for shard in after["shards"]:
        assert victim_id in shard["replicas"]  # a failover changes leaders, not replicas
        assert shard["leader"] != victim_id
    metrics = wait_for("the metrics to show the failover", lambda: (
        found if (found := cluster.metrics()).get(
            'stratamq_cluster_sites{state="down"}') == 1 else None))
    assert metrics["stratamq_cluster_leader_changes_total"] >= len(moved)
    assert metrics[f'stratamq_cluster_under_replicated_shards{{db="{DB}"}}'] == N_SHARDS

    # Publishes to another site reach a committed write again, for every shard that
    # moved: the first acknowledged one says when writes resumed.
    others = [index for index in range(SITES) if index != victim]
    resumed: list[float] = []
    for number, shard in enumerate(moved):
        entry = cluster.site(others[number % len(others)])
        client_id = client_for_shard(shard["id"], "failover")
        attempts, _ = publish_until_acknowledged(entry["mqtt"], entry["host"], client_id,
                                                 f"failover/{shard['id']}")
        resumed.append(time.monotonic() - killed_at)
        assert attempts >= 1
    print(f"\nfailover after kill -9 of {victim_id} ({len(moved)} shards): new leaders "
          f"placed in {placed_in:.2f}s, QoS 1 writes acknowledged again "
          f"{min(resumed):.2f}s to {max(resumed):.2f}s after the kill "
          f"(heartbeat 1s, 3 missed)")

    # Restarted (as the README says, from its own configuration), the site gets the
    # newer placement pushed and follows the new leaders at their epochs.
    entry = cluster.site(victim)
    with (Path(entry["folder"]) / "restarted.log").open("ab") as log:
        restarted = subprocess.Popen(
            [sys.executable, "-m", "stratamq.broker", "broker", "--config", entry["config"]],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        # (It may follow before the push, having learned the new epoch from a peer.)
        wait_for("the restarted site to hold the placement and follow", lambda: (
            cluster.replication(victim)["placement_version"]
            == cluster.storage()["placement_version"] and roles_taken(cluster)))
    finally:
        restarted.send_signal(signal.SIGTERM)
        assert restarted.wait(30) == 0


def test_a_killed_controller_comes_back_with_the_placement(cluster: LocalCluster) -> None:
    before = cluster.storage()
    cluster.kill_controller()
    after = cluster.storage()
    assert after["placement_version"] == before["placement_version"]
    assert [(s["id"], s["leader"], s["epoch"], s["replicas"]) for s in after["shards"]] \
        == [(s["id"], s["leader"], s["epoch"], s["replicas"]) for s in before["shards"]]
    sites = wait_for("the sites to be known again", lambda: [
        site for site in cluster.controller("GET", "/api/v1/ds/sites")[1]["data"]
        if site["up"]] or None)
    assert len(sites) == SITES - 1  # the killed site stays down
    assert "Traceback" not in (cluster.data_dir / "controller" / "controller.log").read_text()


def test_sigterm_stops_the_whole_cluster_cleanly(cluster: LocalCluster) -> None:
    pids = [site["pid"] for site in cluster.layout["sites"]]
    assert cluster.stop() == 0
    assert not any(pid_alive(pid) for pid in pids)
    supervisor_log = cluster.log_path.read_text()
    assert "stopped" in supervisor_log


def test_leave_forget_and_join_step_by_step(tmp_path: Path) -> None:
    """Four sites, replication factor 3: `ctl ds leave` plans `+site`/`-site` steps,
    the controller takes them one at a time (each joined replica caught up first),
    no shard is ever below 3 replicas, the site ends up holding nothing, can then be
    forgotten once stopped, and writes to every shard are acknowledged afterwards. A
    new site added to the controller (`POST /api/v1/ds/sites`) then joins."""
    cluster = LocalCluster(tmp_path, sites=4)
    cluster.start()
    try:
        wait_for("every site to take its roles", lambda: roles_taken(cluster))
        ids = cluster.site_ids()
        leaving_index = max(ids)
        leaving = ids[leaving_index]
        entry = cluster.site(0)
        for shard in range(N_SHARDS):  # something for the joining replicas to catch up on
            for _ in range(5):
                publish_until_acknowledged(entry["mqtt"], entry["host"],
                                           client_for_shard(shard, "before"), "plan/before")

        planned = cluster.ctl("leave", DB, leaving)
        assert planned.returncode == 0, planned.stderr
        steps = [line.strip() for line in planned.stdout.splitlines()[1:]]
        step_form = re.compile(rf"{DB}/\d+: [+-][0-9A-F]{{16}}( \(leader -> [0-9A-F]{{16}}\))?")
        assert steps and all(step_form.fullmatch(step) for step in steps), steps
        removals = [step for step in steps if f": -{leaving}" in step]
        assert len(removals) == N_SHARDS * 3 // 4, steps  # every replica it held

        seen_versions: set[int] = set()

        def plan_done() -> dict[str, Any] | None:
            storage = cluster.storage()
            seen_versions.add(storage["placement_version"])
            for shard in storage["shards"]:
                assert len(shard["replicas"]) >= 3, shard
            if storage["plan"] or any(shard["transitions"] for shard in storage["shards"]):
                return None
            return storage

        began = time.monotonic()
        # The controller dies in the middle of the plan; started again, it goes on.
        wait_for("the plan to take two steps", lambda: (
            cluster.storage()["placement_version"] >= 3))
        cluster.kill_controller()
        done = wait_for("the plan to finish", plan_done, timeout=120)
        print(f"\ndrained {leaving}: {len(steps)} steps in {time.monotonic() - began:.1f}s "
              f"(controller killed after two, started again by the supervisor)")
        resumed_log = (cluster.data_dir / "controller" / "controller.log").read_text()
        assert "resuming a plan" in resumed_log
        assert all(leaving not in shard["replicas"] for shard in done["shards"])
        assert all(len(shard["replicas"]) == 3 for shard in done["shards"])
        assert done["placement_version"] == 1 + len(steps)
        assert len(seen_versions) > 1
        # Every shard still takes writes, on a site that stays.
        wait_for("the sites to take the final roles", lambda: roles_taken(cluster))
        for shard in range(N_SHARDS):
            publish_until_acknowledged(entry["mqtt"], entry["host"],
                                       client_for_shard(shard, "after"), "plan/after")

        # The key-value databases leave it the same way (it holds replicas of them too).
        for other in ("sessions", "retained"):
            planned = cluster.ctl("leave", other, leaving)
            assert planned.returncode == 0, planned.stderr

            def left(other: str = other) -> bool:
                storage = cluster.storage(other)
                return not storage["plan"] and all(
                    leaving not in shard["replicas"] and not shard["transitions"]
                    for shard in storage["shards"])
            wait_for(f"{other} to leave {leaving}", left, timeout=120)

        # Forgetting: refused while it runs, done once it is stopped.
        refused = cluster.ctl("forget", leaving)
        assert refused.returncode == 1 and "409" in refused.stderr, refused.stderr
        os.kill(cluster.site(leaving_index)["pid"], signal.SIGKILL)
        wait_for("the controller to see the site down", lambda: any(
            site["site"] == leaving and not site["up"]
            for site in cluster.controller("GET", "/api/v1/ds/sites")[1]["data"]))
        forgotten = cluster.ctl("forget", leaving)
        assert forgotten.returncode == 0, forgotten.stderr
        known = [site["site"] for site in cluster.controller("GET", "/api/v1/ds/sites")[1]["data"]]
        assert leaving not in known and len(known) == 3

        # A new site on 127.0.0.5, added to the controller and joined to messages.
        joined = start_extra_site(cluster, Path(cluster.site(leaving_index)["config"]),
                                  tmp_path / "site-new")
        try:
            url = f"http://127.0.0.5:{cluster.site(0)['admin']}"
            assert cluster.controller("POST", "/api/v1/ds/sites", {"admin_url": url})[0] == 202
            assert cluster.controller("POST", "/api/v1/ds/sites", {"admin_url": "x"})[0] == 400
            new_id = wait_for("the new site to be known", lambda: next(
                (site["site"] for site in cluster.controller("GET", "/api/v1/ds/sites")[1]["data"]
                 if site["admin_url"] == url and site["up"]), None))
            grown = cluster.ctl("join", DB, new_id)
            assert grown.returncode == 0 and f"+{new_id}" in grown.stdout, grown.stderr
            final = wait_for("the join to finish", plan_done, timeout=120)
            assert sum(new_id in shard["replicas"] for shard in final["shards"]) == 3
            staying = [cluster.admin_url(index) for index in range(4) if index != leaving_index]
            wait_for("every site to take its roles", lambda: roles_taken(
                cluster, [*staying, url]))
        finally:
            joined.send_signal(signal.SIGTERM)
            assert joined.wait(30) == 0
        assert cluster.stop() == 0
    finally:
        cluster.kill()


def start_extra_site(cluster: LocalCluster, model: Path, folder: Path
                     ) -> subprocess.Popen[bytes]:
    """One more site like `model` (a site's config written by `stratamq cluster`), on
    127.0.0.5 with its own data folder."""
    config = yaml.safe_load(model.read_text())
    host = config["listeners"]["tcp"]["bind"].rsplit(":", 1)[0]
    text = yaml.safe_dump(config).replace(f"{host}:", "127.0.0.5:")
    config = yaml.safe_load(text)
    config["durable_storage"]["messages"]["data_dir"] = str(folder / "data")
    folder.mkdir(parents=True)
    path = folder / "stratamq.yaml"
    path.write_text(yaml.safe_dump(config))
    with (folder / "broker.log").open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "stratamq.broker", "broker",
                                 "--config", str(path)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
