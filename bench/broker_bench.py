"""Broker benchmark: stratamq next to Mosquitto and amqtt on this machine, one broker
at a time, same clients, same loads (see broker_peers.py for their configurations).

    .venv/bin/python bench/broker_bench.py [--quick] [--out DIR] [--brokers a,b]
                                           [--drain N] [--kill N] [--amqtt-scale F]
                                           [--only q1,q1w20,drain,...]

Loads (64-byte payloads, Debian's C clients `mosquitto_pub -l` / `mosquitto_sub`, MQTT
3.1.1, clean sessions unless said otherwise, each publisher with `-M 100` in flight):
  1->1 QoS 0 and QoS 1; 1->1 QoS 1 with mosquitto_pub's default window (-M 20);
  10->10 QoS 1 (ten publisher/subscriber pairs, one topic per pair);
  1->100 QoS 1 fan-out (100 subscribers of one topic);
  drain: a persistent session (clean session false) subscribes at QoS 1 and goes
  offline, N QoS 1 messages are published (4 publishers), the session reconnects and
  the time until it has all N is measured (default N 1,000,000; amqtt 50,000: it
  stalls past 65,535);
  kill -9: one publisher sends N QoS 1 messages (default 50,000) to such an offline
  session counting its PUBACKs, the broker gets SIGKILL and is restarted on the same
  data directory, the session reconnects: acknowledged messages that never come back
  are lost.
amqtt gets a quarter of every load (--amqtt-scale): it is about ten times slower.

msgs/s are messages delivered to subscribers per second (fan-out: every copy counts),
from the first publish to the last arrival; CPU us/msg is the broker process's
utime+stime (/proc/<pid>/stat) over the run divided by those deliveries; CPU % is that
time over the run's wall time (100 = one core). Latency (p50/p99 of the send stamp in
the payload against mosquitto_sub's arrival time, one host clock) comes from a separate
low-rate run of the same topology, since a saturated run only measures its queues.
Prints tables and whether stratamq meets its aims; saves a PNG and JSON into
bench/results/. bench/broker_profile.py profiles stratamq under the same loads.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib
from matplotlib.axes import Axes

from bench.broker_load import (
    LineFiles,
    PacedPublisher,
    Subscriber,
    established,
    in_parallel,
    parse_output,
    publish_chunks,
    start_subscriber,
    subscribe_offline,
    wait_connections,
    wait_subscribers,
)
from bench.broker_peers import BROKERS, Stratamq, missing_peers
from harness.processes import REPO, ManagedProcess

matplotlib.use("Agg")

AIM_SCENARIO = "1->1 QoS1"
WINDOW_AIM_SCENARIO = "1->1 QoS1 -M 20"
# stratamq CPU per message / Mosquitto's, at most (the issue "One site you can trust")
CPU_AIMS = {AIM_SCENARIO: 1.5, WINDOW_AIM_SCENARIO: 2.5}
PEER_ORDER = ("stratamq", "mosquitto", "amqtt")
DRAIN_PUBLISHERS = 4
WINDOW = 100  # mosquitto_pub -M: QoS 1 messages in flight per publisher
DRAIN_OFFSET = 10_000_000  # sequence numbers of the drain and kill loads
KILL_OFFSET = 20_000_000
# amqtt 0.12 hands an offline backlog to the reconnecting session all at once, one
# packet id each: past 65535 messages it stalls (and stops serving other clients).
AMQTT_DRAIN_CAP = 60_000


@dataclass(frozen=True)
class Live:
    """Publishers and subscribers on line, a load per publisher and a latency probe."""

    name: str
    slug: str
    qos: int
    publishers: int
    subscribers: int
    fanout: bool  # all subscribers on the one topic; else pairs on their own topics
    messages: int  # per publisher
    quick_messages: int
    window: int = WINDOW
    probe_rate: float = 0.0  # per publisher, msgs/s; 0: no latency probe
    probe_messages: int = 0
    quick_probe_messages: int = 0

    def topics(self, phase: str) -> tuple[list[str], list[str]]:
        if self.fanout:
            topic = f"bench/{phase}/{self.slug}"
            return [topic] * self.publishers, [topic] * self.subscribers
        pairs = [f"bench/{phase}/{self.slug}/{i}" for i in range(self.publishers)]
        return pairs, list(pairs)


LIVE = (
    Live("1->1 QoS0", "q0", 0, 1, 1, False, 100_000, 10_000,
         probe_rate=500, probe_messages=1000, quick_probe_messages=250),
    Live(AIM_SCENARIO, "q1", 1, 1, 1, False, 100_000, 10_000,
         probe_rate=500, probe_messages=1000, quick_probe_messages=250),
    Live(WINDOW_AIM_SCENARIO, "q1w20", 1, 1, 1, False, 50_000, 5_000, window=20),
    Live("10->10 QoS1", "p10", 1, 10, 10, False, 10_000, 1_000,
         probe_rate=50, probe_messages=100, quick_probe_messages=25),
    Live("1->100 QoS1", "fan", 1, 1, 100, True, 1_000, 200,
         probe_rate=10, probe_messages=50, quick_probe_messages=15),
)
DRAIN = "drain (offline)"


@dataclass
class Row:
    scenario: str
    broker: str
    published: int
    expected: int
    received: int
    seconds: float
    cpu_seconds: float
    latencies_ns: list[int] = field(default_factory=list)
    probe_expected: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # stratamq's own count, by reason

    @property
    def rate(self) -> float:
        return self.received / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us(self) -> float:
        return self.cpu_seconds / self.received * 1e6 if self.received else float("nan")

    @property
    def cpu_percent(self) -> float:
        return self.cpu_seconds / self.seconds * 100 if self.seconds > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        if not self.latencies_ns:
            return float("nan")
        ordered = sorted(self.latencies_ns)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


@dataclass
class KillResult:
    broker: str
    published: int
    acked: int
    received: int
    lost: int


@dataclass
class Settings:
    quick: bool
    scale: dict[str, float]
    drain: int
    kill: int
    idle: float  # seconds without a new message before a subscriber counts as done
    drain_cap: dict[str, int] = field(default_factory=dict)
    out: Path = REPO / "bench" / "results"
    first_wait: float = 20.0  # seconds a restarted broker has to deliver a first message
    only: frozenset[str] = frozenset()  # the loads to run (Live slugs, "drain", "kill")


# -- runs ----------------------------------------------------------------------------


def _subscribers(broker: ManagedProcess, topics: Sequence[str], qos: int, expected: int,
                 outdir: Path, prefix: str) -> list[Subscriber]:
    base = established(broker.port)
    subscribers = [start_subscriber(broker.port, topic, qos, expected,
                                    outdir / f"{prefix}-{i}.out", f"{prefix}-{i}")
                   for i, topic in enumerate(topics)]
    wait_connections(broker.port, base + len(subscribers))
    time.sleep(0.3 + 0.01 * len(subscribers))  # CONNECT and SUBSCRIBE follow the accept
    return subscribers


def run_live(broker: ManagedProcess, live: Live, messages: int, files: LineFiles,
             outdir: Path, settings: Settings) -> Row:
    pub_topics, sub_topics = live.topics("load")
    per_subscriber = messages * (live.publishers if live.fanout else 1)
    subscribers = _subscribers(broker, sub_topics, live.qos, per_subscriber, outdir,
                               f"{live.slug}-sub")
    cpu_before = broker.cpu_seconds()
    started_ns = time.time_ns()
    in_parallel([functools.partial(publish_chunks, broker.port, topic, live.qos, live.window,
                                   f"bench-{live.slug}-pub-{i}",
                                   files.chunks(i * messages, messages))
                 for i, topic in enumerate(pub_topics)])
    wait_subscribers(subscribers, settings.idle)
    cpu = broker.cpu_seconds() - cpu_before
    arrivals = [parse_output(s.output) for s in subscribers]
    received = sum(len(a) for a in arrivals)
    last_ns = max((r.recv_ns for a in arrivals for r in a), default=started_ns)
    row = Row(live.name, broker.name, messages * live.publishers,
              per_subscriber * live.subscribers, received, (last_ns - started_ns) / 1e9, cpu)
    probe_messages = live.quick_probe_messages if settings.quick else live.probe_messages
    if live.probe_rate and probe_messages:
        row.latencies_ns, row.probe_expected = run_probe(broker, live, probe_messages, outdir,
                                                          settings)
    return row


def run_probe(broker: ManagedProcess, live: Live, messages: int, outdir: Path,
              settings: Settings) -> tuple[list[int], int]:
    """Latencies of a low-rate run of the same topology, and how many were expected."""
    pub_topics, sub_topics = live.topics("probe")
    per_subscriber = messages * (live.publishers if live.fanout else 1)
    subscribers = _subscribers(broker, sub_topics, live.qos, per_subscriber, outdir,
                               f"{live.slug}-probe-sub")
    base = established(broker.port)
    publishers = [PacedPublisher(broker.port, topic, live.qos, live.window,
                                 f"bench-{live.slug}-probe-pub-{i}", messages, live.probe_rate,
                                 i * messages)
                  for i, topic in enumerate(pub_topics)]
    wait_connections(broker.port, base + len(publishers))
    time.sleep(0.3)  # past CONNACK: mosquitto_pub reads stdin only once connected
    in_parallel([p.run for p in publishers])
    wait_subscribers(subscribers, settings.idle)
    latencies = [r.recv_ns - r.sent_ns for s in subscribers for r in parse_output(s.output)]
    return latencies, per_subscriber * live.subscribers


DRAIN_TOPIC, DRAIN_CLIENT = "bench/drain", "bench-drain-sub"


def fill_offline(broker: ManagedProcess, messages: int, files: LineFiles) -> int:
    """A persistent session subscribes and goes offline, then DRAIN_PUBLISHERS publish
    `messages` at QoS 1 for it; returns how many were published."""
    subscribe_offline(broker.port, DRAIN_TOPIC, DRAIN_CLIENT)
    per_publisher = messages // DRAIN_PUBLISHERS
    in_parallel([functools.partial(publish_chunks, broker.port, DRAIN_TOPIC, 1, WINDOW,
                                   f"bench-drain-pub-{i}",
                                   files.chunks(DRAIN_OFFSET + i * per_publisher, per_publisher))
                 for i in range(DRAIN_PUBLISHERS)])
    return per_publisher * DRAIN_PUBLISHERS


def time_drain(broker: ManagedProcess, messages: int, outdir: Path, settings: Settings) -> Row:
    """The offline session reconnects; until it has all `messages`."""
    cpu_before = broker.cpu_seconds()
    started_ns = time.time_ns()
    subscriber = start_subscriber(broker.port, DRAIN_TOPIC, 1, messages, outdir / "drain.out",
                                  DRAIN_CLIENT, clean=False)
    wait_subscribers([subscriber], settings.idle)
    cpu = broker.cpu_seconds() - cpu_before
    arrivals = parse_output(subscriber.output)
    received = len({r.seq for r in arrivals})
    last_ns = max((r.recv_ns for r in arrivals), default=started_ns)
    return Row(DRAIN, broker.name, messages, messages, received, (last_ns - started_ns) / 1e9,
               cpu)


def run_drain(broker: ManagedProcess, messages: int, files: LineFiles, outdir: Path,
              settings: Settings) -> Row:
    published = fill_offline(broker, messages, files)
    time.sleep(1.0)
    return time_drain(broker, published, outdir, settings)


def run_kill(broker: ManagedProcess, messages: int, files: LineFiles, outdir: Path,
             settings: Settings) -> KillResult:
    """Publish at QoS 1 to an offline persistent session counting PUBACKs, SIGKILL the
    broker, restart it on the same directory, reconnect the session."""
    topic, client = "bench/kill", "bench-kill-sub"
    subscribe_offline(broker.port, topic, client)
    acked = publish_chunks(broker.port, topic, 1, WINDOW, "bench-kill-pub",
                           files.chunks(KILL_OFFSET, messages), count_acks=True)
    broker.kill()
    broker.start()
    subscriber = start_subscriber(broker.port, topic, 1, max(len(acked), 1),
                                  outdir / "kill.out", client, clean=False)
    wait_subscribers([subscriber], settings.idle, first_wait=settings.first_wait)
    received = {r.seq for r in parse_output(subscriber.output)}
    result = KillResult(broker.name, messages, len(acked), len(received & acked),
                        len(acked - received))
    if result.lost and broker.name == "stratamq":  # keep what explains it
        report = settings.out / "broker_bench_kill_stratamq.log"
        report.write_text(f"{result}\n-- mosquitto_sub stderr:\n"
                          + subscriber.output.with_suffix(".err").read_text(errors="replace")
                          + "\n-- broker log (end):\n" + broker.log_tail(20_000))
        print(f"  stratamq lost acknowledged messages: see {report}", flush=True)
    return result


def bench_broker(name: str, workroot: Path, files: LineFiles, settings: Settings,
                 rows: list[Row], kills: list[KillResult]) -> None:
    """Every load on one broker; results go into `rows` and `kills` as they come, so a
    failure keeps what was measured before it."""
    broker = BROKERS[name](workroot / name)
    outdir = workroot / name / "out"
    outdir.mkdir()
    scale = settings.scale.get(name, 1.0)
    broker.start()
    try:
        for live in (live for live in LIVE if live.slug in settings.only):
            messages = max(1, int((live.quick_messages if settings.quick else live.messages)
                                  * scale))
            before = _dropped(broker)
            rows.append(run_live(broker, live, messages, files, outdir, settings))
            after = _dropped(broker)
            rows[-1].dropped = {k: int(v - before.get(k, 0)) for k, v in after.items()
                                if v > before.get(k, 0)}
            _progress(rows[-1])
        if "drain" in settings.only:
            drain = min(int(settings.drain * scale),
                        settings.drain_cap.get(name, settings.drain))
            rows.append(run_drain(broker, drain, files, outdir, settings))
            _progress(rows[-1])
        if "kill" in settings.only:
            kills.append(run_kill(broker, int(settings.kill * scale), files, outdir, settings))
            print(f"  {name}: kill -9: {kills[-1].acked} acked, {kills[-1].lost} of them "
                  "lost", flush=True)
    except Exception as error:
        print(f"  {name} FAILED: {error!r}\n  its log ends:\n{broker.log_tail(1500)}",
              file=sys.stderr, flush=True)
    finally:
        broker.stop()


def _dropped(broker: ManagedProcess) -> dict[str, float]:
    return broker.dropped() if isinstance(broker, Stratamq) else {}


def _progress(row: Row) -> None:
    print(f"  {row.broker}: {row.scenario}: {row.received}/{row.expected} in "
          f"{row.seconds:.1f} s, {row.rate:,.0f} msgs/s, {row.cpu_us:.1f} us/msg"
          + (f", broker dropped {row.dropped}" if row.dropped else ""), flush=True)


# -- report --------------------------------------------------------------------------


def _num(value: float, digits: int = 1) -> str:
    return "-" if value != value else f"{value:,.{digits}f}"  # NaN -> "-"


def print_table(rows: Sequence[Row]) -> None:
    header = (f"{'scenario':<17} {'broker':<10} {'published':>9} {'delivered':>15} "
              f"{'msgs/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/msg':>10} {'CPU %':>6}")
    print(header)
    print("-" * len(header))
    for row in rows:
        delivered = f"{row.received}/{row.expected}"
        print(f"{row.scenario:<17} {row.broker:<10} {row.published:>9} {delivered:>15} "
              f"{row.rate:>9,.0f} {_num(row.latency_ms(0.50), 2):>8} "
              f"{_num(row.latency_ms(0.99), 2):>8} {_num(row.cpu_us):>10} "
              f"{row.cpu_percent:>6.0f}")
    for row in rows:
        if row.dropped:
            print(f"  {row.broker} {row.scenario}: the broker counted "
                  + ", ".join(f"{n} dropped ({reason})" for reason, n in row.dropped.items()))
        if row.probe_expected and len(row.latencies_ns) < row.probe_expected:
            print(f"  {row.broker} {row.scenario}: the latency probe got "
                  f"{len(row.latencies_ns)} of {row.probe_expected}")


def _find(rows: Sequence[Row], scenario: str, broker: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.broker == broker), None)


def print_ratios(rows: Sequence[Row]) -> None:
    peers = [p for p in PEER_ORDER[1:] if any(r.broker == p for r in rows)]
    if not any(r.broker == "stratamq" for r in rows) or not peers:
        return
    header = f"{'stratamq / peer':<17} " + " ".join(
        f"{p + ' msgs/s':>16} {p + ' CPU/msg':>17}" for p in peers)
    print(header)
    print("-" * len(header))
    for scenario in dict.fromkeys(r.scenario for r in rows):
        ours = _find(rows, scenario, "stratamq")
        if ours is None:
            continue
        cells = []
        for peer in peers:
            theirs = _find(rows, scenario, peer)
            if theirs is None or not theirs.rate or not theirs.cpu_us:
                cells.append(f"{'-':>16} {'-':>17}")
                continue
            cells.append(f"{ours.rate / theirs.rate:>15.2f}x {ours.cpu_us / theirs.cpu_us:>16.2f}x")
        print(f"{scenario:<17} " + " ".join(cells))


def print_kills(kills: Sequence[KillResult]) -> None:
    header = (f"{'kill -9':<10} {'published':>9} {'PUBACKed':>9} {'back after restart':>18} "
              f"{'acked lost':>10}")
    print(header)
    print("-" * len(header))
    for kill in kills:
        print(f"{kill.broker:<10} {kill.published:>9} {kill.acked:>9} {kill.received:>18} "
              f"{kill.lost:>10}")


def print_aims(rows: Sequence[Row], kills: Sequence[KillResult]) -> list[str]:
    """The aims for stratamq, each met or not; returns the lines printed."""
    lines = []
    for scenario, aim in CPU_AIMS.items():
        ours, theirs = _find(rows, scenario, "stratamq"), _find(rows, scenario, "mosquitto")
        if ours and theirs:
            ratio = ours.cpu_us / theirs.cpu_us
            lines.append(f"CPU per message, {scenario}: stratamq {ours.cpu_us:.1f} us vs "
                         f"Mosquitto {theirs.cpu_us:.1f} us = {ratio:.2f}x (aim <= {aim}x): "
                         + ("MET" if ratio <= aim else "NOT MET"))
    ours, theirs = _find(rows, DRAIN, "stratamq"), _find(rows, DRAIN, "mosquitto")
    if ours and theirs:
        lines.append(f"offline-backlog drain: stratamq {ours.rate:,.0f} msgs/s vs Mosquitto "
                     f"{theirs.rate:,.0f} msgs/s (aim >= 1.00x): "
                     + ("MET" if ours.rate >= theirs.rate and ours.received == ours.expected
                        else "NOT MET") + f" ({ours.rate / theirs.rate:.2f}x)")
    for kill in kills:
        if kill.broker == "stratamq":
            lines.append(f"kill -9: stratamq lost {kill.lost} of {kill.acked} acknowledged "
                         "messages (aim 0): " + ("MET" if kill.lost == 0 else "NOT MET"))
    for line in lines:
        print(line)
    return lines


def _bars(axis: Axes, rows: Sequence[Row], brokers: Sequence[str], names: Sequence[str],
          value: Callable[[Row], float], title: str) -> None:
    width = 0.8 / max(len(brokers), 1)
    for k, broker in enumerate(brokers):
        found = [_find(rows, s, broker) for s in names]
        axis.bar([i + k * width for i in range(len(names))],
                 [value(r) if r else 0.0 for r in found], width, label=broker)
    axis.set_xticks([i + width * (len(brokers) - 1) / 2 for i in range(len(names))],
                    names, rotation=15, fontsize=8)
    axis.set_yscale("log")
    axis.set_title(title)
    axis.legend(fontsize=8)


def plot(rows: Sequence[Row], kills: Sequence[KillResult], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    brokers = [b for b in PEER_ORDER if any(r.broker == b for r in rows)]
    width = 0.8 / max(len(brokers), 1)
    figure, axes = plt.subplots(2, 2, figsize=(15, 9))
    _bars(axes[0][0], rows, brokers, scenarios, lambda r: r.rate, "delivered msgs/s")
    _bars(axes[0][1], rows, brokers, scenarios, lambda r: r.cpu_us,
          "broker CPU us per delivered msg")
    axis = axes[1][0]
    probed = list(dict.fromkeys(r.scenario for r in rows if r.latencies_ns))
    for k, broker in enumerate(brokers):
        found = [_find(rows, s, broker) for s in probed]
        xs = [i + k * width for i in range(len(probed))]
        axis.bar(xs, [r.latency_ms(0.99) if r else 0.0 for r in found], width, alpha=0.35,
                 color=f"C{k}")
        axis.bar(xs, [r.latency_ms(0.50) if r else 0.0 for r in found], width, color=f"C{k}",
                 label=f"{broker} p50 (pale: p99)")
    axis.set_xticks([i + width * (len(brokers) - 1) / 2 for i in range(len(probed))], probed,
                    rotation=15, fontsize=8)
    axis.set_yscale("log")
    axis.set_title("end-to-end latency, ms (low-rate probe)")
    axis.legend(fontsize=8)
    axis = axes[1][1]
    names = [k.broker for k in kills]
    lost = [k.lost / k.acked * 100 if k.acked else 0.0 for k in kills]
    axis.bar(names, [100.0 if k.acked else 0.0 for k in kills], color="lightgray",
             label="PUBACKed")
    axis.bar(names, lost, color="crimson", label="of those, lost")
    for i, kill in enumerate(kills):
        axis.text(i, 101, f"{kill.lost} of {kill.acked} lost", ha="center", va="bottom",
                  fontsize=9)
    axis.set_ylim(0, 115)
    axis.set_ylabel("% of PUBACKed messages")
    axis.set_title("kill -9 with the persistent subscriber offline, then restart")
    axis.legend(fontsize=8, loc="center right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- main ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small loads, < 90 s")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                        help="where the PNG and JSON go (default: bench/results/)")
    parser.add_argument("--brokers", default=",".join(PEER_ORDER),
                        help="comma-separated subset of " + ",".join(PEER_ORDER))
    parser.add_argument("--drain", type=int, help="messages of the drain load (default "
                        "1000000, quick 20000; amqtt gets --amqtt-scale of it, at most "
                        f"{AMQTT_DRAIN_CAP})")
    parser.add_argument("--kill", type=int, help="messages of the kill -9 load "
                        "(default 50000, quick 5000; amqtt gets --amqtt-scale of it)")
    parser.add_argument("--amqtt-scale", type=float, default=0.25,
                        help="amqtt's loads relative to the others' (it is ~10x slower)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--only", help="comma-separated subset of the loads: "
                        + ",".join([*(live.slug for live in LIVE), "drain", "kill"]))
    args = parser.parse_args(argv)
    known = {*(live.slug for live in LIVE), "drain", "kill"}
    only = set(args.only.split(",")) if args.only else known
    if only - known:
        parser.error(f"unknown loads {sorted(only - known)}; choose from {sorted(known)}")
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    unknown = [b for b in brokers if b not in BROKERS]
    if unknown:
        parser.error(f"unknown brokers {unknown}; choose from {list(BROKERS)}")
    missing = missing_peers()
    if missing:
        print("missing: " + "; ".join(missing) + " (make bench installs them)", file=sys.stderr)
        return 2
    settings = Settings(
        quick=args.quick, scale={"amqtt": args.amqtt_scale},
        drain=args.drain or (20_000 if args.quick else 1_000_000),
        kill=args.kill or (5_000 if args.quick else 50_000),
        idle=3.0 if args.quick else 5.0, drain_cap={"amqtt": AMQTT_DRAIN_CAP}, out=args.out,
        first_wait=6.0 if args.quick else 20.0, only=frozenset(only))
    args.out.mkdir(parents=True, exist_ok=True)
    workroot = Path(tempfile.mkdtemp(prefix="broker_bench-"))
    started = time.monotonic()
    print(f"broker benchmark{' (quick)' if args.quick else ''}: {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}, work dir {workroot}", flush=True)
    rows: list[Row] = []
    kills: list[KillResult] = []
    try:
        files = LineFiles(workroot / "lines")
        for name in brokers:
            bench_broker(name, workroot, files, settings, rows, kills)
    finally:
        if not args.keep:
            shutil.rmtree(workroot, ignore_errors=True)
    order = {b: i for i, b in enumerate(PEER_ORDER)}
    rows.sort(key=lambda r: ([*[live.name for live in LIVE], DRAIN].index(r.scenario),
                             order[r.broker]))
    print(f"\nbroker benchmark, {time.monotonic() - started:.0f} s, 64 B payloads, "
          f"publishers -M {WINDOW} unless noted; load average now {os.getloadavg()[0]:.2f}")
    print_table(rows)
    print()
    print_ratios(rows)
    print()
    print_kills(kills)
    print()
    aims = print_aims(rows, kills)
    stem = "broker_bench_quick" if args.quick else "broker_bench"
    png = args.out / f"{stem}.png"
    plot(rows, kills, png, f"stratamq vs Mosquitto vs amqtt, 64 B, {os.cpu_count()} CPUs"
         + (" (quick)" if args.quick else ""))
    (args.out / f"{stem}.json").write_text(json.dumps({
        "rows": [{**asdict(r), "latencies_ns": None, "p50_ms": r.latency_ms(0.5),
                  "p99_ms": r.latency_ms(0.99), "rate": r.rate, "cpu_us": r.cpu_us}
                 for r in rows],
        "kills": [asdict(k) for k in kills], "aims": aims}, indent=1))
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
