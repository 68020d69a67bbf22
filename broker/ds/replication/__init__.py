"""Replication of the durable storage across sites (DESIGN.md, "Replication").

Built so far: the placement data model (`placement`). The planner, the site's
on-disk copy of the placement, the log shipping, quorum commit and the controller
come later.
"""

from .placement import Placement, ShardId, ShardPlacement, Transition, apply_transition

__all__ = [
    "Placement",
    "ShardId",
    "ShardPlacement",
    "Transition",
    "apply_transition",
]
