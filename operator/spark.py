"""The scheduled Spark jobs of a DurableStorage (`spec.spark`), as Kubernetes objects,
and the status of their last run: pure functions, no API calls.

Per enabled job one scheduler object, owned by the storage:

- a CronJob whose Job runs `spark-submit --master k8s://https://kubernetes.default.svc
  --deploy-mode client` in the Spark image (`spec.spark.apiServer` names another
  address of the API server): the Job's pod is the driver, and Spark
  makes the executor pods owned by it, so a Job that ends (or is killed at its
  deadline) takes its executors along; under `stratamq spark submit`, which gives the
  Job the run's outcome (spark-submit's exit and the run's result file), or
- a ScheduledSparkApplication where the Spark operator's CRDs are served (the Spark
  operator then runs the same application on the schedule).

Either way the driver runs `stratamq spark launch JOB` (stratamq.spark.launch): for
every site a checkpoint through its admin API (each site's own address through the
headless Service, or with `spec.spark.siteAddresses: PodIP` its pod's IP read from the
API server; the token from the storage's admin Secret) into the shared volume
`spec.spark.volume`, the job on it, and the result applied through the same API.
In the Job's pod the token is an env of the container and the volume is mounted;
Spark's own configuration (`--conf`) carries the volume to the executors (and, on
the Spark operator's path, the volume and the token to the driver pod), so neither
path needs anything of the Spark operator's webhook.

The driver creates executor pods as the storage's ServiceAccount `<name>-spark`,
bound (RoleBinding in the storage's namespace) to the chart's ClusterRole for Spark
drivers; the operator itself holds only `bind` on that ClusterRole.

For clusters whose pod network or DNS a Spark pod cannot use (`spec.spark.hostNetwork`,
`apiServer`, `siteAddresses`), the driver and executors run on their nodes' network,
reach the API server at a given address and the sites at their pod IPs.
"""

from __future__ import annotations

import math
import os
from typing import Any

import yaml

from .config import SPARK_WORK_MOUNT
from .resources import (
    MANAGED_BY,
    RESTRICTED_POD_SECURITY,
    SPARK_STORAGE_LABEL,
    SPARK_WORK_VOLUME,
    TOKEN_KEY,
    Manifest,
    Owner,
    admin_secret_name,
    image_pull_secrets,
    operator_image,
    peer_service_name,
    spark_claim,
    split_image,
)
from .spec import parse_spec

# spec.spark key -> the job of `stratamq spark` (also the label value and name part).
JOBS = {"gc": "gc", "learnTopics": "learn-topics", "export": "export"}
SPEC_KEY = {job: key for key, job in JOBS.items()}

# spec.spark.apiServer's default: the API server through cluster DNS.
DEFAULT_API_SERVER = "https://kubernetes.default.svc"
K8S_MASTER = f"k8s://{DEFAULT_API_SERVER}"
# Where images/spark/Dockerfile puts spark/main.py.
APPLICATION = "local:///opt/stratamq/spark-main.py"
SPARK_VERSION = "4.3.0"  # the Spark of images/spark/Dockerfile
TOKEN_ENV = "STRATAMQ_ADMIN_TOKEN"  # what `stratamq ctl` and the launch read
RUN_ENV = "STRATAMQ_SPARK_RUN"
# The Job's pod, which is the driver in client mode: its name and IP (downward API).
POD_NAME_ENV, POD_IP_ENV = "STRATAMQ_SPARK_POD", "STRATAMQ_SPARK_POD_IP"
# The driver's fixed ports (Spark's own in its driver pods), which the executors
# connect to.
DRIVER_PORT, BLOCK_MANAGER_PORT = 7078, 7079
# The executors' pod template (a ConfigMap, mounted in the Job's pod, where the
# driver reads it): the restricted security context and the pull secrets, which
# Spark 4.x has no `--conf` for (but allowPrivilegeEscalation).
POD_TEMPLATE_VOLUME = "executor-pod-template"
POD_TEMPLATE_MOUNT = "/etc/stratamq-spark"
POD_TEMPLATE_KEY = "executor-pod.yaml"
EXECUTOR_CONTAINER = "executor"
# The Job's and the executors' containers (with RESTRICTED_POD_SECURITY on the pod:
# Pod Security "restricted").
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False,
                                      "capabilities": {"drop": ["ALL"]}}
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# The ClusterRole of Spark drivers (the chart's, named by the chart in the operator's
# environment).
DRIVER_CLUSTER_ROLE = os.environ.get("STRATAMQ_OPERATOR_SPARK_DRIVER_ROLE", "stratamq-spark")

