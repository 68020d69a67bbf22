"""Listeners: MQTT over TCP and TLS (asyncio streams) and over WebSocket (aiohttp).
Each accepted connection becomes a `Connection` fed with the bytes it receives."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import WSMsgType, web

from ..channel.channel import Channel as Connection
from ..metrics import CONNECTIONS

log = logging.getLogger(__name__)

READ_CHUNK = 256 * 1024

ConnectionFactory = Callable[["_StreamTransport | _WebSocketTransport", str, str], Connection]


class _StreamTransport:
    """Packets written during one turn of the event loop leave in one `send()`: a
    PUBACK per message would otherwise cost a system call each."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._corked: list[bytes] = []
        self._corked_bytes = 0

    def write(self, data: bytes) -> None:
        if self._writer.is_closing():
            return
        if not self._corked:
            asyncio.get_running_loop().call_soon(self._flush)
        self._corked.append(data)
        self._corked_bytes += len(data)

    def _flush(self) -> None:
        if self._corked and not self._writer.is_closing():
            self._writer.write(b"".join(self._corked))
        self._corked.clear()
        self._corked_bytes = 0

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def buffered(self) -> int:
        return self._writer.transport.get_write_buffer_size() + self._corked_bytes


class _WebSocketTransport:
    def __init__(self, socket: web.WebSocketResponse) -> None:
        self._socket = socket
        self._sending: set[asyncio.Future[object]] = set()

    def write(self, data: bytes) -> None:
        if not self._socket.closed:
            # send_bytes is a coroutine only for flow control; frames keep their order
            self._track(asyncio.ensure_future(self._send(data)))

    async def _send(self, data: bytes) -> None:
        await self._socket.send_bytes(data)

    async def _close(self) -> None:
        await self._socket.close()

    def close(self) -> None:
        self._track(asyncio.ensure_future(self._close()))

    def _track(self, task: asyncio.Future[object]) -> None:
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Future[object]) -> None:
        self._sending.discard(task)
        if not task.cancelled():
            task.exception()  # a closed socket is not an error worth logging

    def buffered(self) -> int:
        transport = self._socket._writer.transport if self._socket._writer else None
        return transport.get_write_buffer_size() if transport is not None else 0


@dataclass
class ListenerSet:
    """The running listeners of a site; `close()` stops them and their connections."""

    servers: list[asyncio.Server]
    web_runners: list[web.AppRunner]
    connections: set[Connection]
    ports: dict[str, int]

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.connections):
            await connection.kick(0x8B)  # Server shutting down
        for server in self.servers:
            await server.wait_closed()
        for runner in self.web_runners:
            await runner.cleanup()


def _format_peer(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


def _split_bind(bind: str) -> tuple[str, int]:
    host, _, port = bind.rpartition(":")
    return host or "0.0.0.0", int(port)


async def start_stream_listener(name: str, bind: str, make: ConnectionFactory,
                                connections: set[Connection], max_connections: int,
                                ssl_context: ssl.SSLContext | None = None) -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _format_peer(writer.get_extra_info("peername"))
        if len(connections) >= max_connections:
            writer.close()  # over the limit: refused before a byte is read
            return
        connection = make(_StreamTransport(writer), name, peer)
        connections.add(connection)
        CONNECTIONS.labels(name).inc()
        try:
            await connection.run(lambda: reader.read(READ_CHUNK))
        finally:
            connections.discard(connection)
            CONNECTIONS.labels(name).dec()
            writer.close()

    host, port = _split_bind(bind)
    server = await asyncio.start_server(serve, host, port, ssl=ssl_context,
                                        limit=READ_CHUNK, reuse_address=True)
    log.info("listening for MQTT%s on %s", "/TLS" if ssl_context else "", bind)
    return server


async def start_websocket_listener(bind: str, path: str, make: ConnectionFactory,
                                   connections: set[Connection],
                                   max_connections: int) -> web.AppRunner:
    async def handle(request: web.Request) -> web.StreamResponse:
        if len(connections) >= max_connections:
            raise web.HTTPServiceUnavailable(text="too many connections")
        socket = web.WebSocketResponse(protocols=("mqtt", "mqttv3.1"), max_msg_size=0)
        await socket.prepare(request)
        connection = make(_WebSocketTransport(socket), "ws", str(request.remote))
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
    host, port = _split_bind(bind)
    await web.TCPSite(runner, host, port).start()
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
