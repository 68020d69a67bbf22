"""CPU and Python calls per message of several stratamq checkouts under the same
loads, taking turns, to tell a change in the work a message costs from the noise of a
busy machine (issue 24: a restructuring must not cost CPU).

    .venv/bin/python bench/compare_checkouts.py NAME=CHECKOUT [NAME=CHECKOUT ...]
        [--loads q1,q1w20,rf3-local,rf3-forwarded] [--messages N] [--repeats R]
        [--no-profile] [--keep]

A CHECKOUT is a worktree of this repository set up with its `.typecheck` folder (see
the README): its broker and controller run from it (PYTHONPATH); the clients, the
loads and this harness are this checkout's. Loads (64-byte payloads, QoS 1, one
`mosquitto_pub -l` and one `mosquitto_sub`, as in broker_bench.py and
cluster_bench.py):
  q1, q1w20: one site with the shipped defaults, the publisher with 100 (q1) or 20
  QoS 1 messages in flight;
  rf3-local, rf3-forwarded: three sites and a controller (replication factor 3, as
  cluster_bench.py), both clients on site 0, the publisher's shard led by site 0
  (local) or by another site (forwarded: its writes go to the leader).
Each repeat runs every checkout once on a fresh setup, in the order given. CPU us/msg
is utime+stime of the setup's processes over the load (which ends one idle second
after the last delivery) per delivered message: median, min and max of the
repeats. Unless --no-profile, one more turn runs each site's main thread under
cProfile (bench/profiled_site.py) during the load: Python calls per message summed
over the sites, which move by a few percent between runs (batch sizes follow the
timing) where CPU time moves by 10% or more on a shared machine. Prints a table.
"""

from __future__ import annotations

import argparse
import marshal
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.broker_bench import LIVE, Settings, run_live
from bench.broker_load import LineFiles
from bench.broker_peers import Stratamq
from bench.cluster_bench import BenchCluster, client_for_shard, endpoint, run_1to1
from harness.processes import REPO, BrokerProcess

SITE_LOADS = {live.slug: replace(live, probe_rate=0) for live in LIVE
              if live.slug in ("q1", "q1w20")}
CLUSTER_LOADS = ("rf3-local", "rf3-forwarded")
IDLE = 1.0  # seconds without a delivery that end a load
PROFILE_WAIT = 10.0  # seconds a site has to write its profile


@dataclass(frozen=True)
class Checkout:
    name: str
    path: Path

    def use(self) -> None:
        """Processes started from now on run this checkout's code."""
        os.environ["PYTHONPATH"] = str(self.path / ".typecheck")


@dataclass
class Result:
    load: str
    checkout: str
    cpu_us: list[float] = field(default_factory=list)
    calls: float | None = None  # Python calls per message, summed over the sites


def profiled(site: BrokerProcess) -> Path:
    """Have the site run under bench/profiled_site.py (before it starts); where its
    profile will be."""
    out = site.workdir / "profile.pstats"
    site.wrapper = (sys.executable, str(REPO / "bench" / "profiled_site.py"), str(out), "--")
    return out


def start_profiles(sites: Sequence[BrokerProcess], outs: Sequence[Path]) -> None:
    for out in outs:
        out.unlink(missing_ok=True)
    for site in sites:
        os.kill(site.pid, signal.SIGUSR1)
    time.sleep(0.3)  # each site's handler runs at its next bytecode


def stop_profiles(sites: Sequence[BrokerProcess], outs: Sequence[Path], received: int
                  ) -> float:
    """Stop the sites' profiles; the Python calls per message, summed over them."""
    for site in sites:
        os.kill(site.pid, signal.SIGUSR2)
    deadline = time.monotonic() + PROFILE_WAIT
    while not all(out.exists() for out in outs) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # written in one go after it appears
    calls = 0
    for out in outs:
        with out.open("rb") as stats:  # pstats' file: function -> (primitive calls, calls, ..)
            calls += sum(entry[1] for entry in marshal.load(stats).values())
    return calls / max(received, 1)


def run_site(checkout: Checkout, load: str, messages: int, files: LineFiles, workdir: Path,
             profile: bool) -> tuple[float, float | None]:
    """One run of a single-site load: (CPU us/msg, calls/msg when profiled)."""
    checkout.use()
    site = Stratamq(workdir)
    outs = [profiled(site)] if profile else []
    settings = Settings(quick=True, scale={}, drain=0, kill=0, idle=IDLE, out=workdir)
    site.start()
    try:
        if profile:
            start_profiles([site], outs)
        row = run_live(site, SITE_LOADS[load], messages, files, workdir, settings)
        calls = stop_profiles([site], outs, row.received) if profile else None
    finally:
        site.stop()
    return row.cpu_us, calls


