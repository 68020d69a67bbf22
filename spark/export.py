"""Job 3: usage export (`stratamq spark export`).

Per topic pattern and hour: messages, payload bytes and distinct publishers, written
to Parquet; and a PNG of messages per hour for the top patterns, the view an operator
opens before changing retention. A topic's pattern is its stream's learned topic
structure (`fleet/+/+/temp`): the levels that vary are `+`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

COLUMNS = ("pattern", "hour", "messages", "bytes", "publishers")


def hourly_usage(frame: DataFrame) -> DataFrame:
    """(pattern, hour (UTC, start of the hour), messages, bytes, publishers)."""
    hour = F.date_trunc("hour", F.timestamp_micros("timestamp"))
    return frame.groupBy("pattern", hour.alias("hour")).agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum("payload_size").alias("bytes"),
        F.countDistinct("publisher").alias("publishers"),
    ).orderBy("pattern", "hour")


def export_usage(spark: SparkSession, checkpoint: str, out: str,
                 plot: str | None = None, top: int = 8) -> dict[str, Any]:
    """Write the hourly usage of a checkpoint to Parquet at `out` (a new folder) and,
    with `plot`, a PNG of the `top` patterns by messages. Returns a summary."""
    frame = spark.read.format("stratamq") \
        .schema("pattern string, timestamp bigint, payload_size int, publisher string") \
        .option("all_topics", "true").load(checkpoint)
    usage = hourly_usage(frame).cache()
    usage.write.mode("errorifexists").parquet(out)
    totals = usage.groupBy("pattern").agg(F.sum("messages").alias("messages")) \
        .orderBy(F.desc("messages"), "pattern").limit(top).collect()
    top_patterns = [row.pattern for row in totals]
    if plot is not None:
        rows = usage.where(F.col("pattern").isin(top_patterns)).collect()
        draw(rows, top_patterns, plot)
    summary = {"out": out, "plot": plot, "rows": usage.count(),
               "top_patterns": {row.pattern: row.messages for row in totals}}
    usage.unpersist()
    return summary


def draw(rows: list[Any], patterns: list[str], path: str) -> None:
    """Messages per hour, one line per pattern."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a job's machine
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(10, 5))
    for pattern in patterns:
        points = sorted((row.hour, row.messages) for row in rows if row.pattern == pattern)
        axes.plot([hour for hour, _ in points], [count for _, count in points],
                  marker="o", label=pattern)
    axes.set_xlabel("hour (UTC)")
    axes.set_ylabel("messages")
    axes.set_title("messages per hour, top topic patterns")
    axes.legend(loc="upper left", fontsize="small")
    figure.autofmt_xdate()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
