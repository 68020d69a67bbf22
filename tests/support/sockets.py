"""Sockets that stand in for a peer that hangs: it takes the connection (the kernel
does, from the listen backlog) and never reads or answers, as a frozen process does."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def hung_listener() -> Iterator[str]:
    """An `http://` address on loopback that listens and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
