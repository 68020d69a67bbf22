"""A real RocksDB handle (rocksdict's `Rdict`) that notes the calls of interest to
tests of how a shard or a log writes: each write (`synced` when it asked RocksDB to
sync within it), each `flush_wal`, each column family dropped."""

from __future__ import annotations

from typing import Any

from rocksdict import WriteOptions


class NotedRocks:
    """Put in place of a shard's or a log's `_db`: passes every call on to `real`."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.notes: list[str] = []

    def write(self, batch: Any, options: WriteOptions | None = None) -> None:
        self._note("write", options)
        self._real.write(batch, options)

    def put(self, key: bytes, value: bytes, options: WriteOptions | None = None) -> None:
        self._note("put", options)
        self._real.put(key, value, options)

    def delete(self, key: bytes, options: WriteOptions | None = None) -> None:
        self._note("delete", options)
        self._real.delete(key, options)

    def flush_wal(self, sync: bool) -> None:
        self.notes.append(f"flush_wal({sync})")
        self._real.flush_wal(sync)

    def drop_column_family(self, name: str) -> None:
        self.notes.append(f"drop {name}")
        self._real.drop_column_family(name)

    def taken(self) -> list[str]:
        """The notes since the last call."""
        notes, self.notes = self.notes, []
        return notes

    def _note(self, call: str, options: WriteOptions | None) -> None:
        self.notes.append(f"{call} synced" if options is not None and options.sync else call)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)
