"""The guard of an HTTP listener (the admin port, the peer port, the cluster
controller's API): whoever reaches the port cannot hold its file descriptors.

aiohttp's server has neither a connection limit nor a header timeout (its keep-alive
timer starts only after a response), so a connection that sent nothing, or half a
request, held a file descriptor for ever, and a few thousand of them took all of the
process's: then it accepted no connection (MQTT's neither) and opened none (its
peers', its files). The guard adds both:

- at most `max_connections` at once. When full, the connection that has waited
  longest for its first request is closed to make room, so that connections which
  send nothing cannot lock a listener's real clients out (they send their request
  as soon as they have connected); only when none waits for a first request is the
  new one answered 503 and closed;
- a connection must deliver its first request's headers within `header_timeout` of
  its accept, and the next request's within `keepalive_timeout` of the previous
  response, else it is closed: a sweep over the server's connections, marked busy by
  a middleware from the moment a request's headers are in until its handler returns.

A request's body is bounded elsewhere (the admin API: `admin.middleware.json_value`).
Every counter has a `listener` label: `admin`, `peer`, `controller` or `operator` (the
operator's `/metrics`)."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from prometheus_client import Counter

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# A client sends its request headers as soon as it has connected.
HEADER_TIMEOUT = 10.0
# Between requests a kept-alive connection waits aiohttp's own default (75 s): longer
# than an aiohttp client keeps an idle pooled connection (15 s), so the client
# closes it first and never sends a request on a connection the server is closing
# (aiohttp resends no POST on a pooled connection found closed).
KEEPALIVE_TIMEOUT = 75.0
# Connections queued by the kernel before the listener accepts them.
BACKLOG = 128

REFUSED = Counter("stratamq_http_connections_refused_total",
                  "HTTP connections answered 503 at accept: the listener held its most "
                  "connections, none waiting for a first request", ["listener"])
EVICTED = Counter("stratamq_http_connections_evicted_total",
                  "HTTP connections closed to make room for a new one: the listener held "
                  "its most connections and this one had waited longest for its first "
                  "request", ["listener"])
TIMED_OUT = Counter("stratamq_http_connections_timed_out_total",
                    "HTTP connections closed for not sending their request headers in time "
                    "(header timeout, keep-alive timeout)", ["listener"])
BAD_REQUESTS = Counter("stratamq_http_bad_requests_total",
                       "HTTP requests refused as malformed", ["listener"])

_FULL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
         b"Content-Length: 29\r\nConnection: close\r\n\r\n"
         b"too many connections, retry\r\n")


def descriptor_share(most: int) -> int:
    """`most`, or a quarter of this process's file descriptors (`ulimit -n`) when that
    is fewer: one listener never holds so many that the process cannot open its files
    and its other connections."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(1, min(most, soft // 4))


