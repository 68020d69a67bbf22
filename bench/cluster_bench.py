"""Cluster benchmark (issue 7): what replication costs on this machine, with the C
clients and loads of the broker benchmark (bench/broker_load.py).

    .venv/bin/python bench/cluster_bench.py [--quick] [--out DIR] [--kills N] [--keep]

Setups: Mosquitto (the peer reference), stratamq as one plain site (cluster off:
replication factor 1), and a cluster of three sites and a controller (replication
factor 3, 4 shards of messages, heartbeat 1 s, the shipped defaults otherwise), each
site on its own loopback address, all on this machine's cores.

Loads (64-byte payloads):
  1->1 QoS 1: one `mosquitto_pub -l -M 100` and one `mosquitto_sub` on the same site
  (site 0 of the cluster; the publisher's client id is one of a shard site 0 leads:
  the leaders are placed anew at each start, and a publisher whose shard is led
  elsewhere has its writes forwarded, some 10% more CPU a message, so a fixed client
  id measured either case by chance). CPU us/msg is utime+stime of every process of the setup
  (all sites + the controller) over the run, per delivered message. The PUBACK
  latency (p50/p99) comes from a separate paced run (`mosquitto_pub -d` under
  `stdbuf -oL`: each PUBACK line is stamped as it is read, against the time its
  line was written), since a saturated run only measures its queues.
  cross-site fan-out (cluster only): the publisher on site 0, one subscriber on site
  1 and one on site 2, QoS 1: msgs/s delivered (both copies count).
  failover: the site leading the most shards gets `kill -9`; from the kill, QoS 1
  publishes (`mosquitto_pub -m`, client ids of a shard it led, on another site) start
  every 0.1 s, each waiting up to 10 s for its PUBACK, until one is acknowledged.
  The site is restarted and the cluster waited for before the next kill. Median and
  max over the kills.
  hand-over: the same, with SIGTERM instead of `kill -9` (a rolling restart): the
  stopping site has the controller give its shards to other replicas before it
  exits (`cluster.handover_timeout`), serving meanwhile. QoS 1 publishes one after
  the other from the SIGTERM until a second after the site exited: the longest wait
  for an acknowledgement (a connection and a publish each, ~20 ms, when nothing
  stalls).
  catch-up: every shard is filled (one publisher per shard), then a fourth site
  starts, is added to the controller and joined (`PUT .../replicas/SITE`, i.e.
  `ctl ds join messages SITE`); for each shard it gets a replica of, the time from
  the replica's creation until its applied offset reaches the leader's committed
  offset at the join. msgs/s = messages in those shards (as published by this
  benchmark) / the sum over them of (site reports the replica -> caught up): the
  controller takes the plan's steps one at a time, a round apart (the time from the
  join request to the last shard caught up is shown too); MB/s = the size of a checkpoint of
  the new site's messages (`POST .../checkpoints`, made once it caught up: the same
  data) / that time. Next to it a plain `shutil.copytree` of that checkpoint (warm
  page cache: an upper bound for a copy). The payloads ('x' padding) compress well,
  so the checkpoint is far smaller than the data folder (WAL included). Sites keep a
  log tail of LOG_RETAIN entries, so each replica the new site gets is bootstrapped
  from a checkpoint of its leader (streamed over the peer port), then reads the log:
  the catch-up time includes that bootstrap; the count is shown.

Prints tables, ratios against Mosquitto, saves a PNG and JSON into bench/results/.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib

from bench.broker_load import (
    LineFiles,
    Subscriber,
    established,
    in_parallel,
    parse_output,
    payload,
    publish_chunks,
    publish_command,
    start_subscriber,
    wait_subscribers,
)
from bench.broker_peers import Mosquitto, Stratamq, missing_peers
from harness.cluster import (
    Cluster,
    ControllerProcess,
    SiteProcess,
    http_json,
    poll,
)
from harness.processes import REPO, ManagedProcess
from stratamq.broker.config import merge_config
from stratamq.broker.ds.shard_set import shard_of

matplotlib.use("Agg")

N_SHARDS = 4
HEARTBEAT = 1.0  # `stratamq cluster`'s default
LOG_RETAIN = 100  # cluster.log_retain_entries of the benchmark's sites
WINDOW = 100
PROBE_RATE = 200.0  # msgs/s of the PUBACK latency probe
TRY_TIMEOUT = 10.0  # seconds one publish may wait for its PUBACK during a failover
TRY_EVERY = 0.1  # seconds between the starts of publish attempts during a failover
FILL_OFFSET = 30_000_000
ONE_TO_ONE, FANOUT = "1->1 QoS1", "fan-out 0->{1,2}"
MOSQUITTO, RF1, RF3 = "mosquitto", "stratamq RF1", "stratamq RF3"
SETUPS = (MOSQUITTO, RF1, RF3)
_PUBACK = re.compile(rb"received PUBACK \(Mid: (\d+)")


# -- processes ------------------------------------------------------------------------


class BenchSite(SiteProcess):
    """A cluster site with the shipped defaults (as Stratamq), not the tests' fast ones,
    but a short kept log tail (LOG_RETAIN), so that the joined site's replicas come from
    checkpoints whatever the fill."""

    def base_config(self, fast: bool) -> dict[str, Any]:
        return merge_config(super().base_config(False),
                            {"cluster": {"log_retain_entries": LOG_RETAIN}})


class BenchCluster(Cluster):
    """Sites on 127.0.0.(k+1) and a controller on 127.0.0.1, free ports."""

    def __init__(self, workdir: Path, sites: int, replication_factor: int,
                 n_shards: int = N_SHARDS) -> None:
        self.n_shards = n_shards
        self.network = None
        self.workdir = workdir
        self.sites = [BenchSite(workdir / f"site-{k}", k, f"127.0.0.{k + 1}", n_shards=n_shards,
                                heartbeat_interval=HEARTBEAT) for k in range(sites)]
        self.controller = ControllerProcess(
            workdir / "controller", "127.0.0.1", self.sites,
            replication_factor=replication_factor, n_shards=n_shards,
            heartbeat_interval=HEARTBEAT)
        self.site_ids = []

    def processes(self) -> list[ManagedProcess]:
        return [self.controller, *self.sites]

    def cpu_seconds(self) -> float:
        return sum(p.cpu_seconds() for p in self.processes() if p.alive())

    def stop(self) -> None:
        """The whole cluster stops: no hand-over (SIGINT), as `stratamq cluster` does."""
        for process in self.processes():
            try:
                process.stop(signum=signal.SIGINT)
            except Exception:
                process.kill()


@dataclass(frozen=True)
class Endpoint:
    """Where a client connects, and the CPU of the whole setup."""

    host: str
    port: int
    cpu: Callable[[], float]


def endpoint(process: ManagedProcess, cpu: Callable[[], float] | None = None) -> Endpoint:
    return Endpoint(process.host, process.port, cpu or process.cpu_seconds)


def client_for_shard(shard: int, prefix: str, suffix: str = "",
                     n_shards: int = N_SHARDS) -> str:
    """A client id (`suffix` added) whose messages go to `shard` of `n_shards` shards
    of messages; returned without the suffix."""
    for k in range(100_000):
        if shard_of(f"{prefix}-{k}{suffix}", n_shards) == shard:
            return f"{prefix}-{k}"
    raise AssertionError("unreachable: crc32 spreads client ids")


# -- results --------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    setup: str
    expected: int
    received: int
    seconds: float
    cpu_seconds: float
    latencies_ns: list[int] = field(default_factory=list)
    probe_expected: int = 0

    @property
    def rate(self) -> float:
        return self.received / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        return self.cpu_seconds / self.received * 1e6 if self.received else float("nan")

    def latency_ms(self, q: float) -> float:
        if not self.latencies_ns:
            return float("nan")
        ordered = sorted(self.latencies_ns)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


@dataclass
class CatchUp:
    shards: int = 0
    entries: int = 0  # log entries (each a batch of messages)
    messages: int = 0
    busy_seconds: float = 0.0  # sum over shards of replica created -> caught up
    disk_bytes: int = 0  # the new site's data folder (WAL included)
    bytes: int = 0
    seconds: float = 0.0
    copy_seconds: float = 0.0
    bootstraps: int = 0  # of the new site's replicas, those installed from a checkpoint
    per_shard_s: dict[int, float] = field(default_factory=dict)  # join -> caught up
    per_shard_seen_s: dict[int, float] = field(default_factory=dict)  # join -> replica

    @property
    def rate(self) -> float:
        return self.messages / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def mb_s(self) -> float:
        return self.bytes / 1e6 / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def end_to_end_rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    @property
    def copy_mb_s(self) -> float:
        return self.bytes / 1e6 / self.copy_seconds if self.copy_seconds else 0.0


@dataclass
class Results:
    rows: list[Row] = field(default_factory=list)
    failovers_s: list[float] = field(default_factory=list)
    handovers_s: list[float] = field(default_factory=list)
    failover_notes: list[str] = field(default_factory=list)
    catch_up: CatchUp | None = None
    shard_messages: dict[int, int] = field(default_factory=dict)  # the cluster's, published

    def count(self, client_id: str, messages: int) -> None:
        shard = shard_of(client_id, N_SHARDS)
        self.shard_messages[shard] = self.shard_messages.get(shard, 0) + messages


# -- loads ----------------------------------------------------------------------------


def run_1to1(where: Endpoint, setup: str, messages: int, files: LineFiles, outdir: Path,
             idle: float, probe_messages: int, publisher: str = "") -> Row:
    """One publisher (client id `publisher`-0, by default from `setup`) and one
    subscriber on the same site, QoS 1."""
    slug = setup.replace(" ", "-")
    publisher = publisher or f"bench-{slug}-pub"
    topic = f"bench/{slug}/1to1"
    subs = start_subscribers([where], topic, messages, outdir, slug)
    cpu_before = where.cpu()
    started_ns = time.time_ns()
    publish_chunks(where.port, topic, 1, WINDOW, publisher,
                   files.chunks(0, messages), host=where.host)
    wait_subscribers(subs, idle)
    cpu = where.cpu() - cpu_before
    arrivals = [parse_output(s.output) for s in subs]
    received = sum(len(a) for a in arrivals)
    last_ns = max((r.recv_ns for a in arrivals for r in a), default=started_ns)
    row = Row(ONE_TO_ONE, setup, messages, received, (last_ns - started_ns) / 1e9, cpu)
    if probe_messages:
        row.latencies_ns = puback_latencies(where, f"{topic}/probe", probe_messages)
        row.probe_expected = probe_messages
    return row


def start_subscribers(targets: Sequence[Endpoint], topic: str, count: int, outdir: Path,
                      prefix: str) -> list[Subscriber]:
    bases = {t.port: established(t.port) for t in targets}
    subs = [start_subscriber(t.port, topic, 1, count, outdir / f"{prefix}-{i}.out",
                             f"{prefix}-sub-{i}", host=t.host) for i, t in enumerate(targets)]
    for port, base in bases.items():
        wanted = base + sum(1 for t in targets if t.port == port)
        deadline = time.monotonic() + 60
        while established(port) < wanted and time.monotonic() < deadline:
            time.sleep(0.02)
    time.sleep(0.5)  # CONNECT and SUBSCRIBE follow the accept
    return subs


def puback_latencies(where: Endpoint, topic: str, messages: int) -> list[int]:
    """A paced `mosquitto_pub -d` at PROBE_RATE: for each message, from writing its
    line to reading its PUBACK line (packet id k is the k-th line)."""
    command = ["stdbuf", "-oL", *publish_command(where.port, topic, 1, WINDOW,
                                                 "bench-probe", debug=True, nodelay=True,
                                                 host=where.host)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    assert process.stdin is not None and process.stdout is not None
    acks: dict[int, int] = {}
    stdout = process.stdout

    def read() -> None:
        for line in stdout:
            found = _PUBACK.search(line)
            if found:
                acks.setdefault(int(found[1]), time.monotonic_ns())

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)  # past CONNACK: mosquitto_pub reads stdin only once connected
    sent: dict[int, int] = {}
    start = time.monotonic()
    for k in range(messages):
        delay = start + k / PROBE_RATE - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent[k + 1] = time.monotonic_ns()
        process.stdin.write(payload(k, time.time_ns()) + b"\n")
        process.stdin.flush()
    process.stdin.close()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    reader.join(10)
    return [acks[mid] - sent[mid] for mid in sent if mid in acks]


def fill_shards(cluster: BenchCluster, messages: int, files: LineFiles,
                results: Results) -> None:
    """`messages` QoS 1 messages into every shard, one publisher per shard on site 0."""
    site = cluster.sites[0]
    jobs: list[Callable[[], object]] = []
    for shard in range(N_SHARDS):
        # publish_chunks gives its k-th process the id PREFIX-k: one chunk, PREFIX-0
        prefix = client_for_shard(shard, f"bench-fill{shard}", suffix="-0")
        results.count(f"{prefix}-0", messages)
        jobs.append(functools.partial(
            publish_chunks, site.port, f"bench/fill/{shard}", 1, WINDOW, prefix,
            files.chunks(FILL_OFFSET + shard * messages, messages), host=site.host))
    in_parallel(jobs)


def publish_command_once(host: str, port: int, client_id: str, topic: str) -> list[str]:
    return ["mosquitto_pub", "-h", host, "-p", str(port), "-t", topic, "-q", "1", "-i",
            client_id, "-m", "failover", "-u", "bench"]


def publish_once(host: str, port: int, client_id: str, topic: str) -> bool:
    try:
        done = subprocess.run(publish_command_once(host, port, client_id, topic),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=TRY_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def until_acknowledged(host: str, port: int, client_id: str, topic: str,
                       since: float, limit: float = 120.0) -> float:
    """Seconds from `since` until a QoS 1 publish is acknowledged. A new attempt starts
    every TRY_EVERY s while none has succeeded (each may wait TRY_TIMEOUT s for its
    PUBACK: a write held by the site until the new leader takes it counts when it is
    answered), with its own client id of the same shard (one id would take over the
    earlier attempts' connections)."""
    attempts: list[tuple[subprocess.Popen[bytes], float]] = []
    next_start = time.monotonic()
    try:
        while time.monotonic() - since < limit:
            now = time.monotonic()
            if now >= next_start:
                shard = shard_of(client_id, N_SHARDS)
                command = publish_command_once(
                    host, port, client_for_shard(shard, f"{client_id}-{len(attempts)}"), topic)
                attempts.append((subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL), now))
                next_start = now + TRY_EVERY
            for process, began in attempts:
                if process.poll() == 0:
                    return time.monotonic() - since
                if process.returncode is None and now - began > TRY_TIMEOUT:
                    process.kill()
            time.sleep(0.01)
        return float("nan")
    finally:
        for process, _ in attempts:
            if process.poll() is None:
                process.kill()
            process.wait()


