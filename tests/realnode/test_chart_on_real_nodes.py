"""The chart as a user installs it, on real nodes (tests/support/realnode.py): `helm
install` with the chart's own storage (`durableStorage.create`, named after the
release) runs the operator as a pod of the built image; the storage's three sites,
each a container of the same image on its own node, become Ready; MQTT
publish/subscribe works through a site, and so does the chart's `helm test`; `helm
uninstall` takes the operator and the storage away together and completes.

Issue 21's defects 1, 2 and 4 were seen in this very install: the operator's pod
carried the sites' labels and was counted as a site (never Ready); the operator
crashed on its read-only root filesystem (no writable /tmp); `helm uninstall` hung on
the finalizer Kopf's timers put on the storage, which the departed operator never
took off.

The operator and the sites use the host network (the chart's `operator.hostNetwork`,
the storage's `spec.hostNetwork`): these nodes' pod network reaches nothing. The operator
reaches the API server at its loopback address (`operator.env`), since no kube-proxy
routes the `kubernetes` Service."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from harness.processes import REPO
from harness.waiting import wait_for
from stratamq.operator import resources
from tests.support.clients import PahoClient
from tests.support.realnode import RealKubeCluster

CHART = REPO / "charts" / "stratamq"
NAMESPACE = "realnode-chart"
RELEASE = "mq"
# Named after the release (the chart's default is <release>-mq): see below.
STORAGE = RELEASE
SITES = 3
# Far above what each step takes on a loaded 2-core machine (install seconds, Ready
# tens of seconds), far below forever.
INSTALL_TIMEOUT_S = 180
READY_TIMEOUT_S = 300


def storage_status(cluster: RealKubeCluster) -> dict[str, Any]:
    result = cluster.plane.kubectl("get", "-n", NAMESPACE, "durablestorage", STORAGE,
                                   "-o", "json", check=False)
    if result.returncode:
        return {}
    status: dict[str, Any] = json.loads(result.stdout).get("status") or {}
    return status


def peering_priority(cluster: RealKubeCluster, pod: str) -> int:
    """The peering priority an operator replica drew (its start-up log line says it):
    the highest acts."""
    found = wait_for(f"{pod}'s peering priority", lambda: re.search(
        r"peering priority (\d+)", cluster.plane.kubectl(
            "logs", "-n", NAMESPACE, pod, check=False).stdout), timeout=60)
    return int(found.group(1))


def explain(cluster: RealKubeCluster) -> str:
    kubectl = cluster.plane.kubectl
    pods = kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    operator = kubectl("logs", "-n", NAMESPACE, "deployment/mq-stratamq-operator",
                       "--tail=40", check=False)
    return (f"pods:\n{pods}\nstatus: {storage_status(cluster)}\n"
            f"operator log:\n{operator.stdout}{operator.stderr}")


# The first test of the session also starts the cluster (and builds the images when
# they changed: minutes).
@pytest.mark.timeout(1800)
def test_helm_install_a_storage_and_mqtt_through_a_site(real_kube_cluster: RealKubeCluster) -> None:
    cluster = real_kube_cluster
    kubectl = cluster.plane.kubectl
    cluster.add_volumes(SITES)
    started = time.monotonic()
    # The storage named after the release (as the chart's own was by default before
    # <release>-mq): the operator's pod and the sites' then share the release's name
    # and instance labels, which once made the operator count itself a site.
    cluster.install_chart(
        CHART, RELEASE, NAMESPACE, "--set", "durableStorage.create=true",
        "--set", f"durableStorage.name={STORAGE}",
        "--set-json", "durableStorage.spec=" + json.dumps({
            "sites": SITES, "hostNetwork": True, "image": {"pullPolicy": "Never"},
            "messages": {"nShards": 4, "replicationFactor": 3},
            "storage": {"size": "1Gi"}}),
        timeout=INSTALL_TIMEOUT_S)
    installed = time.monotonic() - started
    # The operator runs as real containers of the built image: two replicas by
    # default (one acts, by Kopf peering), on two nodes (on the host network their
    # ports keep them apart).
    operator_pods = json.loads(kubectl(
        "get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator",
        "-o", "json").stdout)["items"]
    assert len(operator_pods) == 2, explain(cluster)
    assert all(pod["status"]["containerStatuses"][0]["ready"] for pod in operator_pods), \
        explain(cluster)
    assert len({pod["spec"]["nodeName"] for pod in operator_pods}) == 2, explain(cluster)

    started = time.monotonic()
    wait_for("the storage Ready", lambda: storage_status(cluster).get("phase") == "Ready",
             timeout=READY_TIMEOUT_S, explain=lambda: explain(cluster))
    ready = time.monotonic() - started
    print(f"\nhelm install --wait {installed:.1f} s, storage Ready {ready:.1f} s")

    # Each site on its own node, bound on its node's address.
    pods = json.loads(kubectl("get", "pods", "-n", NAMESPACE, "-l",
                              resources.site_selector(STORAGE), "-o", "json").stdout)["items"]
    addresses = sorted(pod["status"]["podIP"] for pod in pods)
    assert len(set(addresses)) == SITES and set(addresses) <= {
        kubelet.address for kubelet in cluster.kubelets}, addresses

    subscriber = PahoClient(1883, "realnode-sub", host=addresses[0])
    publisher = PahoClient(1883, "realnode-pub", host=addresses[-1])
    try:
        assert subscriber.connect().reason_code == 0
        assert subscriber.subscribe("realnode/#", qos=1) == [1]
        assert publisher.connect().reason_code == 0
        for number in range(10):
            assert publisher.publish(f"realnode/{number % 3}", f"m{number}".encode()) == 0
        received = subscriber.expect(10)
        assert [message.payload for message in received] == [
            f"m{number}".encode() for number in range(10)]
    finally:
        publisher.stop()
        subscriber.stop()

    # `helm test`: the chart's test pod, a real container on a node, round-trips a
    # message through the storage's sites (it exits 0 only then; Helm deletes it once
    # it passed, so its log is not asked for).
    started = time.monotonic()
    tested = cluster.plane.helm("test", RELEASE, "--namespace", NAMESPACE,
                                "--timeout=180s", check=False, timeout=210)
    assert tested.returncode == 0, tested.stdout + tested.stderr + explain(cluster)
    assert re.search(r"Phase:\s+Succeeded", tested.stdout), tested.stdout
    print(f"helm test passed in {time.monotonic() - started:.1f} s")

    # The acting operator's pod deleted (a drain, a roll): the other one acts on, and
    # a spec change is still followed.
    priorities = {pod["metadata"]["name"]: peering_priority(cluster, pod["metadata"]["name"])
                  for pod in operator_pods}
    acting = max(priorities, key=lambda name: priorities[name])
    kubectl("delete", "pod", "-n", NAMESPACE, acting, "--wait=false")
    started = time.monotonic()
    kubectl("patch", "-n", NAMESPACE, "durablestorage", STORAGE, "--type=merge", "-p",
            json.dumps({"spec": {"transitionHistoryLimit": 5}}))
    generation = json.loads(kubectl("get", "-n", NAMESPACE, "durablestorage", STORAGE,
                                    "-o", "json").stdout)["metadata"]["generation"]
    wait_for("the change followed with the acting operator gone",
             lambda: storage_status(cluster).get("observedGeneration") == generation,
             timeout=120, explain=lambda: explain(cluster))
    print(f"acting operator {acting} deleted: a spec change followed after "
          f"{time.monotonic() - started:.1f} s")

    # The storage is the release's: `helm uninstall` deletes it with the operator.
    started = time.monotonic()
    result = cluster.plane.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait",
                                "--timeout=120s", check=False, timeout=150)
    assert result.returncode == 0, result.stderr + explain(cluster)
    # No finalizer left holding the storage once its operator went with it.
    wait_for("the storage gone", lambda: kubectl(
        "get", "-n", NAMESPACE, "durablestorage", STORAGE, check=False).returncode != 0,
        timeout=60, explain=lambda: explain(cluster))
    wait_for("the pods gone", lambda: not json.loads(kubectl(
        "get", "pods", "-n", NAMESPACE, "-o", "json").stdout)["items"],
        timeout=120, explain=lambda: explain(cluster))
    print(f"helm uninstall --wait, storage and pods gone {time.monotonic() - started:.1f} s")
