"""The admin listener's guard: the connections the admin port holds are bounded
apart from MQTT's, and a connection must deliver its request headers within
`header_timeout` of its accept (or of its previous response), whatever trickles in.

aiohttp's server has no header timeout (its keep-alive timer starts only after a
response), so a half-sent request held a file descriptor for ever; this module adds
one as a sweep over the server's connections, marked busy by a middleware from the
moment a request's headers are in until its response is sent. A request's body is
bounded by `middleware.json_value` (`body_timeout`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from prometheus_client import Counter

from .middleware import Handler

log = logging.getLogger(__name__)

REFUSED = Counter("stratamq_admin_connections_refused_total",
                  "Admin port connections refused because admin.max_connections were open")
TIMED_OUT = Counter("stratamq_admin_connections_timed_out_total",
                    "Admin port connections closed for not sending their request headers "
                    "within admin.header_timeout")
BAD_REQUESTS = Counter("stratamq_admin_bad_requests_total",
                       "Admin port requests refused as malformed HTTP")

_FULL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
         b"Content-Length: 35\r\nConnection: close\r\n\r\n"
         b"too many admin connections, retry\r\n")


class _Refusal(asyncio.Protocol):
    """Answers 503 and closes: the admin port is full."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio's classes).
        cast(asyncio.WriteTransport, transport).write(_FULL)
        transport.close()


class ConnectionGuard:
    """The protocol factory of the admin listener (`protocol`), its middleware
    (`middleware`) and the sweep that closes connections whose headers are late."""

    def __init__(self, max_connections: int, header_timeout: float) -> None:
        self._server: web.Server | None = None
        self._max_connections = max_connections
        self._header_timeout = header_timeout
        # A connection -> since when it waits for request headers; absent: busy.
        self._waiting: dict[RequestHandler, float] = {}
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
        # Waiting ones include those accepted but not connected yet (a burst).
        if len(self._waiting.keys() | self._server.connections) >= self._max_connections:
            REFUSED.inc()
            return _Refusal()
        handler = self._server()
        self._waiting[handler] = time.monotonic()
        return handler

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        connection = request.protocol
        self._waiting.pop(connection, None)
        try:
            return await handler(request)
        finally:
            # A keep-alive connection waits for its next request's headers from now.
            self._waiting[connection] = time.monotonic()

    async def _sweep_forever(self) -> None:
        period = min(1.0, self._header_timeout / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()

    def sweep(self) -> None:
        assert self._server is not None
        live = set(self._server.connections)
        late = time.monotonic() - self._header_timeout
        for connection, since in list(self._waiting.items()):
            if connection not in live:
                if since < late:  # closed (or never connected): forget it
                    del self._waiting[connection]
            elif since < late:
                del self._waiting[connection]
                TIMED_OUT.inc()
                connection.force_close()


class _BadRequests(logging.Filter):
    """aiohttp logs each malformed request with a traceback: counted and logged here
    as one line at debug level instead (anyone may send them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        BAD_REQUESTS.inc()
        reason = str(error.message).splitlines()[0] if error.message else type(error).__name__
        log.debug("bad HTTP request on the admin port (%s %s)", error.code, reason[:200])
        return False


# The logger aiohttp's request handlers of the admin port log through.
HTTP_LOG = logging.getLogger("stratamq.broker.admin.http")
HTTP_LOG.addFilter(_BadRequests())