STORAGE_LABEL = SPARK_STORAGE_LABEL
JOB_LABEL = "stratamq.io/spark-job"
SPARK_OPERATOR_API = "sparkoperator.k8s.io/v1beta2"
# Made by the Spark operator on each SparkApplication of a ScheduledSparkApplication.
SCHEDULED_APP_LABEL = "sparkoperator.k8s.io/scheduled-app-name"
HISTORY = 3
# status.spark.<job> (the CRD's schema).
RUN_FIELDS = ("job", "startTime", "completionTime", "result", "message")
# A run that misses its time by more than this (operator or controller down) is
# skipped rather than started late.
STARTING_DEADLINE_SECONDS = 600
# spec.spark.<job>.activeDeadlineSeconds' default (the CRD's): the longest a run takes.
DEFAULT_DEADLINE_SECONDS = 7200


def name_of(owner_name: str, job: str) -> str:
    """The CronJob / ScheduledSparkApplication of one job."""
    return f"{owner_name}-spark-{job}"


def service_account_name(owner_name: str) -> str:
    return f"{owner_name}-spark"


def storage_labels(owner_name: str) -> dict[str, str]:
    """Not the sites' selector labels: a Spark pod is no site."""
    return {"app.kubernetes.io/name": "stratamq-spark", "app.kubernetes.io/instance": owner_name,
            "app.kubernetes.io/managed-by": MANAGED_BY, STORAGE_LABEL: owner_name}


def labels(owner_name: str, job: str) -> dict[str, str]:
    """On the scheduler object, its Jobs / SparkApplications and their pods."""
    return {**storage_labels(owner_name), "app.kubernetes.io/component": f"spark-{job}",
            JOB_LABEL: job}


def runs_selector(owner_name: str, job: str) -> str:
    """The Jobs (or SparkApplications) of one job of one storage."""
    return (f"app.kubernetes.io/managed-by={MANAGED_BY},{STORAGE_LABEL}={owner_name},"
            f"{JOB_LABEL}={job}")


def _metadata(owner: Owner, name: str, job: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace,
            "labels": labels(owner.name, job) if job else storage_labels(owner.name),
            "ownerReferences": [owner.reference()]}


def enabled_jobs(spec: dict[str, Any]) -> list[str]:
    """The jobs (`stratamq spark` names) whose spec enables them, in a fixed order."""
    spark = spec.get("spark", {})
    return [job for key, job in JOBS.items() if spark.get(key, {}).get("enable", False)]


def image(spec: dict[str, Any], default: str | None = None) -> str:
    """The Spark jobs' image: spec.spark.image's repository (stratamq/stratamq-spark
    by default) and tag (the operator image's by default: `default`, else
    `operator_image()`)."""
    _, tag = split_image(operator_image() if default is None else default)
    given = spec.get("spark", {}).get("image", {})
    return f"{given.get('repository', 'stratamq/stratamq-spark')}:{given.get('tag', tag)}"


def pull_policy(spec: dict[str, Any]) -> str:
    policy: str = spec.get("spark", {}).get("image", {}).get("pullPolicy", "IfNotPresent")
    return policy


def host_network(spec: dict[str, Any]) -> bool:
    """spec.spark.hostNetwork: the Job's pod (the driver) and the executors run in
    their node's network namespace."""
    return bool(spec.get("spark", {}).get("hostNetwork", False))


def api_server(spec: dict[str, Any]) -> str:
    """spec.spark.apiServer: where the driver reaches the API server (Spark's master,
    and the launch's reads of the sites' pods)."""
    address: str = spec.get("spark", {}).get("apiServer", DEFAULT_API_SERVER)
    return address


