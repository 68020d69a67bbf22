"""The read loop of one client connection: bytes in, packets out to a handler, with
the read deadline the handler asks for (connect timeout, keep alive)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

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


async def read_packets(read: Callable[[], Awaitable[bytes]], reader: PacketReader,
                       handler: PacketHandler) -> None:
    """Feed the handler until the peer closes or the handler is closing; raises
    ConnectionClosed, codec errors and the transport's errors."""
    while not handler.closing:
        try:
            # asyncio.timeout, not wait_for: no task per read
            async with asyncio.timeout(handler.read_timeout()):
                data = await read()
        except TimeoutError:
            handler.on_read_timeout()
            raise ConnectionClosed() from None
        if not data:
            raise ConnectionClosed()
        BYTES_RECEIVED.inc(len(data))
        for packet in reader.feed(data):
            packets_received(type(packet).__name__).inc()
            pending = handler.handle(packet)
            if pending is not None:
                await pending
