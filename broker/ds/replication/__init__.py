"""Replication of the durable storage across sites (DESIGN.md, "Replication").

Built so far: the placement data model (`placement`), the pure planner that the
local cluster supervisor and the Kubernetes operator share (`planner`), and the
site's on-disk copy of the placement (`store`). The log shipping, quorum commit and
the controller come later.
"""

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
    "Placement",
    "PlacementStore",
    "Plan",
    "ShardId",
    "ShardPlacement",
    "Site",
    "Transition",
    "apply_transition",
    "apply_transitions",
    "failover",
    "plan",
]
