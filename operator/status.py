"""A DurableStorage's `status` from what the operator observed: its pods, its
StatefulSet and the site id each ready pod's broker reported. Pure, so every phase
and condition is unit-tested.

Phase: Ready when every site asked for is ready and reported its id; Pending while the
StatefulSet is still rolling out (created, scaled or a new config rolling through the
pods); Degraded when it has rolled out but a site is not ready. Replication between
sites is not built, so nothing is ever Rebalancing and shards are not reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .kube import PodView
from .resources import selector

REPLICATION_NOT_BUILT = "ReplicationNotBuilt"


@dataclass(frozen=True, slots=True)
class Observed:
    name: str
    generation: int
    sites: int  # spec.sites
    pods: list[PodView]
    stateful_set: dict[str, Any] | None  # its status and "generation"
    site_ids: dict[str, str]  # pod name -> site id (see known_site_ids)


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
    return (found.get("observedGeneration", 0) >= found["generation"]
            and found.get("replicas", 0) == observed.sites
            and found.get("updatedReplicas", 0) == observed.sites
            and found.get("currentRevision") == found.get("updateRevision")
            and len(live) == observed.sites)


def _condition(type_: str, true: bool, reason: str, message: str, generation: int,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if true else "False"
    before = previous.get(type_)
    # The time it last changed, not the time it was last looked at.
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def compute_status(observed: Observed, previous_conditions: list[dict[str, Any]],
                   now: str) -> dict[str, Any]:
    """The whole `status` (less what other handlers own); `now`: an RFC 3339 time."""
    live = [pod for pod in observed.pods if not pod.terminating]
    ready = [pod for pod in live if pod.ready]
    missing_ids = [pod.name for pod in ready if pod.name not in observed.site_ids]
    # Asked of the ready pods only; a pod answered for is in site_ids.
    done = rolled_out(observed)
    all_ready = done and len(ready) == observed.sites and not missing_ids

    if all_ready:
        phase, reason = "Ready", "AllSitesReady"
        message = f"{observed.sites} of {observed.sites} sites ready"
    elif not done:
        phase, reason = "Pending", "RollingOut"
        message = (f"{len(ready)} of {observed.sites} sites ready; the StatefulSet is "
                   f"rolling out (created, scaled or a new config)")
    else:
        phase, reason = "Degraded", "SitesNotReady"
        not_ready = [pod.name for pod in live if not pod.ready]
        message = f"{len(ready)} of {observed.sites} sites ready"
        if not_ready:
            message += "; not ready: " + ", ".join(not_ready)
        if missing_ids:
            message += "; admin API not answering: " + ", ".join(missing_ids)

    previous = {condition["type"]: condition for condition in previous_conditions}
    conditions = [
        _condition("Ready", all_ready, reason, message, observed.generation, previous, now),
        _condition("Degraded", phase == "Degraded", reason, message, observed.generation,
                   previous, now),
        _condition("Rebalancing", False, REPLICATION_NOT_BUILT,
                   "replication between sites is not built: each site holds its own data",
                   observed.generation, previous, now),
    ]
    return {
        "phase": phase,
        "observedGeneration": observed.generation,
        "conditions": conditions,
        "replicas": len(live),
        "readyReplicas": len(ready),
        "selector": selector(observed.name),
        "pendingTransitions": 0,
        "sites": [{"id": observed.site_ids[pod.name], "pod": pod.name, "ready": pod.ready}
                  for pod in live if pod.name in observed.site_ids],
    }


def invalid_conditions(previous_conditions: list[dict[str, Any]], message: str,
                       generation: int, now: str) -> list[dict[str, Any]]:
    """The conditions of a spec the broker would refuse (phase Failed): not Ready."""
    previous = {condition["type"]: condition for condition in previous_conditions}
    return [_condition("Ready", False, "InvalidConfig", message, generation, previous, now),
            _condition("Degraded", False, "InvalidConfig", message, generation, previous, now),
            _condition("Rebalancing", False, REPLICATION_NOT_BUILT,
                       "replication between sites is not built: each site holds its own data",
                       generation, previous, now)]