def run_cluster(checkout: Checkout, loads: Sequence[str], messages: int, files: LineFiles,
                workdir: Path, profile: bool) -> dict[str, tuple[float, float | None]]:
    """One run of each cluster load on one fresh cluster."""
    checkout.use()
    cluster = BenchCluster(workdir, 3, 3)
    outs = [profiled(site) for site in cluster.sites] if profile else []
    found: dict[str, tuple[float, float | None]] = {}
    try:
        cluster.start(120)
        leaders = cluster.leaders()
        for load in loads:
            here = load == "rf3-local"
            shard = min(s for s, leader in leaders.items() if (leader == 0) == here)
            publisher = client_for_shard(shard, f"bench-{load}-pub", suffix="-0")
            if profile:
                start_profiles(cluster.sites, outs)
            row = run_1to1(endpoint(cluster.sites[0], cluster.cpu_seconds), load, messages,
                           files, workdir, IDLE, 0, publisher)
            calls = stop_profiles(cluster.sites, outs, row.received) if profile else None
            found[load] = (row.cpu_us, calls)
    finally:
        cluster.stop()
    return found


def run_turn(checkouts: Sequence[Checkout], loads: Sequence[str], messages: int,
             files: LineFiles, workroot: Path, turn: str, profile: bool,
             results: dict[tuple[str, str], Result]) -> None:
    for checkout in checkouts:
        measured: dict[str, tuple[float, float | None]] = {}
        for load in (load for load in loads if load in SITE_LOADS):
            measured[load] = run_site(checkout, load, messages, files,
                                      workroot / f"{turn}-{checkout.name}-{load}", profile)
        cluster_loads = [load for load in loads if load in CLUSTER_LOADS]
        if cluster_loads:
            measured.update(run_cluster(checkout, cluster_loads, messages, files,
                                        workroot / f"{turn}-{checkout.name}-cluster", profile))
        for load, (cpu_us, calls) in measured.items():
            result = results[(load, checkout.name)]
            if profile:
                result.calls = calls
            else:
                result.cpu_us.append(cpu_us)
            print(f"  {turn}: {load} {checkout.name}: {cpu_us:.1f} us/msg"
                  + (f", {calls:.1f} calls/msg (profiled)" if calls is not None else ""),
                  flush=True)


def print_table(results: Sequence[Result]) -> None:
    print("| load | checkout | CPU us/msg median (min-max) | repeats | Python calls/msg |")
    print("|---|---|---|---|---|")
    for r in results:
        cpu = (f"{statistics.median(r.cpu_us):.1f} ({min(r.cpu_us):.1f}-{max(r.cpu_us):.1f})"
               if r.cpu_us else "")
        calls = f"{r.calls:.1f}" if r.calls is not None else ""
        print(f"| {r.load} | {r.checkout} | {cpu} | {len(r.cpu_us)} | {calls} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs="+", metavar="NAME=CHECKOUT")
    known = [*SITE_LOADS, *CLUSTER_LOADS]
    parser.add_argument("--loads", default=",".join(known),
                        help="comma-separated subset of " + ",".join(known))
    parser.add_argument("--messages", type=int, default=20_000, help="per load and run")
    parser.add_argument("--repeats", type=int, default=3, help="timed turns (default 3)")
    parser.add_argument("--no-profile", action="store_true", help="no profiled turn")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    loads = [load.strip() for load in args.loads.split(",") if load.strip()]
    if set(loads) - set(known):
        parser.error(f"unknown loads {sorted(set(loads) - set(known))}")
    checkouts = []
    for spec in args.checkouts:
        name, _, path = spec.partition("=")
        if not path or not (Path(path) / ".typecheck" / "stratamq").is_dir():
            parser.error(f"{spec}: want NAME=CHECKOUT, a worktree with .typecheck/stratamq")
        checkouts.append(Checkout(name, Path(path).resolve()))
    missing = [client for client in ("mosquitto_pub", "mosquitto_sub")
               if shutil.which(client) is None]
    if missing:
        print(f"missing: {', '.join(missing)} (Debian package mosquitto-clients)",
              file=sys.stderr)
        return 2
    workroot = Path(tempfile.mkdtemp(prefix="compare_checkouts-"))
    started = time.monotonic()
    print(f"compare checkouts: {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}, work dir {workroot}", flush=True)
    results = {(load, c.name): Result(load, c.name) for load in loads for c in checkouts}
    try:
        files = LineFiles(workroot / "lines")
        for k in range(args.repeats):
            run_turn(checkouts, loads, args.messages, files, workroot, f"repeat {k + 1}",
                     False, results)
        if not args.no_profile:
            run_turn(checkouts, loads, args.messages, files, workroot, "profiled", True,
                     results)
    finally:
        if not args.keep:
            shutil.rmtree(workroot, ignore_errors=True)
    print(f"\ncompare checkouts, {time.monotonic() - started:.0f} s, {args.messages} "
          f"messages a run; load average now {os.getloadavg()[0]:.2f}")
    print_table(list(results.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
