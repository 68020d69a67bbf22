"""Job 3: usage export (`stratamq spark export`).

Per topic pattern and hour: messages, payload bytes and distinct publishers, written
to one Parquet file; and a PNG of messages per hour for the top patterns, the view an
operator opens before changing retention.

A topic's pattern (`fleet/+/+/temp`: the levels that vary are `+`) is learned from
the whole topic population of the checkpoint, as `learn-topics` learns its seed
(`topics.seed_patterns`), not taken from the stream that holds each message: every
shard and generation learns its own structure from its own arrivals, so the same
topic can sit under `fleet/+/speed` in one shard and under itself in another, and a
pattern would show only the shards that learned it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from stratamq.broker.ds.lts import PLUS

from .topics import DEFAULT_HOT_SHARE, DEFAULT_THRESHOLDS, seed_patterns

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLUMNS = ("pattern", "hour", "messages", "bytes", "publishers")

PatternTrie = dict[str, "PatternTrie"]


def pattern_trie(patterns: Sequence[str]) -> PatternTrie:
    root: PatternTrie = {}
    for pattern in patterns:
        node = root
        for level in pattern.split("/"):
            node = node.setdefault(level, {})
    return root


def pattern_of(topic: str, trie: PatternTrie) -> str:
    """The pattern a topic falls under: level by level its own value where a pattern
    keeps that value (a hot one) and goes on to the topic's end, else `+`; the topic
    itself when no pattern takes it (not in the population they were learned from)."""
    levels = topic.split("/")
    dead_ends: set[tuple[int, int]] = set()  # (node, depth) known to lead nowhere

    def walk(node: PatternTrie, depth: int) -> list[str] | None:
        if depth == len(levels):
            return []
        if (id(node), depth) in dead_ends:
            return None
        for step in (levels[depth], PLUS):
            child = node.get(step)
            if child is not None:
                rest = walk(child, depth + 1)
                if rest is not None:
                    return [step, *rest]
        dead_ends.add((id(node), depth))
        return None

    found = walk(trie, 0)
    return topic if found is None else "/".join(found)


def export_usage(spark: SparkSession, checkpoint: str, out: str,
                 plot: str | None = None, top: int = 8,
                 thresholds: Sequence[int] = DEFAULT_THRESHOLDS) -> dict[str, Any]:
    """Write the hourly usage of a checkpoint to Parquet at `out` (a new folder) and,
    with `plot`, a PNG of the `top` patterns by messages. Returns a summary."""
    frame = spark.read.format("stratamq") \
        .schema("topic string, timestamp bigint, payload_size int, publisher string") \
        .option("all_topics", "true").load(checkpoint)
    counts = [(row.topic, row["count"]) for row in frame.groupBy("topic").count().collect()]
    trie = pattern_trie(seed_patterns(counts, thresholds, DEFAULT_HOT_SHARE))
    patterns = spark.createDataFrame([(topic, pattern_of(topic, trie)) for topic, _ in counts],
                                     "topic string, pattern string")
    hour = F.date_trunc("hour", F.timestamp_micros("timestamp"))
    usage = frame.join(F.broadcast(patterns), "topic").groupBy("pattern", hour.alias("hour")) \
        .agg(F.count(F.lit(1)).alias("messages"), F.sum("payload_size").alias("bytes"),
             F.countDistinct("publisher").alias("publishers")).cache()
    totals = usage.groupBy("pattern").agg(F.sum("messages").alias("messages")) \
        .orderBy(F.desc("messages"), "pattern").limit(top).collect()
    top_patterns = [row.pattern for row in totals]
    # The plot before the Parquet, which goes last: an export that fails leaves no
    # half of itself (a Parquet folder left behind refused the retry: --out exists).
    if plot is not None:
        draw(usage.where(F.col("pattern").isin(top_patterns)).collect(), top_patterns, plot)
    try:
        # a row per pattern and hour: one file, not one per shuffle partition
        usage.repartition(1).sortWithinPartitions("pattern", "hour") \
            .write.mode("errorifexists").parquet(out)
    except BaseException:
        if plot is not None:
            Path(plot).unlink(missing_ok=True)
        raise
    summary = {"out": out, "plot": plot, "rows": usage.count(), "topics": len(counts),
               "top_patterns": {row.pattern: row.messages for row in totals}}
    usage.unpersist()
    return summary


def draw(rows: list[Any], patterns: list[str], path: str) -> None:
    """The PNG of `usage_figure`."""
    from matplotlib import pyplot

    figure = usage_figure(rows, patterns)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def usage_figure(rows: list[Any], patterns: list[str]) -> Figure:
    """Messages per hour, a bar per hour stacked by pattern (lines of equal counts
    would hide each other), the axis over the hours the rows cover (matplotlib's own
    limits put one hour of data on an axis of years)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a job's machine
    from matplotlib import dates, pyplot

    figure, axes = pyplot.subplots(figsize=(10, 5))
    hours = sorted({row.hour for row in rows})
    counts = {(row.pattern, row.hour): row.messages for row in rows}
    below = [0] * len(hours)
    for pattern in patterns:
        heights = [counts.get((pattern, hour), 0) for hour in hours]
        # width in days, the unit of a date axis: 48 minutes of each hour
        axes.bar(hours, heights, width=0.8 / 24, bottom=below, label=pattern, align="edge")
        below = [low + height for low, height in zip(below, heights, strict=True)]
    if hours:
        axes.set_xlim(hours[0] - timedelta(minutes=30), hours[-1] + timedelta(minutes=90))
    # Ticks on whole hours only, a dozen at most: matplotlib's own put several ticks
    # in one hour, each labelled with that hour.
    span = (hours[-1] - hours[0]) // timedelta(hours=1) + 1 if hours else 1
    hour_ticks = dates.HourLocator(interval=-(-span // 12))  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_locator(hour_ticks)
    hourly = dates.DateFormatter("%Y-%m-%d %H:00")  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_formatter(hourly)
    axes.set_xlabel("hour (UTC)")
    axes.set_ylabel("messages")
    axes.set_title("messages per hour, top topic patterns")
    # beside the bars, not over them
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    figure.autofmt_xdate()
    figure.tight_layout()  # the slanted labels and the axis title inside the picture
    return figure
