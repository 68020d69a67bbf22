"""Memory of idle MQTT connections on one site (issue 25): a `stratamq broker` on an
embedded storage (and Mosquitto beside it), N clients connected that then say nothing,
the growth of the server's RSS per connection, and the time the N took to connect.

    python bench/conn_memory.py [--counts 1000,5000] [--kinds 311-clean,...]
                                [--brokers stratamq,mosquitto] [--trace]

Each kind of client gets a fresh server: its RSS is read once it has started and a
few clients have come and gone (what the first connection loads is not the
connections'), then after each count of clients is connected and the RSS has settled.
KB/conn is (RSS after - RSS before) / N; "add s" the seconds the clients added at
that count (N less the count before) took to connect, CONNACK received, at most
256 handshakes under way at once; "idle ms/s" the server's CPU time per second
over IDLE_SECONDS once they are connected and say nothing (the work a site does for
connections that do nothing: it should not grow with their number). RSS is what the
process holds in user space: the kernel's socket buffers are in neither broker's
figure.

Kinds: MQTT 3.1.1 or 5, clean (a session that ends with the connection) or durable
(3.1.1 clean session 0; 5 with a session expiry of a day), keep alive 300 s.

`--trace` runs stratamq under tracemalloc (bench/traced_site.py) and prints, for the
largest count, what was allocated between before and after per connection, by the
line of the broker's code that allocated it.

The clients come from this process (asyncio), so the open-file limit is raised here
and in the servers it starts: to what the largest count needs where this process may
(root), else to the hard limit, and a count the limit does not allow is refused. One
source address gives at most the kernel's ephemeral ports (about 28k) of connections to
one server port, so the clients connect from 127.0.0.2 to 127.0.0.9 in turn. Traffic
stays on 127.0.0.0/8."""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import struct
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.broker_peers import Mosquitto
from harness.processes import HOST, BrokerProcess, ManagedProcess

KEEPALIVE = 300
DURABLE_EXPIRY = 86_400
CONCURRENT_CONNECTS = 256  # handshakes under way at once, like a reconnect storm
# The clients' source addresses, taken in turn (see the docstring).
SOURCE_ADDRESSES = [f"127.0.0.{last}" for last in range(2, 10)]
WARMUP_CLIENTS = 20
SETTLE_SECONDS = 2.0
IDLE_SECONDS = 5.0
KINDS = ("311-clean", "311-durable", "5-clean", "5-durable")


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("!H", len(data)) + data


def _remaining_length(size: int) -> bytes:
    out = bytearray()
    while True:
        byte, size = size % 128, size // 128
        out.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(out)


def connect_packet(kind: str, client_id: str) -> bytes:
    """CONNECT of one client of `kind` (see KINDS)."""
    level, session = kind.split("-")
    clean = session == "clean"
    flags = 0x02 if clean or level == "5" else 0x00
    variable = _string("MQTT") + bytes([int(level[0]) if level == "5" else 4, flags])
    variable += struct.pack("!H", KEEPALIVE)
    if level == "5":
        properties = b"" if clean else b"\x11" + struct.pack("!I", DURABLE_EXPIRY)
        variable += _remaining_length(len(properties)) + properties
    body = variable + _string(client_id)
    return b"\x10" + _remaining_length(len(body)) + body


@dataclass
class Clients:
    """Connections held open by this process."""

    writers: list[asyncio.StreamWriter]
    refused: int = 0

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers.clear()


async def connect_clients(port: int, kind: str, first: int, count: int,
                          clients: Clients) -> float:
    """Connect `count` clients (CONNACK received, accepted); returns the seconds
    taken. A client refused (no CONNACK, or one with a failure code) is counted."""
    gate = asyncio.Semaphore(CONCURRENT_CONNECTS)

    async def one(number: int) -> None:
        async with gate:
            try:
                reader, writer = await asyncio.open_connection(
                    HOST, port,
                    local_addr=(SOURCE_ADDRESSES[number % len(SOURCE_ADDRESSES)], 0))
                writer.write(connect_packet(kind, f"idle-{kind}-{number}"))
                head = await asyncio.wait_for(reader.readexactly(4), 60)
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                clients.refused += 1
                return
            if head[0] != 0x20 or head[3] != 0:
                clients.refused += 1
                writer.close()
                return
            clients.writers.append(writer)

    started = time.monotonic()
    await asyncio.gather(*(one(number) for number in range(first, first + count)))
    return time.monotonic() - started


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def settled_rss(pid: int) -> int:
    """The RSS once it stops moving (the server finishing what the connects began)."""
    last = rss_bytes(pid)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(SETTLE_SECONDS)
        now = rss_bytes(pid)
        if abs(now - last) < 256 * 1024:
            return now
        last = now
    return last


@dataclass(frozen=True)
class Row:
    broker: str
    kind: str
    count: int
    connect_seconds: float
    rss_before: int
    rss_after: int
    refused: int
    idle_cpu_ms_per_s: float

    @property
    def kb_per_connection(self) -> float:
        return (self.rss_after - self.rss_before) / self.count / 1024


