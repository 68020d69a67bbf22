"""MQTT load for the broker benchmark, from Debian's C clients (mosquitto-clients):

- `mosquitto_pub -l` sends one message per stdin line. For throughput the lines come
  from prepared files (as fast as the client goes); for latency a Python thread writes
  them at a fixed low rate, each stamped with `time.time_ns()` when written.
- `mosquitto_sub -F '%U %p'` prints each message with its arrival time (the same
  host clock), so every output line gives an end-to-end latency and the time of the
  last arrival gives the end of a throughput run.

Payloads are 64 bytes: `<sent ns, 19 digits> <sequence number, 10 digits> xxx...`.

mosquitto_pub -l hands out 16-bit packet ids as it reads lines; past 65535 lines in
one process it sees the PUBACK of an early message with the last id and disconnects
before the rest is sent. So one process never gets more than MAX_LINES lines: long
runs use several, one after the other.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harness.processes import HOST

PAYLOAD_BYTES = 64
MAX_LINES = 60_000
SUB_FORMAT = "%U %p"
# Every client gives a user name: amqtt keeps messages for an offline session only
# when its client is not anonymous (stratamq and Mosquitto accept it as it is).
USER = ["-u", "bench"]
_PUBACK = re.compile(rb"received PUBACK \(Mid: (\d+)")


def payload(seq: int, sent_ns: int) -> bytes:
    head = f"{sent_ns:019d} {seq:010d} ".encode()
    return head + b"x" * (PAYLOAD_BYTES - len(head))


@dataclass(frozen=True, slots=True)
class Received:
    """One line of mosquitto_sub output."""

    recv_ns: int
    sent_ns: int
    seq: int


def parse_output(path: Path) -> list[Received]:
    received = []
    with path.open("rb") as lines:
        for line in lines:
            parts = line.split(b" ", 3)
            if len(parts) < 3 or b"." not in parts[0]:
                continue  # cut short by a kill
            seconds, _, fraction = parts[0].partition(b".")
            try:
                recv_ns = int(seconds) * 1_000_000_000 + int(fraction.ljust(9, b"0"))
                received.append(Received(recv_ns, int(parts[1]), int(parts[2])))
            except ValueError:
                continue
    return received


class LineFiles:
    """Files of `mosquitto_pub -l` input, at most MAX_LINES lines each, made once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def chunks(self, first_seq: int, count: int) -> list[tuple[int, Path]]:
        """(first sequence number, file) for messages first_seq .. first_seq+count-1."""
        chunks = []
        for start in range(first_seq, first_seq + count, MAX_LINES):
            size = min(MAX_LINES, first_seq + count - start)
            path = self.directory / f"lines-{start}-{size}.txt"
            if not path.exists():
                path.write_bytes(b"".join(payload(seq, 0) + b"\n"
                                          for seq in range(start, start + size)))
            chunks.append((start, path))
        return chunks


# -- processes ------------------------------------------------------------------------


