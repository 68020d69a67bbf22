"""The operator end to end: a real `kopf run` process against the real API server and
controller manager, with tests/support/kubelet.py playing the node, so every Pod is a
real broker process on a loopback address of its own.

One DurableStorage (`mq`, 3 sites) lives through the whole module; the tests run in
order and each takes it one step further: ready, MQTT through a pod, scaled by the
scale subresource, a config change rolled through the pods, the operator restarted,
deleted and garbage-collected."""

from __future__ import annotations

import base64
import json
import signal
import time
import tomllib
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml

from harness import waiting
from harness.processes import REPO
from tests.support.clients import PahoClient
from tests.support.kube import ControlPlane
from tests.support.kubelet import Kubelet
from tests.support.operator_process import (
    OperatorProcess,
    Operators,
)

NAMESPACE = "operator-e2e"
NAME = "mq"
TIMEOUT = 180.0
# Short, so that the drift repair shows within the test.
REAPPLY_INTERVAL = 5.0
SPEC: dict[str, Any] = {
    "sites": 3,
    # Few shards start faster; three copies of each, so every site holds every shard
    # (a site holding no replica of a shard does not get its live feed yet).
    "messages": {"nShards": 2, "replicationFactor": 3},
    "storage": {"size": "1Gi"},
}
OWNED = [("service", NAME), ("service", f"{NAME}-peers"), ("statefulset", NAME),
         ("poddisruptionbudget", NAME), ("secret", f"{NAME}-admin")]


def config_map_now(kube: ControlPlane) -> dict[str, Any]:
    """The ConfigMap the StatefulSet's pod template names now (one per config)."""
    stateful_set = get(kube, "statefulset", NAME)
    assert stateful_set is not None
    [name] = [volume["configMap"]["name"] for volume in stateful_set["spec"]["template"][
        "spec"]["volumes"] if volume["name"] == "config"]
    found = get(kube, "configmap", name)
    assert found is not None
    return found


def config_maps(kube: ControlPlane) -> list[str]:
    listed = get(kube, "configmaps", "-l", "app.kubernetes.io/instance=mq")
    assert listed is not None
    return sorted(item["metadata"]["name"] for item in listed["items"])


def wait_for(what: str, check: Callable[[], Any], timeout: float = TIMEOUT,
             explain: Callable[[], str] = lambda: "") -> Any:
    """`waiting.wait_for` with this module's timeout."""
    return waiting.wait_for(what, check, timeout, explain)


def get(kube: ControlPlane, *what: str, check: bool = True) -> dict[str, Any] | None:
    result = kube.kubectl("get", "-n", NAMESPACE, "-o", "json", *what, check=check)
    if result.returncode != 0:
        return None
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def storage(kube: ControlPlane) -> dict[str, Any]:
    found = get(kube, "durablestorage", NAME)
    assert found is not None
    return found


def ready_with(kube: ControlPlane, sites: int) -> dict[str, Any] | None:
    """The storage when its status says Ready with `sites` sites for its generation."""
    found = storage(kube)
    status = found.get("status", {})
    if (status.get("phase") == "Ready" and len(status.get("sites", [])) == sites
            and status.get("observedGeneration") == found["metadata"]["generation"]
            and status.get("readyReplicas") == sites):
        return found
    return None


def explain(kube: ControlPlane, operators: Operators, node: Kubelet) -> Callable[[], str]:
    def text() -> str:
        pods = kube.kubectl("get", "-n", NAMESPACE, "pods", "-o", "wide", check=False).stdout
        status = json.dumps(storage(kube).get("status"), indent=1)
        containers = "\n".join(f"--- {name}:\n{container.log_tail(1500)}"
                               for name, container in node.running(NAMESPACE).items())
        return (f"status: {status}\npods:\n{pods}\nkubelet errors: {node.errors}\n"
                f"{operators.logs()}\n{containers}")
    return text


def owner_uid(kube: ControlPlane) -> str:
    uid: str = storage(kube)["metadata"]["uid"]
    return uid


# --- the tests, in order ------------------------------------------------------------------