def longest_gap(host: str, port: int, client_id: str, topic: str, since: float,
                done: Callable[[], bool], limit: float = 120.0) -> float:
    """QoS 1 publishes one after the other from `since` until a second after `done()`
    holds: the longest time from `since` or an acknowledgement to the next one. A
    site that hands its shards over still serves while it does, so the first
    acknowledgement after a SIGTERM says nothing; the stall comes when the leaders
    change."""
    last = since
    longest = 0.0
    finish_at: float | None = None
    while time.monotonic() - since < limit:
        acknowledged = publish_once(host, port, client_id, topic)
        now = time.monotonic()
        if acknowledged:
            longest = max(longest, now - last)
            last = now
        if finish_at is None and done():
            finish_at = now + 1.0
        if finish_at is not None and now >= finish_at:
            return longest
    return float("nan")


def run_failovers(cluster: BenchCluster, kills: int, results: Results,
                  graceful: bool = False) -> None:
    """`kills` times, the site leading the most shards of `messages` is killed
    (`graceful`: stopped with SIGTERM, so it hands its shards over first), a shard it
    led is written to from another site until acknowledged again (`graceful`: the
    longest wait for an acknowledgement while it stops), and the site is started
    again."""
    what = "stopped (SIGTERM)" if graceful else "killed"
    for k in range(kills):
        leaders = cluster.leaders()
        victim = cluster.busiest_leader()
        led = [shard for shard, leader in leaders.items() if leader == victim]
        entry = next(site for site in cluster.sites if site.index != victim)
        client_id = client_for_shard(led[0], f"bench-{'handover' if graceful else 'failover'}-{k}")
        if not publish_once(entry.host, entry.port, client_id, "bench/failover"):  # warm
            results.failover_notes.append(f"{what} {k}: shard {led[0]} not writable before")
            continue
        site = cluster.sites[victim]
        with ThreadPoolExecutor(1) as stopper:
            began = time.monotonic()
            if graceful:
                stopped = stopper.submit(site.stop, 30.0)
                took = longest_gap(entry.host, entry.port, client_id, "bench/failover",
                                   began, stopped.done)
                stopped.result(60)
            else:
                site.kill()
                took = until_acknowledged(entry.host, entry.port, client_id,
                                          "bench/failover", began)
        results.count(client_id, 1)
        (results.handovers_s if graceful else results.failovers_s).append(took)
        print(f"  {'hand-over' if graceful else 'failover'} {k + 1}: site-{victim} {what} "
              f"(leader of shards {led}): writes to shard {led[0]} from site-{entry.index} "
              + (f"waited at most {took:.2f} s for an acknowledgement" if graceful else
                 f"acknowledged again after {took:.2f} s"), flush=True)
        try:
            site.start()
        except RuntimeError as error:
            note = str(error).strip().splitlines()[-1]
            results.failover_notes.append(f"site-{victim} restart failed: {note}")
            print(f"  site-{victim} did not restart: {note}", flush=True)
            return
        if not cluster.wait_ready(90):
            results.failover_notes.append(f"after {what} {k}: roles not taken in 90 s")
            return


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def run_catch_up(cluster: BenchCluster, fill: int, files: LineFiles, workroot: Path,
                 results: Results) -> CatchUp:
    fill_shards(cluster, fill, files, results)
    new = BenchSite(workroot / "cluster" / "site-3", 3, "127.0.0.4", n_shards=N_SHARDS,
                    heartbeat_interval=HEARTBEAT)
    new.start()
    cluster.sites.append(new)  # stopped with the others, counted in the CPU
    url = cluster.controller.url
    http_json("POST", f"{url}/api/v1/ds/sites", {"admin_url": new.admin_url})
    new_id = new.replication()["site"]
    assert poll(lambda: any(s["site"] == new_id and s["up"] for s in
                            http_json("GET", f"{url}/api/v1/ds/sites")["data"]), 60)
    storage = cluster.controller.storage()
    target = {s["id"]: s["committed"] for s in storage["shards"]}
    began = time.monotonic()
    http_json("PUT", f"{url}/api/v1/ds/storages/messages/replicas/{new_id}")
    caught: dict[int, float] = {}
    seen: dict[int, float] = {}
    deadline = began + 300
    while time.monotonic() < deadline:
        plan = cluster.controller.storage()
        mine = {s["shard"]: s for s in new.replication()["shards"] if s["db"] == "messages"}
        for shard, state in mine.items():
            if state["role"] != "none":  # the site lists every shard, held or not
                seen.setdefault(shard, time.monotonic() - began)
            if shard in seen and shard not in caught and state["applied"] >= target[shard]:
                caught[shard] = time.monotonic() - began
        pending = plan["plan"] or any(s["transitions"] for s in plan["shards"])
        got = {s["id"] for s in plan["shards"] if new_id in s["replicas"]}
        if not pending and got and got <= set(caught):
            break
        time.sleep(0.05)
    seconds = max(caught.values(), default=0.0)
    bootstraps = sum(s["bootstraps"] for s in new.replication()["shards"]
                     if s["db"] == "messages" and s["shard"] in caught)
    data = Path(new.config["durable_storage"]["messages"]["data_dir"])
    checkpoint = workroot / "checkpoint"
    http_json("POST", f"{new.admin_url}/api/v1/ds/storages/messages/checkpoints",
              {"dir": str(checkpoint)})
    size = folder_bytes(checkpoint)
    copy_began = time.monotonic()
    shutil.copytree(checkpoint, workroot / "copy")
    copy_seconds = time.monotonic() - copy_began
    return CatchUp(shards=len(caught), entries=sum(target[s] for s in caught),
                   messages=sum(results.shard_messages.get(s, 0) for s in caught),
                   busy_seconds=sum(caught[s] - seen[s] for s in caught),
                   per_shard_seen_s={s: seen[s] for s in caught},
                   bytes=size, disk_bytes=folder_bytes(data),
                   seconds=seconds, copy_seconds=copy_seconds, per_shard_s=caught,
                   bootstraps=bootstraps)


