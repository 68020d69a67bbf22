"""MQTT over WebSocket must bound what one frame can make the broker hold: a frame
larger than `mqtt.max_packet_size` is refused (the connection closed) as soon as its
header says how long it is, not after the broker has buffered it whole. The listener
today passes `max_msg_size=0` (no limit) to aiohttp, so a client announcing a 1 GiB
frame can make the site buffer as much as it sends.

Raw sockets here: a WebSocket client library would refuse to send what we need (a
frame that announces more than it delivers)."""

from __future__ import annotations

import base64
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import HOST, BrokerProcess, running_broker
from stratamq.broker.mqtt import MQTT_5, Connack, Connect, PacketReader, Pingreq, Pingresp, encode
from tests.support.clients import unique

MAX_PACKET = 64 * 1024
ANNOUNCED = 1 << 30  # what the hostile frame claims to carry
SENT_AT_MOST = 48 * 1024 * 1024  # what we try to push before giving up
CHUNK = 256 * 1024


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path_factory.mktemp("ws-limit"),
                        {"mqtt": {"max_packet_size": MAX_PACKET}}) as process:
        yield process


def frame_header(length: int, opcode: int = 0x2) -> bytes:
    """A final client frame (masked, as RFC 6455 requires of clients)."""
    head = bytes([0x80 | opcode])
    if length < 126:
        head += bytes([0x80 | length])
    elif length < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", length)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", length)
    return head + b"\x00\x00\x00\x00"  # a zero mask: the payload goes as is


def ws_connect(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /mqtt HTTP/1.1\r\nHost: {HOST}:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
                  ).encode())
    response = b""
    while b"\r\n\r\n" not in response:
        data = sock.recv(4096)
        assert data, f"closed during the handshake: {response!r}"
        response += data
    assert response.startswith(b"HTTP/1.1 101"), response
    return sock


def mqtt_over_ws(sock: socket.socket, packet: bytes) -> None:
    sock.sendall(frame_header(len(packet)) + packet)


def read_packets(sock: socket.socket, reader: PacketReader) -> list[object]:
    """One server frame's MQTT packets (server frames are not masked)."""
    head = recv_exactly(sock, 2)
    length = head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", recv_exactly(sock, 2))[0]
    elif length == 127:
        length = struct.unpack("!Q", recv_exactly(sock, 8))[0]
    payload = recv_exactly(sock, length)
    assert head[0] & 0x0F == 0x2, f"not a binary frame: {head!r} {payload!r}"
    return list(reader.decode(payload))


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "closed"
        data += chunk
    return data


def connected(broker: BrokerProcess) -> tuple[socket.socket, PacketReader]:
    sock = ws_connect(broker.ws_port)
    reader = PacketReader(1 << 24, protocol_level=MQTT_5)
    mqtt_over_ws(sock, encode(Connect(unique("ws"), MQTT_5), MQTT_5))
    packets = read_packets(sock, reader)
    assert isinstance(packets[0], Connack) and packets[0].reason_code == 0
    return sock, reader


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_frame_announcing_more_than_max_packet_size_is_refused_at_its_header(
        broker: BrokerProcess) -> None:
    assert broker.process is not None
    sock, _reader = connected(broker)
    rss_before = rss_kib(broker.process.pid)
    sock.sendall(frame_header(ANNOUNCED))
    sent, closed = 0, False
    sock.settimeout(10)
    zeros = bytes(CHUNK)
    while sent < SENT_AT_MOST:
        try:
            sock.sendall(zeros)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        except TimeoutError:
            break  # the broker stopped reading without closing: not a refusal either
        sent += CHUNK
    grown_mib = (rss_kib(broker.process.pid) - rss_before) / 1024
    print(f"\nbroker accepted {sent / 2**20:.1f} MiB of a frame announcing "
          f"{ANNOUNCED / 2**20:.0f} MiB (max_packet_size {MAX_PACKET // 1024} KiB); "
          f"closed: {closed}; broker RSS grew {grown_mib:.1f} MiB")
    sock.close()
    assert closed, f"the broker took {sent / 2**20:.0f} MiB of one frame without closing"
    # what the kernel's socket buffers hold is all it can have taken
    assert sent <= 16 * 1024 * 1024
    assert broker.alive()


def test_a_whole_frame_larger_than_max_packet_size_closes_the_connection(
        broker: BrokerProcess) -> None:
    """A complete frame over the limit, even made of small valid packets (many
    PINGREQs), is refused too: the limit is on the frame."""
    sock, reader = connected(broker)
    pings = encode(Pingreq(), MQTT_5) * (2 * MAX_PACKET // 2)
    sock.sendall(frame_header(len(pings)) + pings)
    sock.settimeout(10)
    answered = 0
    try:
        while True:
            answered += sum(isinstance(p, Pingresp) for p in read_packets(sock, reader))
    except (AssertionError, ConnectionResetError, TimeoutError):
        pass
    sock.close()
    assert answered == 0, f"{answered} PINGREQs of an oversized frame were answered"
    assert broker.alive()


def test_frames_within_the_limit_still_work(broker: BrokerProcess) -> None:
    sock, reader = connected(broker)
    mqtt_over_ws(sock, encode(Pingreq(), MQTT_5))
    assert any(isinstance(p, Pingresp) for p in read_packets(sock, reader))
    sock.close()
