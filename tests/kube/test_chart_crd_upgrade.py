"""The chart's CRD upgrade path: `helm upgrade` never touches `crds/`, so a field a new
chart adds to a CRD would be pruned by the API server from every object written. The
chart's pre-upgrade hook (templates/crd-upgrade-hook.yaml, operator/crd_upgrade.py)
brings the cluster's CRDs to the chart's, and never back to an older chart's.

The test node cannot run the hook's pod with in-cluster credentials (see
test_operator_rbac.py): the hook's objects are rendered by helm and made as Helm
makes them, its ConfigMap is written to a folder as the kubelet would mount it, and
its Job's command runs as a process with a token of the hook's account."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from harness.processes import REPO
from tests.kube.test_operator_rbac import token_kubeconfig
from tests.support.kube import ControlPlane

CHART = REPO / "charts" / "stratamq"
RELEASE = "crdup"
HOOK_ACCOUNT = f"{RELEASE}-stratamq-operator-crds"
TRANSITIONS = "replicatransitions.stratamq.io"


def transition(name: str, note: str) -> str:
    """A ReplicaTransition with a field `spec.note` that only the new chart's CRD has."""
    return yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "ReplicaTransition",
        "metadata": {"name": name},
        "spec": {"durableStorage": "mq", "database": "messages", "shard": 0,
                 "action": "Add", "site": "c3d4", "step": 0, "note": note}})


def new_chart(tmp_path: Path, version: str) -> Path:
    """A copy of the chart at `version` whose ReplicaTransition CRD has `spec.note`."""
    chart = tmp_path / f"chart-{version}"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    (chart / "Chart.yaml").write_text(yaml.safe_dump({**meta, "version": version}))
    path = chart / "crds" / f"{TRANSITIONS}.yaml"
    crd = yaml.safe_load(path.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["note"] = {"type": "string", "description": "new in this chart"}
    path.write_text(yaml.safe_dump(crd))
    return chart


def run_hook(kube: ControlPlane, chart: Path, tmp_path: Path, kubeconfig: Path) -> str:
    """Run the chart's hook: its ConfigMap as a folder, its Job's command as a process
    with the hook account's credentials; its log."""
    docs = [doc for doc in yaml.safe_load_all(kube.helm(
        "template", RELEASE, str(chart), "-n", RELEASE,
        "--show-only", "templates/crd-upgrade-hook.yaml").stdout) if doc]
    [config_map] = [doc for doc in docs if doc["kind"] == "ConfigMap"]
    [job] = [doc for doc in docs if doc["kind"] == "Job"]
    mounted = Path(tempfile.mkdtemp(prefix="mounted-", dir=tmp_path))
    for name, text in config_map["data"].items():
        (mounted / name).write_text(text)
    [container] = job["spec"]["template"]["spec"]["containers"]
    [mount] = [item for item in container["volumeMounts"] if item["name"] == "crds"]
    command = [arg.replace(mount["mountPath"], str(mounted)) for arg in container["command"]]
    assert command[0] == "python", command
    hook = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                          timeout=120, env={**kube.env(), "KUBECONFIG": str(kubeconfig)})
    assert hook.returncode == 0, hook.stderr
    return hook.stderr


def hook_objects(kube: ControlPlane, chart: Path) -> list[dict[str, Any]]:
    """The hook's account and its rights, as Helm makes them before the Job."""
    return [doc for doc in yaml.safe_load_all(kube.helm(
        "template", RELEASE, str(chart), "-n", RELEASE,
        "--show-only", "templates/crd-upgrade-hook.yaml").stdout)
        if doc and doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]


def test_the_upgrade_hook_brings_the_crds_to_the_new_charts_and_never_back(
        crds: ControlPlane, tmp_path: Path) -> None:
    kube = crds
    kube.kubectl("create", "namespace", RELEASE)
    made: list[dict[str, Any]] = []
    try:
        kube.helm("install", RELEASE, str(CHART), "-n", RELEASE,
                  "--set", "operator.replicas=0", "--set", "dashboards.enabled=false")
        # The installed chart's CRD knows no spec.note: the API server prunes it (it
        # warns, as it answers the operator's client; kubectl's default refuses).
        kube.kubectl("apply", "-n", RELEASE, "--validate=warn", "-f", "-",
                     input=transition("before", "lost"))
        stored = json.loads(kube.kubectl("get", "-n", RELEASE, "rt", "before", "-o",
                                         "json").stdout)
        assert "note" not in stored["spec"]

        newer = new_chart(tmp_path, "0.2.0")
        made = hook_objects(kube, newer)
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(made))
        token = kube.kubectl("create", "token", HOOK_ACCOUNT, "-n", RELEASE,
                             "--duration=1h").stdout.strip()
        kubeconfig = token_kubeconfig(kube, tmp_path / "hook.kubeconfig", token, HOOK_ACCOUNT)
        # Its account may write these CRDs and no other.
        as_hook = f"--as=system:serviceaccount:{RELEASE}:{HOOK_ACCOUNT}"
        for crd, allowed in ((TRANSITIONS, "yes"),
                             ("servicemonitors.monitoring.coreos.com", "no")):
            assert kube.kubectl("auth", "can-i", "update", f"customresourcedefinitions/{crd}",
                                as_hook, check=False).stdout.strip() == allowed, crd
        assert kube.kubectl("auth", "can-i", "delete", "customresourcedefinitions", as_hook,
                            check=False).stdout.strip() == "no"

        log = run_hook(kube, newer, tmp_path, kubeconfig)
        assert f"{TRANSITIONS}: updated (chart unknown -> 0.2.0)" in log, log
        kube.kubectl("apply", "-n", RELEASE, "-f", "-", input=transition("after", "kept"))
        stored = json.loads(kube.kubectl("get", "-n", RELEASE, "rt", "after", "-o",
                                         "json").stdout)
        assert stored["spec"]["note"] == "kept"

        # Again: nothing to write.
        log = run_hook(kube, newer, tmp_path, kubeconfig)
        assert f"{TRANSITIONS}: unchanged" in log, log
        # The older chart's hook (a rollback, an old chart installed over): it leaves the
        # newer CRD, and the field stays in the objects stored with it.
        log = run_hook(kube, CHART, tmp_path, kubeconfig)
        assert f"{TRANSITIONS}: kept (written by chart 0.2.0, newer than 0.1.0)" in log, log
        crd = json.loads(kube.kubectl("get", "crd", TRANSITIONS, "-o", "json").stdout)
        properties = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        assert "note" in properties["spec"]["properties"]
        kube.kubectl("label", "-n", RELEASE, "rt", "after", "touched=yes")
        stored = json.loads(kube.kubectl("get", "-n", RELEASE, "rt", "after", "-o",
                                         "json").stdout)
        assert stored["spec"]["note"] == "kept"
    finally:
        # The session's control plane gets its CRDs back as crds/ has them.
        kube.kubectl("delete", "-n", RELEASE, "rt", "--all", check=False)
        for path in sorted((REPO / "crds").glob("*.yaml")):
            kube.kubectl("replace", "-f", str(path), check=False)
        if made:
            kube.kubectl("delete", "--ignore-not-found", "-f", "-",
                         input=yaml.safe_dump_all(made), check=False)
        kube.helm("uninstall", RELEASE, "-n", RELEASE, "--no-hooks", check=False)
        kube.kubectl("delete", "namespace", RELEASE, "--wait=false", check=False)
