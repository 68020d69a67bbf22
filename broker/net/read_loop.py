"""The read loop of one client connection: bytes in, packets out to a handler, with
the read deadline the handler asks for (connect timeout, keep alive), measured from
the last whole packet (or the accept), not from the last byte."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..deadlines import Deadlines
from ..metrics import BYTES_RECEIVED, packets_received
from ..mqtt import Packet, PacketReader


class ConnectionClosed(Exception):
    """Raised to end a connection (after any DISCONNECT is sent)."""


class PacketHandler(Protocol):
    """What the read loop needs of the protocol side of a connection."""

    @property
    def closing(self) -> bool: ...

    def read_timeout(self) -> float | None:
        """Seconds the next read may take; None for no limit."""
        ...

    def on_read_timeout(self) -> None: ...

    def handle(self, packet: Packet) -> Awaitable[None] | None:
        """Act on a packet; an awaitable when it must finish before the next one."""
        ...


class ReadDeadline:
    """The handler's read timeout, measured from real progress: from the connection's
    accept until the first whole packet (the connect timeout), then from the last
    whole packet handled (keep alive). Bytes that do not finish a packet move nothing,
    so a peer trickling a byte now and then is closed at the timeout all the same.

    Armed once per timeout period instead of once per read (a busy connection reads
    thousands of times a second), on the site's one timer for every connection's
    deadline (`Deadlines`: a timer of its own held 0.6 KB). A read under
    way when the deadline passes is cancelled (as asyncio.timeout does), and `expired`
    tells why. While the handler works on a packet nothing is read and the deadline
    waits: the time the broker takes is not the peer's."""

    __slots__ = ("_deadlines", "_handler", "_loop", "_progress_at", "_reading", "_task",
                 "_tick", "_timeout", "expired")  # one per connection

    def __init__(self, handler: PacketHandler, deadlines: Deadlines) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None, "read_packets runs in a task"
        self._task = task
        self._handler = handler
        self._deadlines = deadlines
        self._tick: int | None = None  # while armed: its tick in `deadlines`
        self._timeout: float | None = None
        self._progress_at = self._loop.time()  # the accept, then the last whole packet
        self._reading = False
        self.expired = False

    def reading(self) -> None:
        self._reading = True
        timeout = self._handler.read_timeout()
        if timeout != self._timeout:  # CONNECT moves from connect timeout to keep alive
            self._timeout = timeout
            self.stop()
        if self._tick is None and timeout is not None:
            self._tick = self._deadlines.add(self, self._progress_at + timeout)

    def read(self) -> None:
        self._reading = False

    def progressed(self) -> None:
        """Whole packets were received and handled: the timeout starts again."""
        self._progress_at = self._loop.time()

    def cancelled_the_read(self) -> bool:
        """Whether the CancelledError a read raised came from this deadline alone (not
        also from someone stopping the connection)."""
        return self.expired and self._task.uncancel() == 0

    def stop(self) -> None:
        if self._tick is not None:
            self._deadlines.discard(self, self._tick)
            self._tick = None

    def expire(self) -> None:
        """Called back by `deadlines` at the deadline armed: the connection is closed
        unless whole packets came since."""
        self._tick = None
        if not self._reading or self._timeout is None:
            return  # not reading now: the next read arms the deadline again
        at = self._progress_at + self._timeout
        if at > self._loop.time():
            self._tick = self._deadlines.add(self, at)
            return
        self.expired = True
        self._task.cancel()


async def read_packets(read: Callable[[], Awaitable[bytes]], reader: PacketReader,
                       handler: PacketHandler, deadlines: Deadlines) -> None:
    """Hand the handler packets until the peer closes or the handler is closing; raises
    ConnectionClosed, codec errors and the transport's errors."""
    deadline = ReadDeadline(handler, deadlines)
    try:
        while not handler.closing:
            deadline.reading()
            try:
                data = await read()
            except asyncio.CancelledError:
                if deadline.cancelled_the_read():
                    handler.on_read_timeout()
                    raise ConnectionClosed() from None
                raise
            deadline.read()
            if not data:
                raise ConnectionClosed()
            BYTES_RECEIVED.inc(len(data))
            packets = reader.decode(data)
            for packet in packets:
                packets_received(type(packet).__name__).inc()
                pending = handler.handle(packet)
                if pending is not None:
                    await pending
            if packets:
                deadline.progressed()
                del packet, pending
            # not kept while the next read waits: an idle connection would hold its
            # CONNECT, with its properties and bytes, for as long as it stays
            del data, packets
    finally:
        deadline.stop()
