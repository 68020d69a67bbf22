"""`helm uninstall` of a release that made its own DurableStorage (issue 21, defect 4).

With `durableStorage.create` the chart makes the storage next to the operator's
Deployment. Kopf puts a finalizer on every storage it runs timers for; `helm uninstall`
deletes the operator's Deployment and rights in one go and the storage last, so the
operator, stopping after its rights were gone, could not take the finalizer off: the
storage stayed Terminating, its pods running, `helm uninstall --wait` hanging (seen on
real pods: tests/realnode/test_chart_on_real_nodes.py). The chart's pre-delete hook
now runs `python -m stratamq.operator.uninstall` as the operator's account first.
Before that, with the storage Ready, the chart's `helm test` (its test pod's command)
round-trips an MQTT message through the storage, which refuses anonymous clients: as
the user of the Secret `durableStorage.testCredentialsSecret` names, and without it
the test says it has no credentials.

The test node cannot run the hook's pod nor give a pod its in-cluster credentials (see
test_operator_rbac.py): the operator runs as a process, the hook's module as a process
with a token of the operator's account, and Helm is told --no-hooks. The operator
crashes (SIGKILL), so its exit never takes the finalizer off: the module must."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kopf
import yaml

from harness.processes import REPO
from harness.waiting import wait_for
from stratamq.broker.auth import set_password
from tests.kube.test_operator_rbac import token_kubeconfig
from tests.support.kube import ControlPlane
from tests.support.kubelet import running_kubelet
from tests.support.operator_process import OperatorProcess

CHART = REPO / "charts" / "stratamq"
RELEASE = "mq"
STORAGE = f"{RELEASE}-mq"  # the chart's default name
ACCOUNT = f"{RELEASE}-stratamq-operator"
FINALIZER = kopf.OperatorSettings().persistence.finalizer
# A storage Ready (or its sites gone) on the stand-in kubelet, on a loaded 2-core machine.
TIMEOUT = 180.0
# Far above what the uninstall takes once nothing holds the storage (seconds), far
# below forever.
UNINSTALL_TIMEOUT_S = 60
# The user `helm test` connects as (the storage refuses anonymous clients).
TEST_USER = "helm-test"


def secret_env(kube: ControlPlane, namespace: str,
               container: dict[str, Any]) -> dict[str, str]:
    """The container's environment variables from Secrets, as the kubelet sets them."""
    found = {}
    for variable in container.get("env", []):
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            data = json.loads(kube.kubectl("get", "secret", "-n", namespace, ref["name"],
                                           "-o", "json").stdout)["data"]
            found[variable["name"]] = base64.b64decode(data[ref["key"]]).decode()
    return found


