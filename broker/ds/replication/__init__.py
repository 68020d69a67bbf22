"""Replication of the durable storage across sites (DESIGN.md, "Replication").

Built so far: the placement data model (`placement`), the pure planner that the
local cluster supervisor and the Kubernetes operator share (`planner`), the site's
on-disk copy of the placement (`store`), each shard's log of cooked batches at
(epoch, offset) (`log`), the rule that commits its entries (`commit`), a leader's
bookkeeping (`leader`), the transport of appends and forwarded writes on the peer
port (`wire`, `peer`), what a log entry holds (`entries`), one shard's role on a
running site (`replica`: leader loop, followers' appliers, forwarding) and a site's
replication as a whole (`cluster`: the shard replicas, the kept placement, the peer
port). Not built here: the controller (it pushes placements to the sites), replica
transitions (bootstrap from a checkpoint), the commit feed to sites that hold no
replica of a shard.
"""

from .commit import commit_offset, majority
from .leader import AppendRequest, Leadership
from .log import START, AppendResult, Entry, LogGapError, Position, ShardLog, StaleEpochError
from .placement import (
    Placement,
    ShardId,
    ShardPlacement,
    Transition,
    apply_transition,
    apply_transitions,
)
from .planner import FIRST_EPOCH, Plan, Site, failover, plan
from .store import PlacementStore

__all__ = [
    "FIRST_EPOCH",
    "START",
    "AppendRequest",
    "AppendResult",
    "Entry",
    "Leadership",
    "LogGapError",
    "Placement",
    "PlacementStore",
    "Plan",
    "Position",
    "ShardId",
    "ShardLog",
    "ShardPlacement",
    "Site",
    "StaleEpochError",
    "Transition",
    "apply_transition",
    "apply_transitions",
    "commit_offset",
    "failover",
    "majority",
    "plan",
]
