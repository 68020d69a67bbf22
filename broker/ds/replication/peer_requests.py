"""The requests other sites make of this one on the peer port, beside the log
appends `PeerServer` serves itself: a write forwarded to this site's leader, a
generation change, a barrier, a read of records, a checkpoint to bootstrap from, a
bootstrap the shard's leader asks for, and the broker's own requests between sites."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ...errors import CorruptDataError, PlacementError, StorageError
from ..shard_set import ShardSet
from . import entries
from .bootstrap import PROGRESS_EVERY, serve_checkpoint
from .log import Position, ShardLog, StaleEpochError
from .peer import NOT_A_REPLICA, PeerHandler
from .replica import ShardReplica
from .replica_context import NotLeaderError
from .store import PlacementStore
from .wire import decode_submit

if TYPE_CHECKING:
    from .backend import ReplicatedBackend


class PeerRequests:
    """What this site answers on the peer port for its shard replicas (and the
    broker's requests, by name)."""

    def __init__(self, site: str, store: PlacementStore,
                 backend_of: Callable[[str], ReplicatedBackend | None], checkpoints: Path,
                 checkpoint_rate: int | None) -> None:
        """`backend_of`: the backend of a database this site replicates, by name
        (None: no such database); `checkpoints`: where checkpoints sent are made."""
        self.site = site
        self._store = store
        self._backend_of = backend_of
        self._checkpoints = checkpoints
        self._checkpoint_rate = checkpoint_rate
        self._handlers: dict[str, PeerHandler] = {}

    def _replicated(self, db: str, shard: int) -> ReplicatedBackend:
        replicated = self._backend_of(db)
        if replicated is None or not 0 <= shard < len(replicated.replicas):
            raise NotLeaderError(f"this site holds no shard {db}/{shard}")
        return replicated

    def _replica(self, db: str, shard: int) -> ShardReplica:
        return self._replicated(db, shard).replicas[shard]


    def holds_replica(self, db: str, shard: int) -> bool:
        """Whether the placement this site keeps lists it as a replica of db/shard
        (True before it has one, or when it places no such shard yet: nothing says
        otherwise)."""
        current = self._store.current
        if current is None:
            return True
        try:
            return self.site in current.shard(db, shard).replicas
        except PlacementError:
            return True

    def log_of(self, db: str, shard: int) -> ShardLog:
        replicated = self._backend_of(db)
        if replicated is None or not 0 <= shard < len(replicated.logs):
            raise KeyError(db)
        return replicated.logs[shard]

    def on_append(self, db: str, shard: int) -> None:
        replicated = self._backend_of(db)
        if replicated is not None and 0 <= shard < len(replicated.replicas):
            replica = replicated.replicas[shard]
            replica.committed_moved()
            leadership = replica.leadership
            if leadership is not None and not leadership.current:
                replica.step_down_for_newer_epoch()

    async def submit(self, db: str, shard: int, body: bytes) -> None:
        replica = self._replica(db, shard)
        messages, puts, deletes, fences = decode_submit(body)
        await replica.submit_forwarded(messages, puts, deletes, fences)

    async def change(self, db: str, shard: int, entry: bytes) -> None:
        """A generation change another site asks this site to append as the leader."""
        change = entries.decode(entry)
        if not isinstance(change, entries.DropGeneration | entries.GcWrite
                          | entries.SetTopicSeed):
            raise CorruptDataError(f"a {type(change).__name__} is not a change another "
                                   "site may ask for")
        replicated = self._replicated(db, shard)
        await replicated.replicas[shard].until_leading()
        if not await replicated.propose(shard, change):
            raise NotLeaderError(f"{db}/{shard}: this site does not lead the shard")

    async def barrier(self, db: str, shard: int) -> int:
        return await self._replica(db, shard).barrier_offset()

    async def read_records(self, db: str, shard: int, prefix: bytes, limit: int | None,
                            after: bytes | None) -> list[tuple[bytes, bytes]]:
        return await self._replica(db, shard).read_records_for_peer(prefix, limit, after)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/peer/v1/checkpoints/{db}/{shard}", self._send_checkpoint)
        app.router.add_post("/peer/v1/bootstraps/{db}/{shard}", self._bootstrap)

    def _replica_of(self, http: web.Request) -> tuple[ShardSet, ShardReplica] | None:
        replicated = self._backend_of(http.match_info["db"])
        try:
            shard = int(http.match_info["shard"])
        except ValueError:
            return None
        if replicated is None or not 0 <= shard < len(replicated.replicas):
            return None
        return replicated.shard_set, replicated.replicas[shard]

    async def _send_checkpoint(self, http: web.Request) -> web.StreamResponse:
        """A checkpoint of one shard for a replica that bootstraps from it."""
        found = self._replica_of(http)
        if found is None:
            return web.json_response({"error": "unknown_shard"}, status=404)
        shard_set, replica = found
        return await serve_checkpoint(http, shard_set, replica.shard_id, replica.log,
                                      self._checkpoints,
                                      self._checkpoint_rate)

    async def _bootstrap(self, http: web.Request) -> web.StreamResponse:
        """The shard's leader asks this site to bootstrap its replica from it (refused
        with 409 when this replica has seen a newer epoch than the leader's). The
        answer is a line of progress every PROGRESS_EVERY, then one with the outcome
        (the leader waits as long as lines come)."""
        found = self._replica_of(http)
        if found is None:
            return web.json_response({"error": "unknown_shard"}, status=404)
        _shard_set, replica = found
        if not self.holds_replica(http.match_info["db"], replica.shard_id):
            return web.json_response(
                {"error": NOT_A_REPLICA, "message": "this site is no replica of the shard "
                                                   "under the placement it holds"},
                status=403)
        try:
            document = await http.json()
            source, epoch = document["from"], document["epoch"]
            if not isinstance(source, str) or not isinstance(epoch, int) \
                    or isinstance(epoch, bool):
                raise TypeError(source)
        except (ValueError, KeyError, TypeError):
            return web.json_response(
                {"error": "bad_request",
                 "message": 'expected {"from": "host:port", "epoch": leader epoch}'},
                status=400)
        try:  # refused at once, before a checkpoint is asked for
            await replica.check_bootstrap_epoch(epoch)
        except StaleEpochError as error:
            return web.json_response({"error": "stale_epoch", "message": error.message},
                                     status=409)
        bootstrapping = asyncio.ensure_future(replica.bootstrap_from(source, epoch))
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await response.prepare(http)
            while not bootstrapping.done():
                await asyncio.wait({bootstrapping}, timeout=PROGRESS_EVERY)
                if not bootstrapping.done():
                    progress = replica.bootstrap_progress
                    await response.write(json.dumps(
                        {"progress": None if progress is None else progress.as_dict()}
                    ).encode() + b"\n")
            await response.write(json.dumps(await _outcome(bootstrapping)).encode() + b"\n")
            await response.write_eof()
        except ConnectionError:  # the leader gave up; it asks again (and finds this one)
            bootstrapping.add_done_callback(lambda done: done.cancelled() or done.exception())
        return response

    def serve(self, name: str, handler: PeerHandler) -> None:
        """Answer the broker's request `name` with `handler` (`broker_request`)."""
        self._handlers[name] = handler

    async def broker_request(self, http: web.Request) -> web.StreamResponse:
        handler = self._handlers.get(http.match_info["name"])
        if handler is None:  # the broker has not started yet
            return web.json_response({"error": "not_ready"}, status=503)
        return await handler(http)


async def _outcome(bootstrapping: asyncio.Future[Position]) -> dict[str, Any]:
    """What a bootstrap came to, as the leader that asked for it reads it."""
    try:
        last = await bootstrapping
    except StorageError as error:
        return {"error": type(error).__name__, "message": error.message}
    return {"last": [last.epoch, last.offset]}
