"""Listeners: MQTT over TCP and TLS (an asyncio protocol, net/socket_reader.py) and
over WebSocket (aiohttp). Each accepted connection becomes an `Endpoint` (made by the
caller) fed with the bytes it receives."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Protocol, TypeVar

from aiohttp import WSMsgType, web

from ..metrics import CONNECTIONS
from ..mqtt import ReasonCode
from .address import format_peer, listening, split_bind
from .socket_reader import SocketReader
from .transport import StreamTransport, Transport, WebSocketTransport

log = logging.getLogger(__name__)

READ_CHUNK = 256 * 1024


class Endpoint(Protocol):
    """What a listener needs of the connection it feeds."""

    async def run(self, read: Callable[[], Awaitable[bytes]]) -> None:
        """Serve the connection until it ends; never raises."""
        ...

    async def kick(self, reason_code: int) -> None:
        """Close the connection and wait until it has ended."""
        ...


EndpointT = TypeVar("EndpointT", bound=Endpoint)


@dataclass
class ListenerSet:
    """The running listeners of a site; `close()` stops them and their connections."""

    servers: list[asyncio.Server]
    web_runners: list[web.AppRunner]
    connections: Collection[Endpoint]
    ports: dict[str, int]

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.connections):
            await connection.kick(ReasonCode.SERVER_SHUTTING_DOWN)
        for server in self.servers:
            await server.wait_closed()
        for runner in self.web_runners:
            await runner.cleanup()


async def start_stream_listener(name: str, bind: str,
                                make: Callable[[Transport, str, str], EndpointT],
                                connections: set[EndpointT], max_connections: int,
                                ssl_context: ssl.SSLContext | None = None,
                                backlog: int = 4096) -> asyncio.Server:
    async def serve(socket: SocketReader) -> None:
        transport = socket.transport
        assert transport is not None
        peer = format_peer(transport.get_extra_info("peername"))
        if len(connections) >= max_connections:
            transport.close()  # over the limit: refused before a byte is read
            return
        connection = make(StreamTransport(transport), name, peer)
        connections.add(connection)
        CONNECTIONS.labels(name).inc()
        try:
            await connection.run(socket.read)
        finally:
            connections.discard(connection)
            CONNECTIONS.labels(name).dec()
            transport.close()

    host, port = split_bind(bind)
    loop = asyncio.get_running_loop()
    with listening(f"listeners.{name}.bind", bind):
        # past twice the chunk unread the socket waits, as asyncio's streams did
        server = await loop.create_server(lambda: SocketReader(serve, 2 * READ_CHUNK),
                                          host, port, ssl=ssl_context,
                                          reuse_address=True, backlog=backlog)
    log.info("listening for MQTT%s on %s", "/TLS" if ssl_context else "", bind)
    return server


async def start_websocket_listener(bind: str, path: str,
                                   make: Callable[[Transport, str, str], EndpointT],
                                   connections: set[EndpointT],
                                   max_connections: int, max_packet_size: int,
                                   backlog: int = 4096) -> web.AppRunner:
    async def handle(request: web.Request) -> web.StreamResponse:
        if len(connections) >= max_connections:
            raise web.HTTPServiceUnavailable(text="too many connections")
        # A frame carries at most one packet's worth: aiohttp refuses a frame as soon
        # as its header announces a length >= max_msg_size, before buffering it.
        socket = web.WebSocketResponse(protocols=("mqtt", "mqttv3.1"),
                                       max_msg_size=max_packet_size + 1)
        await socket.prepare(request)
        connection = make(WebSocketTransport(socket), "ws", str(request.remote))
        connections.add(connection)
        CONNECTIONS.labels("ws").inc()
        frames = socket.__aiter__()

        async def read() -> bytes:
            while True:
                try:
                    message = await frames.__anext__()
                except StopAsyncIteration:
                    return b""
                if message.type == WSMsgType.BINARY:
                    return bytes(message.data)
                if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.ERROR):
                    return b""
                if message.type == WSMsgType.TEXT:
                    return b""  # MQTT over WebSocket is binary frames only

        try:
            await connection.run(read)
        finally:
            connections.discard(connection)
            CONNECTIONS.labels("ws").dec()
            await socket.close()
        return socket

    app = web.Application()
    app.router.add_get(path, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = split_bind(bind)
    try:
        with listening("listeners.ws.bind", bind):
            await web.TCPSite(runner, host, port, backlog=backlog).start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("listening for MQTT over WebSocket on %s%s", bind, path)
    return runner


def tls_context(certfile: str, keyfile: str, cafile: str | None,
                require_client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    if cafile:
        context.load_verify_locations(cafile)
    context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
    return context
