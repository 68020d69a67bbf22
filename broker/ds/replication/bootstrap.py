"""Replica bootstrap from a checkpoint (docs/replication.md, "Log trimming and replica
bootstrap"): a replica that needs log entries its leader has trimmed (or that is new to
a big shard) gets a consistent RocksDB checkpoint of that one shard from the leader,
installs it in place of its own shard and then reads the log from where the checkpoint
was taken.

The leader asks (its sender to that follower meets `BootstrapNeededError`): it posts
`/peer/v1/bootstraps/{db}/{shard}` to the follower with its own peer address and its
leader epoch, and waits for the answer. The follower refuses a request of an epoch
older than its log has seen (a deposed leader's late request: the new leader may have
counted entries this follower holds), before the fetch and again, under the log lock,
before the install; and it refuses to install a checkpoint taken below what it has
applied (that would roll back what it acknowledged). Otherwise it fetches
`/peer/v1/checkpoints/{db}/{shard}` from the leader: one streamed response, a JSON
header line (the position the checkpoint was taken at, its files and sizes), then
each file's bytes in turn, read and written in bounded chunks. The files land in the
staged folder next to the shard's (see `install.py`) with a `bootstrap.json` naming
the position; the folder is swapped in, the log reset to that position, and the
marker removed. A crash before the swap keeps the old shard (the leader asks again);
after it, the site finishes the reset on start (`finish_install`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import aiohttp
from aiohttp import web

from ...errors import CorruptDataError
from ..checkpoint import checkpoint_shard
from ..install import staged_folder, sync_folder
from ..shard_set import ShardSet
from .log import START, Position, ShardLog, StaleEpochError
from .peer import PeerError

log = logging.getLogger(__name__)

T = TypeVar("T")

MARKER = "bootstrap.json"
CHUNK = 1024 * 1024
# A checkpoint of a big shard takes as long as it takes (at `cluster.checkpoint_rate`):
# a bootstrap fails only once nothing (checkpoint bytes, or the follower's word that
# it is still at it) came for this long.
STALL_TIMEOUT = 60.0
# How often a bootstrapping follower tells the leader that asked it that it is still
# at it (well within STALL_TIMEOUT).
PROGRESS_EVERY = 5.0
CHECKPOINTS_DIR = "checkpoints"


class BootstrapRefusedError(CorruptDataError):
    """A checkpoint taken below what this replica has applied: installing it would roll
    back entries it applied (and acknowledged). Refused, counted and logged."""


def check_install(position: Position, applied: int) -> None:
    """Raise BootstrapRefusedError when a checkpoint taken at `position` would reset a
    replica that applied up to `applied` below it."""
    if position.offset < applied:
        raise BootstrapRefusedError(
            f"a checkpoint taken at offset {position.offset} (epoch {position.epoch}) is "
            f"below what this replica has applied ({applied}): refused")


def should_bootstrap(next_offset: int, first_offset: int, last_offset: int,
                     retain: int) -> bool:
    """Whether a follower that needs entries from `next_offset` on gets a checkpoint
    rather than the log: it needs trimmed entries, or it has nothing yet and the log
    holds more than the tail a lagging follower would read."""
    return next_offset < first_offset or (next_offset <= 1 and last_offset > retain)


@dataclass(slots=True)
class Progress:
    """A bootstrap under way on this site (shown in the replication status)."""

    source: str
    bytes_total: int = 0
    bytes_done: int = 0
    files: int = 0
    started: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict[str, Any]:
        return {"from": self.source, "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total, "files": self.files,
                "seconds": round(time.monotonic() - self.started, 3)}


# -- the leader's side ------------------------------------------------------------------

async def serve_checkpoint(http: web.Request, database: ShardSet, shard_id: int,
                           shard_log: ShardLog, work_dir: Path,
                           rate: int | None = None) -> web.StreamResponse:
    """Stream a checkpoint of one shard, made under the shard's lock, at up to `rate`
    bytes per second (None: as fast as it goes)."""
    loop = asyncio.get_running_loop()
    executor = database.executor
    folder = work_dir / f"{database.name}-{shard_id}-{uuid.uuid4().hex}"
    await loop.run_in_executor(executor, lambda: work_dir.mkdir(parents=True, exist_ok=True))
    try:
        applied = await checkpoint_shard(database, shard_id, folder)
        epoch = shard_log.epoch_at(applied)
        if epoch is None:
            return web.json_response(
                {"error": "no_position", "message": f"offset {applied} is not in the log"},
                status=503)
        files = await loop.run_in_executor(executor, _list_files, folder)
        header = {"epoch": epoch, "offset": applied,
                  "files": [[name, size] for name, size in files]}
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        try:
            await _send(response, http, header, folder, files, executor, rate)
        except ConnectionError as error:  # the fetching replica went away (it asks again)
            log.info("checkpoint of %s/%d not sent to %s: %s", database.name, shard_id,
                     http.remote, error)
        return response
    finally:
        await loop.run_in_executor(executor, shutil.rmtree, folder, True)


async def _send(response: web.StreamResponse, http: web.Request, header: dict[str, Any],
                folder: Path, files: list[tuple[str, int]], executor: Executor,
                rate: int | None) -> None:
    """The header line, then each file's bytes in bounded chunks, paced to `rate`."""
    loop = asyncio.get_running_loop()
    # paced: about ten chunks a second, so the rate holds for small files too
    chunk_size = CHUNK if rate is None else max(1, min(CHUNK, rate // 10))
    started = loop.time()
    sent = 0
    await response.prepare(http)
    await response.write(json.dumps(header).encode() + b"\n")
    for name, size in files:
        source = await loop.run_in_executor(executor, _open_for_reading, folder / name)
        try:
            left = size
            while left > 0:
                chunk = await loop.run_in_executor(executor, source.read,
                                                   min(chunk_size, left))
                if not chunk:
                    raise CorruptDataError(f"{folder / name} shrank while sent")
                await response.write(chunk)
                left -= len(chunk)
                sent += len(chunk)
                if rate is not None:
                    await asyncio.sleep(max(0.0, started + sent / rate - loop.time()))
        finally:
            await loop.run_in_executor(executor, source.close)
    await response.write_eof()


def _open_for_reading(path: Path) -> BinaryIO:
    return open(path, "rb")


def _list_files(folder: Path) -> list[tuple[str, int]]:
    return sorted((entry.name, entry.stat().st_size) for entry in os.scandir(folder)
                  if entry.is_file())


def remove_checkpoints(work_dir: Path) -> None:
    """Checkpoints left by a site that stopped while sending them."""
    shutil.rmtree(work_dir, ignore_errors=True)


# -- the follower's side ----------------------------------------------------------------

async def fetch_checkpoint(session: aiohttp.ClientSession, address: str, db: str,
                           shard_id: int, shard_path: Path, progress: Progress,
                           executor: Executor) -> Position:
    """Fetch the leader's checkpoint of the shard into the staged folder next to
    `shard_path`, marker included; the position it was taken at."""
    loop = asyncio.get_running_loop()
    staged = staged_folder(shard_path)

    async def run(function: Callable[..., T], *args: Any) -> T:
        return await loop.run_in_executor(executor, function, *args)

    await run(_fresh_folder, staged)
    url = f"http://{address}/peer/v1/checkpoints/{db}/{shard_id}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(
                total=None, sock_read=STALL_TIMEOUT)) as response:
            if response.status != 200:
                body = await response.read()
                raise PeerError(f"{address} made no checkpoint of {db}/{shard_id} "
                                f"({response.status}): {body.decode('utf-8', 'replace')}")
            header = json.loads(await response.content.readline())
            position = Position(int(header["epoch"]), int(header["offset"]))
            files = [(str(name), int(size)) for name, size in header["files"]]
            progress.bytes_total = sum(size for _name, size in files)
            for name, size in files:
                if "/" in name or name.startswith("."):
                    raise CorruptDataError(f"checkpoint file name {name!r}")
                target = await run(open, staged / name, "wb")
                try:
                    left = size
                    while left > 0:
                        chunk = await response.content.read(min(CHUNK, left))
                        if not chunk:
                            raise PeerError(f"{address}: checkpoint of {db}/{shard_id} "
                                            f"ended inside {name}")
                        await run(target.write, chunk)
                        left -= len(chunk)
                        progress.bytes_done += len(chunk)
                    await run(_flush_and_sync, target)
                finally:
                    await run(target.close)
                progress.files += 1
    except (aiohttp.ClientError, TimeoutError) as error:
        raise PeerError(f"{address} did not send a checkpoint of {db}/{shard_id}: "
                        f"{error!r}") from error
    except (ValueError, KeyError, TypeError) as error:
        raise PeerError(f"{address} sent a checkpoint of {db}/{shard_id} with a bad "
                        f"header: {error!r}") from error
    await run(_write_marker, staged, position)
    return position


