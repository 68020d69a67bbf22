"""The objects the operator makes of a DurableStorage spec (stratamq.operator.resources):
every spec field that matters lands where it should, and the rendered broker config
is one the broker itself accepts."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml

from harness.processes import REPO
from stratamq.broker.config import Config, load_config
from stratamq.operator import config as operator_config
from stratamq.operator import resources, spark
from stratamq.operator.resources import Owner
from tests.unit.test_crd_schema import spec_schema

OWNER = Owner(name="mq", namespace="brokers", uid="1234-uid")


def crd_defaults() -> dict[str, Any]:
    """A spec as the API server stores an empty one: the CRD's defaults, camelCase."""
    def camel_defaults(schema: dict[str, Any]) -> Any:
        if "properties" in schema and schema.get("type") == "object":
            return {key: camel_defaults(child) for key, child in schema["properties"].items()
                    if "default" in child}
        return schema["default"]
    return {key: camel_defaults(child) for key, child in spec_schema()["properties"].items()
            if "default" in child}


def container(spec: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = resources.stateful_set(OWNER, spec)["spec"]["template"]["spec"][
        "containers"][0]
    return found


def test_snake_case() -> None:
    assert operator_config.snake("maxInflight") == "max_inflight"
    assert operator_config.snake_keys({"localWriteBuffer": {"maxItems": 3},
                                       "wildcardThresholds": [1, 2]}) == {
        "local_write_buffer": {"max_items": 3}, "wildcard_thresholds": [1, 2]}


def test_defaults_render_a_config_the_broker_accepts() -> None:
    """The config made from the CRD's defaults parses as the broker's Config and means
    the broker's defaults, apart from what the operator sets on purpose."""
    spec = crd_defaults()
    data = yaml.safe_load(resources.config_map(OWNER, spec)["data"]["stratamq.yaml"])
    config = Config.model_validate(data)
    built_in = Config()
    assert config.durable_storage.messages.data_dir == "var/lib/stratamq/data"
    assert config.durable_storage.messages.model_copy(update={"data_dir": "data"}) == (
        built_in.durable_storage.messages)
    assert config.durable_sessions == built_in.durable_sessions
    assert config.mqtt == built_in.mqtt
    assert config.access_control == built_in.access_control
    assert config.listeners == built_in.listeners
    assert config.admin.bind == "0.0.0.0:18083"
    assert config.admin.token is None  # it comes from the Secret through the environment
    assert config.cluster.model_copy(update={"enable": False, "peer_bind": "0.0.0.0:18084"}
                                     ) == built_in.cluster


def test_spec_fields_land_in_the_config() -> None:
    spec = crd_defaults()
    spec["messages"] |= {"nShards": 8, "replicationFactor": 1, "syncWrites": True,
                         "localWriteBuffer": {"maxItems": 50, "flushInterval": "5ms",
                                              "maxBytes": "1MiB"}}
    spec["mqtt"] |= {"maxInflight": 7, "connectTimeout": "3s"}
    spec["durableSessions"] |= {"messageRetentionPeriod": "2h"}
    spec["listeners"] = {"backlog": 64, "tcp": {"enable": True, "port": 1884},
                         "ws": {"enable": False, "port": 8084, "path": "/ws"},
                         "tls": {"enable": True, "port": 8884, "secretName": "certs",
                                 "verifyPeer": True}}
    spec["accessControl"] = {"allowAnonymous": False, "aclNoMatch": "deny",
                             "passwordSecret": {"name": "users", "key": "passwd"},
                             "aclSecret": {"name": "rules", "key": "acl.yaml"}}
    spec["admin"] = {"port": 9000}
    spec["cluster"] = {"writeTimeout": "2s", "logRetainEntries": 50}
    config = Config.model_validate(yaml.safe_load(resources.rendered_config(spec)))
    messages = config.durable_storage.messages
    assert (messages.n_shards, messages.sync_writes) == (8, True)
    assert messages.local_write_buffer.max_items == 50
    assert messages.local_write_buffer.flush_interval == 0.005
    assert messages.local_write_buffer.max_bytes == 1024 * 1024
    assert (config.mqtt.max_inflight, config.mqtt.connect_timeout) == (7, 3.0)
    assert config.durable_sessions.message_retention_period == 7200.0
    assert config.listeners.backlog == 64
    assert config.listeners.tcp.bind == "0.0.0.0:1884"
    assert (config.listeners.ws.enable, config.listeners.ws.path) == (False, "/ws")
    tls = config.listeners.tls
    assert (tls.enable, tls.bind, tls.verify_peer) == (True, "0.0.0.0:8884", True)
    assert (tls.certfile, tls.keyfile, tls.cafile) == (
        "etc/stratamq-tls/tls.crt", "etc/stratamq-tls/tls.key", "etc/stratamq-tls/ca.crt")
    access = config.access_control
    assert (access.allow_anonymous, access.acl_no_match) == (False, "deny")
    assert access.password_file == "etc/stratamq-passwd/passwd"
    assert access.acl_file == "etc/stratamq-acl/acl.yaml"
    assert config.admin.bind == "0.0.0.0:9000"
    cluster = config.cluster
    assert (cluster.write_timeout, cluster.log_retain_entries) == (2.0, 50)
    assert (cluster.enable, cluster.peer_bind) == (True, "0.0.0.0:18084")

    # The same spec in the pod: ports, probes and the Secrets' volumes.
    found = container(spec)
    assert {port["name"]: port["containerPort"] for port in found["ports"]} == {
        "mqtt": 1884, "mqtts": 8884, "admin": 9000, "peer": 18084}
    # Replication is on: the peer port bound on the pod, advertised at the Pod IP.
    assert (config.cluster.enable, config.cluster.peer_bind) == (True, "0.0.0.0:18084")
    assert found["env"][1:] == [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "STRATAMQ__CLUSTER__ADVERTISE", "value": "$(POD_IP):18084"}]
    mounts = {mount["name"]: mount["mountPath"] for mount in found["volumeMounts"]}
    assert mounts == {"config": "/etc/stratamq", "data": "/var/lib/stratamq",
                      "tls": "/etc/stratamq-tls", "passwd": "/etc/stratamq-passwd",
                      "acl": "/etc/stratamq-acl"}
    pod = resources.stateful_set(OWNER, spec)["spec"]["template"]["spec"]
    assert {volume["name"]: volume.get("secret", {}).get("secretName")
            for volume in pod["volumes"]} == {
        "config": None, "tls": "certs", "passwd": "users", "acl": "rules"}
    service = resources.client_service(OWNER, spec)
    assert [(port["name"], port["port"]) for port in service["spec"]["ports"]] == [
        ("mqtt", 1884), ("mqtts", 8884)]
    assert [(port["name"], port["port"]) for port in resources.peer_service(
        OWNER, spec)["spec"]["ports"]] == [("admin", 9000), ("peer", 18084)]


