"""The peer stream (`peer_stream.py`): a leader's appends to a follower, every shard's,
on one WebSocket connection of the peer port. Real aiohttp servers on loopback, real
shard logs. (Over HTTP and in running sites: test_replication_peer.py,
test_replication_site.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from random import Random

import aiohttp
import pytest
from aiohttp import web

from harness.processes import HOST, free_port
from stratamq.broker.ds.replication import Position, ShardLog, StaleEpochError
from stratamq.broker.ds.replication.clock import ClockOffsets, Estimate
from stratamq.broker.ds.replication.leader import AppendRequest
from stratamq.broker.ds.replication.log import Entry
from stratamq.broker.ds.replication.peer import PeerClient, PeerError, PeerServer
from stratamq.broker.ds.replication.peer_stream import (
    PATH,
    PROTOCOL,
    PROTOCOL_V1,
    Answer,
    Forward,
    Refused,
    StreamClient,
    StreamError,
    StreamServer,
    StreamUnavailable,
    decode_answer,
    decode_append,
    decode_request,
    encode_append,
    encode_forward,
    encode_refusal,
    encode_result,
)

SHARDS = 4
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def no_forwards(db: str, shard: int, body: bytes, deadline: float) -> None:
    raise Refused("unknown_shard", "this test's site takes no forwarded writes")


def request_at(offset: int, epoch: int = 1) -> AppendRequest:
    """The append of entry `offset` (epoch `epoch`) after entry offset - 1."""
    return AppendRequest(epoch, Position(epoch if offset > 1 else 0, offset - 1),
                         [Entry(Position(epoch, offset), b"entry %d" % offset)], offset, 0)


def content(log: ShardLog) -> list[tuple[Position, bytes]]:
    return [(entry.position, entry.batch) for entry in log.read(1, 10_000)]


@asynccontextmanager
async def follower(tmp_path: Path, port: int | None = None
                   ) -> AsyncIterator[tuple[str, PeerServer, dict[int, ShardLog]]]:
    """A site's peer server holding SHARDS shard logs of `messages`; its address."""
    executor = ThreadPoolExecutor(2)
    logs = {shard: ShardLog(tmp_path / f"shard-{shard}") for shard in range(SHARDS)}
    server = PeerServer(lambda db, shard: {"messages": logs}[db][shard], executor)
    port = port or free_port()
    await server.start(HOST, port)
    try:
        yield f"{HOST}:{port}", server, logs
    finally:
        await server.stop()
        executor.shutdown()
        for log in logs.values():
            log.close()


@asynccontextmanager
async def app_serving(add: Callable[[web.Application], None]) -> AsyncIterator[str]:
    app = web.Application()
    add(app)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    try:
        yield f"{HOST}:{port}"
    finally:
        await runner.cleanup()


def test_messages_round_trip() -> None:
    raw = encode_append(7, "messages", 3, b"body")
    append = decode_append(raw)
    assert (append.request_id, append.db, append.shard, append.body) == (7, "messages", 3,
                                                                         b"body")
    assert decode_answer(encode_result(9, b"result", 1.5)) == Answer(9, 1.5, b"result")
    answer = decode_answer(encode_refusal(4, "stale_epoch", "épocha 3", 2.25))
    assert (answer.request_id, answer.peer_time) == (4, 2.25)
    assert isinstance(answer.outcome, Refused)
    assert (answer.outcome.code, answer.outcome.message) == ("stale_epoch", "épocha 3")
    assert decode_request(encode_forward(5, 1.25, "messages", 2, b"write")) == Forward(
        5, 1.25, "messages", 2, b"write")


