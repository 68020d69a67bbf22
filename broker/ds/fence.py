"""Fenced (conditional) record writes: an owner epoch per key, kept as a record of
its own, that a write must not be behind. The write is checked where it is cooked
(the shard's leader, or the one site, against the shard's applied state), so two
owners of a key never both win: the older one's late writes are refused.

A claim (`claim=True`) moves the epoch on: it holds only when the stored epoch is
lower than the claimed one, so of two claims of the same epoch one wins. A plain
fenced write holds when the stored epoch is not higher than its own. A claim may name
its owner (bytes the caller reads back with `stored_owner`); a plain write keeps the
owner of the claim it writes under."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import StorageError

# Outside any key the broker writes (MQTT topics and client ids hold no U+0000).
FENCE_PREFIX = b"\x00fence/"


class FencedError(StorageError):
    """A newer owner holds the key: this writer's write was refused, and will be
    again (not recoverable: the writer has lost the key). `keys`: the fenced keys
    whose writes were refused (the other writes of a batch were not written either,
    and may be tried again)."""

    def __init__(self, message: str, keys: frozenset[bytes] = frozenset()) -> None:
        super().__init__(message)
        self.keys = keys


@dataclass(frozen=True, slots=True)
class Fence:
    key: bytes
    epoch: int
    claim: bool = False
    owner: bytes = b""

    @property
    def record_key(self) -> bytes:
        return fence_key(self.key)

    def check(self, stored: bytes | None) -> tuple[bytes, bytes]:
        """The put that the write carries with it (the key's epoch, this one, and its
        owner), or FencedError when the write does not hold against `stored`."""
        current = stored_epoch(stored)
        if current > self.epoch or (self.claim and current == self.epoch):
            raise FencedError(f"owner epoch {self.epoch} of {self.key!r} is behind "
                              f"epoch {current}: a newer owner holds it")
        owner = self.owner if self.claim else stored_owner(stored)
        return self.record_key, self.epoch.to_bytes(8, "big") + owner


def fence_key(key: bytes) -> bytes:
    return FENCE_PREFIX + key


def stored_epoch(stored: bytes | None) -> int:
    return 0 if stored is None else int.from_bytes(stored[:8], "big")


def stored_owner(stored: bytes | None) -> bytes:
    return b"" if stored is None else stored[8:]


def check_fences(fences: Sequence[Fence],
                 read: Callable[[bytes], bytes | None]) -> list[tuple[bytes, bytes]]:
    """The epoch records that a batch with these fenced writes (in their order)
    carries, checked against the applied state (`read` of a record key) and each
    other: FencedError naming every refused key when any does not hold."""
    current: dict[bytes, bytes | None] = {}
    refused: set[bytes] = set()
    reasons: list[str] = []
    for fence in fences:
        key = fence.record_key
        if key not in current:
            current[key] = read(key)
        try:
            current[key] = fence.check(current[key])[1]
        except FencedError as exc:
            refused.add(fence.key)
            reasons.append(exc.message)
    if refused:
        raise FencedError("; ".join(reasons), frozenset(refused))
    return [(key, value) for key, value in current.items() if value is not None]
