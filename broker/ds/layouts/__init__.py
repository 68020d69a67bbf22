"""Storage layouts, by the name a generation records."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..lts import DEFAULT_TOPIC_CACHE_BYTES
from .base import Layout, ReadStats, StreamOf
from .wildcard_optimized import WildcardOptimized, option_problems
from .wildcard_optimized_v2 import WildcardOptimizedV2

__all__ = ["KNOWN_LAYOUTS", "Layout", "ReadStats", "StreamOf", "make_layout"]

KNOWN_LAYOUTS = (WildcardOptimizedV2.name, WildcardOptimized.name)
_BITFIELD_OPTIONS = ("topic_index_bytes", "bits_per_topic_level", "epoch_bits")


def make_layout(name: str, options: dict[str, Any],
                cache_bytes: int = DEFAULT_TOPIC_CACHE_BYTES) -> Layout:
    """The layout `name` with `options` (as a generation records them). Refuses
    what it cannot open exactly as recorded, rather than mis-read a generation."""
    if name == WildcardOptimizedV2.name:
        if options:
            raise ConfigError(f"layout {name!r} takes no options, got {sorted(options)}")
        return WildcardOptimizedV2(cache_bytes)
    if name == WildcardOptimized.name:
        unknown = sorted(set(options) - set(_BITFIELD_OPTIONS))
        if unknown:
            raise ConfigError(f"layout {name!r} has no options {unknown}; it takes "
                              f"{', '.join(_BITFIELD_OPTIONS)}")
        chosen = {key: int(options[key]) for key in _BITFIELD_OPTIONS if key in options}
        layout = WildcardOptimized(cache_bytes)  # the defaults, for what is not given
        sizes = {**layout.options(), **chosen}
        problems = option_problems(**sizes)
        if problems:
            raise ConfigError(f"durable_storage.messages.layout: {'; '.join(problems)}")
        return WildcardOptimized(cache_bytes, **sizes)
    raise ConfigError(
        f"durable_storage.messages.layout.type: layout {name!r} is not available; "
        f"available: {', '.join(sorted(KNOWN_LAYOUTS))}")
