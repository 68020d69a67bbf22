"""Log shipping over the peer port: real aiohttp servers on loopback, real shard logs.
(Running sites: test_replication_site.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from harness.processes import HOST, free_port
from stratamq.broker.ds.replication import Leadership, Position, ShardLog, StaleEpochError, wire
from stratamq.broker.ds.replication.leader import AppendRequest
from stratamq.broker.ds.replication.peer import PeerClient, PeerError, PeerServer


def content(log: ShardLog) -> list[tuple[Position, bytes]]:
    return [(entry.position, entry.batch) for entry in log.read(1, 10_000)]


def test_a_leader_ships_its_log_to_followers_over_the_peer_port(tmp_path: Path) -> None:
    async def scenario() -> None:
        executor = ThreadPoolExecutor(2)
        logs = {site: ShardLog(tmp_path / site) for site in ("a", "b", "c")}
        servers: dict[str, PeerServer] = {}
        addresses: dict[str, str] = {}
        def logs_of(site: str) -> Callable[[str, int], ShardLog]:
            return lambda db, shard: {("messages", 3): logs[site]}[(db, shard)]

        for site in ("b", "c"):
            servers[site] = PeerServer(logs_of(site), executor)
            port = free_port()
            await servers[site].start(HOST, port)
            addresses[site] = f"{HOST}:{port}"
        leadership = Leadership.begin("a", 1, logs["a"], ("a", "b", "c"))
        try:
            async with aiohttp.ClientSession() as session:
                client = PeerClient(session, timeout=2)

                async def ship(follower: str) -> None:
                    for _ in range(5):
                        request = leadership.request_for(follower)
                        leadership.on_result(follower, await client.append(
                            addresses[follower], "messages", 3, request))

                leadership.append([b"x" * 1000, b"y"])
                assert leadership.committed == 0
                await ship("b")
                assert leadership.committed == 2  # a and b: a majority
                await servers["c"].stop()  # c is gone: the majority goes on
                leadership.append([b"z"])
                with pytest.raises(PeerError):
                    await client.append(addresses["c"], "messages", 3,
                                        leadership.request_for("c"))
                await ship("b")
                assert leadership.committed == 3
                assert content(logs["b"]) == content(logs["a"])

                # b learns of a newer leader: the old one is refused and steps down
                logs["b"].observe_epoch(2)
                leadership.append([b"late"])
                with pytest.raises(StaleEpochError):
                    await client.append(addresses["b"], "messages", 3,
                                        leadership.request_for("b"))
                assert leadership.committed == 3

                with pytest.raises(PeerError, match="404"):
                    await client.append(addresses["b"], "messages", 9,
                                        leadership.request_for("b"))
                async with session.post(f"http://{addresses['b']}/peer/v1/logs/messages/3/"
                                        "append", data=b"\x01garbage") as response:
                    assert response.status == 400
                    assert (await response.json())["error"] == "bad_request"
        finally:
            for server in servers.values():
                await server.stop()
            executor.shutdown()
            for log in logs.values():
                log.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("body", [
    b"",  # cut off
    bytes([wire.VERSION + 1]) + bytes(wire._RESULT.size - 1),  # another protocol version
], ids=["truncated", "other-version"])
def test_an_unreadable_append_answer_is_a_peer_error_the_sender_retries(body: bytes) -> None:
    """A follower answering 200 with what is no append result (another version of the
    peer protocol, a body cut off) is an error to retry like a refusal, not one that
    ends the leader's sender for that follower (it raised CorruptDataError, which the
    sender does not catch: that follower got no append again while the leadership
    lasted)."""
    async def scenario() -> None:
        async def answer(_request: web.Request) -> web.Response:
            return web.Response(body=body, content_type="application/octet-stream")
        app = web.Application()
        app.router.add_post("/peer/v1/logs/{db}/{shard}/append", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, HOST, port).start()
        try:
            async with aiohttp.ClientSession() as session:
                client = PeerClient(session, timeout=2)
                request = AppendRequest(1, Position(0, 0), [], 0, 0)
                with pytest.raises(PeerError, match="answered an append"):
                    await client.append(f"{HOST}:{port}", "messages", 3, request)
        finally:
            await runner.cleanup()
    asyncio.run(scenario())
