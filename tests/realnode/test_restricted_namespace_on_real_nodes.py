"""Pod Security "restricted" on real nodes (tests/support/realnode.py): every pod the
chart and the operator make, created for real in a namespace that enforces it, is
admitted, and runc starts its container under what the policy asks for.

Issue 21, defect 6: the API server's PodSecurity admission refused all the pod
templates (no `seccompProfile`). tests/kube/test_chart.py checks the admission with
server-side dry runs; here the real controllers (Deployment, Job, StatefulSet, the
CronJob's Job) create the pods, and the nodes run them: a setting the runtime cannot
apply (a seccomp profile, a non-root user, a read-only root) would stop the container
from starting, which no dry run shows. For the containers that keep running, their
process is read from the host's /proc: its user, no new privileges, seccomp filtering,
no capabilities, a read-only root.

The policy forbids the host network, so these pods are on the nodes' pod network,
where a pod reaches nothing outside itself (realnode.py): the operator and its
uninstall hook cannot reach the API server, the site cannot be probed. So the test
asks that they start, not that they work; the other modules show them working on the
host network. The operator serving this namespace's storage runs on the host network
in a namespace of its own (the chart installed there). The Spark jobs' image
(images/spark) is not built for these nodes: the GC job's pod is admitted, its
container waits for the image.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.processes import REPO
from harness.waiting import wait_for, wait_until
from stratamq.operator import resources
from tests.support.realnode import RealKubeCluster

CHART = REPO / "charts" / "stratamq"
NAMESPACE = "realnode-restricted"
OPERATOR_NAMESPACE = "realnode-restricted-op"
RELEASE = "rp"
OPERATOR = f"{RELEASE}-stratamq-operator"
NAME = "locked"
SPARK_CLAIM = "spark-work"
TIMEOUT = 180.0
# The images' user (images/stratamq/Dockerfile), which every pod template names.
USER = "10001"
# What runc sets for the restricted context: no new privileges, seccomp filter mode,
# an empty effective capability set.
CONFINED = {"user": [USER] * 4, "no_new_privileges": "1", "seccomp": "2",
            "capabilities": "0000000000000000"}
# Container states in which runc never ran the process.
NOT_STARTED = {"StartError", "ContainerCannotRun", "CreateContainerError",
               "CreateContainerConfigError", "RunContainerError"}


def pods_of(cluster: RealKubeCluster, selector: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(cluster.plane.kubectl(
        "get", "pods", "-n", NAMESPACE, "-l", selector, "-o", "json").stdout)["items"]
    return found


def pod_of(cluster: RealKubeCluster, selector: str) -> dict[str, Any] | None:
    found = pods_of(cluster, selector)
    return found[0] if found else None


def started(pod: dict[str, Any]) -> bool:
    """Whether runc ran the container's process (now or before a restart)."""
    [status] = pod["status"].get("containerStatuses") or [{}]
    for state in (status.get("state", {}), status.get("lastState", {})):
        if "running" in state:
            return True
        ended = state.get("terminated")
        if ended and ended.get("reason") not in NOT_STARTED:
            return True
    return False


def admitted(cluster: RealKubeCluster, selector: str) -> Callable[[], bool]:
    return lambda: pod_of(cluster, selector) is not None


def has_started(cluster: RealKubeCluster, selector: str) -> Callable[[], bool]:
    """Whether a container of one of the pods `selector` picks was run."""
    return lambda: any(started(pod) for pod in pods_of(cluster, selector))


def said_why(cluster: RealKubeCluster, selector: str) -> Callable[[], bool]:
    """Whether one of the pods `selector` picks logged an `error:` line."""
    def check() -> bool:
        for pod in pods_of(cluster, selector):
            log = cluster.plane.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"],
                                        check=False)
            if "error:" in log.stdout + log.stderr:
                return True
        return False
    return check


def confinement(pid: int) -> dict[str, Any]:
    """What the kernel says of a process: its user ids (real, effective, saved, file
    system), no-new-privileges, seccomp mode, effective capabilities, and whether its
    root file system is read-only."""
    fields = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    [root] = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text(
        ).splitlines() if line.split()[4] == "/"]
    return {"user": fields["Uid"].split(), "no_new_privileges": fields["NoNewPrivs"].strip(),
            "seccomp": fields["Seccomp"].strip(), "capabilities": fields["CapEff"].strip(),
            "read_only_root": "ro" in root[5].split(",")}