def test_stateful_set() -> None:
    spec = crd_defaults() | {
        "sites": 5, "image": {"repository": "registry.example/mq", "tag": "1.2",
                              "pullPolicy": "Always"},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        "storage": {"size": "20Gi", "storageClassName": "fast"}}
    made = resources.stateful_set(OWNER, spec)
    assert made["metadata"]["name"] == "mq"
    assert made["metadata"]["namespace"] == "brokers"
    assert made["metadata"]["ownerReferences"] == [{
        "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage", "name": "mq",
        "uid": "1234-uid", "controller": True, "blockOwnerDeletion": True}]
    assert made["spec"]["replicas"] == 5
    assert made["spec"]["serviceName"] == "mq-peers"
    assert made["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "stratamq", "app.kubernetes.io/instance": "mq"}
    template = made["spec"]["template"]
    assert template["metadata"]["labels"].items() >= made["spec"]["selector"][
        "matchLabels"].items()
    found = container(spec)
    assert found["image"] == "registry.example/mq:1.2"
    assert found["imagePullPolicy"] == "Always"
    assert found["command"] == ["stratamq", "broker", "--config", "etc/stratamq/stratamq.yaml"]
    assert found["workingDir"] == "/"
    assert found["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
    assert found["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert found["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert found["env"][:1] == [{"name": "STRATAMQ__ADMIN__TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "mq-admin", "key": "token"}}}]
    assert template["spec"]["volumes"][0] == {
        "name": "config", "configMap": {"name": resources.config_map_name("mq", spec)}}
    [claim] = made["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    # More pods than spec.sites while departing ones hold replicas (the operator says).
    assert resources.stateful_set(OWNER, spec, replicas=7)["spec"]["replicas"] == 7
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    # Without a class the cluster's default applies.
    assert "storageClassName" not in resources.stateful_set(OWNER, crd_defaults())["spec"][
        "volumeClaimTemplates"][0]["spec"]


def pod_spec(spec: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = resources.stateful_set(OWNER, spec)["spec"]["template"]["spec"]
    return found


def test_pods_by_default_ask_for_resources_and_spread_over_nodes_and_zones() -> None:
    """issue 23: BestEffort pods are evicted first; nothing kept a shard's replicas off
    one node; the kubelet walked the whole volume at every mount."""
    spec = crd_defaults()
    assert container(spec)["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"}}
    made = pod_spec(spec)
    sites = {"matchLabels": resources.site_selector_labels("mq")}
    assert made["affinity"] == {"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": sites}}]}}
    assert made["topologySpreadConstraints"] == [{
        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": sites}]
    assert made["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    for key in ("nodeSelector", "tolerations", "priorityClassName", "imagePullSecrets",
                "serviceAccountName"):
        assert key not in made


def test_spec_pod_fields_land_in_the_pods() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "disk", "operator": "In", "values": ["ssd"]}]}]}}}
    spec = crd_defaults() | {"pod": {
        "labels": {"team": "iot", "app.kubernetes.io/name": "mine"},
        "annotations": {"note": "x", resources.CONFIG_HASH_ANNOTATION: "mine"},
        "nodeSelector": {"pool": "brokers"},
        "affinity": affinity,
        "topologySpreadConstraints": [],
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "mq",
                         "effect": "NoSchedule"}],
        "priorityClassName": "brokers-high",
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "mq-pods",
        "env": [{"name": "TZ", "value": "UTC"}],
        "volumes": [{"name": "extra", "emptyDir": {}}],
        "volumeMounts": [{"name": "extra", "mountPath": "/extra"}]}}
    template = resources.stateful_set(OWNER, spec)["spec"]["template"]
    made = template["spec"]
    assert made["affinity"] == affinity
    assert made["topologySpreadConstraints"] == []  # an empty value turns it off
    assert made["nodeSelector"] == {"pool": "brokers"}
    assert made["tolerations"][0]["key"] == "dedicated"
    assert made["priorityClassName"] == "brokers-high"
    assert made["imagePullSecrets"] == [{"name": "registry"}]
    assert made["serviceAccountName"] == "mq-pods"
    assert made["automountServiceAccountToken"] is False
    assert made["volumes"][-1] == {"name": "extra", "emptyDir": {}}
    # the operator's labels and annotation win: the selector still selects the pods
    assert template["metadata"]["labels"]["team"] == "iot"
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "stratamq"
    assert template["metadata"]["annotations"]["note"] == "x"
    assert template["metadata"]["annotations"][resources.CONFIG_HASH_ANNOTATION] \
        == resources.config_hash(spec)
    found = container(spec)
    assert found["env"][0]["name"] == resources.TOKEN_ENV
    assert found["env"][-1] == {"name": "TZ", "value": "UTC"}
    assert found["volumeMounts"][-1] == {"name": "extra", "mountPath": "/extra"}


