"""The chart's operator ServiceAccount and its rights suffice, serving every namespace
(a ClusterRole) or only those of `operator.watchNamespaces` (a Role in each): helm
installs the chart, the operator runs as a real process with a token of that
ServiceAccount (the chart's peering object), and a DurableStorage comes up Ready
through it, its budget is deleted when turned off, its Spark job's CronJob and driver
account are made and deleted, a second site's ReplicaTransitions are made and reach
Done; nothing it does is forbidden. Serving one namespace, it can read no Secret
elsewhere, and the chart's uninstall hook, as the same account, takes the finalizer
off the storages of that namespace.

The chart's Deployment runs 0 replicas here: the test node cannot give a pod its
in-cluster credentials (absolute paths under /var/run/secrets), so this process
stands in for the operator's pod, with the same account."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kopf
import pytest
import yaml

from harness.processes import REPO
from harness.waiting import wait_for
from tests.support.kube import ControlPlane
from tests.support.kubelet import running_kubelet
from tests.support.operator_process import OperatorProcess

CHART = REPO / "charts" / "stratamq"
NAMESPACE = "operator-rbac"
# Where the storage is when the operator serves only the namespaces it is given.
WATCHED = "operator-rbac-iot"
RELEASE = "rbac"
ACCOUNT = f"{RELEASE}-stratamq-operator"
# A storage Ready (or gone) on the stand-in kubelet, on a loaded 2-core machine.
TIMEOUT = 180.0


def token_kubeconfig(kube: ControlPlane, path: Path, token: str, account: str = ACCOUNT
                     ) -> Path:
    """A kubeconfig for the test API server that authenticates with `token`."""
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": admin["clusters"],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": admin["clusters"][0]["name"],
                                                      "user": account}}]}))
    path.chmod(0o600)
    return path


def can_i(kube: ControlPlane, release_ns: str, *args: str) -> bool:
    """Whether the operator's account (of the release in `release_ns`) may do `args`
    (kubectl auth can-i's arguments)."""
    answer = kube.kubectl("auth", "can-i", *args,
                          f"--as=system:serviceaccount:{release_ns}:{ACCOUNT}",
                          check=False).stdout.strip()
    assert answer in ("yes", "no"), answer
    return answer == "yes"


def run_uninstall_hook(kube: ControlPlane, release_ns: str, kubeconfig: Path) -> str:
    """Run the command of the chart's pre-delete hook Job, as rendered for the release,
    as a process with the operator's credentials; its log."""
    hooks = yaml.safe_load_all(kube.helm("get", "hooks", RELEASE, "-n", release_ns).stdout)
    job, = (hook for hook in hooks if hook and hook["kind"] == "Job"
            and hook["metadata"]["name"].endswith("-uninstall"))
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "python", command
    hook = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                          timeout=120, env={**kube.env(), "KUBECONFIG": str(kubeconfig)})
    assert hook.returncode == 0, hook.stderr
    return hook.stderr


