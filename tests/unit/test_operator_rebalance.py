"""What a DurableStorage shows of its rebalancing (stratamq.operator.rebalance, issue
23): the plan summary in status.rebalance and which plans' ReplicaTransitions go
past spec.transitionHistoryLimit. The deletions and the summary of a running
operator are in tests/kube/test_operator_rebalance.py."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from stratamq.operator.rebalance import (
    MESSAGE_ANNOTATION,
    TRIGGER_ANNOTATION,
    PlanRun,
    run_of,
    stale_transitions,
    summary,
)
from stratamq.operator.times import seconds_of, timestamp

T0 = seconds_of("2026-11-27T10:00:00Z")
RUN = PlanRun(key="7-abcdef", trigger="Scale", message="sites 3 -> 5", steps=4, started=T0)
LABEL = "stratamq.io/plan"


def test_a_running_plan_shows_its_steps_and_an_eta_at_its_pace() -> None:
    # No step done yet: no pace, no ETA.
    assert summary(RUN, ["CatchingUp", "Pending", "Pending", "Pending"], T0 + 30) == {
        "plan": "7-abcdef", "trigger": "Scale", "message": "sites 3 -> 5", "steps": 4,
        "stepsDone": 0, "startedAt": "2026-11-27T10:00:00Z", "result": "Running",
        "eta": None, "completedAt": None}
    # 2 of 4 done in 60 s: 30 s a step, 2 to go.
    found = summary(RUN, ["Done", "Done", "Joined", "Pending"], T0 + 60)
    assert (found["stepsDone"], found["eta"]) == (2, "2026-11-27T10:02:00Z")
    # Steps without a phase yet count as not done.
    assert summary(RUN, [], T0)["stepsDone"] == 0


def test_an_ended_plan_says_how_it_ended() -> None:
    done = summary(RUN, ["Done"] * 4, T0 + 100, ended=T0 + 90)
    assert (done["result"], done["completedAt"], done["stepsDone"]) == (
        "Done", "2026-11-27T10:01:30Z", 4)
    assert done["eta"] is None  # None: a merge patch deletes the running plan's ETA
    replaced = summary(RUN, ["Done", "Failed", "Failed", "Failed"], T0 + 100, ended=T0 + 50)
    assert (replaced["result"], replaced["stepsDone"]) == ("Replaced", 1)


@given(st.integers(min_value=1, max_value=200), st.data())
def test_the_eta_is_never_before_now_and_now_once_every_step_is_done(
        steps: int, data: st.DataObject) -> None:
    done = data.draw(st.integers(min_value=1, max_value=steps))
    elapsed = data.draw(st.integers(min_value=0, max_value=10**6))
    run = PlanRun(key="1-000000", trigger="Scale", message="", steps=steps, started=T0)
    found = summary(run, ["Done"] * done + ["Pending"] * (steps - done), T0 + elapsed)
    assert seconds_of(found["eta"]) >= seconds_of(timestamp(T0 + elapsed))
    if done == steps:
        assert found["eta"] == timestamp(T0 + elapsed)


def item(name: str, key: str, made: str = "2026-11-27T10:00:00Z", uid: str = "u-1",
         annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {LABEL: key}, "creationTimestamp": made,
                         "ownerReferences": [{"uid": uid}], "annotations": annotations or {}}}


def test_the_newest_plans_keep_their_transitions_and_the_running_one_always() -> None:
    # Plans by start version; two from one version ordered by when they were made.
    items = [item(f"mq-{key}-{step:03d}", key, made)
             for key, made in (("2-aaaaaa", "2026-11-27T10:00:00Z"),
                               ("10-bbbbbb", "2026-11-27T10:05:00Z"),
                               ("10-cccccc", "2026-11-27T10:06:00Z"),
                               ("11-dddddd", "2026-11-27T10:07:00Z"))
             for step in range(2)]

    def names(*keys: str) -> list[str]:
        return sorted(f"mq-{key}-{step:03d}" for key in keys for step in range(2))
    assert stale_transitions(items, LABEL, "u-1", 2, None) == names("2-aaaaaa", "10-bbbbbb")
    assert stale_transitions(items, LABEL, "u-1", 3, "11-dddddd") == names("2-aaaaaa")
    # The plan running is kept whatever its place; with a limit of 1, alone.
    assert stale_transitions(items, LABEL, "u-1", 1, "2-aaaaaa") == names(
        "10-bbbbbb", "10-cccccc", "11-dddddd")
    assert stale_transitions(items, LABEL, "u-1", 5, None) == []
    # Not the storage's own (another uid: a storage made again under its name), or
    # without a plan label: left alone.
    foreign = [item("mq-x-000", "1-eeeeee", uid="other"), {"metadata": {"name": "mine"}}]
    assert stale_transitions(items + foreign, LABEL, "u-1", 4, None) == []


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 59)), max_size=12, unique=True),
       st.integers(1, 6), st.data())
def test_at_most_the_limit_of_plans_keep_transitions(
        plans: list[tuple[int, int]], keep: int, data: st.DataObject) -> None:
    items = [item(f"mq-{version}-{minute:06d}-000", f"{version}-{minute:06d}",
                  f"2026-11-27T10:{minute:02d}:00Z") for version, minute in plans]
    running = data.draw(st.sampled_from([None, *(f"{v}-{m:06d}" for v, m in plans)]))
    stale = set(stale_transitions(items, LABEL, "u-1", keep, running))
    kept = [found for found in items if found["metadata"]["name"] not in stale]
    assert len(kept) == min(keep, len(items))
    if running is not None:
        assert f"mq-{running}-000" not in stale
    # Every plan deleted starts no later than every plan kept but the running one.
    kept_versions = [int(found["metadata"]["name"].split("-")[1]) for found in kept
                     if found["metadata"]["labels"][LABEL] != running]
    for name in stale:
        assert all(int(name.split("-")[1]) <= version for version in kept_versions)


def test_a_restarted_operator_finds_the_run_of_the_plan_it_resumes() -> None:
    why = {TRIGGER_ANNOTATION: "ReplicationFactor", MESSAGE_ANNOTATION: "replication factor 3 -> 2"}
    items = [item("mq-7-abcdef-001", "7-abcdef", "2026-11-27T10:00:05Z", annotations=why),
             item("mq-7-abcdef-000", "7-abcdef", "2026-11-27T10:00:04Z", annotations=why),
             item("mq-6-000000-000", "6-000000", "2026-11-27T09:00:00Z")]
    assert run_of(items, LABEL, "7-abcdef", 2) == PlanRun(
        key="7-abcdef", trigger="ReplicationFactor", message="replication factor 3 -> 2",
        steps=2, started=seconds_of("2026-11-27T10:00:04Z"))
    assert run_of(items, LABEL, "6-000000", 1) == PlanRun(
        key="6-000000", trigger="Unknown", message="", steps=1,
        started=seconds_of("2026-11-27T09:00:00Z"))
    assert run_of(items, LABEL, "9-ffffff", 3) is None
