"""Generations: time partitions of a shard, and the pure retention rule over them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class GenerationInfo:
    """What a shard records of a generation. Times are µs since the epoch; `until`
    is None while the generation is current (the only one that takes writes)."""

    id: int
    layout: str
    layout_options: dict[str, Any] = field(default_factory=dict)
    created_at: int = 0
    since: int = 0
    until: int | None = None

    @property
    def is_current(self) -> bool:
        return self.until is None

    def closed(self, at: int) -> GenerationInfo:
        return replace(self, until=at)

    def data_column_family(self) -> str:
        return f"gen{self.id}.data"

    def trie_column_family(self) -> str:
        return f"gen{self.id}.trie"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> GenerationInfo:
        return cls(**json.loads(raw))


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    add_generation: bool
    drop: tuple[int, ...]


def plan_retention(generations: list[GenerationInfo], now: int,
                   retention_us: int, drop_after_us: int | None = None,
                   period_us: int | None = None) -> RetentionPlan:
    """Add a generation once the current one is older than `period_us` (the retention
    period when None), and drop closed generations whose `until` is older than now
    minus the retention (or minus `drop_after_us`, the longest per-topic retention,
    when given). So a message lives between one retention period and one period more."""
    horizon = now - retention_us
    drop_horizon = horizon if drop_after_us is None else now - max(drop_after_us, retention_us)
    current = [g for g in generations if g.is_current]
    rollover = now - (retention_us if period_us is None else period_us)
    add = bool(current) and current[0].since <= rollover
    drop = tuple(g.id for g in generations
                 if g.until is not None and g.until <= drop_horizon)
    return RetentionPlan(add, drop)