def test_a_config_change_changes_the_pod_template() -> None:
    """The broker reads its config at start, so a new config must roll the pods."""
    spec = crd_defaults()
    before = resources.stateful_set(OWNER, spec)["spec"]["template"]
    changed = crd_defaults()
    changed["mqtt"]["maxInflight"] = 3
    after = resources.stateful_set(OWNER, changed)["spec"]["template"]
    assert before != after
    assert before == resources.stateful_set(OWNER, crd_defaults())["spec"]["template"]
    # A scale is no config change: the template stays.
    assert resources.stateful_set(OWNER, crd_defaults() | {"sites": 7})["spec"][
        "template"] == before


def test_services() -> None:
    spec = crd_defaults()
    peers = resources.peer_service(OWNER, spec)
    assert peers["metadata"]["name"] == "mq-peers"
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    client = resources.client_service(OWNER, spec)
    assert client["metadata"]["name"] == "mq"
    # the MQTT listeners only: the admin API is not for clients
    assert [(port["name"], port["port"]) for port in client["spec"]["ports"]] == [
        ("mqtt", 1883), ("mqtt-ws", 8083)]
    assert client["spec"]["type"] == "ClusterIP"
    for service in (peers, client):
        assert service["spec"]["selector"] == {"app.kubernetes.io/name": "stratamq",
                                               "app.kubernetes.io/instance": "mq",
                                               "app.kubernetes.io/component": "broker"}


