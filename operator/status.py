"""A DurableStorage's `status` from what the operator observed: its pods, its
StatefulSet and the site id each ready pod's broker reported. Pure, so every phase
and condition is unit-tested.

Phase: Ready when every site asked for is ready and reported its id. A planned change
in progress has a phase of its own and is never Degraded (no Warning event): Rolling
while the StatefulSet replaces its pods one at a time (a new config), Scaling while it
makes or removes pods or a scale's new pods start (pods never known as sites),
Rebalancing while the controller runs a plan (shards short of a replica the plan adds
included), Pending before the first placement and until the controller (controller.py)
has run a round with the current spec (a scale's plan is made there). Degraded is what
nothing planned explains: a known site not ready once the StatefulSet rolled out, a
roll or a scale stuck (a pod not ready for longer than
spec.updateStrategy.progressDeadlineSeconds: it crashes, has no image, cannot be
scheduled), a shard under-replicated with no plan running, a goal with no plan (say
a replication factor above the sites), and always a shard without a leader that
answers. The pods
kept are spec.sites, or more while departing pods still hold replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .kube import PodView
from .phases import ConditionType, Reason, StoragePhase
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
    # Before the first placement: what the controller waits for ("": nothing said).
    waiting: str = ""
    # The plan running, or the last one, summarised (rebalance.py); None: none known.
    rebalance: dict[str, Any] | None = None


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
    # The pods spec.updateStrategy keeps on the previous template (paused: all of them;
    # else those below the partition): a roll held there is done, as asked.
    held: int = 0
    # The image the sites are given (spec.image resolved by the operator).
    image: str = ""
    # When it was observed (epoch seconds), and how long a pod may stay not ready while
    # a roll or a scale is under way (spec.updateStrategy.progressDeadlineSeconds).
    now: float = 0.0
    progress_deadline: float = 600.0


def known_site_ids(previous_sites: list[dict[str, Any]],
                   answered: dict[str, str]) -> dict[str, str]:
    """Pod name -> site id: the ids just answered, and for the pods not asked (not
    ready) the ids the last status had, so a site that stops being ready is still
    listed, as not ready."""
    known = {site["pod"]: site["id"] for site in previous_sites if "pod" in site}
    return known | answered


def rolled_out(observed: Observed) -> bool:
    """The StatefulSet has acted on its newest spec and every pod runs its newest
    template (a scale or a config change is done), but for the pods spec.updateStrategy
    holds on the previous one."""
    found = observed.stateful_set
    if found is None:
        return False
    live = [pod for pod in observed.pods if not pod.terminating]
    kept = max(observed.kept, observed.sites)
    updated = found.get("updatedReplicas", 0)
    every_pod = updated == kept and found.get("currentRevision") == found.get("updateRevision")
    # while the strategy holds pods, the revisions differ until it lets them go
    as_held = observed.held > 0 and updated >= kept - min(observed.held, kept)
    return (found.get("observedGeneration", 0) >= found["generation"]
            and found.get("replicas", 0) == kept and (every_pod or as_held)
            and len(live) == kept)


def held_back(observed: Observed) -> int:
    """How many pods run the previous template because spec.updateStrategy holds them."""
    found = observed.stateful_set or {}
    if found.get("currentRevision") == found.get("updateRevision"):
        return 0
    kept = max(observed.kept, observed.sites)
    updated: int = found.get("updatedReplicas", 0)
    return max(0, kept - updated)


def _condition(type_: ConditionType, true: bool, reason: Reason, message: str, generation: int,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if true else "False"
    before = previous.get(type_)
    # The time it last changed, not the time it was last looked at.
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since}


def _replication_conditions(replication: ReplicationView | None
                             ) -> tuple[bool, Reason, str]:
    """(Rebalancing, reason, message)."""
    if replication is None or not replication.placed:
        return False, Reason.NOT_PLACED, "no placement yet: waiting for the sites"
    if replication.rebalancing:
        return True, Reason.PLAN_RUNNING, (f"{replication.pending} replica transitions to go")
    return False, Reason.BALANCED, "every database is on the sites asked for"


def _scaling(observed: Observed, live: list[PodView]) -> bool:
    """The StatefulSet is making or removing pods (a scale), rather than replacing them
    (a roll): its pod count, or the pods there, differ from the count kept."""
    found = observed.stateful_set or {}
    kept = max(observed.kept, observed.sites)
    return (found.get("observedGeneration", 0) >= found.get("generation", 0)
            and found.get("replicas", 0) != kept) or len(live) != kept


def stuck_pods(observed: Observed, live: list[PodView]) -> list[str]:
    """The live pods not ready for longer than the progress deadline: a roll or a
    scale waits on them for ever (the StatefulSet goes on only once each is ready)."""
    return [pod.name for pod in live if not pod.ready and pod.not_ready_since is not None
            and observed.now - pod.not_ready_since > observed.progress_deadline]


def _stuck(observed: Observed, live: list[PodView], counted: str
           ) -> tuple[StoragePhase, Reason, str] | None:
    stuck = stuck_pods(observed, live)
    if not stuck:
        return None
    return StoragePhase.DEGRADED, Reason.ROLLOUT_STUCK, (
        f"{counted}; not ready for more than {observed.progress_deadline:.0f} s, the roll "
        f"or scale waits on them: {', '.join(stuck)} (kubectl describe pod: a crash, an "
        f"image not pulled, no node to run on; or a site still catching its replicas up)")


def _phase(observed: Observed, done: bool, all_ready: bool, counted: str,
           live: list[PodView], missing_ids: list[str]) -> tuple[StoragePhase, Reason, str]:
    """(phase, reason, message). A planned change in progress (a roll, a scale, a
    plan) is a phase of its own, not Degraded: pods restarting or starting, and shards
    short of a replica while the plan that fixes them runs, are what it does. Degraded
    is what nothing planned explains (issue 21, defect 7), and always a shard without
    a leader that answers."""
    replication = observed.replication
    placed = replication is not None and replication.placed
    leaderless = f"{counted}; {replication.leaderless if replication else 0} shards " \
        "without a leader that answers"
    # A roll or a scale (or a scale's new pods starting) that waits on a pod for
    # longer than the deadline; a shard without a leader says more.
    waiting = not done or (not all_ready and _starting(observed, live, missing_ids) is not None)
    stuck = _stuck(observed, live, counted) if waiting else None
    if stuck is not None and not (placed and replication is not None
                                  and replication.leaderless):
        return stuck
    if not done and (observed.stateful_set is None or not placed):
        return StoragePhase.PENDING, Reason.ROLLING_OUT, (
            f"{counted}; the StatefulSet is rolling out (created, scaled or a new config)")
    if replication is not None and placed and replication.leaderless:
        return StoragePhase.DEGRADED, Reason.NO_LEADER, leaderless
    if not done and _scaling(observed, live):
        return (StoragePhase.SCALING, Reason.SCALING,
                f"{counted}; the StatefulSet is scaling to them")
    if not done:
        return StoragePhase.ROLLING, Reason.ROLLING_OUT, (
            f"{counted}; a new pod template is rolling through the pods, one at a time")
    if not all_ready:
        starting = _starting(observed, live, missing_ids)
        if starting is not None:
            # Every pod short of being a site never was one: a scale's new pods
            # starting (or, before the first placement, the first ones).
            return (StoragePhase.SCALING if placed else StoragePhase.PENDING), Reason.SCALING, (
                f"{counted}; new sites starting: " + ", ".join(starting))
        message = counted
        not_ready = [pod.name for pod in live if not pod.ready]
        if not_ready:
            message += "; not ready: " + ", ".join(not_ready)
        if missing_ids:
            message += "; admin API not answering: " + ", ".join(missing_ids)
        return StoragePhase.DEGRADED, Reason.SITES_NOT_READY, message
    if replication is None or not placed:
        why = f" ({replication.waiting})" if replication and replication.waiting else ""
        return StoragePhase.PENDING, Reason.PLACING, (
            f"{counted}; waiting for the first placement of the shards{why}")
    if replication.under_replicated and not replication.rebalancing:
        return StoragePhase.DEGRADED, Reason.UNDER_REPLICATED, (
            f"{counted}; {replication.under_replicated} shards under-replicated")
    if replication.no_plan:
        return StoragePhase.DEGRADED, Reason.NO_PLAN, f"{counted}; {replication.no_plan}"
    if replication.generation < observed.spec_generation:
        return StoragePhase.PENDING, Reason.PLANNING, (
            f"{counted}; the replication controller has not yet followed "
            f"generation {observed.spec_generation}")
    if replication.rebalancing:
        short = (f", {replication.under_replicated} shards short of a replica until it ends"
                 if replication.under_replicated else "")
        return StoragePhase.REBALANCING, Reason.PLAN_RUNNING, (
            f"{counted}; {replication.pending} replica transitions to go{short}")
    return StoragePhase.READY, Reason.ALL_SITES_READY, f"{counted}; every shard fully replicated"


def _starting(observed: Observed, live: list[PodView], missing_ids: list[str]
              ) -> list[str] | None:
    """The pods short of being a site (not ready, or not answering with their id),
    when none of them ever was one (a scale's new pods starting); else None."""
    starting = [pod.name for pod in live
                if pod.name not in observed.site_ids or pod.name in missing_ids]
    if len(starting) != len([pod for pod in live if not pod.ready]) + len(missing_ids):
        return None
    return sorted(starting)


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
    held = held_back(observed) if done else 0
    if held:
        counted += (f"; {held} held on the previous pod template by spec.updateStrategy "
                    f"(paused or partition)")

    phase, reason, message = _phase(observed, done, all_ready, counted, live, missing_ids)
    serving = all_ready and placed and replication is not None and not replication.leaderless

    rebalancing, rebalance_reason, rebalance_message = _replication_conditions(replication)
    previous = {condition["type"]: condition for condition in previous_conditions}
    conditions = [
        _condition(ConditionType.READY, serving, Reason.ALL_SITES_READY if serving else reason,
                   message, observed.generation, previous, now),
        _condition(ConditionType.DEGRADED, phase == StoragePhase.DEGRADED, reason, message,
                   observed.generation, previous, now),
        _condition(ConditionType.REBALANCING, rebalancing, rebalance_reason,
                   rebalance_message, observed.generation, previous, now),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": observed.generation,
        "conditions": conditions,
        "replicas": len(live),
        "readyReplicas": len(ready),
        "updatedReplicas": (observed.stateful_set or {}).get("updatedReplicas", 0),
        "image": observed.image,
        "selector": site_selector(observed.name),
        "underReplicatedShards": 0 if replication is None else replication.under_replicated,
        "pendingTransitions": 0 if replication is None else replication.pending,
        "sites": [{"id": observed.site_ids[pod.name], "pod": pod.name, "ready": pod.ready,
                   **({} if pod.zone is None else {"zone": pod.zone})}
                  for pod in live if pod.name in observed.site_ids],
    }
    if replication is not None:
        status["databases"] = replication.databases
        if replication.rebalance is not None:
            status["rebalance"] = replication.rebalance
    return status


def invalid_conditions(previous_conditions: list[dict[str, Any]], message: str,
                       generation: int, now: str) -> list[dict[str, Any]]:
    """The conditions of a spec the broker would refuse (phase Failed): not Ready."""
    previous = {condition["type"]: condition for condition in previous_conditions}
    return [_condition(type_, False, Reason.INVALID_CONFIG, message, generation, previous, now)
            for type_ in ConditionType]
