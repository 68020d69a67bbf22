"""A DurableStorage's `status` from what the operator observed: its pods, its
StatefulSet and the site id each ready pod's broker reported. Pure, so every phase
and condition is unit-tested.

Phase: Ready when every site asked for is ready and reported its id; Pending while the
StatefulSet is still rolling out (created, scaled or a new config rolling through the
pods); Degraded when it has rolled out but a site is not ready, or a shard is
under-replicated or without a leader that answers, or the spec's goal has no plan
(say a replication factor above the sites); Pending too until the controller
(controller.py) has run a round with the current spec (a scale's plan is made there);
Rebalancing while the controller runs a plan. The pods kept are spec.sites, or more
while departing pods still hold replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .kube import PodView
from .resources import site_selector


@dataclass(frozen=True)
class ReplicationView:
    """What the controller (controller.py) knows of replication, for the status: per
    database its shards' leaders, epochs and replicas, and the totals."""

    placed: bool
    databases: list[dict[str, Any]]
    under_replicated: int
    leaderless: int
    pending: int
    rebalancing: bool
    # The storage's metadata.generation whose spec the controller's last round followed.
    generation: int
    # Why the spec's goal has no plan ("": it has one, or needs none).
    no_plan: str = ""


@dataclass(frozen=True, slots=True)
class Observed:
    name: str
    generation: int
    sites: int  # spec.sites
    pods: list[PodView]
    stateful_set: dict[str, Any] | None  # its status and "generation"
    site_ids: dict[str, str]  # pod name -> site id (see known_site_ids)
    # None until the controller has run; `kept`: the pods the StatefulSet keeps (more
    # than `sites` while departing pods still hold replicas; 0: `sites`).
    replication: ReplicationView | None = None
    kept: int = 0
    # The metadata.generation of the spec `sites` was read from: the controller must
    # have followed it before the status may say Ready (a scale's plan comes from it).
    spec_generation: int = 0


def known_site_ids(previous_sites: list[dict[str, Any]],
                   answered: dict[str, str]) -> dict[str, str]:
    """Pod name -> site id: the ids just answered, and for the pods not asked (not
    ready) the ids the last status had, so a site that stops being ready is still
    listed, as not ready."""
    known = {site["pod"]: site["id"] for site in previous_sites if "pod" in site}
    return known | answered


def rolled_out(observed: Observed) -> bool:
    """The StatefulSet has acted on its newest spec and every pod runs its newest
    template (a scale or a config change is done)."""
    found = observed.stateful_set
    if found is None:
        return False
    live = [pod for pod in observed.pods if not pod.terminating]
    kept = max(observed.kept, observed.sites)
    return (found.get("observedGeneration", 0) >= found["generation"]
            and found.get("replicas", 0) == kept
            and found.get("updatedReplicas", 0) == kept
            and found.get("currentRevision") == found.get("updateRevision")
            and len(live) == kept)


def _condition(type_: str, true: bool, reason: str, message: str, generation: int,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if true else "False"
    before = previous.get(type_)
    # The time it last changed, not the time it was last looked at.
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def _replication_conditions(replication: ReplicationView | None) -> tuple[bool, str, str]:
    """(Rebalancing, reason, message)."""
    if replication is None or not replication.placed:
        return False, "NotPlaced", "no placement yet: waiting for the sites"
    if replication.rebalancing:
        return True, "PlanRunning", (f"{replication.pending} replica transitions to go")
    return False, "Balanced", "every database is on the sites asked for"


def compute_status(observed: Observed, previous_conditions: list[dict[str, Any]],
                   now: str) -> dict[str, Any]:
    """The whole `status` (less what other handlers own); `now`: an RFC 3339 time."""
    live = [pod for pod in observed.pods if not pod.terminating]
    ready = [pod for pod in live if pod.ready]
    missing_ids = [pod.name for pod in ready if pod.name not in observed.site_ids]
    # Asked of the ready pods only; a pod answered for is in site_ids.
    done = rolled_out(observed)
    kept = max(observed.kept, observed.sites)
    all_ready = done and len(ready) == kept and not missing_ids
    replication = observed.replication
    placed = replication is not None and replication.placed
    departing = kept - observed.sites
    counted = f"{len(ready)} of {kept} sites ready" + (
        f" ({departing} departing, their replicas moving off first)" if departing else "")

    if not done:
        phase, reason = "Pending", "RollingOut"
        message = f"{counted}; the StatefulSet is rolling out (created, scaled or a new config)"
    elif not all_ready:
        phase, reason = "Degraded", "SitesNotReady"
        not_ready = [pod.name for pod in live if not pod.ready]
        message = counted
        if not_ready:
            message += "; not ready: " + ", ".join(not_ready)
        if missing_ids:
            message += "; admin API not answering: " + ", ".join(missing_ids)
    elif replication is None or not placed:
        phase, reason = "Pending", "Placing"
        message = f"{counted}; waiting for the first placement of the shards"
    elif replication.leaderless:
        phase, reason = "Degraded", "NoLeader"
        message = f"{counted}; {replication.leaderless} shards without a leader that answers"
    elif replication.under_replicated:
        phase, reason = "Degraded", "UnderReplicated"
        message = f"{counted}; {replication.under_replicated} shards under-replicated"
    elif replication.no_plan:
        phase, reason = "Degraded", "NoPlan"
        message = f"{counted}; {replication.no_plan}"
    elif replication.generation < observed.spec_generation:
        phase, reason = "Pending", "Planning"
        message = (f"{counted}; the replication controller has not yet followed "
                   f"generation {observed.spec_generation}")
    elif replication.rebalancing:
        phase, reason = "Rebalancing", "PlanRunning"
        message = f"{counted}; {replication.pending} replica transitions to go"
    else:
        phase, reason = "Ready", "AllSitesReady"
        message = f"{counted}; every shard fully replicated"
    serving = all_ready and placed and replication is not None and not replication.leaderless

    rebalancing, rebalance_reason, rebalance_message = _replication_conditions(replication)
    previous = {condition["type"]: condition for condition in previous_conditions}
    conditions = [
        _condition("Ready", serving, "AllSitesReady" if serving else reason,
                   message, observed.generation, previous, now),
        _condition("Degraded", phase == "Degraded", reason, message, observed.generation,
                   previous, now),
        _condition("Rebalancing", rebalancing, rebalance_reason, rebalance_message,
                   observed.generation, previous, now),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": observed.generation,
        "conditions": conditions,
        "replicas": len(live),
        "readyReplicas": len(ready),
        "selector": site_selector(observed.name),
        "underReplicatedShards": 0 if replication is None else replication.under_replicated,
        "pendingTransitions": 0 if replication is None else replication.pending,
        "sites": [{"id": observed.site_ids[pod.name], "pod": pod.name, "ready": pod.ready}
                  for pod in live if pod.name in observed.site_ids],
    }
    if replication is not None:
        status["databases"] = replication.databases
    return status


def invalid_conditions(previous_conditions: list[dict[str, Any]], message: str,
                       generation: int, now: str) -> list[dict[str, Any]]:
    """The conditions of a spec the broker would refuse (phase Failed): not Ready."""
    previous = {condition["type"]: condition for condition in previous_conditions}
    return [_condition("Ready", False, "InvalidConfig", message, generation, previous, now),
            _condition("Degraded", False, "InvalidConfig", message, generation, previous, now),
            _condition("Rebalancing", False, "InvalidConfig", message, generation, previous,
                       now)]
