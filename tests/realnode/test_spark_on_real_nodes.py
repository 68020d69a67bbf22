"""A scheduled Spark job on real nodes (tests/support/realnode.py): the chart's operator
makes the storage's export CronJob; a run of it (`kubectl create job --from=cronjob`)
is the driver in the Job's own pod, a container of the Spark image
(images/build-local.sh --spark, imported on one node, the others cordoned while the
run's pods are placed) that asks the API server for an executor pod, a second
container of that image; the driver takes the
site's checkpoint through its admin API into a ReadWriteMany volume (a hostPath
PersistentVolume: one machine), the executor reads it there, and the usage Parquet it
leaves counts every message published (issue 23).

These nodes' pod network reaches nothing and there is no cluster DNS or kube-proxy, so
the storage says so (`spec.spark.hostNetwork`, `apiServer`: the API server's loopback
address, `siteAddresses: PodIP`): the Spark pods run on their nodes' network and the
driver finds the site at its pod's IP. The stand-in kubelet's
tests/kube/test_spark_client_mode.py covers the restricted executor template and the
executors' going with the driver's pod."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pyarrow.parquet as parquet
import pytest

from harness.processes import REPO
from harness.waiting import wait_for
from stratamq.operator import resources, spark
from tests.support.clients import PahoClient
from tests.support.realnode import RealKubeCluster

CHART = REPO / "charts" / "stratamq"
IMAGES = REPO / ".cache" / "images"
NAMESPACE = "realnode-spark"
RELEASE = "sp-op"
NAME = "sp"
CLAIM = "spark-work"
RUN = f"{NAME}-export-1"
MESSAGES = 200
# The one node with the Spark image, where the site and the Spark pods run.
SPARK_NODE = 0
# Generous: a Spark driver and executor JVM on nodes of one loaded 2-core machine.
RUN_TIMEOUT_S = 900.0



def explain(cluster: RealKubeCluster) -> str:
    pods = cluster.plane.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    driver = cluster.plane.kubectl("logs", "-n", NAMESPACE, f"job/{RUN}", "--tail=60",
                                   check=False)
    jobs = cluster.plane.kubectl("get", "jobs", "-n", NAMESPACE, "-o", "yaml", check=False).stdout
    return f"pods:\n{pods}\njobs:\n{jobs[-3000:]}\ndriver log:\n{driver.stdout}{driver.stderr}"


@pytest.fixture(scope="module")
def spark_cluster(real_kube_cluster: RealKubeCluster) -> Iterator[RealKubeCluster]:
    """The Spark image imported on one node only (1.6 GB: its copies on every node
    filled a CI machine's disk), a shared volume, and the chart's operator with a
    one-site storage whose export job runs on the host network, both on other nodes;
    after, the release uninstalled, its pods gone, every node schedulable and the image
    removed (the next module needs the nodes and the disk)."""
    cluster = real_kube_cluster
    started = time.monotonic()
    subprocess.run([str(REPO / "images" / "build-local.sh"), "--spark", str(IMAGES)],
                   check=True, timeout=1800)
    built = time.monotonic() - started
    images_before = cluster.image_names(SPARK_NODE)
    try:
        cluster.import_images([IMAGES / "spark.tar"], nodes=[SPARK_NODE])
        print(f"\nSpark image: built {built:.0f} s, imported "
              f"{time.monotonic() - started - built:.0f} s")
        # the operator and the site elsewhere: the Spark pods take the node's 2 cores
        schedulable_only(cluster, [kubelet.node for index, kubelet
                                   in enumerate(cluster.kubelets) if index != SPARK_NODE])
        yield from _storage_with_spark(cluster)
    finally:
        schedulable_only(cluster, [kubelet.node for kubelet in cluster.kubelets],
                         check=False)
        cluster.remove_images(sorted(cluster.image_names(SPARK_NODE) - images_before),
                              nodes=[SPARK_NODE])


def schedulable_only(cluster: RealKubeCluster, nodes: list[str], check: bool = True) -> None:
    """New pods go to `nodes` only: the others are cordoned."""
    for kubelet in cluster.kubelets:
        cluster.plane.kubectl("uncordon" if kubelet.node in nodes else "cordon", kubelet.node,
                              check=check)


def _storage_with_spark(cluster: RealKubeCluster) -> Iterator[RealKubeCluster]:
    shared = cluster.workdir / "spark-work"
    shared.mkdir()
    os.chown(shared, 10001, 10001)  # the images' user, in the sites and the Spark pods
    cluster.plane.kubectl("create", "namespace", NAMESPACE)
    cluster.plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": [{
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": CLAIM},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                 "claimRef": {"namespace": NAMESPACE, "name": CLAIM},
                 "hostPath": {"path": str(shared), "type": "Directory"}}}, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": NAMESPACE},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "volumeName": CLAIM, "resources": {"requests": {"storage": "1Gi"}}}}]}))
    cluster.add_volumes(1)  # the site's data
    spec = {
        "sites": 1, "hostNetwork": True, "image": {"pullPolicy": "Never"},
        "messages": {"nShards": 2, "replicationFactor": 1}, "storage": {"size": "1Gi"},
        "spark": {
            "hostNetwork": True, "siteAddresses": "PodIP",
            "apiServer": f"https://127.0.0.1:{cluster.plane.apiserver.port}",
            "image": {"pullPolicy": "Never"}, "volume": {"claimName": CLAIM},
            "executors": 1, "resources": {"driver": {"memory": "512m"},
                                          "executor": {"memory": "512m"}},
            # run by the test, not by the schedule
            "export": {"enable": True, "schedule": "0 0 1 1 *"}}}
    try:
        # One operator: a second, on the host network, would need another node's ports.
        cluster.install_chart(CHART, RELEASE, NAMESPACE, "--set", "operator.replicas=1",
                              "--set", "durableStorage.create=true",
                              "--set", f"durableStorage.name={NAME}",
                              "--set-json", "durableStorage.spec=" + json.dumps(spec))
        yield cluster
    finally:
        cluster.plane.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait",
                           "--timeout=120s", check=False, timeout=150)
        cluster.plane.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        wait_for("the module's pods gone", lambda: not json.loads(cluster.plane.kubectl(
            "get", "pods", "-n", NAMESPACE, "-o", "json", check=False).stdout
            or '{"items": []}')["items"], timeout=180)
        cluster.plane.kubectl("delete", "persistentvolume", CLAIM, "--wait=false", check=False)


@pytest.mark.timeout(2400)  # with the Spark image's first build (minutes)
def test_a_scheduled_export_runs_on_spark_pods(spark_cluster: RealKubeCluster) -> None:
    cluster = spark_cluster
    wait_for("the storage Ready", lambda: cluster.get_json(NAMESPACE, "durablestorage", NAME).get(
        "status", {}).get("phase") == "Ready", timeout=300, explain=lambda: explain(cluster))
    [site] = cluster.get_json(NAMESPACE, "pods", "-l", resources.site_selector(NAME))["items"]
    publisher = PahoClient(1883, "spark-pub", host=site["status"]["podIP"])
    try:
        assert publisher.connect().reason_code == 0
        for number in range(MESSAGES):
            assert publisher.publish(f"fleet/{number % 20}/speed", b"%d" % number, qos=1) == 0
    finally:
        publisher.stop()

    # the run's pods (a driver and an executor of a core each) where the image is
    schedulable_only(cluster, [cluster.kubelets[SPARK_NODE].node])
    started = time.monotonic()
    cluster.plane.kubectl("create", "job", "-n", NAMESPACE, RUN,
                          f"--from=cronjob/{spark.name_of(NAME, 'export')}")
    executors: dict[str, dict[str, Any]] = {}

    def ended() -> str | None:
        # the executor pods while they live (the driver deletes them at its end)
        for pod in cluster.get_json(NAMESPACE, "pods", "-l", "spark-role=executor")["items"]:
            executors.setdefault(pod["metadata"]["name"], pod)
        job = cluster.get_json(NAMESPACE, "job", RUN)
        for condition in job.get("status", {}).get("conditions") or []:
            if condition["status"] == "True" and condition["type"] in ("Complete", "Failed"):
                return str(condition["type"])
        return None

    outcome = wait_for("the run's end", ended, timeout=RUN_TIMEOUT_S, every=1.0,
                       explain=lambda: explain(cluster))
    assert outcome == "Complete", explain(cluster)
    print(f"export run: {time.monotonic() - started:.0f} s, executors {sorted(executors)}")

    # The executor: a pod of the Spark image the driver asked for, owned by the Job's
    # pod, on its node's network.
    [driver] = cluster.get_json(NAMESPACE, "pods", "-l", f"{spark.JOB_NAME_LABEL}={RUN}")["items"]
    assert driver["spec"]["hostNetwork"] is True
    assert len(executors) == 1, executors
    [executor] = executors.values()
    assert executor["spec"]["hostNetwork"] is True
    assert [owner["name"] for owner in executor["metadata"]["ownerReferences"]] == [
        driver["metadata"]["name"]]
    assert executor["spec"]["containers"][0]["image"] == driver["spec"]["containers"][0]["image"]

    # What the run left on the shared volume: its outcome and the usage it counted.
    folder = cluster.workdir / "spark-work" / NAME / "export" / RUN
    result = json.loads((folder / "result.json").read_text())
    assert (result["result"], len(result["sites_done"])) == ("Succeeded", 1), result
    usage = parquet.read_table(folder / "site-0" / "usage.parquet").to_pylist()
    assert sum(row["messages"] for row in usage) == MESSAGES, usage
    # The operator's record of the run.
    wait_for("the run in status.spark", lambda: cluster.get_json(
        NAMESPACE, "durablestorage", NAME).get("status", {}).get("spark", {}).get(
            "export", {}).get("result") == "Succeeded",
        timeout=60, explain=lambda: explain(cluster))
