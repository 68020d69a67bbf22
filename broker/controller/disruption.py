"""How many sites may be taken down at once (a node drain, an upgrade) without a shard
losing its quorum: pure, from what the controller knows (docs/replication.md, "The
controller"). The Kubernetes operator sets the sites' PodDisruptionBudget from it.

A replica counts only when it is caught up: its site is up and its log holds what the
shard's leader committed (`decisions.holds_committed`). A Ready pod whose replica is
still catching up (a site back from a restart, a replica just added) does not count,
since taking another replica of that shard down leaves too few that can acknowledge
a write. Taking one site down takes at most one replica of each shard, so a shard
with `spare` caught-up replicas beyond its majority tolerates `spare` sites going.

The controller probes its sites one after the other, so under load a follower's log
end is always a little short of what its leader, probed later, calls committed. A
follower is therefore measured against what the leader reported committed one round
earlier (`earlier`): caught up means at most about a heartbeat behind."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..ds.replication import Placement, ShardPlacement
from ..ds.replication.commit import majority
from .decisions import Settings, holds_committed, is_gone
from .sites import SiteState


def caught_up_replicas(shard: ShardPlacement, sites: Mapping[str, SiteState],
                       earlier: Mapping[str, SiteState], now: float,
                       settings: Settings) -> list[str]:
    """The replicas of `shard` that are up and hold what its leader reported committed
    in the round before (`earlier`; this round's report when it has none of the same
    epoch); none while its leader is down or has not reported the shard (nothing is
    known then)."""
    def up(site: SiteState | None) -> bool:
        return site is not None and site.answered and not is_gone(site, now, settings)

    leader = sites.get(shard.leader)
    if leader is None or not up(leader):
        return []
    leader_report = leader.shards.get(shard.id)
    if leader_report is None or leader_report.epoch != shard.epoch:
        return []
    before = earlier.get(shard.leader)
    before_report = None if before is None else before.shards.get(shard.id)
    if before_report is not None and before_report.epoch == leader_report.epoch:
        leader_report = replace(leader_report, committed=min(before_report.committed,
                                                             leader_report.committed))
    found = []
    for name in shard.replicas:
        site = sites.get(name)
        if site is None or not up(site):
            continue
        report = site.shards.get(shard.id)
        if report is not None and holds_committed(report, leader_report):
            found.append(name)
    return found


def tolerated_disruptions(placement: Placement, sites: Mapping[str, SiteState],
                          earlier: Mapping[str, SiteState], now: float,
                          settings: Settings) -> int | None:
    """How many sites may go down at once with every shard keeping a majority of its
    replicas caught up: the least spare of any shard, at least 0. None before the
    first placement (nothing is placed, so nothing to protect yet)."""
    if placement.version == 0 or not placement.shards:
        return None
    spares = (len(caught_up_replicas(shard, sites, earlier, now, settings))
              - majority(len(shard.replicas)) for shard in placement.shards)
    return max(0, min(spares))


def quorum_tolerance(replication_factor: int) -> int:
    """How many replicas of a shard may be down with its majority left: what a
    healthy cluster tolerates (1 at replication factor 3, 2 at 5, 0 at 1 or 2)."""
    return replication_factor - majority(replication_factor)
