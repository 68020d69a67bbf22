"""The operator launches the Spark jobs of `spec.spark` (stratamq.operator.spark), against
the real API server and controller manager, the operator a real `kopf run` process.

No node serves this module's namespace (the sites' pods stay Pending: the jobs' objects
do not need them), and nothing here runs Spark. Where a Spark run would end, the test
says so the way the missing part would: it sets the run's Pod to Succeeded or Failed
through the status subresource, as a kubelet does, and the real Job controller turns
that into the Job's Complete or Failed condition; for the Spark operator's path it
plays the Spark operator (makes the SparkApplication of a run, labelled and owned as
the Spark operator does, and sets its state).

The tests run in order: CronJobs first; then the Spark operator's CRDs are installed
(a minimal copy of their schema) and the same storage moves to
ScheduledSparkApplications; the CRDs are removed at the end, so other modules never
see them."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from harness.waiting import wait_for
from stratamq.operator import spark
from tests.support.kube import ControlPlane
from tests.support.operator_process import OperatorProcess

NAMESPACE = "operator-spark"
NAME = "mq"
CLAIM = "spark-shared"
TIMEOUT = 90.0
# The CronJob controller runs a `* * * * *` schedule within a minute, and checks its
# CronJobs about every 10 s.
SCHEDULED_TIMEOUT = 100.0
SPEC: dict[str, Any] = {
    "sites": 2,
    "messages": {"nShards": 1, "replicationFactor": 1,
                 "layout": {"wildcardThresholds": [50, 5]}},
    "durableSessions": {"retentionRules": {"sensors/#": "7d"}},
    "storage": {"size": "1Gi"},
    "spark": {"volume": {"claimName": CLAIM}, "image": {"tag": "9.9.9"},
              "gc": {"enable": True, "schedule": "0 4 * * *"},
              # the real CronJob controller makes this one's Job within a minute
              "export": {"enable": True, "schedule": "* * * * *"}},
}
SPARK_OPERATOR_CRDS = ("sparkapplications", "scheduledsparkapplications")


def kubectl_json(kube: ControlPlane, *what: str) -> dict[str, Any] | None:
    result = kube.kubectl("get", "-n", NAMESPACE, "-o", "json", *what, check=False)
    if result.returncode != 0:
        return None
    found: dict[str, Any] = json.loads(result.stdout)
    return found


def items(kube: ControlPlane, *what: str) -> list[dict[str, Any]]:
    found = kubectl_json(kube, *what)
    assert found is not None, what
    listed: list[dict[str, Any]] = found["items"]
    return listed


def storage(kube: ControlPlane) -> dict[str, Any]:
    found = kubectl_json(kube, "durablestorage", NAME)
    assert found is not None
    return found


def patch_spec(kube: ControlPlane, spec: dict[str, Any]) -> None:
    kube.kubectl("patch", "-n", NAMESPACE, "durablestorage", NAME, "--type=merge",
                 "-p", json.dumps({"spec": spec}))


def last_run(kube: ControlPlane, key: str) -> dict[str, Any]:
    found: dict[str, Any] = storage(kube).get("status", {}).get("spark", {}).get(key, {})
    return found


def run_is(kube: ControlPlane, key: str, job: str, result: str) -> dict[str, Any] | None:
    run = last_run(kube, key)
    return run if run.get("job") == job and run.get("result") == result else None


def arguments(command: list[str]) -> dict[str, list[str]]:
    """`--flag value` pairs of a command line, each flag's values in order."""
    found: dict[str, list[str]] = {}
    for flag, value in itertools.pairwise(command):
        if flag.startswith("--"):
            found.setdefault(flag, []).append(value)
    return found