def test_a_forwarded_write_goes_on_the_stream_and_is_answered_once_committed() -> None:
    """A write forwarded to a shard's leader: its deadline and body as sent; the
    answer once the leader has committed it, or its refusal (a fenced write's with the
    JSON the HTTP route answers with); appends share the connection meanwhile."""
    async def scenario() -> None:
        taken: list[tuple[str, int, bytes, float]] = []
        commit = asyncio.Event()

        async def forward(db: str, shard: int, body: bytes, deadline: float) -> None:
            if body == b"fenced":
                raise Refused("fenced", '{"error": "fenced", "keys": ["6b"]}')
            taken.append((db, shard, body, deadline))
            await commit.wait()

        async def take(db: str, shard: int, body: bytes) -> bytes:
            return b"appended"

        async with app_serving(StreamServer(take, forward).add_routes) as address, \
                aiohttp.ClientSession() as session:
            client = StreamClient(session, ClockOffsets())
            write = asyncio.ensure_future(client.forward(address, "messages", 1, b"write",
                                                         123.5, within=5))
            # the write waits for its commit; an append is answered meanwhile
            assert await client.append(address, "messages", 1, b"", within=5) == b"appended"
            assert not write.done()
            commit.set()
            assert await write == b""
            assert taken == [("messages", 1, b"write", 123.5)]
            refused = await client.forward(address, "messages", 0, b"fenced", 0.0, within=5)
            assert isinstance(refused, Refused) and refused.code == "fenced"
            await client.close()
    asyncio.run(scenario())


def test_a_site_that_speaks_stream_v1_is_sent_forwarded_writes_over_http() -> None:
    """A site of the version before forwarded writes went on the stream takes v1:
    appends go on the stream, forwarded writes are StreamUnavailable (over HTTP)."""
    async def scenario() -> None:
        async def version_1(request: web.Request) -> web.StreamResponse:
            connection = web.WebSocketResponse(protocols=(PROTOCOL_V1,))
            await connection.prepare(request)
            async for message in connection:
                append = decode_append(message.data)
                await connection.send_bytes(encode_result(append.request_id, b"v1", 0.0))
            return connection

        def routes(app: web.Application) -> None:
            app.router.add_get(PATH, version_1)

        async with app_serving(routes) as address, aiohttp.ClientSession() as session:
            client = StreamClient(session, ClockOffsets())
            assert await client.append(address, "messages", 0, b"", within=5) == b"v1"
            with pytest.raises(StreamUnavailable, match=PROTOCOL_V1):
                await client.forward(address, "messages", 0, b"", 0.0, within=5)
            assert client.speaks_stream(address)  # its appends stay on the stream
            await client.close()
    asyncio.run(scenario())


def test_every_shards_appends_share_one_connection(tmp_path: Path) -> None:
    """Appends of four shards sent at once, 25 each, each shard's one after the other
    without waiting for answers: all taken (an append overtaking its predecessor would
    be refused for the gap), on one connection."""
    async def scenario() -> None:
        async with follower(tmp_path) as (address, server, logs), \
                aiohttp.ClientSession() as session:
            client = PeerClient(session, timeout=5)
            results = await asyncio.gather(*(
                client.append(address, "messages", shard, request_at(offset))
                for offset in range(1, 26) for shard in range(SHARDS)))
            assert all(result.accepted for result in results)
            for log in logs.values():
                assert content(log) == [(Position(1, offset), b"entry %d" % offset)
                                        for offset in range(1, 26)]
            assert len(server._streams._open) == 1
            # each answer tells the follower's clock, as an HTTP answer's header did
            # (forwarded writes state their deadlines in it): the same machine's here
            [(estimated, clock)] = client.clocks.status().items()
            assert estimated == address and abs(clock["offset"]) <= clock["uncertainty"]
            await client.close()
    asyncio.run(scenario())


