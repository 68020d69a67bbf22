"""Storage replication (DESIGN.md, "Replication"): each shard's log of cooked batches
at (epoch, offset) and the rule that commits its entries. Built so far: the log of one
shard on one site and the commit rule. Not built yet: shipping the log between sites
over the peer port, the controller, failover, replica transitions."""

from .commit import commit_offset, majority
from .log import START, AppendResult, Entry, LogGapError, Position, ShardLog, StaleEpochError

__all__ = [
    "START",
    "AppendResult",
    "Entry",
    "LogGapError",
    "Position",
    "ShardLog",
    "StaleEpochError",
    "commit_offset",
    "majority",
]
