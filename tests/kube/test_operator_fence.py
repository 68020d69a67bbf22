"""The fence between two operators (issue 8, "the operator's own leader election"):
Kopf's peering is a lease by convention, so at a hand-over two replicas may both
run a round. The controller's state write (`status.controller`) is conditional on the
resourceVersion it last read, and a placement is pushed only after that write: an
operator that lost the race loads the other's state and pushes nothing.
`KeptState` is that write, the operator's `StateStore` (broker/controller/store.py):
it keeps what no one else wrote over, and refuses, with theirs, what another did.

Against the real API server, with the controller (`StorageController`) in this
process and one real site (a broker process) as the storage's only pod; the "other
operator" writes its state with `kubectl`, as any writer of the status would."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kopf._core.engines import posting

from harness.cluster import SiteProcess
from harness.processes import HOST, BrokerProcess, http_json
from stratamq.broker.controller.decisions import ClusterState
from stratamq.broker.controller.store import KeepRefused, Kept
from stratamq.broker.ds.replication import Placement, PlannedSite, plan
from stratamq.broker.ds.replication.term import ControllerTerm
from stratamq.operator import controller, handlers, kube
from stratamq.operator.kept_state import KeptState, StatusRecord, kept_document
from stratamq.operator.resources import Owner
from stratamq.operator.spec import parse_spec
from tests.support.kube import ControlPlane
from tests.support.state_store import check_keeps_and_loads

NAME = "fence"
N_SHARDS = 2



@pytest.fixture
def site(tmp_path: Path) -> Iterator[SiteProcess]:
    process = SiteProcess(tmp_path / "site", 0, HOST, n_shards=N_SHARDS, heartbeat_interval=0.5)
    process.start()
    yield process
    process.stop()


def placement_version(site: SiteProcess) -> int | None:
    found: int | None = site.replication()["placement_version"]
    return found


def applied_storage(api: ControlPlane, namespace: str, site: SiteProcess
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The storage these tests run (one site, replication factor 1, the site's admin
    port) applied: its spec and the object as read back."""
    spec: dict[str, Any] = {"sites": 1, "messages": {"nShards": N_SHARDS, "replicationFactor": 1},
                            "admin": {"port": site.admin_port}}
    api.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME}, "spec": spec}))
    read = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
    assert read is not None
    return spec, read