def test_the_client_service_for_clients_outside_the_cluster() -> None:
    spec = crd_defaults()
    spec["service"] = {"type": "LoadBalancer", "loadBalancerClass": "example.com/lb",
                       "externalTrafficPolicy": "Local", "annotations": {"lb/idle": "300"},
                       "labels": {"team": "iot", "app.kubernetes.io/name": "mine"},
                       "loadBalancerSourceRanges": ["10.0.0.0/8"],
                       "nodePorts": {"mqtt": 31883}}
    made = resources.client_service(OWNER, spec)
    assert made["spec"]["type"] == "LoadBalancer"
    assert made["spec"]["loadBalancerClass"] == "example.com/lb"
    assert made["spec"]["externalTrafficPolicy"] == "Local"
    assert made["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert made["metadata"]["annotations"] == {"lb/idle": "300"}
    # the operator's labels win over the user's
    assert made["metadata"]["labels"]["team"] == "iot"
    assert made["metadata"]["labels"]["app.kubernetes.io/name"] == "stratamq"
    assert [(port["name"], port.get("nodePort")) for port in made["spec"]["ports"]] == [
        ("mqtt", 31883), ("mqtt-ws", None)]
    # A NodePort Service has no load balancer fields.
    spec["service"] = {"type": "NodePort", "loadBalancerClass": "ignored",
                       "externalTrafficPolicy": "Cluster"}
    made = resources.client_service(OWNER, spec)
    assert "loadBalancerClass" not in made["spec"]
    assert made["spec"]["externalTrafficPolicy"] == "Cluster"


def test_pod_disruption_budget_and_service_monitor() -> None:
    spec = crd_defaults()
    # What the controller says every shard's quorum allows; nothing while it does not
    # know; never above the spec's maxUnavailable.
    for tolerated, allowed in ((None, 0), (0, 0), (1, 1), (2, 2)):
        budget = resources.pod_disruption_budget(OWNER, spec, tolerated)
        assert budget is not None and budget["spec"]["maxUnavailable"] == allowed
        # a site not Ready keeps no quorum: a budget of 0 must not hold its node
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    spec["podDisruptionBudget"] = {"enable": True, "maxUnavailable": 1}
    for tolerated, allowed in ((None, 0), (0, 0), (1, 1), (2, 1)):
        budget = resources.pod_disruption_budget(OWNER, spec, tolerated)
        assert budget is not None and budget["spec"]["maxUnavailable"] == allowed
    spec["podDisruptionBudget"] = {"enable": False, "maxUnavailable": 2}
    assert resources.pod_disruption_budget(OWNER, spec) is None
    kinds = [made["kind"] for made in resources.desired_objects(OWNER, spec,
                                                                service_monitors=True)]
    assert kinds == ["ConfigMap", "Service", "Service", "StatefulSet", "ServiceMonitor"]
    monitor = resources.service_monitor(OWNER)
    client = resources.client_service(OWNER, spec)
    # It selects the headless Service only (every pod once, a site not ready too; both
    # would scrape each site twice, and the client Service has no admin port).
    assert monitor["spec"]["selector"]["matchLabels"].items() <= resources.peer_service(
        OWNER, spec)["metadata"]["labels"].items()
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= client["metadata"][
        "labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("admin", "/metrics")
    # every series gets its storage's name (the dashboards' Storage variable), from the
    # pod label that holds it
    assert endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
         "targetLabel": "storage"},
        # and the site is named by its namespace and pod (iot/mq-0), in the legends and
        # the alerts: unique, where a pod name alone is not
        {"sourceLabels": ["__meta_kubernetes_namespace", "__meta_kubernetes_pod_name"],
         "separator": "/", "targetLabel": "instance"}]
    assert resources.labels("mq")["app.kubernetes.io/instance"] == "mq"