@pytest.fixture(scope="module")
def operator(kube_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    process = OperatorProcess(tmp_path_factory.mktemp("operator-spark"), kube_cluster, NAMESPACE)
    process.start(timeout=60)
    yield process
    process.kill()
    assert "Traceback" not in process.log(), process.log_tail(6000)


@pytest.fixture(scope="module")
def spark_operator_crds(kube_cluster: ControlPlane, operator: OperatorProcess) -> Iterator[None]:
    """The Spark operator's CRDs (group sparkoperator.k8s.io, v1beta2), their schemas
    cut to what the API server needs: any spec, a status subresource. Removed after the
    module (the operator first, so it never sees them go)."""
    for plural in SPARK_OPERATOR_CRDS:
        kind = {"sparkapplications": "SparkApplication",
                "scheduledsparkapplications": "ScheduledSparkApplication"}[plural]
        kube_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            # *.k8s.io groups need it; the Spark operator's own CRDs carry this one
            "metadata": {"name": f"{plural}.sparkoperator.k8s.io", "annotations": {
                "api-approved.kubernetes.io":
                    "https://github.com/kubeflow/spark-operator/pull/1298"}},
            "spec": {"group": "sparkoperator.k8s.io", "scope": "Namespaced",
                     "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                     "versions": [{"name": "v1beta2", "served": True, "storage": True,
                                   "subresources": {"status": {}},
                                   "schema": {"openAPIV3Schema": {
                                       "type": "object",
                                       "x-kubernetes-preserve-unknown-fields": True}}}]}}))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    *(f"crd/{plural}.sparkoperator.k8s.io" for plural in SPARK_OPERATOR_CRDS))
    yield
    operator.kill()
    kube_cluster.kubectl("delete", "crd", "--wait=false",
                    *(f"{plural}.sparkoperator.k8s.io" for plural in SPARK_OPERATOR_CRDS))


def finish_pod_of(kube: ControlPlane, job: str, exit_code: int, log_end: str = "") -> None:
    """What a kubelet reports when the Job's container exits with `exit_code`, its
    log ending with `log_end` (the termination message, FallbackToLogsOnError)."""
    def pod() -> str | None:
        pods = items(kube, "pods", "-l", f"{spark.JOB_NAME_LABEL}={job}")
        return str(pods[0]["metadata"]["name"]) if pods else None
    name = wait_for(f"the pod of Job {job}", pod, timeout=TIMEOUT)
    phase = "Succeeded" if exit_code == 0 else "Failed"
    terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                  "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:01:00Z",
                  **({"message": log_end} if log_end else {})}
    kube.kubectl("patch", "-n", NAMESPACE, "pod", name, "--subresource=status",
                 "--type=merge", "-p", json.dumps({"status": {
                     "phase": phase,
                     "conditions": [{"type": "Ready", "status": "False",
                                     "reason": "PodCompleted"}],
                     "containerStatuses": [{
                         "name": "spark-submit", "image": "stratamq/stratamq-spark:9.9.9",
                         "imageID": "", "ready": False, "restartCount": 0,
                         "state": {"terminated": terminated}}]}}))


# --- the tests, in order --------------------------------------------------------------------

