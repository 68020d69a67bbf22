"""A DurableStorage deleted and made again over its retained volumes (issue 21, defect
5): its sites come back holding the placement of the first storage, which the new
storage's `status.controller` does not know. The operator adopts what they hold (a
Warning event `PlacementAdopted` says so) instead of staying Placing for ever."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import yaml

from harness import waiting
from tests.support.kube import ControlPlane
from tests.support.kubelet import Kubelet
from tests.support.operator_process import Operators

NAMESPACE = "operator-recreate"
NAME = "again"
SPEC: dict[str, Any] = {"sites": 3, "messages": {"nShards": 1, "replicationFactor": 3},
                        "storage": {"size": "1Gi"}}
TIMEOUT = 180.0


def wait_for(what: str, check: Callable[[], Any], explain: Callable[[], str]) -> Any:
    return waiting.wait_for(what, check, TIMEOUT, explain)


def storage(kube: ControlPlane) -> dict[str, Any] | None:
    found = kube.kubectl("get", "-n", NAMESPACE, "-o", "json", "durablestorage", NAME,
                         check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def ready(kube: ControlPlane) -> dict[str, Any] | None:
    found = storage(kube)
    status = (found or {}).get("status", {})
    return found if status.get("phase") == "Ready" and len(status.get("sites", [])) == 3 \
        else None


def test_a_storage_made_again_over_its_volumes_adopts_its_sites_placement(
        kube_cluster: ControlPlane, node: Kubelet, operators: Operators) -> None:
    def explain() -> str:
        return (f"storage: {json.dumps((storage(kube_cluster) or {}).get('status'), indent=1)}"
                f"\n{operators.logs()}")

    manifest = yaml.safe_dump({"apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
                               "metadata": {"name": NAME}, "spec": SPEC})
    kube_cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=manifest)
    first = wait_for("the first storage Ready", lambda: ready(kube_cluster), explain)["status"]
    placed = json.loads(first["controller"]["placement"])
    sites = {site["id"] for site in first["sites"]}

    kube_cluster.kubectl("delete", "-n", NAMESPACE, "durablestorage", NAME, "--wait=true",
                    "--timeout=120s")
    wait_for("every pod of the first storage gone", lambda: not node.running(NAMESPACE),
             explain)

    kube_cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=manifest)
    again = wait_for("the storage made again Ready", lambda: ready(kube_cluster), explain)
    status = again["status"]
    assert {site["id"] for site in status["sites"]} == sites  # the same sites, same data
    adopted = json.loads(status["controller"]["placement"])
    assert adopted["version"] >= placed["version"]
    events = json.loads(kube_cluster.kubectl(
        "get", "-n", NAMESPACE, "events", "-o", "json",
        "--field-selector", f"involvedObject.uid={again['metadata']['uid']}").stdout)
    reasons = {event["reason"] for event in events["items"]}
    assert "PlacementAdopted" in reasons, reasons
