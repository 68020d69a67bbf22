"""A run's driver in client mode (stratamq.operator.spark), Spark's own, against the
real API server and controller manager: the operator's spark-submit command of a gc
run, as its CronJob's container has it, with the storage's driver account bound to
the chart's ClusterRole for Spark drivers, in a namespace that enforces Pod Security
"restricted".

No node serves the namespace, so the Job's pod stays Pending and the driver process
runs here instead of in it: what differs from a real run is only where that process
runs (the kubelet would expand `$(...)` from the pod's env; here the test does, with
this machine's address and free ports for the driver). The test shows what the
executors get from the driver: made by Spark from the operator's pod template
(admitted under "restricted"), owned by the Job's pod, and collected by the real
garbage collector when the driver is killed and its pod deleted, as when a Job is
killed at its deadline. No executor runs (no node, no image)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from harness.processes import HOST, REPO, free_port
from harness.waiting import wait_for
from stratamq.operator import spark
from stratamq.operator.resources import Owner
from tests.kube.test_chart import as_pod
from tests.kube.test_operator_rbac import token_kubeconfig
from tests.support.kube import ControlPlane
from tests.unit.test_operator_spark import with_spark

RELEASE = "spark-client"
# The driver's JVM and Python start on a loaded 2-core machine.
TIMEOUT = 180.0
# The application the driver runs here: a session, which makes the executors, held
# until the test kills it.
APPLICATION = """
import time
from pyspark.sql import SparkSession
SparkSession.builder.getOrCreate()
print("session up", flush=True)
time.sleep(600)
"""


def driver_role(kube: ControlPlane) -> dict[str, Any]:
    """The chart's ClusterRole for Spark drivers, as the chart renders it."""
    rendered = kube.helm("template", RELEASE, str(REPO / "charts" / "stratamq"),
                         "--show-only", "templates/operator-rbac.yaml").stdout
    [role] = [doc for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] == "ClusterRole"
              and doc["metadata"]["name"].endswith("-spark")]
    return dict(role)


def executors(kube: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    listed = kube.kubectl("get", "pods", "-n", namespace, "-l", "spark-role=executor",
                          "-o", "yaml").stdout
    found: list[dict[str, Any]] = yaml.safe_load(listed)["items"]
    return found


def test_executors_are_restricted_and_go_with_the_jobs_pod(kube: ControlPlane, namespace: str,
                                                            tmp_path: Path) -> None:
    kube.kubectl("label", "namespace", namespace,
                 "pod-security.kubernetes.io/enforce=restricted")
    owner = Owner(name="mq", namespace=namespace, uid="1234-uid")
    spec = with_spark(gc={"enable": True})
    spec["pod"] = {"imagePullSecrets": [{"name": "registry"}]}
    role = driver_role(kube)
    kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(role))
    try:
        binding = spark.role_binding(owner)
        binding["roleRef"]["name"] = role["metadata"]["name"]
        for made in (spark.service_account(owner), binding):
            made["metadata"].pop("ownerReferences")  # (no storage here)
            kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(made))
        # The Job's pod, as its Job would make it.
        job = spark.cron_job(owner, spec, "gc")["spec"]["jobTemplate"]
        driver_pod = as_pod("mq-spark-gc-manual-abcde", job["spec"]["template"])
        driver_pod["metadata"]["labels"][spark.JOB_NAME_LABEL] = "mq-spark-gc-manual"
        kube.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(driver_pod))
        uid = kube.kubectl("get", "pod", "-n", namespace, driver_pod["metadata"]["name"],
                           "-o", "jsonpath={.metadata.uid}").stdout.strip()
        # What the pod's ConfigMap volume holds.
        [config_map] = [made for made in spark.spark_objects(owner, spec, spark_operator=False)
                        if made["kind"] == "ConfigMap"]
        template = tmp_path / spark.POD_TEMPLATE_KEY
        template.write_text(config_map["data"][spark.POD_TEMPLATE_KEY])

        token = kube.kubectl("create", "token", spark.service_account_name(owner.name), "-n",
                             namespace, "--duration=1h").stdout.strip()
        kubeconfig = token_kubeconfig(kube, tmp_path / "driver.kubeconfig", token, "mq-spark")
        application = tmp_path / "application.py"
        application.write_text(APPLICATION)
        expanded = {f"$({spark.POD_NAME_ENV})": driver_pod["metadata"]["name"],
                    f"$({spark.POD_IP_ENV})": HOST,
                    f"spark.driver.port={spark.DRIVER_PORT}": f"spark.driver.port={free_port()}",
                    f"spark.driver.blockManager.port={spark.BLOCK_MANAGER_PORT}":
                        f"spark.driver.blockManager.port={free_port()}",
                    f"{spark.POD_TEMPLATE_MOUNT}/{spark.POD_TEMPLATE_KEY}": str(template),
                    spark.K8S_MASTER: f"k8s://{kube.apiserver.url}"}
        command = spark.submit_command(owner, spec, "gc")
        command = command[:command.index(spark.APPLICATION)]
        for before, after in expanded.items():
            command = [part.replace(before, after) for part in command]
        assert not [part for part in command if "$(" in part], command
        command[0] = str(Path(sys.executable).with_name("spark-submit"))

        with (tmp_path / "driver.log").open("wb") as log:
            driver = subprocess.Popen(
                [*command, "--conf", "spark.ui.enabled=false", str(application)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "KUBECONFIG": str(kubeconfig),
                     "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable})
            try:
                def explain() -> str:
                    return (tmp_path / "driver.log").read_text()[-4000:]

                def both_executors() -> list[dict[str, Any]] | None:
                    found = executors(kube, namespace)
                    return found if len(found) == 2 else None
                pods = wait_for("the executor pods", both_executors, timeout=TIMEOUT,
                                explain=explain)
                for pod in pods:
                    assert [(reference["kind"], reference["uid"]) for reference in
                            pod["metadata"]["ownerReferences"]] == [("Pod", uid)], pod
                    assert pod["spec"]["securityContext"]["seccompProfile"] == {
                        "type": "RuntimeDefault"}
                    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
                    assert pod["spec"]["automountServiceAccountToken"] is False
                    [container] = pod["spec"]["containers"]
                    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
                    assert pod["metadata"]["labels"][spark.JOB_LABEL] == "gc"
                    assert {"name": "spark-work", "persistentVolumeClaim": {
                        "claimName": "shared"}} in pod["spec"]["volumes"]
            finally:
                # Killed, as a Job at its deadline kills its pod's processes.
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(30)
        assert executors(kube, namespace), "the driver took its executors along"
        kube.kubectl("delete", "pod", "-n", namespace, driver_pod["metadata"]["name"],
                     "--grace-period=0", "--force")
        wait_for("the executors collected with the Job's pod",
                 lambda: not executors(kube, namespace), timeout=TIMEOUT)
    finally:
        kube.kubectl("delete", "clusterrole", role["metadata"]["name"], check=False)
