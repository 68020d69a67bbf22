"""Topic-pattern learning and the usage export on a real site.

`fleet/{region}/{vehicle}/{sensor}` published by each vehicle (so every shard sees
only its vehicles, too few per region to reach the threshold, and learns one stream
per topic). `stratamq spark learn-topics` sees the whole population: the vehicle
level varies, regions and sensors do not, one vehicle is hot. After `stratamq ctl ds
seed-topics` the next generation starts from that structure: fewer streams per
shard, fewer seeks for a `+` filter, and the same messages replayed. The usage
export then counts what the checkpoint holds per pattern and hour."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from matplotlib import pyplot as plt
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from harness.cluster import Cluster
from harness.processes import BrokerProcess, running_broker
from stratamq.broker.ds import EndOfStream, ShardSnapshot, Snapshot
from stratamq.broker.ds.layouts import ReadStats
from stratamq.spark.export import export_usage, pattern_of, pattern_trie, usage_figure
from stratamq.spark.topics import newest_copies, seed_patterns
from tests.support.checkpoints import Published, make_checkpoint, publish_all, snapshot_messages
from tests.support.clients import ADMIN_TOKEN, generations

REGIONS = ["north", "south", "east", "west"]
VEHICLES = [f"v{i}" for i in range(16)]
SENSORS = ["temp", "speed", "fuel"]
THRESHOLDS = [100, 6]
N_SHARDS = 4
CONFIG = {"durable_storage": {"messages": {"n_shards": N_SHARDS,
                                           "layout": {"wildcard_thresholds": THRESHOLDS}}},
          # rolls over every 6 s; keeps everything for the test's length
          "durable_sessions": {"message_retention_period": "6s",
                               "retention_rules": {"fleet/#": "1h"}}}
HOT = ("north", "v0")


def workload(tag: str) -> list[Published]:
    messages = []
    for region in REGIONS:
        for vehicle in VEHICLES:
            for sensor in SENSORS:
                repeat = 16 if (region, vehicle) == HOT else 1
                messages += [Published(f"{region}-{vehicle}",
                                       f"fleet/{region}/{vehicle}/{sensor}",
                                       f"{tag}-{i}".encode(), 1) for i in range(repeat)]
    return messages


def test_seed_patterns_vary_levels_by_the_whole_population() -> None:
    counts = Counter(m.topic for m in workload("x"))
    patterns = seed_patterns(counts.items(), THRESHOLDS, 0.25)
    assert patterns == sorted(
        [f"fleet/{r}/+/{s}" for r in REGIONS for s in SENSORS]
        + [f"fleet/north/v0/{s}" for s in SENSORS])
    # below the thresholds everything stays literal
    assert seed_patterns([("a/b", 1), ("a/c", 2)], [100, 10]) == ["a/b", "a/c"]


def test_a_topic_falls_under_its_hot_value_or_plus() -> None:
    trie = pattern_trie(["fleet/north/+/temp", "fleet/north/+/speed", "fleet/north/v0/temp",
                         "$SYS/+"])
    assert pattern_of("fleet/north/v3/temp", trie) == "fleet/north/+/temp"
    assert pattern_of("fleet/north/v0/temp", trie) == "fleet/north/v0/temp"
    # the hot branch has no `speed`: the `+` branch takes it
    assert pattern_of("fleet/north/v0/speed", trie) == "fleet/north/+/speed"
    assert pattern_of("$SYS/load", trie) == "$SYS/+"
    assert pattern_of("other/x", trie) == "other/x"
    assert pattern_of("fleet/north", trie) == "fleet/north"  # not a pattern's end either


def test_the_usage_plot_of_one_hour_spans_that_hour() -> None:
    """One hour of data: the axis covers that hour, not matplotlib's years around a
    single date (issue 28); two patterns' bars stack instead of hiding each other."""
    hour = datetime(2026, 11, 27, 10)
    rows = [SimpleNamespace(pattern="a/+", hour=hour, messages=5),
            SimpleNamespace(pattern="b/+", hour=hour, messages=5)]
    figure = usage_figure(rows, ["a/+", "b/+"])
    low, high = figure.axes[0].get_xlim()
    assert high - low < 0.1  # days: the two hours around it
    assert figure.axes[0].get_ylim()[1] >= 10
    # a tick per hour, each labelled once (not "10:00" at 10:00, 10:15, 10:30, ...)
    figure.canvas.draw()
    labels = [tick.get_text() for tick in figure.axes[0].get_xticklabels()]
    assert labels and len(labels) == len(set(labels)), labels
    assert "2026-11-27 10:00" in labels, labels
    # and the axis title is inside the picture
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    label_box = figure.axes[0].xaxis.label.get_window_extent(renderer)
    assert label_box.y0 >= 0, label_box
    plt.close(figure)


