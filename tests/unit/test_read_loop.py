"""broker/net/read_loop.py: what the read loop keeps while it waits for the next read."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable

from stratamq.broker.deadlines import Deadlines
from stratamq.broker.mqtt import Packet, PacketReader
from stratamq.broker.net.read_loop import read_packets

# MQTT 3.1.1 CONNECT, clean session, keep alive 60, client id "a"
CONNECT = b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01a"


class Handler:
    closing = False

    def __init__(self) -> None:
        self.handled: list[Packet] = []

    def read_timeout(self) -> float | None:
        return None

    def on_read_timeout(self) -> None:
        raise AssertionError("no timeout here")

    def handle(self, packet: Packet) -> Awaitable[None] | None:
        self.handled.append(packet)
        return None


def test_an_idle_connection_keeps_neither_its_last_packet_nor_its_bytes() -> None:
    async def scenario() -> None:
        reads = [CONNECT]
        idle = asyncio.get_running_loop().create_future()

        async def read() -> bytes:
            return reads.pop() if reads else await idle

        handler = Handler()
        loop_task = asyncio.create_task(read_packets(read, PacketReader(1 << 20), handler,
                                                     Deadlines()))
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(handler.handled) == 1
        gc.collect()
        # only the handler's list: the loop's frame, waiting for the next read, holds
        # neither the packet nor the list it came in
        assert gc.get_referrers(handler.handled[0]) == [handler.handled]
        loop_task.cancel()
    asyncio.run(scenario())


class KeepAliveHandler(Handler):
    def read_timeout(self) -> float | None:
        return 90.0  # keep alive 60 s


def test_idle_connections_share_one_timer_for_their_keep_alive() -> None:
    """Issue 25: a timer of its own (TimerHandle, bound method, context) held 0.6 KB of
    an idle connection; the site's Deadlines has one for them all."""
    async def scenario() -> None:
        idle: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def read() -> bytes:
            return await idle

        def timers() -> int:
            gc.collect()
            return sum(isinstance(found, asyncio.TimerHandle) for found in gc.get_objects())

        before = timers()
        deadlines = Deadlines()
        loops = [asyncio.create_task(read_packets(read, PacketReader(1 << 20),
                                                  KeepAliveHandler(), deadlines))
                 for _ in range(50)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(deadlines) == 50
        assert timers() - before <= 1
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        assert len(deadlines) == 0
    asyncio.run(scenario())
