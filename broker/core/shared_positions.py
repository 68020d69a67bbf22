"""Where this site's shared groups stopped settling messages, kept on disk
(`<data_dir>/shared-groups.json`) every `SAVE_INTERVAL` and at a clean stop, so that a
restarted site finds its groups again: each is absent (`AbsentGroup` in dispatch.py)
until a member is back, and then reads from where its members stopped, at least once.
After a `kill -9`, messages settled in the last interval come again.

The file is the site's own: a member that comes back on another site of a cluster
finds the group there from the live feed. A file older than `keep_for` (the longest
retention: storage holds nothing older to read) is not loaded."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from ..errors import CorruptDataError
from ..files import write_atomically
from ..supervise import supervise
from .dispatch import AbsentGroup, Dispatcher

log = logging.getLogger(__name__)

FILE_NAME = "shared-groups.json"
FORMAT = 1
SAVE_INTERVAL = 1.0


def encode(groups: dict[str, AbsentGroup], saved_at: float) -> str:
    return json.dumps({"format": FORMAT, "saved_at": saved_at, "groups": {
        key: {"since": {str(shard): at for shard, at in sorted(group.since.items())},
              "away": sorted(group.away)}
        for key, group in sorted(groups.items())}})


def decode(text: str) -> tuple[dict[str, AbsentGroup], float]:
    """The groups and when they were saved (s since the epoch); CorruptDataError when
    the text is not such a file."""
    try:
        found: Any = json.loads(text)
        if found.get("format") != FORMAT:
            raise ValueError(f"unknown format {found.get('format')!r}")
        groups = {str(key): AbsentGroup({int(shard): int(at)
                                         for shard, at in entry["since"].items()},
                                        {str(client) for client in entry["away"]})
                  for key, entry in found["groups"].items()}
        return groups, float(found["saved_at"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptDataError(f"{FILE_NAME}: {exc}") from exc


class SharedPositions:
    def __init__(self, dispatcher: Dispatcher, data_dir: Path, executor: Executor,
                 keep_for: float) -> None:
        self._dispatcher = dispatcher
        self._path = data_dir / FILE_NAME
        self._executor = executor
        self._keep_for = keep_for
        self._saver: asyncio.Task[None] | None = None
        self._last_saved = ""
        self._last_saved_at = 0.0

    async def load(self) -> None:
        """Give the dispatcher the groups kept at the last stop. A damaged file is
        logged and set aside (the groups start from the live feed), never fatal."""
        loop = asyncio.get_running_loop()
        try:
            text = await loop.run_in_executor(self._executor, self._path.read_text)
        except FileNotFoundError:
            return
        try:
            groups, saved_at = decode(text)
        except CorruptDataError as exc:
            log.error("shared groups' positions not read (the groups start from the live "
                      "feed): %s", exc.message)
            return
        if time.time() - saved_at > self._keep_for:
            return
        self._dispatcher.restore_absent(groups)
        if groups:
            log.info("shared groups kept for their members: %s", ", ".join(sorted(groups)))

    def start(self) -> None:
        self._saver = asyncio.create_task(supervise("shared-positions", self._save_every),
                                          name="shared-positions")

    async def close(self) -> None:
        """Stop saving; a last save (the connections are closed: every group whose
        members keep their sessions is absent now)."""
        if self._saver is not None:
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
        await self.save(force=True)

    async def _save_every(self) -> None:
        while True:
            await asyncio.sleep(SAVE_INTERVAL)
            await self.save()

    async def save(self, force: bool = False) -> None:
        """Write the positions when they moved (or the file's time would soon make
        them look too old to load), or with `force`."""
        groups = self._dispatcher.positions_to_keep()
        text = encode(groups, 0.0)
        now = time.time()
        if not force and text == self._last_saved \
                and now - self._last_saved_at < self._keep_for / 2:
            return
        self._last_saved, self._last_saved_at = text, now
        await asyncio.get_running_loop().run_in_executor(
            self._executor, write_atomically, self._path, encode(groups, now))