def test_a_stale_state_write_is_refused_and_nothing_pushed(
        api: ControlPlane, namespace: str, site: SiteProcess) -> None:
    spec, read = applied_storage(api, namespace, site)
    owner = Owner(name=NAME, namespace=namespace, uid=read["metadata"]["uid"])
    # This operator read the storage (no controller state yet) ...
    late = controller.StorageController(
        owner, controller.settings_of(parse_spec(spec), 0.5),
        KeptState(owner, {}, read["metadata"]["resourceVersion"]))
    # ... then another one made the first placement and kept it (version 7: not the
    # version 1 this one would make; the site's peer address not known to it yet, so
    # the state this one keeps next differs from it).
    report = site.replication()
    theirs = dataclasses.replace(
        plan([PlannedSite(report["site"])], list(controller.DATABASES), N_SHARDS, 1,
             Placement.empty()).start,
        version=7)
    document = kept_document(StatusRecord(
        ClusterState(placement=theirs,
                     goals={database: (report["site"],) for database in controller.DATABASES}),
        {report["site"]: None}, {report["site"]: f"{NAME}-0"}))
    api.kubectl("patch", "-n", namespace, "durablestorage", NAME, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": {"controller": document}}))

    pods = [kube.PodView(name=f"{NAME}-0", ip=site.host, ready=True, terminating=False)]
    late.round(parse_spec(spec), 1, pods, BrokerProcess.ADMIN_TOKEN)
    # Its own first placement was refused by the API server: it took the other's state
    # and pushed nothing.
    assert late.state.placement == theirs
    kept = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
    assert kept is not None and kept["status"]["controller"] == document
    assert placement_version(site) is None

    # A change by another writer that leaves the controller's state alone (a label,
    # the status refresh, Kopf's marks) moves the resourceVersion too: the write is
    # tried again at the new one, and the kept placement pushed after it.
    api.kubectl("label", "-n", namespace, "durablestorage", NAME, "touched=yes")
    late.round(parse_spec(spec), 1, pods, BrokerProcess.ADMIN_TOKEN)
    assert placement_version(site) == 7
    kept = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
    assert kept is not None
    assert json.loads(kept["status"]["controller"]["placement"])["version"] == 7
    assert kept["status"]["controller"]["sites"] == [
        {"id": report["site"], "pod": f"{NAME}-0", "peer": report["peer"]}]


def test_the_status_store_keeps_and_refuses_what_another_writer_kept(
        api: ControlPlane, namespace: str) -> None:
    api.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME},
        "spec": {"sites": 1, "messages": {"replicationFactor": 1}}}))

    def fresh() -> KeptState:
        """status.controller as an operator starting now reads it."""
        read = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
        assert read is not None
        return KeptState(owner_of(read), (read.get("status") or {}).get("controller") or {},
                         read["metadata"]["resourceVersion"])

    first = placed_on(["A", "B"], 1)
    records = [StatusRecord(first, {"A": "10.0.0.1:18084", "B": None}, {"A": f"{NAME}-0"}),
               StatusRecord(placed_on(["A", "B"], 2), {"A": "10.0.0.1:18084"},
                            forgotten=frozenset({"B"}), term=ControllerTerm(3, "op-1"))]
    check_keeps_and_loads(fresh, records)

    mine, other = fresh(), fresh()
    theirs = StatusRecord(placed_on(["C"], 4), {"C": None}, term=ControllerTerm(4, "op-2"))
    assert other.keep(theirs) == Kept()
    assert mine.keep(records[0]) == KeepRefused(theirs)
    assert fresh().load() == theirs
    # Refused once, it has read theirs: its next keep is at the version it read.
    assert mine.keep(records[0]) == Kept()
    assert fresh().load() == records[0]
    api.kubectl("delete", "-n", namespace, "durablestorage", NAME)
    assert mine.keep(records[1]) == KeepRefused(None)


def test_an_operator_paused_while_another_took_the_term_acts_again_above_it(
        api: ControlPlane, namespace: str, site: SiteProcess) -> None:
    """Issue 23: Kopf's peering pauses one replica of the operator while another (with
    a higher priority) acts and takes a newer term. When the other is gone and this one
    acts again, the sites hold the other's term: it used to step aside for good (no
    failover, no plan until it restarted); its controller hands back, and the one made
    in its place from the state the other kept (which holds that term) goes on above
    it. A term the state does not hold (a local controller run against the same sites)
    still fences it."""
    spec, read = applied_storage(api, namespace, site)
    parsed = parse_spec(spec)
    pods = [kube.PodView(name=f"{NAME}-0", ip=site.host, ready=True, terminating=False)]
    owner = owner_of(read)

    def site_term() -> ControllerTerm:
        number, held_by = site.replication()["controller_term"]
        return ControllerTerm(number, held_by)

    def round_of(controllers: controller.Controllers) -> controller.StorageController:
        running = controllers.of(owner, parsed, 0.5)
        assert running is not None
        running.round(parsed, 1, pods, BrokerProcess.ADMIN_TOKEN)
        return running

    paused_operator, other_operator = controller.Controllers(), controller.Controllers()
    paused = round_of(paused_operator)
    assert placement_version(site) == 1 and site_term() == paused.term_keeper.term
    other = round_of(other_operator)  # the peering paused `paused`; `other` acts
    theirs = other.term_keeper.term
    assert theirs is not None and site_term() == theirs
    assert paused.term_keeper.term is not None and theirs > paused.term_keeper.term

    # `other` went; `paused` acts again: its controller hands back ...
    assert round_of(paused_operator) is paused and paused.handed_back
    assert paused_operator.hand_back(paused, 0.0)
    # ... and the one made from the state kept goes on above the other's term.
    resumed = round_of(paused_operator)
    assert resumed is not paused and not resumed.snapshot().fenced
    own = resumed.term_keeper.term
    assert own is not None and own > theirs and site_term() == own
    assert resumed.pushes.take_warnings() == []
    stored = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
    assert stored is not None and stored["status"]["controller"]["term"]["number"] == own.number

    # A term no operator kept: another controller's.
    foreign = ControllerTerm(own.number + 5, "local-controller")
    assert http_json("PUT", f"{site.admin_url}/api/v1/ds/controller-term",
                     {"term": foreign.to_json()})["accepted"] is True
    for _ in range(2):
        assert round_of(paused_operator) is resumed
    assert not resumed.handed_back
    assert resumed.snapshot().fenced and resumed.term_keeper.fenced_by == foreign
    assert [reason for reason, _ in resumed.pushes.take_warnings()] == ["ControllerFenced"]


