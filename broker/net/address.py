"""Socket addresses as configured (`host:port`) and as shown (`[::1]:1883`)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from ..errors import ListenError


def split_bind(bind: str) -> tuple[str, int]:
    """`host:port` (`[::1]:1883` for IPv6) -> (host, port); an empty host is all."""
    host, _, port = bind.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    return host or "0.0.0.0", int(port)


def source_address(bind: str) -> tuple[str, int] | None:
    """The local address outgoing connections start from, for a process bound to
    `bind`: its own host when it names one (so that peers see connections coming from
    the address it serves at, as on a machine of its own), else None (the system's
    choice)."""
    host, _port = split_bind(bind)
    return None if host in ("0.0.0.0", "::") else (host, 0)


def format_peer(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


def peer_host(peer: str) -> str:
    """The host of a peer as `format_peer` shows it (`[::1]:1883` -> `::1`,
    `10.0.0.1:1883` -> `10.0.0.1`); a peer shown without a port (the WebSocket
    listener's) is returned as it is."""
    if peer.startswith("["):
        return peer[1:].partition("]")[0]
    if peer.count(":") == 1:
        return peer.partition(":")[0]
    return peer


@contextlib.contextmanager
def listening(setting: str, bind: str) -> Iterator[None]:
    """A failed bind inside becomes a `ListenError` that names `setting` (the
    configuration key or option that gave `bind`), a line for the user rather than a
    traceback."""
    try:
        yield
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        hint = (": another process has that port, or this one runs twice"
                if error.errno == errno.EADDRINUSE else "")
        raise ListenError(f"{setting}: cannot listen on {bind}: {reason}{hint}") from error
