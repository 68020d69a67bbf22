"""Benchmark of the durable storage (`stratamq.broker.ds`) on this disk, per layout
(`wildcard_optimized_v2`, `wildcard_optimized`), next to the limit of the stack under
it: raw rocksdict batched puts and iteration.

    .venv/bin/python bench/ds_bench.py [--quick] [--many-topics N] [--layouts A,B]
                                       [--payloads 64,1024] [--out DIR] [--data-dir DIR]

Measures, for each layout on the same workloads: write throughput through
`store_batch` (many concurrent publishers with small batches, sync=True, and large
batches), bytes on disk per message, replay throughput of exact topics, `+` filters
and `#` with RocksDB seeks per delivered message (replays read a closed generation:
a generation is added after the writes), and the end-to-end latency of a wildcard
subscriber that reads the current generation from storage while publishers write.
`--many-topics` sets the "many distinct topics" workload (default 1M; shorter runs
pass less). Prints tables and saves a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import matplotlib
from prometheus_client import REGISTRY
from rocksdict import Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from stratamq.broker.ds import DbOptions, DurableStorage, EndOfStream, Message, Stream
from stratamq.broker.ds import Iterator as StreamIterator
from stratamq.broker.ds.layouts import KNOWN_LAYOUTS
from stratamq.broker.ds.shard import now_us

matplotlib.use("Agg")

REPO = Path(__file__).resolve().parent.parent
DB = "messages"
WRITE_AIM = 0.30  # engine writes / raw batched put
REPLAY_AIM = 0.40  # exact-topic replay / raw iteration
READ_BATCH = 1000
REPEATS = 3  # replays are timed best of 3 (the machine is shared)
PAYLOAD_POOL = 256  # distinct random payloads, cycled (random: no free compression)
MAX_GATEWAYS = 1000


# -- workload ----------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """`n_topics` distinct topics `site/s{a}/device/d{b}/temp` (`sites` x `devices`),
    published by `gateways` clients: gateway g owns the topics t with t % gateways == g,
    so a topic lives in one shard. Each store_batch call is one gateway's next
    `call_batch` messages, on its topics in turn (as a broker stores what one client
    connection sent); gateways take turns, so every topic gets its share."""

    n_topics: int
    n_messages: int
    payload_size: int
    call_batch: int

    @cached_property
    def sites(self) -> int:
        best = 1
        for divisor in range(1, int(self.n_topics ** 0.5) + 1):
            if self.n_topics % divisor == 0:
                best = divisor
        return best

    @cached_property
    def devices(self) -> int:
        return self.n_topics // self.sites

    @cached_property
    def gateways(self) -> int:
        """At most MAX_GATEWAYS, dividing the topics (each owns as many) and the calls
        (each makes as many), so every topic is published to."""
        return math.gcd(self.n_topics, MAX_GATEWAYS, self.calls)

    @cached_property
    def calls(self) -> int:
        return -(-self.n_messages // self.call_batch)

    def call(self, index: int) -> tuple[int, range]:
        """(gateway, topics) of one store_batch call: topic = gateway + gateways * m
        for each m in the range, taken modulo the gateway's topic count."""
        gateway, turn = index % self.gateways, index // self.gateways
        count = min(self.call_batch, self.n_messages - index * self.call_batch)
        return gateway, range(turn * self.call_batch, turn * self.call_batch + count)

    def site_device(self, topic: int) -> tuple[int, int]:
        return topic % self.sites, topic // self.sites

    @cached_property
    def messages_per_topic(self) -> list[int]:
        counts = [0] * self.n_topics
        gateways, per_gateway = self.gateways, self.n_topics // self.gateways
        for index in range(self.calls):
            gateway, positions = self.call(index)
            for m in positions:
                counts[gateway + gateways * (m % per_gateway)] += 1
        return counts

    def count_matching(self, matches: Callable[[int, int], bool]) -> int:
        """How many messages went to topics `matches(site, device)` accepts (for
        checking what a replay delivers)."""
        return sum(count for topic, count in enumerate(self.messages_per_topic)
                   if matches(*self.site_device(topic)))


