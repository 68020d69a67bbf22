"""The Helm chart skeleton (charts/stratamq) with the real helm: it carries the CRDs of
crds/ unchanged, lints clean, renders, and installs into the test API server."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from harness.processes import REPO
from stratamq.operator import resources, spark
from stratamq.operator.resources import Owner
from tests.integration.test_alert_rules import OPERATOR_JOB
from tests.support.kube import ControlPlane, run_tool, tool_env
from tests.unit.test_operator_resources import crd_defaults
from tests.unit.test_operator_spark import with_spark

CHART = REPO / "charts" / "stratamq"
CRDS = REPO / "crds"


def test_chart_carries_the_crds_unchanged() -> None:
    names = sorted(path.name for path in CRDS.glob("*.yaml"))
    assert names == ["durablestorages.stratamq.io.yaml", "kopfpeerings.kopf.dev.yaml",
                     "replicatransitions.stratamq.io.yaml"]
    assert sorted(path.name for path in (CHART / "crds").iterdir()) == names
    for name in names:
        assert (CHART / "crds" / name).read_bytes() == (CRDS / name).read_bytes(), (
            f"charts/stratamq/crds/{name} differs from crds/{name}: copy crds/ over it")


def test_helm_lint_is_clean(tmp_path: Path) -> None:
    for values in ([], ["--set", "durableStorage.create=true"],
                   ["--set", "nameOverride=queue", "--set", "fullnameOverride=broker"]):
        result = run_tool("helm", ["lint", "--strict", str(CHART), *values], tool_env(tmp_path))
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, (
            result.stdout)


def test_a_misspelt_value_is_refused_by_the_values_schema(tmp_path: Path) -> None:
    """values.schema.json: helm refuses a key the chart does not have (which it would
    otherwise ignore, leaving the user's setting without effect) and a wrong type."""
    for values, said in ((["--set", "operator.replica=2"],
                          "additional properties 'replica' not allowed"),
                         (["--set", "operator.replicas=-1"], "minimum"),
                         (["--set", "operator.image.pullPolicy=Sometimes"], "pullPolicy"),
                         (["--set", "serviceMonitor.interval=often"], "interval"),
                         (["--set", "operator.watchNamespaces={Fleet_1}"], "watchNamespaces"),
                         (["--set", "operator.logLevel=loud"], "logLevel"),
                         (["--set", "fullnameOverride=Broker"], "fullnameOverride"),
                         (["--set", f"fullnameOverride={'b' * 45}"], "fullnameOverride")):
        result = run_tool("helm", ["template", "mq", str(CHART), *values], tool_env(tmp_path),
                          check=False)
        assert result.returncode != 0, values
        assert said in result.stderr, (values, result.stderr)


def test_the_operators_pods_take_placement_values(tmp_path: Path) -> None:
    docs = render(tmp_path, "--set-json", 'operator.nodeSelector={"pool": "ops"}',
                  "--set-json", 'operator.tolerations=[{"key": "ops", "operator": "Exists"}]',
                  "--set-json", 'operator.imagePullSecrets=[{"name": "registry"}]',
                  "--set-json", 'operator.affinity={"nodeAffinity": {}}')
    [deployment] = [doc for doc in docs if doc["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "ops"}
    assert pod["tolerations"] == [{"key": "ops", "operator": "Exists"}]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["affinity"] == {"nodeAffinity": {}}
    # the sites' default image is the operator's own
    [container] = pod["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["STRATAMQ_OPERATOR_IMAGE"] == container["image"]
    # the sites' NetworkPolicy admits the operator's pods from its namespace alone
    assert {"name": "STRATAMQ_OPERATOR_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in container["env"]
    plain = render(tmp_path)
    [deployment] = [doc for doc in plain if doc["kind"] == "Deployment"]
    assert not {"nodeSelector", "tolerations", "imagePullSecrets"} & set(
        deployment["spec"]["template"]["spec"])
    # (by default only the preference for two nodes, see below)
    assert set(deployment["spec"]["template"]["spec"]["affinity"]) == {"podAntiAffinity"}


def test_the_operator_takes_its_account_log_level_and_intervals(tmp_path: Path) -> None:
    docs = render(tmp_path, "--set", "operator.serviceAccount.name=ops",
                  "--set", "operator.serviceAccount.annotations.team=mq",
                  "--set", "operator.logLevel=debug",
                  "--set-json", "operator.heartbeatInterval=1.5",
                  "--set", "operator.reapplyInterval=60",
                  "--set", "operator.securityContext.readOnlyRootFilesystem=false")
    [account] = [doc for doc in docs if doc["kind"] == "ServiceAccount"
                 and doc["metadata"]["name"] == "ops"]
    assert account["metadata"]["name"] == "ops"
    assert account["metadata"]["annotations"] == {"team": "mq"}
    [deployment] = [doc for doc in docs if doc["kind"] == "Deployment"]
    job = uninstall_hook(docs)
    for pod in (deployment["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        assert pod["serviceAccountName"] == "ops"
        [container] = pod["containers"]
        # a value changed, the rest of the restricted defaults kept
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
            "capabilities": {"drop": ["ALL"]}}
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert "--verbose" in container["command"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["STRATAMQ_OPERATOR_HEARTBEAT_INTERVAL"] == "1.5"
    assert env["STRATAMQ_OPERATOR_REAPPLY_INTERVAL"] == "60"
    bindings = [doc for doc in docs if doc["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and not doc["roleRef"]["name"].endswith("-crds")]  # the hook's own account
    assert bindings and all(binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ops", "namespace": "brokers"}]
        for binding in bindings)
    # an account of the user's: bound, not made
    docs = render(tmp_path, "--set", "operator.serviceAccount.create=false",
                  "--set", "operator.serviceAccount.name=ops", "--set", "operator.logLevel=warning")
    assert [doc["metadata"]["name"] for doc in docs if doc["kind"] == "ServiceAccount"] == [
        "mq-stratamq-operator-crds"]  # the CRD upgrade hook's own
    [deployment] = [doc for doc in docs if doc["kind"] == "Deployment"]
    assert "--quiet" in deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def test_watch_namespaces_grants_rights_in_those_namespaces_only(tmp_path: Path) -> None:
    """Serving some namespaces, the operator's rights on what lives in one are a Role in
    each of them; its ClusterRole keeps only what is cluster-scoped (get Nodes). The
    real API server's view of the same rights: tests/kube/test_operator_rbac.py."""
    every = render(tmp_path)
    [cluster_role] = [doc for doc in every if doc["kind"] == "ClusterRole"
                      and doc["metadata"]["name"] == "mq-stratamq-operator"]
    namespaced = [rule for rule in cluster_role["rules"]
                  if rule["resources"] not in (["customresourcedefinitions"], ["nodes"],
                                               ["clusterkopfpeerings"], ["namespaces"])]
    docs = render(tmp_path, "--set", "operator.watchNamespaces={iot,fleet}")
    [cluster_role] = [doc for doc in docs if doc["kind"] == "ClusterRole"
                      and doc["metadata"]["name"] == "mq-stratamq-operator"]
    assert [rule["resources"] for rule in cluster_role["rules"]] == [["nodes"]]
    roles = {doc["metadata"]["namespace"]: doc for doc in docs if doc["kind"] == "Role"
             and doc["metadata"]["name"] == "mq-stratamq-operator"}
    assert set(roles) == {"iot", "fleet"}
    for role in roles.values():
        assert role["rules"] == [{"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"],
                                  "verbs": ["get", "list", "watch", "patch"]}, *namespaced]
    bound = {(doc["metadata"]["namespace"], doc["roleRef"]["name"]) for doc in docs
             if doc["kind"] == "RoleBinding"}
    assert bound == {("iot", "mq-stratamq-operator"), ("fleet", "mq-stratamq-operator"),
                     ("brokers", "mq-stratamq-operator-uninstall")}
    assert {(doc["kind"], doc["metadata"].get("namespace")) for doc in docs
            if doc["kind"].endswith("KopfPeering")} == {("KopfPeering", "iot"),
                                                         ("KopfPeering", "fleet")}
    [deployment] = [doc for doc in docs if doc["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    # Kopf lists no namespaces and watches no CRDs: it may not
    assert {"name": "STRATAMQ_OPERATOR_SCANNING", "value": "off"} in container["env"]
    command = container["command"]
    assert "--all-namespaces" not in command
    assert [arg for arg in command if arg.startswith("--namespace")] == [
        "--namespace=iot", "--namespace=fleet"]
    job = uninstall_hook(docs)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert [arg for arg in command if arg.startswith("--watch-namespace")] == [
        "--watch-namespace=iot", "--watch-namespace=fleet"]


def uninstall_hook(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The pre-delete hook's Job among rendered documents."""
    [job] = [doc for doc in docs if doc["kind"] == "Job"
             and doc["metadata"]["name"].endswith("-operator-uninstall")]
    return job


def render(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    out = run_tool("helm", ["template", "mq", str(CHART), "--namespace", "brokers", *args],
                   tool_env(tmp_path)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


# Everything the chart can make at once: its storage (and `helm test`), the
# Prometheus operator's kinds, the hooks and dashboards (the default).
EVERYTHING = ("--set", "durableStorage.create=true",
              "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
              "--api-versions", "monitoring.coreos.com/v1/PrometheusRule")
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "PriorityClass"}
# DNS labels: a Service's, a Job's (its pods' job-name label) name
LABEL_NAMED = {"Service", "Job"}


def object_key(doc: dict[str, Any]) -> tuple[str, str | None, str]:
    metadata = doc["metadata"]
    return doc["kind"], metadata.get("namespace"), metadata["name"]


def references(docs: list[dict[str, Any]]) -> set[tuple[str, str | None, str]]:
    """The objects that rendered objects name by name: accounts, roles, the priority
    class, the peering, the Deployment the uninstall hook scales, ConfigMaps mounted,
    the Spark drivers' ClusterRole, the storage `helm test` tests."""
    named: set[tuple[str, str | None, str]] = set()
    for doc in docs:
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            ref = doc["roleRef"]
            named.add((ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"]))
            named |= {("ServiceAccount", subject["namespace"], subject["name"])
                      for subject in doc["subjects"]}
        if doc["kind"] in ("ClusterRole", "Role"):
            named |= {("ClusterRole", None, name) for rule in doc["rules"]
                      if rule["resources"] == ["clusterroles"]
                      for name in rule.get("resourceNames", [])}
            named |= {("Deployment", namespace, name) for rule in doc["rules"]
                      if rule["resources"] == ["deployments"]
                      for name in rule.get("resourceNames", [])}
        template = doc.get("spec", {}).get("template", doc.get("spec", {}).get("jobTemplate"))
        pod = (template or {}).get("spec") if doc["kind"] != "Pod" else doc["spec"]
        if not isinstance(pod, dict) or "containers" not in pod:
            continue
        named.add(("ServiceAccount", namespace, pod["serviceAccountName"]))
        if "priorityClassName" in pod:
            named.add(("PriorityClass", None, pod["priorityClassName"]))
        named |= {("ConfigMap", namespace, volume["configMap"]["name"])
                  for volume in pod.get("volumes", []) if "configMap" in volume}
        for container in pod["containers"]:
            for arg in container.get("command", []):
                key, _, value = arg.partition("=")
                if key == "--peering":
                    named.add(("ClusterKopfPeering", None, value))
                elif key == "--deployment":
                    named.add(("Deployment", namespace, value))
                elif key == "--storage":
                    named.add(("DurableStorage", namespace, value))
            named |= {("ClusterRole", None, variable["value"])
                      for variable in container.get("env", [])
                      if variable["name"] == "STRATAMQ_OPERATOR_SPARK_DRIVER_ROLE"}
    return named


def test_name_overrides_name_every_object(tmp_path: Path) -> None:
    """nameOverride replaces the chart's name in the name of every object the chart
    makes, cluster-scoped ones included; fullnameOverride the whole <release>-stratamq.
    No two objects share a name, every name an object refers to is one rendered, and
    the storage keeps its own name (a storage renamed would be a new one)."""
    default = render(tmp_path, *EVERYTHING)
    renamed = render(tmp_path, *EVERYTHING, "--set", "nameOverride=queue")
    full = render(tmp_path, *EVERYTHING, "--set", "fullnameOverride=broker")
    long_name = "b" * 44  # the longest the schema allows
    longest = render(tmp_path, *EVERYTHING, "--set", f"fullnameOverride={long_name}")
    for docs, prefix in ((default, "mq-stratamq"), (renamed, "mq-queue"), (full, "broker"),
                         (longest, long_name)):
        keys = [object_key(doc) for doc in docs]
        assert len(keys) == len(set(keys)), f"{prefix}: names collide: {sorted(keys)}"
        assert ("DurableStorage", "brokers", "mq-mq") in keys
        made = [key for key in keys if key[0] != "DurableStorage"]
        assert len(made) == 23  # every object, the hooks and `helm test` included
        assert [key for key in made if not key[2].startswith(prefix)] == []
        if prefix != "mq-stratamq":
            assert [key for key in made if "stratamq" in key[2]] == []
        assert {kind for kind, namespace, _ in made if namespace is None} == CLUSTER_SCOPED
        assert references(docs) <= set(keys), references(docs) - set(keys)
        assert [key for key in keys if key[0] in LABEL_NAMED and len(key[2]) > 63] == []
    # Serving some namespaces: the Roles and peerings there follow too.
    docs = render(tmp_path, "--set", "fullnameOverride=broker",
                  "--set", "operator.watchNamespaces={iot}")
    watched = {object_key(doc) for doc in docs}
    assert {("Role", "iot", "broker-operator"), ("RoleBinding", "iot", "broker-operator"),
            ("KopfPeering", "iot", "broker-operator")} <= watched
    assert [key for key in watched if not key[2].startswith("broker-")] == []
    # Two releases, one overridden, side by side: no cluster-scoped name in common.
    assert not {object_key(doc) for doc in default if object_key(doc)[1] is None} & {
        object_key(doc) for doc in full if object_key(doc)[1] is None}
    # The alert for a stopped operator selects the job the ServiceMonitor gives it,
    # whatever the objects are called: a label of the metrics Service, not its name.
    for docs in (default, full):
        [service] = [doc for doc in docs if doc["kind"] == "Service"]
        [monitor] = [doc for doc in docs if doc["kind"] == "ServiceMonitor"]
        [rule] = [doc for doc in docs if doc["kind"] == "PrometheusRule"]
        assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == OPERATOR_JOB
        [down] = [alert for group in rule["spec"]["groups"] for alert in group["rules"]
                  if alert["alert"] == "StratamqOperatorDown"]
        assert f'up{{job="{OPERATOR_JOB}"}}' in down["expr"]


def test_helm_template_renders(tmp_path: Path) -> None:
    # by default: the operator and the dashboards (the CRDs are left out by `template`)
    assert [doc["kind"] for doc in render(tmp_path)] == [
        "PriorityClass", "PodDisruptionBudget", "ServiceAccount", "ConfigMap", "ConfigMap",
        "ConfigMap", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "Service", "Deployment", "ClusterKopfPeering",
        # the hooks: the pre-upgrade hook's (crd-upgrade-hook.yaml) and its Job, the
        # pre-delete hook's Job
        "ServiceAccount", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "Job", "Job"]
    docs = render(tmp_path, "--include-crds", "--set", "dashboards.enabled=false",
                  "--set", "operator.enabled=false", "--set", "crds.upgrade=false",
                  "--set", "durableStorage.create=true",
                  "--set", "durableStorage.spec.sites=5",
                  "--set-json", 'durableStorage.spec.messages={"nShards": 8}')
    assert [(doc["kind"], doc["metadata"]["name"]) for doc in docs] == [
        ("CustomResourceDefinition", "durablestorages.stratamq.io"),
        ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev"),
        ("CustomResourceDefinition", "kopfpeerings.kopf.dev"),
        ("CustomResourceDefinition", "replicatransitions.stratamq.io"),
        ("DurableStorage", "mq-mq")]
    assert docs[:4] == [doc for path in sorted(CRDS.glob("*.yaml"))
                        for doc in yaml.safe_load_all(path.read_text())]
    storage = docs[4]
    assert storage["apiVersion"] == "stratamq.io/v1alpha1"
    assert storage["metadata"]["namespace"] == "brokers"
    assert storage["metadata"]["labels"]["app.kubernetes.io/instance"] == "mq"
    assert storage["spec"] == {"sites": 5, "messages": {"nShards": 8}}


def test_dashboards_are_config_maps_for_the_grafana_sidecar(tmp_path: Path) -> None:
    docs = render(tmp_path, "--set", "dashboards.annotations.grafana_folder=stratamq",
                  "--set", "operator.enabled=false", "--set", "crds.upgrade=false")
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert [path.name for path in files] == ["stratamq-broker.json", "stratamq-replication.json",
                                             "stratamq-storage.json"]
    assert [doc["metadata"]["name"] for doc in docs] == ["mq-stratamq-broker",
                                                          "mq-stratamq-replication",
                                                          "mq-stratamq-storage"]
    for doc, path in zip(docs, files, strict=True):
        assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert doc["metadata"]["annotations"] == {"grafana_folder": "stratamq"}
        assert doc["data"] == {path.name: path.read_text().rstrip("\n")}
        board = json.loads(doc["data"][path.name])
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"
        assert board["uid"] == path.stem and board["templating"]["list"][0]["name"] == \
            "datasource"
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and all(target["expr"] for target in panel["targets"])
    assert render(tmp_path, "--set", "dashboards.enabled=false",
                  "--set", "operator.enabled=false", "--set", "crds.upgrade=false") == []


def test_alerts_are_a_prometheus_rule_where_the_operator_crd_exists(tmp_path: Path) -> None:
    assert render(tmp_path, "--set", "dashboards.enabled=false",
                  "--set", "operator.enabled=false", "--set", "crds.upgrade=false") == []
    docs = render(tmp_path, "--set", "dashboards.enabled=false", "--set", "operator.enabled=false",
                  "--set", "crds.upgrade=false",
                  "--set", "prometheusRule.labels.release=kube-prometheus-stack",
                  "--api-versions", "monitoring.coreos.com/v1/PrometheusRule")
    assert [doc["kind"] for doc in docs] == ["PrometheusRule"]
    rule = docs[0]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules_file = CHART / "rules" / "stratamq.rules.yaml"
    assert rule["spec"] == yaml.safe_load(rules_file.read_text())
    assert render(tmp_path, "--set", "dashboards.enabled=false", "--set", "operator.enabled=false",
                  "--set", "crds.upgrade=false", "--set", "prometheusRule.enabled=false",
                  "--api-versions", "monitoring.coreos.com/v1/PrometheusRule") == []
    # With a runbook's address, each alert links to its section of docs/runbook.md.
    [linked] = render(tmp_path, "--set", "dashboards.enabled=false",
                      "--set", "operator.enabled=false", "--set", "crds.upgrade=false",
                      "--set", "prometheusRule.runbookBaseURL=https://wiki.example/runbook",
                      "--api-versions", "monitoring.coreos.com/v1/PrometheusRule")
    sections = {line[3:].strip().lower() for line in
                (REPO / "docs" / "runbook.md").read_text().splitlines()
                if line.startswith("## ")}
    alerts = [rule for group in linked["spec"]["groups"] for rule in group["rules"]]
    assert alerts and sections == {rule["alert"].lower() for rule in alerts}
    for rule in alerts:
        assert rule["annotations"]["runbook_url"] == \
            f"https://wiki.example/runbook#{rule['alert'].lower()}"


def test_helm_install_creates_the_durable_storage(crds: ControlPlane, namespace: str) -> None:
    values = ["--set", "durableStorage.create=true", "--set", "durableStorage.spec.sites=1",
              "--set", "durableStorage.spec.messages.replicationFactor=1",
              "--set", "durableStorage.spec.listeners.tcp.port=1884",
              "--set", "durableStorage.spec.admin.port=18090"]
    installed = crds.helm("install", "mq", str(CHART), "--namespace", namespace, *values)
    # Named apart from the release's own objects; the notes say how to connect and
    # where the admin token is.
    notes = installed.stdout
    assert f"kubectl port-forward -n {namespace} svc/mq-mq 1884:1884" in notes, notes
    assert f"kubectl get secret -n {namespace} mq-mq-admin -o jsonpath='{{.data.token}}'" \
        in notes, notes
    assert "The admin API (port 18090 of each site" in notes, notes  # the spec's port
    storage = json.loads(crds.kubectl("get", "-n", namespace, "durablestorage", "mq-mq",
                                      "-o", "json").stdout)
    assert storage["spec"]["sites"] == 1
    assert storage["spec"]["messages"]["nShards"] == 16  # the CRD's default
    assert storage["metadata"]["annotations"]["meta.helm.sh/release-name"] == "mq"

    # A storage an older chart made under the release's name (its default then) keeps
    # it through an upgrade: a new name would be a new storage, the old one deleted.
    crds.helm("install", "old", str(CHART), "--namespace", namespace, *values,
              "--set", "durableStorage.name=old")
    # (--no-hooks: no node here runs the CRD upgrade hook's pod;
    # test_chart_crd_upgrade.py runs what it runs)
    crds.helm("upgrade", "old", str(CHART), "--namespace", namespace, *values, "--no-hooks")
    assert crds.kubectl("get", "-n", namespace, "durablestorages", "-o", "name"
                        ).stdout.split() == ["durablestorage.stratamq.io/mq-mq",
                                             "durablestorage.stratamq.io/old"]
    crds.helm("uninstall", "old", "--namespace", namespace, "--wait", "--no-hooks")

    # Values that break the schema fail the install with the API server's message.
    result = crds.helm("install", "bad", str(CHART), "--namespace", namespace,
                       "--set", "durableStorage.create=true",
                       "--set", "durableStorage.spec.sites=0", check=False)
    assert result.returncode != 0
    assert "spec.sites in body should be greater than or equal to 1" in result.stderr

    # No node runs the pre-delete hook's pod here (tests/realnode runs it); no operator
    # ran either, so no finalizer holds the storage.
    crds.helm("uninstall", "mq", "--namespace", namespace, "--wait", "--no-hooks")
    assert crds.kubectl("get", "-n", namespace, "durablestorages", "-o", "name").stdout == ""
    # Helm never deletes CRDs.
    crds.kubectl("get", "crd", "durablestorages.stratamq.io")


def test_prometheus_scrapes_the_operator(tmp_path: Path) -> None:
    """A Service for the operator's metrics port, and a ServiceMonitor selecting it where
    the Prometheus operator's CRD exists (and serviceMonitor.enabled)."""
    off = ["--set", "dashboards.enabled=false"]
    docs = render(tmp_path, *off)
    assert not [doc for doc in docs if doc["kind"] == "ServiceMonitor"]
    docs = render(tmp_path, *off, "--set", "serviceMonitor.labels.release=kube-prometheus-stack",
                  "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    by_kind = {doc["kind"]: doc for doc in docs}
    service, monitor, deployment = (by_kind["Service"], by_kind["ServiceMonitor"],
                                    by_kind["Deployment"])
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    # The Service reaches the operator's pods at their metrics port ...
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    env = {item["name"]: item.get("value") for item in container["env"]}
    [port] = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] == "metrics"
    assert env["STRATAMQ_OPERATOR_METRICS_BIND"] == f"0.0.0.0:{ports['metrics']}"
    # ... and the ServiceMonitor selects that Service, in the release's namespace.
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items())
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["brokers"]}
    # The storages' own `namespace` and `name` labels kept (the dashboards' controller
    # panels and the operator's alerts select a storage by them).
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "30s", "honorLabels": True}]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not [doc for doc in render(tmp_path, *off, "--set", "serviceMonitor.enabled=false",
                                      "--api-versions",
                                      "monitoring.coreos.com/v1/ServiceMonitor")
                if doc["kind"] == "ServiceMonitor"]
    assert not [doc for doc in render(tmp_path, *off, "--set", "operator.enabled=false",
                                      "--api-versions",
                                      "monitoring.coreos.com/v1/ServiceMonitor")
                if doc["kind"] in ("Service", "ServiceMonitor")]


def test_rendered_manifests_validate_on_the_api_server(crds: ControlPlane, namespace: str,
                                                       tmp_path: Path) -> None:
    """Everything the chart renders (the ServiceMonitor aside: its CRD is not served
    here) is accepted by the real API server's schemas (a server-side dry run, with
    strict field validation: an unknown or misplaced field fails)."""
    out = run_tool("helm", ["template", "mq", str(CHART), "--namespace", namespace,
                            "--set", "durableStorage.create=true",
                            "--set", "durableStorage.spec.sites=3",
                            # `helm test`'s credentials, from a Secret
                            "--set", "durableStorage.testCredentialsSecret=mq-helm-test"],
                  tool_env(tmp_path)).stdout
    # The accounts the pods name must exist (the ServiceAccount admission checks a Pod's,
    # here `helm test`'s; a dry run makes nothing): made for real first.
    crds.kubectl("create", "serviceaccount", "-n", namespace, "mq-stratamq-operator")
    result = crds.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace,
                          "-f", "-", input=out)
    kinds = [line.split()[0].split("/")[0] for line in result.stdout.splitlines()]
    assert "service" in kinds and "deployment.apps" in kinds and "pod" in kinds, result.stdout


def operator_pod_template(tmp_path: Path) -> dict[str, Any]:
    """The operator Deployment's pod template, as the chart renders it next to a storage
    named after the release (`durableStorage.create`)."""
    [deployment] = [doc for doc in render(tmp_path, "--set", "durableStorage.create=true")
                    if doc["kind"] == "Deployment"]
    template: dict[str, Any] = deployment["spec"]["template"]
    return template


def test_nothing_that_looks_for_sites_finds_the_operators_pod(tmp_path: Path) -> None:
    """With `durableStorage.create` the storage is named after the release, and the
    operator's pod carries that name and instance too. It was counted as a site (the
    phase never reached Ready) and selected by the sites' Services and disruption
    budget. Everything that looks for the sites now also asks for component=broker."""
    operator_labels = operator_pod_template(tmp_path)["metadata"]["labels"].items()
    owner = Owner(name="mq", namespace="brokers", uid="1234-uid")
    objects = resources.desired_objects(owner, crd_defaults(), service_monitors=False)
    [site_set] = [made for made in objects if made["kind"] == "StatefulSet"]
    site_labels = site_set["spec"]["template"]["metadata"]["labels"].items()
    selectors = {"pod listing and status.selector": resources.site_selector_labels("mq")}
    selectors |= {f"{made['kind']} {made['metadata']['name']}":
                  made["spec"]["selector"].get("matchLabels", made["spec"]["selector"])
                  for made in objects if made["kind"] in ("Service", "PodDisruptionBudget")}
    assert len(selectors) == 4
    for what, selector in selectors.items():
        assert selector.items() <= site_labels, what
        assert not selector.items() <= operator_labels, f"{what} selects the operator's pod"
    assert resources.site_selector("mq") == ",".join(
        f"{key}={value}" for key, value in resources.site_selector_labels("mq").items())


def test_the_operator_is_the_last_evicted_and_kept_through_drains(tmp_path: Path) -> None:
    """While no operator runs nothing fails over: its pods get a PriorityClass above
    ordinary workloads (the chart's own, or the one named); by default two replicas
    (Kopf peering: one acts), preferably on two nodes, rolled one new pod at a time
    with none taken first, and a disruption budget keeps one through node drains
    (with one replica it would block every drain)."""
    docs = render(tmp_path)
    [priority] = [doc for doc in docs if doc["kind"] == "PriorityClass"]
    assert priority["value"] == 1000000 and priority["globalDefault"] is False
    assert operator_pod_template(tmp_path)["spec"]["priorityClassName"] \
        == priority["metadata"]["name"] == "mq-stratamq-operator"
    [deployment] = [doc for doc in docs if doc["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    [term] = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() \
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    [budget] = [doc for doc in docs if doc["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["minAvailable"] == 1
    docs = render(tmp_path, "--set", "operator.replicas=1")
    assert not [doc for doc in docs if doc["kind"] == "PodDisruptionBudget"]
    docs = render(tmp_path, "--set", "operator.replicas=2",
                  "--set", "operator.priorityClassName=platform-critical")
    assert not [doc for doc in docs if doc["kind"] == "PriorityClass"]
    [deployment] = [doc for doc in docs if doc["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["priorityClassName"] == "platform-critical"
    [budget] = [doc for doc in docs if doc["kind"] == "PodDisruptionBudget"]
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() \
        <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_operators_root_is_read_only_with_a_writable_tmp(tmp_path: Path) -> None:
    """The Kubernetes client keeps its discovery cache under /tmp: with a read-only root
    and nothing mounted there, the operator crashed in its own pod."""
    spec = operator_pod_template(tmp_path)["spec"]
    [container] = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    [mount] = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/tmp"]
    [volume] = [volume for volume in spec["volumes"] if volume["name"] == mount["name"]]
    assert "emptyDir" in volume and not mount.get("readOnly")


def test_the_operator_on_the_host_network_binds_its_pod_ip(tmp_path: Path) -> None:
    """operator.hostNetwork: health and metrics on the node's address (the pod IP), not
    on all of the node's addresses; operator.env reaches the container as given."""
    default = operator_pod_template(tmp_path)["spec"]
    assert "hostNetwork" not in default
    [deployment] = [doc for doc in render(
        tmp_path, "--set", "operator.hostNetwork=true",
        "--set-json", 'operator.env=[{"name": "KUBERNETES_SERVICE_HOST", "value": "10.1.2.3"}]')
        if doc["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    [container] = spec["containers"]
    assert "--liveness=http://$(POD_IP):8080/healthz" in container["command"]
    names = [variable["name"] for variable in container["env"]]
    values = {variable["name"]: variable.get("value") for variable in container["env"]}
    assert values["STRATAMQ_OPERATOR_METRICS_BIND"] == "$(POD_IP):8081"
    assert names.index("POD_IP") < names.index("STRATAMQ_OPERATOR_METRICS_BIND")
    assert values["KUBERNETES_SERVICE_HOST"] == "10.1.2.3"


def test_uninstall_stops_the_operator_first_as_its_own_account(tmp_path: Path) -> None:
    """Helm deletes the operator's Deployment and its rights in one go, the storage of
    `durableStorage.create` last: the operator, stopping after its rights were gone,
    could not take Kopf's finalizer off, and `helm uninstall` hung (issue 21, defect 4;
    tests/realnode/test_chart_on_real_nodes.py). A pre-delete hook, run as the
    operator's account, stops the operator first; that account may change its own
    Deployment, no other."""
    docs = render(tmp_path, "--set", "operator.hostNetwork=true", "--set-json",
                  'operator.env=[{"name": "KUBERNETES_SERVICE_HOST", "value": "10.1.2.3"}]')
    hook = uninstall_hook(docs)
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    spec = hook["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "mq-stratamq-operator"
    assert spec["hostNetwork"] is True  # reaches the API server as the operator does
    [container] = spec["containers"]
    assert container["command"][:3] == ["python", "-m", "stratamq.operator.uninstall"]
    assert "--deployment=mq-stratamq-operator" in container["command"]
    assert container["env"] == [{"name": "KUBERNETES_SERVICE_HOST", "value": "10.1.2.3"}]
    # Not one of the operator's pods, which the hook waits to be gone.
    [deployment] = [doc for doc in docs if doc["kind"] == "Deployment"]
    assert not deployment["spec"]["selector"]["matchLabels"].items() \
        <= hook["spec"]["template"]["metadata"]["labels"].items()
    [role] = [doc for doc in docs if doc["kind"] == "Role"]
    assert role["metadata"]["name"] == "mq-stratamq-operator-uninstall"
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments"],
                              "verbs": ["get", "patch"],
                              "resourceNames": ["mq-stratamq-operator"]},
                             # to wait for the Deployment's pods to go
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert not [doc for doc in render(tmp_path, "--set", "operator.enabled=false",
                                      "--set", "crds.upgrade=false")
                if doc["kind"] in ("Job", "Role", "RoleBinding")]


def as_pod(name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": template["metadata"].get("labels", {})},
            "spec": template["spec"]}


def spark_executor(spec: dict[str, Any]) -> dict[str, Any]:
    """An executor pod as Spark's driver makes it from the pod template: what Spark
    adds (image, arguments, ports, its scratch and the shared volume) in a real one."""
    template = spark.executor_pod_template(spec)
    [container] = template["spec"]["containers"]
    container.update({"image": "stratamq/stratamq-spark:0.1.0", "args": ["executor"],
                      "ports": [{"name": "blockmanager", "containerPort": 7079}],
                      "volumeMounts": [{"name": "spark-local-dir-1", "mountPath": "/var/data"},
                                       {"name": "spark-work",
                                        "mountPath": "/var/lib/stratamq-spark"}]})
    template["spec"].update({"restartPolicy": "Never", "volumes": [
        {"name": "spark-local-dir-1", "emptyDir": {}},
        {"name": "spark-work", "persistentVolumeClaim": {"claimName": "shared"}}]})
    return {**template, "metadata": {"name": "spark-gc-exec-1"}}


def test_every_pod_passes_pod_security_restricted(crds: ControlPlane, namespace: str,
                                                  tmp_path: Path) -> None:
    """The operator's (and its hooks'), the sites' and the Spark jobs' pods,
    created (server-side dry run)
    in a namespace that enforces Pod Security "restricted": the API server's PodSecurity
    admission refused all three (no seccompProfile)."""
    crds.kubectl("label", "namespace", namespace,
                 "pod-security.kubernetes.io/enforce=restricted")
    # The accounts the pods name must exist (the ServiceAccount admission checks that).
    for account in ("mq-stratamq-operator", "mq-stratamq-operator-crds", "mq-spark"):
        crds.kubectl("create", "serviceaccount", "-n", namespace, account)
    # ... and so must the operator's PriorityClass (the Priority admission checks it):
    # the chart's own, created for real beside the dry runs (cluster-wide, so removed
    # at the end)
    [priority] = [doc for doc in render(tmp_path) if doc["kind"] == "PriorityClass"]
    crds.kubectl("create", "-f", "-", input=json.dumps(priority))
    deadline = time.monotonic() + 30  # `default`: made by the controller manager
    while crds.kubectl("get", "serviceaccount", "-n", namespace, "default",
                       check=False).returncode != 0:
        assert time.monotonic() < deadline, "no default ServiceAccount"
        time.sleep(0.2)
    owner = Owner(name="mq", namespace=namespace, uid="1234-uid")
    spec = with_spark(gc={"enable": True})
    site_set = resources.stateful_set(owner, spec)
    site_template = site_set["spec"]["template"]
    site_template["spec"]["volumes"].append(  # what the StatefulSet adds from its claims
        {"name": "data", "persistentVolumeClaim": {"claimName": "data-mq-0"}})
    [gc_job] = [made for made in spark.spark_objects(owner, spec, spark_operator=False)
                if made["kind"] == "CronJob"]
    rendered = render(tmp_path, "--set", "durableStorage.create=true")
    hook = uninstall_hook(rendered)
    [crd_hook] = [doc for doc in rendered if doc["kind"] == "Job"
                  and doc["metadata"]["name"].endswith("-operator-crds")]
    [test_pod] = [doc for doc in rendered if doc["kind"] == "Pod"]  # `helm test`
    pods = [as_pod("operator", operator_pod_template(tmp_path)),
            as_pod("operator-uninstall", hook["spec"]["template"]),
            as_pod("crd-upgrade", crd_hook["spec"]["template"]),
            as_pod("helm-test", {"metadata": test_pod["metadata"], "spec": test_pod["spec"]}),
            as_pod("site", site_template),
            as_pod("spark-gc", gc_job["spec"]["jobTemplate"]["spec"]["template"]),
            spark_executor(spec)]
    try:
        for pod in pods:
            result = crds.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                                  input=json.dumps(pod), check=False)
            assert result.returncode == 0, f"{pod['metadata']['name']}: {result.stderr}"
    finally:
        crds.kubectl("delete", "priorityclass", priority["metadata"]["name"])
