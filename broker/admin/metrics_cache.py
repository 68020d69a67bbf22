"""`/metrics` rendered at most once per interval: any number of scrapers costs the
site one render (and one disk measurement) per interval, shared by the scrapes that
arrive meanwhile; before, each scrape rendered every metric on the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from prometheus_client import REGISTRY, generate_latest


class MetricsCache:
    def __init__(self, interval: float, refresh: Callable[[], Awaitable[None]]) -> None:
        """`refresh`: what to measure before a render (the storage's disk usage)."""
        self._interval = interval
        self._refresh = refresh
        self._body = b""
        self._rendered_at = -float("inf")
        self._lock = asyncio.Lock()

    def _fresh(self) -> bool:
        return time.monotonic() - self._rendered_at < self._interval

    async def body(self) -> bytes:
        if self._fresh():
            return self._body
        async with self._lock:  # concurrent scrapes wait for one render
            if not self._fresh():
                await self._refresh()
                self._body = generate_latest(REGISTRY)
                self._rendered_at = time.monotonic()
            return self._body