def test_the_control_handler_hands_back_and_goes_on_in_the_same_round(
        api: ControlPlane, namespace: str, site: SiteProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Kopf timer `control` of two operator replicas in turn (their memos), with the
    real API server and a real site: the one the peering paused, acting again, hands
    its controller back and runs the one made in its place in the same call (no round
    without a controller: no Pending or NoLeader status for a round), takes a term
    above the other's, applies the objects again (another operator acted), and scales
    the StatefulSet by the spec applied."""
    monkeypatch.setattr(handlers, "HEARTBEAT_INTERVAL", 0.5)
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.CRITICAL + 1  # no Kopf event queue here
    posting.settings_var.set(settings)
    spec, read = applied_storage(api, namespace, site)
    owner = owner_of(read)
    # the admin token the site was started with, where the operator reads it
    api.kubectl("create", "secret", "generic", f"{NAME}-admin", "-n", namespace,
                f"--from-literal=token={BrokerProcess.ADMIN_TOKEN}")
    pod = kube.SitePod(name=f"{NAME}-0", ip=site.host, ready=True, terminating=False,
                       node=None)
    index = {(namespace, NAME): [pod]}

    def memo_of_an_operator() -> kopf.Memo:
        memo = kopf.Memo()
        memo["controllers"] = controller.Controllers()
        memo["node_zones"] = kube.NodeZones()
        return memo

    timer: Any = handlers.control  # as Kopf calls it, with what this test has

    def control(memo: kopf.Memo) -> controller.StorageController:
        timer(name=NAME, namespace=namespace, uid=owner.uid, spec=spec,
              meta={"generation": 1}, body=read, memo=memo, site_pod_index=index)
        running = handlers.controllers_of(memo).existing(owner.uid)
        assert running is not None
        return running

    def site_term() -> ControllerTerm:
        number, held_by = site.replication()["controller_term"]
        return ControllerTerm(number, held_by)

    paused, other = memo_of_an_operator(), memo_of_an_operator()
    handlers.apply_and_note(owner, spec, 1, paused)  # its reconcile
    first = control(paused)
    assert site_term() == first.term_keeper.term
    handlers.apply_and_note(owner, spec, 1, other)
    theirs = control(other).term_keeper.term
    assert theirs is not None and site_term() == theirs
    kube.scale("StatefulSet", namespace, NAME, 0)  # the scale is the controller's
    again = control(paused)  # acting again: hands back, and goes on
    assert again is not first and again.in_charge
    handed = [event for event in json.loads(api.kubectl(
        "get", "-n", namespace, "events", "-o", "json").stdout)["items"]
        if event["reason"] == "ControllerHandedBack"]
    assert len(handed) == 1 and handed[0]["involvedObject"]["uid"] == owner.uid \
        and f"controller term {theirs}" in handed[0]["message"], handed
    own = again.term_keeper.term
    assert own is not None and own > theirs and site_term() == own
    applied = handlers.applied_of(paused)
    assert applied.get() == 1 and not applied.is_stale()  # applied again
    found = kube.get("apps/v1", "StatefulSet", namespace, NAME)
    assert found is not None and found["spec"]["replicas"] == 1


def owner_of(storage: dict[str, Any]) -> Owner:
    return Owner(name=storage["metadata"]["name"], namespace=storage["metadata"]["namespace"],
                 uid=storage["metadata"]["uid"])


def placed_on(sites: list[str], version: int) -> ClusterState:
    placement = plan([PlannedSite(site) for site in sites], list(controller.DATABASES), N_SHARDS,
                     1, Placement.empty()).start
    return ClusterState(placement=dataclasses.replace(placement, version=version),
                        goals={database: tuple(sites) for database in controller.DATABASES})
