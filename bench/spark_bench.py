"""Benchmark of the Spark data pipeline on this machine: topic learning on
`fleet/{region}/{vehicle}/{sensor}` (streams per shard, index seeks per message for
exact-topic and `+` filters, replay throughput, learned locally and seeded), rows
per second through the `stratamq` data source next to plain rocksdict iteration of
the same checkpoint, and the GC job (plan on Spark, apply on the storage) against
data size, with the bytes it frees.

    .venv/bin/python bench/spark_bench.py [--sizes 1000000,10000000] [--vehicles 20000]
        [--generations 1,10,50] [--repeat 3]

Each size is a fresh storage of `n` messages (random payloads, 256 bytes by default)
over 4 shards and two generations, half of them on topics whose retention rule has
expired at the plan's time (so the closed generation is rewritten); prints a table
and saves a PNG in bench/results/. The issue's sizes are the default; a quick look:
`--sizes 100000,300000`.

With `--generations`, the same messages (`--generation-messages`, default 200,000) are
stored over that many generations per shard, one checkpoint each, and read through the
source and with plain rocksdict, the counts interleaved and repeated (`--repeat`): the
source's share of rocksdict's rate should not fall with the number of generations."""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from rocksdict import AccessType, Options, Rdict

from stratamq.broker.ds import (
    DbOptions,
    DurableStorage,
    EndOfStream,
    Message,
    RetentionRules,
    Snapshot,
    decode_message,
)
from stratamq.broker.ds.layouts import ReadStats
from stratamq.spark.gc import make_plan
from stratamq.spark.session import spark_session
from stratamq.spark.topics import make_seed

matplotlib.use("Agg")

REPO = Path(__file__).resolve().parent.parent
N_SHARDS = 4
CALL_BATCH = 1000
DAY = 86_400.0


@dataclass
class Result:
    messages: int
    checkpoint_bytes: int
    rocksdict_rows_per_s: float
    source_rows_per_s: float
    source_decoded_rows_per_s: float
    plan_s: float
    apply_s: float
    bytes_freed: int
    deleted: int


def topic_of(i: int) -> str:
    # even: logs (1 day, expired at the plan's time); odd: sensors (7 days, live)
    kind = "logs" if i % 2 == 0 else "sensors"
    return f"{kind}/site{i % 50}/dev{i % 1000}/v"


async def fill(storage: DurableStorage, n: int, payload: int) -> None:
    pool = [random.randbytes(payload) for _ in range(64)]
    await storage.open_db("messages", DbOptions(n_shards=N_SHARDS))
    for start in range(0, n, CALL_BATCH):
        if start == n // 2:
            await storage.add_generation("messages")  # the first half is closed
        await storage.store_batch("messages", [
            Message(topic_of(i), pool[i % 64], f"gw{i % 40}", 1)
            for i in range(start, min(n, start + CALL_BATCH))])