# -- setups ---------------------------------------------------------------------------


@dataclass
class Sizes:
    messages: int
    probe: int
    fanout: int
    kills: int
    fill: int
    idle: float


def bench_single(kind: type[ManagedProcess], setup: str, workroot: Path, files: LineFiles,
                 sizes: Sizes, results: Results) -> None:
    process = kind(workroot / setup)
    outdir = workroot / setup / "out"
    outdir.mkdir()
    process.start()
    try:
        results.rows.append(run_1to1(endpoint(process), setup, sizes.messages, files, outdir,
                                     sizes.idle, sizes.probe))
        progress(results.rows[-1])
    except Exception as error:
        print(f"  {setup} FAILED: {error!r}\n{process.log_tail(1500)}", file=sys.stderr)
    finally:
        process.stop()


def bench_cluster(workroot: Path, files: LineFiles, sizes: Sizes, results: Results) -> None:
    cluster = BenchCluster(workroot / "cluster", 3, 3)
    outdir = workroot / "cluster" / "out"
    outdir.mkdir(parents=True)
    began = time.monotonic()
    cluster.start(120)
    print(f"  cluster of 3 sites ready in {time.monotonic() - began:.1f} s", flush=True)
    try:
        site = [Endpoint(s.host, s.port, cluster.cpu_seconds) for s in cluster.sites]
        led_here = min(shard for shard, leader in cluster.leaders().items() if leader == 0)
        publisher = client_for_shard(led_here, f"bench-{RF3.replace(' ', '-')}-pub",
                                     suffix="-0")
        results.rows.append(run_1to1(site[0], RF3, sizes.messages, files, outdir,
                                     sizes.idle, sizes.probe, publisher))
        progress(results.rows[-1])
        results.count(f"{publisher}-0", sizes.messages)
        results.count("bench-probe", sizes.probe)
        row = run_fanout(site, sizes.fanout, files, outdir, sizes.idle)
        results.count("bench-fanout-pub-0", sizes.fanout)
        results.rows.append(row)
        progress(row)
        run_failovers(cluster, sizes.kills, results)
        run_failovers(cluster, sizes.kills, results, graceful=True)
        results.catch_up = run_catch_up(cluster, sizes.fill, files, workroot, results)
        c = results.catch_up
        print(f"  catch-up: {c.shards} shards, {c.messages} messages ({c.entries} entries), "
              f"{c.bytes / 1e6:.1f} MB, {c.busy_seconds:.2f} s catching up, all caught up "
              f"{c.seconds:.2f} s after the join; copytree {c.copy_seconds:.3f} s", flush=True)
    except Exception as error:
        print(f"  cluster FAILED: {error!r}\n{cluster.logs(1500)}", file=sys.stderr)
    finally:
        cluster.stop()


