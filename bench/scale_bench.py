"""Scale-out benchmark (issue 25): the same load on a cluster of 3 and of 6 sites at
replication factor 3, and the CPU each site spends per message.

    .venv/bin/python bench/scale_bench.py [--quick] [--repeats N] [--out DIR] [--keep]

Setups: `stratamq cluster`-like clusters (bench/cluster_bench.py's `BenchCluster`:
each site on its own loopback address, a controller, heartbeat 1 s, the shipped
defaults otherwise) of 3 and of 6 sites, replication factor 3, 6 shards of
messages: at 3 sites each site holds 6 replicas (2 led), at 6 sites 3 (1 led).
They run one after the other, interleaved (3, 6, 3, 6, ...), `--repeats` times each,
so the spread shows.

Load: one QoS 1 publisher per shard (`mosquitto_pub -l -M 100`, 64-byte payloads, a
client id of that shard), connected to the shard's leader (its writes are local, not
forwarded), all at once; no subscriber, so what is measured is the write path and
its replication. Every message's PUBACK is counted.

Figures per run: msgs/s (acknowledged messages / wall time of the load); CPU us/msg
summed over every process of the cluster (sites and controller, utime+stime over the
load); per site, its CPU us/msg (mean and busiest); and what a 16-core node would
carry at that cost: 16 cores / (summed cost / sites) messages a second per node, the
whole cluster sites times that. The machine's 2 cores are shared by all the sites
and the clients, so rates here are not a cluster's: the costs are what transfers.

Prints a table, saves a PNG and JSON into bench/results/."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib

from bench.broker_load import LineFiles, in_parallel, publish_chunks
from bench.broker_peers import missing_peers
from bench.cluster_bench import WINDOW, BenchCluster, client_for_shard
from harness.processes import REPO

matplotlib.use("Agg")

SHARDS = 6
SITE_COUNTS = (3, 6)
CORES_PER_NODE = 16


@dataclass
class Run:
    sites: int
    repeat: int
    messages: int  # acknowledged
    seconds: float
    site_cpu_s: list[float]
    controller_cpu_s: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> float:
        """CPU per message summed over the cluster's processes."""
        return (sum(self.site_cpu_s) + self.controller_cpu_s) / self.messages * 1e6

    @property
    def per_site_us(self) -> list[float]:
        return [cpu / self.messages * 1e6 for cpu in self.site_cpu_s]

    @property
    def node_rate(self) -> float:
        """Messages a second a node of CORES_PER_NODE cores would carry, at this run's
        cost per message spread over the sites."""
        return CORES_PER_NODE * 1e6 / (self.cpu_us / self.sites)


def run_once(workroot: Path, sites: int, repeat: int, per_shard: int,
             files: LineFiles) -> Run:
    cluster = BenchCluster(workroot / f"sites{sites}-{repeat}", sites, 3, n_shards=SHARDS)
    began = time.monotonic()
    cluster.start(180)
    print(f"  {sites} sites ready in {time.monotonic() - began:.1f} s", flush=True)
    try:
        leaders = cluster.leaders()
        jobs: list[Callable[[], set[int]]] = []
        for shard in range(SHARDS):
            site = cluster.sites[leaders[shard]]
            prefix = client_for_shard(shard, f"scale-{sites}-{repeat}-s{shard}", suffix="-0",
                                      n_shards=SHARDS)
            jobs.append(functools.partial(
                publish_chunks, site.port, f"bench/scale/{shard}", 1, WINDOW, prefix,
                files.chunks(shard * per_shard, per_shard), count_acks=True,
                host=site.host))
        acked: list[set[int]] = []
        before = [site.cpu_seconds() for site in cluster.sites]
        controller_before = cluster.controller.cpu_seconds()
        started = time.monotonic()
        in_parallel([functools.partial(lambda job: acked.append(job()), job) for job in jobs])
        seconds = time.monotonic() - started
        run = Run(sites, repeat, sum(len(found) for found in acked), seconds,
                  [site.cpu_seconds() - b for site, b in zip(cluster.sites, before, strict=True)],
                  cluster.controller.cpu_seconds() - controller_before)
    finally:
        cluster.stop()
    if run.messages < SHARDS * per_shard:
        print(f"  {sites} sites: only {run.messages} of {SHARDS * per_shard} acknowledged",
              file=sys.stderr)
    print(f"  {sites} sites, run {repeat + 1}: {run.rate:,.0f} msgs/s, {run.cpu_us:.0f} us/msg "
          f"summed, per site {statistics.mean(run.per_site_us):.0f} mean / "
          f"{max(run.per_site_us):.0f} busiest", flush=True)
    return run