def confined(cluster: RealKubeCluster, selector: str) -> Callable[[], dict[str, Any] | None]:
    """The confinement of the pod's running container, once it runs (None before, or
    when the process ended while being read: a restarted one is read next time)."""
    def check() -> dict[str, Any] | None:
        pod = pod_of(cluster, selector)
        pid = cluster.container_process(pod) if pod else None
        if pid is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return confinement(pid)
        return None
    return check


def explain(cluster: RealKubeCluster) -> str:
    kubectl = cluster.plane.kubectl
    pods = kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False).stdout
    events = kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp",
                     check=False).stdout
    return f"pods:\n{pods}\nevents:\n{events[-4000:]}"


@pytest.mark.timeout(900)
def test_a_restricted_namespace_admits_and_runs_every_pod(
        real_kube_cluster: RealKubeCluster) -> None:
    cluster = real_kube_cluster
    kubectl = cluster.plane.kubectl
    cluster.add_volumes(2)  # the site's claim and the Spark jobs' work volume
    kubectl("create", "namespace", NAMESPACE)
    kubectl("label", "namespace", NAMESPACE, "pod-security.kubernetes.io/enforce=restricted",
            "pod-security.kubernetes.io/enforce-version=latest")
    try:
        # The operator that serves the namespace's storage, on the host network.
        cluster.install_chart(CHART, RELEASE, OPERATOR_NAMESPACE)

        # The operator's and its uninstall hook's pods as the chart makes them with
        # its defaults (off the host network) for a release in this namespace, under
        # the release's own name (its PriorityClass exists).
        rendered = cluster.plane.helm(
            "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--set", "operator.image.pullPolicy=Never",
            "--show-only", "templates/operator-deployment.yaml",
            "--show-only", "templates/operator-uninstall-hook.yaml").stdout
        kubectl("create", "serviceaccount", "-n", NAMESPACE, OPERATOR)
        kubectl("apply", "-n", NAMESPACE, "-f", "-", input=rendered)

        # The sites' and the Spark jobs' pods as the operator makes them.
        kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": SPARK_CLAIM, "namespace": NAMESPACE},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}}}))
        kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": resources.API_VERSION, "kind": resources.KIND,
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"sites": 1, "image": {"pullPolicy": "Never"},
                     "messages": {"nShards": 1, "replicationFactor": 1},
                     "storage": {"size": "1Gi"},
                     "spark": {"volume": {"claimName": SPARK_CLAIM},
                               "image": {"pullPolicy": "Never"},
                               "gc": {"enable": True}}}}))
        wait_for("the GC CronJob", lambda: kubectl(
            "get", "cronjob", "-n", NAMESPACE, f"{NAME}-spark-gc", check=False
        ).returncode == 0, timeout=TIMEOUT, explain=lambda: explain(cluster))
        kubectl("create", "job", "-n", NAMESPACE, "gc-now", f"--from=cronjob/{NAME}-spark-gc")

        selectors = {
            "operator": "app.kubernetes.io/component=operator",
            "uninstall hook": "app.kubernetes.io/component=operator-uninstall",
            "site": resources.site_selector(NAME),
            "spark gc": "job-name=gc-now"}
        for what, selector in selectors.items():
            wait_for(f"the {what}'s pod admitted", admitted(cluster, selector),
                     timeout=TIMEOUT, explain=lambda: explain(cluster))
        for what in ("operator", "uninstall hook", "site"):
            wait_for(f"the {what}'s container started", has_started(cluster, selectors[what]),
                     timeout=TIMEOUT, explain=lambda: explain(cluster))
        for what in ("operator", "site"):
            seen = wait_for(f"the {what}'s process", confined(cluster, selectors[what]),
                            timeout=TIMEOUT, explain=lambda: explain(cluster))
            assert seen == {**CONFINED, "read_only_root": True}, (what, seen)
            print(f"\n{what}: {seen}")
        # The hook ran (and said why it could not go on: no API server in reach). Its
        # Job makes a second pod after the first failed, which may not have run yet.
        wait_for("the hook's error in the log of one of its pods",
                 said_why(cluster, selectors["uninstall hook"]), timeout=TIMEOUT,
                 explain=lambda: explain(cluster))
        spark = pod_of(cluster, selectors["spark gc"])
        assert spark is not None and spark["spec"]["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"}
    finally:
        kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        cluster.plane.helm("uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait",
                           "--timeout=120s", check=False, timeout=150)
        wait_until(lambda: kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0,
                   TIMEOUT, every=1)