def test_enabled_jobs_become_cron_jobs(kube_cluster: ControlPlane,
                                       operator: OperatorProcess) -> None:
    kube_cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
        "metadata": {"name": NAME}, "spec": SPEC}))
    gc = wait_for("the gc CronJob",
                  lambda: kubectl_json(kube_cluster, "cronjob", f"{NAME}-spark-gc"),
                  timeout=TIMEOUT, explain=operator.log_tail)
    export = wait_for("the export CronJob",
                      lambda: kubectl_json(kube_cluster, "cronjob", f"{NAME}-spark-export"),
                      timeout=TIMEOUT)
    assert kubectl_json(kube_cluster, "cronjob", f"{NAME}-spark-learn-topics") is None
    uid = storage(kube_cluster)["metadata"]["uid"]
    for made in (gc, export):
        [reference] = made["metadata"]["ownerReferences"]
        assert (reference["kind"], reference["name"], reference["uid"],
                reference["controller"]) == ("DurableStorage", NAME, uid, True)
    assert (gc["spec"]["schedule"], gc["spec"]["timeZone"]) == ("0 4 * * *", "Etc/UTC")
    assert export["spec"]["schedule"] == "* * * * *"
    assert gc["spec"]["concurrencyPolicy"] == "Forbid"

    template = gc["spec"]["jobTemplate"]
    assert template["metadata"]["labels"][spark.JOB_LABEL] == "gc"
    assert template["spec"]["activeDeadlineSeconds"] == 7200  # the CRD's default
    pod = template["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{NAME}-spark"
    [container] = pod["containers"]
    assert container["image"] == "stratamq/stratamq-spark:9.9.9"
    # spark-submit in client mode (this pod is the driver) on the cluster's own API
    # server, the application `stratamq spark launch gc` over every site's admin API;
    # under `stratamq spark submit`, which fails the Job unless the driver exited 0 and
    # its result file says Succeeded
    wrapper = container["command"][:container["command"].index("--") + 1]
    assert wrapper == ["stratamq", "spark", "submit", "--result",
                       "/var/lib/stratamq-spark/mq/gc/$(STRATAMQ_SPARK_RUN)/result.json", "--"]
    command = container["command"][len(wrapper):]
    assert command[:5] == ["spark-submit", "--master", "k8s://https://kubernetes.default.svc",
                           "--deploy-mode", "client"]
    assert {"name": "spark-work", "mountPath": "/var/lib/stratamq-spark"} in (
        container["volumeMounts"])
    assert {"name": "spark-work", "persistentVolumeClaim": {"claimName": CLAIM}} in (
        pod["volumes"])
    application = command.index(spark.APPLICATION)
    assert command[application + 1:application + 3] == ["launch", "gc"]
    flags = arguments(command[application:])
    assert flags["--site"] == [f"http://{NAME}-{n}.{NAME}-peers.{NAMESPACE}.svc:18083"
                               for n in range(2)]
    assert flags["--workdir"] == ["/var/lib/stratamq-spark/mq/gc"]
    assert flags["--rule"] == ["sensors/#=7d"]
    assert flags["--default"] == ["1d"]
    assert flags["--run"] == ["$(STRATAMQ_SPARK_RUN)"]
    conf = dict(value.split("=", 1) for value in arguments(command[:application])["--conf"])
    assert conf["spark.kubernetes.namespace"] == NAMESPACE
    assert conf["spark.kubernetes.container.image"] == "stratamq/stratamq-spark:9.9.9"
    assert conf["spark.kubernetes.driver.pod.name"] == "$(STRATAMQ_SPARK_POD)"
    token = {"secretKeyRef": {"name": f"{NAME}-admin", "key": "token"}}
    assert {"name": "STRATAMQ_ADMIN_TOKEN", "valueFrom": token} in container["env"]
    prefix = "spark.kubernetes.executor.volumes.persistentVolumeClaim.spark-work"
    assert conf[f"{prefix}.options.claimName"] == CLAIM
    assert conf[f"{prefix}.mount.path"] == "/var/lib/stratamq-spark"

    # The driver's account, bound to the chart's ClusterRole in this namespace.
    binding = kubectl_json(kube_cluster, "rolebinding", f"{NAME}-spark")
    assert binding is not None
    assert binding["roleRef"]["name"] == "stratamq-spark"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{NAME}-spark",
                                    "namespace": NAMESPACE}]
    assert kubectl_json(kube_cluster, "serviceaccount", f"{NAME}-spark") is not None
    # The executors' pod template, mounted in the Job's pod.
    config_map = kubectl_json(kube_cluster, "configmap", f"{NAME}-spark-executor")
    assert config_map is not None
    assert config_map["metadata"]["ownerReferences"][0]["uid"] == uid
    assert {"name": "executor-pod-template", "configMap": {
        "name": f"{NAME}-spark-executor", "defaultMode": 420}} in pod["volumes"]
    # The sites mount the shared volume where the jobs read their checkpoints.
    stateful_set = kubectl_json(kube_cluster, "statefulset", NAME)
    assert stateful_set is not None
    volumes = stateful_set["spec"]["template"]["spec"]["volumes"]
    assert {"name": "spark-work", "persistentVolumeClaim": {"claimName": CLAIM}} in volumes


