"""What a connection writes to: the byte sink of one client socket, with the write
buffering that keeps system calls few and the buffered size that flow control reads."""

from __future__ import annotations

import asyncio
from typing import Protocol

from aiohttp import web


class Transport(Protocol):
    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def buffered(self) -> int:
        """Bytes written but not yet sent (for slow-consumer protection)."""
        ...


class StreamTransport:
    """Packets written during one turn of the event loop leave in one `send()`: a
    PUBACK per message would otherwise cost a system call each."""

    __slots__ = ("_corked", "_corked_bytes", "_writer")  # one per connection

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._writer = transport  # the socket's own transport: no StreamWriter
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
        return self._writer.get_write_buffer_size() + self._corked_bytes


class WebSocketTransport:
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