class MessageSource:
    def __init__(self, workload: Workload, seed: int = 1) -> None:
        self.workload = workload
        rng = random.Random(seed)
        self.payloads = [rng.randbytes(workload.payload_size) for _ in range(PAYLOAD_POOL)]
        sites = workload.sites
        self.topics = [f"site/s{t % sites}/device/d{t // sites}/temp"
                       for t in range(workload.n_topics)]
        self.clients = [f"gw{g}" for g in range(workload.gateways)]

    def batch(self, index: int) -> list[Message]:
        """The messages of store_batch call `index`."""
        workload = self.workload
        gateway, positions = workload.call(index)
        gateways, per_gateway = workload.gateways, workload.n_topics // workload.gateways
        topics, client, payloads = self.topics, self.clients[gateway], self.payloads
        return [Message(topics[gateway + gateways * (m % per_gateway)],
                        payloads[(index + m) % PAYLOAD_POOL], client_id=client, qos=1)
                for m in positions]


# -- results -----------------------------------------------------------------------


@dataclass
class WriteResult:
    label: str
    layout: str
    workload: Workload
    publishers: int
    seconds: float
    cpu_seconds: float
    disk: DiskUsage
    raw: RawResult | None = None

    @property
    def rate(self) -> float:
        return self.workload.n_messages / self.seconds

    @property
    def cpu_us_per_message(self) -> float:
        return self.cpu_seconds / self.workload.n_messages * 1e6

    @property
    def bytes_per_message(self) -> float:
        return self.disk.data / self.workload.n_messages

    @property
    def du_per_message(self) -> float:
        return self.disk.total / self.workload.n_messages


@dataclass
class ReplayResult:
    dataset: str
    layout: str
    kind: str
    topic_filter: str
    streams: int
    delivered: int
    expected: int
    seconds: float
    seeks: float
    raw: RawResult | None = None

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds > 0 else 0.0

    @property
    def seeks_per_message(self) -> float:
        return self.seeks / self.delivered if self.delivered else float("nan")


@dataclass
class RawResult:
    n_messages: int
    payload_size: int
    put_seconds: float
    put_cpu_seconds: float
    iter_seconds: float
    disk: DiskUsage

    @property
    def put_rate(self) -> float:
        return self.n_messages / self.put_seconds

    @property
    def iter_rate(self) -> float:
        return self.n_messages / self.iter_seconds


@dataclass
class LatencyResult:
    """Publish-to-read latency of a subscriber reading a wildcard filter from the
    current generation, polling its streams (as a session that has fallen behind
    does; a caught-up session takes the commit feed instead)."""

    layout: str
    topic_filter: str
    published: int
    delivered: int
    latencies_us: list[int]

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies_us)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000


@dataclass
class Report:
    writes: list[WriteResult] = field(default_factory=list)
    replays: list[ReplayResult] = field(default_factory=list)
    raws: dict[tuple[int, int], RawResult] = field(default_factory=dict)
    latencies: list[LatencyResult] = field(default_factory=list)


# -- helpers -----------------------------------------------------------------------


@dataclass(frozen=True)
class DiskUsage:
    data: int  # RocksDB SST files and write-ahead logs: what grows with the messages
    total: int  # everything, with per-shard info LOGs, OPTIONS, MANIFEST


def disk_usage(path: Path) -> DiskUsage:
    data = total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            size = (Path(root) / name).stat().st_size
            total += size
            if name.endswith((".sst", ".log")):
                data += size
    return DiskUsage(data, total)


def seek_count() -> float:
    return sum(REGISTRY.get_sample_value("stratamq_ds_layout_seek_total",
                                         {"db": DB, "layout": layout}) or 0.0
               for layout in KNOWN_LAYOUTS)


def db_options(shards: int, layout: str) -> DbOptions:
    # the shipped defaults (WAL, no fsync, group commit, the layout's default options)
    return DbOptions(n_shards=shards, layout=layout)


def layout_label(layout: str) -> str:
    return {"wildcard_optimized_v2": "v2", "wildcard_optimized": "bitfield"}.get(layout, layout)


def human(n: float) -> str:
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n:.0f}"


def payload_label(size: int) -> str:
    return f"{size // 1024}KiB" if size >= 1024 and size % 1024 == 0 else f"{size}B"


# -- raw rocksdict -----------------------------------------------------------------


