"""Storage layouts, by the name a generation records."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..lts import DEFAULT_TOPIC_CACHE_BYTES
from .base import Layout, ReadStats
from .wildcard_optimized_v2 import WildcardOptimizedV2

__all__ = ["KNOWN_LAYOUTS", "Layout", "ReadStats", "make_layout"]

# `wildcard_optimized` (EMQX's bit-field layout with epochs) is not built yet; a
# generation asking for it is refused with a clear error rather than mis-read.
KNOWN_LAYOUTS = {WildcardOptimizedV2.name: WildcardOptimizedV2}


def make_layout(name: str, options: dict[str, Any],
                cache_bytes: int = DEFAULT_TOPIC_CACHE_BYTES) -> Layout:
    layout_class = KNOWN_LAYOUTS.get(name)
    if layout_class is None:
        raise ConfigError(
            f"durable_storage.messages.layout.type: layout {name!r} is not available; "
            f"available: {', '.join(sorted(KNOWN_LAYOUTS))}")
    if options:
        raise ConfigError(f"layout {name!r} takes no options, got {sorted(options)}")
    return layout_class(cache_bytes)
