"""A site's own copy of the placement: the newest version the controller has pushed,
kept in `<data_dir>/placement.json` so that a restarted site knows its shards before
the controller speaks to it again.

Writes are atomic (temp file, fsync, rename, fsync of the folder), so a crash leaves
the old document or the new one. The newest version wins: an older version pushed
later (a controller that lost track, a delayed request) is refused, and so is a
different document under a version the site already keeps.

This is blocking file I/O on a small file; async callers run it in an executor.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ...errors import CorruptDataError, PlacementError, StalePlacementError
from ...files import write_atomically
from .placement import Placement

log = logging.getLogger(__name__)

PLACEMENT_FILE = "placement.json"


class PlacementStore:
    """The placement kept in one folder. Opening reads what is there; a document that
    does not parse is a `CorruptDataError` (never silently replaced: the site would
    forget which version it has seen)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / PLACEMENT_FILE
        self._lock = threading.Lock()
        self._current = self._load()

    @property
    def current(self) -> Placement | None:
        """The newest placement kept, or None before the first push."""
        return self._current

    def offer(self, placement: Placement) -> bool:
        """Keep `placement` if it is newer than the one kept: True when it was written,
        False when it is the very document kept already (a repeated push). An older
        version, or another document with the kept version, is refused with
        `StalePlacementError` and changes nothing."""
        with self._lock:
            kept = self._current
            if kept is not None:
                if placement.version < kept.version:
                    raise StalePlacementError(
                        f"placement version {placement.version} is older than version "
                        f"{kept.version}, which this site keeps")
                if placement.version == kept.version:
                    if placement == kept:
                        return False
                    raise StalePlacementError(
                        f"placement version {placement.version} differs from the document "
                        f"this site keeps under that version; a changed placement needs a "
                        f"new version")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(self.path, placement.to_json())
            except OSError as exc:
                raise PlacementError(f"{self.path}: cannot store placement version "
                                     f"{placement.version}: {exc}") from exc
            self._current = placement
            log.info("placement version %d kept (was %s)", placement.version,
                     "none" if kept is None else kept.version)
            return True

    def _load(self) -> Placement | None:
        self._remove_leftovers()
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptDataError(f"{self.path}: cannot read the placement: {exc}") from exc
        try:
            return Placement.from_json(text)
        except PlacementError as exc:
            raise CorruptDataError(
                f"{self.path}: the stored placement is damaged ({exc.message}). Restore the "
                f"file, or remove it to have the site wait for the controller to push the "
                f"placement again") from exc

    def _remove_leftovers(self) -> None:
        # A crash between creating the temp file and renaming it leaves it behind;
        # it was never the document, so it goes.
        if not self.path.parent.is_dir():
            return
        for leftover in self.path.parent.glob(f".{PLACEMENT_FILE}.*.tmp"):
            leftover.unlink(missing_ok=True)
