"""Replication of the durable storage across sites (DESIGN.md, "Replication").

Built so far: the placement data model (`placement`), the pure planner that the
local cluster supervisor and the Kubernetes operator share (`planner`), the site's
on-disk copy of the placement (`store`), each shard's log of cooked batches at
(epoch, offset) (`log`), the rule that commits its entries (`commit`), a leader's
bookkeeping (`leader`) and the transport of appends on the peer port (`wire`,
`peer`). Not built yet: the shard leader's loop in a running site (writers answered
on commit, committed entries applied on every replica), the controller, failover in
action, replica transitions, the broker as a cluster.
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
