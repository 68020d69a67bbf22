"""The operator's /metrics port is guarded as the sites' listeners are
(operator/metrics.py, broker/http/guard.py): connections that send nothing cannot
take it. prometheus_client's threaded server, which served it before, gave every
connection a thread and never closed one: 1,026 idle connections held 1,022 threads
and /metrics answered nobody.

In-process on a free port: the listener is the one the operator starts at its
startup (handlers.configure)."""

from __future__ import annotations

import asyncio
import socket
import time

from harness.processes import free_port
from stratamq.operator import metrics

IDLE = 300


def ended(connection: socket.socket) -> bool:
    """Whether the other side closed `connection` (non-blocking, sent nothing)."""
    try:
        return connection.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def _flood_then_scrape(port: int) -> tuple[int, bytes, float, int]:
    listener = await metrics.serve(f"127.0.0.1:{port}")
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):
            connection = socket.create_connection(("127.0.0.1", port))
            connection.setblocking(False)
            idle.append(connection)
            await asyncio.sleep(0)  # let the listener accept it
        await asyncio.sleep(0.5)
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=5)
        took = time.monotonic() - started
        writer.close()
        status = int(answer.split(b" ", 2)[1])
        # The idle ones the listener closed to make room read as ended.
        return status, answer, took, sum(ended(connection) for connection in idle)
    finally:
        for connection in idle:
            connection.close()
        await listener.stop()


def test_idle_connections_do_not_take_the_metrics_port() -> None:
    status, answer, took, closed = asyncio.run(_flood_then_scrape(free_port()))
    assert status == 200, answer[:500]
    assert b"stratamq_operator_reconciles_total" in answer
    assert took < 2.0, took
    # At most MAX_CONNECTIONS held: the others were closed to make room.
    assert closed >= IDLE - metrics.MAX_CONNECTIONS, closed
    assert b'stratamq_http_connections_evicted_total{listener="operator"}' in answer
