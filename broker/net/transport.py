"""What a connection writes to: the byte sink of one client socket."""

from __future__ import annotations

from typing import Protocol


class Transport(Protocol):
    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def buffered(self) -> int:
        """Bytes written but not yet sent (for slow-consumer protection)."""
        ...