def sites_by_pod_ip(spec: dict[str, Any]) -> bool:
    """spec.spark.siteAddresses: PodIP: the driver reaches each site at its pod's IP,
    read from the API server when the run starts, instead of its DNS name."""
    addresses: str = spec.get("spark", {}).get("siteAddresses", "DNS")
    return addresses == "PodIP"


def site_urls(owner: Owner, spec: dict[str, Any]) -> list[str]:
    """Each site's admin API through the headless Service (one DNS name per pod):
    until replication is built every site holds its own data, so each is checkpointed
    and maintained."""
    parsed = parse_spec(spec)
    return [f"http://{owner.name}-{index}.{peer_service_name(owner.name)}."
            f"{owner.namespace}.svc:{parsed.admin_port}" for index in range(parsed.sites)]


def work_folder(owner: Owner, job: str) -> str:
    """Where a job's runs write on the shared volume: per storage, since storages of
    one namespace may share the claim (and their schedules the same minute)."""
    return f"{SPARK_WORK_MOUNT}/{owner.name}/{job}"


def launch_arguments(owner: Owner, spec: dict[str, Any], job: str) -> list[str]:
    """The arguments of `spark-main.py` (= `stratamq spark`): `launch JOB ...`, with the
    rules the job needs from the storage's config (so the driver needs no ConfigMap)."""
    if sites_by_pod_ip(spec):
        parsed = parse_spec(spec)
        sites = [*(part for index in range(parsed.sites)
                   for part in ("--site-pod", f"{owner.name}-{index}")),
                 "--admin-port", str(parsed.admin_port),
                 "--namespace", owner.namespace, "--api-server", api_server(spec)]
    else:
        sites = [part for url in site_urls(owner, spec) for part in ("--site", url)]
    arguments = ["launch", job, *sites, "--workdir", work_folder(owner, job)]
    if job == "gc":
        sessions = spec.get("durableSessions", {})
        arguments += ["--default", str(sessions.get("messageRetentionPeriod", "1d"))]
        for topic_filter, duration in sorted(sessions.get("retentionRules", {}).items()):
            arguments += ["--rule", f"{topic_filter}={duration}"]
    if job == "learn-topics":
        thresholds = spec.get("messages", {}).get("layout", {}).get("wildcardThresholds")
        if thresholds:
            arguments += ["--wildcard-thresholds", ",".join(str(n) for n in thresholds)]
    return arguments


