"""The Spark jobs' objects and last-run status (stratamq.operator.spark): pure parts.
The same objects against the real API server: tests/kube/test_operator_spark.py."""

from __future__ import annotations

from typing import Any

import yaml

from harness.processes import REPO
from stratamq.operator import resources, spark
from stratamq.operator.config import broker_config
from stratamq.operator.resources import Owner
from tests.unit.test_operator_resources import crd_defaults

OWNER = Owner(name="mq", namespace="brokers", uid="1234-uid")


def with_spark(**jobs: dict[str, Any]) -> dict[str, Any]:
    spec = crd_defaults()
    spec["spark"] = {**spec["spark"], "volume": {"claimName": "shared"}}
    for key, given in jobs.items():
        spec["spark"][key] = {**spec["spark"][key], **given}
    return spec


def test_nothing_is_made_by_default() -> None:
    spec = crd_defaults()
    assert spark.spark_objects(OWNER, spec, spark_operator=False) == []
    assert spark.spark_objects(OWNER, spec, spark_operator=True) == []
    assert resources.spark_claim(spec) is None
    volumes = resources.stateful_set(OWNER, spec)["spec"]["template"]["spec"]["volumes"]
    assert all("persistentVolumeClaim" not in volume for volume in volumes)


def test_each_enabled_job_gets_its_scheduler() -> None:
    spec = with_spark(gc={"enable": True}, export={"enable": True, "schedule": "@hourly"})
    made = spark.spark_objects(OWNER, spec, spark_operator=False)
    assert [(m["kind"], m["metadata"]["name"]) for m in made] == [
        ("ServiceAccount", "mq-spark"), ("RoleBinding", "mq-spark"),
        ("ConfigMap", "mq-spark-executor"),
        ("CronJob", "mq-spark-gc"), ("CronJob", "mq-spark-export")]
    assert [m["spec"]["schedule"] for m in made[3:]] == ["0 3 * * *", "@hourly"]
    # (the executors' pod template is the CronJobs' alone)
    scheduled = spark.spark_objects(OWNER, spec, spark_operator=True)
    assert [m["kind"] for m in scheduled[2:]] == ["ScheduledSparkApplication"] * 2
    # No Spark pod carries the sites' selector (it would count as a site).
    site_selector = resources.selector_labels("mq").items()
    for manifest in made[3:]:
        template = manifest["spec"]["jobTemplate"]["spec"]["template"]
        assert not site_selector <= template["metadata"]["labels"].items()


def test_the_jobs_pull_the_image_with_the_sites_pull_secrets() -> None:
    spec = with_spark(gc={"enable": True})
    spec["pod"] = {"imagePullSecrets": [{"name": "registry"}, {"name": "mirror"}]}
    cron = spark.spark_objects(OWNER, spec, spark_operator=False)[-1]
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}, {"name": "mirror"}]
    # the executor pods (their pod template), and on the Spark operator's path the
    # driver and executor pods spark-submit makes
    assert spark.executor_pod_template(spec)["spec"]["imagePullSecrets"] == [
        {"name": "registry"}, {"name": "mirror"}]
    assert "spark.kubernetes.container.image.pullSecrets" not in spark.client_conf(OWNER, spec)
    assert spark.spark_conf(OWNER, spec)["spark.kubernetes.container.image.pullSecrets"] \
        == "registry,mirror"
    scheduled = spark.spark_objects(OWNER, spec, spark_operator=True)[-1]
    assert scheduled["spec"]["template"]["imagePullSecrets"] == ["registry", "mirror"]
    plain = spark.spark_objects(OWNER, with_spark(gc={"enable": True}), spark_operator=False)
    assert "imagePullSecrets" not in plain[-1]["spec"]["jobTemplate"]["spec"]["template"][
        "spec"]


