"""The login guard: the per-source back-off, the bounded hash pool, and the pieces the
channel hands them (the source address, the CONNECT size bound)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from stratamq.broker.auth import (
    CONNECTION_RATE_EXCEEDED,
    SERVER_BUSY,
    AccessControl,
    hash_password,
)
from stratamq.broker.auth.login_guard import (
    FREE_FAILURES,
    FailureBackoff,
    HashPool,
    ServerBusy,
)
from stratamq.broker.mqtt import (
    MQTT_5,
    Connect,
    PacketReader,
    Properties,
    encode,
    encode_publish,
)
from stratamq.broker.mqtt.errors import PacketTooLargeError
from stratamq.broker.net.address import peer_host


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_source_is_backed_off_after_its_free_failures_for_doubling_periods() -> None:
    clock = Clock()
    backoff = FailureBackoff(10.0, clock=clock)
    for _ in range(FREE_FAILURES):
        backoff.failed("10.0.0.1")
        assert not backoff.backed_off("10.0.0.1")
    periods = []
    for _ in range(6):
        backoff.failed("10.0.0.1")
        start = clock.now
        while backoff.backed_off("10.0.0.1"):
            clock.now += 0.5
        periods.append(clock.now - start)
    assert periods == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]  # doubling, capped
    assert not backoff.backed_off("10.0.0.2")  # other sources are not touched


def test_a_quiet_source_is_forgotten_and_the_table_is_bounded() -> None:
    clock = Clock()
    backoff = FailureBackoff(5.0, max_sources=100, clock=clock)
    for _ in range(FREE_FAILURES + 1):
        backoff.failed("a")
    assert backoff.backed_off("a")
    clock.now += 10.1  # twice the longest back-off without a failure
    backoff.failed("a")
    assert not backoff.backed_off("a")  # counted from one again
    for index in range(1000):
        backoff.failed(f"10.0.{index // 256}.{index % 256}")
    assert len(backoff) == 100


def test_no_backoff_when_turned_off() -> None:
    backoff = FailureBackoff(0.0)
    for _ in range(FREE_FAILURES * 3):
        backoff.failed("a")
    assert not backoff.backed_off("a") and len(backoff) == 0


def test_the_pool_refuses_beyond_its_room_and_per_source() -> None:
    async def scenario() -> list[str]:
        pool = HashPool(workers=1, queue=2, per_source=2)
        release = threading.Event()

        def slow() -> bool:
            return release.wait(10.0)

        async def attempt(source: str) -> str:
            try:
                return str(await pool.run(source, slow))
            except ServerBusy:
                return "busy"

        first = [asyncio.create_task(attempt("a")) for _ in range(3)]  # third: per source
        second = [asyncio.create_task(attempt("b")) for _ in range(2)]  # second: pool full
        await asyncio.sleep(0.1)
        release.set()
        results = await asyncio.gather(*first, *second)
        # the room is given back: a new check runs
        results.append(str(await pool.run("a", lambda: True)))
        pool.close()
        return results

    assert asyncio.run(scenario()) == ["True", "True", "busy", "True", "busy", "True"]


def test_a_waiting_check_of_another_source_goes_before_a_busy_sources_next() -> None:
    """A storm from one address keeps its checks queued in the pool: a login from
    another address runs as soon as a thread is free, not behind the storm's queue
    (the login-storm test saw 3 s on a loaded machine for a 0.3 s hash)."""
    async def scenario() -> list[str]:
        pool = HashPool(workers=1, queue=8, per_source=4)
        gates = {name: threading.Event() for name in ("a1", "a2", "a3", "a4", "b1")}
        ran: list[str] = []

        def check(name: str) -> bool:
            ran.append(name)
            return gates[name].wait(10.0)

        storm = [asyncio.create_task(pool.run("a", lambda n=name: check(n)))  # type: ignore[misc]
                 for name in ("a1", "a2", "a3", "a4")]
        await asyncio.sleep(0.1)
        legitimate = asyncio.create_task(pool.run("b", lambda: check("b1")))
        await asyncio.sleep(0.1)
        for gate in gates.values():  # one thread: they finish one after the other
            gate.set()
        await asyncio.gather(*storm, legitimate)
        pool.close()
        return ran

    assert asyncio.run(scenario())[:2] == ["a1", "b1"]


def test_a_check_whose_caller_left_before_it_ran_gives_its_room_back() -> None:
    async def scenario() -> tuple[list[str], str]:
        pool = HashPool(workers=1, queue=1, per_source=2)
        release = threading.Event()
        ran: list[str] = []

        def check(name: str) -> bool:
            ran.append(name)
            return release.wait(10.0)

        running = asyncio.create_task(pool.run("a", lambda: check("running")))
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(pool.run("a", lambda: check("left")))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.05)
        # its room is free at once: another check is admitted
        later = asyncio.create_task(pool.run("b", lambda: check("later")))
        await asyncio.sleep(0.05)
        release.set()
        try:
            result = str(await later)
        except ServerBusy:
            result = "busy"
        await running
        pool.close()
        return ran, result

    ran, result = asyncio.run(scenario())
    assert result == "True" and "left" not in ran, (ran, result)


def test_checks_not_started_are_cancelled_when_the_pool_closes() -> None:
    async def scenario() -> list[bool]:
        pool = HashPool(workers=1, queue=2, per_source=3)
        release = threading.Event()
        running = asyncio.create_task(pool.run("a", lambda: release.wait(10.0)))
        waiting = asyncio.create_task(pool.run("a", lambda: True))
        await asyncio.sleep(0.05)
        pool.close()
        release.set()
        await running
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(waiting), 5.0)  # not left waiting
        return [running.result(), waiting.cancelled()]

    assert asyncio.run(scenario()) == [True, True]


def test_access_control_refuses_without_a_hash_when_busy_or_backed_off() -> None:
    passwords = {"alice": hash_password("pw", iterations=1000)}

    async def scenario() -> tuple[int, int]:
        clock = Clock()
        backoff = FailureBackoff(30.0, clock=clock)
        for _ in range(FREE_FAILURES + 1):
            backoff.failed("10.0.0.9")
        control = AccessControl(allow_anonymous=False, passwords=passwords,
                                hash_pool=HashPool(1, 1, 1), backoff=backoff)
        backed_off = await control.authenticate_async("c", "alice", b"pw", "10.0.0.9")
        busy_pool = HashPool(1, 1, 1)
        gate = threading.Event()
        blocker = asyncio.create_task(busy_pool.run("x", lambda: gate.wait(10.0)))
        await asyncio.sleep(0.05)
        busy = AccessControl(allow_anonymous=False, passwords=passwords,
                             hash_pool=busy_pool, backoff=FailureBackoff(30.0))
        refused = await busy.authenticate_async("c", "alice", b"pw", "x")
        gate.set()
        await blocker
        control.close()
        busy.close()
        return backed_off, refused

    assert asyncio.run(scenario()) == (CONNECTION_RATE_EXCEEDED, SERVER_BUSY)


@pytest.mark.parametrize(("peer", "host"), [
    ("10.0.0.1:1883", "10.0.0.1"), ("[::1]:1883", "::1"), ("10.0.0.1", "10.0.0.1"),
    ("::1", "::1"), ("fe80::1", "fe80::1")])
def test_peer_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_a_connect_over_its_own_bound_is_refused_at_its_fixed_header() -> None:
    connect = encode(Connect("c", MQTT_5, True, 60, None, bytes(2000), None, Properties()),
                     MQTT_5)
    reader = PacketReader(1 << 20, max_connect_size=1024)
    with pytest.raises(PacketTooLargeError, match="CONNECT of"):
        reader.decode(connect[:5])  # the fixed header alone
    roomy = PacketReader(1 << 20, max_connect_size=4096)
    assert len(roomy.decode(connect)) == 1
    # past CONNECT, max_packet_size bounds packets again
    publish = encode_publish("t", bytes(8000), 0, False, False, None, Properties(), MQTT_5)
    assert len(roomy.decode(publish)) == 1
