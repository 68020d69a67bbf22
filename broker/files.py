"""Small files the broker keeps (tokens, ids, password files), written so a crash
leaves the old or the new content, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: write a 0600 temp file in the same folder, fsync,
    rename over, fsync the folder (which must exist)."""
    directory = path.parent
    descriptor, temp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.",
                                             suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            os.fchmod(stream.fileno(), 0o600)
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    folder = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
