"""Log shipping on the peer port (aiohttp): a site's `PeerServer` applies appends
that shard leaders send to its replicas' logs; a leader's `PeerClient` sends them.
Only the transport lives here: what to send comes from `Leadership`, how a follower
takes it from `ShardLog.append_from_leader`. The listener is guarded
(`http/guard.py`): whoever reaches the port cannot hold its file descriptors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from ...errors import CorruptDataError, StorageError
from ...http.guard import (
    HEADER_TIMEOUT,
    KEEPALIVE_TIMEOUT,
    ConnectionGuard,
    GuardedListener,
    descriptor_share,
)
from ..fence import FencedError
from .clock import TIME_HEADER, ClockOffsets
from .leader import AppendRequest, tail_for
from .log import (
    AppendResult,
    BootstrapNeededError,
    LogGapError,
    Position,
    ShardLog,
    StaleEpochError,
)
from .peer_stream import FAILED, Refused, StreamClient, StreamServer, StreamUnavailable
from .wire import decode_request, decode_result, encode_request, encode_result

CONTENT_TYPE = "application/vnd.stratamq.append"
# An append carries at most the leader's max_bytes of entries (4 MiB) plus framing.
MAX_REQUEST_BYTES = 64 * 1024 * 1024

logger = logging.getLogger(__name__)

LogsOf = Callable[[str, int], ShardLog]
# Told (db, shard) after an append was taken: the site applies what became committed.
OnAppend = Callable[[str, int], None]
# A write forwarded to this site as the shard's leader: (db, shard, request body);
# returns once committed.
Submit = Callable[[str, int, bytes], Awaitable[None]]
SUBMIT_CONTENT_TYPE = "application/vnd.stratamq.submit"
# A generation change (an encoded log entry: a drop, GC deletes, a topic seed) another
# site asks this site to append as the shard's leader: (db, shard, entry); returns
# once applied here.
ChangeAt = Callable[[str, int, bytes], Awaitable[None]]
DEADLINE_HEADER = "X-Stratamq-Deadline"
# The error code of a site asked to append to, fence or bootstrap a shard it is no
# replica of (HTTP 403): the leader tries again later, it does not step down.
NOT_A_REPLICA = "not_a_replica"
# An append's refusals (`Refused.code`, over HTTP or the stream) and the HTTP status
# of each.
REFUSAL_STATUS = {"unknown_shard": 404, NOT_A_REPLICA: 403, "bad_request": 400,
                  "stale_epoch": 409, FAILED: 500}
# A forwarded write's refusals and the HTTP status of each. FENCED's message is the
# JSON the HTTP route answers with (the fenced keys in it); UNAVAILABLE: not the
# leader any more, no majority in time: the sender may try again.
FENCED, UNAVAILABLE, EXPIRED = "fenced", "unavailable", "expired"
FORWARD_REFUSAL_STATUS = {"unknown_shard": 404, "bad_request": 400, EXPIRED: 503,
                          FENCED: 409, UNAVAILABLE: 503, FAILED: 500}
# As the shard's leader: the offset a read barrier waits for (db, shard); raises a
# recoverable StorageError elsewhere.
Barrier = Callable[[str, int], Awaitable[int]]
# A consistent read of a shard's records (db, shard, key prefix, at most this many
# or all, after this key or from the first), for a site that holds no replica of the
# shard; a recoverable StorageError when this site cannot.
ReadRecords = Callable[[str, int, bytes, int | None, bytes | None],
                       Awaitable[list[tuple[bytes, bytes]]]]
# Whether this site is a replica of (db, shard) under the placement it keeps: a site
# taken off a shard refuses the appends and fences of a leader that has not taken
# that placement yet.
Holds = Callable[[str, int], bool]
# A request the broker serves on the peer port (a session taken over elsewhere).
PeerHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The most connections the peer port holds (`http/guard.py`; then the one waiting
# longest for its first request is closed). Its clients are the other sites, each
# through one aiohttp session (`site_replication.py`) whose connector holds at most 100
# connections to all its peers together (aiohttp's default limit), and their
# connections send their requests at once: 4,096 is room for 40 sites with their
# pools full. With few file descriptors (`ulimit -n`) a quarter of them, so that the
# port cannot take those that RocksDB, MQTT and the site's own connections need.
PEER_MAX_CONNECTIONS = 4096


class PeerError(StorageError):
    """A peer did not answer, or answered with an error: try again later."""

    recoverable = True


class _ExpiredError(PeerError):
    """A shard's leader refused a forwarded write as arrived after its deadline (not
    taken): `PeerClient.submit` may send it again."""


class PeerServer:
    def __init__(self, logs_of: LogsOf, executor: Executor, on_append: OnAppend | None = None,
                 submit: Submit | None = None, barrier: Barrier | None = None,
                 read_records: ReadRecords | None = None, change: ChangeAt | None = None,
                 holds: Holds | None = None) -> None:
        self._logs_of = logs_of
        self._holds = holds
        self._change_at = change
        self._executor = executor
        self._on_append = on_append
        self._submit = submit
        self._barrier = barrier
        self._read_records = read_records
        # one append at a time per shard log: each checks and moves the log's end
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._listener: GuardedListener | None = None
        self._streams = StreamServer(self.take_append, self.take_forward)
        # more endpoints (checkpoints for bootstraps, reads of shards held here, the
        # services beside replication, the broker's requests between sites): each
        # adds its routes
        self.extra_routes: list[Callable[[web.Application], None]] = []

    def add_route(self, method: str, path: str, handler: PeerHandler) -> None:
        """Serve another request on the peer port (before `start`)."""

        def add(app: web.Application) -> None:
            app.router.add_route(method, path, handler)
        self.extra_routes.append(add)

    def lock(self, db: str, shard: int) -> asyncio.Lock:
        """Held while a shard log is written through this server; the site's own
        writes to that log (as its leader) hold it too."""
        return self._locks.setdefault((db, shard), asyncio.Lock())

    def app(self, *middlewares: Middleware) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=middlewares)
        app.on_response_prepare.append(_stamp_time)
        app.router.add_post("/peer/v1/logs/{db}/{shard}/append", self._append)
        app.router.add_post("/peer/v1/logs/{db}/{shard}/fence", self._fence)
        app.router.add_get("/peer/v1/logs/{db}/{shard}/tail", self._tail)
        app.router.add_post("/peer/v1/dbs/{db}/{shard}/submit", self._submit_write)
        app.router.add_get("/peer/v1/dbs/{db}/{shard}/barrier", self._read_barrier)
        app.router.add_get("/peer/v1/dbs/{db}/{shard}/records", self._records)
        app.router.add_post("/peer/v1/dbs/{db}/{shard}/change", self._change)
        self._streams.add_routes(app)
        for add_routes in self.extra_routes:
            add_routes(app)
        return app

    async def start(self, host: str, port: int) -> None:
        guard = ConnectionGuard("peer", descriptor_share(PEER_MAX_CONNECTIONS),
                                HEADER_TIMEOUT, KEEPALIVE_TIMEOUT)
        listener = GuardedListener(self.app(guard.middleware), guard)
        await listener.start(host, port)
        self._listener = listener

    async def stop(self) -> None:
        await self._streams.close()
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None

    def _log_asked(self, http: web.Request) -> tuple[str, int, ShardLog] | web.Response:
        db = http.match_info["db"]
        try:
            shard = int(http.match_info["shard"])
            return db, shard, self._logs_of(db, shard)
        except (ValueError, KeyError):
            return _error(404, "unknown_shard", f"no replica of {db}/{http.match_info['shard']} "
                                                f"on this site")

    def _not_a_replica(self, db: str, shard: int) -> Refused | None:
        """The refusal for a site the placement took off `db/shard`, or None. Called
        under the shard's log lock: a placement taken later drops the log after."""
        if self._holds is None or self._holds(db, shard):
            return None
        return Refused(NOT_A_REPLICA, f"this site is no replica of {db}/{shard} under "
                                      f"the placement it holds")

    async def _fence(self, http: web.Request) -> web.Response:
        """A new leader taking over: refuse older leaders' appends from now on, and
        say where this log ends (the new leader appends the furthest tail of a
        majority before its own entries)."""
        asked = self._log_asked(http)
        if isinstance(asked, web.Response):
            return asked
        db, shard, log = asked
        try:
            epoch = int((await http.json())["epoch"])
        except (ValueError, KeyError, TypeError) as error:
            return _error(400, "bad_request", f"expected {{\"epoch\": n}}: {error}")
        async with self.lock(db, shard):
            refused = self._not_a_replica(db, shard)
            if refused is not None:
                return _error(REFUSAL_STATUS[refused.code], refused.code, refused.message)
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, log.observe_epoch, epoch)
            except StaleEpochError as error:
                return _error(409, "stale_epoch", str(error))
            last = log.last
        if self._on_append is not None:
            self._on_append(db, shard)  # a leader of an older epoch here steps down
        return web.json_response({"last": [last.epoch, last.offset]})

    async def _tail(self, http: web.Request) -> web.Response:
        """This log's entries from `from` on, for a new leader taking over (see
        `leader.tail_for`)."""
        asked = self._log_asked(http)
        if isinstance(asked, web.Response):
            return asked
        db, shard, log = asked
        try:
            start = max(1, int(http.query["from"]))
        except (KeyError, ValueError):
            return _error(400, "bad_request", "from: the first offset wanted")
        async with self.lock(db, shard):
            try:
                request = await asyncio.get_running_loop().run_in_executor(
                    self._executor, tail_for, log, start)
            except BootstrapNeededError as error:
                return _error(410, "trimmed", str(error))
        return web.Response(body=encode_request(request), content_type=CONTENT_TYPE)

    async def _append(self, http: web.Request) -> web.Response:
        try:
            shard = int(http.match_info["shard"])
        except ValueError:
            return _error(404, "unknown_shard", f"no shard {http.match_info['shard']}")
        try:
            result = await self.take_append(http.match_info["db"], shard, await http.read())
        except Refused as refusal:
            return _error(REFUSAL_STATUS[refusal.code], refusal.code, refusal.message)
        return web.Response(body=result, content_type=CONTENT_TYPE)

    async def take_append(self, db: str, shard: int, body: bytes) -> bytes:
        """Append what a leader sent (`wire.encode_request`) to this site's replica of
        `db/shard`, over HTTP or the peer stream; the encoded result. Refused (with
        one of REFUSAL_STATUS's codes) when it is not taken."""
        try:
            shard_log = self._logs_of(db, shard)
        except KeyError as error:
            raise Refused("unknown_shard", f"no replica of {db}/{shard} on this site") \
                from error
        try:
            request = decode_request(body)
        except CorruptDataError as error:
            raise Refused("bad_request", str(error)) from error
        async with self.lock(db, shard):
            refused = self._not_a_replica(db, shard)
            if refused is not None:
                raise refused
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._executor, shard_log.append_from_leader, request.epoch, request.previous,
                    request.entries, request.committed)
            except StaleEpochError as error:
                raise Refused("stale_epoch", str(error)) from error
            except (LogGapError, CorruptDataError) as error:
                raise Refused("bad_request", str(error)) from error
            if result.accepted:
                shard_log.leader_trims_before = request.trim_before
        if self._on_append is not None:
            self._on_append(db, shard)
        return encode_result(result)

    async def _submit_write(self, http: web.Request) -> web.Response:
        try:
            shard = int(http.match_info["shard"])
        except ValueError:
            return _error(404, "unknown_shard", f"no shard {http.match_info['shard']}")
        try:
            await self.take_forward(http.match_info["db"], shard, await http.read(),
                                    _deadline(http))
        except Refused as refusal:
            if refusal.code == FENCED:
                return web.Response(text=refusal.message, status=409,
                                    content_type="application/json")
            return _error(FORWARD_REFUSAL_STATUS[refusal.code], refusal.code,
                          refusal.message)
        return web.json_response({"committed": True})

    async def take_forward(self, db: str, shard: int, body: bytes, deadline: float) -> None:
        """Write what another site forwarded to this site as the shard's leader
        (`wire.encode_submit`), over HTTP or the peer stream; returns once committed.
        Refused (with one of FORWARD_REFUSAL_STATUS's codes) otherwise."""
        if self._submit is None:
            raise Refused("unknown_shard", "this site takes no forwarded writes")
        if time.time() > deadline:
            # The sender gave up on it (a request held up in a partition, delivered
            # by TCP after the healing): taken now, it would land after the writes
            # the sender's clients have resent since.
            raise Refused(EXPIRED, "the forwarded write arrived after its deadline")
        try:
            await self._submit(db, shard, body)
        except CorruptDataError as error:
            raise Refused("bad_request", str(error)) from error
        except FencedError as error:
            raise Refused(FENCED, json.dumps({
                "error": FENCED, "message": error.message,
                "keys": sorted(key.hex() for key in error.keys)})) from error
        except StorageError as error:
            raise Refused(UNAVAILABLE if error.recoverable else FAILED,
                          f"{type(error).__name__}: {error.message}") from error


    async def _change(self, http: web.Request) -> web.Response:
        if self._change_at is None:
            return _error(404, "unknown_shard", "this site takes no generation changes")
        try:
            shard = int(http.match_info["shard"])
        except ValueError:
            return _error(404, "unknown_shard", f"no shard {http.match_info['shard']}")
        try:
            await self._change_at(http.match_info["db"], shard, await http.read())
        except CorruptDataError as error:
            return _error(400, "bad_request", str(error))
        except StorageError as error:
            return _error(503 if error.recoverable else 500, type(error).__name__,
                          error.message)
        return web.json_response({"applied": True})

    async def _read_barrier(self, http: web.Request) -> web.Response:
        if self._barrier is None:
            return _error(404, "unknown_shard", "this site leads no shard")
        try:
            offset = await self._barrier(http.match_info["db"],
                                         int(http.match_info["shard"]))
        except ValueError:
            return _error(404, "unknown_shard", f"no shard {http.match_info['shard']}")
        except StorageError as error:
            return _error(503 if error.recoverable else 500, type(error).__name__,
                          error.message)
        return web.json_response({"offset": offset})

    async def _records(self, http: web.Request) -> web.Response:
        if self._read_records is None:
            return _error(404, "unknown_shard", "this site holds no shard")
        try:
            shard = int(http.match_info["shard"])
            prefix = bytes.fromhex(http.query.get("prefix", ""))
            limit = int(http.query["limit"]) if "limit" in http.query else None
            after = bytes.fromhex(http.query["after"]) if "after" in http.query else None
        except ValueError:
            return _error(400, "bad_request", "shard and limit must be numbers, prefix and "
                                              "after hex")
        try:
            records = await self._read_records(http.match_info["db"], shard, prefix, limit,
                                               after)
        except StorageError as error:
            return _error(503 if error.recoverable else 500, type(error).__name__,
                          error.message)
        return web.json_response({"records": [[key.hex(), value.hex()]
                                              for key, value in records]})