def raw_baseline(path: Path, n_messages: int, payload_size: int) -> RawResult:
    """Batched puts (WriteBatch of 1000, WAL on, sync off) of 18-byte keys and
    payload-sized values, then iteration of the range with `items()` (best of
    REPEATS)."""
    payloads = MessageSource(Workload(1, 1, payload_size, 1)).payloads
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    db = Rdict(str(path), options)
    write_options = WriteOptions()
    write_options.sync = False
    prefix = b"\x17" * 8 + b"\x00\x00"  # like a data key: static index | level 0
    started, cpu_started = time.perf_counter(), time.process_time()
    for start in range(0, n_messages, 1000):
        batch = WriteBatch(raw_mode=True)
        for k in range(start, min(n_messages, start + 1000)):
            batch.put(prefix + k.to_bytes(8, "big"), payloads[k % PAYLOAD_POOL])
        db.write(batch, write_options)
    put_seconds = time.perf_counter() - started
    put_cpu = time.process_time() - cpu_started

    iter_seconds = float("inf")
    for _ in range(REPEATS):
        read_options = ReadOptions()
        read_options.set_iterate_upper_bound(prefix[:-1] + b"\x01")
        started = time.perf_counter()
        count = 0
        for _key, _value in db.items(from_key=prefix, read_opt=read_options):
            count += 1
        iter_seconds = min(iter_seconds, time.perf_counter() - started)
        if count != n_messages:
            raise RuntimeError(f"raw iteration read {count} of {n_messages} values")
    db.close()
    Rdict(str(path), options).close()  # as for the engine: the log becomes SST files
    return RawResult(n_messages, payload_size, put_seconds, put_cpu, iter_seconds,
                     disk_usage(path))


# -- engine writes -----------------------------------------------------------------


async def write_all(storage: DurableStorage, source: MessageSource, publishers: int) -> None:
    """`publishers` concurrent callers, each storing one call's messages and waiting
    until they are durable before taking the next call."""
    calls = source.workload.calls
    cursor = 0

    async def publisher() -> None:
        nonlocal cursor
        while cursor < calls:
            index = cursor
            cursor += 1
            await storage.store_batch(DB, source.batch(index), sync=True)

    await asyncio.gather(*(publisher() for _ in range(publishers)))


async def replay(storage: DurableStorage, topic_filter: str) -> tuple[int, int, float, float]:
    """Read every stream of the filter to its end: (streams, delivered, seconds, seeks)."""
    seeks_before = seek_count()
    started = time.perf_counter()
    streams = storage.get_streams(DB, topic_filter, start_time=0)
    delivered = 0
    for _rank, stream in streams:
        iterator = storage.make_iterator(DB, stream, topic_filter, 0)
        while True:
            result = await storage.next(DB, iterator, READ_BATCH)
            if isinstance(result, EndOfStream):
                break
            iterator, messages = result
            if not messages:
                break
            delivered += len(messages)
    seconds = time.perf_counter() - started
    return len(streams), delivered, seconds, seek_count() - seeks_before


def replay_filters(workload: Workload) -> list[tuple[str, str, Callable[[int, int], bool]]]:
    """(kind, filter, matches(site, device)) for one dataset."""
    site = min(1, workload.sites - 1)
    device = min(42, workload.devices - 1)
    return [
        ("exact", "site/s0/device/d0/temp", lambda a, b: a == 0 and b == 0),
        ("+", f"site/s{site}/device/+/temp", lambda a, _b: a == site),
        (f"+ d{device}", f"site/+/device/d{device}/temp", lambda _a, b: b == device),
        ("#", "#", lambda _a, _b: True),
    ]