def test_storage_becomes_ready_with_three_sites(kube_cluster: ControlPlane, node: Kubelet,
                                                operators: Operators) -> None:
    kube_cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME}, "spec": SPEC}))
    found = wait_for("3 sites ready", lambda: ready_with(kube_cluster, 3),
                     explain=explain(kube_cluster, operators, node))
    status = found["status"]
    uid = found["metadata"]["uid"]

    # Every object is there once, owned by the storage.
    for kind, name in OWNED:
        made = get(kube_cluster, kind, name)
        assert made is not None, (kind, name)
        [reference] = made["metadata"]["ownerReferences"]
        assert (reference["kind"], reference["name"], reference["uid"]) == (
            "DurableStorage", NAME, uid), (kind, name)
        assert reference["controller"] is True

    # One site per pod, each id the one its broker's admin API reports.
    pods = {site["pod"]: site for site in status["sites"]}
    assert sorted(pods) == [f"{NAME}-0", f"{NAME}-1", f"{NAME}-2"]
    assert all(site["ready"] for site in status["sites"])
    assert len({site["id"] for site in status["sites"]}) == 3
    token = kube_cluster.kubectl("get", "-n", NAMESPACE, "secret", f"{NAME}-admin", "-o",
                            "jsonpath={.data.token}").stdout
    bearer = base64.b64decode(token).decode()
    for pod, site in pods.items():
        ip = node.container(NAMESPACE, pod).ip
        request = urllib.request.Request(f"http://{ip}:18083/api/v1/ds/sites",
                                         headers={"Authorization": f"Bearer {bearer}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.load(response)["data"][0]["site"] == site["id"]

    # The image left out of the spec is the operator's own (its package's version
    # outside the chart), resolved when the objects are applied and said in status.
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert status["image"] == f"stratamq/stratamq:{version}"
    sts = get(kube_cluster, "statefulset", NAME)
    assert sts is not None
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == status["image"]

    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    assert (conditions["Rebalancing"]["status"], conditions["Rebalancing"]["reason"]) == (
        "False", "Balanced")
    # The operator is the controller: every shard of every replicated database placed
    # on the three sites, led.
    ids = {site["id"] for site in status["sites"]}
    assert [database["name"] for database in status["databases"]] == [
        "messages", "retained", "sessions"]
    for database in status["databases"]:
        assert database["underReplicatedShards"] == 0
        assert [shard["shard"] for shard in database["shards"]] == [0, 1]
        for shard in database["shards"]:
            assert set(shard["replicas"]) == ids and shard["leader"] in ids
    # The scale subresource's status side and the printer columns.
    assert status["replicas"] == 3
    assert status["selector"] == ("app.kubernetes.io/name=stratamq,"
                                  "app.kubernetes.io/instance=mq,"
                                  "app.kubernetes.io/component=broker")
    table = kube_cluster.kubectl("get", "-n", NAMESPACE, "durablestorage", NAME).stdout
    assert table.splitlines()[1].split()[:4] == [NAME, "3", "3", "2"], table
    # The broker config the pods run with is the spec's.
    config_map = config_map_now(kube_cluster)
    assert config_map["immutable"] is True
    config = yaml.safe_load(config_map["data"]["stratamq.yaml"])
    assert config["durable_storage"]["messages"]["n_shards"] == 2
    events = kube_cluster.kubectl("get", "-n", NAMESPACE, "events", "--field-selector",
                             f"involvedObject.name={NAME},involvedObject.kind=DurableStorage",
                             "-o", "json").stdout
    reasons = {event["reason"] for event in json.loads(events)["items"]}
    assert {"Reconciled", "Ready"} <= reasons, reasons


def test_mqtt_through_a_pod(kube_cluster: ControlPlane, node: Kubelet) -> None:
    """A client reaches a site at its pod's address. (Not through the Service: there is
    no kube-proxy, and EndpointSlices refuse loopback addresses, so the Services have
    no endpoints here.)"""
    ip = node.container(NAMESPACE, f"{NAME}-1").ip
    subscriber = PahoClient(1883, "e2e-sub", host=ip)
    publisher = PahoClient(1883, "e2e-pub", host=ip)
    try:
        assert subscriber.connect().reason_code == 0
        assert subscriber.subscribe("e2e/#", qos=1) == [1]
        assert publisher.connect().reason_code == 0
        for number in range(5):
            assert publisher.publish(f"e2e/{number}", f"m{number}".encode(), qos=1) == 0
        got = subscriber.expect(5)
        assert [message.payload for message in got] == [f"m{n}".encode() for n in range(5)]
    finally:
        subscriber.stop()
        publisher.stop()


def test_a_crashed_site_comes_back_as_itself(kube_cluster: ControlPlane, node: Kubelet,
                                             operators: Operators) -> None:
    """kill -9 of a pod's broker: the node restarts the container (restartCount 1), and
    the site is back, Ready, with the id on its volume."""
    sites = {site["pod"]: site["id"] for site in storage(kube_cluster)["status"]["sites"]}
    container = node.container(NAMESPACE, f"{NAME}-0")
    assert container.process is not None
    container.process.send_signal(signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        pod = get(kube_cluster, "pod", f"{NAME}-0")
        assert pod is not None
        [state] = pod["status"]["containerStatuses"]
        restarted_once = state["restartCount"] == 1 and state["ready"]
        return ready_with(kube_cluster, 3) if restarted_once else None
    found = wait_for("the site back", restarted, explain=explain(kube_cluster, operators, node))
    assert {site["pod"]: site["id"] for site in found["status"]["sites"]} == sites


def test_scale_subresource_adds_a_site(kube_cluster: ControlPlane, node: Kubelet,
                                       operators: Operators) -> None:
    before = {site["pod"]: site["id"] for site in storage(kube_cluster)["status"]["sites"]}
    kube_cluster.kubectl("scale", "-n", NAMESPACE, "durablestorage", NAME, "--replicas=4")
    found = wait_for("4 sites ready", lambda: ready_with(kube_cluster, 4),
                     explain=explain(kube_cluster, operators, node))
    after = {site["pod"]: site["id"] for site in found["status"]["sites"]}
    assert after.items() >= before.items()  # the first three are the same sites
    assert len(set(after.values())) == 4
    stateful_set = get(kube_cluster, "statefulset", NAME)
    assert stateful_set is not None and stateful_set["spec"]["replicas"] == 4
    assert found["spec"]["sites"] == 4


def test_spec_change_rolls_into_the_config_and_the_pods(
        kube_cluster: ControlPlane, node: Kubelet, operators: Operators) -> None:
    """A new maxInflight reaches the ConfigMap; the pods restart with it one at a time
    and come back as the same sites (their ids live on their volumes). First held at
    spec.updateStrategy.partition 3 (a canary): only mq-3 restarts, and the storage
    is Ready with the other three held; then partition 0 lets the roll go on."""
    before = storage(kube_cluster)
    sites = {site["pod"]: site["id"] for site in before["status"]["sites"]}
    old_pods = {name: container.uid for name, container in node.running(NAMESPACE).items()}
    kube_cluster.kubectl("patch", "-n", NAMESPACE, "durablestorage", NAME, "--type=merge",
                    "-p", json.dumps({"spec": {"mqtt": {"maxInflight": 7},
                                               "updateStrategy": {"partition": 3}}}))

    def canary_done() -> dict[str, Any] | None:
        found = ready_with(kube_cluster, 4)
        running = node.running(NAMESPACE)
        if found is None or len(running) != 4 or running[f"{NAME}-3"].uid == old_pods[
                f"{NAME}-3"] or found["status"].get("updatedReplicas") != 1:
            return None
        return found
    found = wait_for("the canary pod alone restarted", canary_done,
                     explain=explain(kube_cluster, operators, node))
    assert "3 held on the previous pod template" in found["status"]["conditions"][0][
        "message"], found["status"]
    assert all(node.running(NAMESPACE)[f"{NAME}-{n}"].uid == old_pods[f"{NAME}-{n}"]
               for n in range(3))
    # A held pod deleted meanwhile comes back on its own template's config, not the
    # canary's (one ConfigMap per config: the held template names the old one).
    kube_cluster.kubectl("delete", "-n", NAMESPACE, "pod", f"{NAME}-1", "--wait=false")

    def back_held() -> dict[str, Any] | None:
        found = ready_with(kube_cluster, 4)
        running = node.running(NAMESPACE)
        back = running.get(f"{NAME}-1")
        if found is None or back is None or back.uid == old_pods[f"{NAME}-1"]:
            return None
        return found
    wait_for("the held pod back", back_held, explain=explain(kube_cluster, operators, node))
    held_config = yaml.safe_load((node.running(NAMESPACE)[f"{NAME}-1"].cwd
                                  / "etc/stratamq/stratamq.yaml").read_text())
    canary_config = yaml.safe_load((node.running(NAMESPACE)[f"{NAME}-3"].cwd
                                    / "etc/stratamq/stratamq.yaml").read_text())
    assert held_config["mqtt"]["max_inflight"] != 7, held_config["mqtt"]
    assert canary_config["mqtt"]["max_inflight"] == 7, canary_config["mqtt"]
    assert len(config_maps(kube_cluster)) == 2  # the held pods' and the canary's
    kube_cluster.kubectl("patch", "-n", NAMESPACE, "durablestorage", NAME, "--type=merge",
                    "-p", json.dumps({"spec": {"updateStrategy": {"partition": 0}}}))

    def config_has_it() -> bool:
        made = config_map_now(kube_cluster)
        return bool(yaml.safe_load(made["data"]["stratamq.yaml"])["mqtt"]["max_inflight"] == 7)
    wait_for("the new config", config_has_it)

    def rolled() -> dict[str, Any] | None:
        found = ready_with(kube_cluster, 4)
        running = node.running(NAMESPACE)
        if found is None or len(running) != 4 or any(
                old_pods.get(name) == container.uid for name, container in running.items()):
            return None
        return found
    found = wait_for("every pod restarted with the new config", rolled,
                     explain=explain(kube_cluster, operators, node))
    assert {site["pod"]: site["id"] for site in found["status"]["sites"]} == sites
    for container in node.running(NAMESPACE).values():
        config = yaml.safe_load((container.cwd / "etc/stratamq/stratamq.yaml").read_text())
        assert config["mqtt"]["max_inflight"] == 7


def test_a_spec_the_broker_would_refuse_fails_and_touches_nothing(
        kube_cluster: ControlPlane, node: Kubelet, operators: Operators) -> None:
    """The schema lets mqtt.maxPacketSize above 256MiB through; the operator checks the
    config with the broker's own model, applies nothing, and says why. Nor does the
    periodic re-apply apply it."""
    config_before = config_map_now(kube_cluster)
    pods_before = {name: c.uid for name, c in node.running(NAMESPACE).items()}
    kube_cluster.kubectl("patch", "-n", NAMESPACE, "durablestorage", NAME, "--type=merge",
                    "-p", json.dumps({"spec": {"mqtt": {"maxPacketSize": "512MiB"}}}))

    def failed() -> dict[str, Any] | None:
        status = storage(kube_cluster).get("status", {})
        return status if status.get("phase") == "Failed" else None
    status = wait_for("phase Failed", failed)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidConfig")
    assert "mqtt.max_packet_size" in ready["message"]
    reapplied = "Timer 'reapply' succeeded"
    runs = operators.current.log().count(reapplied)
    wait_for("two more runs of the periodic re-apply",
             lambda: operators.current.log().count(reapplied) >= runs + 2,
             explain=operators.current.log_tail)
    config_after = config_map_now(kube_cluster)
    assert config_after["data"] == config_before["data"]
    assert {name: c.uid for name, c in node.running(NAMESPACE).items()} == pods_before

    kube_cluster.kubectl("patch", "-n", NAMESPACE, "durablestorage", NAME, "--type=merge",
                    "-p", json.dumps({"spec": {"mqtt": {"maxPacketSize": "1MiB"}}}))
    wait_for("Ready again", lambda: ready_with(kube_cluster, 4))


def test_operator_restart_resumes(kube_cluster: ControlPlane, node: Kubelet,
                                  operators: Operators) -> None:
    """Killed (no goodbye), the operator misses a scale; the next one picks it up and
    makes no second copy of anything."""
    operators.current.kill()
    kube_cluster.kubectl("scale", "-n", NAMESPACE, "durablestorage", NAME, "--replicas=3")
    time.sleep(1)  # nobody acts meanwhile: the StatefulSet still has 4
    stateful_set = get(kube_cluster, "statefulset", NAME)
    assert stateful_set is not None and stateful_set["spec"]["replicas"] == 4
    operators.start()
    wait_for("3 sites ready again", lambda: ready_with(kube_cluster, 3),
             explain=explain(kube_cluster, operators, node))
    labels = "app.kubernetes.io/instance=mq"
    # One ConfigMap: the config the pods run; those of the configs before went (the
    # roll is over, no revision names them).
    for kind, count in (("configmaps", 1), ("services", 2), ("statefulsets", 1),
                        ("poddisruptionbudgets", 1), ("secrets", 1)):
        listed = get(kube_cluster, kind, "-l", labels)
        assert listed is not None
        assert len(listed["items"]) == count, (kind, listed["items"])
    # The operator serves its health and metrics endpoints.
    operator = operators.current
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.port}/healthz",
                                timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics",
                                timeout=10) as response:
        metrics = response.read().decode()
    assert 'stratamq_operator_reconciles_total{result="ok"}' in metrics
    assert f'stratamq_operator_sites_ready{{name="{NAME}",namespace="{NAMESPACE}"}} 3.0' in (
        metrics)


def test_drift_is_repaired(kube_cluster: ControlPlane) -> None:
    """An owned object deleted by hand comes back (the periodic re-apply), as the same
    spec says."""
    before = get(kube_cluster, "service", f"{NAME}-peers")
    assert before is not None
    kube_cluster.kubectl("delete", "-n", NAMESPACE, "service", f"{NAME}-peers")

    def recreated() -> dict[str, Any] | None:
        found = get(kube_cluster, "service", f"{NAME}-peers", check=False)
        if found is None or found["metadata"]["uid"] == before["metadata"]["uid"]:
            return None
        return found
    found = wait_for("the headless Service back", recreated, timeout=60)
    assert found["spec"]["clusterIP"] == "None"
    assert found["metadata"]["ownerReferences"][0]["uid"] == owner_uid(kube_cluster)


def test_a_second_operator_waits_its_turn(kube_cluster: ControlPlane, operators: Operators
                                          ) -> None:
    """Peering: an operator with a lower priority than the running one stays paused
    (it starts paused and never resumes) until the first leaves; then it takes over."""
    first = operators.current
    second = OperatorProcess(operators.workdir / "second", kube_cluster, NAMESPACE, priority=1)
    operators.started.append(second)
    second.start(timeout=60)
    refreshed = "Timer 'refresh_status' succeeded"
    runs = first.log().count(refreshed)
    wait_for("three more status refreshes by the first operator",
             lambda: first.log().count(refreshed) >= runs + 3, explain=first.log_tail)
    assert "refresh_status" not in second.log(), second.log_tail()
    assert "Resuming operations" not in second.log(), second.log_tail()
    # Stopped cleanly, the first leaves the peering object; the second takes over.
    assert first.stop(timeout=30) == 0, first.log_tail()
    wait_for("the second operator to act", lambda: refreshed in second.log(),
             explain=second.log_tail)
    # Its first rounds take its controller term over the sites before it reports
    # them: Ready again once they are in.
    wait_for("Ready under the second operator", lambda: ready_with(kube_cluster, 3),
             explain=second.log_tail)


def test_delete_garbage_collects(kube_cluster: ControlPlane, node: Kubelet) -> None:
    uid = owner_uid(kube_cluster)
    kube_cluster.kubectl("delete", "-n", NAMESPACE, "durablestorage", NAME, "--wait=true",
                    timeout=120)
    def collected() -> list[tuple[str, str]]:
        left = [(kind, name) for kind, name in OWNED
                if get(kube_cluster, kind, name, check=False) is not None]
        pods = get(kube_cluster, "pods")
        assert pods is not None
        left += [("pod", pod["metadata"]["name"]) for pod in pods["items"]]
        left += [("configmap", name) for name in config_maps(kube_cluster)]
        return left
    wait_for("the owned objects collected", lambda: not collected(),
             explain=lambda: str(collected()))
    wait_for("the brokers stopped", lambda: not node.running(NAMESPACE))
    # The volumes stay (the StatefulSet's claims are retained, as data should be).
    claims = get(kube_cluster, "pvc")
    assert claims is not None
    assert sorted(claim["metadata"]["name"] for claim in claims["items"]) == [
        f"data-{NAME}-{n}" for n in range(4)]
    assert all(reference.get("uid") != uid for claim in claims["items"]
               for reference in claim["metadata"].get("ownerReferences", []))
