"""Slow bytes: timers that any byte reset, and bytes buffered before CONNECT.

A client trickling a byte every few seconds held a connection before CONNECT for
ever, each one buffering up to `max_packet_size` (1 MiB; 200 of them: +203 MiB RSS),
and a connected client trickling the bytes of a packet it never finishes was never
closed for keep alive. The connect timeout runs from accept to CONNECT, the keep alive
from the last whole packet, and a CONNECT larger than `mqtt.max_connect_packet_size`
(64 KiB) is refused as soon as its fixed header says so."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

from harness.processes import HOST, running_broker
from stratamq.broker.mqtt import MQTT_3_1_1, Connack, Connect, PacketReader, Properties, encode

TRICKLE_INTERVAL = 0.25  # seconds between the bytes a slow client sends


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def trickle_until_closed(sock: socket.socket, limit: float) -> float:
    """Send one zero byte every TRICKLE_INTERVAL until the broker closes the
    connection (or `limit` seconds pass); returns the seconds it stayed open."""
    started = time.monotonic()
    sock.settimeout(TRICKLE_INTERVAL)
    while time.monotonic() - started < limit:
        try:
            sock.sendall(b"\x00")
            if sock.recv(4096) == b"":
                break
        except TimeoutError:
            continue  # nothing from the broker: still open
        except OSError:
            break  # reset
    return time.monotonic() - started


def test_a_byte_trickle_before_connect_is_closed_at_connect_timeout(tmp_path: Path) -> None:
    with running_broker(tmp_path, {"mqtt": {"connect_timeout": "1s"}}) as broker:
        sock = socket.create_connection((HOST, broker.port))
        sock.sendall(b"\x10\xc8\x01")  # a CONNECT of 200 bytes, whose body never comes
        open_for = trickle_until_closed(sock, limit=8.0)
        sock.close()
        print(f"a pre-CONNECT byte trickle stayed open {open_for:.1f} s (connect_timeout 1 s)")
        assert 0.8 < open_for < 5.0, f"open for {open_for:.1f} s"


def test_a_keepalive_client_trickling_a_partial_packet_is_closed(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        sock = socket.create_connection((HOST, broker.port), timeout=10.0)
        sock.sendall(encode(Connect("trickler", MQTT_3_1_1, True, 1, None, None, None,
                                    Properties()), MQTT_3_1_1))
        reader = PacketReader(1 << 16, protocol_level=MQTT_3_1_1)
        packets: list[object] = []
        while not packets:
            packets = list(reader.decode(sock.recv(4096)))
        assert isinstance(packets[0], Connack) and packets[0].reason_code == 0
        sock.sendall(b"\x30\xc8\x01")  # a PUBLISH of 200 bytes, whose body never comes
        open_for = trickle_until_closed(sock, limit=8.0)
        sock.close()
        print(f"a keep alive 1 s client trickling a partial packet stayed open "
              f"{open_for:.1f} s (1.5 x keep alive: 1.5 s)")
        assert 1.0 < open_for < 5.0, f"open for {open_for:.1f} s"


async def oversized_connects(port: int, pid: int, clients: int, body: int) -> tuple[int, float]:
    """Each client announces a CONNECT of 1,000,000 bytes and sends `body` of them,
    then holds the connection. Returns how many the broker closed, and how much its
    RSS (MiB) grew meanwhile."""
    header = b"\x10\xc0\x84\x3d"  # remaining length 1,000,000
    before = rss_mib(pid)

    async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(header + bytes(body))
        with contextlib.suppress(OSError):  # closed by the broker before the end
            await writer.drain()
        return reader, writer

    connections = await asyncio.gather(*(one() for _ in range(clients)))
    await asyncio.sleep(1.0)  # the broker has read what it is going to read
    grown = rss_mib(pid) - before
    closed = 0
    for reader, writer in connections:
        try:
            closed += await asyncio.wait_for(reader.read(1), 0.01) == b""
        except TimeoutError:
            pass  # still open
        except OSError:
            closed += 1
        writer.close()
    return closed, grown


def test_bytes_buffered_before_connect_are_bounded(tmp_path: Path) -> None:
    clients, body = 60, 900_000
    with running_broker(tmp_path) as broker:
        assert broker.process is not None
        closed, grown = asyncio.run(oversized_connects(broker.port, broker.process.pid,
                                                       clients, body))
        print(f"{clients} clients each sending {body} bytes of an unfinished CONNECT: "
              f"broker RSS +{grown:.1f} MiB, {closed} closed by the broker")
        assert grown < 20, f"RSS grew {grown:.1f} MiB"
        assert closed == clients
