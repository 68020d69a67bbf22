"""broker/net/socket_reader.py over real loopback sockets: what arrives is read in
order, the end of the connection is told, and a reader that falls behind stops the
socket being read until it catches up. On asyncio's own loop and on uvloop (the
site's), whose transports are not asyncio.Transport subclasses."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from stratamq.broker.net.socket_reader import Serve, SocketReader

Run = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    return asyncio.run if request.param == "asyncio" else uvloop.run


async def _serve_one(serve: Serve, pause_above: int) -> tuple[asyncio.Server, int]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: SocketReader(serve, pause_above),
                                      "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_reads_what_arrives_in_order_then_the_end(run: Run) -> None:
    async def scenario() -> None:
        received: list[bytes] = []
        done = asyncio.get_running_loop().create_future()

        async def serve(reader: SocketReader) -> None:
            while data := await reader.read():
                received.append(data)
            done.set_result(None)
        server, port = await _serve_one(serve, 1 << 20)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for part in (b"one ", b"two ", b"three"):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()
        await asyncio.wait_for(done, 5)
        assert b"".join(received) == b"one two three"
        server.close()
    run(scenario())


def test_a_reset_connection_raises_its_error(run: Run) -> None:
    async def scenario() -> None:
        outcome = asyncio.get_running_loop().create_future()

        async def serve(reader: SocketReader) -> None:
            try:
                while await reader.read():
                    pass
                outcome.set_result("end")
            except ConnectionError as error:
                outcome.set_result(type(error).__name__)
        server, port = await _serve_one(serve, 1 << 20)
        client = socket.create_connection(("127.0.0.1", port))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.sendall(b"x")
        await asyncio.sleep(0.05)
        client.close()  # linger 0: RST
        assert await asyncio.wait_for(outcome, 5) == "ConnectionResetError"
        server.close()
    run(scenario())


def test_reading_pauses_past_the_limit_and_resumes_once_read(run: Run) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        reader_ready: asyncio.Future[SocketReader] = loop.create_future()
        read_total: asyncio.Future[int] = loop.create_future()
        release = asyncio.Event()

        async def serve(reader: SocketReader) -> None:
            reader_ready.set_result(reader)
            await release.wait()
            total = 0
            while data := await reader.read():
                total += len(data)
            read_total.set_result(total)
        server, port = await _serve_one(serve, 64 * 1024)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        reader = await reader_ready
        sent = 0
        chunk = b"x" * 65536
        for _ in range(64):  # 4 MB: far more than the socket buffers hold
            writer.write(chunk)
            sent += len(chunk)
        await asyncio.sleep(0.3)
        assert reader._paused
        assert reader._size < 2 * 64 * 1024 + 1024 * 1024  # one recv past the limit
        release.set()
        await writer.drain()
        writer.close()
        assert await asyncio.wait_for(read_total, 10) == sent
        server.close()
    run(scenario())