class TracedBroker(BrokerProcess):
    """A site under tracemalloc (bench/traced_site.py); snapshots to `trace_prefix`."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, fast=False)
        self.trace_prefix = workdir / "trace"

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).with_name("traced_site.py")),
                str(self.trace_prefix), "--", *super().command()]

    def snapshot(self, suffix: str, signum: int) -> tracemalloc.Snapshot:
        path = Path(f"{self.trace_prefix}.{suffix}")
        path.unlink(missing_ok=True)
        os.kill(self.pid, signum)
        deadline = time.monotonic() + 120
        size = -1
        while time.monotonic() < deadline:  # dumped when its size stops growing
            time.sleep(1.0)
            if path.exists() and path.stat().st_size == size > 0:
                return tracemalloc.Snapshot.load(str(path))
            size = path.stat().st_size if path.exists() else -1
        raise RuntimeError(f"no snapshot {path}")


def make_server(broker: str, workdir: Path, trace: bool) -> ManagedProcess:
    if broker == "mosquitto":
        return Mosquitto(workdir)
    if trace:
        return TracedBroker(workdir)
    return BrokerProcess(workdir, fast=False)


async def measure(broker: str, kind: str, counts: Sequence[int], workdir: Path,
                  trace: bool) -> list[Row]:
    server = make_server(broker, workdir, trace).start(timeout=60)
    rows = []
    clients = Clients([])
    try:
        warmup = Clients([])
        await connect_clients(server.port, kind, 10_000_000, WARMUP_CLIENTS, warmup)
        await warmup.close()
        await asyncio.sleep(0.5)
        before = await asyncio.to_thread(settled_rss, server.pid)
        if isinstance(server, TracedBroker):
            first = await asyncio.to_thread(server.snapshot, "before", signal.SIGUSR1)
        connected = 0
        for count in counts:
            seconds = await connect_clients(server.port, kind, connected, count - connected,
                                            clients)
            connected = count
            after = await asyncio.to_thread(settled_rss, server.pid)
            cpu_before = server.cpu_seconds()
            await asyncio.sleep(IDLE_SECONDS)
            idle = (server.cpu_seconds() - cpu_before) / IDLE_SECONDS * 1000
            rows.append(Row(broker, kind, count, seconds, before, after, clients.refused,
                            idle))
        if isinstance(server, TracedBroker):
            last = await asyncio.to_thread(server.snapshot, "after", signal.SIGUSR2)
            print_trace(kind, first, last, connected)
    finally:
        await clients.close()
        server.kill()
    return rows


def print_trace(kind: str, before: tracemalloc.Snapshot, after: tracemalloc.Snapshot,
                count: int, top: int = 25) -> None:
    """What the connections allocated, per connection, by the line that did."""
    differences = after.compare_to(before, "lineno")
    total = sum(difference.size_diff for difference in differences)
    print(f"\ntracemalloc, {kind}, {count} connections: {total / count / 1024:.2f} KB "
          "per connection of Python allocations")
    print(f"{'B/conn':>8} {'objs/conn':>9}  line")
    for difference in differences[:top]:
        frame = difference.traceback[0]
        print(f"{difference.size_diff / count:8.0f} {difference.count_diff / count:9.2f}  "
              f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}")
    print("by the innermost line of the broker's own code under it:")
    grouped: dict[str, int] = {}
    for difference in after.compare_to(before, "traceback"):
        # a traceback runs from the outermost frame to the one that allocated
        frames = [frame for frame in difference.traceback
                  if "/broker/" in frame.filename and "site-packages" not in frame.filename]
        where = f"{frames[-1].filename.split('/broker/')[-1]}:{frames[-1].lineno}" \
            if frames else "(outside the broker)"
        grouped[where] = grouped.get(where, 0) + difference.size_diff
    for where, size in sorted(grouped.items(), key=lambda item: -item[1])[:top]:
        print(f"{size / count:8.0f}  {where}")


def print_table(rows: Sequence[Row]) -> None:
    print(f"\n{'broker':<10} {'kind':<12} {'clients':>7} {'add s':>9} "
          f"{'RSS before MB':>13} {'RSS after MB':>12} {'KB/conn':>8} {'refused':>7} "
          f"{'idle ms/s':>9}")
    for row in rows:
        print(f"{row.broker:<10} {row.kind:<12} {row.count:>7} {row.connect_seconds:>9.2f} "
              f"{row.rss_before / 2**20:>13.1f} {row.rss_after / 2**20:>12.1f} "
              f"{row.kb_per_connection:>8.2f} {row.refused:>7} {row.idle_cpu_ms_per_s:>9.1f}")


def raise_file_limit(wanted: int) -> int:
    """The open-file limit raised to `wanted` (root may pass the hard limit), else to
    the hard limit; the limit now."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
        except (ValueError, OSError):
            pass  # not root: the hard limit it is
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1000,5000",
                        help="clients connected, cumulative (default 1000,5000)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--brokers", default="stratamq,mosquitto")
    parser.add_argument("--trace", action="store_true",
                        help="stratamq under tracemalloc: what the connections hold")
    args = parser.parse_args(argv)
    counts = sorted(int(count) for count in args.counts.split(","))
    limit = raise_file_limit(counts[-1] + 1024)
    if counts[-1] + 200 > limit:
        parser.error(f"{counts[-1]} connections need more than the open-file limit "
                     f"{limit} allows")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="conn-memory-") as scratch:
        for broker in args.brokers.split(","):
            for kind in args.kinds.split(","):
                workdir = Path(scratch) / f"{broker}-{kind}"
                rows += asyncio.run(measure(broker, kind, counts, workdir, args.trace))
                print_table(rows[-len(counts):])
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