def job_container(spec: dict[str, Any], job: str = "gc") -> dict[str, Any]:
    pod = spark.cron_job(OWNER, spec, job)["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return dict(container)


def conf_of(command: list[str]) -> dict[str, str]:
    return dict(command[i + 1].split("=", 1) for i, part in enumerate(command)
                if part == "--conf")


def test_the_driver_runs_in_the_jobs_pod() -> None:
    """Client mode: the Job's pod is the driver, named to Spark (its executors are then
    owned by it and go with it) and reached at its IP on fixed ports."""
    container = job_container(with_spark(gc={"enable": True}))
    command = container["command"]
    assert command[command.index("--deploy-mode") + 1] == "client"
    conf = conf_of(command)
    env = {variable["name"]: variable["valueFrom"] for variable in container["env"]}
    assert conf["spark.kubernetes.driver.pod.name"] == "$(STRATAMQ_SPARK_POD)"
    assert env["STRATAMQ_SPARK_POD"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert conf["spark.driver.host"] == "$(STRATAMQ_SPARK_POD_IP)"
    assert env["STRATAMQ_SPARK_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    ports = {port["containerPort"] for port in container["ports"]}
    assert {int(conf["spark.driver.port"]), int(conf["spark.driver.blockManager.port"])} == ports
    # The kubelet expands only the container's own env: every $(...) must be one.
    for part in command:
        for name in part.split("$(")[1:]:
            assert name.split(")")[0] in env, part
    # The driver's token and volume are the container's own; the cluster-mode settings
    # of a driver pod Spark would make are gone.
    assert env["STRATAMQ_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "mq-admin", "key": "token"}}
    assert {"name": "spark-work", "mountPath": "/var/lib/stratamq-spark"} in (
        container["volumeMounts"])
    assert not [key for key in conf if key.startswith("spark.kubernetes.driver.")
                and key != "spark.kubernetes.driver.pod.name"]
    assert "spark.kubernetes.authenticate.driver.serviceAccountName" not in conf
    prefix = "spark.kubernetes.executor.volumes.persistentVolumeClaim.spark-work"
    assert conf[f"{prefix}.options.claimName"] == "shared"
    assert conf[f"spark.kubernetes.executor.label.{spark.JOB_LABEL}"] == "gc"
    # The Spark operator's path keeps cluster mode and its driver pod.
    application = spark.scheduled_spark_application(OWNER, with_spark(gc={"enable": True}),
                                                     "gc")["spec"]["template"]
    assert application["mode"] == "cluster"
    assert application["sparkConf"][
        "spark.kubernetes.driver.secretKeyRef.STRATAMQ_ADMIN_TOKEN"] == "mq-admin:token"


def test_the_jobs_pod_is_sized_for_the_driver() -> None:
    """Spark's own sizing of a Python driver pod: the heap and 40 % (at least 384 MiB)."""
    assert job_container(with_spark())["resources"] == {
        "requests": {"cpu": "1", "memory": "1434Mi"}, "limits": {"memory": "1434Mi"}}
    spec = with_spark()
    spec["spark"]["resources"] = {"driver": {"cores": 2, "memory": "512m"}}
    assert job_container(spec)["resources"]["requests"] == {"cpu": "2", "memory": "896Mi"}
    assert spark.driver_pod_memory("2g") == "2868Mi"
    assert spark.driver_pod_memory("1048576k") == "1434Mi"


def test_a_run_has_a_deadline() -> None:
    """2 h unless the job says otherwise; one run at a time stays."""
    spec = with_spark(gc={"enable": True}, export={"enable": True,
                                                   "activeDeadlineSeconds": 600})
    gc, export = (spark.cron_job(OWNER, spec, job) for job in ("gc", "export"))
    assert gc["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"] == 7200
    assert export["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"] == 600
    assert gc["spec"]["concurrencyPolicy"] == "Forbid"


def test_executors_start_from_a_restricted_pod_template() -> None:
    """A ConfigMap owned by the storage, mounted in the Job's pod where the driver reads
    it as spark.kubernetes.executor.podTemplateFile."""
    spec = with_spark(gc={"enable": True})
    [config_map] = [made for made in spark.spark_objects(OWNER, spec, spark_operator=False)
                    if made["kind"] == "ConfigMap"]
    assert config_map["metadata"]["ownerReferences"] == [OWNER.reference()]
    template = yaml.safe_load(config_map["data"]["executor-pod.yaml"])
    assert template == spark.executor_pod_template(spec)
    pod = template["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001,
                                      "runAsGroup": 10001,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["automountServiceAccountToken"] is False
    assert "imagePullSecrets" not in pod
    [container] = pod["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}
    job_pod = spark.cron_job(OWNER, spec, "gc")["spec"]["jobTemplate"]["spec"]["template"][
        "spec"]
    [volume] = [volume for volume in job_pod["volumes"] if "configMap" in volume]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    [mount] = [mount for mount in job_pod["containers"][0]["volumeMounts"]
               if mount["name"] == volume["name"]]
    conf = conf_of(job_pod["containers"][0]["command"])
    assert conf["spark.kubernetes.executor.podTemplateFile"] == (
        f"{mount['mountPath']}/executor-pod.yaml")
    assert conf["spark.kubernetes.executor.podTemplateContainerName"] == container["name"]


def test_launch_arguments_carry_the_storages_rules() -> None:
    spec = with_spark()
    spec["sites"] = 3
    spec["durableSessions"]["messageRetentionPeriod"] = "2d"
    spec["durableSessions"]["retentionRules"] = {"b/#": "7d", "a/+": "1h"}
    spec["messages"]["layout"]["wildcardThresholds"] = [20, 4]
    gc = spark.launch_arguments(OWNER, spec, "gc")
    assert gc[:2] == ["launch", "gc"]
    assert gc.count("--site") == 3
    assert gc[gc.index("--default") + 1] == "2d"
    assert [gc[i + 1] for i, part in enumerate(gc) if part == "--rule"] == ["a/+=1h", "b/#=7d"]
    learn = spark.launch_arguments(OWNER, spec, "learn-topics")
    assert learn[learn.index("--wildcard-thresholds") + 1] == "20,4"
    assert "--rule" not in learn


def test_spark_pods_on_the_host_network_without_cluster_dns() -> None:
    """spec.spark.hostNetwork, apiServer and siteAddresses: the Job's pod and the
    executors on their node's network with Spark's own free ports (two drivers may share
    a node), Spark's master at the given address, and the sites by their pods (the
    launch reads their IPs from the same address)."""
    spec = with_spark(gc={"enable": True})
    spec["sites"] = 2
    default_pod = spark.cron_job(OWNER, spec, "gc")["spec"]["jobTemplate"]["spec"][
        "template"]["spec"]
    assert "hostNetwork" not in default_pod
    assert spark.launch_arguments(OWNER, spec, "gc").count("--site") == 2
    assert "--site-pod" not in spark.launch_arguments(OWNER, spec, "gc")

    spec["spark"].update(hostNetwork=True, apiServer="https://127.0.0.1:6443",
                         siteAddresses="PodIP")
    pod = spark.cron_job(OWNER, spec, "gc")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    [container] = pod["containers"]
    assert "ports" not in container  # on the host network: host ports
    command = container["command"]
    assert command[command.index("--master") + 1] == "k8s://https://127.0.0.1:6443"
    conf = conf_of(command)
    assert "spark.driver.port" not in conf and "spark.driver.blockManager.port" not in conf
    template = spark.executor_pod_template(spec)["spec"]
    assert (template["hostNetwork"], template["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    launch = spark.launch_arguments(OWNER, spec, "gc")
    assert "--site" not in launch
    assert [launch[i + 1] for i, part in enumerate(launch) if part == "--site-pod"] == [
        "mq-0", "mq-1"]
    assert launch[launch.index("--admin-port") + 1] == "18083"
    assert launch[launch.index("--namespace") + 1] == "brokers"
    assert launch[launch.index("--api-server") + 1] == "https://127.0.0.1:6443"
    application = spark.scheduled_spark_application(OWNER, spec, "gc")["spec"]["template"]
    assert application["driver"]["hostNetwork"] and application["executor"]["hostNetwork"]
    assert "--site-pod" in application["arguments"]


def test_the_sites_mount_the_shared_volume() -> None:
    pod = resources.stateful_set(OWNER, with_spark())["spec"]["template"]["spec"]
    assert {"name": "spark-work", "persistentVolumeClaim": {"claimName": "shared"}} in (
        pod["volumes"])
    assert {"name": "spark-work", "mountPath": "/var/lib/stratamq-spark"} in (
        pod["containers"][0]["volumeMounts"])
    # and their admin API may make the jobs' checkpoints there (only there, besides
    # their own checkpoints folder)
    assert broker_config(with_spark())["admin"]["checkpoint_dirs"] == [
        "/var/lib/stratamq-spark"]
    assert "checkpoint_dirs" not in broker_config(crd_defaults())["admin"]


def job(name: str, created: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created}, "status": status}


def test_job_runs() -> None:
    assert spark.job_run(job("j", "", {})) == {"job": "j", "result": "Running"}
    complete = spark.job_run(job("j", "", {
        "startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:02:00Z",
        "conditions": [{"type": "SuccessCriteriaMet", "status": "True"},
                       {"type": "Complete", "status": "True"}]}))
    assert complete == {"job": "j", "result": "Succeeded", "startTime": "2026-01-01T00:00:00Z",
                        "completionTime": "2026-01-01T00:02:00Z"}
    failed = spark.job_run(job("j", "", {
        "startTime": "2026-01-01T00:00:00Z",
        "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                        "lastTransitionTime": "2026-01-01T00:03:00Z"}]}))
    assert failed["result"] == "Failed"
    assert failed["completionTime"] == "2026-01-01T00:03:00Z"
    assert failed["message"] == ("BackoffLimitExceeded: Job has reached the specified "
                                 "backoff limit")
    # A condition that is not True yet decides nothing.
    assert spark.job_run(job("j", "", {"conditions": [
        {"type": "Failed", "status": "False"}]}))["result"] == "Running"


def test_a_failed_jobs_message_says_why_its_pod_failed() -> None:
    def pod(created: str, message: str | None) -> dict[str, Any]:
        terminated = {"exitCode": 1, **({"message": message} if message is not None else {})}
        return {"metadata": {"creationTimestamp": created},
                "status": {"containerStatuses": [{"state": {"terminated": terminated}}]}}
    run = {"job": "j", "result": "Failed", "message": "BackoffLimitExceeded"}
    pods = [pod("2026-01-01T00:00:00Z", "old\nolder reason"),
            pod("2026-01-01T00:01:00Z", "log\nthe run failed: 409\n\n")]
    assert spark.with_pod_failure(run, pods)["message"] == (
        "BackoffLimitExceeded; the run failed: 409")
    assert spark.with_pod_failure(run, [pod("2026-01-01T00:00:00Z", None)]) == run
    assert spark.with_pod_failure(run, []) == run
    succeeded = {"job": "j", "result": "Succeeded"}
    assert spark.with_pod_failure(succeeded, pods) == succeeded


def test_spark_application_runs() -> None:
    def application(state: dict[str, Any], **times: str) -> dict[str, Any]:
        return {"metadata": {"name": "a"}, "status": {"applicationState": state, **times}}
    assert spark.spark_application_run({"metadata": {"name": "a"}}) == {
        "job": "a", "result": "Running"}
    assert spark.spark_application_run(application(
        {"state": "COMPLETED"}, lastSubmissionAttemptTime="t0", terminationTime="t1")) == {
        "job": "a", "result": "Succeeded", "startTime": "t0", "completionTime": "t1"}
    failed = spark.spark_application_run(application(
        {"state": "SUBMISSION_FAILED", "errorMessage": "no image"}))
    assert (failed["result"], failed["message"]) == ("Failed", "SUBMISSION_FAILED: no image")


def test_the_last_run_is_the_newest_and_replaces_the_one_before() -> None:
    runs = [job("mq-spark-gc-29000001", "2026-01-01T00:01:00Z", {}),
            job("mq-spark-gc-29000003", "2026-01-01T00:03:00Z", {}),
            job("mq-spark-gc-29000002", "2026-01-01T00:02:00Z", {})]
    newest = spark.last_run(runs)
    assert newest is not None and newest["metadata"]["name"] == "mq-spark-gc-29000003"
    assert spark.last_run([]) is None
    # Once the recorded run's Job is gone (its CronJob deleted), an older one still
    # being collected does not come back as the last run; a newer one does.
    recorded = {"job": "mq-spark-gc-29000003", "startTime": "2026-01-01T00:03:01Z"}
    assert spark.replaces(newest, recorded)
    assert not spark.replaces(runs[2], recorded)
    assert spark.replaces(job("manual", "2026-01-01T00:04:00Z", {}), recorded)
    assert spark.replaces(runs[0], None)
    # A merge patch: what the new run lacks is nulled, so nothing of the last stays.
    assert spark.status_patch({"job": "j", "result": "Running"}) == {
        "job": "j", "result": "Running", "startTime": None, "completionTime": None,
        "message": None}


def test_the_application_is_where_the_spark_image_puts_it() -> None:
    dockerfile = (REPO / "images" / "spark" / "Dockerfile").read_text()
    [destination] = [line.split()[2] for line in dockerfile.splitlines()
                     if line.startswith("COPY spark/main.py ")]
    assert f"local://{destination}" == spark.APPLICATION


def test_the_driver_and_executors_get_the_resources_asked_for() -> None:
    spec = with_spark()
    conf = spark.spark_conf(OWNER, spec)
    assert (conf["spark.driver.cores"], conf["spark.driver.memory"]) == ("1", "1g")
    assert (conf["spark.executor.cores"], conf["spark.executor.memory"]) == ("1", "1g")
    spec["spark"]["resources"] = {"driver": {"memory": "2g"},
                                  "executor": {"cores": 4, "memory": "8g"}}
    command = spark.submit_command(OWNER, spec, "gc")
    for setting in ("spark.driver.cores=1", "spark.driver.memory=2g",
                    "spark.executor.cores=4", "spark.executor.memory=8g"):
        assert command[command.index(setting) - 1] == "--conf", setting
    application = spark.scheduled_spark_application(OWNER, spec, "gc")["spec"]["template"]
    assert (application["driver"]["cores"], application["driver"]["memory"]) == (1, "2g")
    assert (application["executor"]["cores"], application["executor"]["memory"]) == (4, "8g")
    assert not any(key.startswith(("spark.driver.", "spark.executor."))
                   for key in application["sparkConf"])
