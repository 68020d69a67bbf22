"""What a DurableStorage shows of its rebalancing (issue 23), pure: the summary of the
plan running, or of the last one, in `status.rebalance` (its id, why it was made, its
steps done of all, when it started, and when it should end at the pace so far), and
which ReplicaTransitions go once more plans than spec.transitionHistoryLimit have
some (never those of the plan running). A storage's Transitions (transitions.py)
gathers the inputs and deletes what this names; its controller (controller.py) writes
the summary into its view."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .phases import PlanResult, PlanTrigger, TransitionPhase
from .resources import GROUP
from .times import seconds_of, timestamp

# On each ReplicaTransition: why its plan was made (a PlanTrigger), and a word more.
TRIGGER_ANNOTATION = f"{GROUP}/plan-trigger"
MESSAGE_ANNOTATION = f"{GROUP}/plan-trigger-message"


@dataclass(frozen=True)
class PlanRun:
    """One plan as the storage shows it: its id (the `plan` label of its
    ReplicaTransitions), why it was made and a word more, its step count, and when
    its ReplicaTransitions were made (seconds since the epoch)."""

    key: str
    trigger: str
    message: str
    steps: int
    started: float


def summary(run: PlanRun, phases: Sequence[str], now: float, ended: float | None = None
            ) -> dict[str, Any]:
    """`status.rebalance` for `run`, whose steps are in `phases` (in step order; a
    step without a phase yet is Pending), at `now`; `ended`: when it ended (done, or
    made again). The ETA is the pace so far (time per step done) times the steps
    left, while it runs and has done one."""
    done = sum(1 for phase in phases if phase == TransitionPhase.DONE)
    found: dict[str, Any] = {"plan": run.key, "trigger": run.trigger, "message": run.message,
                             "steps": run.steps, "stepsDone": done,
                             "startedAt": timestamp(run.started),
                             # None, not left out: the status is a merge patch, where
                             # None deletes what an earlier summary wrote.
                             "eta": None, "completedAt": None}
    if ended is None:
        found["result"] = PlanResult.RUNNING
        if done:
            pace = max(now - run.started, 0.0) / done
            found["eta"] = timestamp(now + pace * (run.steps - done))
        return found
    result = PlanResult.DONE if done == run.steps else PlanResult.REPLACED
    return found | {"result": result, "completedAt": timestamp(ended)}


def stale_transitions(items: Iterable[Mapping[str, Any]], plan_label: str, owner_uid: str,
                      keep: int, running: str | None) -> list[str]:
    """The names of the ReplicaTransitions (`items`, as listed) to delete so that only
    the newest `keep` plans have some: the plan `running` (its key) is always one of
    them; the others are ordered by their placement version at the start (a plan's
    key begins with it: a later plan starts at a newer or the same placement), then
    when made. Only those owned by the storage (`owner_uid`) and labelled with a plan
    are considered."""
    made: dict[str, tuple[int, str]] = {}
    names: dict[str, list[str]] = {}
    for item in items:
        metadata = item["metadata"]
        key = (metadata.get("labels") or {}).get(plan_label)
        owned = any(reference.get("uid") == owner_uid
                    for reference in metadata.get("ownerReferences") or [])
        if not key or not owned:
            continue
        order = (start_version(key), str(metadata.get("creationTimestamp") or ""))
        made[key] = max(made.get(key, order), order)
        names.setdefault(key, []).append(metadata["name"])
    newest = sorted(made, key=lambda key: made[key], reverse=True)
    kept = ([running] if running in made else [])
    kept += [key for key in newest if key != running][:max(keep - len(kept), 0)]
    return sorted(name for key in newest if key not in kept for name in names[key])


def start_version(key: str) -> int:
    """The placement version a plan started at, from its key (`<version>-<hash>`);
    -1 for a key of another form."""
    head = key.split("-", 1)[0]
    return int(head) if head.isdigit() else -1


def run_of(items: Sequence[Mapping[str, Any]], plan_label: str, key: str, steps: int
           ) -> PlanRun | None:
    """The run of plan `key` (of `steps` steps) from its ReplicaTransitions as listed
    (after a restart): made when the first of them was, why as their annotations
    say; None without any."""
    mine = [item for item in items
            if (item["metadata"].get("labels") or {}).get(plan_label) == key]
    if not mine:
        return None
    annotations: Mapping[str, str] = mine[0]["metadata"].get("annotations") or {}
    return PlanRun(key=key, trigger=annotations.get(TRIGGER_ANNOTATION, PlanTrigger.UNKNOWN),
                   message=annotations.get(MESSAGE_ANNOTATION, ""), steps=steps,
                   started=min(seconds_of(item["metadata"]["creationTimestamp"])
                               for item in mine))
