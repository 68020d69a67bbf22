"""What every RocksDB user in `ds` shares: raw-mode options, byte checks, key ranges,
and the length-prefixed blobs of the serialized forms."""

from __future__ import annotations

import struct
import threading
from typing import Any

from rocksdict import Options

from ..errors import CorruptDataError

_U32 = struct.Struct(">I")


def raw_options(create_missing_column_families: bool = False) -> Options:
    """Options of a raw-mode (bytes in, bytes out) database, created when missing."""
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(create_missing_column_families)
    return options


class WalSync:
    """Syncs a database's write-ahead log and closes the database, never the one while
    the other runs. A durable write is written unsynced, then synced here: rocksdict
    holds the GIL through a write with `sync=True`, fsync included, which froze the
    event loop and every other thread for as long as the disk took, while
    `flush_wal(True)` lets go of it as it syncs. A close from another thread during
    that sync failed ("Already borrowed"), and one comes: a sync goes on in its
    executor thread after the task that awaited it was cancelled (the site stopping).
    A sync after the close does nothing (the close flushed what was written). The
    database is passed in each call: tests put a noting one in place of the owner's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False

    def sync(self, db: Any) -> None:
        with self._lock:
            if not self._closed:
                db.flush_wal(True)

    def close(self, db: Any) -> None:
        with self._lock:
            db.close()
            self._closed = True


def as_bytes(value: object) -> bytes:
    """rocksdict is typed for every value kind; a raw-mode database holds only bytes."""
    if not isinstance(value, bytes):
        raise CorruptDataError(f"expected bytes in a raw-mode database, got {type(value)}")
    return value


def after_prefix(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key that starts with `prefix`; None when
    there is none (the prefix is empty or all 0xff)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes((stripped[-1] + 1,)) if stripped else None


def blob(data: bytes) -> bytes:
    """`data` with its length in front (4 bytes, big-endian)."""
    return _U32.pack(len(data)) + data


def read_blob(raw: bytes, pos: int) -> tuple[bytes, int]:
    """The blob at `pos` and the position after it; ValueError when truncated."""
    (length,) = _U32.unpack_from(raw, pos)
    pos += 4
    data = raw[pos:pos + length]
    if len(data) != length:
        raise ValueError("truncated")
    return data, pos + length