# spec.spark.resources' defaults: Spark's own.
DEFAULT_CORES, DEFAULT_MEMORY = 1, "1g"
# Spark's memory overhead of a non-JVM (Python) driver on Kubernetes.
OVERHEAD_FACTOR, MIN_OVERHEAD_MIB = 0.4, 384
_MEBIBYTES = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def pod_resources(spec: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """spec.spark.resources: the driver's and each executor's (cores, memory), in
    Spark's units (memory as 512m, 2g)."""
    given = spec.get("spark", {}).get("resources", {})
    return {role: (int(given.get(role, {}).get("cores", DEFAULT_CORES)),
                   str(given.get(role, {}).get("memory", DEFAULT_MEMORY)))
            for role in ("driver", "executor")}


def _common_conf(owner: Owner, spec: dict[str, Any]) -> dict[str, str]:
    """Spark's configuration of a run on either path: the namespace, the executors'
    image, count and resources, and the shared volume on the executors."""
    conf = {
        "spark.kubernetes.namespace": owner.namespace,
        "spark.kubernetes.container.image": image(spec),
        "spark.kubernetes.container.image.pullPolicy": pull_policy(spec),
        "spark.executor.instances": str(spec.get("spark", {}).get("executors", 2)),
        **{f"spark.{role}.{key}": str(value)
           for role, (cores, memory) in pod_resources(spec).items()
           for key, value in (("cores", cores), ("memory", memory))},
    }
    claim = spark_claim(spec)
    if claim is not None:
        conf.update(_volume_conf("executor", claim))
    return conf


def _volume_conf(role: str, claim: str) -> dict[str, str]:
    prefix = f"spark.kubernetes.{role}.volumes.persistentVolumeClaim.{SPARK_WORK_VOLUME}"
    return {f"{prefix}.options.claimName": claim, f"{prefix}.mount.path": SPARK_WORK_MOUNT}


def spark_conf(owner: Owner, spec: dict[str, Any]) -> dict[str, str]:
    """Spark's configuration of a cluster-mode run (the Spark operator's path): the
    driver is a pod Spark makes, with the storage's account, the shared volume and
    the admin token."""
    conf = {
        **_common_conf(owner, spec),
        "spark.kubernetes.authenticate.driver.serviceAccountName":
            service_account_name(owner.name),
        f"spark.kubernetes.driver.secretKeyRef.{TOKEN_ENV}":
            f"{admin_secret_name(owner.name)}:{TOKEN_KEY}",
    }
    secrets = image_pull_secrets(spec)
    if secrets:  # the driver and executor pods pull the sites' image
        conf["spark.kubernetes.container.image.pullSecrets"] = ",".join(secrets)
    claim = spark_claim(spec)
    if claim is not None:
        conf.update(_volume_conf("driver", claim))
    return conf


def client_conf(owner: Owner, spec: dict[str, Any]) -> dict[str, str]:
    """Spark's configuration of a client-mode run (the CronJob's): the driver is the
    Job's own pod, named to Spark so that it makes the executors owned by that pod
    (they go when it goes, as when the Job is killed), and reached by the executors
    at its IP on fixed ports (on the host network Spark's own free ones: two drivers
    may share a node). The kubelet expands `$(...)` from the container's env."""
    conf = {
        **_common_conf(owner, spec),
        "spark.kubernetes.driver.pod.name": f"$({POD_NAME_ENV})",
        "spark.driver.host": f"$({POD_IP_ENV})",
        **({} if host_network(spec) else {
            "spark.driver.port": str(DRIVER_PORT),
            "spark.driver.blockManager.port": str(BLOCK_MANAGER_PORT)}),
        "spark.kubernetes.executor.podTemplateFile":
            f"{POD_TEMPLATE_MOUNT}/{POD_TEMPLATE_KEY}",
        "spark.kubernetes.executor.podTemplateContainerName": EXECUTOR_CONTAINER,
    }
    return conf


def pod_template_name(owner_name: str) -> str:
    """The ConfigMap of the executors' pod template."""
    return f"{owner_name}-spark-executor"


def executor_pod_template(spec: dict[str, Any]) -> Manifest:
    """What Spark starts each executor pod from (it adds the image, command, env,
    resources, volumes and labels): Pod Security "restricted", the sites' pull
    secrets, and no API token (an executor never calls the API server)."""
    secrets = image_pull_secrets(spec)
    return {"apiVersion": "v1", "kind": "Pod", "spec": {
        **host_network_fields(spec),
        "securityContext": RESTRICTED_POD_SECURITY,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        **({"imagePullSecrets": [{"name": name} for name in secrets]} if secrets else {}),
        "containers": [{"name": EXECUTOR_CONTAINER, "securityContext": CONTAINER_SECURITY}],
    }}


def host_network_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A Spark pod's fields for spec.spark.hostNetwork (cluster DNS still first)."""
    return ({"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
            if host_network(spec) else {})


def pod_template_config_map(owner: Owner, spec: dict[str, Any]) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(owner, pod_template_name(owner.name)),
            "data": {POD_TEMPLATE_KEY: yaml.safe_dump(executor_pod_template(spec),
                                                      sort_keys=False)}}


def submit_command(owner: Owner, spec: dict[str, Any], job: str) -> list[str]:
    """The CronJob's container: spark-submit in client mode (the driver runs in this
    container) against the cluster's own API server. `$(STRATAMQ_SPARK_RUN)` is
    expanded by the kubelet to the Job's name, the run's folder."""
    command = ["spark-submit", "--master", f"k8s://{api_server(spec)}", "--deploy-mode", "client",
               "--name", name_of(owner.name, job)]
    for key, value in client_conf(owner, spec).items():
        command += ["--conf", f"{key}={value}"]
    for key, value in labels(owner.name, job).items():
        command += ["--conf", f"spark.kubernetes.executor.label.{key}={value}"]
    return [*command, APPLICATION, *launch_arguments(owner, spec, job),
            "--run", f"$({RUN_ENV})"]


def job_command(owner: Owner, spec: dict[str, Any], job: str) -> list[str]:
    """spark-submit under `stratamq spark submit`, which fails the Job unless
    spark-submit (in client mode: the driver's exit code) exited 0 and the run's
    result file (written by the driver on the shared volume) says Succeeded."""
    result = f"{work_folder(owner, job)}/$({RUN_ENV})/result.json"
    return ["stratamq", "spark", "submit", "--result", result, "--",
            *submit_command(owner, spec, job)]


def driver_pod_memory(memory: str) -> str:
    """The Job pod's memory for a driver of `memory` (Spark's units): the heap and
    Spark's overhead for a Python application on Kubernetes (40 %, at least 384 MiB),
    as Spark would size a driver pod of its own."""
    mebibytes = math.ceil(int(memory[:-1]) * _MEBIBYTES[memory[-1]])
    return f"{mebibytes + max(MIN_OVERHEAD_MIB, math.ceil(OVERHEAD_FACTOR * mebibytes))}Mi"


def driver_container_resources(spec: dict[str, Any]) -> dict[str, Any]:
    cores, memory = pod_resources(spec)["driver"]
    size = driver_pod_memory(memory)
    return {"requests": {"cpu": str(cores), "memory": size}, "limits": {"memory": size}}


def driver_env(owner: Owner) -> list[dict[str, Any]]:
    """The Job container's env: the run's name, the pod's name and IP for Spark, and
    the admin token for the driver (`stratamq spark launch`)."""
    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
    return [field(RUN_ENV, f"metadata.labels['{JOB_NAME_LABEL}']"),
            field(POD_NAME_ENV, "metadata.name"), field(POD_IP_ENV, "status.podIP"),
            {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                "name": admin_secret_name(owner.name), "key": TOKEN_KEY}}}]


