"""What the parts of one shard replica share (`replica`: the role; `writes`,
`senders`, `applier`, `reads`): the replica's settings, the role as the parts read it
(`ReplicaRole`, which `ShardReplica` implements) and the error of a lost leadership."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ...errors import StorageError
from .leader import Leadership
from .placement import ShardPlacement

# How long a part waits before it tries again (an unreachable follower, a leader
# that is gone, a failed apply).
RETRY_INTERVAL = 0.5


class NotLeaderError(StorageError):
    """This site stopped leading the shard (a newer leader exists) before a write
    was committed: the writer may retry, and reaches the new leader."""

    recoverable = True


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    site: str
    write_timeout: float
    heartbeat_interval: float
    # log entries kept beyond what every replica holds (`trim.py`)
    log_retain_entries: int = 10_000
    # bytes per second a checkpoint is sent at to a bootstrapping replica; None: as
    # fast as it goes
    checkpoint_rate: int | None = None
    # the site's failure zone (`cluster.zone`), reported to the controller; None: not
    # known
    zone: str | None = None


class ReplicaRole(Protocol):
    """The shard's role on this site, as the replica's parts read it and call back
    into it."""

    @property
    def placement(self) -> ShardPlacement | None:
        """The placement this site last took."""

    @property
    def peers(self) -> Mapping[str, str]:
        """The peer address of each site, as the placement push told them."""

    @property
    def leadership(self) -> Leadership | None:
        """This site's leadership of the shard; None while it does not lead."""

    @property
    def role_changed(self) -> asyncio.Event:
        """Set (and replaced) when the placement or this site's leadership changes:
        a waiter takes it before it looks at the role."""

    async def until_leading(self) -> None:
        """While this site is named the leader and still takes over, wait for it."""

    def step_down(self, why: str) -> None:
        """Stop leading the shard (a newer leader exists)."""


def remaining(deadline: float) -> float:
    """Seconds left until `deadline` (monotonic), which bounds every wait of a
    write or a read."""
    return max(0.0, deadline - time.monotonic())