def streams_after(snapshot: Snapshot, since_generation: dict[int, int]) -> dict[int, int]:
    """Most streams any generation after the given one holds, per shard."""
    return {shard_id: max(len(snapshot.shard(shard_id).all_streams(g))
                          for g in snapshot.shard(shard_id).generations if g > after)
            for shard_id, after in since_generation.items()}


def count_seeks(shard: ShardSnapshot, generation: int, topic_filter: str,
                stats: ReadStats) -> None:
    """Read what the filter reads in one generation, counting the layout's work."""
    for stream in shard.get_streams(generation, topic_filter):
        iterator = shard.make_iterator(stream, topic_filter)
        while not isinstance(result := shard.next_raw(iterator, 100, stats), EndOfStream):
            iterator, _entries = result


def replayed(snapshot: Snapshot, pick: dict[int, list[int]], topic_filter: str
             ) -> tuple[list[tuple[str, bytes]], int]:
    """(topic, payload) of every message the filter reads in the picked generations,
    and the index seeks that took."""
    stats = ReadStats()
    found = [(m.topic, m.payload.split(b"-")[1])
             for _shard, _generation, _stream, m in snapshot_messages(snapshot, topic_filter, pick)]
    for shard_id, generation_ids in pick.items():
        for generation in generation_ids:
            count_seeks(snapshot.shard(shard_id), generation, topic_filter, stats)
    return sorted(found), stats.seeks


def wait_for_generation_after(broker: BrokerProcess, after: dict[int, int]) -> None:
    deadline = time.monotonic() + 60
    while not all(max(ids) > after[shard] for shard, ids in generations(broker).items()):
        assert time.monotonic() < deadline, "no generation rollover"
        time.sleep(0.2)