def spread(values: list[float], digits: int = 0) -> str:
    return (f"{statistics.median(values):,.{digits}f} "
            f"({min(values):,.{digits}f}-{max(values):,.{digits}f})")


def report(runs: list[Run]) -> list[str]:
    lines = ["| sites | runs | msgs/s | CPU us/msg summed | per site us/msg (mean) | "
             "busiest site us/msg | msgs/s per 16-core node | cluster of such nodes |",
             "|---|---|---|---|---|---|---|---|"]
    by_sites = {n: [run for run in runs if run.sites == n] for n in SITE_COUNTS}
    for n, found in by_sites.items():
        if not found:
            continue
        lines.append(
            f"| {n} | {len(found)} | {spread([r.rate for r in found])} | "
            f"{spread([r.cpu_us for r in found])} | "
            f"{spread([statistics.mean(r.per_site_us) for r in found])} | "
            f"{spread([max(r.per_site_us) for r in found])} | "
            f"{spread([r.node_rate for r in found])} | "
            f"{spread([r.node_rate * n for r in found])} |")
    small, large = by_sites[SITE_COUNTS[0]], by_sites[SITE_COUNTS[1]]
    if small and large:
        pairs = list(zip(small, large, strict=False))
        per_site = [statistics.mean(b.per_site_us) / statistics.mean(a.per_site_us)
                    for a, b in pairs]
        summed = [b.cpu_us / a.cpu_us for a, b in pairs]
        lines += ["", f"{SITE_COUNTS[1]} vs {SITE_COUNTS[0]} sites, run by run (interleaved):",
                  f"  per site CPU us/msg: {spread(per_site, 2)} x",
                  f"  summed CPU us/msg: {spread(summed, 2)} x"]
    return lines


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, (cost, node) = plt.subplots(1, 2, figsize=(10, 4))
    for index, n in enumerate(SITE_COUNTS):
        found = [run for run in runs if run.sites == n]
        if not found:
            continue
        cost.scatter([index] * len(found), [statistics.mean(r.per_site_us) for r in found],
                     color="steelblue", label="per site (mean)" if index == 0 else None)
        cost.scatter([index] * len(found), [r.cpu_us for r in found], color="crimson",
                     marker="x", label="summed" if index == 0 else None)
        node.scatter([index] * len(found), [r.node_rate * n for r in found],
                     color="seagreen")
    for axis in (cost, node):
        axis.set_xticks(range(len(SITE_COUNTS)), [f"{n} sites" for n in SITE_COUNTS])
        axis.set_xlim(-0.5, len(SITE_COUNTS) - 0.5)
    cost.set_ylabel("CPU us per message")
    cost.set_title("CPU per message, RF 3, 6 shards")
    cost.legend()
    node.set_ylabel("msgs/s")
    node.set_title(f"a cluster of {CORES_PER_NODE}-core nodes, at these costs")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small loads, ~3 min")
    parser.add_argument("--repeats", type=int, help="runs of each setup (default 3, quick 2)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                        help="where the PNG and JSON go (default: bench/results/)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    missing = [m for m in missing_peers() if m.startswith("mosquitto")]
    if missing:
        print("missing: " + "; ".join(missing), file=sys.stderr)
        return 2
    per_shard = 2_000 if args.quick else 10_000
    repeats = args.repeats or (2 if args.quick else 3)
    args.out.mkdir(parents=True, exist_ok=True)
    workroot = Path(tempfile.mkdtemp(prefix="scale_bench-"))
    print(f"scale benchmark{' (quick)' if args.quick else ''}: {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, {SHARDS} shards x {per_shard} messages, "
          f"work dir {workroot}", flush=True)
    runs: list[Run] = []
    try:
        files = LineFiles(workroot / "lines")
        for repeat in range(repeats):
            for sites in SITE_COUNTS:
                runs.append(run_once(workroot, sites, repeat, per_shard, files))
    finally:
        if not args.keep:
            shutil.rmtree(workroot, ignore_errors=True)
    lines = report(runs)
    print("\n" + "\n".join(lines))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    png = args.out / f"scale-{stamp}.png"
    plot(runs, png)
    (args.out / f"scale-{stamp}.json").write_text(json.dumps(
        {"shards": SHARDS, "per_shard": per_shard, "runs": [asdict(run) for run in runs]},
        indent=1))
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
