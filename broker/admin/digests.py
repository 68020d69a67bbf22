"""`GET /api/v1/ds/storages/{db}/shards/{shard}/digest`: the digest of one shard's
content as this site applied it (`ds/digest.py`), for `stratamq ctl ds verify`.

`?offset=N` first waits (up to `?wait=` seconds, 10 by default, at most
MAX_WAIT) until this site has applied log offset N, so that a replica that lags a
little is compared at the offset of the others. The answer names the offset the
digest is at, which is N or later: the caller compares replicas at equal offsets only.
One digest at a time per site (each reads the whole shard, in the executor); other
requests wait their turn."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ..ds import Database
from ..errors import StorageTimeoutError
from .http_errors import BadRequestError
from .views import Json

DEFAULT_WAIT = 10.0
MAX_WAIT = 60.0
# How often a wait for an offset looks at the shard's applied offset.
POLL_INTERVAL = 0.05


class ShardDigests:
    def __init__(self, work_dir: Path) -> None:
        self._work_dir = work_dir
        self._one_at_a_time = asyncio.Lock()

    async def answer(self, site: str, database: Database, shard: str,
                     query: dict[str, str]) -> Json:
        shard_id = _number(shard, "shard")
        if shard_id >= database.shard_count:
            raise BadRequestError(f"database {database.name!r} has shards 0 to "
                                  f"{database.shard_count - 1}, not {shard_id}")
        offset = _number(query["offset"], "offset") if "offset" in query else None
        wait = min(MAX_WAIT, _seconds(query.get("wait"), DEFAULT_WAIT))
        if offset is not None:
            await _until_applied(database, shard_id, offset, wait)
        async with self._one_at_a_time:
            found = await database.digest(shard_id, self._work_dir)
        return {"site": site, "db": database.name, "shard": shard_id,
                "applied": found.applied, "digest": found.digest, "keys": found.keys}


async def _until_applied(database: Database, shard_id: int, offset: int,
                         wait: float) -> None:
    deadline = time.monotonic() + wait
    # asked again each time: a bootstrap puts another copy of the shard in place
    while (applied := database.applied_offset(shard_id)) < offset:
        if time.monotonic() >= deadline:
            raise StorageTimeoutError(
                f"{database.name}/{shard_id}: applied up to offset {applied}, "
                f"not {offset}, within {wait}s")
        await asyncio.sleep(POLL_INTERVAL)


def _number(text: str, name: str) -> int:
    if not text.isdigit() or len(text) > 19:
        raise BadRequestError(f"{name} must be a whole number >= 0, not {text[:40]!r}")
    return int(text)


def _seconds(text: str | None, default: float) -> float:
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise BadRequestError(f"wait must be seconds, not {text[:40]!r}") from None
    if not value >= 0:  # NaN too
        raise BadRequestError(f"wait must be >= 0 seconds, not {text[:40]!r}")
    return value
