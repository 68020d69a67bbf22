"""Storage replication (DESIGN.md, "Replication"): each shard's log of cooked batches
at (epoch, offset), the rule that commits its entries, and a leader's bookkeeping.
Not built yet: shipping the log between sites over the peer port, applying committed
entries to the shard's data, the controller, failover, replica transitions."""

from .commit import commit_offset, majority
from .leader import AppendRequest, Leadership
from .log import START, AppendResult, Entry, LogGapError, Position, ShardLog, StaleEpochError

__all__ = [
    "START",
    "AppendRequest",
    "AppendResult",
    "Entry",
    "Leadership",
    "LogGapError",
    "Position",
    "ShardLog",
    "StaleEpochError",
    "commit_offset",
    "majority",
]
