"""A reconcile's applies (issue 23), against the real API server, with the operator's
handler functions in this process: an object the API server refuses (here a real
admission policy refusing the sites' StatefulSet) used to end the reconcile there,
leaving the disruption budget, the network policy, the pruning and the Spark objects
after it unapplied and no metric saying so. Each object is tried whatever the others
did, the failures counted by kind and raised together (Kopf retries)."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
import yaml
from prometheus_client import REGISTRY

from stratamq.operator import kube
from stratamq.operator.controller import Controllers
from stratamq.operator.handlers import (
    AppliedBudget,
    ObjectsNotAppliedError,
    applied_of,
    apply_and_note,
    apply_objects,
)
from stratamq.operator.resources import Owner
from stratamq.operator.spec import parse_spec
from tests.support.kube import ControlPlane, refusing

NAME = "applied"
SPEC: dict[str, Any] = {"sites": 3, "messages": {"replicationFactor": 3},
                        "networkPolicy": {"enable": True}}


def apply_errors(kind: str) -> float:
    return REGISTRY.get_sample_value("stratamq_operator_apply_errors_total",
                                     {"kind": kind}) or 0.0


def make_storage(api: ControlPlane, namespace: str) -> Owner:
    api.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME}, "spec": SPEC}))
    read = kube.get("stratamq.io/v1alpha1", "DurableStorage", namespace, NAME)
    assert read is not None
    return Owner(name=NAME, namespace=namespace, uid=read["metadata"]["uid"])


def test_a_refused_stateful_set_leaves_the_other_objects_applied(
        api: ControlPlane, namespace: str) -> None:
    owner = make_storage(api, namespace)
    probe = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "probe"},
             "spec": {"selector": {"matchLabels": {"probe": "yes"}}, "serviceName": "probe",
                      "template": {"metadata": {"labels": {"probe": "yes"}},
                                   "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    before = apply_errors("StatefulSet")
    with refusing(api, namespace, {"apiGroups": ["apps"], "apiVersions": ["*"],
                                   "operations": ["CREATE", "UPDATE"],
                                   "resources": ["statefulsets"]}, "false", probe):
        with pytest.raises(ObjectsNotAppliedError, match=f"StatefulSet {NAME}"):
            apply_objects(owner, SPEC, parse_spec(SPEC), Controllers(), AppliedBudget())
        assert kube.get("apps/v1", "StatefulSet", namespace, NAME) is None
        for api_version, kind in [("policy/v1", "PodDisruptionBudget"),
                                  ("networking.k8s.io/v1", "NetworkPolicy"),
                                  ("v1", "Service")]:
            assert kube.get(api_version, kind, namespace, NAME) is not None, kind
    assert apply_errors("StatefulSet") == before + 1
    apply_objects(owner, SPEC, parse_spec(SPEC), Controllers(), AppliedBudget())
    assert kube.get("apps/v1", "StatefulSet", namespace, NAME) is not None


def test_a_refused_config_map_holds_the_stateful_set_back(
        api: ControlPlane, namespace: str) -> None:
    """A config change makes a new ConfigMap, which the new pod template names: the
    StatefulSet applied while that ConfigMap was refused would roll a site into a pod
    that cannot mount its config. It is held back (and counted) until the ConfigMap
    is applied; the objects after it still are."""
    owner = make_storage(api, namespace)
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}}
    before = apply_errors("StatefulSet")
    with refusing(api, namespace, {"apiGroups": [""], "apiVersions": ["*"],
                                   "operations": ["CREATE", "UPDATE"],
                                   "resources": ["configmaps"]}, "false", probe):
        with pytest.raises(ObjectsNotAppliedError, match="held"):
            apply_objects(owner, SPEC, parse_spec(SPEC), Controllers(), AppliedBudget())
        assert kube.get("apps/v1", "StatefulSet", namespace, NAME) is None
        assert kube.get("policy/v1", "PodDisruptionBudget", namespace, NAME) is not None
    assert apply_errors("StatefulSet") == before + 1
    apply_objects(owner, SPEC, parse_spec(SPEC), Controllers(), AppliedBudget())
    assert kube.get("apps/v1", "StatefulSet", namespace, NAME) is not None


def test_an_older_spec_is_not_applied_over_a_newer_one(api: ControlPlane, namespace: str) -> None:
    """The reconcile of a new generation and a timer holding an older body both applied
    the storage's objects, and whichever came last won: the older one's template (and
    its ConfigMap pruning) over the newer one's, while the generation noted said the
    newer. One apply of a storage at a time, none of a generation older than one
    applied."""
    owner = make_storage(api, namespace)
    memo = kopf.Memo()
    memo["controllers"] = Controllers()
    newer = {**SPEC, "sites": 4}
    assert apply_and_note(owner, newer, 2, memo)
    assert not apply_and_note(owner, SPEC, 1, memo)  # the timer's older body
    stateful_set = kube.get("apps/v1", "StatefulSet", namespace, NAME)
    assert stateful_set is not None and stateful_set["spec"]["replicas"] == 4
    assert applied_of(memo).last() == (newer, 2)
    assert apply_and_note(owner, newer, 2, memo)  # the same generation: drift repaired
