"""The operator's replication controller (stratamq.operator.controller), its parts that
need no API server: the state kept in status.controller, the pods the StatefulSet
must keep while departing sites hold replicas, and the phases of a plan's steps. The
rounds themselves run against a real API server and real sites in
tests/kube/test_operator_replication.py."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from stratamq.broker.controller.decisions import CatchUp, ClusterState, LeaderMove
from stratamq.broker.controller.sites import SiteState, parse_report
from stratamq.broker.ds.replication import (
    Placement,
    PlannedSite,
    apply_transition,
    apply_transitions,
    plan,
)
from stratamq.broker.ds.replication.term import NO_TERM, ControllerTerm
from stratamq.broker.ds.replication.waves import in_waves
from stratamq.broker.errors import PlacementError
from stratamq.operator.controller import (
    HAND_BACK_WINDOW,
    MAX_HAND_BACKS,
    Controllers,
    GoalFollowed,
    StorageController,
    departed,
    follow_goal,
    leader_move_event,
    plan_trigger,
    seen_on,
    settings_of,
)
from stratamq.operator.kept_state import (
    KeptState,
    StatusRecord,
    kept_document,
    known_sites,
    record_of,
)
from stratamq.operator.kube import PodView, zone_of_node
from stratamq.operator.metrics import OperatorCollector
from stratamq.operator.phases import TransitionPhase as T
from stratamq.operator.rebalance import PlanRun
from stratamq.operator.resources import Owner
from stratamq.operator.spec import parse_spec
from stratamq.operator.transitions import (
    phase_path,
    plan_key,
    step_phases,
    transition_manifest,
    transition_name,
)

OWNER = Owner(name="mq", namespace="brokers", uid="u-1")
SPEC = {"sites": 3, "messages": {"nShards": 2, "replicationFactor": 3}}
A, B, C, D = "AAAAAAAAAAAAAAAA", "BBBBBBBBBBBBBBBB", "CCCCCCCCCCCCCCCC", "DDDDDDDDDDDDDDDD"


def first_placement(sites: list[str]) -> Placement:
    return plan([PlannedSite(site) for site in sites], ["messages"], 2, 3, Placement.empty()).start


def sites_state(*ids: str) -> dict[str, SiteState]:
    return {site: SiteState(id=site, admin_url="", last_seen=0.0, peer=f"10.0.0.{n}:18084")
            for n, site in enumerate(ids)}


def peers(*ids: str) -> dict[str, str | None]:
    return {site: f"10.0.0.{n}:18084" for n, site in enumerate(ids)}


def kept(document: dict[str, Any]) -> KeptState:
    """status.controller as an operator read it (nothing written in these tests)."""
    return KeptState(OWNER, document)


def test_the_kept_state_comes_back_whole() -> None:
    placement = first_placement([A, B, C])
    moving = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C, draining=True), PlannedSite(D)],
                  ["messages"], 2, 3,
                  placement)
    state = ClusterState(placement=placement, plan=moving, goals={"messages": (A, B, D)})
    pods = {A: "mq-0", B: "mq-1", C: "mq-2", D: "mq-3"}
    document = kept_document(StatusRecord(state, peers(A, B, C, D), pods,
                                          frozenset({"EEEEEEEEEEEEEEEE"})))
    record = record_of(document)
    loaded = record.state
    assert record.forgotten == {"EEEEEEEEEEEEEEEE"}
    assert (loaded.placement, loaded.plan, loaded.goals) == (placement, moving,
                                                              {"messages": (A, B, D)})
    assert record.pods == pods
    sites = known_sites(record, 5.0)
    assert {site.id: (site.peer, site.last_seen, site.answered) for site in sites.values()} == {
        site: (f"10.0.0.{n}:18084", 5.0, False) for n, site in enumerate((A, B, C, D))}
    # An operator that never placed anything keeps nothing.
    empty = record_of(kept_document(StatusRecord()))
    assert empty.state.placement.version == 0 and empty.state.plan is None
    assert not empty.sites and not empty.pods and not empty.forgotten


def test_a_large_placement_and_plan_are_kept_small() -> None:
    """Issue 23: status.controller grew with shards x databases (106 KB at 256 shards of
    three databases on 9 sites). Large ones are kept compressed and read back whole; a
    small one stays the JSON older operators read; a damaged one is refused."""
    sites = [PlannedSite(f"{n:X}" * 16) for n in range(1, 10)]
    large = plan(sites, ["messages", "sessions", "retained"], 256, 3)
    moving = plan([*sites[:8], PlannedSite(sites[8].id, draining=True)],
                  ["messages", "sessions", "retained"], 256, 3, large.target)
    state = ClusterState(placement=large.target, plan=moving)
    document = kept_document(StatusRecord(state))
    assert len(large.target.to_json()) > 100_000
    assert len(document["placement"]) < 8_000 and len(document["plan"]) < 16_000
    loaded = record_of(document).state
    assert (loaded.placement, loaded.plan) == (large.target, moving)
    small = kept_document(StatusRecord(ClusterState(placement=first_placement([A, B, C]))))
    assert Placement.from_json(small["placement"]) == first_placement([A, B, C])
    damaged = {**document, "placement": document["placement"][:-40]}
    with pytest.raises(PlacementError, match="damaged"):
        record_of(damaged)


def test_a_restart_after_a_join_waits_for_its_catch_up() -> None:
    placement = first_placement([A, B, C])
    moving = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C, draining=True), PlannedSite(D)],
                  ["messages"], 2, 3,
                  placement)
    first = moving.transitions[0]
    assert first.action == "add"
    state = ClusterState(placement=apply_transition(placement, first), plan=moving,
                         goals={"messages": (A, B, D)})
    loaded = record_of(kept_document(StatusRecord(state, peers(A, B, C, D)))).state
    assert [catch_up.site for catch_up in loaded.catch_ups] == [first.site]


def test_departing_pods_are_kept_while_they_hold_replicas() -> None:
    placement = first_placement([A, B, C])
    document = kept_document(StatusRecord(ClusterState(placement=placement), peers(A, B, C, D),
                                          {A: "mq-0", B: "mq-1", C: "mq-2", D: "mq-3"}))
    controller = StorageController(OWNER, settings_of(parse_spec(SPEC), 2.0), kept(document))
    # Scaled to 2: mq-2 holds replicas, so three pods stay; D on mq-3 holds none.
    assert controller.kept_pods(2) == 3
    assert controller.kept_pods(4) == 4
    # D in the pending plan's target keeps mq-3 too.
    moving = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C), PlannedSite(D)],
                  ["messages"], 2, 3, placement)
    assert D in moving.target.sites()
    controller.state = replace(controller.state, plan=moving)
    assert controller.kept_pods(2) == 4


def test_a_site_is_forgotten_once_its_pod_is_gone_and_it_holds_nothing() -> None:
    settings = settings_of(parse_spec(SPEC), 1.0)
    state = ClusterState(placement=first_placement([A, B, C]))
    sites = {**sites_state(A, B, C), D: replace(sites_state(D)[D], last_seen=9.0,
                                                   answered=True)}
    pods = {A: "mq-0", B: "mq-1", C: "mq-2", D: "mq-3"}
    # D's pod is gone, but D answered a moment ago: not yet.
    assert departed(state, sites, pods, {"mq-0", "mq-1"}, 10.0, settings) == {}
    assert departed(state, sites, pods, {"mq-0", "mq-1"}, 20.0, settings) == {D: "mq-3"}
    # C lost its pod too, but holds replicas; D in a pending plan's target stays.
    moving = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C), PlannedSite(D)],
                  ["messages"], 2, 3, state.placement)
    assert D in moving.target.sites()
    assert departed(replace(state, plan=moving), sites, pods, set(), 20.0, settings) == {}
    # A site never seen on a pod that holds nothing goes at once.
    assert departed(state, {**sites, "E": sites_state("E")["E"]}, pods,
                    {"mq-0", "mq-1", "mq-2", "mq-3"}, 0.0, settings) == {"E": None}


def test_a_scale_is_planned_once_every_pod_asked_for_is_a_known_site() -> None:
    state = ClusterState(placement=first_placement([A, B, C]))
    sites, pods = sites_state(A, B, C, D), {A: "mq-0", B: "mq-1", C: "mq-2"}
    settings = settings_of(parse_spec(SPEC), 2.0)
    assert follow_goal(state, "mq", 3, sites, pods, settings) == GoalFollowed(state)
    # mq-3 is not a known site yet: no plan (one per pod as they come) until it is.
    assert follow_goal(state, "mq", 4, sites, pods, settings) == GoalFollowed(
        state, unsettled=True)
    followed = follow_goal(state, "mq", 4, sites, {**pods, D: "mq-3"}, settings)
    assert followed.trigger == ("Scale", "sites 3 -> 4")
    assert followed.state.plan is not None
    assert followed.state.goals == {"messages": (A, B, C, D)}
    assert followed.planned.startswith(
        f"messages to live on {A}, {B}, {C}, {D} at replication factor 3; plan: messages/")
    # A replication factor above the sites: no plan, and why.
    above = settings_of(parse_spec({**SPEC, "messages": {"replicationFactor": 4}}), 2.0)
    refused = follow_goal(state, "mq", 3, sites, pods, above)
    assert refused.state == state and refused.trigger is None
    assert refused.no_plan.startswith(f"no plan to {A}, {B}, {C} at replication factor 4: ")


def test_step_phases_follow_the_plan() -> None:
    placement = first_placement([A, B, C])
    moving = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C, draining=True), PlannedSite(D)],
                  ["messages"], 2, 3,
                  placement)
    steps = moving.transitions
    assert [step.action for step in steps[:2]] == ["add", "remove"]
    state = ClusterState(placement=placement, plan=moving)
    versions: dict[str, int | None] = {A: placement.version}
    assert step_phases(moving, state, versions) == ["Pending"] * len(steps)
    joined = apply_transition(placement, steps[0])
    catching = replace(state, placement=joined,
                       catch_ups=(CatchUp(steps[0].shard_id, steps[0].site, joined.version),))
    # Pending until the joining site took the placement.
    assert step_phases(moving, catching, versions)[:2] == ["Pending", "Pending"]
    versions[steps[0].site] = joined.version
    assert step_phases(moving, catching, versions)[:2] == ["CatchingUp", "Pending"]
    assert step_phases(moving, catching, versions, bootstrapping={0})[:2] == [
        "Bootstrapping", "Pending"]
    caught = replace(catching, catch_ups=())
    assert step_phases(moving, caught, versions)[:2] == ["Joined", "Pending"]
    removed = apply_transition(joined, steps[1])
    left = replace(caught, placement=removed)
    assert step_phases(moving, left, {A: joined.version})[:2] == ["Done", "Removing"]
    assert step_phases(moving, left, {A: removed.version})[:2] == ["Done", "Done"]
    # A placement the plan does not pass through (a failover): nothing taken.
    assert step_phases(moving, replace(state, placement=first_placement([A, B, D])),
                       versions) == ["Pending"] * len(steps)


def test_step_phases_of_shards_moving_at_once() -> None:
    """Two `+site` steps taken in one round (max_concurrent_moves 2): each shows its
    own joiner's progress; one caught up is Done (through Joined, phase_path) once a
    step after it is under way."""
    placement = first_placement([A, B, C])
    single = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C, draining=True),
                   PlannedSite(D)], ["messages"], 2, 3, placement)
    moving = replace(single, transitions=in_waves(single.transitions, 2))
    steps = moving.transitions
    assert [step.action for step in steps[:3]] == ["add", "add", "remove"]
    taken = apply_transitions(placement, steps[:2])
    catching = ClusterState(placement=taken, plan=moving, catch_ups=tuple(
        CatchUp(step.shard_id, step.site, taken.version) for step in steps[:2]))
    versions: dict[str, int | None] = {A: taken.version, B: taken.version,
                                       C: taken.version, D: taken.version}
    assert step_phases(moving, catching, versions, bootstrapping={1})[:3] == [
        "CatchingUp", "Bootstrapping", "Pending"]
    one_left = replace(catching, catch_ups=catching.catch_ups[1:])
    assert step_phases(moving, one_left, versions)[:3] == ["Done", "CatchingUp", "Pending"]
    removed = apply_transition(taken, steps[2])
    later = replace(one_left, placement=removed)
    assert step_phases(moving, later, versions)[:3] == ["Done", "CatchingUp", "Removing"]
    done = replace(later, catch_ups=())
    assert step_phases(moving, done, {D: removed.version})[:3] == ["Done", "Done", "Done"]


def test_transition_objects_are_named_per_plan_and_owned() -> None:
    placement = first_placement([A, B, C])
    one = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C, draining=True), PlannedSite(D)],
               ["messages"], 2, 3,
               placement)
    other = plan([PlannedSite(A), PlannedSite(B, draining=True), PlannedSite(C), PlannedSite(D)],
                 ["messages"], 2, 3,
                 placement)
    # Two plans from one version get names of their own.
    assert transition_name("mq", one, 0) != transition_name("mq", other, 0)
    made = transition_manifest(OWNER, one, 1, one.transitions[1])
    assert made["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert made["spec"] == {"durableStorage": "mq", "database": "messages",
                            "shard": one.transitions[1].shard, "action": "Remove",
                            "site": one.transitions[1].site, "step": 1}
    # With the pod that holds the site, and why the plan was made (for a restart).
    run = PlanRun(key=plan_key(one), trigger="Scale", message="sites 3 -> 4",
                  steps=len(one.transitions), started=0.0)
    placed = transition_manifest(OWNER, one, 1, one.transitions[1], "mq-2", run)
    assert placed["spec"]["pod"] == "mq-2"
    assert placed["metadata"]["annotations"] == {"stratamq.io/plan-trigger": "Scale",
                                                 "stratamq.io/plan-trigger-message":
                                                 "sites 3 -> 4"}


def test_step_numbers_are_zero_padded_and_names_fit_the_limit() -> None:
    """`kubectl get` sorts by name: step 10 after step 9 (issue 23)."""
    placement = first_placement([A, B, C])
    moving = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C, draining=True), PlannedSite(D)],
                  ["messages"], 2, 3,
                  placement)
    names = [transition_name("mq", moving, step) for step in range(len(moving.transitions))]
    assert names[0] == f"mq-{plan_key(moving)}-000"
    assert names == sorted(names)
    many = replace(moving, transitions=moving.transitions * 600)  # 2400 steps: 4 digits
    assert transition_name("mq", many, 7).endswith("-0007")
    assert sorted(transition_name("mq", many, step) for step in (9, 10, 100, 1000)) == [
        transition_name("mq", many, step) for step in (9, 10, 100, 1000)]
    # A storage name as long as any object's (253) is cut, the step and plan kept.
    long = transition_name("s" * 253, moving, 3)
    assert len(long) == 253 and long.endswith(f"-{plan_key(moving)}-003")
    assert not transition_name("a-" * 126 + "b", moving, 3).split(plan_key(moving))[0].endswith(
        "--")


def test_a_failover_event_names_the_leaders_their_pods_and_the_epoch() -> None:
    move = LeaderMove(("messages", 1), A, B, 7, handover=False)
    event = leader_move_event(OWNER, move, {A: "mq-0", B: "mq-1"}, "2026-11-27T10:00:00Z")
    assert event["involvedObject"] == {"apiVersion": "stratamq.io/v1alpha1",
                                       "kind": "DurableStorage", "name": "mq",
                                       "namespace": "brokers", "uid": "u-1"}
    assert (event["type"], event["reason"]) == ("Warning", "Failover")
    assert event["message"] == (
        f"messages/1: its leader is gone or hears no majority of its replicas; leader "
        f"{A} (pod mq-0) -> {B} (pod mq-1) at epoch 7")
    handed = leader_move_event(OWNER, replace(move, handover=True), {B: "mq-1"}, "")
    assert (handed["type"], handed["reason"]) == ("Normal", "LeaderHandover")
    assert f"leader {A} -> {B} (pod mq-1)" in handed["message"]  # A's pod not known


def test_a_plan_says_why_it_was_made() -> None:
    assert plan_trigger([(A, B, C)], (A, B, C, D, "E" * 16), [], 3) == ("Scale",
                                                                        "sites 3 -> 5")
    assert plan_trigger([(A, B, C)], (A, B, D), [], 3) == (
        "SiteReplaced", f"site(s) {C} replaced by {D}")
    assert plan_trigger([], (A, B, C), [3, 3], 2) == ("ReplicationFactor",
                                                      "replication factor 3 -> 2")
    assert plan_trigger([(A, B, C)], (A, B), [3], 2) == (
        "Scale", "sites 3 -> 2; replication factor 3 -> 2")


def test_a_step_shows_the_phases_it_passed_between_two_rounds() -> None:
    # A join seen first when already caught up went through CatchingUp and Joined;
    # through Bootstrapping only where its site bootstrapped.
    assert phase_path("add", T.PENDING, T.DONE, False) == [T.CATCHING_UP, T.JOINED, T.DONE]
    assert phase_path("add", T.PENDING, T.JOINED, True) == [T.BOOTSTRAPPING, T.CATCHING_UP,
                                                            T.JOINED]
    assert phase_path("add", T.BOOTSTRAPPING, T.DONE, True) == [T.CATCHING_UP, T.JOINED,
                                                                T.DONE]
    assert phase_path("add", T.CATCHING_UP, T.CATCHING_UP, True) == []
    # A site bootstrapping again (restarted mid-transfer) goes back as it is.
    assert phase_path("add", T.CATCHING_UP, T.BOOTSTRAPPING, True) == [T.BOOTSTRAPPING]
    assert phase_path("remove", T.PENDING, T.DONE, False) == [T.REMOVING, T.DONE]
    assert phase_path("add", T.CATCHING_UP, T.FAILED, False) == [T.FAILED]


def test_the_operator_keeps_its_term_and_steps_aside_for_a_newer_one() -> None:
    """The controller term (issue 22): the operator takes a term above the kept one and
    every one reported, keeps it in status.controller; a push refused for its placement
    is adopted next round (a Warning event), one refused for a newer term fences it (an
    error and a Warning event; nothing pushed from then on)."""
    document = kept_document(StatusRecord(ClusterState(placement=first_placement([A, B, C])),
                                          term=ControllerTerm(4, "operator-0")))
    assert record_of(document).term == ControllerTerm(4, "operator-0")
    assert record_of({}).term == NO_TERM  # kept by an operator before terms
    running = StorageController(OWNER, settings_of(parse_spec(SPEC), 1.0), kept(document))

    def hold(reported: dict[str, ControllerTerm | None]) -> bool:
        return running.pushes.hold_term(reported, running.state.placement)

    keeper = running.term_keeper
    assert hold({}) and keeper.term is None  # no report: no term yet
    assert hold({A: ControllerTerm(2, "c"), B: None})
    assert keeper.term is not None and keeper.term.number == 5
    own = keeper.term.to_json()
    running.pushes.push_answered(A, 2, {"accepted": True, "version": 2, "term": own})
    assert running.pushes.take_warnings() == []
    running.pushes.push_answered(A, 2, {"accepted": False, "version": 3, "term": own})
    [(reason, message)] = running.pushes.take_warnings()
    assert reason == "PlacementRefused" and "keeps version 3" in message
    assert keeper.fenced_by is None and hold({A: keeper.term})
    running.pushes.push_answered(B, 2, {"accepted": False, "version": 2, "term": [6, "other"]})
    [(reason, message)] = running.pushes.take_warnings()
    assert reason == "ControllerFenced" and "6/other" in message
    assert keeper.fenced_by == ControllerTerm(6, "other")
    assert not hold({A: keeper.term})
    assert running.snapshot().fenced


def test_a_site_reporting_a_newer_term_fences_the_operator() -> None:
    running = StorageController(OWNER, settings_of(parse_spec(SPEC), 1.0), kept({}))

    def hold(reported: dict[str, ControllerTerm | None]) -> bool:
        return running.pushes.hold_term(reported, running.state.placement)

    assert hold({A: NO_TERM})
    assert running.term_keeper.term == ControllerTerm(1, running.term_keeper.controller_id)
    assert not hold({A: ControllerTerm(1, "zzzz-later")})
    assert [reason for reason, _ in running.pushes.take_warnings()] == ["ControllerFenced"]


def test_a_site_is_in_the_zone_of_its_pods_node() -> None:
    assert zone_of_node({"metadata": {"labels": {"topology.kubernetes.io/zone": "eu-1a",
                                                 "kubernetes.io/hostname": "n1"}}}) == "eu-1a"
    unzoned: list[dict[str, Any] | None] = [
        None, {"metadata": {}}, {"metadata": {"labels": None}},
        {"metadata": {"labels": {"topology.kubernetes.io/zone": ""}}}]
    assert [zone_of_node(node) for node in unzoned] == [None] * 4
    report = parse_report({"site": A, "peer": "10.0.0.1:18084", "placement_version": None,
                           "shards": [], "stopping": False, "heartbeat_interval": 1.0,
                           "controller_term": [0, ""], "zone": "reported"})
    known = SiteState(id=A, admin_url="", last_seen=0.0)
    on_zoned_node = PodView("mq-0", "10.0.0.1", True, False, zone="eu-1a")
    assert seen_on(known, report, on_zoned_node, 5.0).zone == "eu-1a"
    assert seen_on(known, report, replace(on_zoned_node, zone=None), 5.0).zone == "reported"
    assert seen_on(known, report, on_zoned_node, 5.0).last_seen == 5.0


def test_hand_backs_are_bounded_two_operators_acting_at_once_leave_one_fenced() -> None:
    """A controller hands back when another replica of the operator kept a newer term
    (a Kopf peering hand-over): its storage's next round makes a new one. Two
    operators acting on one storage at once (two releases watching one namespace)
    would take terms over each other's for ever: past MAX_HAND_BACKS in
    HAND_BACK_WINDOW seconds a hand-back is refused and the controller stays, fenced
    like by any other, for a window; then it may hand back again (a peering that
    flapped must not leave the storage without a controller for good)."""
    controllers = Controllers()
    for number in range(MAX_HAND_BACKS):
        running = StorageController(OWNER, settings_of(parse_spec(SPEC), 1.0), kept({}))
        running.handed_back = True
        assert controllers.hand_back(running, 10.0 * number)
    refused = StorageController(OWNER, settings_of(parse_spec(SPEC), 1.0), kept({}))
    refused.handed_back = True
    assert not controllers.hand_back(refused, 50.0)
    assert refused.yield_refused_until == 50.0 + HAND_BACK_WINDOW and not refused.handed_back
    refused.handed_back = True  # it yields again once the window is over
    assert controllers.hand_back(refused, 50.0 + HAND_BACK_WINDOW)


def test_a_paused_replicas_controllers_export_no_metrics() -> None:
    """A replica of the operator that Kopf's peering paused keeps its controllers and
    runs no rounds: its stratamq_cluster_* series stood, stale, beside those of the
    replica that acts (the dashboards' sums counted both). Only controllers that ran
    a round lately are exported."""
    controllers = Controllers()
    acting = StorageController(OWNER, settings_of(parse_spec(SPEC), 1.0), kept({}))
    paused = StorageController(replace(OWNER, name="other", uid="u-2"),
                               settings_of(parse_spec(SPEC), 1.0), kept({}))
    now = time.monotonic()
    acting.last_round_at, paused.last_round_at = now - 1.0, now - 60.0
    controllers._by_uid = {"u-1": acting, "u-2": paused}  # as `of` makes them
    assert controllers.acting(now, 10.0) == [acting]
    names = {sample.labels.get("name") for family in OperatorCollector(controllers, 10.0)
             .collect() for sample in family.samples}
    assert names == {"mq"}