def _fresh_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _flush_and_sync(target: Any) -> None:
    target.flush()
    os.fsync(target.fileno())


def _write_marker(staged: Path, position: Position) -> None:
    with open(staged / MARKER, "w") as marker:
        marker.write(json.dumps({"epoch": position.epoch, "offset": position.offset}))
        marker.flush()
        os.fsync(marker.fileno())
    sync_folder(staged)


def remove_staged(shard_path: Path) -> None:
    """Drop a staged folder that is not to be installed. Blocking."""
    shutil.rmtree(staged_folder(shard_path), ignore_errors=True)


def stage_empty_shard(shard_path: Path) -> None:
    """Stage an empty shard (with a marker for an empty log) for `swap_in_staged`:
    what a site keeps of a shard once it left the shard's replica set. Blocking."""
    staged = staged_folder(shard_path)
    _fresh_folder(staged)
    _write_marker(staged, START)


def finish_install(shard_path: Path, shard_log: ShardLog) -> Position | None:
    """After a checkpoint was swapped in: reset the shard's log to the position it was
    taken at, then drop the marker. Also on start (a crash between the two). Blocking;
    None when there is no marker."""
    marker = shard_path / MARKER
    try:
        document = json.loads(marker.read_text())
        position = Position(int(document["epoch"]), int(document["offset"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptDataError(f"{marker}: does not parse ({error})") from error
    shard_log.reset_to(position)
    marker.unlink()
    return position


# -- the leader asks ----------------------------------------------------------------------

async def request_bootstrap(session: aiohttp.ClientSession, address: str, db: str,
                            shard_id: int, leader_address: str, epoch: int) -> Position:
    """Ask the follower at `address` to bootstrap its replica of the shard from this
    leader's checkpoint (the leader of `epoch`); returns once it has, with the position
    its log now ends at. The follower answers with a line of progress every
    PROGRESS_EVERY and a last line with its outcome. StaleEpochError when it knows a
    newer epoch; PeerError when it does not bootstrap otherwise, or says nothing for
    STALL_TIMEOUT."""
    url = f"http://{address}/peer/v1/bootstraps/{db}/{shard_id}"
    line = b""
    try:
        async with session.post(url, json={"from": leader_address, "epoch": epoch},
                                timeout=aiohttp.ClientTimeout(total=None,
                                                              sock_read=STALL_TIMEOUT)
                                ) as response:
            if response.status == 409:
                body = await response.read()
                raise StaleEpochError(f"{address} refused a bootstrap of {db}/{shard_id}: "
                                      f"{body.decode('utf-8', 'replace')}")
            if response.status != 200:
                body = await response.read()
                raise PeerError(f"{address} did not bootstrap {db}/{shard_id} "
                                f"({response.status}): {body.decode('utf-8', 'replace')}")
            async for line in response.content:
                answer = json.loads(line)
                if answer.get("error") == StaleEpochError.__name__:
                    raise StaleEpochError(f"{address} did not bootstrap {db}/{shard_id}: "
                                          f"{answer.get('message')}")
                if "error" in answer:
                    raise PeerError(f"{address} did not bootstrap {db}/{shard_id}: "
                                    f"{answer['error']}: {answer.get('message')}")
                if "last" in answer:
                    epoch, offset = answer["last"]
                    return Position(int(epoch), int(offset))
    except (aiohttp.ClientError, TimeoutError) as error:
        raise PeerError(f"{address} did not answer a bootstrap of {db}/{shard_id}: "
                        f"{error!r}") from error
    except (ValueError, KeyError, TypeError) as error:
        raise PeerError(f"{address} answered a bootstrap of {db}/{shard_id} with "
                        f"{line[:200]!r}") from error
    raise PeerError(f"{address} ended its answer to a bootstrap of {db}/{shard_id} "
                    f"without an outcome")
