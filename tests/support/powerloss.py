"""A power loss for a killed process, without root: what it wrote to a RocksDB
write-ahead log but never synced is cut off, as a power loss may cut it.

The process runs with `powerloss.c` preloaded (`wrapper`), which notes each log's
size whenever the process syncs it (RocksDB syncs a log with fdatasync or fsync: a
synced write, `flush_wal(sync=True)`, a log's close). The size is noted just before
the sync, so what is kept was certainly synced. After SIGKILL, `lose_unsynced` cuts
every log under the data directory back to its last noted size (all of it when it
was never synced). Files other than the logs (tables, MANIFEST, CURRENT) RocksDB
syncs before it relies on them, so they stay."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("powerloss.c")
JOURNAL_ENV = "STRATAMQ_TEST_SYNC_JOURNAL"
_WAL_NAME = re.compile(r"\d+\.log")


def build_shim(folder: Path) -> Path:
    """Compile the preload library into `folder` (a C compiler is part of the test
    toolchain, as for the Go and Rust builds: its absence fails the test)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None, "no C compiler (cc) to build the power-loss shim"
    library = folder / "powerloss.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE),
                    "-ldl"], check=True, capture_output=True)
    return library


def wrapper(library: Path, journal: Path) -> tuple[str, ...]:
    """A command prefix that runs a process with the shim, noting syncs in `journal`."""
    return ("env", f"LD_PRELOAD={library}", f"{JOURNAL_ENV}={journal}")


def synced_sizes(journal: Path) -> dict[str, int]:
    """Per log file, the size it had at its last sync."""
    sizes: dict[str, int] = {}
    if journal.exists():
        for line in journal.read_text().splitlines():
            path, _, size = line.rpartition("\t")
            if path and size.isdigit():
                sizes[path] = int(size)
    return sizes


def lose_unsynced(data_dir: Path, journal: Path) -> dict[str, int]:
    """Cut every RocksDB log under `data_dir` back to its last synced size (the
    process is dead); the bytes cut, per log that lost any."""
    synced = synced_sizes(journal)
    lost: dict[str, int] = {}
    for log in data_dir.rglob("*.log"):
        if not _WAL_NAME.fullmatch(log.name):
            continue
        size = log.stat().st_size
        keep = min(size, synced.get(str(log.resolve()), 0))
        if keep < size:
            with open(log, "r+b") as file:
                file.truncate(keep)
            lost[str(log.relative_to(data_dir))] = size - keep
    return lost
