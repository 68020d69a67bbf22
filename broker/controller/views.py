"""The JSON documents of the controller's cluster API, after EMQX's `/ds/sites` and
`/ds/storages`: plain functions of the controller's state and its sites' reports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..ds.replication import Placement, ShardPlacement, Transition
from ..errors import PlanError
from .decisions import ClusterState, Settings, goal_of, is_gone
from .sites import SiteState

Json = dict[str, Any]


def site_view(site: SiteState, placement: Placement, now: float, settings: Settings) -> Json:
    """A site: whether it is up, where it is, and its shards with the role the
    placement gives it and the one it reports."""
    up = site.answered and not is_gone(site, now, settings)
    shards = []
    for shard in placement.shards:
        if site.id not in shard.replicas:
            continue
        report = site.shards.get(shard.id)
        shards.append({
            "storage": shard.database, "id": shard.shard, "leader": shard.leader,
            "role": "leader" if shard.leader == site.id else "follower",
            "reported_role": None if report is None else report.role,
            "applied": None if report is None else report.applied,
        })
    return {
        "site": site.id,
        "up": up,
        "admin_url": site.admin_url,
        "peer": site.peer,
        "zone": site.zone,
        "last_seen_seconds_ago": round(now - site.last_seen, 3) if site.answered else None,
        "placement_version": site.placement_version,
        "shards": shards,
    }


def storage_summary(database: str, state: ClusterState, settings: Settings) -> Json:
    return {"name": database, "n_shards": state.placement.n_shards(database),
            "replication_factor": settings.replication_factor}


def _remaining(state: ClusterState) -> tuple[Transition, ...]:
    if state.plan is None:
        return ()
    try:
        return state.plan.remaining(state.placement)
    except PlanError:  # until the next round plans again from the placement
        return ()


def _pending(state: ClusterState, shard: ShardPlacement) -> list[str]:
    """The shard's steps still to do, `+site` / `-site`, the one catching up first."""
    steps = [step for step in _remaining(state) if step.shard_id == shard.id]
    found = [("+" if step.action == "add" else "-") + step.site for step in steps]
    found[:0] = [f"+{catch_up.site} (catching up)" for catch_up in state.catch_ups
                 if catch_up.shard == shard.id]
    return found


def storage_view(database: str, state: ClusterState, sites: Mapping[str, SiteState],
                 settings: Settings) -> Json:
    """A database: per shard the replica set, leader, epoch, the leader's committed
    offset, each replica's lag (committed entries it has not applied; null when not
    reported) and the pending transitions; then the whole plan."""
    shards = []
    for shard in state.placement.shards_of(database):
        leader = sites.get(shard.leader)
        leader_report = None if leader is None else leader.shards.get(shard.id)
        committed = None if leader_report is None else leader_report.committed
        lag: dict[str, int | None] = {}
        for replica in shard.replicas:
            site = sites.get(replica)
            report = None if site is None else site.shards.get(shard.id)
            lag[replica] = (None if report is None or committed is None
                            else max(0, committed - report.applied))
        shards.append({"id": shard.shard, "replicas": list(shard.replicas),
                       "leader": shard.leader, "epoch": shard.epoch, "committed": committed,
                       "lag": lag, "transitions": _pending(state, shard)})
    plan = [str(step) for step in _remaining(state) if step.database == database]
    return {**storage_summary(database, state, settings),
            "placement_version": state.placement.version,
            "sites": list(goal_of(state, database)),
            "plan": plan,
            "shards": shards}
