"""Replication of the durable storage across sites (docs/replication.md).

The placement data model (`placement`), the pure planner that the local cluster
controller and the Kubernetes operator share (`planner`), the site's on-disk copy of
the placement (`store`), each shard's log of cooked batches at (epoch, offset)
(`log`), the rule that commits its entries (`commit`), a leader's bookkeeping
(`leader`), the transport of appends, fences and forwarded writes on the peer port
(`wire`, `peer`), what a log entry holds (`entries`), one shard's role on a running
site (`replica`) and its parts (`replica_context`: what they share; `takeover`;
writes and forwarding in `writes`; the leader's `senders`; the `applier`; `reads`;
checkpoint installs in `installer`), log trimming and replica bootstrap from
checkpoints (`trim`, `bootstrap`), reads of shards held elsewhere (`remote`, served by
`remote_service`, its bytes in `remote_wire`) and a site's replication as a whole
(`site_replication`: the controller's pushes it keeps in `kept_placement`, the peer
port's requests it answers in `peer_requests`). The relay
to sites without a replica lives in `broker/routing`, a `PeerService` on the same peer
port.
The controller that pushes placements lives in `broker/controller`.
"""

from .commit import commit_offset, majority
from .leader import AppendRequest, Leadership, tail_for
from .log import START, AppendResult, Entry, LogGapError, Position, ShardLog, StaleEpochError
from .placement import (
    Placement,
    ShardId,
    ShardPlacement,
    Transition,
    apply_transition,
    apply_transitions,
)
from .planner import FIRST_EPOCH, Plan, PlannedSite, breaks_zone_rule, failover, plan
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
    "PlannedSite",
    "Position",
    "ShardId",
    "ShardLog",
    "ShardPlacement",
    "StaleEpochError",
    "Transition",
    "apply_transition",
    "apply_transitions",
    "breaks_zone_rule",
    "commit_offset",
    "failover",
    "majority",
    "plan",
    "tail_for",
]
