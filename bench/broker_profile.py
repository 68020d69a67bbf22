"""Where stratamq spends its CPU under a QoS 1 load: py-spy samples the broker process
(all threads, idle ones left out) while the broker benchmark's 1->1 and 10->10 QoS 1
loads and the offline drain run (or those named by --only), then prints the functions
with the most own time (and the most time including callees).

    .venv/bin/python bench/broker_profile.py [--messages N] [--top K] [--out DIR]
                                             [--only q1,q1w20,p10,drain] [--native]

Needs py-spy in .venv (the `bench` extra; `make bench` installs it); writes the raw
samples and the report into bench/results/.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.broker_bench import LIVE, Settings, fill_offline, run_live, time_drain
from bench.broker_load import LineFiles
from bench.broker_peers import VENV_BIN, Stratamq
from harness.processes import REPO

_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_key(frame: str) -> str:
    """`function (path:line)` -> `function (short path)`, lines merged."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    path = match["file"]
    for marker in ("/site-packages/", "/broker/", "/lib/python3"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    return f"{match['name']} ({path})"


def summarize(raw: Path) -> tuple[int, Counter[str], Counter[str]]:
    """Samples, own samples per function, samples including callees per function."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_key(f) for f in stack.split(";")]
        samples += count
        own[frames[-1]] += count
        for key in set(frames):
            total[key] += count
    return samples, own, total


def report(samples: int, own: Counter[str], total: Counter[str], top: int) -> str:
    lines = [f"{samples} samples of busy broker threads"]
    for title, counter in (("own time", own), ("including callees", total)):
        lines.append(f"\ntop {top} by {title}:")
        for key, count in counter.most_common(top):
            lines.append(f"  {count / samples * 100:5.1f}%  {key}")
    return "\n".join(lines)


class Sampler:
    """py-spy recording a process from `with` until its end."""

    def __init__(self, py_spy: Path, pid: int, raw: Path, native: bool = False) -> None:
        self.command = [str(py_spy), "record", "--pid", str(pid), "--rate", "200",
                        "--format", "raw", "--output", str(raw)]
        # --native must stop the process to unwind C frames; plain sampling need not
        self.command += ["--native"] if native else ["--nonblocking"]
        self.raw = raw
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Sampler:
        self.raw.unlink(missing_ok=True)
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        time.sleep(0.5)  # attached
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
        _, errors = self.process.communicate(timeout=60)
        if not self.raw.exists():
            raise RuntimeError(f"py-spy wrote nothing: {errors.decode(errors='replace')}")

    def report(self, title: str, top: int) -> str:
        return f"== {title} ==\n" + report(*summarize(self.raw), top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000,
                        help="messages of the 1->1 load, of the 10->10 load (all pairs) "
                        "and of the drain")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--only", default="q1,p10,drain",
                        help="comma-separated loads to profile: slugs of broker_bench's "
                        "LIVE loads, and drain (default q1,p10,drain)")
    parser.add_argument("--native", action="store_true",
                        help="sample C frames too (uvloop, RocksDB); slows the broker")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    known = {*(live.slug for live in LIVE), "drain"}
    if only - known:
        parser.error(f"unknown loads {sorted(only - known)}; choose from {sorted(known)}")
    lives = [live for live in LIVE if live.slug in only]
    py_spy = VENV_BIN / "py-spy"
    if not py_spy.exists():
        print("py-spy is missing: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    workroot = Path(tempfile.mkdtemp(prefix="broker_profile-"))
    broker = Stratamq(workroot / "stratamq")
    outdir = workroot / "out"
    outdir.mkdir()
    settings = Settings(quick=False, scale={}, drain=0, kill=0, idle=5.0)
    files = LineFiles(workroot / "lines")
    texts = []
    broker.start()
    try:
        if lives:
            raw = args.out / "broker_profile_live.raw.txt"
            with Sampler(py_spy, broker.pid, raw, args.native) as sampler:
                for live in lives:
                    row = run_live(broker, replace(live, probe_rate=0.0),
                                   args.messages // live.publishers, files, outdir, settings)
                    print(f"{row.scenario}: {row.rate:,.0f} msgs/s, {row.cpu_us:.1f} us/msg "
                          "(under py-spy)", flush=True)
            texts.append(sampler.report(", ".join(live.name for live in lives), args.top))
        if "drain" in only:
            published = fill_offline(broker, args.messages, files)
            raw = args.out / "broker_profile_drain.raw.txt"
            with Sampler(py_spy, broker.pid, raw, args.native) as sampler:
                row = time_drain(broker, published, outdir, settings)
                print(f"drain: {row.rate:,.0f} msgs/s, {row.cpu_us:.1f} us/msg "
                      "(under py-spy)")
            texts.append(sampler.report(f"drain of {published} messages", args.top))
    finally:
        broker.stop()
        shutil.rmtree(workroot, ignore_errors=True)
    text = "\n\n".join(texts)
    (args.out / "broker_profile.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