def run_fanout(site: Sequence[Endpoint], messages: int, files: LineFiles, outdir: Path,
               idle: float) -> Row:
    topic = "bench/fanout"
    subs = start_subscribers([site[1], site[2]], topic, messages, outdir, "fanout")
    cpu_before = site[0].cpu()
    started_ns = time.time_ns()
    publish_chunks(site[0].port, topic, 1, WINDOW, "bench-fanout-pub",
                   files.chunks(0, messages), host=site[0].host)
    wait_subscribers(subs, idle)
    cpu = site[0].cpu() - cpu_before
    arrivals = [parse_output(s.output) for s in subs]
    received = sum(len(a) for a in arrivals)
    last_ns = max((r.recv_ns for a in arrivals for r in a), default=started_ns)
    return Row(FANOUT, RF3, 2 * messages, received,
               (last_ns - started_ns) / 1e9, cpu)


def progress(row: Row) -> None:
    print(f"  {row.setup}: {row.scenario}: {row.received}/{row.expected} in {row.seconds:.1f} s,"
          f" {row.rate:,.0f} msgs/s, {row.cpu_us:.1f} us/msg"
          + (f", PUBACK p50 {row.latency_ms(0.5):.2f} ms p99 {row.latency_ms(0.99):.2f} ms"
             if row.latencies_ns else ""), flush=True)


