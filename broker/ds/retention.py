"""Per-topic retention rules (`sensors/#: 7d`, `alerts/#: 90d`, a default for the
rest): which rule a topic falls under, and whether a message has expired. Pure
functions, shared by the site (which applies GC plans) and the Spark GC job (which
makes them), so both decide alike.

The most specific matching filter wins: over the topic's levels, the filter levels
that matched them are compared in order, a literal beating `+` and `+` beating `#`
(`sensors/temp` over `sensors/+` over `sensors/#`; `a/+/#` over `a/#`); where that
ties, the filter with fewer levels (`a/+` over `a/+/#` for `a/b`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..topic import levels_match, validate_filter

# Order of a level in a filter: a literal is more specific than `+`, `+` than `#`.
_HASH, _PLUS, _LITERAL = 0, 1, 2


def specificity(filter_levels: list[str], topic_levels: list[str]) -> tuple[tuple[int, ...], int]:
    """How specifically a filter matches a topic it matches; higher is more."""
    classes: list[int] = []
    for position in range(len(topic_levels)):
        level = filter_levels[position] if position < len(filter_levels) else "#"
        if level == "#":
            classes += [_HASH] * (len(topic_levels) - position)
            break
        classes.append(_PLUS if level == "+" else _LITERAL)
    return tuple(classes), -len(filter_levels)


@dataclass(frozen=True, slots=True)
class RetentionRules:
    """Seconds of retention: `default`, or the most specific rule matching a topic."""

    default: float
    rules: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default <= 0:
            raise ValueError(f"default retention must be above 0, got {self.default}")
        for topic_filter, seconds in self.rules.items():
            validate_filter(topic_filter)
            if seconds <= 0:
                raise ValueError(f"retention of {topic_filter!r} must be above 0, got {seconds}")

    def rule_of(self, topic: str) -> str | None:
        """The filter of the rule a topic falls under; None for the default. (Two
        different filters never match one topic equally specifically.)"""
        levels = topic.split("/")
        best: tuple[tuple[tuple[int, ...], int], str] | None = None
        for topic_filter in self.rules:
            filter_levels = topic_filter.split("/")
            if levels_match(filter_levels, levels):
                key = (specificity(filter_levels, levels), topic_filter)
                if best is None or key > best:
                    best = key
        return None if best is None else best[1]

    def retention_of(self, topic: str) -> float:
        rule = self.rule_of(topic)
        return self.default if rule is None else self.rules[rule]

    def retention_us_of(self, topic: str) -> int:
        return int(self.retention_of(topic) * 1_000_000)

    @property
    def longest(self) -> float:
        """The longest retention of any rule or the default: no generation may be
        dropped whole before this."""
        return max([self.default, *self.rules.values()])

    def to_json(self) -> dict[str, object]:
        return {"default": self.default, "rules": dict(sorted(self.rules.items()))}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> RetentionRules:
        rules = data.get("rules", {})
        default = data.get("default")
        if not isinstance(rules, dict) or not isinstance(default, int | float):
            raise ValueError('retention must be {"default": seconds, "rules": {filter: seconds}}')
        return cls(float(default), {str(k): float(v) for k, v in rules.items()})


def is_expired(rules: RetentionRules, topic: str, timestamp: int, now: int) -> bool:
    """Whether a message (timestamp in µs) has outlived its rule at `now` (µs)."""
    return timestamp < now - rules.retention_us_of(topic)
