"""Putting a whole shard folder in place of a shard's own, so that a crash at any
moment leaves either the old shard or the new one, never a mix (replica bootstrap
from a checkpoint, see `replication/bootstrap.py`).

The new folder is complete in `<shard>.staged` first. Then `<shard>` is renamed to
`<shard>.old` and `<shard>.staged` to `<shard>`; `<shard>.old` is removed last. A
site that finds `<shard>.old` on start finishes or undoes this before opening the
shard (`recover_shard_folder`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

STAGED_SUFFIX = ".staged"
OLD_SUFFIX = ".old"


def staged_folder(shard_path: Path) -> Path:
    return shard_path.with_name(shard_path.name + STAGED_SUFFIX)


def _old_folder(shard_path: Path) -> Path:
    return shard_path.with_name(shard_path.name + OLD_SUFFIX)


def sync_folder(path: Path) -> None:
    """Make the names in folder `path` durable (after renames or new files)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def swap_in_staged(shard_path: Path) -> None:
    """Put the staged folder in place of the shard's (closed) folder. Blocking."""
    staged, old = staged_folder(shard_path), _old_folder(shard_path)
    if not staged.is_dir():
        raise FileNotFoundError(f"no staged shard folder {staged}")
    if old.exists():
        shutil.rmtree(old)
    if shard_path.exists():
        shard_path.rename(old)
    staged.rename(shard_path)  # the moment the new shard takes over
    sync_folder(shard_path.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_shard_folder(shard_path: Path) -> None:
    """Before a shard is opened: finish or undo an interrupted `swap_in_staged`, and
    drop a staged folder whose filling was interrupted (it is fetched again)."""
    old = _old_folder(shard_path)
    if old.exists():
        if shard_path.exists():
            shutil.rmtree(old)  # the new folder took over: the old one goes
        else:
            old.rename(shard_path)  # interrupted between the renames: the old stays
    staged = staged_folder(shard_path)
    if staged.exists():
        shutil.rmtree(staged)
