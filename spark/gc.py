"""Job 1: generation GC with per-topic retention (`stratamq spark gc`).

Reads a checkpoint with the `stratamq` data source, counts for every generation how
many of its messages are still live under the retention rules at the plan's time,
and writes a plan the site applies (`stratamq ctl ds apply-gc PLAN`):

- `drop`: a closed generation whose every message has expired (or that is empty);
- `rewrite`: a closed generation partly expired; the site deletes the expired
  messages in place, so the live ones keep their keys (timestamps and streams);
- `keep`: nothing expired, or the generation was current at the checkpoint (the
  plan never touches it: it may have taken writes since).

The plan is JSON meant to be read: per generation its action, counts per rule, and
the totals."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType

from stratamq.broker.ds import RetentionRules, Snapshot
from stratamq.broker.ds.gc import PLAN_FORMAT, PLAN_KIND

DEFAULT_RULE = "(default)"


def retention_counts(frame: DataFrame, rules: RetentionRules, now: int) -> DataFrame:
    """Per (shard, generation, rule): messages, expired messages and their payload
    bytes. The rule of each distinct topic is found once (a Python UDF over distinct
    topics, not over every message) and joined back."""
    rule_of = F.udf(lambda topic: rules.rule_of(topic) or DEFAULT_RULE, StringType())
    cutoff_of = F.udf(lambda topic: now - rules.retention_us_of(topic), LongType())
    topics = frame.select("topic").distinct() \
        .withColumn("rule", rule_of("topic")).withColumn("cutoff", cutoff_of("topic"))
    expired = F.col("timestamp") < F.col("cutoff")
    return frame.join(topics, "topic").groupBy("shard", "generation", "rule").agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum(F.when(expired, 1).otherwise(0)).alias("expired"),
        F.sum("payload_size").alias("payload_bytes"),
        F.sum(F.when(expired, F.col("payload_size")).otherwise(0)).alias("expired_payload_bytes"))


def make_plan(spark: SparkSession, checkpoint: str, rules: RetentionRules,
              now: int | None = None) -> dict[str, Any]:
    """The GC plan of a checkpoint (or a stopped site's database folder) at `now`
    (µs; default: the current time)."""
    made_at = now if now is not None else time.time_ns() // 1000
    with Snapshot(checkpoint) as snapshot:
        manifest = snapshot.manifest()
    frame = spark.read.format("stratamq") \
        .schema("shard int, generation int, topic string, timestamp bigint, payload_size int") \
        .option("all_topics", "true").load(checkpoint)
    counted: dict[tuple[int, int], dict[str, dict[str, int]]] = defaultdict(dict)
    for row in retention_counts(frame, rules, made_at).collect():
        counted[(row.shard, row.generation)][row.rule] = {
            "messages": row.messages, "expired_messages": row.expired,
            "payload_bytes": row.payload_bytes, "expired_payload_bytes": row.expired_payload_bytes}
    generations = [_entry(shard["id"], generation, counted[(shard["id"], generation["id"])])
                   for shard in manifest["shards"] for generation in shard["generations"]]
    return {
        "kind": PLAN_KIND,
        "format": PLAN_FORMAT,
        "db": manifest["db"],
        "site": manifest["site"],
        "checkpoint": {"dir": checkpoint,
                       "created_at": manifest["created_at"] or made_at},
        "made_at": made_at,
        "timestamps": "microseconds since the epoch",
        "retention": rules.to_json(),
        "summary": _summary(generations),
        "generations": generations,
    }


def _entry(shard_id: int, generation: dict[str, Any],
           by_rule: dict[str, dict[str, int]]) -> dict[str, Any]:
    messages = sum(counts["messages"] for counts in by_rule.values())
    expired = sum(counts["expired_messages"] for counts in by_rule.values())
    if generation["current"]:
        action, reason = "keep", "current at the checkpoint: it may take writes the plan " \
                                 "did not see"
    elif messages == 0:
        action, reason = "drop", "empty"
    elif expired == messages:
        action, reason = "drop", "every message expired"
    elif expired:
        action, reason = "rewrite", f"{expired} of {messages} messages expired"
    else:
        action, reason = "keep", "every message live"
    return {
        "shard": shard_id,
        "generation": generation["id"],
        "since": generation["since"],
        "until": generation["until"],
        "action": action,
        "reason": reason,
        "messages": messages,
        "expired_messages": expired,
        "live_messages": messages - expired,
        "payload_bytes": sum(c["payload_bytes"] for c in by_rule.values()),
        "expired_payload_bytes": sum(c["expired_payload_bytes"] for c in by_rule.values()),
        "stored_bytes": generation.get("bytes", 0),
        "by_rule": dict(sorted(by_rule.items())),
    }


def _summary(generations: list[dict[str, Any]]) -> dict[str, int]:
    summary = {f"{action}_generations": sum(1 for g in generations if g["action"] == action)
               for action in ("drop", "rewrite", "keep")}
    summary["expired_messages"] = sum(g["expired_messages"] for g in generations
                                      if g["action"] != "keep")
    summary["live_messages"] = sum(g["live_messages"] for g in generations)
    summary["stored_bytes_dropped"] = sum(g["stored_bytes"] for g in generations
                                          if g["action"] == "drop")
    return summary