class _Refusal(asyncio.Protocol):
    """Answers 503 and closes: the listener is full."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio's classes).
        cast(asyncio.WriteTransport, transport).write(_FULL)
        transport.close()


class ConnectionGuard:
    """The protocol factory of a listener (`protocol`), its middleware (`middleware`,
    first of the app's), the logger of its server (`logger`) and the sweep that
    closes connections whose headers are late."""

    def __init__(self, listener: str, max_connections: int, header_timeout: float,
                 keepalive_timeout: float | None = None) -> None:
        self.listener = listener
        self.logger = _http_logger(listener)
        self._server: web.Server | None = None
        self._max_connections = max_connections
        self._header_timeout = header_timeout
        self.keepalive_timeout = (header_timeout if keepalive_timeout is None
                                   else keepalive_timeout)
        # A connection -> when its first request's headers are due (in accept order:
        # the first waited longest); its next request's (kept alive); absent: busy.
        self._unused: dict[RequestHandler, float] = {}
        self._idle: dict[RequestHandler, float] = {}
        self._refused = REFUSED.labels(listener)
        self._evicted = EVICTED.labels(listener)
        self._timed_out = TIMED_OUT.labels(listener)
        self._sweeper: asyncio.Task[None] | None = None

    def start(self, server: web.Server) -> None:
        """Guard the connections of `server` (an AppRunner's, once set up)."""
        self._server = server
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

    def protocol(self) -> asyncio.BaseProtocol:
        """A new connection's protocol: aiohttp's handler, or a refusal when full."""
        assert self._server is not None, "ConnectionGuard.start first"
        # Those accepted but not connected yet are not counted: a burst of accepts
        # overshoots by at most the backlog.
        full = len(self._server.connections) >= self._max_connections
        if full and not self._evict():
            self._refused.inc()
            return _Refusal()
        handler = self._server()
        self._unused[handler] = time.monotonic() + self._header_timeout
        return handler

    def _evict(self) -> bool:
        """Close the connection that has waited longest for its first request; False
        when none does. Those closed meanwhile (not connected a second after their
        accept) are forgotten on the way."""
        closed_if_before = time.monotonic() + self._header_timeout - 1.0
        closed: list[RequestHandler] = []
        oldest = None
        for connection, due in self._unused.items():
            if connection.connected:
                oldest = connection
                break
            if due < closed_if_before:
                closed.append(connection)
        for connection in closed:
            del self._unused[connection]
        if oldest is None:
            return False
        del self._unused[oldest]
        self._evicted.inc()
        oldest.force_close()
        return True

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        connection = request.protocol
        self._unused.pop(connection, None)
        self._idle.pop(connection, None)
        try:
            return await handler(request)
        finally:
            self._idle[connection] = time.monotonic() + self.keepalive_timeout

    async def _sweep_forever(self) -> None:
        period = min(1.0, self._header_timeout / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()

    def sweep(self) -> None:
        now = time.monotonic()
        for waiting in (self._unused, self._idle):
            late = [connection for connection, due in waiting.items() if due < now]
            for connection in late:
                del waiting[connection]
                if connection.connected:  # else closed already: forgotten
                    self._timed_out.inc()
                    connection.force_close()


class GuardedListener:
    """An aiohttp application served through a `ConnectionGuard` (not `web.TCPSite`:
    the guard's protocol factory counts, evicts and refuses)."""

    def __init__(self, app: web.Application, guard: ConnectionGuard,
                 **runner_options: Any) -> None:
        """`app` has `guard.middleware` first; `runner_options` go to its AppRunner."""
        self.guard = guard
        self._runner = web.AppRunner(app, access_log=None, logger=guard.logger,
                                     keepalive_timeout=guard.keepalive_timeout,
                                     **runner_options)
        self._listener: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        await self._runner.setup()
        assert self._runner.server is not None
        self.guard.start(self._runner.server)
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self.guard.protocol, host, port, reuse_address=True, backlog=BACKLOG)
        except BaseException:
            await self.guard.stop()
            await self._runner.cleanup()
            raise
        self.port = int(self._listener.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self.guard.stop()
        await self._runner.cleanup()


class _BadRequests(logging.Filter):
    """aiohttp logs each malformed request with a traceback: counted and logged here
    as one line at debug level instead (anyone may send them)."""

    def __init__(self, listener: str) -> None:
        super().__init__()
        self._listener = listener
        self._counter = BAD_REQUESTS.labels(listener)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        self._counter.inc()
        reason = str(error.message).splitlines()[0] if error.message else type(error).__name__
        log.debug("bad HTTP request on the %s listener (%s %s)", self._listener, error.code,
                  reason[:200])
        return False


def _http_logger(listener: str) -> logging.Logger:
    """The logger the request handlers of `listener` log through."""
    logger = logging.getLogger(f"stratamq.broker.http.{listener}")
    if not any(isinstance(found, _BadRequests) for found in logger.filters):
        logger.addFilter(_BadRequests(listener))
    return logger
