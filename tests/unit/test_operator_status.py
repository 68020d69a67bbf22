"""The status the operator writes on a DurableStorage (stratamq.operator.status), from
observed pods, StatefulSet and site ids: phase, conditions and their transition times,
sites, and the scale subresource's fields."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from stratamq.operator.kube import PodView, site_pod
from stratamq.operator.status import (
    Observed,
    ReplicationView,
    compute_status,
    known_site_ids,
    rolled_out,
)

T0 = "2026-01-01T00:00:00Z"
T1 = "2026-01-01T00:01:00Z"


def pods(ready: int, not_ready: int = 0, terminating: int = 0) -> list[PodView]:
    made = [PodView(f"mq-{n}", f"127.9.9.{n + 1}", True, False) for n in range(ready)]
    made += [PodView(f"mq-{ready + n}", None, False, False) for n in range(not_ready)]
    made += [PodView(f"mq-{ready + not_ready + n}", "127.9.9.99", False, True)
             for n in range(terminating)]
    return made


def stateful_set(replicas: int, updated: int | None = None, *, generation: int = 1,
                 observed: int = 1, current: str = "r1", update: str = "r1") -> dict[str, Any]:
    return {"generation": generation, "observedGeneration": observed, "replicas": replicas,
            "updatedReplicas": replicas if updated is None else updated,
            "currentRevision": current, "updateRevision": update}


def replication(*, placed: bool = True, under: int = 0, leaderless: int = 0,
                pending: int = 0, generation: int = 4) -> ReplicationView:
    shards = [{"shard": 0, "leader": "SITE0", "leaderEpoch": 1,
               "replicas": ["SITE0", "SITE1", "SITE2"], "underReplicated": under > 0}]
    return ReplicationView(
        placed=placed, databases=[{"name": "messages", "placementVersion": 1,
                                   "underReplicatedShards": under,
                                   "pendingTransitions": pending, "shards": shards}]
        if placed else [], under_replicated=under, leaderless=leaderless, pending=pending,
        rebalancing=pending > 0, generation=generation)


BALANCED = replication()


def observed(sites: int, found: list[PodView], sts: dict[str, Any] | None,
             ids: dict[str, str] | None = None, placement: ReplicationView | None = BALANCED,
             kept: int = 0, spec_generation: int = 4) -> Observed:
    if ids is None:
        ids = {pod.name: f"SITE{pod.name[-1]}" for pod in found if pod.ready}
    return Observed(name="mq", generation=4, sites=sites, pods=found, stateful_set=sts,
                    site_ids=ids, replication=placement, kept=kept,
                    spec_generation=spec_generation)


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_ready() -> None:
    status = compute_status(observed(3, pods(3), stateful_set(3)), [], T0)
    assert status["phase"] == "Ready"
    assert conditions(status) == {"Ready": ("True", "AllSitesReady"),
                                  "Degraded": ("False", "AllSitesReady"),
                                  "Rebalancing": ("False", "Balanced")}
    assert status["observedGeneration"] == 4
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])
    assert (status["replicas"], status["readyReplicas"]) == (3, 3)
    assert status["selector"] == ("app.kubernetes.io/name=stratamq,app.kubernetes.io/instance=mq,"
                                  "app.kubernetes.io/component=broker")
    assert status["sites"] == [{"id": f"SITE{n}", "pod": f"mq-{n}", "ready": True}
                               for n in range(3)]
    assert status["pendingTransitions"] == 0
    assert status["underReplicatedShards"] == 0
    assert status["databases"] == BALANCED.databases


def test_replication_decides_the_phase_once_the_sites_are_ready() -> None:
    cases = [
        (None, "Pending", ("False", "Placing"), ("False", "NotPlaced")),
        (replication(placed=False), "Pending", ("False", "Placing"), ("False", "NotPlaced")),
        (replication(pending=4), "Rebalancing", ("True", "AllSitesReady"),
         ("True", "PlanRunning")),
        # Short of replicas while the plan adding them runs (a raised factor).
        (replication(under=2, pending=1), "Rebalancing", ("True", "AllSitesReady"),
         ("True", "PlanRunning")),
        (replication(under=2), "Degraded", ("True", "AllSitesReady"), ("False", "Balanced")),
        (replication(leaderless=1, under=1), "Degraded", ("False", "NoLeader"),
         ("False", "Balanced")),
    ]
    for view, phase, ready, rebalancing in cases:
        status = compute_status(observed(3, pods(3), stateful_set(3), placement=view), [], T0)
        assert status["phase"] == phase, view
        found = conditions(status)
        assert (found["Ready"], found["Rebalancing"]) == (ready, rebalancing), view
        assert found["Degraded"][0] == ("True" if phase == "Degraded" else "False")
        if view is not None:
            assert status["underReplicatedShards"] == view.under_replicated
            assert status["pendingTransitions"] == view.pending


def test_not_ready_until_the_controller_followed_the_spec_read() -> None:
    """Scaled 3 -> 5 (generation 5): the new pods are up and answer, but the
    controller's last round followed generation 4, whose goal was the 3 first sites
    (balanced, no plan): Pending, not Ready, until a round has followed 5."""
    behind = observed(5, pods(5), stateful_set(5), placement=replication(generation=4),
                      spec_generation=5)
    status = compute_status(behind, [], T0)
    assert status["phase"] == "Pending"
    assert conditions(status)["Ready"][0] == "True"  # the sites serve meanwhile
    assert "not yet followed generation 5" in status["conditions"][0]["message"]
    followed = observed(5, pods(5), stateful_set(5), placement=replication(generation=5),
                        spec_generation=5)
    assert compute_status(followed, [], T0)["phase"] == "Ready"


def test_degraded_when_the_goal_has_no_plan() -> None:
    view = replace(replication(), no_plan="no plan to A, B at replication factor 3: "
                   "2 sites for 3 replicas")
    status = compute_status(observed(3, pods(3), stateful_set(3), placement=view), [], T0)
    assert status["phase"] == "Degraded"
    assert conditions(status)["Degraded"] == ("True", "NoPlan")
    assert "2 sites for 3 replicas" in status["conditions"][1]["message"]


def test_departing_pods_kept_while_they_hold_replicas() -> None:
    """Scaled 5 -> 3 while pods 3 and 4 still hold replicas: the StatefulSet keeps 5,
    which counts as rolled out (not Pending), and the status says why."""
    status = compute_status(observed(3, pods(5), stateful_set(5), placement=replication(
        pending=3), kept=5), [], T0)
    assert status["phase"] == "Rebalancing"
    assert "2 departing" in status["conditions"][0]["message"]
    assert (status["replicas"], status["readyReplicas"]) == (5, 5)
    # Once they hold none, the StatefulSet shrinks to 3: scaling until it has.
    status = compute_status(observed(3, pods(5), stateful_set(5), kept=3), [], T0)
    assert status["phase"] == "Scaling"


def test_pending_rolling_or_scaling_while_the_stateful_set_rolls_out() -> None:
    cases = [
        (3, None, pods(0), "Pending", "RollingOut"),  # no StatefulSet yet
        # the spec not acted on yet, pods the same: a roll
        (3, stateful_set(3, generation=2, observed=1), pods(3), "Rolling", "RollingOut"),
        (3, stateful_set(3, updated=2, update="r2"), pods(3), "Rolling", "RollingOut"),
        # scaled to 4, the 4th pod not made
        (4, stateful_set(4, updated=3), pods(3), "Scaling", "Scaling"),
        (4, stateful_set(3), pods(3), "Scaling", "Scaling"),  # the StatefulSet not yet
    ]
    for sites, sts, found, phase, reason in cases:
        status = compute_status(observed(sites, found, sts), [], T0)
        assert status["phase"] == phase, (sites, sts)
        assert conditions(status)["Ready"] == ("False", reason)
        assert conditions(status)["Degraded"][0] == "False"
    # The first pods, before the first placement: Pending.
    first = observed(3, pods(1, 2), stateful_set(3), placement=None)
    assert compute_status(first, [], T0)["phase"] == "Pending"


KNOWN = {"mq-0": "SITE0", "mq-1": "SITE1", "mq-2": "SITE2"}


def test_degraded_when_rolled_out_but_a_site_is_not_ready() -> None:
    status = compute_status(observed(3, pods(2, 1), stateful_set(3), ids=KNOWN), [], T0)
    assert status["phase"] == "Degraded"
    assert conditions(status)["Degraded"] == ("True", "SitesNotReady")
    assert "not ready: mq-2" in status["conditions"][1]["message"]
    assert status["readyReplicas"] == 2
    # A ready pod whose admin API does not answer is not a known site: next to a
    # known site that is not ready, Degraded; alone, a new site starting (a scale).
    status = compute_status(observed(4, pods(3, 1), stateful_set(4),
                                     ids={"mq-0": "A", "mq-1": "B", "mq-3": "D"}), [], T0)
    assert status["phase"] == "Degraded"
    assert "admin API not answering: mq-2" in status["conditions"][0]["message"]
    status = compute_status(observed(3, pods(3), stateful_set(3),
                                     ids={"mq-0": "A", "mq-1": "B"}), [], T0)
    assert status["phase"] == "Scaling"
    assert "new sites starting: mq-2" in status["conditions"][0]["message"]


def test_terminating_pods_are_not_sites() -> None:
    status = compute_status(observed(3, pods(3, terminating=1), stateful_set(3)), [], T0)
    assert status["replicas"] == 3
    assert [site["pod"] for site in status["sites"]] == ["mq-0", "mq-1", "mq-2"]


def test_each_site_says_the_zone_of_its_node_where_known() -> None:
    made = [PodView("mq-0", "i", True, False, zone="a"), PodView("mq-1", "i", True, False)]
    status = compute_status(observed(2, made, stateful_set(2), ids={"mq-0": "A", "mq-1": "B"}),
                            [], T0)
    assert status["sites"] == [{"id": "A", "pod": "mq-0", "ready": True, "zone": "a"},
                               {"id": "B", "pod": "mq-1", "ready": True}]


def test_transition_times_change_only_with_the_status() -> None:
    first = compute_status(observed(3, pods(3), stateful_set(3)), [], T0)
    again = compute_status(observed(3, pods(3), stateful_set(3)), first["conditions"], T1)
    assert [c["lastTransitionTime"] for c in again["conditions"]] == [T0, T0, T0]
    degraded = compute_status(observed(3, pods(2, 1), stateful_set(3), ids=KNOWN),
                              again["conditions"], T1)
    times = {c["type"]: c["lastTransitionTime"] for c in degraded["conditions"]}
    assert times == {"Ready": T1, "Degraded": T1, "Rebalancing": T0}


def test_known_site_ids_keep_a_site_that_stops_answering() -> None:
    previous = [{"id": "A", "pod": "mq-0", "ready": True}, {"id": "B", "pod": "mq-1",
                                                            "ready": True}]
    ids = known_site_ids(previous, {"mq-0": "A", "mq-2": "C"})
    assert ids == {"mq-0": "A", "mq-1": "B", "mq-2": "C"}
    status = compute_status(observed(3, [PodView("mq-0", "i", True, False),
                                         PodView("mq-1", "i", False, False),
                                         PodView("mq-2", "i", True, False)],
                                     stateful_set(3), ids), [], T0)
    assert status["sites"] == [{"id": "A", "pod": "mq-0", "ready": True},
                               {"id": "B", "pod": "mq-1", "ready": False},
                               {"id": "C", "pod": "mq-2", "ready": True}]


def test_rolled_out() -> None:
    assert rolled_out(observed(3, pods(3), stateful_set(3)))
    assert not rolled_out(observed(3, pods(3), stateful_set(3, current="r1", update="r2")))
    assert not rolled_out(observed(3, pods(3), None))


def test_planned_changes_are_progress_not_degradation() -> None:
    """Issue 21, defect 7: planned, healthy scales and config rolls showed phase
    Degraded (and its Warning event). A pod restarting in a roll, the new pods of a
    scale, shards short of a replica while the plan that fixes them runs: progress."""
    cases = [
        # A config roll: the StatefulSet replaces one pod at a time; mq-2 restarts and
        # its replicas are not up meanwhile.
        ("Rolling", "RollingOut", observed(
            3, pods(2, 1), stateful_set(3, updated=1, current="r1", update="r2"),
            placement=replication(under=1))),
        # Scaled 3 -> 5: the StatefulSet made the two pods, they are not ready yet.
        ("Scaling", "Scaling", observed(5, pods(3, 2), stateful_set(5))),
        # Scaled, the StatefulSet not yet acted on the new count.
        ("Scaling", "Scaling", observed(5, pods(3), stateful_set(3, generation=2))),
        # Replication factor 1 -> 2: every shard is short of its second replica until
        # the plan adding them ends.
        ("Rebalancing", "PlanRunning", observed(3, pods(3), stateful_set(3),
                                               placement=replication(under=2, pending=2))),
    ]
    for phase, reason, seen in cases:
        status = compute_status(seen, [], T0)
        assert (status["phase"], conditions(status)["Degraded"]) == (
            phase, ("False", reason)), seen


def test_a_roll_or_scale_waiting_on_a_pod_past_the_deadline_is_degraded() -> None:
    """Issue 23: a roll whose new pod never got ready (a crash, an image not pulled, no
    node) read Rolling for ever, never Degraded, no Warning. Past
    spec.updateStrategy.progressDeadlineSeconds of a pod not ready, it is Degraded
    (RolloutStuck), naming the pod; before it, Rolling or Scaling as it was."""
    now = 10_000.0

    def waiting(since: float) -> list[PodView]:
        return [*pods(2), replace(PodView("mq-2", None, False, False), not_ready_since=since)]

    rolling = stateful_set(3, updated=1, current="r1", update="r2")
    scaling = stateful_set(4)
    for sts, sites, found, phase in [(rolling, 3, waiting, "Rolling"),
                                     (scaling, 4, lambda since: [*waiting(since),
                                                                 PodView("mq-3", None, False,
                                                                         False)], "Scaling")]:
        seen = replace(observed(sites, found(now - 599), sts, placement=replication(under=1)),
                       now=now, progress_deadline=600)
        assert compute_status(seen, [], T0)["phase"] == phase
        seen = replace(seen, pods=found(now - 601))
        status = compute_status(seen, [], T0)
        assert (status["phase"], conditions(status)["Degraded"]) == (
            "Degraded", ("True", "RolloutStuck")), sts
        assert "mq-2" in status["conditions"][1]["message"]
    # The first pods, before any placement: stuck too.
    first = replace(observed(3, waiting(now - 700), stateful_set(3), placement=None),
                    now=now, progress_deadline=600)
    assert compute_status(first, [], T0)["phase"] == "Degraded"
    # A shard without a leader says more.
    leaderless = replace(observed(3, waiting(now - 700), rolling,
                                  placement=replication(leaderless=1)), now=now)
    assert conditions(compute_status(leaderless, [], T0))["Degraded"] == ("True", "NoLeader")


def test_a_pods_not_ready_time_is_read_from_its_ready_condition() -> None:
    made = {"metadata": {"name": "mq-0", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"conditions": [{"type": "Ready", "status": "False",
                                       "lastTransitionTime": "2026-01-01T00:05:00Z"}]}}
    assert site_pod(made).not_ready_since == 1767225900.0
    assert site_pod({"metadata": made["metadata"]}).not_ready_since == 1767225600.0
    ready = {**made, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert site_pod(ready).not_ready_since is None


def test_degraded_when_nothing_planned_explains_it() -> None:
    cases = [
        # Rolled out, no roll or scale: a site that is not ready.
        ("SitesNotReady", observed(3, pods(2, 1), stateful_set(3), ids=KNOWN)),
        # Under-replicated with no plan running (a site gone).
        ("UnderReplicated", observed(3, pods(3), stateful_set(3),
                                     placement=replication(under=1))),
        # A shard without a leader that answers, even in the middle of a roll or scale.
        ("NoLeader", observed(3, pods(2, 1), stateful_set(3, updated=1, update="r2"),
                              placement=replication(leaderless=1, under=1))),
        ("NoLeader", observed(5, pods(3, 2), stateful_set(5),
                              placement=replication(leaderless=1, under=1, pending=2))),
    ]
    for reason, seen in cases:
        status = compute_status(seen, [], T0)
        assert (status["phase"], conditions(status)["Degraded"]) == (
            "Degraded", ("True", reason)), seen


def test_placing_says_why_a_recreated_storage_waits() -> None:
    """Issue 21, defect 5: a storage deleted and made again over its retained volumes
    has sites holding a placement its new status.controller does not know. Until the
    operator has adopted it (the next round fetches what they keep), Placing says so,
    not the `placement.json` of `stratamq cluster controller` it once pointed at."""
    from stratamq.broker.controller.decisions import ClusterState, Settings, decide
    from stratamq.broker.controller.sites import SiteState

    # What decisions.py says of a site that holds placement 7 to a controller with none.
    held = SiteState(id="S1", admin_url="", last_seen=100.0, answered=True,
                     placement_version=7)
    [said] = decide(ClusterState(), {"S1": held}, 100.0, 0.0,
                    Settings(replication_factor=1, n_shards=2, heartbeat_interval=1.0)).notes
    assert "placement.json" not in said and "waiting to adopt" in said
    view = replace(replication(placed=False), waiting=said)
    status = compute_status(observed(3, pods(3), stateful_set(3), placement=view), [], T0)
    assert status["phase"] == "Pending"
    assert said in status["conditions"][0]["message"]


def test_a_roll_held_by_the_update_strategy_is_done_as_asked() -> None:
    """spec.updateStrategy.partition 2 of 3 sites: the new template reaches mq-2 only;
    the storage is Ready once it has, saying how many pods are held. Paused (all 3
    held): Ready with the old template everywhere. Without the strategy the same
    StatefulSet is a roll in progress."""
    partly = stateful_set(3, updated=1, current="r1", update="r2")
    rolling = compute_status(observed(3, pods(3), partly), [], T0)
    assert rolling["phase"] == "Rolling"
    held = compute_status(replace(observed(3, pods(3), partly), held=2), [], T0)
    assert held["phase"] == "Ready", held["conditions"][0]
    assert held["updatedReplicas"] == 1
    assert "2 held on the previous pod template" in held["conditions"][0]["message"]
    # the partition's pod has not taken the new template yet: still rolling
    behind = stateful_set(3, updated=0, current="r1", update="r2")
    assert compute_status(replace(observed(3, pods(3), behind), held=2), [],
                          T0)["phase"] == "Rolling"
    paused = compute_status(replace(observed(3, pods(3), behind), held=3), [], T0)
    assert paused["phase"] == "Ready"
    assert "3 held" in paused["conditions"][0]["message"]


def test_the_plan_summary_is_in_status_when_the_controller_has_one() -> None:
    summary = {"plan": "7-abcdef", "trigger": "Scale", "message": "sites 3 -> 5",
               "steps": 4, "stepsDone": 1, "startedAt": T0, "eta": T1, "result": "Running"}
    status = compute_status(observed(3, pods(3), stateful_set(3), placement=replace(
        replication(pending=3), rebalance=summary)), [], T0)
    assert status["rebalance"] == summary
    assert "rebalance" not in compute_status(observed(3, pods(3), stateful_set(3),
                                                      placement=BALANCED), [], T0)