# -- report ---------------------------------------------------------------------------


def _num(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:,.{digits}f}"  # NaN -> "-"


def _find(rows: Sequence[Row], scenario: str, setup: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.setup == setup), None)


def report(results: Results) -> list[str]:
    """The tables, as lines."""
    lines = []
    header = (f"{'scenario':<17} {'setup':<13} {'delivered':>13} {'msgs/s':>8} "
              f"{'CPU us/msg':>10} {'PUBACK p50 ms':>13} {'p99 ms':>7}")
    lines += [header, "-" * len(header)]
    for row in results.rows:
        lines.append(f"{row.scenario:<17} {row.setup:<13} "
                     f"{f'{row.received}/{row.expected}':>13} {row.rate:>8,.0f} "
                     f"{_num(row.cpu_us):>10} {_num(row.latency_ms(0.5), 2):>13} "
                     f"{_num(row.latency_ms(0.99), 2):>7}")
        if row.probe_expected and len(row.latencies_ns) < row.probe_expected:
            lines.append(f"  {row.setup}: the latency probe got {len(row.latencies_ns)} of "
                         f"{row.probe_expected} PUBACKs")
    peer = _find(results.rows, ONE_TO_ONE, MOSQUITTO)
    if peer is not None:
        lines += ["", f"{'vs Mosquitto, 1->1 QoS1':<24} {'msgs/s':>7} {'CPU/msg':>8} "
                      f"{'p50':>7} {'p99':>7}"]
        for setup in (RF1, RF3):
            ours = _find(results.rows, ONE_TO_ONE, setup)
            if ours is None or not peer.rate:
                continue
            lines.append(f"{setup:<24} {ours.rate / peer.rate:>6.2f}x "
                         f"{ours.cpu_us / peer.cpu_us:>7.2f}x "
                         f"{ours.latency_ms(0.5) / peer.latency_ms(0.5):>6.2f}x "
                         f"{ours.latency_ms(0.99) / peer.latency_ms(0.99):>6.2f}x")
    rf1, rf3 = _find(results.rows, ONE_TO_ONE, RF1), _find(results.rows, ONE_TO_ONE, RF3)
    if rf1 and rf3:
        lines.append(f"{'RF3 / RF1':<24} {rf3.rate / rf1.rate:>6.2f}x "
                     f"{rf3.cpu_us / rf1.cpu_us:>7.2f}x "
                     f"{rf3.latency_ms(0.5) / rf1.latency_ms(0.5):>6.2f}x "
                     f"{rf3.latency_ms(0.99) / rf1.latency_ms(0.99):>6.2f}x")
    if results.failovers_s:
        times = results.failovers_s
        lines += ["", f"failover after kill -9 of a leader site (heartbeat {HEARTBEAT:g} s): "
                      f"{len(times)} kills, median {statistics.median(times):.2f} s, "
                      f"max {max(times):.2f} s  ({', '.join(f'{t:.2f}' for t in times)})"]
    if results.handovers_s:
        times = results.handovers_s
        lines += [f"hand-over at SIGTERM of a leader site, longest wait for a PUBACK: "
                  f"{len(times)} stops, median {statistics.median(times):.2f} s, "
                  f"max {max(times):.2f} s  ({', '.join(f'{t:.2f}' for t in times)})"]
    lines += [f"  {note}" for note in results.failover_notes]
    c = results.catch_up
    if c is not None:
        lines += ["", f"catch-up of a joined 4th site: {c.shards} shard replicas "
                      f"({c.bootstraps} bootstrapped from a checkpoint of the leader, then "
                      f"the log; log tail kept {LOG_RETAIN} entries), "
                      f"{c.messages:,} messages ({c.entries:,} log entries), "
                      f"{c.bytes / 1e6:.1f} MB as a checkpoint ({c.disk_bytes / 1e6:.1f} MB "
                      "data folder)",
                  "  per shard, s from the join to replica created / caught up: " + ", ".join(
                      f"{shard}: {c.per_shard_seen_s.get(shard, 0):.2f}/{t:.2f}"
                      for shard, t in sorted(c.per_shard_s.items())),
                  f"  catching up {c.busy_seconds:.2f} s (sum over shards of replica created -> "
                  f"applied = leader's committed) = {c.rate:,.0f} msgs/s, {c.mb_s:.1f} MB/s",
                  f"  join request -> last shard caught up: "
                  f"{c.seconds:.2f} s = {c.end_to_end_rate:,.0f} msgs/s",
                  f"  shutil.copytree of its checkpoint: {c.copy_seconds:.3f} s = "
                  f"{c.copy_mb_s:,.0f} MB/s"]
    return lines


