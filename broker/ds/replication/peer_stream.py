"""Log shipping on one long-lived connection per peer: a leader's appends to a
follower, every shard's, and the writes a site forwards to a shard's leader, as
binary WebSocket messages on the peer port (`/peer/v1/stream`), each answered by
request id, in any order across shards (appends in order within one). An append
over HTTP (a POST per append per follower, `peer.py`) cost the two sites most of a
replicated write's CPU; over the stream it costs a message each way. The HTTP routes
stay for peers that do not speak the stream (a site of an older version, during a
roll): `stratamq.append.v1` carries appends only, `stratamq.stream.v2` forwarded
writes too.

WebSocket (aiohttp's, on the guarded peer listener) gives the framing, the size
limit, the subprotocol handshake that versions this protocol, and the heartbeat
(a ping each `STREAM_HEARTBEAT`, the connection closed without its pong) that tells
a dead peer from a slow one.

A message, big-endian:
  append  kind 1, request id (4), database name length (1), name, shard (4),
          `wire.encode_request` body
  forward kind 4 (v2), request id (4), deadline (8, a double: the leader's wall
          clock, after which the sender no longer waits), database name length (1),
          name, shard (4), `wire.encode_submit` body; its result has no body
  result  kind 2, request id (4), the follower's wall clock (8, a double: seconds),
          `wire.encode_result` body
  refusal kind 3, request id (4), the follower's wall clock (8), code length (1),
          code, message (UTF-8)
The follower's clock in each answer is what the `X-Stratamq-Time` header of an HTTP
answer is: the leader estimates the peer's clock offset from it (`clock.py`), as
forwarded writes state their deadlines in the peer's clock.
A message that does not decode closes the connection (the peer runs other code)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from ...errors import CorruptDataError, StorageError
from .clock import ClockOffsets

log = logging.getLogger(__name__)

PATH = "/peer/v1/stream"
# The subprotocols, newest first: the client offers both, the server takes the first
# it speaks. v1 (sites before forwarded writes went on the stream) carries appends.
PROTOCOL = "stratamq.stream.v2"
PROTOCOL_V1 = "stratamq.append.v1"
PROTOCOLS = (PROTOCOL, PROTOCOL_V1)
# An append carries at most the leader's max_bytes of entries (4 MiB) plus framing.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A ping this often; a connection whose pong does not come within half of it is
# closed, and its appends in flight fail (the sender retries on a new one).
STREAM_HEARTBEAT = 5.0
# Appends one connection may have in flight at the follower (read, not yet answered),
# and their bytes: past either it reads no more until some are answered (the leader's
# socket then fills: flow control). The bytes bound the follower's memory per leader
# (appends are up to the leader's max_bytes, 4 MiB, each); one bigger append alone
# still passes.
MAX_IN_FLIGHT = 256
MAX_IN_FLIGHT_BYTES = 32 * 1024 * 1024
# How long a site that refused the stream (an older version) is sent appends over
# HTTP before the stream is tried again.
FALLBACK_INTERVAL = 60.0

APPEND, RESULT, REFUSAL, FORWARD = 1, 2, 3, 4
# The refusal of an append that failed at the follower (an error writing its log).
FAILED = "failed"
_KIND_ID = struct.Struct(">BI")
_ANSWER = struct.Struct(">BId")  # kind, request id, the follower's wall clock
_LENGTH = struct.Struct(">B")
_SHARD = struct.Struct(">I")
_DEADLINE = struct.Struct(">d")

# Takes an append (db, shard, encoded request); returns the encoded result or raises
# `Refused`.
TakeAppend = Callable[[str, int, bytes], Awaitable[bytes]]
# Takes a forwarded write (db, shard, `wire.encode_submit` body, deadline in this
# site's clock); returns once it is committed or raises `Refused`.
TakeForward = Callable[[str, int, bytes, float], Awaitable[None]]


class Refused(Exception):
    """An append or forwarded write the peer did not take, with the code the HTTP
    route answers with (`peer.REFUSAL_STATUS`, `peer.FORWARD_REFUSAL_STATUS`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StreamUnavailable(StorageError):
    """The peer does not speak the stream (it answered the handshake with an HTTP
    error): send over HTTP."""

    recoverable = True


class StreamError(StorageError):
    """The connection failed or closed with the append in flight, or the answer did
    not come in time: try again later."""

    recoverable = True


@dataclass(frozen=True, slots=True)
class Append:
    request_id: int
    db: str
    shard: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Forward:
    request_id: int
    deadline: float  # the receiver's wall clock
    db: str
    shard: int
    body: bytes


def encode_append(request_id: int, db: str, shard: int, body: bytes) -> bytes:
    name = db.encode()
    return b"".join((_KIND_ID.pack(APPEND, request_id), _LENGTH.pack(len(name)), name,
                     _SHARD.pack(shard), body))


def encode_forward(request_id: int, deadline: float, db: str, shard: int,
                   body: bytes) -> bytes:
    name = db.encode()
    return b"".join((_KIND_ID.pack(FORWARD, request_id), _DEADLINE.pack(deadline),
                     _LENGTH.pack(len(name)), name, _SHARD.pack(shard), body))


def decode_append(raw: bytes) -> Append:
    found = decode_request(raw)
    if not isinstance(found, Append):
        raise CorruptDataError("stream append does not decode: a forwarded write")
    return found


def decode_request(raw: bytes) -> Append | Forward:
    """An append or a forwarded write, as the follower or leader receives it."""
    try:
        kind, request_id = _KIND_ID.unpack_from(raw)
        if kind not in (APPEND, FORWARD):
            raise ValueError(f"message kind {kind}, expected an append or forward")
        start = _KIND_ID.size
        deadline = 0.0
        if kind == FORWARD:
            (deadline,) = _DEADLINE.unpack_from(raw, start)
            start += _DEADLINE.size
        (length,) = _LENGTH.unpack_from(raw, start)
        start += _LENGTH.size
        db = raw[start:start + length].decode()
        (shard,) = _SHARD.unpack_from(raw, start + length)
    except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise CorruptDataError(f"stream message does not decode: {exc}") from exc
    body = raw[start + length + _SHARD.size:]
    if kind == FORWARD:
        return Forward(request_id, deadline, db, shard, body)
    return Append(request_id, db, shard, body)


def encode_result(request_id: int, body: bytes, now: float) -> bytes:
    return _ANSWER.pack(RESULT, request_id, now) + body


def encode_refusal(request_id: int, code: str, message: str, now: float) -> bytes:
    name = code.encode()
    return b"".join((_ANSWER.pack(REFUSAL, request_id, now), _LENGTH.pack(len(name)), name,
                     message.encode()))


@dataclass(frozen=True, slots=True)
class Answer:
    request_id: int
    peer_time: float  # the follower's wall clock when it answered
    outcome: bytes | Refused  # the result's body, or the refusal


def decode_answer(raw: bytes) -> Answer:
    try:
        kind, request_id, peer_time = _ANSWER.unpack_from(raw)
        if kind == RESULT:
            return Answer(request_id, peer_time, raw[_ANSWER.size:])
        if kind != REFUSAL:
            raise ValueError(f"message kind {kind}, expected an answer")
        (length,) = _LENGTH.unpack_from(raw, _ANSWER.size)
        start = _ANSWER.size + _LENGTH.size
        if len(raw) < start + length:
            raise ValueError("refusal code cut off")
        code = raw[start:start + length].decode()
        return Answer(request_id, peer_time,
                      Refused(code, raw[start + length:].decode("utf-8", "replace")))
    except (struct.error, ValueError) as exc:
        raise CorruptDataError(f"stream answer does not decode: {exc}") from exc


# --- the receiving end (a follower; a leader for forwarded writes) --------------------

class InFlight:
    """The appends one connection has in flight: `admit` waits while `max_count` of
    them, or `max_bytes`, are (an append bigger than `max_bytes` waits for none)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self._max_count = max_count
        self._max_bytes = max_bytes
        self.count = 0
        self.bytes = 0
        self._freed = asyncio.Event()

    async def admit(self, size: int) -> None:
        while self.count and (self.count >= self._max_count
                              or self.bytes + size > self._max_bytes):
            self._freed.clear()
            await self._freed.wait()
        self.count += 1
        self.bytes += size

    def release(self, size: int) -> None:
        self.count -= 1
        self.bytes -= size
        self._freed.set()


class StreamServer:
    """Serves `/peer/v1/stream` on the peer port: each connection's appends taken by
    `take`, in order per shard, concurrently across shards; its forwarded writes by
    `forward`, each as it comes (a site sends one write of a shard at a time)."""

    def __init__(self, take: TakeAppend, forward: TakeForward,
                 max_in_flight: int = MAX_IN_FLIGHT,
                 max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES) -> None:
        """`max_in_flight`, `max_in_flight_bytes`: a connection's bound (`InFlight`)."""
        self._take = take
        self._forward = forward
        self._max_in_flight = max_in_flight
        self._max_in_flight_bytes = max_in_flight_bytes
        self._open: set[web.WebSocketResponse] = set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PATH, self.serve)

    async def close(self) -> None:
        """Close every connection (the site stops serving the peer port)."""
        for connection in list(self._open):
            await connection.close(code=aiohttp.WSCloseCode.GOING_AWAY)

    async def serve(self, http: web.Request) -> web.StreamResponse:
        connection = web.WebSocketResponse(protocols=PROTOCOLS, heartbeat=STREAM_HEARTBEAT,
                                           max_msg_size=MAX_MESSAGE_BYTES)
        await connection.prepare(http)
        if connection.ws_protocol not in PROTOCOLS:
            await connection.close(code=aiohttp.WSCloseCode.PROTOCOL_ERROR,
                                   message=f"speaks only {', '.join(PROTOCOLS)}".encode())
            return connection
        self._open.add(connection)
        # the last append of each shard taken from this connection: the next waits
        # for it (a leader's appends to one log land in the order it sent them)
        last: dict[tuple[str, int], asyncio.Task[None]] = {}
        pending: set[asyncio.Task[None]] = set()
        in_flight = InFlight(self._max_in_flight, self._max_in_flight_bytes)
        try:
            async for message in connection:
                if message.type != aiohttp.WSMsgType.BINARY:
                    break  # an error, or text: not this protocol
                try:
                    request = decode_request(message.data)
                    if isinstance(request, Forward) and connection.ws_protocol != PROTOCOL:
                        raise CorruptDataError(f"a forwarded write on {connection.ws_protocol}")
                except CorruptDataError as exc:
                    log.warning("closing a peer stream from %s: %s", http.remote, exc)
                    break
                size = len(message.data)
                await in_flight.admit(size)
                key = (request.db, request.shard)
                if isinstance(request, Forward):
                    task = asyncio.create_task(self._answer_forward(connection, request))
                else:
                    task = asyncio.create_task(self._answer(connection, request, last.get(key)))
                    last[key] = task
                pending.add(task)

                def answered(done: asyncio.Task[None], key: tuple[str, int] = key,
                             size: int = size) -> None:
                    in_flight.release(size)
                    pending.discard(done)
                    if last.get(key) is done:
                        del last[key]
                task.add_done_callback(answered)
        finally:
            self._open.discard(connection)
            await connection.close()
            # Appends under way finish (not cancelled: one holds its log's lock while
            # its write runs in the executor); their answers go nowhere.
            if pending:
                await asyncio.wait(pending)
        return connection

    async def _answer(self, connection: web.WebSocketResponse, append: Append,
                      after: asyncio.Task[None] | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        try:
            taken = await self._take(append.db, append.shard, append.body)
            answer = encode_result(append.request_id, taken, time.time())
        except Refused as refusal:
            answer = encode_refusal(append.request_id, refusal.code, refusal.message,
                                    time.time())
        except Exception as exc:  # the HTTP route's 500: the leader tries again later
            log.exception("an append to %s/%s from a peer stream failed", append.db,
                          append.shard)
            answer = encode_refusal(append.request_id, FAILED, repr(exc), time.time())
        await _send(connection, answer)

    async def _answer_forward(self, connection: web.WebSocketResponse,
                              forward: Forward) -> None:
        try:
            await self._forward(forward.db, forward.shard, forward.body, forward.deadline)
            answer = encode_result(forward.request_id, b"", time.time())
        except Refused as refusal:
            answer = encode_refusal(forward.request_id, refusal.code, refusal.message,
                                    time.time())
        except Exception as exc:  # the HTTP route's 500: the sender may retry
            log.exception("a write forwarded to %s/%s on a peer stream failed", forward.db,
                          forward.shard)
            answer = encode_refusal(forward.request_id, FAILED, repr(exc), time.time())
        await _send(connection, answer)


async def _send(connection: web.WebSocketResponse, answer: bytes) -> None:
    """An answer, unless the connection is gone (the asker's end then fails it)."""
    if not connection.closed:
        with contextlib.suppress(ConnectionError):
            await connection.send_bytes(answer)


# --- the sending end (a leader; a site forwarding writes) -----------------------------

class StreamConnection:
    """One connection to a peer's stream: appends and forwarded writes sent as they
    come, their answers matched by request id. `protocol`: the subprotocol the peer
    took (forwarded writes need `PROTOCOL`)."""

    def __init__(self, address: str, connection: aiohttp.ClientWebSocketResponse,
                 clocks: ClockOffsets) -> None:
        self.address = address
        self.protocol = connection.protocol
        self._connection = connection
        self._clocks = clocks
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Answer]] = {}
        self._reader = asyncio.create_task(self._read(), name=f"peer-stream-{address}")

    @property
    def closed(self) -> bool:
        return self._reader.done()

    async def append(self, db: str, shard: int, body: bytes, within: float
                     ) -> bytes | Refused:
        """Send an append; its answer. StreamError when the connection fails or the
        answer does not come within `within` seconds."""
        return await self._ask(lambda request_id: encode_append(request_id, db, shard, body),
                               within, f"an append to {db}/{shard}")

    async def forward(self, db: str, shard: int, body: bytes, deadline: float,
                      within: float) -> bytes | Refused:
        """Send a forwarded write (`deadline` in the peer's clock); its answer (no
        body: committed). StreamError as for `append`."""
        return await self._ask(lambda request_id: encode_forward(request_id, deadline, db,
                                                                 shard, body),
                               within, f"a write forwarded to {db}/{shard}")

    async def _ask(self, message: Callable[[int], bytes], within: float,
                   what: str) -> bytes | Refused:
        """Send `message(request id)`; the answer's outcome."""
        if self.closed:
            raise StreamError(f"the stream to {self.address} is closed")
        request_id = next(self._ids) & 0xFFFFFFFF
        answered: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answered
        try:
            if self.closed:  # it ended while the future was made: no answer will come
                raise StreamError(f"the stream to {self.address} is closed")
            sent, sent_monotonic = time.time(), time.monotonic()
            await self._connection.send_bytes(message(request_id))
            answer = await asyncio.wait_for(answered, within)
            self._clocks.answered(self.address, sent, sent_monotonic, answer.peer_time,
                                  time.time(), time.monotonic())
            return answer.outcome
        except TimeoutError as exc:
            raise StreamError(f"{self.address} did not answer {what} within {within:.1f} s"
                              ) from exc
        except (ConnectionError, aiohttp.ClientError) as exc:
            raise StreamError(f"the stream to {self.address} failed: {exc!r}") from exc
        finally:
            self._waiting.pop(request_id, None)

    async def close(self) -> None:
        await self._connection.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _read(self) -> None:
        why = "closed by the peer"
        try:
            async for message in self._connection:
                if message.type != aiohttp.WSMsgType.BINARY:
                    why = f"a {message.type.name} message"
                    break
                try:
                    answer = decode_answer(message.data)
                except CorruptDataError as exc:
                    why = str(exc)
                    break
                waiting = self._waiting.pop(answer.request_id, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
            else:
                exception = self._connection.exception()
                if exception is not None:
                    why = repr(exception)
        finally:
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(StreamError(
                        f"the stream to {self.address} ended with the append in flight: "
                        f"{why}"))
            self._waiting.clear()
            if not self._connection.closed:
                await self._connection.close()


class StreamClient:
    """A site's streams, one per peer address, opened at the first append or
    forwarded write and opened again after a failure; a peer that refuses the stream
    is sent both over HTTP for a while (`FALLBACK_INTERVAL`)."""

    def __init__(self, session: aiohttp.ClientSession, clocks: ClockOffsets) -> None:
        """`clocks`: the peers' clock offsets, estimated from every answer."""
        self._session = session
        self._clocks = clocks
        self._streams: dict[str, StreamConnection] = {}
        self._opening: dict[str, asyncio.Future[StreamConnection]] = {}
        self._http_until: dict[str, float] = {}

    def speaks_stream(self, address: str) -> bool:
        return time.monotonic() >= self._http_until.get(address, 0.0)

    async def append(self, address: str, db: str, shard: int, body: bytes, within: float
                     ) -> bytes | Refused:
        """The answer of the site at `address` to an append. StreamUnavailable when it
        does not speak the stream, StreamError when it cannot be reached or does not
        answer within `within` seconds."""
        stream = await self._stream(address, within)
        return await stream.append(db, shard, body, within)

    async def forward(self, address: str, db: str, shard: int, body: bytes,
                      deadline: float, within: float) -> bytes | Refused:
        """The answer of the shard's leader at `address` to a forwarded write
        (`deadline` in its clock). StreamUnavailable when it does not take forwarded
        writes on the stream (it speaks v1), StreamError as for `append`."""
        stream = await self._stream(address, within)
        if stream.protocol != PROTOCOL:
            raise StreamUnavailable(f"{address} speaks {stream.protocol}: forwarded writes "
                                    f"go over HTTP")
        return await stream.forward(db, shard, body, deadline, within)

    async def close(self) -> None:
        for opening in self._opening.values():
            opening.cancel()
        for stream in list(self._streams.values()):
            await stream.close()
        self._streams.clear()

    async def _stream(self, address: str, within: float) -> StreamConnection:
        stream = self._streams.get(address)
        if stream is not None and not stream.closed:
            return stream
        # One handshake per peer at a time: the shards' senders that find no stream
        # wait for the same one.
        opening = self._opening.get(address)
        if opening is None:
            opening = asyncio.ensure_future(self._open(address, within))
            self._opening[address] = opening
            opening.add_done_callback(lambda _: self._opening.pop(address, None))
        return await asyncio.shield(opening)

    async def _open(self, address: str, within: float) -> StreamConnection:
        try:
            connection = await asyncio.wait_for(self._session.ws_connect(
                f"http://{address}{PATH}", protocols=PROTOCOLS, heartbeat=STREAM_HEARTBEAT,
                max_msg_size=MAX_MESSAGE_BYTES,
                timeout=aiohttp.ClientWSTimeout(ws_close=within)), within)
        except aiohttp.WSServerHandshakeError as exc:
            self._http_until[address] = time.monotonic() + FALLBACK_INTERVAL
            raise StreamUnavailable(f"{address} does not speak the peer stream "
                                    f"({exc.status})") from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise StreamError(f"{address} did not open a peer stream: {exc!r}") from exc
        if connection.protocol not in PROTOCOLS:
            await connection.close()
            self._http_until[address] = time.monotonic() + FALLBACK_INTERVAL
            raise StreamUnavailable(f"{address} speaks {connection.protocol!r} on the peer "
                                    f"stream, not {' or '.join(PROTOCOLS)}")
        stream = StreamConnection(address, connection, self._clocks)
        self._streams[address] = stream
        return stream