def test_schedule_and_image_changes_update_the_cron_job(kube_cluster: ControlPlane) -> None:
    patch_spec(kube_cluster, {"spark": {"gc": {"schedule": "30 2 * * 0"},
                                   "image": {"tag": "9.9.10"}}})

    def updated() -> dict[str, Any] | None:
        found = kubectl_json(kube_cluster, "cronjob", f"{NAME}-spark-gc")
        return found if found and found["spec"]["schedule"] == "30 2 * * 0" else None
    found = wait_for("the new schedule", updated, timeout=TIMEOUT)
    [container] = found["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "stratamq/stratamq-spark:9.9.10"
    assert "spark.kubernetes.container.image=stratamq/stratamq-spark:9.9.10" in (
        container["command"])


def test_a_run_that_succeeds_then_one_that_fails_show_in_status(kube_cluster: ControlPlane) -> None:
    """Runs made as `kubectl create job --from=cronjob/...` makes them (the CronJob's
    own template, owned by it); their pod's end is reported as a kubelet would."""
    first = f"{NAME}-spark-gc-manual-1"
    kube_cluster.kubectl("create", "job", "-n", NAMESPACE, first, f"--from=cronjob/{NAME}-spark-gc")
    # (the Job controller sets the start time a moment after the Job is made)
    wait_for("the run Running, started", lambda: "startTime" in (
        run_is(kube_cluster, "gc", first, "Running") or {}), timeout=TIMEOUT)
    running = last_run(kube_cluster, "gc")
    assert "completionTime" not in running and "message" not in running, running
    finish_pod_of(kube_cluster, first, 0)
    done = wait_for("the run Succeeded", lambda: run_is(kube_cluster, "gc", first, "Succeeded"),
                    timeout=TIMEOUT)
    job = kubectl_json(kube_cluster, "job", first)
    assert job is not None
    assert done["completionTime"] == job["status"]["completionTime"]
    assert done["startTime"] == job["status"]["startTime"]

    second = f"{NAME}-spark-gc-manual-2"
    kube_cluster.kubectl("create", "job", "-n", NAMESPACE, second,
                    f"--from=cronjob/{NAME}-spark-gc")
    wait_for("the second run Running", lambda: run_is(kube_cluster, "gc", second, "Running"),
             timeout=TIMEOUT)
    why = "stratamq spark submit: the run failed: CtlError: http://mq-1: 409 Conflict"
    finish_pod_of(kube_cluster, second, 1, f"INFO spark-submit log\n{why}\n")
    failed = wait_for("the second run Failed", lambda: run_is(kube_cluster, "gc", second, "Failed"),
                      timeout=TIMEOUT)
    # backoffLimit 0: the Job controller gives up on the first failed pod
    assert failed["message"].startswith("BackoffLimitExceeded"), failed
    # and why, from the end of the pod's log
    assert failed["message"].endswith(f"; {why}"), failed
    assert "completionTime" in failed


def test_the_cron_job_controller_starts_a_run(kube_cluster: ControlPlane) -> None:
    """The export's `* * * * *`: the real CronJob controller makes its Job (its name is
    the CronJob's and the scheduled minute), and the status shows it."""
    def scheduled() -> dict[str, Any] | None:
        run = last_run(kube_cluster, "export")
        return run if run.get("job", "").startswith(f"{NAME}-spark-export-") else None
    run = wait_for("a scheduled export run", scheduled, timeout=SCHEDULED_TIMEOUT)
    job = kubectl_json(kube_cluster, "job", run["job"])
    assert job is not None
    [reference] = job["metadata"]["ownerReferences"]
    assert (reference["kind"], reference["name"]) == ("CronJob", f"{NAME}-spark-export")


def test_turning_a_job_off_deletes_its_cron_job(kube_cluster: ControlPlane) -> None:
    before = last_run(kube_cluster, "gc")
    patch_spec(kube_cluster, {"spark": {"gc": {"enable": False}}})
    wait_for("the gc CronJob deleted",
             lambda: kubectl_json(kube_cluster, "cronjob", f"{NAME}-spark-gc") is None,
             timeout=TIMEOUT)
    assert kubectl_json(kube_cluster, "cronjob", f"{NAME}-spark-export") is not None
    # The last run stays reported after its Jobs went with their CronJob.
    wait_for("the gc Jobs collected",
             lambda: not items(kube_cluster, "jobs", "-l", f"{spark.JOB_LABEL}=gc"),
             timeout=TIMEOUT)
    assert last_run(kube_cluster, "gc") == before


def test_with_the_spark_operator_scheduled_spark_applications(
        kube_cluster: ControlPlane, operator: OperatorProcess, spark_operator_crds: None) -> None:
    # Any change of the spec reconciles; the operator then finds the CRDs served.
    patch_spec(kube_cluster, {"spark": {"learnTopics": {"enable": True, "schedule": "@daily"}}})

    def scheduled(job: str) -> dict[str, Any] | None:
        return kubectl_json(kube_cluster, "scheduledsparkapplication", f"{NAME}-spark-{job}")
    learn = wait_for("the learn-topics ScheduledSparkApplication",
                     lambda: scheduled("learn-topics"), timeout=TIMEOUT,
                     explain=operator.log_tail)
    assert scheduled("export") is not None
    assert scheduled("gc") is None
    # Its CronJob went: the Spark operator runs it now (and the CronJobs' pod template).
    wait_for("the CronJobs deleted", lambda: not items(kube_cluster, "cronjobs"), timeout=TIMEOUT)
    wait_for("the executors' pod template deleted", lambda: kubectl_json(
        kube_cluster, "configmap", f"{NAME}-spark-executor") is None, timeout=TIMEOUT)
    [reference] = learn["metadata"]["ownerReferences"]
    assert (reference["kind"], reference["name"]) == ("DurableStorage", NAME)
    assert learn["spec"]["schedule"] == "@daily"
    template = learn["spec"]["template"]
    assert (template["type"], template["mode"], template["mainApplicationFile"]) == (
        "Python", "cluster", spark.APPLICATION)
    assert template["image"] == "stratamq/stratamq-spark:9.9.10"
    assert template["arguments"][:2] == ["launch", "learn-topics"]
    assert arguments(template["arguments"])["--wildcard-thresholds"] == ["50,5"]
    assert template["driver"]["serviceAccount"] == f"{NAME}-spark"
    assert template["sparkConf"]["spark.kubernetes.driver.secretKeyRef.STRATAMQ_ADMIN_TOKEN"] \
        == f"{NAME}-admin:token"

    # Playing the Spark operator: a run is a SparkApplication with the scheduled one's
    # labels, owned by it; its state decides the status.
    run = f"{NAME}-spark-learn-topics-1767225600000000000"
    kube_cluster.kubectl("create", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "sparkoperator.k8s.io/v1beta2", "kind": "SparkApplication",
        "metadata": {"name": run, "labels": {**learn["metadata"]["labels"],
                                             spark.SCHEDULED_APP_LABEL: learn["metadata"]["name"]},
                     "ownerReferences": [{"apiVersion": "sparkoperator.k8s.io/v1beta2",
                                          "kind": "ScheduledSparkApplication",
                                          "name": learn["metadata"]["name"],
                                          "uid": learn["metadata"]["uid"]}]},
        "spec": template}))

    def set_state(state: dict[str, Any], **times: str) -> None:
        kube_cluster.kubectl("patch", "-n", NAMESPACE, "sparkapplication", run,
                        "--subresource=status", "--type=merge", "-p", json.dumps(
                            {"status": {"applicationState": state, **times}}))
    set_state({"state": "RUNNING"}, lastSubmissionAttemptTime="2026-01-01T00:00:00Z")
    running = wait_for("the run Running",
                       lambda: run_is(kube_cluster, "learnTopics", run, "Running"),
                       timeout=TIMEOUT)
    assert running["startTime"] == "2026-01-01T00:00:00Z"
    set_state({"state": "FAILED", "errorMessage": "driver container failed with ExitCode: 1"},
              terminationTime="2026-01-01T00:05:00Z")
    failed = wait_for("the run Failed", lambda: run_is(kube_cluster, "learnTopics", run, "Failed"),
                      timeout=TIMEOUT)
    assert failed["completionTime"] == "2026-01-01T00:05:00Z"
    assert failed["message"] == "FAILED: driver container failed with ExitCode: 1"


def test_turning_every_job_off_removes_the_driver_account(kube_cluster: ControlPlane,
                                                          spark_operator_crds: None) -> None:
    patch_spec(kube_cluster, {"spark": {"learnTopics": {"enable": False},
                                   "export": {"enable": False}}})
    wait_for("the ScheduledSparkApplications deleted",
             lambda: not items(kube_cluster, "scheduledsparkapplications"), timeout=TIMEOUT)
    wait_for("the driver's RoleBinding deleted",
             lambda: kubectl_json(kube_cluster, "rolebinding", f"{NAME}-spark") is None,
             timeout=TIMEOUT)
    assert kubectl_json(kube_cluster, "serviceaccount", f"{NAME}-spark") is None
    # What the storage's spec no longer asks for is gone; the runs' record stays.
    assert last_run(kube_cluster, "learnTopics")["result"] == "Failed"