async def fill_generations(storage: DurableStorage, n: int, generations: int,
                           payload: int) -> None:
    """`n` messages over `generations` generations per shard, the same number in each."""
    pool = [random.randbytes(payload) for _ in range(64)]
    await storage.open_db("messages", DbOptions(n_shards=N_SHARDS))
    per_generation = max(n // generations, 1)
    for start in range(0, n, CALL_BATCH):
        if start and start % per_generation < CALL_BATCH \
                and sum(shard == 0 for shard, _generation
                        in storage.db("messages").list_generations()) < generations:
            await storage.add_generation("messages")
        await storage.store_batch("messages", [
            Message(topic_of(i), pool[i % 64], f"gw{i % 40}", 1)
            for i in range(start, min(n, start + CALL_BATCH))])


@dataclass
class GenerationsResult:
    generations: int
    rocksdict_rows_per_s: list[float]
    source_rows_per_s: list[float]

    def ratios(self) -> list[float]:
        return [source / raw for source, raw in zip(self.source_rows_per_s,
                                                    self.rocksdict_rows_per_s, strict=True)]


def generations_runs(counts: list[int], n: int, payload: int, repeat: int, master: str,
                     workdir: Path) -> list[GenerationsResult]:
    """Reads of the same messages over 1, 10, 50... generations per shard: the source
    (keys only) and plain rocksdict, interleaved, `repeat` times."""
    checkpoints = {}
    for count in counts:
        storage = DurableStorage(workdir / f"data-g{count}")
        checkpoint = workdir / f"checkpoint-g{count}"

        async def prepare(storage: DurableStorage = storage, count: int = count,
                          checkpoint: Path = checkpoint) -> None:
            await fill_generations(storage, n, count, payload)
            await storage.db("messages").checkpoint(checkpoint)
            await storage.close()

        asyncio.run(prepare())
        shutil.rmtree(workdir / f"data-g{count}")
        checkpoints[count] = checkpoint
    results = {count: GenerationsResult(count, [], []) for count in counts}
    spark = spark_session("stratamq-bench", master, shuffle_partitions=8,
                          config={"spark.ui.enabled": "false"})
    try:
        spark.read.format("stratamq").load(str(checkpoints[counts[0]])).limit(1).collect()
        for _round in range(repeat):
            for count in counts:
                raw_rows, raw_s = rocksdict_rows(checkpoints[count])
                keys = spark.read.format("stratamq").schema("topic string, timestamp bigint") \
                    .load(str(checkpoints[count]))
                started = time.perf_counter()
                rows = keys.selectExpr("count(topic)").collect()[0][0]
                source_s = time.perf_counter() - started
                assert rows == raw_rows == n, (rows, raw_rows, n)
                results[count].rocksdict_rows_per_s.append(raw_rows / raw_s)
                results[count].source_rows_per_s.append(rows / source_s)
    finally:
        spark.stop()
    for checkpoint in checkpoints.values():
        shutil.rmtree(checkpoint)
    return [results[count] for count in counts]


def generations_table(n: int, results: list[GenerationsResult]) -> str:
    def spread(values: list[float], fmt: str) -> str:
        return f"{min(values):{fmt}} / {statistics.median(values):{fmt}} / {max(values):{fmt}}"

    lines = [f"{n:,} messages over 4 shards; min / median / max of the runs",
             "| generations per shard | rocksdict rows/s | source rows/s (keys) | "
             "source / rocksdict |", "|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.generations} | {spread(r.rocksdict_rows_per_s, ',.0f')} | "
                     f"{spread(r.source_rows_per_s, ',.0f')} | {spread(r.ratios(), '.2f')} |")
    return "\n".join(lines)


def generations_plot(results: list[GenerationsResult], path: Path) -> None:
    from matplotlib import pyplot

    figure, axis = pyplot.subplots(figsize=(6, 4))
    for r in results:
        axis.scatter([r.generations] * len(r.ratios()), r.ratios(), color="tab:blue")
    axis.plot([r.generations for r in results],
              [statistics.median(r.ratios()) for r in results], color="tab:blue",
              label="source / rocksdict (median)")
    axis.set_xscale("log")
    axis.set_ylim(bottom=0)
    axis.set_xlabel("generations per shard")
    axis.set_ylabel("rows/s, source / rocksdict")
    axis.legend()
    save(figure, path)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rocksdict_rows(checkpoint: Path) -> tuple[int, float]:
    """Every entry of every generation's data family, read raw (the floor)."""
    rows = 0
    started = time.perf_counter()
    for shard in range(N_SHARDS):
        path = str(checkpoint / str(shard))
        families = [name for name in Rdict.list_cf(path, Options(raw_mode=True))
                    if name.endswith(".data")]
        db = Rdict(path, Options(raw_mode=True),
                   column_families={name: Options(raw_mode=True) for name in
                                    Rdict.list_cf(path, Options(raw_mode=True))
                                    if name != "default"},
                   access_type=AccessType.read_only())
        for name in families:
            family = db.get_column_family(name)
            for _key, value in family.items():
                if value:  # index entries are empty
                    rows += 1
            family.close()
        db.close()
    return rows, time.perf_counter() - started


def run(size: int, payload: int, master: str, workdir: Path) -> Result:
    data = workdir / f"data-{size}"
    checkpoint = workdir / f"checkpoint-{size}"
    storage = DurableStorage(data)

    async def prepare() -> dict[str, object]:
        await fill(storage, size, payload)
        return await storage.db("messages").checkpoint(checkpoint)

    loop = asyncio.new_event_loop()
    manifest = loop.run_until_complete(prepare())
    created_at = int(manifest["created_at"])  # type: ignore[call-overload]
    raw_rows, raw_s = rocksdict_rows(checkpoint)
    spark = spark_session("stratamq-bench", master, shuffle_partitions=8,
                          config={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        # Python workers and the JVM's first query: not what the source costs per row
        spark.read.format("stratamq").load(str(checkpoint)).where("shard = 0").limit(1).collect()
        keys = spark.read.format("stratamq").schema("topic string, timestamp bigint") \
            .load(str(checkpoint))
        started = time.perf_counter()
        key_rows = keys.selectExpr("count(topic)").collect()[0][0]
        key_s = time.perf_counter() - started
        full = spark.read.format("stratamq").option("payload", "true").load(str(checkpoint))
        started = time.perf_counter()
        full_rows = full.selectExpr("sum(length(payload))", "count(*)").collect()[0][1]
        full_s = time.perf_counter() - started
        assert key_rows == full_rows == raw_rows == size, (key_rows, full_rows, raw_rows)
        rules = RetentionRules(DAY, {"sensors/#": 7 * DAY})
        started = time.perf_counter()
        plan = make_plan(spark, str(checkpoint), rules, now=created_at + int(2 * DAY * 1e6))
        plan_s = time.perf_counter() - started
    finally:
        spark.stop()
    started = time.perf_counter()
    report = loop.run_until_complete(storage.db("messages").apply_gc_plan(plan))
    apply_s = time.perf_counter() - started
    loop.run_until_complete(storage.close())
    loop.close()
    result = Result(size, folder_bytes(checkpoint), raw_rows / raw_s, key_rows / key_s,
                    full_rows / full_s, plan_s, apply_s, int(report["bytes_freed"]),
                    int(report["deleted_messages"]))
    shutil.rmtree(data)
    shutil.rmtree(checkpoint)
    return result


@dataclass
class LearnResult:
    generation: str
    streams_per_shard: float
    exact_seeks_per_message: float
    plus_seeks_per_message: float
    replay_messages_per_s: float


def fleet(regions: int, vehicles: int, sensors: int, tag: str) -> list[Message]:
    messages = [Message(f"fleet/r{r}/v{v}/s{s}", tag.encode(), f"r{r}-v{v}", 1)
                for r in range(regions) for v in range(vehicles) for s in range(sensors)]
    random.shuffle(messages)  # arrival order decides what a site learns
    return messages


def measure(snapshot: Snapshot, generation: int, name: str, exact: list[str],
            plus: list[str]) -> tuple[LearnResult, list[str]]:
    streams = [len(snapshot.shard(s).all_streams(generation)) for s in range(N_SHARDS)]
    rates = []
    topics: list[str] = []
    for filters in (exact, plus):
        stats = ReadStats()
        delivered = 0
        started = time.perf_counter()
        for topic_filter in filters:
            for shard_id in range(N_SHARDS):
                shard = snapshot.shard(shard_id)
                for stream in shard.get_streams(generation, topic_filter):
                    iterator = shard.make_iterator(stream, topic_filter)
                    while not isinstance(result := shard.next_raw(iterator, 1000, stats),
                                         EndOfStream):
                        iterator, entries = result
                        delivered += len(entries)
                        if filters is plus:
                            topics += [decode_message(value).topic for _k, value in entries]
        rates.append((stats.seeks / max(delivered, 1), delivered / (time.perf_counter()
                                                                     - started)))
    return LearnResult(name, sum(streams) / N_SHARDS, rates[0][0], rates[1][0],
                       rates[1][1]), sorted(topics)


def learn_run(vehicles: int, master: str, workdir: Path) -> list[LearnResult]:
    """fleet/{8 regions}/{vehicles}/{5 sensors}, published by each vehicle: the
    streams and seeks of a generation learned locally, then of one seeded by
    `learn-topics` from the same population."""
    data = workdir / "fleet"
    storage = DurableStorage(data)
    loop = asyncio.new_event_loop()

    async def store(tag: str) -> None:
        messages = fleet(8, vehicles, 5, tag)
        for start in range(0, len(messages), CALL_BATCH):
            await storage.store_batch("messages", messages[start:start + CALL_BATCH])

    async def first() -> None:
        await storage.open_db("messages", DbOptions(n_shards=N_SHARDS))
        await store("one")

    loop.run_until_complete(first())
    learned = workdir / "fleet-learned"
    loop.run_until_complete(storage.db("messages").checkpoint(learned))
    spark = spark_session("stratamq-bench-learn", master, shuffle_partitions=8,
                          config={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    try:
        seed = make_seed(spark, str(learned), (100, 10))
    finally:
        spark.stop()

    async def second() -> None:
        await storage.db("messages").set_topic_seed(seed["patterns"])
        await storage.add_generation("messages")
        await store("two")

    loop.run_until_complete(second())
    both = workdir / "fleet-both"
    loop.run_until_complete(storage.db("messages").checkpoint(both))
    loop.run_until_complete(storage.close())
    loop.close()
    rng = random.Random(7)
    exact = [f"fleet/r{rng.randrange(8)}/v{rng.randrange(vehicles)}/s{rng.randrange(5)}"
             for _ in range(50)]
    plus = [f"fleet/r{r}/+/s{s}" for r in range(8) for s in range(5)]
    with Snapshot(both) as snapshot:
        local, topics_local = measure(snapshot, 1, "learned locally", exact, plus)
        seeded, topics_seeded = measure(snapshot, 2, f"seeded ({len(seed['patterns'])} "
                                                     "patterns)", exact, plus)
    assert topics_local == topics_seeded, "the seeded generation replays other messages"
    for folder in (data, learned, both):
        shutil.rmtree(folder)
    return [local, seeded]


def learn_table(vehicles: int, results: list[LearnResult]) -> str:
    lines = [f"fleet/{{8 regions}}/{{{vehicles:,} vehicles}}/{{5 sensors}}, {N_SHARDS} shards",
             "| generation | streams per shard | seeks per message (exact) | "
             "seeks per message (+) | replay msgs/s (+) |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.generation} | {r.streams_per_shard:,.0f} | "
              f"{r.exact_seeks_per_message:.2f} | {r.plus_seeks_per_message:.3f} | "
              f"{r.replay_messages_per_s:,.0f} |" for r in results]
    return "\n".join(lines)


def table(results: list[Result]) -> str:
    lines = ["| messages | checkpoint | rocksdict rows/s | source rows/s (keys) | "
             "source rows/s (payload) | GC plan s | GC apply s | deleted | freed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.messages:,} | {r.checkpoint_bytes / 2**20:.0f} MiB | "
                     f"{r.rocksdict_rows_per_s:,.0f} | {r.source_rows_per_s:,.0f} | "
                     f"{r.source_decoded_rows_per_s:,.0f} | {r.plan_s:.1f} | {r.apply_s:.1f} | "
                     f"{r.deleted:,} | {r.bytes_freed / 2**20:.0f} MiB |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    from matplotlib import pyplot

    figure, (rates, times) = pyplot.subplots(1, 2, figsize=(11, 4))
    sizes = [r.messages for r in results]
    rates.plot(sizes, [r.rocksdict_rows_per_s for r in results], marker="o", label="rocksdict")
    rates.plot(sizes, [r.source_rows_per_s for r in results], marker="o", label="source (keys)")
    rates.plot(sizes, [r.source_decoded_rows_per_s for r in results], marker="o",
               label="source (payload)")
    rates.set_xscale("log")
    rates.set_yscale("log")
    rates.set_xlabel("messages")
    rates.set_ylabel("rows per second")
    rates.legend()
    times.plot(sizes, [r.plan_s for r in results], marker="o", label="plan (Spark)")
    times.plot(sizes, [r.apply_s for r in results], marker="o", label="apply (site)")
    times.set_xscale("log")
    times.set_xlabel("messages")
    times.set_ylabel("seconds")
    times.legend()
    save(figure, path)


def save(figure: Figure, path: Path) -> None:
    from matplotlib import pyplot

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,10000000",
                        help="messages per run, comma separated (empty: skip)")
    parser.add_argument("--payload", type=int, default=256, help="payload bytes")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--workdir", help="where the storages go (default: a temp folder)")
    parser.add_argument("--vehicles", type=int, default=20_000,
                        help="vehicles of the topic-learning workload (0: skip it)")
    parser.add_argument("--generations", default="",
                        help="generations per shard to compare, comma separated (1,10,50)")
    parser.add_argument("--generation-messages", type=int, default=200_000,
                        help="messages of each --generations run")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds of the --generations reads (interleaved)")
    arguments = parser.parse_args()
    workdir = Path(arguments.workdir or tempfile.mkdtemp(prefix="spark-bench-"))
    counts = [int(text) for text in arguments.generations.split(",") if text]
    if counts:
        found = generations_runs(counts, arguments.generation_messages, arguments.payload,
                                 arguments.repeat, arguments.master, workdir)
        print(generations_table(arguments.generation_messages, found), flush=True)
        generations_plot(found, Path(arguments.out) / "spark_bench_generations.png")
    if arguments.vehicles:
        print(learn_table(arguments.vehicles,
                          learn_run(arguments.vehicles, arguments.master, workdir)), flush=True)
    results = []
    for size in (int(text) for text in arguments.sizes.split(",") if text):
        results.append(run(size, arguments.payload, arguments.master, workdir))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    if results:
        print(table(results))
        plot(results, Path(arguments.out) / "spark_bench.png")


if __name__ == "__main__":
    main()