def cron_job(owner: Owner, spec: dict[str, Any], job: str) -> Manifest:
    key = SPEC_KEY[job]
    pod_labels = labels(owner.name, job)
    claim = spark_claim(spec)
    work_volume = ([{"name": SPARK_WORK_VOLUME, "persistentVolumeClaim": {"claimName": claim}}]
                   if claim else [])
    volumes = [*work_volume, {"name": POD_TEMPLATE_VOLUME,
                              "configMap": {"name": pod_template_name(owner.name)}}]
    return {
        "apiVersion": "batch/v1", "kind": "CronJob",
        "metadata": _metadata(owner, name_of(owner.name, job), job),
        "spec": {
            "schedule": spec["spark"][key].get("schedule", "0 3 * * *"),
            "timeZone": "Etc/UTC",  # the CRD's schedules are in UTC
            # One run at a time: two GC plans of one site would race.
            "concurrencyPolicy": "Forbid",
            "startingDeadlineSeconds": STARTING_DEADLINE_SECONDS,
            "successfulJobsHistoryLimit": HISTORY,
            "failedJobsHistoryLimit": HISTORY,
            "jobTemplate": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    # A failed run waits for the next schedule: its folder exists, a
                    # retry would take a new checkpoint anyway.
                    "backoffLimit": 0,
                    # With Forbid a hung run would hold back every later one; the
                    # driver is the Job's pod, so its executors go with it.
                    "activeDeadlineSeconds": int(spec["spark"][key].get(
                        "activeDeadlineSeconds", DEFAULT_DEADLINE_SECONDS)),
                    "template": {
                        "metadata": {"labels": pod_labels},
                        "spec": {
                            "serviceAccountName": service_account_name(owner.name),
                            # the sites' image: from the same registry
                            **({"imagePullSecrets": [{"name": name} for name
                                                     in image_pull_secrets(spec)]}
                               if image_pull_secrets(spec) else {}),
                            "restartPolicy": "Never",
                            "enableServiceLinks": False,
                            **host_network_fields(spec),
                            "securityContext": RESTRICTED_POD_SECURITY,
                            "containers": [{
                                "name": "spark-submit",
                                "image": image(spec),
                                "imagePullPolicy": pull_policy(spec),
                                "command": job_command(owner, spec, job),
                                "env": driver_env(owner),
                                # (on the host network a port would be a host port)
                                **({} if host_network(spec) else {"ports": [
                                    {"name": "driver", "containerPort": DRIVER_PORT},
                                    {"name": "block-manager",
                                     "containerPort": BLOCK_MANAGER_PORT}]}),
                                # the driver writes the run's results there
                                "volumeMounts": [
                                    *({"name": SPARK_WORK_VOLUME,
                                       "mountPath": SPARK_WORK_MOUNT} for _ in work_volume),
                                    {"name": POD_TEMPLATE_VOLUME,
                                     "mountPath": POD_TEMPLATE_MOUNT, "readOnly": True}],
                                # the end of the log, where `stratamq spark submit`
                                # says why
                                "terminationMessagePolicy": "FallbackToLogsOnError",
                                "resources": driver_container_resources(spec),
                                "securityContext": CONTAINER_SECURITY,
                            }],
                            "volumes": volumes,
                        },
                    },
                },
            },
        },
    }


