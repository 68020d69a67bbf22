"""What other sites read of the shards this site holds a replica of, over the peer
port (docs/replication.md, "Every site sees every shard"): the `RemoteReads` of a
site without a replica ask these. A replica still catching up answers that it holds
none; one behind what the asking site was fed waits a little, then says so."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from aiohttp import web

from ...errors import InvalidIteratorError, StorageError
from ..iterator import Iterator, Stream
from ..message import encode_message
from ..shard_set import ShardSet
from ..streams import GenerationView
from .remote_wire import encode_generations, encode_next

# The largest batch a peer's `next` answers with.
MAX_REMOTE_BATCH = 1000
NEXT_CONTENT_TYPE = "application/vnd.stratamq.next"
# How long a replica asked for a read waits to apply what the asking site was fed
# before it says it is behind (the asking site then asks the next replica).
BEHIND_WAIT = 0.5
BEHIND_POLL = 0.02


class RemoteReadService:
    """Serves one database's remote reads to other sites from the shards this site
    holds (and the pre-drop counts of the generations it reads elsewhere)."""

    def __init__(self, shard_set: ShardSet, is_remote: Callable[[int], bool],
                 generations: Callable[[int], Mapping[int, GenerationView]]) -> None:
        """`is_remote`: whether this site reads a shard elsewhere (it holds no
        replica of it, or one still catching up); `generations`: a shard's
        generations as this site reads them."""
        self.shard_set = shard_set
        self.is_remote = is_remote
        self.generations = generations


    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/peer/v1/dbs/{db}/{shard}/generations", self._serve_generations)
        app.router.add_post("/peer/v1/dbs/{db}/{shard}/next", self._serve_next)
        app.router.add_get("/peer/v1/dbs/{db}/{shard}/message", self._serve_message)
        app.router.add_post("/peer/v1/dbs/{db}/{shard}/pre-drop", self._serve_pre_drop)

    def _shard_asked(self, http: web.Request) -> int | web.Response:
        """The shard of a request, one of this database's."""
        try:
            shard_id = int(http.match_info["shard"])
        except ValueError:
            return _error(400, "bad_request", "shard must be a number")
        if http.match_info["db"] != self.shard_set.name \
                or not 0 <= shard_id < len(self.shard_set.shards):
            return _error(404, "unknown_shard", "no such shard here")
        return shard_id

    def _held(self, http: web.Request) -> int | web.Response:
        """The shard of a request, when this site holds a replica of it."""
        shard_id = self._shard_asked(http)
        if isinstance(shard_id, web.Response):
            return shard_id
        if self.is_remote(shard_id):
            return _error(503, "not_a_replica", "this site holds no replica of the shard "
                                                "(or one still catching up)")
        return shard_id

    async def _serve_generations(self, http: web.Request) -> web.Response:
        shard_id = self._held(http)
        if isinstance(shard_id, web.Response):
            return shard_id
        generations = self.shard_set.shards[shard_id].generations
        body = encode_generations({generation_id: (generation.info,
                                                   list(generation.trie.edges()))
                                   for generation_id, generation in
                                   list(generations.items())})
        return web.Response(body=body, content_type="application/json")

    async def _serve_next(self, http: web.Request) -> web.Response:
        shard_id = self._held(http)
        if isinstance(shard_id, web.Response):
            return shard_id
        try:
            iterator = Iterator.from_bytes(await http.read())
            batch = max(1, min(int(http.query.get("batch", "100")), MAX_REMOTE_BATCH))
        except (InvalidIteratorError, ValueError) as exc:
            return _error(400, "bad_request", str(exc))
        if iterator.stream.shard != shard_id:
            return _error(400, "bad_request", "the iterator reads another shard")
        behind = await self._behind(http, shard_id)
        if behind is not None:
            return behind
        try:
            result = await self.shard_set.next(iterator, batch)
        except StorageError as exc:
            return _error(503 if exc.recoverable else 500, type(exc).__name__, exc.message)
        return web.Response(body=encode_next(result), content_type=NEXT_CONTENT_TYPE)

    async def _serve_message(self, http: web.Request) -> web.Response:
        shard_id = self._held(http)
        if isinstance(shard_id, web.Response):
            return shard_id
        try:
            stream = Stream(shard_id, int(http.query["generation"]),
                            bytes.fromhex(http.query["static"]))
            timestamp = int(http.query["timestamp"])
        except (KeyError, ValueError):
            return _error(400, "bad_request", "generation, static (hex), timestamp")
        behind = await self._behind(http, shard_id)
        if behind is not None:
            return behind
        message = await self.shard_set.read_message(stream, timestamp)
        return web.Response(body=b"" if message is None else encode_message(message),
                            content_type=NEXT_CONTENT_TYPE)


    async def _behind(self, http: web.Request, shard_id: int) -> web.Response | None:
        """A 503 unless this replica has applied the shard through the timestamp the
        asking site says (`applied`: what it was fed, or the message it asks for),
        waiting BEHIND_WAIT for it: a follower cut off from its leader, or an old
        leader that left, holds a copy that lacks it."""
        try:
            wanted = int(http.query.get("applied", "0"))
        except ValueError:
            return _error(400, "bad_request", "applied must be a number")
        deadline = asyncio.get_running_loop().time() + BEHIND_WAIT
        while self.shard_set.shards[shard_id].last_timestamp < wanted:
            if asyncio.get_running_loop().time() >= deadline:
                return _error(503, "behind", f"this replica has applied the shard through "
                              f"{self.shard_set.shards[shard_id].last_timestamp}, "
                              f"not {wanted} yet")
            await asyncio.sleep(BEHIND_POLL)
        return None

    async def _serve_pre_drop(self, http: web.Request) -> web.Response:
        shard_id = self._shard_asked(http)
        if isinstance(shard_id, web.Response):
            return shard_id
        try:
            generation_id = int(http.query["generation"])
        except (KeyError, ValueError):
            return _error(400, "bad_request", "generation must be a number")
        # A replica here runs its listeners as it applies the drop: nothing to do now.
        # the pre-drop listeners run as on a replica, reading the generation at a
        # replica while it is still there
        if self.is_remote(shard_id) and generation_id in self.generations(shard_id):
            await self.shard_set.tell_pre_drop_listeners(shard_id, generation_id)
        return web.json_response({"counted": True})


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)