def test_refusals_come_back_as_the_http_route_would_say_them(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with follower(tmp_path) as (address, _server, logs), \
                aiohttp.ClientSession() as session:
            client = PeerClient(session, timeout=5)
            assert (await client.append(address, "messages", 0, request_at(1))).accepted
            logs[0].observe_epoch(2)
            with pytest.raises(StaleEpochError):
                await client.append(address, "messages", 0, request_at(2))
            with pytest.raises(PeerError, match="404 unknown_shard"):
                await client.append(address, "messages", SHARDS, request_at(1))
            with pytest.raises(PeerError, match="404 unknown_shard"):
                await client.append(address, "sessions", 0, request_at(1))
            # the connection outlives refusals
            assert (await client.append(address, "messages", 1, request_at(1))).accepted
            await client.close()
    asyncio.run(scenario())


def test_a_follower_that_does_not_speak_the_stream_is_sent_appends_over_http(
        tmp_path: Path) -> None:
    """A site of a version before the stream (no such route: the handshake gets 404),
    or one that speaks another version of it, gets its appends over HTTP."""
    async def scenario() -> None:
        async with follower(tmp_path) as (address, server, logs):
            posted: list[str] = []

            async def forward(request: web.Request) -> web.StreamResponse:
                posted.append(request.path)
                async with aiohttp.ClientSession() as session, session.post(
                        f"http://{address}{request.path}", data=await request.read()) as got:
                    return web.Response(status=got.status, body=await got.read())

            async def other_version(request: web.Request) -> web.StreamResponse:
                connection = web.WebSocketResponse(protocols=("stratamq.append.v9",))
                await connection.prepare(request)
                await connection.receive()
                return connection

            for shard, stream in enumerate((None, other_version)):
                def routes(app: web.Application, stream: Handler | None = stream) -> None:
                    app.router.add_post("/peer/v1/logs/{db}/{shard}/append", forward)
                    if stream is not None:
                        app.router.add_get(PATH, stream)
                async with app_serving(routes) as old_site, \
                        aiohttp.ClientSession() as session:
                    posted.clear()
                    client = PeerClient(session, timeout=5)
                    for offset in (1, 2):
                        assert (await client.append(old_site, "messages", shard,
                                                    request_at(offset))).accepted
                    assert posted == [f"/peer/v1/logs/messages/{shard}/append"] * 2
                    assert len(content(logs[shard])) == 2
                    await client.close()
            assert not server._streams._open
    asyncio.run(scenario())


def test_a_restarted_follower_is_reached_on_a_new_connection(tmp_path: Path) -> None:
    async def scenario() -> None:
        port = free_port()
        # the session's own total timeout does not end a stream that lives longer
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
            client = PeerClient(session, timeout=2)
            async with follower(tmp_path, port) as (address, _server, _logs):
                assert (await client.append(address, "messages", 0, request_at(1))).accepted
                await asyncio.sleep(1.5)
                assert (await client.append(address, "messages", 0, request_at(2))).accepted
            with pytest.raises(PeerError, match="did not take an append"):
                await client.append(address, "messages", 0, request_at(3))
            async with follower(tmp_path, port) as (address, _server, logs):
                assert (await client.append(address, "messages", 0, request_at(3))).accepted
                assert len(content(logs[0])) == 3
            await client.close()
    asyncio.run(scenario())


def test_each_shards_appends_are_taken_in_the_order_sent() -> None:
    """Taking an append takes a while, more for some than others; those of one shard
    are still taken one after the other, in the order sent."""
    async def scenario() -> None:
        taken: dict[int, list[bytes]] = {shard: [] for shard in range(SHARDS)}
        random = Random(7)

        async def take(db: str, shard: int, body: bytes) -> bytes:
            await asyncio.sleep(random.random() / 200)
            taken[shard].append(body)
            return body

        async with app_serving(StreamServer(take, no_forwards).add_routes) as address, \
                aiohttp.ClientSession() as session:
            client = StreamClient(session, ClockOffsets())
            await asyncio.gather(*(client.append(address, "messages", shard, b"%d" % number,
                                                 within=5)
                                   for number in range(30) for shard in range(SHARDS)))
            assert taken == {shard: [b"%d" % number for number in range(30)]
                             for shard in range(SHARDS)}
            await client.close()
    asyncio.run(scenario())


def test_an_answer_that_does_not_come_fails_the_append_not_the_connection() -> None:
    """A follower slow to answer one append: that append fails in time (the sender
    retries), and the connection serves the others meanwhile."""
    async def scenario() -> None:
        release = asyncio.Event()

        async def take(db: str, shard: int, body: bytes) -> bytes:
            if shard == 0:
                await release.wait()
            return b"taken %d" % shard

        async with app_serving(StreamServer(take, no_forwards).add_routes) as address, \
                aiohttp.ClientSession() as session:
            client = StreamClient(session, ClockOffsets())
            with pytest.raises(StreamError, match="did not answer"):
                await client.append(address, "messages", 0, b"", within=0.3)
            assert await client.append(address, "messages", 1, b"", within=2) == b"taken 1"
            release.set()
            # the late answer to the first is dropped; the next of shard 0 is answered
            assert await client.append(address, "messages", 0, b"", within=2) == b"taken 0"
            await client.close()
    asyncio.run(scenario())


def test_a_follower_reads_no_more_than_its_byte_bound_ahead() -> None:
    """Appends read and not yet answered hold the follower's memory: past
    `max_in_flight_bytes` of them it reads no more until some are answered, however
    many the leader sends; then every one is taken."""
    async def scenario() -> None:
        release, three_started = asyncio.Event(), asyncio.Event()
        started: list[int] = []

        async def take(db: str, shard: int, body: bytes) -> bytes:
            started.append(shard)
            if len(started) == 3:
                three_started.set()
            await release.wait()
            return b"taken"

        server = StreamServer(take, no_forwards, max_in_flight_bytes=1_000_000)
        async with app_serving(server.add_routes) as address, \
                aiohttp.ClientSession() as session:
            client = StreamClient(session, ClockOffsets())
            # ten appends of ~300 kB to ten shards (nothing orders them): three fit
            sends = [asyncio.ensure_future(client.append(address, "messages", shard,
                                                         bytes(300_000), within=10))
                     for shard in range(10)]
            await asyncio.wait_for(three_started.wait(), 5)
            await asyncio.sleep(0.3)  # time for more to be read, were they allowed
            assert len(started) == 3, started
            release.set()
            assert await asyncio.gather(*sends) == [b"taken"] * 10
            assert sorted(started) == list(range(10))
            await client.close()
    asyncio.run(scenario())


def test_a_message_that_does_not_decode_closes_the_connection() -> None:
    async def scenario() -> None:
        async def take(db: str, shard: int, body: bytes) -> bytes:
            return b""

        async with app_serving(StreamServer(take, no_forwards).add_routes) as address, \
                aiohttp.ClientSession() as session:
            async with session.ws_connect(f"http://{address}{PATH}",
                                          protocols=(PROTOCOL,)) as connection:
                await connection.send_bytes(b"\x02garbage")
                message = await connection.receive(timeout=5)
                assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            async with session.ws_connect(f"http://{address}{PATH}",
                                          protocols=("stratamq.append.v0",)) as connection:
                message = await connection.receive(timeout=5)
                assert message.type == aiohttp.WSMsgType.CLOSE
                assert message.data == aiohttp.WSCloseCode.PROTOCOL_ERROR
    asyncio.run(scenario())


def test_a_write_refused_as_late_for_a_wrong_clock_estimate_is_sent_again(
        tmp_path: Path) -> None:
    """A forwarded write states its deadline in the leader's clock, by this site's
    estimate of it; with no estimate yet (the first write after a start) or a stale
    one, a leader whose clock runs further ahead than thought refused it as arrived
    after its deadline, and the publisher's write failed. The refusal carries the
    leader's clock: sent again at once, with the estimate it gave, it is taken. Here
    the estimate kept says the leader runs 20 s behind (from a slow round trip, so
    the next answer replaces it)."""
    async def scenario() -> None:
        taken: list[bytes] = []

        async def submit(db: str, shard: int, body: bytes) -> None:
            taken.append(body)

        executor = ThreadPoolExecutor(2)
        server = PeerServer(lambda db, shard: None, executor, submit=submit)  # type: ignore[arg-type, return-value]
        port = free_port()
        await server.start(HOST, port)
        address = f"{HOST}:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                client = PeerClient(session, timeout=5)
                client.clocks.observe(address, Estimate(offset=-20.0, round_trip=10.0,
                                                        at=time.monotonic()))
                await client.submit(address, "messages", 0, b"write", within=3.0)
                assert taken == [b"write"]
                # no time left (a write queued past its deadline): not sent
                with pytest.raises(PeerError, match="no time left"):
                    await client.submit(address, "messages", 0, b"late", within=0.0)
                assert taken == [b"write"]
                assert abs(client.clocks.offset(address)) < 1.0
                await client.close()
        finally:
            await server.stop()
            executor.shutdown()
    asyncio.run(scenario())