async def engine_run(path: Path, label: str, layout: str, workload: Workload, shards: int,
                     publishers: int, with_replay: bool) -> tuple[WriteResult, list[ReplayResult]]:
    source = MessageSource(workload)
    storage = DurableStorage(path)
    await storage.open_db(DB, db_options(shards, layout))
    started, cpu_started = time.perf_counter(), time.process_time()
    await write_all(storage, source, publishers)
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    dataset = f"{human(workload.n_topics)} topics {payload_label(workload.payload_size)}"
    replays: list[ReplayResult] = []
    if with_replay:
        # Replays read history: a closed generation, where no layout waits for
        # anything (the current generation's wildcard readers of `wildcard_optimized`
        # wait for the open epoch; that is measured by the latency run).
        await storage.add_generation(DB)
        for kind, topic_filter, matches in replay_filters(workload):
            runs = [await replay(storage, topic_filter) for _ in range(REPEATS)]
            streams, delivered, read_seconds, seeks = min(runs, key=lambda run: run[2])
            replays.append(ReplayResult(dataset, layout, kind, topic_filter, streams,
                                        delivered, workload.count_matching(matches),
                                        read_seconds, seeks))
    await storage.close()
    # Reopen once: the write-ahead log a close leaves behind (its data is already in
    # SST files) is dropped when RocksDB recovers it, so what is measured is the data
    # as it rests.
    storage = DurableStorage(path)
    await storage.open_db(DB, db_options(shards, layout))
    await storage.close()
    write = WriteResult(label, layout, workload, publishers, seconds, cpu_seconds,
                        disk_usage(path / DB))
    return write, replays


# -- latency of a wildcard subscriber ------------------------------------------------

LATENCY_TOPICS = 1000
LATENCY_RATE = 2000  # messages/s, in calls of LATENCY_CALL
LATENCY_CALL = 20
LATENCY_SECONDS = 5.0
LATENCY_FILTER = "site/+/device/+/temp"
POLL_PAUSE = 0.001  # a reader with nothing new looks again this much later


async def latency_run(path: Path, layout: str, shards: int, seconds: float) -> LatencyResult:
    """Publishers write LATENCY_RATE messages/s over LATENCY_TOPICS topics for
    `seconds`; one reader polls every stream of LATENCY_FILTER in the current
    generation and notes, per message, now minus its timestamp (set when its batch
    was cooked, just before it was written)."""
    workload = Workload(LATENCY_TOPICS, int(LATENCY_RATE * seconds), 64, LATENCY_CALL)
    source = MessageSource(workload)
    storage = DurableStorage(path)
    await storage.open_db(DB, db_options(shards, layout))
    # learn the topic structure first, so the streams exist when the clock starts
    await write_all(storage, MessageSource(Workload(LATENCY_TOPICS, LATENCY_TOPICS, 64,
                                                    LATENCY_CALL)), 4)
    start = now_us()
    latencies: list[int] = []
    done = asyncio.Event()

    async def publish() -> None:
        started = time.perf_counter()
        for index in range(workload.calls):
            delay = started + index * LATENCY_CALL / LATENCY_RATE - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await storage.store_batch(DB, source.batch(index), sync=True)
        await asyncio.sleep(2 ** 20 / 1e6 * 2)  # let readers reach the last epoch
        done.set()

    async def read() -> None:
        iterators: dict[Stream, StreamIterator] = {}
        while not done.is_set():
            for _rank, stream in storage.get_streams(DB, LATENCY_FILTER, start):
                if stream not in iterators:
                    iterators[stream] = storage.make_iterator(DB, stream, LATENCY_FILTER,
                                                              start)
            progressed = False
            for stream, iterator in iterators.items():
                result = await storage.next(DB, iterator, 100)
                if isinstance(result, EndOfStream):
                    continue
                iterators[stream], batch = result
                now = now_us()
                latencies.extend(now - message.timestamp for _key, message in batch)
                progressed = progressed or bool(batch)
            if not progressed:
                await asyncio.sleep(POLL_PAUSE)

    await asyncio.gather(publish(), read())
    await storage.close()
    return LatencyResult(layout, LATENCY_FILTER, workload.n_messages, len(latencies),
                         latencies)


# -- the run -----------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    messages: int  # for 10 and 10k topics
    many_topics: int  # the "1M distinct topics" case (as many messages)
    big_batch_callers: int
    latency_seconds: float = LATENCY_SECONDS


QUICK = Sizes(messages=20_000, many_topics=20_000, big_batch_callers=16, latency_seconds=2.0)
DEFAULT = Sizes(messages=200_000, many_topics=1_000_000, big_batch_callers=16)
BIG_BATCH = 1000


