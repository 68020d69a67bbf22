"""A plan's steps as ReplicaTransition objects (one per step, owned by the storage,
labelled with it and with their plan), and the phase each step is in: named per plan
so that two plans from one placement version never share a name, numbered so that
`kubectl get` lists a plan's steps in order. The functions are pure; `Transitions`,
which each storage's controller (controller.py) builds and calls every round, makes
the objects and moves their phases along through the API."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from stratamq.broker.controller.decisions import CatchUp, ClusterState
from stratamq.broker.ds.replication import Placement, Plan, Transition
from stratamq.broker.errors import PlanError

from . import kube
from .phases import (
    ADD_PHASES,
    FINAL_PHASES,
    REMOVE_PHASES,
    PlanTrigger,
    TransitionPhase,
    TransitionReason,
)
from .rebalance import (
    MESSAGE_ANNOTATION,
    TRIGGER_ANNOTATION,
    PlanRun,
    run_of,
    stale_transitions,
)
from .resources import GROUP, Owner, labels
from .sites import Bootstraps
from .times import timestamp

log = logging.getLogger(__name__)

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


def catching_up_steps(plan: Plan, state: ClusterState) -> dict[int, CatchUp]:
    """The taken `+site` steps whose replica is still catching up (by step number):
    for each of `state`'s catch-ups, the last step taken that added its site to its
    shard."""
    done = taken_steps(plan, state.placement) or 0
    found: dict[int, CatchUp] = {}
    for catch_up in state.catch_ups:
        numbers = [number for number, step in enumerate(plan.transitions[:done])
                   if step.action == "add" and step.shard_id == catch_up.shard
                   and step.site == catch_up.site]
        if numbers:
            found[numbers[-1]] = catch_up
    return found


def step_phases(plan: Plan, state: ClusterState, versions: Mapping[str, int | None],
                bootstrapping: Collection[int] = ()) -> list[TransitionPhase]:
    """The phase of each step of `plan` (the pending one) at `state`: the steps taken
    are Done, except those still under way, from the first whose replica is catching
    up (several shards may move at once) or else the last one taken: a `+site` Pending
    until its site took the placement, then bootstrapping from a checkpoint while the
    site says so (`bootstrapping`: those steps' numbers), catching up, and Joined once
    caught up; a `-site` Removing until every site that answers took it. The rest
    Pending. `versions`: the placement version each site that answers has taken."""
    done = taken_steps(plan, state.placement)
    if done is None:
        return [TransitionPhase.PENDING] * len(plan.transitions)
    catching = catching_up_steps(plan, state)
    under_way = min([done - 1, *catching])
    phases = []
    for number, step in enumerate(plan.transitions):
        if number >= done:
            phases.append(TransitionPhase.PENDING)
        elif number < under_way:
            phases.append(TransitionPhase.DONE)
        elif step.action == "add":
            catch_up = catching.get(number)
            if catch_up is None:
                phases.append(TransitionPhase.JOINED)
            elif (versions.get(step.site) or 0) < catch_up.version:
                # its site has not taken the placement yet
                phases.append(TransitionPhase.PENDING)
            else:
                phases.append(TransitionPhase.BOOTSTRAPPING if number in bootstrapping
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


def all_taken(plan: Plan, state: ClusterState) -> bool:
    """Every step of `plan` is taken at `state`'s placement (False when it is not on
    the plan's way)."""
    try:
        return not plan.remaining(state.placement)
    except PlanError:
        return False


class Transitions:
    """One storage's ReplicaTransitions, as its controller keeps them: made for each
    plan it runs, their phases moved along every round (through the phases passed
    between two rounds), the plans past spec.transitionHistoryLimit deleted, and the
    run of the plan as status.rebalance summarises it (`rebalance`, published whole
    for readers in other threads). Called from the controller's rounds, one at a
    time."""

    def __init__(self, owner: Owner, plan: Plan | None, history_limit: int) -> None:
        self.owner = owner
        # The plans whose ReplicaTransitions are kept (spec.transitionHistoryLimit).
        self.history_limit = history_limit
        self._phases: dict[str, str] = {}
        self._plan = plan  # whose ReplicaTransitions exist (or are being made)
        # Its steps whose ReplicaTransitions are not made yet (an API error stopped
        # their making: tried again every round).
        self._unmade: list[int] = []
        self._boots: Mapping[str, Bootstraps] = {}  # site -> its last report's bootstraps
        self._boot_base: dict[str, int] = {}  # `+site` step -> its checkpoints at the start
        self._bootstrapped: set[str] = set()  # `+site` steps whose site bootstrapped
        self._showed_bootstrap: set[str] = set()  # ... and whose phase said so
        # The plan running, or the last one, as status.rebalance summarises it: its
        # run, its steps' names, when it ended; published whole (`rebalance`).
        self._run: PlanRun | None = None
        self._run_names: tuple[str, ...] = ()
        self._run_ended: float | None = None
        self.rebalance: tuple[PlanRun, tuple[str, ...], float | None] | None = None

    def start(self, listed: list[dict[str, Any]], pods: Mapping[str, str]) -> None:
        """At the controller's start, from the storage's ReplicaTransitions as `listed`:
        the phases they have, the run of the plan resumed, the old plans pruned."""
        self.known_phases(listed)
        self.resume_run(listed, pods)
        self.prune_history(listed)

    def follow(self, state: ClusterState, pods: Mapping[str, str],
               boots: Mapping[str, Bootstraps], versions: Mapping[str, int | None],
               why: tuple[str, str] | None, limit: int) -> None:
        """Make the pending plan's ReplicaTransitions and move their phases along; the
        steps of a plan replaced before it ended are Failed, saying why. `state`: as
        this round kept it; `pods`: site -> its pod; `boots`: each site's bootstraps as
        it reported them; `versions`: the placement version each site that answers
        took; `why`: (trigger, message) when this round made a plan, else None;
        `limit`: spec.transitionHistoryLimit."""
        self.history_limit = limit
        self._boots = boots
        changed = self._plan != state.plan
        replaced = self._plan is not None and changed
        if self._plan is not None and self._plan != state.plan:
            finished = self._plan.target == state.placement or (
                state.plan is None and all_taken(self._plan, state))
            if finished:
                self._watch_bootstraps(self._plan, state)
            for number, step in enumerate(self._plan.transitions):
                name = transition_name(self.owner.name, self._plan, number)
                if self._phases.get(name) not in FINAL_PHASES:
                    if finished:
                        self._set_phase(name, step.action, TransitionPhase.DONE)
                    else:
                        self._set_phase(name, step.action, TransitionPhase.FAILED,
                                        TransitionReason.REPLANNED,
                                        "the plan was made again (a failover, or the "
                                        "sites asked for changed)")
            self._plan, self._unmade = None, []
            self._run_ended = time.time()
        if state.plan is None:
            if changed:
                self._publish_run()
                self.prune_history()
            return
        if self._plan != state.plan:
            self._plan = state.plan
            trigger, message = why or (
                (PlanTrigger.FAILOVER, "the plan running was made again around a failover")
                if replaced else (PlanTrigger.UNKNOWN, ""))
            self._run = PlanRun(key=plan_key(state.plan), trigger=trigger, message=message,
                                steps=len(state.plan.transitions), started=time.time())
            self._run_ended = None
            self._run_names = tuple(transition_name(self.owner.name, state.plan, number)
                                    for number in range(len(state.plan.transitions)))
            self._unmade = list(range(len(state.plan.transitions)))
            self._make_unmade(state.plan, pods)
            self.prune_history()
        else:
            self._make_unmade(state.plan, pods)
        bootstrapping = self._watch_bootstraps(state.plan, state)
        for number, phase in enumerate(step_phases(state.plan, state, versions, bootstrapping)):
            self._set_phase(transition_name(self.owner.name, state.plan, number),
                            state.plan.transitions[number].action, phase)
        self._publish_run()

    def _publish_run(self) -> None:
        """What status.rebalance summarises, for the controller's view() (read in other
        threads)."""
        if self._run is not None:
            phases = tuple(self._phases.get(name, TransitionPhase.PENDING)
                           for name in self._run_names)
            self.rebalance = (self._run, phases, self._run_ended)

    def prune_history(self, listed: list[dict[str, Any]] | None = None) -> None:
        """Delete the ReplicaTransitions of the plans older than the newest
        `history_limit` (the plan running always among those kept); `listed`: them
        as just listed, else listed here."""
        if listed is None:
            listed = kube.list_labeled(TRANSITION_API, TRANSITION_KIND, self.owner.namespace,
                                       f"{STORAGE_LABEL}={self.owner.name}")
        running = None if self._plan is None else plan_key(self._plan)
        stale = stale_transitions(listed, PLAN_LABEL, self.owner.uid, self.history_limit,
                                  running)
        for name in stale:
            kube.delete(TRANSITION_API, TRANSITION_KIND, self.owner.namespace, name)
            self._phases.pop(name, None)
        if stale:
            log.info("%s/%s: %d ReplicaTransitions of plans older than the last %d deleted",
                     self.owner.namespace, self.owner.name, len(stale), self.history_limit)

    def resume_run(self, listed: list[dict[str, Any]], pods: Mapping[str, str]) -> None:
        """At start: the run of the plan resumed, from its ReplicaTransitions (as
        `listed`); those missing are made (an operator before zero-padded names made
        them under others). `pods`: site -> its pod."""
        plan = self._plan
        if plan is None:
            return
        self._run = run_of(listed, PLAN_LABEL, plan_key(plan), len(plan.transitions)) or (
            PlanRun(key=plan_key(plan), trigger=PlanTrigger.UNKNOWN, message="",
                    steps=len(plan.transitions), started=time.time()))
        self._run_names = tuple(transition_name(self.owner.name, plan, number)
                                for number in range(len(plan.transitions)))
        there = {item["metadata"]["name"] for item in listed}
        self._unmade = [number for number in range(len(plan.transitions))
                        if self._run_names[number] not in there]
        self._make_unmade(plan, pods)
        self._publish_run()

    def _make_unmade(self, plan: Plan, pods: Mapping[str, str]) -> None:
        """Make the ReplicaTransitions of `plan`'s steps not made yet, each Pending;
        one the API server refuses, or does not answer for (a quota, an admission
        policy, the API server away), is said as a warning and made on a later
        round."""
        unmade = []
        for number in self._unmade:
            step = plan.transitions[number]
            manifest = transition_manifest(self.owner, plan, number, step,
                                           pods.get(step.site, ""), self._run)
            name = manifest["metadata"]["name"]
            try:
                if kube.create(manifest):
                    log.info("%s/%s: ReplicaTransition %s: %s", self.owner.namespace,
                             self.owner.name, name, step)
                if name not in self._phases:  # new, or no phase yet
                    self._write_phase(name, TransitionPhase.PENDING)
            except kube.API_ERRORS as error:
                log.warning("%s/%s: ReplicaTransition %s not made (tried again next "
                            "round): %s", self.owner.namespace, self.owner.name, name,
                            kube.error_reason(error))
                unmade.append(number)
        self._unmade = unmade

    def _watch_bootstraps(self, plan: Plan, state: ClusterState) -> set[int]:
        """Note which taken `+site` steps bootstrapped their site from a checkpoint (it
        says `bootstrapping` for the shard, or installed a checkpoint of it since the
        step was taken); the steps catching up that are bootstrapping now."""
        taken = taken_steps(plan, state.placement)
        if taken is None:
            return set()
        catching = catching_up_steps(plan, state)
        now = set()
        for number, step in enumerate(plan.transitions[:taken]):
            boots = self._boots.get(step.site)
            if step.action != "add" or boots is None:
                continue
            name = transition_name(self.owner.name, plan, number)
            count = boots.installed.get(step.shard_id, 0)
            base = self._boot_base.setdefault(name, count)
            running = step.shard_id in boots.running and number in catching
            if running or count > base:
                self._bootstrapped.add(name)
            if running:
                now.add(number)
        return now

    def _set_phase(self, name: str, action: str, phase: TransitionPhase,
                   reason: TransitionReason | None = None, message: str = "") -> None:
        """Move the step to `phase` through the phases it passed meanwhile."""
        current = self._phases.get(name, TransitionPhase.PENDING)
        bootstrapped = name in self._bootstrapped
        if (bootstrapped and current == TransitionPhase.CATCHING_UP
                and phase != TransitionPhase.FAILED
                and name not in self._showed_bootstrap):
            # Its site began the bootstrap after a round had seen it catching up
            # (the leader decides on it as it ships the first entries).
            path = [TransitionPhase.BOOTSTRAPPING,
                    *phase_path(action, TransitionPhase.BOOTSTRAPPING, phase, True)]
        else:
            path = phase_path(action, current, phase, bootstrapped)
        for passed in path:
            if passed == phase:
                self._write_phase(name, passed, reason, message)
            else:
                self._write_phase(name, passed)

    def _write_phase(self, name: str, phase: TransitionPhase,
                     reason: TransitionReason | None = None, message: str = "") -> None:
        if self._phases.get(name) == phase:
            return
        status: dict[str, Any] = {"phase": phase}
        if (phase != TransitionPhase.PENDING
                and self._phases.get(name, TransitionPhase.PENDING) == TransitionPhase.PENDING):
            status["startTime"] = timestamp(time.time())
        if phase in FINAL_PHASES:
            status["completionTime"] = timestamp(time.time())
        if reason is not None:
            status |= {"reason": reason, "message": message}
        if kube.patch_status(TRANSITION_API, TRANSITION_KIND, self.owner.namespace, name,
                             status):
            log.info("%s/%s: ReplicaTransition %s is %s", self.owner.namespace,
                     self.owner.name, name, phase)
            self._phases[name] = phase
            if phase == TransitionPhase.BOOTSTRAPPING:
                self._showed_bootstrap.add(name)

    def known_phases(self, found: list[dict[str, Any]]) -> None:
        """The phases the ReplicaTransitions have (after a restart: not set again)."""
        for item in found:
            phase = (item.get("status") or {}).get("phase")
            if phase:
                self._phases[item["metadata"]["name"]] = phase