@pytest.mark.parametrize("watched", [False, True], ids=["all-namespaces", "watched-namespace"])
def test_the_charts_rbac_suffices(crds: ControlPlane, tmp_path: Path, watched: bool) -> None:
    kube = crds
    # Each mode in namespaces of its own: the other's may still be terminating.
    release_ns = f"{NAMESPACE}-ops" if watched else NAMESPACE
    kube.kubectl("create", "namespace", release_ns)
    storage_ns = WATCHED if watched else release_ns
    scope = []
    if watched:
        kube.kubectl("create", "namespace", WATCHED)
        scope = ["--set", f"operator.watchNamespaces={{{WATCHED}}}"]
    try:
        kube.helm("install", RELEASE, str(CHART), "--namespace", release_ns,
                  "--set", "operator.replicas=0", "--set", "dashboards.enabled=false", *scope)
        token = kube.kubectl("create", "token", ACCOUNT, "-n", release_ns,
                             "--duration=1h").stdout.strip()
        kubeconfig = token_kubeconfig(kube, tmp_path / "operator.kubeconfig", token)
        # The account really is limited: it may not read Secrets' list or list Nodes
        # (it gets the node of each site's pod, for its zone), nor make the pods it
        # lets Spark drivers make.
        for verb, what in (("list", "secrets"), ("list", "nodes"), ("delete", "statefulsets"),
                           ("create", "pods")):
            assert not can_i(kube, release_ns, verb, what, "-n", storage_ns), (verb, what)
        if watched:
            # Serving one namespace, it may do nothing of the kind anywhere else.
            assert can_i(kube, release_ns, "get", "secrets", "-n", WATCHED)
            for namespace in ("default", "kube-system", release_ns):
                for verb, what in (("get", "secrets"), ("create", "statefulsets"),
                                   ("list", "durablestorages.stratamq.io")):
                    assert not can_i(kube, release_ns, verb, what, "-n", namespace), \
                        (verb, what, namespace)
            assert not can_i(kube, release_ns, "list", "durablestorages.stratamq.io",
                             "--all-namespaces")
        # Its objects name the storage as owner with blockOwnerDeletion, which a cluster
        # running the OwnerReferencesPermissionEnforcement admission plugin (OpenShift,
        # for one) allows only to who may update the owner's finalizers.
        assert can_i(kube, release_ns, "update", "durablestorages.stratamq.io",
                     "--subresource=finalizers", "-n", storage_ns)
        # ... and may do what it needs that this test does not reach: delete the
        # ReplicaTransitions of old plans (spec.transitionHistoryLimit).
        assert can_i(kube, release_ns, "delete", "replicatransitions", "-n", storage_ns)
        # An operator of all namespaces would take on the storages other tests left
        # behind in namespaces being deleted: wait until they are gone.
        wait_for("no DurableStorage in other namespaces", lambda: not [
            line for line in kube.kubectl("get", "durablestorages", "-A", "-o", "name")
            .stdout.splitlines() if line], timeout=TIMEOUT)

        with running_kubelet(kube, tmp_path / "node", {storage_ns}) as node:
            operator = OperatorProcess(tmp_path / "operator", kube,
                                       WATCHED if watched else None, kubeconfig=kubeconfig,
                                       peering=ACCOUNT,
                                       spark_driver_role=f"{RELEASE}-stratamq-spark",
                                       scanning=not watched)  # as the chart's Deployment
            operator.start(timeout=60)
            try:
                kube.kubectl("apply", "-n", storage_ns, "-f", "-", input=yaml.safe_dump({
                    "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
                    "metadata": {"name": "mq"},
                    "spec": {"sites": 1, "messages": {"nShards": 2, "replicationFactor": 1},
                             "storage": {"size": "1Gi"},
                             "spark": {"volume": {"claimName": "spark"},
                                       "gc": {"enable": True}}}}))

                def ready() -> bool:
                    status = json.loads(kube.kubectl(
                        "get", "-n", storage_ns, "durablestorage", "mq", "-o", "json").stdout
                    ).get("status", {})
                    return status.get("phase") == "Ready" and len(status.get("sites", [])) == 1
                wait_for("the storage Ready", ready, explain=lambda: operator.log_tail()
                         + f"\nkubelet errors: {node.errors}", timeout=TIMEOUT)

                kube.kubectl("patch", "-n", storage_ns, "durablestorage", "mq", "--type=merge",
                             "-p", '{"spec": {"podDisruptionBudget": {"enable": false}}}')
                wait_for("the budget deleted", lambda: kube.kubectl(
                    "get", "-n", storage_ns, "pdb", "mq", check=False).returncode != 0,
                    explain=operator.log_tail, timeout=TIMEOUT)
                # The Spark job: its CronJob, the executors' pod template, and the
                # driver's account bound to the chart's ClusterRole (the operator may
                # bind that one role, nothing more); turned off, all four go.
                binding = json.loads(kube.kubectl("get", "-n", storage_ns, "rolebinding",
                                                  "mq-spark", "-o", "json").stdout)
                assert binding["roleRef"]["name"] == f"{RELEASE}-stratamq-spark"
                kube.kubectl("get", "-n", storage_ns, "cronjob", "mq-spark-gc")
                kube.kubectl("get", "-n", storage_ns, "configmap", "mq-spark-executor")
                kube.kubectl("patch", "-n", storage_ns, "durablestorage", "mq", "--type=merge",
                             "-p", '{"spec": {"spark": {"gc": {"enable": false}}}}')
                wait_for("the Spark objects deleted", lambda: all(kube.kubectl(
                    "get", "-n", storage_ns, kind, name, check=False).returncode != 0
                    for kind, name in (("cronjob", "mq-spark-gc"), ("rolebinding", "mq-spark"),
                                       ("serviceaccount", "mq-spark"),
                                       ("configmap", "mq-spark-executor"))),
                    explain=operator.log_tail, timeout=TIMEOUT)
                # A second site: the rebalance (a shard of each database moves to it)
                # makes ReplicaTransitions and moves them along to Done under the
                # chart's account too.
                kube.kubectl("patch", "-n", storage_ns, "durablestorage", "mq", "--type=merge",
                             "-p", '{"spec": {"sites": 2}}')

                def rebalanced() -> bool:
                    found = json.loads(kube.kubectl(
                        "get", "-n", storage_ns, "replicatransitions", "-o", "json").stdout
                    )["items"]
                    status = json.loads(kube.kubectl(
                        "get", "-n", storage_ns, "durablestorage", "mq", "-o", "json").stdout
                    ).get("status", {})
                    return bool(found) and all(
                        item.get("status", {}).get("phase") == "Done" for item in found) \
                        and status.get("phase") == "Ready" and len(status.get("sites", [])) == 2
                wait_for("the second site's transitions Done", rebalanced, timeout=TIMEOUT,
                         explain=lambda: operator.log_tail() + f"\nkubelet errors: {node.errors}")
                # The sites' pods come from a watch (the operator's index of them), not
                # from a list in every round of the controller (every 2 s) and every
                # status refresh: the API server's audit log has the account's lists of
                # pods at the watch's start only.
                user = f"system:serviceaccount:{release_ns}:{ACCOUNT}"
                lists, watches = (kube.apiserver.audited(user, verb)
                                  for verb in ("list", "watch"))
                print(f"\npods listed {lists} times, watched {watches} times by the operator")
                assert watches >= 1 and lists <= 3, (lists, watches)
                events = json.loads(kube.kubectl("get", "-n", storage_ns, "events", "-o",
                                                 "json").stdout)["items"]
                assert "Reconciled" in {event["reason"] for event in events}
                if watched:
                    # The uninstall hook, as the chart renders it: it stops the operator
                    # and takes Kopf's finalizer off the storages of the namespaces the
                    # operator served (a killed operator's exit never does).
                    operator.kill()
                    hook_log = run_uninstall_hook(kube, release_ns, kubeconfig)
                    finalizer = kopf.OperatorSettings().persistence.finalizer
                    assert f"{WATCHED}/mq: finalizer {finalizer} removed" in hook_log, hook_log
                kube.kubectl("delete", "-n", storage_ns, "durablestorage", "mq",
                             "--wait=true", timeout=120)
            finally:
                operator.kill()
                # A failure above leaves the storage with Kopf's finalizer and no
                # operator to take it off: the next mode would wait for it in vain.
                kube.kubectl("patch", "-n", storage_ns, "durablestorage", "mq",
                             "--type=merge", "-p", '{"metadata": {"finalizers": null}}',
                             check=False)
            log = operator.log()
            assert "forbidden" not in log.lower(), log[-6000:]
            assert "Traceback" not in log, log[-6000:]
    finally:
        # No node runs the pre-delete hook's pod here (test_chart_uninstall.py runs
        # what it runs; tests/realnode the hook itself).
        kube.helm("uninstall", RELEASE, "--namespace", release_ns, "--no-hooks", check=False)
        kube.kubectl("delete", "namespace", release_ns, "--wait=false")
        if watched:
            kube.kubectl("delete", "namespace", WATCHED, "--wait=false")
