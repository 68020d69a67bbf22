"""What the parts of one shard replica share (`replica`: the role; `takeover`,
`writes`, `senders`, `applier`, `reads`, `installer`): what they work on
(`ReplicaContext`), the role as they read it (`ReplicaRole`, which `ShardReplica`
implements) and the error of a lost leadership."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...errors import StorageError
from ..buffer import WriteBuffer
from ..shard import Shard
from ..shard_set import ShardSet
from .leader import Leadership
from .log import ShardLog
from .peer import PeerClient
from .placement import ShardPlacement
from .state_machine import LogStateMachine

T = TypeVar("T")

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


@dataclass(frozen=True, slots=True)
class ReplicaContext:
    """What every part of one shard replica works on."""

    # this site's copy of the database, the shard's write buffer (where writes
    # forwarded to this site as the leader wait) and what applies the log's entries
    shard_set: ShardSet
    buffer: WriteBuffer
    state_machine: LogStateMachine
    shard_id: int
    log: ShardLog
    # shared with the peer server's appends to this log
    log_lock: asyncio.Lock
    # blocking calls (the log's, RocksDB's) run here
    executor: Executor
    client: PeerClient
    settings: ReplicaSettings

    @property
    def shard(self) -> Shard:
        """The shard's data, looked up each time: an install replaces it."""
        return self.shard_set.shards[self.shard_id]

    @property
    def label(self) -> str:
        """The shard as "db/shard", for log lines and errors."""
        return f"{self.shard_set.name}/{self.shard_id}"

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` in the executor."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, function,
                                                                 *args)


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
