"""Rebalancing you can follow (issue 23), against the real API server, with the
replication controller (`StorageController`) in this process, as in
test_operator_fence.py:

1. at an operator start, the ReplicaTransitions of plans older than the newest
   spec.transitionHistoryLimit are deleted, never those of the plan it resumes (one
   of those missing is made again), and status.rebalance's summary of that plan
   comes back from its ReplicaTransitions;
2. with three real sites (broker processes, one per "pod" on a loopback address of
   its own): a leading site is killed and the failover is an Event on the
   DurableStorage, naming the old and the new leader with their pods and the new
   epoch; with the site back, a replication factor change is planned (a plan
   summarised as ReplicationFactor, its steps naming the pods of their sites), the
   old plans' ReplicaTransitions go as it starts, and it ends Done."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster import SiteProcess
from harness.processes import BrokerProcess, free_port
from harness.waiting import wait_for
from stratamq.broker.controller.decisions import ClusterState
from stratamq.broker.ds.replication import Placement, Plan, PlannedSite, plan
from stratamq.operator import controller, kube
from stratamq.operator.kept_state import StatusRecord, kept_document
from stratamq.operator.rebalance import PlanRun
from stratamq.operator.resources import Owner
from stratamq.operator.spec import parse_spec
from stratamq.operator.transitions import (
    Transitions,
    plan_key,
    transition_manifest,
    transition_name,
)
from tests.support.kube import ControlPlane, refusing

NAME = "rb"
HEARTBEAT = 0.5
TIMEOUT = 60.0  # three brokers and a control plane on a loaded 2-core machine
A, B, C, D = "AAAAAAAAAAAAAAAA", "BBBBBBBBBBBBBBBB", "CCCCCCCCCCCCCCCC", "DDDDDDDDDDDDDDDD"



def make_storage(api: ControlPlane, namespace: str, spec: dict[str, Any]) -> Owner:
    api.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME}, "spec": spec}))
    read = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
    assert read is not None
    return Owner(name=NAME, namespace=namespace, uid=read["metadata"]["uid"])


def transitions(api: ControlPlane, namespace: str) -> dict[str, dict[str, Any]]:
    items = json.loads(api.kubectl("get", "-n", namespace, "replicatransitions", "-o",
                                   "json").stdout)["items"]
    return {item["metadata"]["name"]: item for item in items}


def names_of(plan_: Plan) -> set[str]:
    return {transition_name(NAME, plan_, step) for step in range(len(plan_.transitions))}


def make_transitions(owner: Owner, plan_: Plan, run: PlanRun | None = None) -> None:
    for step, transition in enumerate(plan_.transitions):
        assert kube.create(transition_manifest(owner, plan_, step, transition, run=run))


def plans_from(versions: list[int]) -> list[Plan]:
    """A plan (A, B, C -> A, B, D) from a placement at each of `versions`."""
    first = plan([PlannedSite(A), PlannedSite(B), PlannedSite(C)],
                 ["messages"], 2, 3, Placement.empty()).start
    return [plan([PlannedSite(A), PlannedSite(B), PlannedSite(C, draining=True), PlannedSite(D)],
                 ["messages"], 2, 3,
                 dataclasses.replace(first, version=version)) for version in versions]


def test_old_plans_go_at_a_start_and_the_resumed_one_is_summarised(
        api: ControlPlane, namespace: str) -> None:
    spec: dict[str, Any] = {"sites": 3, "transitionHistoryLimit": 2,
                            "messages": {"nShards": 2, "replicationFactor": 3}}
    owner = make_storage(api, namespace, spec)
    oldest, older, newer, running = plans_from([2, 3, 9, 4])
    run = PlanRun(key=plan_key(running), trigger="Scale", message="sites 3 -> 4",
                  steps=len(running.transitions), started=0.0)
    for made in (oldest, older, newer):
        make_transitions(owner, made)
    make_transitions(owner, running, run)
    # The plan running is one that started before `newer` (say a goal changed back).
    document = kept_document(StatusRecord(
        ClusterState(placement=running.start, plan=running, goals={"messages": (A, B, D)})))
    api.kubectl("patch", "-n", namespace, "durablestorage", NAME, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": {"controller": document}}))

    # One step of it lost (or made under another name by an older operator).
    lost = transition_name(NAME, running, 1)
    assert kube.delete("stratamq.io/v1alpha1", "ReplicaTransition", namespace, lost)

    started = controller.Controllers().of(owner, parse_spec(spec), HEARTBEAT)
    assert started is not None
    found = transitions(api, namespace)
    assert set(found) == names_of(running) | names_of(newer)
    assert found[lost]["status"]["phase"] == "Pending"  # made again
    summary = started.view().rebalance
    assert summary is not None
    assert {key: summary[key] for key in ("plan", "trigger", "message", "steps", "stepsDone",
                                          "result")} == {
        "plan": plan_key(running), "trigger": "Scale", "message": "sites 3 -> 4",
        "steps": len(running.transitions), "stepsDone": 0, "result": "Running"}


def test_steps_the_api_server_refused_are_made_on_a_later_round(
        api: ControlPlane, namespace: str) -> None:
    """Issue 23: a plan's ReplicaTransitions were made once, on the round that found
    the plan: an API error part way (here a real admission policy that refuses steps
    past the second) left the rest unmade until the operator restarted. They are made
    on later rounds."""
    owner = make_storage(api, namespace, {"sites": 3})
    [running] = plans_from([2])
    assert len(running.transitions) > 2
    state = ClusterState(placement=running.start, plan=running, goals={"messages": (A, B, D)})
    followed = Transitions(owner, None, 5)
    with refusing(api, namespace, {"apiGroups": ["stratamq.io"], "apiVersions": ["*"],
                                   "operations": ["CREATE"], "resources": ["replicatransitions"]},
                  "object.spec.step < 2",
                  transition_manifest(owner, running, 2, running.transitions[2])):
        followed.follow(state, {}, {}, {}, None, 5)
        assert set(transitions(api, namespace)) == {transition_name(NAME, running, step)
                                                    for step in (0, 1)}
    followed.follow(state, {}, {}, {}, None, 5)
    found = transitions(api, namespace)
    assert set(found) == names_of(running)
    assert {item["status"]["phase"] for item in found.values()} == {"Pending"}


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[list[SiteProcess]]:
    """Three sites, each on a loopback address of its own with the one admin port
    the spec names (as pods are)."""
    admin = free_port()
    made = []
    for index in range(3):
        host = f"127.0.0.{index + 2}"
        site = SiteProcess(tmp_path / f"site-{index}", index, host, n_shards=1,
                           heartbeat_interval=HEARTBEAT,
                           config={"admin": {"bind": f"{host}:{admin}"}})
        site.admin_port = admin
        made.append(site)
    try:
        for site in made:
            site.start()
        yield made
    finally:
        for site in made:
            site.kill()


def test_a_plan_is_summarised_and_a_failover_is_an_event(
        api: ControlPlane, namespace: str, sites: list[SiteProcess]) -> None:
    spec: dict[str, Any] = {"sites": 3, "transitionHistoryLimit": 1,
                            "messages": {"nShards": 1, "replicationFactor": 3},
                            "admin": {"port": sites[0].admin_port}}
    owner = make_storage(api, namespace, spec)
    [old] = plans_from([1])
    make_transitions(owner, old)  # a plan of long ago
    running = controller.Controllers().of(owner, parse_spec(spec), HEARTBEAT)
    assert running is not None
    pods = [kube.PodView(name=f"{NAME}-{site.index}", ip=site.host, ready=True,
                         terminating=False) for site in sites]
    by_id = {site.replication()["site"]: site for site in sites}
    pod_of = {site_id: f"{NAME}-{site.index}" for site_id, site in by_id.items()}

    def rounds_until(what: str, done: Any) -> Any:
        """Rounds, a heartbeat apart, as the operator's timer runs them."""
        def step() -> Any:
            running.round(parse_spec(spec), 1, pods, BrokerProcess.ADMIN_TOKEN)
            return done()
        return wait_for(what, step, timeout=TIMEOUT, every=HEARTBEAT)
    rounds_until("the first placement", lambda: running.state.placement.version > 0 and all(
        site.replication()["placement_version"] == running.state.placement.version
        for site in sites))
    assert running.view().rebalance is None  # no plan yet

    # A leading site killed: a failover, and an Event saying so.
    shard = running.state.placement.shard("messages", 0)
    by_id[shard.leader].kill()  # its pod stays, as a pod does until it is replaced
    rounds_until("a failover", lambda: running.state.placement.shard(
        "messages", 0).leader != shard.leader)
    after = running.state.placement.shard("messages", 0)
    assert after.epoch > shard.epoch
    events = json.loads(api.kubectl(
        "get", "-n", namespace, "events", "-o", "json",
        f"--field-selector=involvedObject.name={NAME},reason=Failover").stdout)["items"]
    messages = [event["message"] for event in events
                if event["involvedObject"]["uid"] == owner.uid and event["type"] == "Warning"]
    assert (f"messages/0: its leader is gone or hears no majority of its replicas; leader "
            f"{shard.leader} (pod {pod_of[shard.leader]}) -> {after.leader} "
            f"(pod {pod_of[after.leader]}) at epoch {after.epoch}") in messages, messages
    assert running.state.plan is None  # a failover is no plan

    # The site back (its pod restarted), then 3 -> 2 replicas: a plan, summarised; its
    # steps name their pods; the plan of long ago goes (a limit of 1: the plan
    # running alone keeps its transitions).
    by_id[shard.leader].start()
    rounds_until("every site at the newest placement", lambda: all(
        site.replication()["placement_version"] == running.state.placement.version
        for site in sites))
    spec["messages"]["replicationFactor"] = 2
    rounds_until("a plan", lambda: running.state.plan is not None)
    assert running.state.plan is not None
    made = names_of(running.state.plan)
    listed = transitions(api, namespace)
    assert set(listed) == made
    assert all(item["spec"]["pod"] == pod_of[item["spec"]["site"]] for item in listed.values())
    summary = running.view().rebalance
    assert summary is not None
    assert (summary["trigger"], summary["message"], summary["steps"]) == (
        "ReplicationFactor", "replication factor 3 -> 2", len(made))
    ended = rounds_until("the plan done", lambda: (found := running.view().rebalance) and
                         found["result"] == "Done" and found)
    assert ended["stepsDone"] == ended["steps"] == len(made)
    assert ended["completedAt"] >= ended["startedAt"]
    # The status refresh writes it with a merge patch (Kopf's): over a running
    # summary's ETA, the ended one leaves none.
    for written in ({**summary, "eta": ended["completedAt"]}, ended):
        assert kube.patch_status("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME,
                                 {"rebalance": written})
    stored = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
    assert stored is not None
    assert stored["status"]["rebalance"] == {key: value for key, value in ended.items()
                                             if value is not None}
    assert set(transitions(api, namespace)) == made  # kept: the newest plan
