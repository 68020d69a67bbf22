"""`SocketReader`: the receiving side of one client socket for the read loop, an
asyncio protocol whose `read()` hands over what has arrived.

It stands where asyncio's streams stood (`start_server`'s StreamReader, its protocol
and a StreamWriter): those make, for every connection, a writer nobody here uses,
a deque of drain waiters (a block of 64 slots, ~760 bytes) and more, about 2 KB per
idle connection by tracemalloc (bench/conn_memory.py --trace). Writes go straight to
the transport (net/transport.py), which needs no drain: flow control reads its
buffered size instead."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, cast

Serve = Callable[["SocketReader"], Coroutine[Any, Any, None]]


class SocketReader(asyncio.Protocol):
    """Bytes received and not read yet are kept until `read()`; past `pause_above`
    of them the socket is not read until they are (as a StreamReader with a limit
    does), so a client that sends faster than its packets are handled waits."""

    # one per connection: no __dict__ each
    __slots__ = ("_chunks", "_eof", "_error", "_pause_above", "_paused", "_serve", "_size",
                 "_task", "_waiter", "transport")

    def __init__(self, serve: Serve, pause_above: int) -> None:
        self._serve = serve
        self._pause_above = pause_above
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._task: asyncio.Task[None] | None = None  # held here: asyncio keeps it weakly
        self.transport: asyncio.Transport | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a uvloop transport (the site's loop) is one without being a subclass
        self.transport = cast(asyncio.Transport, transport)
        self._task = asyncio.get_running_loop().create_task(self._serve(self))
        self._task.add_done_callback(self._served)

    def data_received(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > self._pause_above and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # the transport closes itself: MQTT has no half-closed connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if exc is not None:
            self._error = exc
        self._wake()

    # -- for the read loop ---------------------------------------------------------------

    async def read(self) -> bytes:
        """What has arrived since the last read, waiting for something if nothing has;
        b"" once the peer has closed; raises the error that ended the connection."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error  # as a StreamReader: the error before what is buffered
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _served(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if self.transport is not None:
            self.transport.close()
        if not task.cancelled() and task.exception() is not None:
            asyncio.get_running_loop().call_exception_handler({
                "message": "a client connection's task failed",
                "exception": task.exception(), "protocol": self})
