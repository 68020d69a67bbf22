"""A dict bounded by the bytes its entries hold, evicting the oldest entry first.

The topic caches of the write path key on topic names, which may be 64 KB each: a
bound by count lets a few thousand huge topics take gigabytes, a bound by bytes
does not."""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

# What a dict slot and the entry's small objects cost beyond the sizes we add up.
ENTRY_OVERHEAD = 64


class BytesBoundedCache(Generic[K, V]):
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # OrderedDict, not dict: evicting the oldest of a plain dict with
        # next(iter(...)) walks past every slot deleted before it (2.4 us a put at
        # 8k entries, against 0.8 here), and a cache of many topics evicts on
        # nearly every put
        self.entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.bytes = 0

    def get(self, key: K) -> V | None:
        entry = self.entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, value_bytes: int) -> None:
        """Keep `value` under `key`; `value_bytes` is what the value holds (the key's
        size is added here). An entry bigger than the whole bound is not kept."""
        size = sys.getsizeof(key) + value_bytes + ENTRY_OVERHEAD
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _evicted, (_value, evicted_size) = self.entries.popitem(last=False)
            self.bytes -= evicted_size
        self.entries[key] = (value, size)
        self.bytes += size

    def pop(self, key: K) -> V | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry[1]
        return entry[0]

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)
