"""Job 2: topic-pattern learning (`stratamq spark learn-topics`).

A site learns its topic structure from its own arrivals: a level turns into `+` once
one trie node has seen as many distinct values as the threshold, so where that
happens depends on the order topics first arrive in. `fleet/{region}/{vehicle}/
{sensor}` can end as hundreds of streams (the first vehicles each got a literal edge
and their own streams) or as one stream that mixes everything.

This job counts the messages of every topic over all shards and generations (the
heavy part, on Spark), then decides from the whole population, level by level from
the root, with the site's own thresholds:

- a level with fewer distinct values (under its prefix) than the threshold stays
  literal: one branch per value;
- a level with as many or more varies: a `+` branch for all its values, plus a
  literal branch for each value hot enough (at least `hot_share` of the messages
  under its prefix) to deserve streams of its own.

The result is a **seed structure**: the stream patterns (`fleet/north/+/temp`) the
sites add to the learned topic trie of their next generation (`stratamq ctl ds
seed-topics DB FILE`). The distinct topics are brought to the driver to build it:
fine for millions of topics, not for billions."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import SparkSession

from stratamq.broker.ds import Snapshot
from stratamq.broker.ds.lts import PLUS

SEED_KIND = "stratamq-topic-seed"
SEED_FORMAT = 1
DEFAULT_THRESHOLDS = (100, 10)
DEFAULT_HOT_SHARE = 0.25


@dataclass(slots=True)
class _Node:
    """Topics under one prefix: the next level's values with their message counts."""

    messages: int = 0
    ends: int = 0  # messages on the prefix itself (a topic ending here)
    children: dict[str, _Node] = field(default_factory=dict)


def _tree(topics: Iterable[tuple[str, int]]) -> _Node:
    root = _Node()
    for topic, count in topics:
        node = root
        node.messages += count
        for level in topic.split("/"):
            node = node.children.setdefault(level, _Node())
            node.messages += count
        node.ends += count
    return root


def _merge(nodes: Sequence[_Node]) -> _Node:
    """The union of several subtrees (the values a `+` takes together)."""
    merged = _Node()
    for node in nodes:
        _merge_into(merged, node)
    return merged


def _merge_into(target: _Node, node: _Node) -> None:
    stack = [(target, node)]
    while stack:
        into, source = stack.pop()
        into.messages += source.messages
        into.ends += source.ends
        for level, child in source.children.items():
            stack.append((into.children.setdefault(level, _Node()), child))


def seed_patterns(topics: Iterable[tuple[str, int]], thresholds: Sequence[int],
                  hot_share: float = DEFAULT_HOT_SHARE) -> list[str]:
    """The stream patterns of the seed structure for a population of (topic,
    messages), sorted. `$` topics live under their own root, as in the trie."""
    patterns: list[str] = []
    stack: list[tuple[_Node, tuple[str, ...]]] = [(_tree(topics), ())]
    while stack:
        node, path = stack.pop()
        if node.ends and path:
            patterns.append("/".join(path))
        depth = len(path)
        threshold = thresholds[min(depth, len(thresholds) - 1)]
        dollar = [(v, c) for v, c in node.children.items() if depth == 0 and v.startswith("$")]
        plain = [(v, c) for v, c in node.children.items() if not (depth == 0 and v.startswith("$"))]
        for values in (dollar, plain):
            if len(values) < threshold:
                stack += [(child, (*path, value)) for value, child in values]
                continue
            hot = [(v, c) for v, c in values if c.messages >= hot_share * node.messages]
            hot = sorted(hot, key=lambda pair: -pair[1].messages)[:threshold - 1]
            hot_values = {value for value, _ in hot}
            stack += [(child, (*path, value)) for value, child in hot]
            rest = [child for value, child in values if value not in hot_values]
            if rest:
                stack.append((_merge(rest), (*path, PLUS)))
    return sorted(patterns)


def newest_copies(manifests: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Which shards to read from which checkpoint, a list per checkpoint: each shard
    from the checkpoint whose copy of it is the newest (the highest committed
    timestamp). The checkpoints of a cluster's sites overlap (a shard has a replica on
    several sites) and a site's copy of a shard it holds no replica of is old or
    empty: counting each shard once, from its newest copy, counts every message once."""
    newest: dict[int, tuple[int, int]] = {}
    for index, manifest in enumerate(manifests):
        for shard in manifest["shards"]:
            committed = int(shard["committed_timestamp"])
            if shard["id"] not in newest or committed > newest[shard["id"]][0]:
                newest[shard["id"]] = (committed, index)
    chosen: list[list[int]] = [[] for _ in manifests]
    for shard_id, (_committed, index) in sorted(newest.items()):
        chosen[index].append(shard_id)
    return chosen


def make_seed(spark: SparkSession, checkpoints: Sequence[str],
              thresholds: Sequence[int] | None = None,
              hot_share: float = DEFAULT_HOT_SHARE) -> dict[str, Any]:
    """The seed structure of the whole topic population of one database: of one
    site's checkpoint, or of every site's (each shard counted once, see
    `newest_copies`)."""
    manifests = []
    for checkpoint in checkpoints:
        with Snapshot(checkpoint) as snapshot:
            manifests.append(snapshot.manifest())
    frames = [spark.read.format("stratamq").schema("topic string")
              .option("all_topics", "true").option("shards", ",".join(map(str, shards)))
              .load(checkpoint)
              for checkpoint, shards in zip(checkpoints, newest_copies(manifests), strict=True)
              if shards]
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.union(other)
    counts = [(row.topic, row["count"]) for row in frame.groupBy("topic").count().collect()]
    used = tuple(thresholds or DEFAULT_THRESHOLDS)
    patterns = seed_patterns(counts, used, hot_share)
    return {
        "kind": SEED_KIND,
        "format": SEED_FORMAT,
        "db": manifests[0]["db"],
        "sites": [manifest["site"] for manifest in manifests],
        "checkpoints": list(checkpoints),
        "made_at": time.time_ns() // 1000,
        "wildcard_thresholds": list(used),
        "hot_share": hot_share,
        "topics": len(counts),
        "messages": sum(count for _topic, count in counts),
        "streams_now": _streams_now(manifests[0], checkpoints[0]),
        "patterns": patterns,
    }


def _streams_now(manifest: dict[str, Any], checkpoint: str) -> dict[str, int]:
    """Streams per shard in the (first) checkpoint's current generation."""
    found = {}
    with Snapshot(checkpoint) as snapshot:
        for shard in manifest["shards"]:
            current = max(g["id"] for g in shard["generations"])
            found[str(shard["id"])] = len(snapshot.shard(shard["id"]).all_streams(current))
    return found