def test_every_object_is_owned_and_labelled() -> None:
    for made in resources.desired_objects(OWNER, crd_defaults(), service_monitors=True):
        assert made["metadata"]["namespace"] == "brokers"
        assert made["metadata"]["ownerReferences"][0]["uid"] == "1234-uid"
        assert made["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "stratamq-operator"
    assert resources.selector("mq") == ("app.kubernetes.io/name=stratamq,"
                                        "app.kubernetes.io/instance=mq")


def test_config_problems_are_the_brokers() -> None:
    """What the schema cannot check, the broker's own config model does."""
    spec = crd_defaults()
    assert operator_config.config_problems(spec) == []
    spec["mqtt"]["maxPacketSize"] = "512MiB"
    [problem] = operator_config.config_problems(spec)
    assert problem.startswith("mqtt.max_packet_size: ")


def test_host_network_binds_every_port_on_the_pod_ip(tmp_path: Path) -> None:
    """spec.hostNetwork: the pods share their node's network, so each site binds its
    node's address (the pod IP) only; the broker then listens where the Services and
    probes (by port name) expect it."""
    assert "hostNetwork" not in resources.stateful_set(OWNER, crd_defaults())["spec"][
        "template"]["spec"]
    assert not any(variable["name"].endswith("BIND") for variable in container(crd_defaults())[
        "env"])
    spec = crd_defaults() | {"hostNetwork": True, "admin": {"port": 9000},
                             "listeners": {"tcp": {"port": 1884}, "ws": {"enable": False}}}
    pod = resources.stateful_set(OWNER, spec)["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    env = pod["containers"][0]["env"]
    names = [variable["name"] for variable in env]
    binds = {variable["name"]: variable["value"] for variable in env
             if variable["name"].endswith("BIND")}
    assert binds == {"STRATAMQ__LISTENERS__TCP__BIND": "$(POD_IP):1884",
                     "STRATAMQ__ADMIN__BIND": "$(POD_IP):9000",
                     "STRATAMQ__CLUSTER__PEER_BIND": "$(POD_IP):18084"}
    # The kubelet expands $(POD_IP) only from variables defined before.
    assert all(names.index("POD_IP") < names.index(name) for name in binds)
    # As the kubelet hands them over, the broker takes them over its config file.
    config_file = tmp_path / "stratamq.yaml"
    config_file.write_text(resources.rendered_config(spec))
    loaded = load_config(config_file, {name: value.replace("$(POD_IP)", "127.0.0.51")
                                       for name, value in binds.items()})
    assert loaded.listeners.tcp.bind == "127.0.0.51:1884"
    assert loaded.admin.bind == "127.0.0.51:9000"
    assert loaded.cluster.peer_bind == "127.0.0.51:18084"


def test_the_update_strategy_holds_pods_on_their_template() -> None:
    spec = crd_defaults()
    made = resources.stateful_set(OWNER, spec, replicas=3)["spec"]["updateStrategy"]
    assert made == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
    spec["updateStrategy"] = {"paused": False, "partition": 2}
    made = resources.stateful_set(OWNER, spec, replicas=3)["spec"]["updateStrategy"]
    assert made["rollingUpdate"] == {"partition": 2}
    assert resources.held_pods(spec, 3) == 2
    # paused: every pod kept, those of a scale-up too (the partition follows the count)
    spec["updateStrategy"] = {"paused": True, "partition": 0}
    for replicas in (3, 5):
        made = resources.stateful_set(OWNER, spec, replicas=replicas)["spec"]["updateStrategy"]
        assert made["rollingUpdate"] == {"partition": replicas}
        assert resources.held_pods(spec, replicas) == replicas
    # a partition above the pods holds them all
    spec["updateStrategy"] = {"paused": False, "partition": 7}
    assert resources.held_pods(spec, 3) == 3


def test_the_network_policy_lets_in_what_each_port_is_for(monkeypatch: Any) -> None:
    spec = crd_defaults()
    assert resources.network_policy(OWNER, spec, "ops") is None
    assert "NetworkPolicy" not in [made["kind"] for made in resources.desired_objects(
        OWNER, spec, service_monitors=False)]
    prometheus = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    spec["networkPolicy"] = {"enable": True, "admin": [prometheus]}
    monkeypatch.setenv(resources.OPERATOR_NAMESPACE_ENV, "ops")
    policy = resources.network_policy(OWNER, spec, "ops")
    assert policy is not None and policy in resources.desired_objects(
        OWNER, spec, service_monitors=False)
    sites = {"podSelector": {"matchLabels": resources.site_selector_labels("mq")}}
    assert policy["spec"]["podSelector"] == sites["podSelector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    clients, peers, admin = policy["spec"]["ingress"]
    # MQTT from anyone (no `from`), on the enabled listeners only
    assert clients == {"ports": [{"port": 1883, "protocol": "TCP"},
                                 {"port": 8083, "protocol": "TCP"}]}
    assert peers == {"from": [sites], "ports": [{"port": 18084, "protocol": "TCP"}]}
    assert admin["ports"] == [{"port": 18083, "protocol": "TCP"}]
    operator_pods, spark_pods, site_pods, extra = admin["from"]
    # Issue 23: the operator's pods in its own namespace only (a pod given its labels
    # in any other namespace is anybody's); the storage's when that is not known.
    operator_labels = {"matchLabels": {"app.kubernetes.io/name": "stratamq",
                                       "app.kubernetes.io/component": "operator"}}
    assert operator_pods == {"podSelector": operator_labels, "namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "ops"}}}
    unknown = resources.network_policy(OWNER, spec, None)
    assert unknown is not None
    assert unknown["spec"]["ingress"][2]["from"][0] == {"podSelector": operator_labels}
    # the Spark jobs' pods carry the label the selector asks for
    job = spark.cron_job(OWNER, spec | {"spark": {"volume": {"claimName": "work"},
                                                  "gc": {"enable": True}}}, "gc")
    pod_labels = job["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    assert spark_pods["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert not spark_pods["podSelector"]["matchLabels"].items() <= resources.labels(
        "mq").items()
    assert (site_pods, extra) == (sites, prometheus)
    # clients from a namespace only
    spec["networkPolicy"]["clients"] = [prometheus]
    policy = resources.network_policy(OWNER, spec, "ops")
    assert policy is not None and policy["spec"]["ingress"][0]["from"] == [prometheus]


def test_the_image_left_out_is_the_operators_own(monkeypatch: Any) -> None:
    """Not fixed into the storage when it is made: the operator fills what spec.image
    leaves out from its own image whenever it applies the objects, so an upgraded
    operator rolls the sites to its version unless the spec pins a tag."""
    spec = crd_defaults()
    assert "tag" not in spec["image"] and "repository" not in spec["image"]
    mirror = "registry.example:5000/mirror/stratamq:2.0.1"
    assert resources.image(spec, mirror) == mirror
    assert resources.image(spec | {"image": {"tag": "1.9"}}, mirror) \
        == "registry.example:5000/mirror/stratamq:1.9"
    assert resources.image(spec | {"image": {"repository": "mine/mq"}}, mirror) \
        == "mine/mq:2.0.1"
    assert spark.image(spec, mirror) == "stratamq/stratamq-spark:2.0.1"
    # from the chart's environment, else this package's version
    monkeypatch.setenv("STRATAMQ_OPERATOR_IMAGE", mirror)
    assert resources.stateful_set(OWNER, spec)["spec"]["template"]["spec"]["containers"][0][
        "image"] == mirror
    monkeypatch.delenv("STRATAMQ_OPERATOR_IMAGE")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert resources.image(spec) == f"stratamq/stratamq:{version}"
    assert resources.split_image("stratamq") == ("stratamq", "latest")
    assert resources.split_image("host:5000/stratamq") == ("host:5000/stratamq", "latest")


def test_each_config_has_its_own_config_map_and_the_old_ones_go_when_unnamed() -> None:
    """updateStrategy.paused held the pods but not their ConfigMap: a held pod recreated
    (or any site restarting) came back on the new config. Each rendered config is now a
    ConfigMap of its own, immutable, which the pod template names; one goes once no pod
    and no revision of the StatefulSet names it."""
    spec: dict[str, Any] = {"sites": 3}
    changed = {**spec, "mqtt": {"maxInflight": 7}}
    first, second = (resources.config_map(OWNER, given) for given in (spec, changed))
    assert first["metadata"]["name"] != second["metadata"]["name"]
    assert first["metadata"]["name"].startswith("mq-config-") and first["immutable"] is True
    assert resources.config_map(OWNER, dict(spec))["metadata"]["name"] \
        == first["metadata"]["name"]  # the same config, the same name
    template = resources.stateful_set(OWNER, changed)["spec"]["template"]["spec"]
    assert resources.config_maps_named([template]) == {second["metadata"]["name"]}
    assert resources.stateful_set(OWNER, changed)["spec"]["revisionHistoryLimit"] == 0
    old, new = first["metadata"]["name"], second["metadata"]["name"]
    found = [old, new, "mq-config", "mq-config-abc", "mq-configs", "mq-config-x-config-0123456789",
             "other-config-0123456789", "mq-spark-executor"]
    # A held pod (or a revision) names the old one: it stays; the legacy name goes.
    assert resources.stale_config_maps("mq", found, {old}, new) == ["mq-config"]
    assert resources.stale_config_maps("mq", found, set(), new) == ["mq-config", old]
