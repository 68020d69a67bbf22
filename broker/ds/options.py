"""Per-database options of the storage engine (the config file's
`durable_storage.<db>` section, converted by the broker's shell)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_MQTT_PAYLOAD = 268_435_455


@dataclass(frozen=True, slots=True)
class DbOptions:
    n_shards: int = 16
    layout: str = "wildcard_optimized_v2"
    layout_options: dict[str, Any] = field(default_factory=dict)
    wildcard_thresholds: tuple[int, ...] = (100, 10)
    max_items: int = 1000
    # 0: flush as soon as the shard is idle; writers arriving meanwhile share the next
    # write (group commit). More trades latency for bigger batches.
    flush_interval: float = 0.0
    max_bytes: int = 16 * 1024 * 1024
    # False: a batch is durable once in RocksDB's write-ahead log (survives a process
    # crash). True: the log is also fsynced (survives power loss).
    sync_writes: bool = False
    max_payload_bytes: int = MAX_MQTT_PAYLOAD
    message_retention_period: float = 86_400.0
    # How long a generation takes new messages before the next one starts (None: the
    # retention period). Shorter: retention and the Spark GC work in finer steps.
    generation_period: float | None = None
    # With per-topic retention rules: the longest of them. A generation is dropped
    # whole only once it is older than this (None: `message_retention_period`); the
    # Spark GC job removes what shorter rules let go before that.
    longest_retention_period: float | None = None
    # Bytes the write path's topic caches (learned topic keys, index key prefixes)
    # may hold in all, over every shard.
    topic_cache_bytes: int = 64 * 1024 * 1024
    # The learned topic structure of each generation: levels learned at most, and the
    # estimated bytes of all shards' tries of one generation (each shard its share);
    # what goes past them is folded (see `lts.TrieBounds`).
    learned_topic_max_levels: int = 32
    learned_topic_bytes: int = 128 * 1024 * 1024
    # A key-value database (`sessions`, `retained`) takes only records (puts and
    # deletes), written through the same shard log as messages; retention never
    # drops them (records live outside generations).
    key_value: bool = False
