"""`helm uninstall` of a release that made its own DurableStorage (issue 21, defect 4).

With `durableStorage.create` the chart makes the storage next to the operator's
Deployment, and `helm uninstall` deletes both at once: the operator's pod gets its
SIGTERM while (or before) the storage is deleted. Kopf puts a finalizer on every storage
it runs timers for; left behind by an operator that is gone, it kept the storage
Terminating, its pods running, and `helm uninstall --wait` hanging.

The chart's Deployment runs 0 replicas here (the test node cannot give a pod its
in-cluster credentials, see test_operator_rbac.py): a real operator process stands in
for its pod, and is stopped with SIGTERM first, as the Deployment's deletion does."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from tests.kube.test_operator import wait_for
from tests.support.harness import REPO
from tests.support.kube import ControlPlane
from tests.support.kubelet import running_kubelet
from tests.support.operator_process import OperatorProcess

CHART = REPO / "charts" / "stratamq"
RELEASE = "mq"
# Far above what the uninstall takes once nothing holds the storage (seconds), far
# below forever.
UNINSTALL_TIMEOUT_S = 60


def test_helm_uninstall_completes_after_the_operator_is_gone(crds: ControlPlane,
                                                             namespace: str,
                                                             tmp_path: Path) -> None:
    kube = crds
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "stratamq"}}))
    kube.helm("install", RELEASE, str(CHART), "--namespace", namespace,
              "--set", "operator.replicas=0", "--set", "dashboards.enabled=false",
              "--set", "durableStorage.create=true", "--set", "durableStorage.spec.sites=1",
              "--set", "durableStorage.spec.messages.nShards=2",
              "--set", "durableStorage.spec.messages.replicationFactor=1",
              "--set", "durableStorage.spec.storage.size=1Gi")

    def storage() -> dict[str, object] | None:
        result = kube.kubectl("get", "-n", namespace, "durablestorage", RELEASE, "-o", "json",
                              check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    with running_kubelet(kube, tmp_path / "node", {namespace}) as node:
        operator = OperatorProcess(tmp_path / "operator", kube, namespace)
        operator.start(timeout=60)
        try:
            def ready() -> bool:
                found = storage() or {}
                status = found.get("status") or {}
                assert isinstance(status, dict)
                return status.get("phase") == "Ready"
            wait_for("the storage Ready", ready, explain=lambda: operator.log_tail()
                     + f"\nkubelet errors: {node.errors}")
            # The operator goes first: helm deletes its Deployment with the storage.
            assert operator.stop(timeout=30) == 0, operator.log_tail()
        finally:
            operator.kill()
        log = operator.log()
        assert "Traceback" not in log, log[-6000:]

        started = time.monotonic()
        result = kube.helm("uninstall", RELEASE, "--namespace", namespace, "--wait",
                           f"--timeout={UNINSTALL_TIMEOUT_S}s", check=False)
        took = time.monotonic() - started
        left = storage()
        meta = (left or {}).get("metadata") or {}
        assert isinstance(meta, dict)
        held = {key: meta.get(key) for key in ("deletionTimestamp", "finalizers")}
        assert result.returncode == 0 and left is None, (
            f"helm uninstall: rc {result.returncode} after {took:.1f}s: {result.stderr}\n"
            f"the storage left: {held}")
        print(f"helm uninstall --wait took {took:.1f}s")
        # Its objects go by garbage collection, the brokers with them.
        wait_for("the brokers stopped", lambda: not node.running(namespace),
                 explain=lambda: kube.kubectl("get", "-n", namespace, "all",
                                              check=False).stdout)