def test_helm_uninstall_completes_after_the_operator_crashed(crds: ControlPlane,
                                                             namespace: str,
                                                             tmp_path: Path) -> None:
    kube = crds
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "stratamq"}}))
    # The storage's one user (few hash iterations: a loaded 2-core machine), and the
    # Secret `helm test` takes its credentials from.
    set_password(tmp_path / "passwd", TEST_USER, "s3cret", iterations=1000)
    kube.kubectl("create", "secret", "generic", "-n", namespace, "mq-users",
                 f"--from-file=passwd={tmp_path / 'passwd'}")
    kube.kubectl("create", "secret", "generic", "-n", namespace, "mq-helm-test",
                 "--type=kubernetes.io/basic-auth", f"--from-literal=username={TEST_USER}",
                 "--from-literal=password=s3cret")
    kube.helm("install", RELEASE, str(CHART), "--namespace", namespace,
              "--set", "operator.replicas=0", "--set", "dashboards.enabled=false",
              "--set", "durableStorage.create=true", "--set", "durableStorage.spec.sites=1",
              "--set", "durableStorage.spec.messages.nShards=2",
              "--set", "durableStorage.spec.messages.replicationFactor=1",
              "--set", "durableStorage.spec.storage.size=1Gi",
              "--set", "durableStorage.spec.accessControl.allowAnonymous=false",
              "--set", "durableStorage.spec.accessControl.passwordSecret.name=mq-users",
              "--set", "durableStorage.testCredentialsSecret=mq-helm-test")

    def storage() -> dict[str, object] | None:
        result = kube.kubectl("get", "-n", namespace, "durablestorage", STORAGE, "-o", "json",
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
                     + f"\nkubelet errors: {node.errors}", timeout=TIMEOUT)
            # `helm test`: the chart's test pod's command, as the operator's account
            # (the pod's), the way the pod runs it.
            token = kube.kubectl("create", "token", ACCOUNT, "-n", namespace,
                                 "--duration=1h").stdout.strip()
            kubeconfig = token_kubeconfig(kube, tmp_path / "account.kubeconfig", token,
                                          ACCOUNT)
            [test_pod] = [hook for hook in yaml.safe_load_all(kube.helm(
                "get", "hooks", RELEASE, "-n", namespace).stdout)
                if hook and hook["metadata"]["annotations"]["helm.sh/hook"] == "test"]
            [container] = test_pod["spec"]["containers"]
            command = container["command"]
            assert command[0] == "python", command
            credentials = secret_env(kube, namespace, container)
            assert credentials["STRATAMQ_HELM_TEST_USERNAME"] == TEST_USER

            def helm_test(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run(
                    [sys.executable, *command[1:], *args], capture_output=True, text=True,
                    timeout=120, env={**os.environ, "KUBECONFIG": str(kubeconfig), **env})

            tested = helm_test(**credentials)
            assert tested.returncode == 0, tested.stdout + tested.stderr
            assert f"DurableStorage {namespace}/{STORAGE} Ready; a QoS 1 message " \
                f"published at {STORAGE}-0 reached a subscriber at {STORAGE}-0" \
                in tested.stdout and f"(user {TEST_USER})" in tested.stdout, tested.stdout
            # Without credentials: said at once; with a wrong password: the sites refuse.
            anonymous = helm_test()
            assert anonymous.returncode == 1 and "refuses anonymous clients" in \
                anonymous.stderr and "durableStorage.testCredentialsSecret" in \
                anonymous.stderr, anonymous.stderr
            wrong = helm_test(**{**credentials, "STRATAMQ_HELM_TEST_PASSWORD": "guess"})
            assert wrong.returncode == 1 and "no MQTT round trip" in wrong.stderr, \
                wrong.stderr
            missing = helm_test("--storage=nope", "--timeout=1")
            assert missing.returncode == 1 and "no DurableStorage" in missing.stderr, \
                missing.stderr
        finally:
            operator.kill()  # a crash: no cleanup at its exit
        log = operator.log()
        assert "Traceback" not in log, log[-6000:]
        meta = (storage() or {}).get("metadata") or {}
        assert isinstance(meta, dict)
        assert FINALIZER in (meta.get("finalizers") or []), meta

        # The hook's module, as the operator's account (what the chart grants it).
        hook = subprocess.run(
            [sys.executable, "-m", "stratamq.operator.uninstall", f"--namespace={namespace}",
             f"--deployment={ACCOUNT}", "--timeout=30"],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)}, capture_output=True,
            text=True, timeout=120)
        assert hook.returncode == 0, hook.stdout + hook.stderr
        assert f"{namespace}/{STORAGE}: finalizer {FINALIZER} removed" in hook.stderr, \
            hook.stderr
        assert json.loads(kube.kubectl("get", "deployment", "-n", namespace, ACCOUNT,
                                       "-o", "json").stdout)["spec"]["replicas"] == 0

        started = time.monotonic()
        result = kube.helm("uninstall", RELEASE, "--namespace", namespace, "--wait",
                           "--no-hooks", f"--timeout={UNINSTALL_TIMEOUT_S}s", check=False)
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
                                              check=False).stdout, timeout=TIMEOUT)
