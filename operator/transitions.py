"""A plan's steps as ReplicaTransition objects (one per step, owned by the storage,
labelled with it and with their plan), and the phase each step is in: named per plan
so that two plans from one placement version never share a name, numbered so that
`kubectl get` lists a plan's steps in order. Pure; StorageController (controller.py)
makes them and moves their phases along."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from stratamq.broker.controller.decisions import ClusterState
from stratamq.broker.ds.replication import Placement, Plan, Transition
from stratamq.broker.errors import PlanError

from .phases import ADD_PHASES, REMOVE_PHASES, TransitionPhase
from .rebalance import MESSAGE_ANNOTATION, TRIGGER_ANNOTATION, PlanRun
from .resources import GROUP, Owner, labels

TRANSITION_API = f"{GROUP}/v1alpha1"
TRANSITION_KIND = "ReplicaTransition"
STORAGE_LABEL = f"{GROUP}/durable-storage"
PLAN_LABEL = f"{GROUP}/plan"
# A ReplicaTransition's name is a DNS subdomain (at most 253 characters); its step
# number has at least this many digits, more in a plan with more steps, so that
# `kubectl get` (which sorts by name) lists a plan's steps in order.
NAME_LIMIT = 253
STEP_DIGITS = 3


def plan_key(plan: Plan) -> str:
    """Names a plan's ReplicaTransitions: two plans may start from one version (a goal
    changed before a step was taken), so the start version alone is not enough."""
    return f"{plan.start.version}-{hashlib.sha256(plan.to_json().encode()).hexdigest()[:6]}"


def transition_name(storage: str, plan: Plan, step: int) -> str:
    """`<storage>-<plan key>-<step>`, the step zero-padded to the plan's width; a
    storage name too long for the limit is cut (the labels still name it whole)."""
    width = max(STEP_DIGITS, len(str(len(plan.transitions) - 1)))
    suffix = f"-{plan_key(plan)}-{step:0{width}d}"
    return storage[:NAME_LIMIT - len(suffix)].rstrip("-.") + suffix


def transition_manifest(owner: Owner, plan: Plan, step: int, transition: Transition,
                        pod: str = "", run: PlanRun | None = None) -> dict[str, Any]:
    """The step's ReplicaTransition; `pod`: the pod that holds its site (when known),
    `run`: why its plan was made (in annotations, for a restarted operator)."""
    meta_labels = {**labels(owner.name), STORAGE_LABEL: owner.name, PLAN_LABEL: plan_key(plan)}
    metadata: dict[str, Any] = {"name": transition_name(owner.name, plan, step),
                                "namespace": owner.namespace, "labels": meta_labels,
                                "ownerReferences": [owner.reference()]}
    if run is not None:
        metadata["annotations"] = {TRIGGER_ANNOTATION: run.trigger,
                                   MESSAGE_ANNOTATION: run.message}
    spec: dict[str, Any] = {"durableStorage": owner.name, "database": transition.database,
                            "shard": transition.shard,
                            "action": "Add" if transition.action == "add" else "Remove",
                            "site": transition.site, "step": step}
    if pod:
        spec["pod"] = pod
    return {"apiVersion": TRANSITION_API, "kind": TRANSITION_KIND, "metadata": metadata,
            "spec": spec}


def step_phases(plan: Plan, state: ClusterState, versions: Mapping[str, int | None],
                bootstrapping: bool = False) -> list[TransitionPhase]:
    """The phase of each step of `plan` (the pending one) at `state`: the steps taken
    are Done, except the last one while it is under way (a `+site` Pending until its
    site took the placement, then bootstrapping from a checkpoint while the site says
    so, catching up, and Joined once caught up; a `-site` Removing until every site
    that answers took it); the rest Pending. `versions`: the placement version each
    site that answers has taken."""
    try:
        done = len(plan.transitions) - len(plan.remaining(state.placement))
    except PlanError:
        return [TransitionPhase.PENDING] * len(plan.transitions)
    phases = []
    for number, step in enumerate(plan.transitions):
        if number >= done:
            phases.append(TransitionPhase.PENDING)
        elif number < done - 1:
            phases.append(TransitionPhase.DONE)
        elif step.action == "add":
            if state.catch_up is None:
                phases.append(TransitionPhase.JOINED)
            elif (versions.get(step.site) or 0) < state.catch_up.version:
                # its site has not taken the placement yet
                phases.append(TransitionPhase.PENDING)
            else:
                phases.append(TransitionPhase.BOOTSTRAPPING if bootstrapping
                              else TransitionPhase.CATCHING_UP)
        else:
            behind = any(version is None or version < state.placement.version
                         for version in versions.values())
            phases.append(TransitionPhase.REMOVING if behind else TransitionPhase.DONE)
    return phases


def phase_path(action: str, current: str, target: TransitionPhase,
               bootstrapped: bool) -> list[TransitionPhase]:
    """The phases a step shows on its way from `current` to `target` (a round may
    find it several phases on: a join that caught up between two rounds went through
    CatchingUp and Joined; Bootstrapping only where its site bootstrapped). Failed,
    and any move back (a site bootstrapping again after a restart), go straight."""
    if target == current:
        return []
    order = ADD_PHASES if action == "add" else REMOVE_PHASES
    if target == TransitionPhase.FAILED or current not in order or target not in order:
        return [target]
    start, end = order.index(current), order.index(target)
    if end < start:
        return [target]
    return [phase for phase in order[start + 1:end]
            if phase != TransitionPhase.BOOTSTRAPPING or bootstrapped] + [target]


def taken_steps(plan: Plan, placement: Placement) -> int | None:
    """How many of the plan's steps `placement` has taken; None when it is not on the
    plan's way (a failover changed it)."""
    try:
        return len(plan.transitions) - len(plan.remaining(placement))
    except PlanError:
        return None