class PeerClient:
    def __init__(self, session: aiohttp.ClientSession, timeout: float = 5.0,
                 clocks: ClockOffsets | None = None) -> None:
        """`clocks`: the peers' clock offsets, estimated from this session's answers
        (its `trace_config`); deadlines sent to a peer are stated in its clock."""
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.clocks = clocks or ClockOffsets()
        self._streams = StreamClient(session, self.clocks)

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    async def append(self, address: str, db: str, shard: int,
                     request: AppendRequest) -> AppendResult:
        """Send an append to the site at `address` (host:port of its peer port): on the
        peer stream, or over HTTP to a site that does not speak it. Raises
        StaleEpochError when that site knows a newer leader, PeerError when it cannot
        be reached or refuses."""
        body = encode_request(request)
        if self._streams.speaks_stream(address):
            try:
                answer = await self._streams.append(address, db, shard, body,
                                                    self._timeout.total or 5.0)
            except StreamUnavailable as error:
                logger.info("appends to %s go over HTTP: %s", address, error.message)
            except StorageError as error:
                raise PeerError(f"{address} did not take an append to {db}/{shard}: "
                                f"{error.message}") from error
            else:
                if isinstance(answer, Refused):
                    if answer.code == "stale_epoch":
                        raise StaleEpochError(f"{address}: {answer.message}")
                    raise PeerError(f"{address} refused an append to {db}/{shard} "
                                    f"({REFUSAL_STATUS.get(answer.code, 500)} "
                                    f"{answer.code}): {answer.message}")
                return self._result(address, db, shard, answer)
        url = f"http://{address}/peer/v1/logs/{db}/{shard}/append"
        try:
            async with self._session.post(url, data=body,
                                          headers={"Content-Type": CONTENT_TYPE},
                                          timeout=self._timeout) as response:
                answered = await response.read()
                if response.status == 200:
                    return self._result(address, db, shard, answered)
                reason = answered.decode("utf-8", "replace")
                if response.status == 409:
                    raise StaleEpochError(f"{address}: {reason}")
                raise PeerError(f"{address} refused an append to {db}/{shard} "
                                f"({response.status}): {reason}")
        except (aiohttp.ClientError, TimeoutError) as error:
            raise PeerError(f"{address} did not take an append to {db}/{shard}: "
                            f"{error!r}") from error

    @staticmethod
    def _result(address: str, db: str, shard: int, body: bytes) -> AppendResult:
        # Another version of the peer protocol, or a body cut off: an answer to retry
        # later like a refusal (the sender goes on).
        try:
            return decode_result(body)
        except CorruptDataError as error:
            raise PeerError(f"{address} answered an append to {db}/{shard} with no "
                            f"append result: {error}") from error

    async def close(self) -> None:
        """Close the peer streams (before the session)."""
        await self._streams.close()

    async def fence(self, address: str, db: str, shard: int, epoch: int,
                    within: float) -> Position:
        """Fence the replica at `address` at `epoch` (a leader taking over); where its
        log ends. StaleEpochError when it knows a newer epoch, PeerError otherwise."""
        doing = f"a fence of {db}/{shard}"
        status, body = await self._fetch("POST", address, f"/peer/v1/logs/{db}/{shard}/fence",
                                         doing, within, json={"epoch": epoch})
        reason = body.decode("utf-8", "replace")
        if status == 409:
            raise StaleEpochError(f"{address}: {reason}")
        try:
            if status != 200:
                raise ValueError("not answered")
            last_epoch, last_offset = json.loads(body)["last"]
            return Position(int(last_epoch), int(last_offset))
        except (ValueError, KeyError, TypeError) as error:
            raise PeerError(f"{address} answered {doing} ({status}): {reason[:200]}") \
                from error

    async def tail(self, address: str, db: str, shard: int, start: int,
                   within: float) -> AppendRequest:
        """The entries of the log at `address` from `start` on (a leader taking over).
        PeerError when they do not come (BootstrapNeededError when trimmed there)."""
        doing = f"the tail of {db}/{shard}"
        status, body = await self._fetch("GET", address, f"/peer/v1/logs/{db}/{shard}/tail",
                                         doing, within, params={"from": str(start)})
        reason = body[:200].decode("utf-8", "replace")
        if status == 410:
            raise BootstrapNeededError(f"{address}: {reason}", 0)
        if status != 200:
            raise PeerError(f"{address} refused {doing} ({status}): {reason}")
        try:
            return decode_request(body)
        except CorruptDataError as error:
            raise PeerError(f"{address} sent {doing}: {error}") from error

    async def _fetch(self, method: str, address: str, path: str, doing: str, within: float,
                     **request: object) -> tuple[int, bytes]:
        """One request to the peer port at `address`: its status and body. PeerError
        when it is not answered in time."""
        try:
            async with self._session.request(method, f"http://{address}{path}",
                                             timeout=aiohttp.ClientTimeout(total=within),
                                             **request) as response:  # type: ignore[arg-type]
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise PeerError(f"{address} did not answer {doing}: {error!r}") from error

    async def submit(self, address: str, db: str, shard: int, body: bytes,
                     within: float) -> None:
        """Forward a write (`wire.encode_submit`) to the shard's leader at `address`;
        returns once it is committed. PeerError (recoverable) otherwise.

        Its deadline is stated in the leader's clock, by the estimate of it here. A
        leader refuses a write arrived past it (`EXPIRED`: not taken); when that
        answer (which tells the leader's clock) changed the estimate, the estimate was
        wrong (none yet: a first write after a start; or stale), not the write late:
        sent again at once with the new one, while `within` lasts."""
        if within <= 0:  # (aiohttp takes a timeout of 0 for none)
            raise PeerError(f"a write forwarded to {db}/{shard} at {address} had no time "
                            "left to be sent")
        give_up_at = time.monotonic() + within
        remaining = within
        while True:
            offset = self.clocks.offset(address)
            try:
                await self._submit_once(address, db, shard, body, remaining)
                return
            except _ExpiredError as error:
                remaining = give_up_at - time.monotonic()
                if self.clocks.offset(address) == offset or remaining <= 0:
                    raise PeerError(error.message) from error
                logger.info("%s/%s: a write forwarded to %s was refused as late for this "
                            "site's estimate of its clock (%+.3f s, now %+.3f s): sent "
                            "again", db, shard, address, offset, self.clocks.offset(address))

    async def _submit_once(self, address: str, db: str, shard: int, body: bytes,
                           within: float) -> None:
        """`submit`'s one try; _ExpiredError when the leader refused it as late."""
        deadline = self.clocks.peer_time(address, time.time() + within)
        if self._streams.speaks_stream(address):
            try:
                answer = await self._streams.forward(address, db, shard, body, deadline,
                                                     within)
            except StreamUnavailable:
                pass  # a site of an older version: over HTTP
            except StorageError as error:
                raise PeerError(f"the leader of {db}/{shard} at {address} did not answer a "
                                f"forwarded write: {error.message}") from error
            else:
                if isinstance(answer, Refused):
                    if answer.code == FENCED:
                        raise FencedError(f"the leader of {db}/{shard} at {address} refused "
                                          f"a fenced write: {answer.message}",
                                          _fenced_keys(answer.message.encode()))
                    if answer.code == EXPIRED:
                        raise _ExpiredError(f"the leader of {db}/{shard} at {address} "
                                            f"refused a forwarded write: {answer.message}")
                    raise PeerError(f"the leader of {db}/{shard} at {address} did not "
                                    f"commit a forwarded write ({answer.code}): "
                                    f"{answer.message}")
                return
        url = f"http://{address}/peer/v1/dbs/{db}/{shard}/submit"
        try:
            async with self._session.post(url, data=body,
                                          headers={"Content-Type": SUBMIT_CONTENT_TYPE,
                                                   DEADLINE_HEADER: f"{deadline:.6f}"},
                                          timeout=aiohttp.ClientTimeout(total=within)
                                          ) as response:
                reason = await response.read()
                if response.status == 409:
                    raise FencedError(f"the leader of {db}/{shard} at {address} refused a "
                                      f"fenced write: {reason.decode('utf-8', 'replace')}",
                                      _fenced_keys(reason))
                if response.status == FORWARD_REFUSAL_STATUS[EXPIRED] \
                        and _error_code(reason) == EXPIRED:
                    raise _ExpiredError(f"the leader of {db}/{shard} at {address} refused "
                                        f"a forwarded write: "
                                        f"{reason.decode('utf-8', 'replace')}")
                if response.status != 200:
                    raise PeerError(f"the leader of {db}/{shard} at {address} did not "
                                    f"commit a forwarded write ({response.status}): "
                                    f"{reason.decode('utf-8', 'replace')}")
        except (aiohttp.ClientError, TimeoutError) as error:
            raise PeerError(f"the leader of {db}/{shard} at {address} did not answer a "
                            f"forwarded write: {error!r}") from error


    async def change(self, address: str, db: str, shard: int, entry: bytes,
                     within: float) -> None:
        """Have the shard's leader at `address` append a generation change (an encoded
        log entry); returns once it is applied there. PeerError (recoverable)
        otherwise."""
        await self._json("POST", address, f"/peer/v1/dbs/{db}/{shard}/change",
                         f"a generation change of {db}/{shard}", within, data=entry)

    async def read_records(self, address: str, db: str, shard: int, prefix: bytes,
                           within: float, limit: int | None = None,
                           after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """A consistent read of a shard's records at a site that holds a replica of
        it. PeerError (recoverable) when it does not answer with them."""
        params = {"prefix": prefix.hex()}
        if limit is not None:
            params["limit"] = str(limit)
        if after is not None:
            params["after"] = after.hex()
        doing = f"a read of records of {db}/{shard}"
        answer = await self._json("GET", address, f"/peer/v1/dbs/{db}/{shard}/records",
                                  doing, within, params=params)
        try:
            return [(bytes.fromhex(key), bytes.fromhex(value))
                    for key, value in answer["records"]]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise PeerError(f"{address} answered {doing} with {answer!r:.200}") from error

    async def call(self, address: str, name: str, body: dict[str, object],
                   within: float) -> dict[str, object]:
        """POST a broker request (`/peer/v1/broker/{name}`) to the site at `address`;
        its JSON answer. PeerError (recoverable) when it does not answer with one."""
        return await self._json("POST", address, f"/peer/v1/broker/{name}", name, within,
                                json=body)

    async def barrier(self, address: str, db: str, shard: int, within: float) -> int:
        """Ask the shard's leader at `address` for the offset a read barrier waits
        for (the end of its log). PeerError (recoverable) when it does not answer so."""
        doing = f"a read barrier of {db}/{shard}"
        answer = await self._json("GET", address, f"/peer/v1/dbs/{db}/{shard}/barrier",
                                  doing, within)
        offset = answer.get("offset")
        if not isinstance(offset, int):
            raise PeerError(f"the leader of {db}/{shard} at {address} answered {doing} "
                            f"with offset {offset!r}")
        return offset

    async def _json(self, method: str, address: str, path: str, doing: str, within: float,
                    **request: object) -> dict[str, Any]:
        """One request to the peer port at `address` whose answer is a JSON object.
        PeerError (recoverable) when it is not answered in time, refused (not 200), or
        answered with anything else; `doing` names the request in the message."""
        status, body = await self._fetch(method, address, path, doing, within, **request)
        if status != 200:
            raise PeerError(f"{address} refused {doing} ({status}): "
                            f"{body.decode('utf-8', 'replace')}")
        try:
            found = json.loads(body)
        except ValueError as error:
            raise PeerError(f"{address} answered {doing} with {body[:200]!r}") from error
        if not isinstance(found, dict):
            raise PeerError(f"{address} answered {doing} with {found!r:.200}")
        return found


def _error_code(body: bytes) -> str | None:
    """The `error` of a JSON refusal (`_error`); None when the body is not one."""
    try:
        found = json.loads(body)
    except ValueError:
        return None
    return found.get("error") if isinstance(found, dict) else None


def _fenced_keys(body: bytes) -> frozenset[bytes]:
    try:
        return frozenset(bytes.fromhex(key) for key in json.loads(body)["keys"])
    except (ValueError, KeyError, TypeError) as error:
        raise PeerError(f"a refused fenced write answered with {body[:200]!r}") from error


async def _stamp_time(_http: web.Request, response: web.StreamResponse) -> None:
    """Every answer tells this site's wall clock, from which the asking site estimates
    how far the two clocks are apart (`clock.py`)."""
    response.headers[TIME_HEADER] = f"{time.time():.6f}"


def _deadline(http: web.Request) -> float:
    """The wall-clock time after which the sender of a forwarded write no longer waits
    for it, in this site's clock (the sender converts it with its estimate of this
    site's clock offset, `clock.py`)."""
    try:
        return float(http.headers.get(DEADLINE_HEADER, "inf"))
    except ValueError:
        return float("inf")


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)
