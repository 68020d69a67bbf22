"""What a storage layout is: how one generation turns messages into RocksDB keys and
how it reads a stream back. A generation records its layout's name and options, so
a new layout is a new generation and old data is never migrated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..lts import StaticIndex, TopicKey


@dataclass(slots=True)
class ReadStats:
    """Work a read did (feeds the `stratamq_ds_layout_*` counters), and when a read
    that stopped at an open epoch holding messages for it can go on."""

    seeks: int = 0
    nexts: int = 0
    hash_collisions: int = 0
    # µs: once the shard's settled time reaches this, the epoch the read stopped at
    # is closed and readable (None: the read did not stop at one)
    wait_until: int | None = None


# The stream a topic belongs to in the generation (None: unknown there).
StreamOf = Callable[[str], StaticIndex | None]


class KeyValueReader(Protocol):
    """The slice of a rocksdict column family a layout reads through."""

    def iter(self, read_opt: Any = ...) -> Any: ...

    def items(self, backwards: bool = ..., from_key: Any = ..., read_opt: Any = ...) -> Any: ...

    def get(self, key: Any, default: Any = ...) -> Any: ...


class Layout(Protocol):
    name: str

    def options(self) -> dict[str, Any]:
        """What the generation records to reopen the layout the same way."""
        ...

    def encode(self, topic: str, key: TopicKey, timestamp: int,
               value: bytes) -> list[tuple[bytes, bytes]]:
        """The RocksDB entries (key, value) that store one message on `topic`."""
        ...

    def read(self, data: KeyValueReader, static: StaticIndex, pattern: tuple[str, ...],
             filter_levels: list[str], after: int, batch_size: int, stats: ReadStats,
             horizon: int | None = None,
             stream_of: StreamOf | None = None) -> list[tuple[bytes, bytes]]:
        """Up to `batch_size` (data key, stored message) of one stream with a
        timestamp greater than `after`, in timestamp order, matching the filter.
        `horizon`: every message below this timestamp is written (None: all are, the
        generation is closed); a layout that must not read past it says so in
        `stats.wait_until`. `stream_of` tells which stream a topic belongs to, for a
        layout whose streams may share keys."""
        ...

    def read_one(self, data: KeyValueReader, static: StaticIndex,
                 timestamp: int) -> bytes | None:
        """The stored message of a stream at a timestamp, if there is one."""
        ...

    def clear_cache(self) -> None:
        """Forget what the write path cached (the generation takes no more writes)."""
        ...