def scenarios(sizes: Sizes, publishers: int, call_batch: int, payloads: list[int],
              ) -> Iterator[tuple[str, Workload, int, bool]]:
    """(label, workload, concurrent callers, replay it)."""
    for payload in payloads:
        for n_topics in (10, 10_000, sizes.many_topics):
            n = max(sizes.messages, n_topics)
            workload = Workload(n_topics, n, payload, call_batch)
            label = (f"{payload_label(payload)} {human(n_topics)} topics "
                     f"{publishers}x{call_batch}")
            yield label, workload, publishers, True
        workload = Workload(10_000, sizes.messages, payload, BIG_BATCH)
        label = f"{payload_label(payload)} 10k topics {sizes.big_batch_callers}x{BIG_BATCH}"
        yield label, workload, sizes.big_batch_callers, False


def run(sizes: Sizes, work_dir: Path, shards: int, publishers: int, call_batch: int,
        layouts: list[str], payloads: list[int]) -> Report:
    report = Report()
    for index, (label, workload, callers, with_replay) in enumerate(
            scenarios(sizes, publishers, call_batch, payloads)):
        raw_key = (workload.n_messages, workload.payload_size)
        if raw_key not in report.raws:
            raw_path = work_dir / f"raw-{index}"
            print(f"  raw rocksdict: {human(workload.n_messages)} x "
                  f"{payload_label(workload.payload_size)} ...", file=sys.stderr, flush=True)
            report.raws[raw_key] = raw_baseline(raw_path, *raw_key)
            shutil.rmtree(raw_path)
        raw = report.raws[raw_key]
        for layout in layouts:
            print(f"  engine {layout_label(layout)}: {label} "
                  f"({human(workload.n_messages)} messages) ...", file=sys.stderr, flush=True)
            path = work_dir / f"engine-{index}-{layout}"
            write, replays = asyncio.run(engine_run(path, label, layout, workload, shards,
                                                    callers, with_replay))
            shutil.rmtree(path)
            write.raw = raw
            for result in replays:
                result.raw = raw
            report.writes.append(write)
            report.replays += replays
    for layout in layouts:
        print(f"  latency {layout_label(layout)}: {LATENCY_FILTER} ...", file=sys.stderr,
              flush=True)
        path = work_dir / f"latency-{layout}"
        report.latencies.append(asyncio.run(latency_run(path, layout, shards,
                                                        sizes.latency_seconds)))
        shutil.rmtree(path)
    return report