def established(port: int) -> int:
    """Open TCP connections on the broker's side of `port`."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def wait_connections(port: int, at_least: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while established(port) < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {established(port)} of {at_least} clients connected "
                               f"to port {port}")
        time.sleep(0.02)


@dataclass
class Subscriber:
    process: subprocess.Popen[bytes]
    output: Path
    stdout: IO[bytes]
    stderr: IO[bytes]


def start_subscriber(port: int, topic: str, qos: int, count: int, output: Path,
                     client_id: str, clean: bool = True, host: str = HOST) -> Subscriber:
    command = ["mosquitto_sub", "-h", host, "-p", str(port), "-t", topic, "-q", str(qos),
               "-C", str(count), "-F", SUB_FORMAT, "-i", client_id, *USER]
    if not clean:
        command.append("-c")
    stdout = output.open("wb")
    stderr = output.with_suffix(".err").open("wb")
    process = subprocess.Popen(command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    return Subscriber(process, output, stdout, stderr)


def subscribe_offline(port: int, topic: str, client_id: str) -> None:
    """Create a persistent session (clean session false) with a QoS 1 subscription, then
    disconnect."""
    subprocess.run(["mosquitto_sub", "-h", HOST, "-p", str(port), "-t", topic, "-q", "1",
                    "-c", "-i", client_id, "-E", *USER], check=True, timeout=30,
                   stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def wait_subscribers(subscribers: Sequence[Subscriber], idle: float,
                     first_wait: float | None = None, limit: float = 600.0) -> None:
    """Wait until every subscriber has its count, or their output stopped growing for
    `idle` seconds (`first_wait` while there is none yet): then they are stopped."""
    last_size = 0
    last_growth = time.monotonic()
    deadline = time.monotonic() + limit
    while any(s.process.poll() is None for s in subscribers):
        size = sum(s.output.stat().st_size for s in subscribers)
        now = time.monotonic()
        allowed = idle if size or first_wait is None else first_wait
        if size != last_size:
            last_size, last_growth = size, now
        elif now - last_growth > allowed or now > deadline:
            break
        time.sleep(0.05)
    for subscriber in subscribers:
        if subscriber.process.poll() is None:
            subscriber.process.send_signal(signal.SIGTERM)  # it flushes its output
            try:
                subscriber.process.wait(10)
            except subprocess.TimeoutExpired:
                subscriber.process.kill()
                subscriber.process.wait()
        subscriber.stdout.close()
        subscriber.stderr.close()


def publish_command(port: int, topic: str, qos: int, window: int, client_id: str,
                    debug: bool = False, nodelay: bool = False,
                    host: str = HOST) -> list[str]:
    command = ["mosquitto_pub", "-h", host, "-p", str(port), "-t", topic, "-q", str(qos),
               "-M", str(window), "-i", client_id, "-l", *USER]
    if debug:
        command.append("-d")
    if nodelay:  # no Nagle delay on a lone small PUBLISH
        command.append("--nodelay")
    return command


def publish_chunks(port: int, topic: str, qos: int, window: int, client_id: str,
                   chunks: Sequence[tuple[int, Path]], count_acks: bool = False,
                   host: str = HOST) -> set[int]:
    """Send the chunks one process after the other, each its own client (with one id, a
    broker closes the previous connection, and the QoS 0 messages still unread in its
    socket with it); with `count_acks`, returns the sequence numbers whose PUBACK
    arrived (packet id k of a process is its k-th line)."""
    acked: set[int] = set()
    for k, (first_seq, path) in enumerate(chunks):
        with path.open("rb") as stdin:
            done = subprocess.run(
                publish_command(port, topic, qos, window, f"{client_id}-{k}", count_acks,
                                host=host),
                stdin=stdin, stdout=subprocess.PIPE if count_acks else subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, check=False, timeout=900)
        if count_acks:
            acked.update(first_seq + int(mid) - 1 for mid in _PUBACK.findall(done.stdout))
    return acked


def in_parallel(jobs: Sequence[Callable[[], object]]) -> None:
    errors: list[BaseException] = []

    def run(job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class PacedPublisher:
    """A `mosquitto_pub -l --nodelay` whose lines a thread writes at `rate` per second,
    each stamped with the time it is written."""

    def __init__(self, port: int, topic: str, qos: int, window: int, client_id: str,
                 count: int, rate: float, first_seq: int = 0) -> None:
        self.process = subprocess.Popen(publish_command(port, topic, qos, window, client_id,
                                                        nodelay=True),
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self.count = count
        self.rate = rate
        self.first_seq = first_seq

    def run(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        start = time.monotonic()
        for k in range(self.count):
            delay = start + k / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            stdin.write(payload(self.first_seq + k, time.time_ns()) + b"\n")
            stdin.flush()
        stdin.close()
        self.process.wait(120)