def scheduled_spark_application(owner: Owner, spec: dict[str, Any], job: str) -> Manifest:
    """For the Spark operator: the same application, run on the same schedule; the
    Spark operator copies these labels onto each SparkApplication it makes."""
    key = SPEC_KEY[job]
    pod_labels = labels(owner.name, job)
    conf = spark_conf(owner, spec)
    executors = int(conf.pop("spark.executor.instances"))
    # the SparkApplication's own fields say these
    resources = pod_resources(spec)
    (driver_cores, driver_memory), (executor_cores, executor_memory) = (
        resources["driver"], resources["executor"])
    for role in ("driver", "executor"):
        for setting in ("cores", "memory"):
            conf.pop(f"spark.{role}.{setting}")
    return {
        "apiVersion": SPARK_OPERATOR_API, "kind": "ScheduledSparkApplication",
        "metadata": _metadata(owner, name_of(owner.name, job), job),
        "spec": {
            "schedule": spec["spark"][key].get("schedule", "0 3 * * *"),
            # (the Spark operator's field since v2.1; an older one prunes it and uses
            # its own local time)
            "timeZone": "Etc/UTC",
            "concurrencyPolicy": "Forbid",
            "successfulRunHistoryLimit": HISTORY,
            "failedRunHistoryLimit": HISTORY,
            "template": {
                "type": "Python",
                "mode": "cluster",
                "sparkVersion": SPARK_VERSION,
                "image": image(spec),
                "imagePullPolicy": pull_policy(spec),
                **({"imagePullSecrets": image_pull_secrets(spec)}
                   if image_pull_secrets(spec) else {}),
                "mainApplicationFile": APPLICATION,
                "arguments": launch_arguments(owner, spec, job),
                "sparkConf": conf,
                "restartPolicy": {"type": "Never"},
                "driver": {"serviceAccount": service_account_name(owner.name),
                           "cores": driver_cores, "memory": driver_memory,
                           "labels": pod_labels,
                           **({"hostNetwork": True} if host_network(spec) else {})},
                "executor": {"instances": executors, "cores": executor_cores,
                             "memory": executor_memory, "labels": pod_labels,
                             **({"hostNetwork": True} if host_network(spec) else {})},
            },
        },
    }


def service_account(owner: Owner) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _metadata(owner, service_account_name(owner.name))}