# -- output ------------------------------------------------------------------------


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in
                       enumerate(zip(headers, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                               enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def render(report: Report) -> str:
    out: list[str] = []
    write_rows = []
    for w in report.writes:
        assert w.raw is not None
        write_rows.append([
            w.label, layout_label(w.layout), human(w.workload.n_messages), f"{w.rate:,.0f}",
            f"{w.cpu_us_per_message:.1f}", f"{w.bytes_per_message:.0f}",
            f"{w.du_per_message:.0f}",
            f"{w.raw.put_rate:,.0f}", f"{w.rate / w.raw.put_rate:.0%}",
            "yes" if w.rate / w.raw.put_rate >= WRITE_AIM else "NO"])
    out.append("Writes (store_batch, sync=True; label: payload, topics, concurrent callers x "
               "messages per call, each call one publisher's)")
    out.append(table(["scenario", "layout", "msgs", "msg/s", "cpu us/msg", "data B/msg",
                      "du B/msg",
                      "raw put/s", "vs raw", f">={WRITE_AIM:.0%}"], write_rows))
    out.append("")
    replay_rows = []
    for r in report.replays:
        assert r.raw is not None
        ratio = r.rate / r.raw.iter_rate
        aim = ("yes" if ratio >= REPLAY_AIM else "NO") if r.kind == "exact" else ""
        check = "" if r.delivered == r.expected else f" (expected {r.expected})"
        replay_rows.append([
            r.dataset, layout_label(r.layout), r.topic_filter, str(r.streams),
            f"{r.delivered}{check}",
            f"{r.rate:,.0f}", f"{r.seeks_per_message:.3f}", f"{r.raw.iter_rate:,.0f}",
            f"{ratio:.0%}", aim])
    out.append(f"Replay (next, batch_size {READ_BATCH}, streams one after another, best of "
               f"{REPEATS}; raw = rocksdict items() over as many values)")
    out.append(table(["dataset", "layout", "filter", "streams", "delivered", "msg/s",
                      "seeks/msg",
                      "raw iter/s", "vs raw", f"exact>={REPLAY_AIM:.0%}"], replay_rows))
    out.append("")
    raw_rows = [[f"{human(r.n_messages)} x {payload_label(r.payload_size)}",
                 f"{r.put_rate:,.0f}", f"{r.put_cpu_seconds / r.n_messages * 1e6:.1f}",
                 f"{r.iter_rate:,.0f}", f"{r.disk.data / r.n_messages:.0f}"]
                for r in report.raws.values()]
    out.append("Raw rocksdict (18-byte keys, WriteBatch of 1000, WAL on, sync off)")
    out.append(table(["values", "put/s", "cpu us/put", "iter/s", "data B/value"], raw_rows))
    out.append("data B = SST files + write-ahead log after close and reopen; du B = every "
               "file, with RocksDB's per-shard info LOG and OPTIONS files")
    out.append("")
    if report.latencies:
        latency_rows = [[layout_label(r.layout), r.topic_filter, str(r.published),
                         str(r.delivered), f"{r.percentile(0.5):.1f}",
                         f"{r.percentile(0.99):.1f}", f"{r.percentile(1.0):.1f}"]
                        for r in report.latencies]
        out.append(f"Wildcard subscriber reading the current generation from storage "
                   f"({LATENCY_RATE} msg/s over {LATENCY_TOPICS} topics; latency = read "
                   "time - timestamp, ms)")
        out.append(table(["layout", "filter", "published", "read", "p50 ms", "p99 ms",
                          "max ms"], latency_rows))
        out.append("")
    out += aims(report)
    return "\n".join(out)


def aims(report: Report) -> list[str]:
    lines = []
    write_ratios = [w.rate / w.raw.put_rate for w in report.writes if w.raw is not None]
    met = sum(ratio >= WRITE_AIM for ratio in write_ratios)
    lines.append(f"Aim: writes >= {WRITE_AIM:.0%} of raw batched put: "
                 f"{'MET' if met == len(write_ratios) else 'NOT MET'} ({met} of "
                 f"{len(write_ratios)} scenarios reach it; ratios "
                 f"{min(write_ratios):.0%}..{max(write_ratios):.0%})")
    exact = [r for r in report.replays if r.kind == "exact" and r.raw is not None
             and r.delivered >= READ_BATCH]
    exact_ratios = [r.rate / r.raw.iter_rate for r in exact if r.raw is not None]
    if exact_ratios:
        met = sum(ratio >= REPLAY_AIM for ratio in exact_ratios)
        lines.append(f"Aim: exact-topic replay >= {REPLAY_AIM:.0%} of raw iteration: "
                     f"{'MET' if met == len(exact_ratios) else 'NOT MET'} ({met} of "
                     f"{len(exact_ratios)} datasets with >= {READ_BATCH} messages on the "
                     f"topic reach it; ratios {min(exact_ratios):.0%}..{max(exact_ratios):.0%})")
    wrong = [r for r in report.replays if r.delivered != r.expected]
    if wrong:
        lines.append(f"WARNING: {len(wrong)} replays delivered a different count than "
                     "was stored")
    return lines


def plot(report: Report, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(20, 9),
                                                 gridspec_kw={"width_ratios": [3, 4, 2]})
    labels = [f"{layout_label(w.layout)} {w.label}" for w in report.writes]
    positions = range(len(labels))
    width = 0.4
    left.barh([p - width / 2 for p in positions], [w.rate for w in report.writes], width,
              label="engine store_batch")
    left.barh([p + width / 2 for p in positions],
              [w.raw.put_rate if w.raw else 0 for w in report.writes], width,
              label="raw rocksdict put", color="tab:gray")
    for p, w in zip(positions, report.writes, strict=True):
        if w.raw is not None:
            left.text(w.rate, p - width / 2, f" {w.rate / w.raw.put_rate:.0%}",
                      va="center", fontsize=8)
    left.set_yticks(list(positions), labels, fontsize=8)
    left.invert_yaxis()
    left.set_xscale("log")
    left.set_xlabel("messages/s (log); % = engine / raw put")
    left.set_title(f"Writes (aim >= {WRITE_AIM:.0%} of raw put)")
    left.legend(fontsize=8, loc="lower right")

    replays = report.replays
    replay_labels = [f"{layout_label(r.layout)} {r.dataset}: {r.topic_filter}" for r in replays]
    positions = range(len(replays))
    middle.barh([p - width / 2 for p in positions], [r.rate for r in replays], width,
                label="engine next()")
    middle.barh([p + width / 2 for p in positions],
                [r.raw.iter_rate if r.raw else 0 for r in replays], width,
                label="raw rocksdict items()", color="tab:gray")
    for p, r in zip(positions, replays, strict=True):
        if r.raw is not None:
            middle.text(max(r.rate, 1), p - width / 2,
                        f" {r.rate / r.raw.iter_rate:.0%}, {r.seeks_per_message:.2f} seeks/msg"
                        f", {human(r.delivered)} msgs", va="center", fontsize=7)
    middle.set_yticks(list(positions), replay_labels, fontsize=7)
    middle.invert_yaxis()
    middle.set_xscale("log")
    top = max([r.rate for r in replays] + [r.raw.iter_rate for r in replays if r.raw])
    middle.set_xlim(right=top * 8)  # room for the notes
    middle.set_xlabel("messages/s (log); % = engine / raw iteration")
    middle.set_title(f"Replay (aim: exact topic >= {REPLAY_AIM:.0%} of raw iteration)")
    middle.legend(fontsize=8, loc="lower right")

    right.barh(list(range(len(labels))), [w.bytes_per_message for w in report.writes],
               color="tab:green")
    for p, w in enumerate(report.writes):
        right.text(w.bytes_per_message, p, f" {w.bytes_per_message:.0f}", va="center",
                   fontsize=8)
    right.set_yticks(list(range(len(labels))), labels, fontsize=8)
    right.invert_yaxis()
    right.set_xlim(0, max(w.bytes_per_message for w in report.writes) * 1.2)
    right.set_xlabel("bytes on disk per message (SST + WAL)")
    right.set_title("Disk")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def default_data_parent() -> Path:
    """The system temp dir when it is on the repository's disk, else bench/results."""
    temp = Path(tempfile.gettempdir())
    if temp.stat().st_dev == REPO.stat().st_dev:
        return temp
    fallback = REPO / "bench" / "results"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke check")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                        help="where the PNG goes (default: bench/results/)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the databases are made (a temp dir inside it, removed "
                             "after); default: a temp dir on the repository's disk")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--publishers", type=int, default=64)
    parser.add_argument("--call-batch", type=int, default=8,
                        help="messages per store_batch call of each publisher")
    parser.add_argument("--many-topics", type=int, default=None,
                        help="distinct topics of the many-topics workload (default 1M; "
                             "20k with --quick)")
    parser.add_argument("--layouts", default=",".join(KNOWN_LAYOUTS),
                        help=f"comma-separated layouts to compare (default: all, "
                             f"{','.join(KNOWN_LAYOUTS)})")
    parser.add_argument("--payloads", default="64,1024",
                        help="comma-separated payload sizes in bytes (default 64,1024)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else DEFAULT
    if args.many_topics is not None:
        sizes = replace(sizes, many_topics=args.many_topics)
    layouts = args.layouts.split(",")
    unknown = set(layouts) - set(KNOWN_LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; known: {', '.join(KNOWN_LAYOUTS)}")
    payloads = [int(size) for size in args.payloads.split(",")]
    parent = args.data_dir if args.data_dir is not None else default_data_parent()
    parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="ds-bench-", dir=parent))
    print(f"data in {work_dir} ({os.cpu_count()} CPUs)", file=sys.stderr)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        report = run(sizes, work_dir, args.shards, args.publishers, args.call_batch, layouts,
                     payloads)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print(render(report))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "ds_bench_quick.png" if args.quick else "ds_bench.png"
    title = (f"stratamq durable storage, {args.shards} shards, {os.cpu_count()} CPUs"
             f"{' (--quick sizes)' if args.quick else ''}")
    plot(report, args.out / name, title)
    print(f"\nplot: {args.out / name}  (run took {elapsed:.0f} s; 1-min load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
          "CPUs: other work on the machine lowers every rate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