def plot(results: Results, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    found = [(s, _find(results.rows, ONE_TO_ONE, s)) for s in SETUPS]
    present = [(s, r) for s, r in found if r is not None]
    names = [s for s, _ in present]
    axes[0].bar(names, [r.cpu_us for _, r in present], color=["C1", "C0", "C2"][:len(names)])
    axes[0].set_title("1->1 QoS 1: CPU us per message\n(all processes of the setup)")
    xs = range(len(names))
    axes[1].bar([x - 0.2 for x in xs], [r.latency_ms(0.5) for _, r in present], 0.4,
                label="p50")
    axes[1].bar([x + 0.2 for x in xs], [r.latency_ms(0.99) for _, r in present], 0.4,
                label="p99")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_yscale("log")
    axes[1].set_title(f"PUBACK latency, ms ({PROBE_RATE:g} msgs/s probe)")
    axes[1].legend(fontsize=8)
    rates = [(f"1->1 {s}", r.rate) for s, r in present]
    fan = _find(results.rows, FANOUT, RF3)
    if fan is not None:
        rates.append(("fan-out RF3\n0->{1,2}", fan.rate))
    axes[2].bar([n for n, _ in rates], [v for _, v in rates])
    axes[2].set_title("delivered msgs/s")
    axes[2].tick_params(axis="x", labelsize=7, labelrotation=15)
    axis = axes[3]
    if results.failovers_s:
        kills = range(1, len(results.failovers_s) + 1)
        width = 0.4
        axis.bar([k - width / 2 for k in kills], results.failovers_s, width, color="crimson",
                 label="kill -9")
        if results.handovers_s:
            stops = range(1, len(results.handovers_s) + 1)
            axis.bar([k + width / 2 for k in stops], results.handovers_s, width,
                     color="seagreen", label="SIGTERM (hand-over)")
        axis.set_xticks(list(kills))
        axis.legend(fontsize=8)
        axis.set_xlabel("stop of a leader site")
        axis.set_ylabel("seconds until acknowledged again")
    c = results.catch_up
    axis.set_title("failover" + (
        f"\ncatch-up {c.rate:,.0f} msgs/s, {c.mb_s:.1f} MB/s; copy {c.copy_mb_s:,.0f} MB/s"
        if c else ""), fontsize=9)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- main -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small loads, < 2 min")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                        help="where the PNG and JSON go (default: bench/results/)")
    parser.add_argument("--kills", type=int, help="leader kills (default 5, quick 2)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    missing = [m for m in missing_peers() if not m.startswith("amqtt")]
    if shutil.which("stdbuf") is None:
        missing.append("stdbuf (coreutils)")
    if missing:
        print("missing: " + "; ".join(missing), file=sys.stderr)
        return 2
    sizes = (Sizes(messages=5_000, probe=300, fanout=3_000, kills=2, fill=5_000, idle=3.0)
             if args.quick else
             Sizes(messages=50_000, probe=2_000, fanout=20_000, kills=5, fill=50_000,
                   idle=5.0))
    if args.kills is not None:
        sizes.kills = args.kills
    args.out.mkdir(parents=True, exist_ok=True)
    workroot = Path(tempfile.mkdtemp(prefix="cluster_bench-"))
    started = time.monotonic()
    print(f"cluster benchmark{' (quick)' if args.quick else ''}: {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, work dir {workroot}", flush=True)
    results = Results()
    try:
        files = LineFiles(workroot / "lines")
        bench_single(Mosquitto, MOSQUITTO, workroot, files, sizes, results)
        bench_single(Stratamq, RF1, workroot, files, sizes, results)
        bench_cluster(workroot, files, sizes, results)
    finally:
        if not args.keep:
            shutil.rmtree(workroot, ignore_errors=True)
    print(f"\ncluster benchmark, {time.monotonic() - started:.0f} s, 64 B payloads, "
          f"publishers -M {WINDOW}, {N_SHARDS} shards; load average now "
          f"{os.getloadavg()[0]:.2f}")
    lines = report(results)
    print("\n".join(lines))
    stem = "cluster_bench_quick" if args.quick else "cluster_bench"
    png = args.out / f"{stem}.png"
    plot(results, png, f"stratamq replication factor 1 vs 3 (3 sites) vs Mosquitto, 64 B, "
         f"{os.cpu_count()} CPUs" + (" (quick)" if args.quick else ""))
    (args.out / f"{stem}.json").write_text(json.dumps({
        "rows": [{**asdict(r), "latencies_ns": None, "p50_ms": r.latency_ms(0.5),
                  "p99_ms": r.latency_ms(0.99), "rate": r.rate, "cpu_us": r.cpu_us}
                 for r in results.rows],
        "failovers_s": results.failovers_s, "failover_notes": results.failover_notes,
        "catch_up": None if results.catch_up is None else {
            **asdict(results.catch_up), "rate": results.catch_up.rate,
            "mb_s": results.catch_up.mb_s, "copy_mb_s": results.catch_up.copy_mb_s},
        "report": lines}, indent=1))
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