def role_binding(owner: Owner) -> Manifest:
    """The driver's rights (executor pods, their Service and ConfigMap) in the storage's
    namespace only, from the chart's ClusterRole."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _metadata(owner, service_account_name(owner.name)),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": DRIVER_CLUSTER_ROLE},
            "subjects": [{"kind": "ServiceAccount", "name": service_account_name(owner.name),
                          "namespace": owner.namespace}]}


def spark_objects(owner: Owner, spec: dict[str, Any], *,
                  spark_operator: bool) -> list[Manifest]:
    """What the enabled jobs need, in the order to apply; empty when none is enabled."""
    jobs = enabled_jobs(spec)
    if not jobs:
        return []
    if spark_operator:
        return [service_account(owner), role_binding(owner),
                *(scheduled_spark_application(owner, spec, job) for job in jobs)]
    return [service_account(owner), role_binding(owner), pod_template_config_map(owner, spec),
            *(cron_job(owner, spec, job) for job in jobs)]


# --- the last run ------------------------------------------------------------------------

def job_run(job: dict[str, Any]) -> dict[str, Any]:
    """A Kubernetes Job as `status.spark.<job>`: its name, times and outcome (Running
    until a Complete or Failed condition says otherwise; Failed with its reason)."""
    status = job.get("status") or {}
    run: dict[str, Any] = {"job": job["metadata"]["name"], "result": "Running"}
    if status.get("startTime"):
        run["startTime"] = status["startTime"]
    for condition in status.get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            run["result"] = "Succeeded"
            run["completionTime"] = status.get("completionTime",
                                               condition.get("lastTransitionTime"))
        elif condition.get("type") == "Failed":
            run["result"] = "Failed"
            run["completionTime"] = condition.get("lastTransitionTime")
            reason = condition.get("reason", "")
            message = condition.get("message", "")
            run["message"] = f"{reason}: {message}" if message else reason
    return run


def pod_failure(pods: list[dict[str, Any]]) -> str | None:
    """Why a failed run's pod ended: the last line of its container's termination
    message (`FallbackToLogsOnError`: the end of its log, where `stratamq spark
    submit` says why), or None."""
    for pod in sorted(pods, key=lambda pod: pod["metadata"].get("creationTimestamp", ""),
                      reverse=True):
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            message = ((container.get("state") or {}).get("terminated") or {}).get("message")
            lines = [line for line in (message or "").splitlines() if line.strip()]
            if lines:
                return lines[-1].strip()
    return None


def with_pod_failure(run: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """A failed Job's run with its pod's reason added to the Job's own."""
    why = pod_failure(pods) if run["result"] == "Failed" else None
    return {**run, "message": f"{run['message']}; {why}"} if why else run


# SparkApplication states (the Spark operator's) that end a run.
_SPARK_DONE = {"COMPLETED": "Succeeded", "FAILED": "Failed", "SUBMISSION_FAILED": "Failed",
               "FAILING": "Failed"}


def spark_application_run(application: dict[str, Any]) -> dict[str, Any]:
    """A SparkApplication as `status.spark.<job>`."""
    status = application.get("status") or {}
    state = (status.get("applicationState") or {})
    run: dict[str, Any] = {"job": application["metadata"]["name"],
                           "result": _SPARK_DONE.get(state.get("state", ""), "Running")}
    started = status.get("lastSubmissionAttemptTime")
    if started:
        run["startTime"] = started
    if run["result"] != "Running":
        if status.get("terminationTime"):
            run["completionTime"] = status["terminationTime"]
        if run["result"] == "Failed":
            run["message"] = f"{state.get('state')}: {state.get('errorMessage', '')}"
    return run


def last_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest of one job's Jobs (or SparkApplications), by creation time then name
    (a CronJob's Job names grow with their scheduled time)."""
    if not runs:
        return None
    return max(runs, key=lambda run: (run["metadata"].get("creationTimestamp", ""),
                                      run["metadata"]["name"]))


def replaces(newest: dict[str, Any], recorded: dict[str, Any] | None) -> bool:
    """Whether the newest run that exists is reported over the recorded one: it is
    that run, or it was made after that run started. (When the recorded run's Job is
    deleted with its CronJob, an older one still being collected is no newer run.)"""
    if not recorded or recorded.get("job") == newest["metadata"]["name"]:
        return True
    started = recorded.get("startTime")
    return not started or newest["metadata"].get("creationTimestamp", "") >= started


def status_patch(run: dict[str, Any]) -> dict[str, Any]:
    """A run as a merge patch of `status.spark.<job>`: the fields it lacks are nulled,
    so nothing of the run before stays (a new run has no completionTime yet)."""
    return {field: run.get(field) for field in RUN_FIELDS}
