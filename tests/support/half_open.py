"""Attacks on an HTTP listener with connections that never finish a request: idle
ones (nothing sent) and half-sent ones (request headers without the blank line).
The processes started while `few_descriptors` holds get a small file descriptor
limit (as with a default `ulimit -n`) that such an attack can exhaust."""

from __future__ import annotations

import contextlib
import resource
import socket
from collections.abc import Iterator

import pytest

# A default `ulimit -n`: what the processes started under `few_descriptors` get.
FEW_DESCRIPTORS = 1024
HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # no blank line: never complete


@contextlib.contextmanager
def few_descriptors(attack: int) -> Iterator[None]:
    """Processes started meanwhile get 1,024 file descriptors; after, this process
    keeps enough for an attack of `attack` connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = attack + 500
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"ulimit -n hard limit {hard} is below {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (FEW_DESCRIPTORS, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))


def open_half_open(host: str, port: int, count: int, *, give_up_after: int = 3,
                   connect_timeout: float = 1.0) -> list[socket.socket]:
    """Up to `count` connections to host:port, every other one half-sent
    (`HALF_SENT`), the rest idle. Stops after `give_up_after` connects in a row fail
    (a listener out of descriptors stops accepting, and each try would wait out
    `connect_timeout`)."""
    sockets: list[socket.socket] = []
    failed = 0
    for number in range(count):
        try:
            attacker = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError:
            failed += 1
            if failed >= give_up_after:
                break
            continue
        failed = 0
        if number % 2:
            with contextlib.suppress(OSError):
                attacker.sendall(HALF_SENT)
        sockets.append(attacker)
    return sockets


def still_open(sockets: list[socket.socket]) -> int:
    """How many of `sockets` the listener has not closed (nothing to read yet: a
    refusal's 503 or a close counts as closed)."""
    count = 0
    for attacker in sockets:
        attacker.settimeout(0.01)
        try:
            attacker.recv(4096)
        except TimeoutError:
            count += 1
        except OSError:
            pass  # reset: closed
    return count


def close_all(sockets: list[socket.socket]) -> None:
    for attacker in sockets:
        attacker.close()
