"""The Helm chart skeleton (charts/stratamq) with the real helm: it carries the CRDs of
crds/ unchanged, lints clean, renders, and installs into the test API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.support.harness import REPO
from tests.support.kube import ControlPlane, run_tool, tool_env

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
    for values in ([], ["--set", "durableStorage.create=true"]):
        result = run_tool("helm", ["lint", "--strict", str(CHART), *values], tool_env(tmp_path))
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, (
            result.stdout)


def render(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    out = run_tool("helm", ["template", "mq", str(CHART), "--namespace", "brokers", *args],
                   tool_env(tmp_path)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_helm_template_renders(tmp_path: Path) -> None:
    # by default: the operator and the dashboards (the CRDs are left out by `template`)
    assert [doc["kind"] for doc in render(tmp_path)] == [
        "ServiceAccount", "ConfigMap", "ConfigMap", "ConfigMap", "ClusterRole", "ClusterRole",
        "ClusterRoleBinding", "Service", "Deployment", "ClusterKopfPeering"]
    docs = render(tmp_path, "--include-crds", "--set", "dashboards.enabled=false",
                  "--set", "operator.enabled=false",
                  "--set", "durableStorage.create=true",
                  "--set", "durableStorage.spec.sites=5",
                  "--set-json", 'durableStorage.spec.messages={"nShards": 8}')
    assert [(doc["kind"], doc["metadata"]["name"]) for doc in docs] == [
        ("CustomResourceDefinition", "durablestorages.stratamq.io"),
        ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev"),
        ("CustomResourceDefinition", "kopfpeerings.kopf.dev"),
        ("CustomResourceDefinition", "replicatransitions.stratamq.io"),
        ("DurableStorage", "mq")]
    assert docs[:4] == [doc for path in sorted(CRDS.glob("*.yaml"))
                        for doc in yaml.safe_load_all(path.read_text())]
    storage = docs[4]
    assert storage["apiVersion"] == "stratamq.io/v1alpha1"
    assert storage["metadata"]["namespace"] == "brokers"
    assert storage["metadata"]["labels"]["app.kubernetes.io/instance"] == "mq"
    assert storage["spec"] == {"sites": 5, "messages": {"nShards": 8}}


def test_dashboards_are_config_maps_for_the_grafana_sidecar(tmp_path: Path) -> None:
    docs = render(tmp_path, "--set", "dashboards.annotations.grafana_folder=stratamq",
                  "--set", "operator.enabled=false")
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
                  "--set", "operator.enabled=false") == []


def test_alerts_are_a_prometheus_rule_where_the_operator_crd_exists(tmp_path: Path) -> None:
    assert render(tmp_path, "--set", "dashboards.enabled=false",
                  "--set", "operator.enabled=false") == []
    docs = render(tmp_path, "--set", "dashboards.enabled=false", "--set", "operator.enabled=false",
                  "--set", "prometheusRule.labels.release=kube-prometheus-stack",
                  "--api-versions", "monitoring.coreos.com/v1/PrometheusRule")
    assert [doc["kind"] for doc in docs] == ["PrometheusRule"]
    rule = docs[0]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules_file = CHART / "rules" / "stratamq.rules.yaml"
    assert rule["spec"] == yaml.safe_load(rules_file.read_text())
    assert render(tmp_path, "--set", "dashboards.enabled=false", "--set", "operator.enabled=false",
                  "--set", "prometheusRule.enabled=false",
                  "--api-versions", "monitoring.coreos.com/v1/PrometheusRule") == []


def test_helm_install_creates_the_durable_storage(crds: ControlPlane, namespace: str) -> None:
    crds.helm("install", "mq", str(CHART), "--namespace", namespace,
              "--set", "durableStorage.create=true", "--set", "durableStorage.spec.sites=1",
              "--set", "durableStorage.spec.messages.replicationFactor=1")
    storage = json.loads(crds.kubectl("get", "-n", namespace, "durablestorage", "mq",
                                      "-o", "json").stdout)
    assert storage["spec"]["sites"] == 1
    assert storage["spec"]["messages"]["nShards"] == 16  # the CRD's default
    assert storage["metadata"]["annotations"]["meta.helm.sh/release-name"] == "mq"

    # Values that break the schema fail the install with the API server's message.
    result = crds.helm("install", "bad", str(CHART), "--namespace", namespace,
                       "--set", "durableStorage.create=true",
                       "--set", "durableStorage.spec.sites=0", check=False)
    assert result.returncode != 0
    assert "spec.sites in body should be greater than or equal to 1" in result.stderr

    crds.helm("uninstall", "mq", "--namespace", namespace, "--wait")
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
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "30s"}]
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
                            "--set", "durableStorage.spec.sites=3"], tool_env(tmp_path)).stdout
    result = crds.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace,
                          "-f", "-", input=out)
    kinds = [line.split()[0].split("/")[0] for line in result.stdout.splitlines()]
    assert "service" in kinds and "deployment.apps" in kinds, result.stdout
