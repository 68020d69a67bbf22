"""The test control plane itself: the API server answers with the version it was
built at, and the controller manager really runs controllers (a StatefulSet gets its
Pods and volume claims; deleting it garbage-collects them). No kubelet runs, so the
Pods stay Pending."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from harness import waiting
from tests.support.kube import ControlPlane, running_control_plane

STATEFUL_SET = {
    "apiVersion": "apps/v1", "kind": "StatefulSet",
    "metadata": {"name": "web"},
    "spec": {
        "replicas": 3, "serviceName": "web", "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": {"app": "web"}},
        "template": {"metadata": {"labels": {"app": "web"}},
                     "spec": {"containers": [{"name": "web", "image": "example/web:1"}]}},
        "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}],
    },
}


def items(kube: ControlPlane, namespace: str, kind: str) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = json.loads(
        kube.kubectl("get", "-n", namespace, kind, "-o", "json").stdout)["items"]
    return listed


def wait_for(what: str, check: Callable[[], object], timeout: float = 60) -> None:
    waiting.wait_for(what, check, timeout, every=0.2)


def test_server_version(kube: ControlPlane) -> None:
    version = json.loads(kube.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == version["clientVersion"]["gitVersion"]
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    status, ready = kube.get("/readyz")
    assert (status, ready) == (200, "ok")


def test_a_second_control_plane_leaves_nothing_behind(kube: ControlPlane) -> None:
    """Started beside the session's one (ports of its own), and once its block ends its
    processes are gone and its folder (etcd data, keys, logs) is removed."""
    with running_control_plane() as plane:
        assert plane.apiserver.url != kube.apiserver.url
        plane.kubectl("create", "namespace", "only-here")
        workdir = plane.workdir
        pids = [process.pid for process in plane.processes()]
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    assert not workdir.exists()
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert kube.kubectl("get", "namespace", "only-here", check=False).returncode != 0


def test_statefulset_gets_pods_from_the_controller_manager(kube: ControlPlane,
                                                           namespace: str) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(STATEFUL_SET))
    wait_for("3 pods", lambda: len(items(kube, namespace, "pods")) == 3)
    pods = items(kube, namespace, "pods")
    assert sorted(pod["metadata"]["name"] for pod in pods) == ["web-0", "web-1", "web-2"]
    for pod in pods:
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("StatefulSet", "web")
        assert pod["status"]["phase"] == "Pending"  # no kubelet, no scheduler
        assert "nodeName" not in pod["spec"]
        # Admitted with the namespace's default ServiceAccount, which the controller
        # manager made.
        assert pod["spec"]["serviceAccountName"] == "default"
    claims = sorted(claim["metadata"]["name"] for claim in items(kube, namespace, "pvc"))
    assert claims == ["data-web-0", "data-web-1", "data-web-2"]

    kube.kubectl("scale", "-n", namespace, "statefulset/web", "--replicas=1")
    wait_for("2 pods gone", lambda: len(items(kube, namespace, "pods")) == 1)
    assert items(kube, namespace, "pods")[0]["metadata"]["name"] == "web-0"

    # Owner references garbage-collect: the Pod goes with its StatefulSet.
    kube.kubectl("delete", "-n", namespace, "statefulset/web")
    wait_for("the pod collected", lambda: items(kube, namespace, "pods") == [])