@pytest.mark.timeout(900)  # JVMs of Spark local on a shared 2-core machine
def test_seed_cuts_streams_and_seeks_and_export_counts(spark: SparkSession,
                                                       tmp_path: Path) -> None:
    with running_broker(tmp_path / "site", CONFIG) as broker:
        publish_all(broker, workload("one"))
        learned = tmp_path / "learned"
        make_checkpoint(broker, learned)
        seed_file = tmp_path / "seed.json"
        done = subprocess.run(
            [sys.executable, "-m", "stratamq.broker", "spark", "learn-topics", "--checkpoint",
             str(learned), "--config", str(broker.config_path), "--seed", str(seed_file),
             "--master", "local[2]"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        seed = json.loads(seed_file.read_text())
        assert "fleet/north/+/temp" in seed["patterns"]
        assert "fleet/north/v0/temp" in seed["patterns"]  # hot: streams of its own

        applied = subprocess.run(
            [sys.executable, "-m", "stratamq.broker", "ctl", "ds", "seed-topics", "messages",
             str(seed_file), "--url", f"http://127.0.0.1:{broker.admin_port}"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "STRATAMQ_ADMIN_TOKEN": ADMIN_TOKEN})
        assert applied.returncode == 0, applied.stderr
        assert "next generation" in applied.stdout
        # a generation opened from now on starts from the seed; one that a timed
        # rollover opened while the command ran may not
        seeded_at = {shard: max(ids) for shard, ids in generations(broker).items()}
        wait_for_generation_after(broker, seeded_at)
        first_seeded = {shard: max(ids) for shard, ids in generations(broker).items()}
        publish_all(broker, workload("two"))
        final = tmp_path / "final"
        make_checkpoint(broker, final)

    with Snapshot(learned) as before, Snapshot(final) as after:
        # (a rollover may have cut the first workload in two: every generation counts)
        streams_before = streams_after(before, dict.fromkeys(range(N_SHARDS), 0))
        streams_seeded = streams_after(after, {s: first_seeded[s] - 1 for s in range(N_SHARDS)})
        for shard in range(N_SHARDS):
            assert streams_seeded[shard] < streams_before[shard], (streams_seeded, streams_before)
        old = {s: list(before.shard(s).generations) for s in range(N_SHARDS)}
        new = {s: [g for g in after.shard(s).generations if g >= first_seeded[s]]
               for s in range(N_SHARDS)}
        for topic_filter in ("fleet/north/+/temp", "fleet/+/v3/speed", "fleet/north/v0/fuel",
                             "fleet/east/v5/temp", "#"):
            messages_before, seeks_before = replayed(before, old, topic_filter)
            messages_after, seeks_after = replayed(after, new, topic_filter)
            assert messages_after == messages_before, topic_filter
            if topic_filter == "fleet/north/+/temp":
                assert seeks_after < seeks_before, (seeks_after, seeks_before)

    # The usage export of the final checkpoint: per pattern and hour, the patterns
    # learned over the whole population, so a pattern counts its topics in every
    # shard and generation (each shard alone kept the first workload's topics literal).
    summary = export_usage(spark, str(final), str(tmp_path / "usage.parquet"),
                           str(tmp_path / "usage.png"), top=5, thresholds=THRESHOLDS)
    assert len(list((tmp_path / "usage.parquet").glob("*.parquet"))) == 1
    usage = spark.read.parquet(str(tmp_path / "usage.parquet")).collect()
    assert sum(row.messages for row in usage) == 2 * len(workload("x"))
    assert sum(row.bytes for row in usage) == sum(
        len(m.payload) for m in workload("one") + workload("two"))
    exported: Counter[str] = Counter()
    for row in usage:
        exported[row.pattern] += row.messages
    vehicles_not_hot = len(VEHICLES) - 1
    assert exported["fleet/north/+/temp"] == 2 * vehicles_not_hot
    assert exported["fleet/north/v0/temp"] == 2 * 16
    assert exported["fleet/south/+/speed"] == 2 * len(VEHICLES)
    assert set(exported) == set(seed_patterns(Counter(m.topic for m in workload("x")).items(),
                                              THRESHOLDS, 0.25))
    source = spark.read.format("stratamq").load(str(final))
    publishers = source.where(F.col("topic").like("fleet/south/%/speed")) \
        .select("publisher").distinct().count()
    assert max(row.publishers for row in usage if row.pattern == "fleet/south/+/speed") \
        <= publishers
    assert summary["top_patterns"] and (tmp_path / "usage.png").read_bytes()[:4] == b"\x89PNG"
    # A plot that cannot be written fails the export before its Parquet is written:
    # no half export left to refuse the retry (--out exists).
    with pytest.raises(OSError):  # its folder would be a file
        export_usage(spark, str(final), str(tmp_path / "again.parquet"),
                     str(tmp_path / "usage.png" / "usage.png"), top=5, thresholds=THRESHOLDS)
    assert not (tmp_path / "again.parquet").exists()


def test_newest_copies_counts_each_shard_once() -> None:
    def manifest(*committed: int) -> dict[str, Any]:
        return {"shards": [{"id": shard, "committed_timestamp": at}
                           for shard, at in enumerate(committed)]}

    # site A leads shards 0 and 2, B shards 1 and 3; shard 3 is empty everywhere
    assert newest_copies([manifest(50, 0, 70, 0), manifest(0, 60, 0, 0)]) == [[0, 2, 3], [1]]
    # replicas on both sites: each shard once, from the copy that is further on
    assert newest_copies([manifest(50, 60), manifest(55, 60)]) == [[1], [0]]


@pytest.mark.timeout(900)  # JVMs of Spark local on a shared 2-core machine
def test_learn_topics_merges_every_sites_checkpoint(tmp_path: Path) -> None:
    """`stratamq spark launch learn-topics` (the operator's scheduled run) on a
    two-site cluster whose sites both hold every shard and each lead some: each shard
    is checkpointed once, at its leader (issue 23: once per replica before), one seed
    from both checkpoints counts each message once, given to both sites (issue 28: a
    seed per site kept the last site's, learned from half the population)."""
    cluster = Cluster(tmp_path / "cluster", sites=2, n_shards=N_SHARDS,
                      replication_factor=2).start()
    try:
        leaders = cluster.leaders("messages")
        assert set(leaders.values()) == {0, 1}, leaders
        publish_all(cluster.sites[0], workload("one"))
        done = subprocess.run(
            [sys.executable, "-m", "stratamq.broker", "spark", "launch", "learn-topics",
             *(part for site in cluster.sites for part in ("--site", site.admin_url)),
             "--workdir", str(tmp_path / "work"), "--run", "r1", "--master", "local[2]",
             "--wildcard-thresholds", ",".join(map(str, THRESHOLDS))],
            capture_output=True, text=True, timeout=800,
            env={**os.environ, "STRATAMQ_ADMIN_TOKEN": ADMIN_TOKEN})
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        cluster.close()
    seed = json.loads((tmp_path / "work" / "r1" / "seed.json").read_text())
    counts = Counter(m.topic for m in workload("one"))
    assert seed["messages"] == sum(counts.values())
    assert seed["patterns"] == seed_patterns(counts.items(), THRESHOLDS, 0.25)
    result = json.loads((tmp_path / "work" / "r1" / "result.json").read_text())
    assert result["result"] == "Succeeded"
    assert [site["applied"]["patterns"] for site in result["sites_done"]] \
        == [len(seed["patterns"])] * 2
    assert not list((tmp_path / "work" / "r1").glob("site-*/checkpoint"))
    read = {index: [shard["id"] for shard in json.loads(
        (tmp_path / "work" / "r1" / f"site-{index}" / "checkpoint.json").read_text())["shards"]]
        for index in (0, 1)}
    assert read == {index: sorted(shard for shard, leader in leaders.items()
                                  if leader == index) for index in (0, 1)}
