"""The CRDs of crds/ on a real kube-apiserver, through the real kubectl: they become
Established, defaults are filled in, bad specs are refused with the schema's message,
the scale and status subresources and the printer columns work."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from stratamq.operator.resources import Owner, client_service, network_policy, stateful_set
from tests.kube.conftest import CRD_NAMES
from tests.support.kube import ControlPlane


def storage(name: str, spec: dict[str, Any] | None = None) -> str:
    return yaml.safe_dump({"apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
                           "metadata": {"name": name}, "spec": spec or {}})


def get_json(kube: ControlPlane, namespace: str, *what: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        kube.kubectl("get", "-n", namespace, "-o", "json", *what).stdout)
    return result


def refusal(kube: ControlPlane, namespace: str, manifest: str) -> str:
    """Apply `manifest`, which must be refused; return kubectl's message."""
    result = kube.kubectl("apply", "-n", namespace, "-f", "-", input=manifest, check=False)
    assert result.returncode != 0, f"accepted:\n{manifest}\n{result.stdout}"
    return result.stderr


def test_crds_are_established(crds: ControlPlane) -> None:
    for name in CRD_NAMES:
        crd = json.loads(crds.kubectl("get", "crd", name, "-o", "json").stdout)
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions["Established"] == "True", crd["status"]
        assert conditions["NamesAccepted"] == "True", crd["status"]
    resources = crds.kubectl("api-resources", "--api-group=stratamq.io", "-o", "name").stdout
    assert resources.split() == ["durablestorages.stratamq.io", "replicatransitions.stratamq.io"]


def test_good_storage_gets_defaults(crds: ControlPlane, namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq"))
    spec = get_json(crds, namespace, "durablestorage", "mq")["spec"]
    assert spec["sites"] == 3
    assert spec["messages"] == {
        "nShards": 16, "replicationFactor": 3, "syncWrites": False,
        "localWriteBuffer": {"maxItems": 1000, "flushInterval": "0ms", "maxBytes": "16MiB"},
        "layout": {"type": "wildcard_optimized_v2", "wildcardThresholds": [100, 10],
                   "topicIndexBytes": 8, "bitsPerTopicLevel": 64, "epochBits": 20},
        "maxPayloadBytes": 268435455, "topicCacheBytes": "64MiB",
        "learnedTopicMaxLevels": 32, "learnedTopicBytes": "128MiB"}
    assert spec["durableSessions"]["messageRetentionPeriod"] == "1d"
    assert spec["listeners"]["tcp"] == {"enable": True, "port": 1883}
    assert spec["listeners"]["tls"] == {"enable": False, "port": 8883, "verifyPeer": False}
    assert spec["accessControl"] == {"allowAnonymous": True, "aclNoMatch": "allow"}
    assert spec["storage"] == {"size": "10Gi"}
    assert spec["cluster"] == {"writeTimeout": "5s", "logRetainEntries": 10000,
                               "handoverTimeout": "10s"}
    assert spec["podDisruptionBudget"] == {"enable": True}
    assert spec["transitionHistoryLimit"] == 3
    assert spec["maxConcurrentMoves"] == 1
    assert spec["spark"]["gc"] == {"enable": False, "schedule": "0 3 * * *",
                                   "activeDeadlineSeconds": 7200}
    assert (spec["spark"]["hostNetwork"], spec["spark"]["apiServer"],
            spec["spark"]["siteAddresses"]) == (False, "https://kubernetes.default.svc", "DNS")
    # the repository and tag come from the operator's image when it applies the objects
    assert spec["image"] == {"pullPolicy": "IfNotPresent"}


POD = {
    "labels": {"team": "iot"},
    "nodeSelector": {"pool": "brokers"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "disk", "operator": "In", "values": ["ssd"]}]}]}}},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "mq",
                     "effect": "NoSchedule"}],
    "priorityClassName": "brokers-high",
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccountName": "mq-pods",
    "env": [{"name": "TZ", "value": "UTC"},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
    "volumes": [{"name": "extra", "emptyDir": {"sizeLimit": "1Gi"}}],
    "volumeMounts": [{"name": "extra", "mountPath": "/extra", "readOnly": True}],
}


def test_pod_template_fields_are_kept_and_the_sites_pods_are_valid(
        crds: ControlPlane, namespace: str) -> None:
    """spec.pod keeps the core/v1 fields whole (their schemas are Kubernetes' own),
    and the StatefulSet the operator makes of it, defaults and all, passes the API
    server's validation."""
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq", {"pod": POD}))
    stored = get_json(crds, namespace, "durablestorage", "mq")
    assert stored["spec"]["pod"] == POD
    owner = Owner(name="mq", namespace=namespace, uid=stored["metadata"]["uid"])
    for spec in (stored["spec"], {**stored["spec"], "pod": {}}):
        made = json.dumps(stateful_set(owner, spec))
        crds.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=made)


def test_the_client_service_changes_type_in_place(crds: ControlPlane, namespace: str) -> None:
    """The client Service as the operator applies it (server-side, as its field
    manager): ClusterIP, then a LoadBalancer with a class, Local traffic and a fixed
    node port, then NodePort, then ClusterIP again; each step is a valid change of the
    one object (the node ports the cluster gave are released on the way back). The
    StatefulSet with an update strategy passes validation too."""
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq"))
    stored = get_json(crds, namespace, "durablestorage", "mq")
    owner = Owner(name="mq", namespace=namespace, uid=stored["metadata"]["uid"])
    balancer = {"type": "LoadBalancer", "loadBalancerClass": "example.com/lb",
                "externalTrafficPolicy": "Local", "annotations": {"lb/idle": "300"},
                "nodePorts": {"mqtt": 31883}}
    steps: list[dict[str, Any]] = [{}, balancer, {"type": "NodePort"}, {"type": "ClusterIP"}]
    for given in steps:
        crds.kubectl("patch", "-n", namespace, "durablestorage", "mq", "--type=merge",
                     "-p", json.dumps({"spec": {"service": None}}))
        crds.kubectl("patch", "-n", namespace, "durablestorage", "mq", "--type=merge",
                     "-p", json.dumps({"spec": {"service": given}}))
        spec = get_json(crds, namespace, "durablestorage", "mq")["spec"]
        crds.kubectl("apply", "--server-side", "--field-manager=stratamq-operator",
                     "-n", namespace, "-f", "-", input=json.dumps(client_service(owner, spec)))
        made = get_json(crds, namespace, "service", "mq")
        assert made["spec"]["type"] == given.get("type", "ClusterIP")
        assert [port["name"] for port in made["spec"]["ports"]] == ["mqtt", "mqtt-ws"]
        node_ports = [port.get("nodePort") for port in made["spec"]["ports"]]
        if made["spec"]["type"] == "ClusterIP":
            assert node_ports == [None, None]
        else:
            assert all(node_ports), made
        if given.get("type") == "LoadBalancer":
            assert node_ports[0] == 31883
            assert made["spec"]["loadBalancerClass"] == "example.com/lb"
            assert made["spec"]["externalTrafficPolicy"] == "Local"
            assert made["metadata"]["annotations"]["lb/idle"] == "300"
    spec = {**stored["spec"], "updateStrategy": {"paused": False, "partition": 2}}
    crds.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                 input=json.dumps(stateful_set(owner, spec)))
    # the NetworkPolicy, with the peers a user gives kept whole, is valid as made
    monitoring = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    crds.kubectl("patch", "-n", namespace, "durablestorage", "mq", "--type=merge", "-p",
                 json.dumps({"spec": {"networkPolicy": {
                     "enable": True, "admin": [monitoring],
                     "clients": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}}}))
    spec = get_json(crds, namespace, "durablestorage", "mq")["spec"]
    assert spec["networkPolicy"]["admin"] == [monitoring]
    policy = network_policy(owner, spec, "operators")
    assert policy is not None
    crds.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                 input=json.dumps(policy))


def test_explicit_values_are_kept(crds: ControlPlane, namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq", {
        "sites": 1,
        "messages": {"nShards": 4, "replicationFactor": 1,
                     "localWriteBuffer": {"maxBytes": "512KiB", "flushInterval": "5ms"}},
        "durableSessions": {"messageRetentionPeriod": "1h30m"},
        "accessControl": {"allowAnonymous": False, "passwordSecret": {"name": "mq-users"}},
        "listeners": {"tls": {"enable": True, "secretName": "mq-tls"}},
        "storage": {"size": "512Mi", "storageClassName": "fast"},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 2}},
    }))
    spec = get_json(crds, namespace, "durablestorage", "mq")["spec"]
    assert spec["messages"]["nShards"] == 4
    assert spec["messages"]["localWriteBuffer"] == {
        "maxItems": 1000, "flushInterval": "5ms", "maxBytes": "512KiB"}
    assert spec["durableSessions"]["messageRetentionPeriod"] == "1h30m"
    assert spec["accessControl"]["passwordSecret"] == {"name": "mq-users", "key": "passwd"}
    assert spec["storage"] == {"size": "512Mi", "storageClassName": "fast"}
    assert spec["resources"]["limits"] == {"cpu": 2}


# (spec, a part of the message the API server must answer with)
BAD_SPECS: dict[str, tuple[dict[str, Any], str]] = {
    "negative-nshards": ({"messages": {"nShards": -4}},
                         "spec.messages.nShards: Invalid value: -4: "
                         "spec.messages.nShards in body should be greater than or equal to 1"),
    "zero-nshards": ({"messages": {"nShards": 0}}, "should be greater than or equal to 1"),
    "too-many-nshards": ({"messages": {"nShards": 5000}}, "should be less than or equal to 1024"),
    "rf-above-sites": ({"sites": 3, "messages": {"replicationFactor": 5}},
                       "spec.messages.replicationFactor: Invalid value: \"object\": "
                       "messages.replicationFactor (default 3) must not exceed sites: every "
                       "replica of a shard lives on a different site"),
    "default-rf-above-one-site": ({"sites": 1},
                                  "messages.replicationFactor (default 3) must not exceed sites"),
    "rf-zero": ({"messages": {"replicationFactor": 0}},
                "spec.messages.replicationFactor in body should be greater than or equal to 1"),
    "rf-out-of-range": ({"sites": 9, "messages": {"replicationFactor": 8}},
                        "spec.messages.replicationFactor in body should be less than or equal "
                        "to 7"),
    "zero-sites": ({"sites": 0}, "spec.sites in body should be greater than or equal to 1"),
    "sites-not-a-number": ({"sites": "three"}, 'spec.sites: Invalid value: "string": '
                                               'spec.sites in body must be of type integer'),
    "epoch-bits-zero": ({"messages": {"layout": {"type": "wildcard_optimized", "epochBits": 0}}},
                        "spec.messages.layout.epochBits in body should be greater than or "
                        "equal to 1"),
    "topic-index-too-wide": ({"messages": {"layout": {"topicIndexBytes": 9}}},
                             "spec.messages.layout.topicIndexBytes in body should be less than "
                             "or equal to 8"),
    "layout-unknown": ({"messages": {"layout": {"type": "btree"}}}, 'Unsupported value: "btree"'),
    "bad-byte-size": ({"messages": {"localWriteBuffer": {"maxBytes": "16 megs"}}},
                      "spec.messages.localWriteBuffer.maxBytes: Invalid value: \"string\": "
                      "must be a byte size above 0, such as 512KiB"),
    "zero-byte-size": ({"messages": {"topicCacheBytes": "0MiB"}}, "must be a byte size above 0"),
    "bad-volume-size": ({"storage": {"size": "ten gigs"}},
                        "spec.storage.size: Invalid value: \"string\": must be a Kubernetes "
                        "quantity above 0, such as 512Mi, 10Gi or 1Ti"),
    "zero-volume-size": ({"storage": {"size": "0"}}, "must be a Kubernetes quantity above 0"),
    "bad-resource-quantity": ({"resources": {"limits": {"memory": "lots"}}},
                              "spec.resources.limits.memory in body should match"),
    "bad-retention": ({"durableSessions": {"messageRetentionPeriod": "forever"}},
                      "spec.durableSessions.messageRetentionPeriod: Invalid value: \"string\": "
                      "must be a duration above 0 with a unit ms, s, m, h or d"),
    "zero-retention": ({"durableSessions": {"messageRetentionPeriod": "0d"}},
                       "must be a duration above 0"),
    "bad-flush-interval": ({"messages": {"localWriteBuffer": {"flushInterval": "soon"}}},
                           "must be a duration with a unit ms, s, m, h or d"),
    "port-out-of-range": ({"listeners": {"tcp": {"port": 70000}}},
                          "spec.listeners.tcp.port in body should be less than or equal to 65535"),
    "tls-without-secret": ({"listeners": {"tls": {"enable": True}}},
                           "tls.secretName (a kubernetes.io/tls Secret) is required when "
                           "tls.enable is true"),
    "nobody-can-connect": ({"accessControl": {"allowAnonymous": False}},
                           "accessControl.allowAnonymous is false but no "
                           "accessControl.passwordSecret is set, so no client could connect"),
    "acl-no-match": ({"accessControl": {"aclNoMatch": "maybe"}},
                     'spec.accessControl.aclNoMatch: Unsupported value: "maybe": supported '
                     'values: "allow", "deny"'),
    "bad-cron": ({"spark": {"gc": {"enable": True, "schedule": "every night"}}},
                 "spec.spark.gc.schedule: Invalid value: \"string\": must be a cron schedule"),
    "spark-without-volume": ({"spark": {"export": {"enable": True}}},
                             "a Spark job is enabled, so spark.volume.claimName must name "
                             "the shared (ReadWriteMany) volume claim"),
    "zero-log-retain": ({"cluster": {"logRetainEntries": 0}},
                        "spec.cluster.logRetainEntries in body should be greater than or "
                        "equal to 1"),
    "bad-write-timeout": ({"cluster": {"writeTimeout": "0s"}}, "must be a duration above 0"),
    "operator-env": ({"pod": {"env": [{"name": "POD_IP", "value": "10.0.0.1"}]}},
                     "the operator sets STRATAMQ__ADMIN__TOKEN, POD_IP and "
                     "STRATAMQ__CLUSTER__ADVERTISE itself"),
    "operator-volume": ({"pod": {"volumes": [{"name": "data", "emptyDir": {}}]}},
                        "the volume names config, data, spark-work, tls, passwd and acl are "
                        "the operator's"),
    "pull-secret-without-name": ({"pod": {"imagePullSecrets": [{}]}},
                                 'spec.pod.imagePullSecrets[0].name: Required value'),
    "load-balancer-class-on-cluster-ip": (
        {"service": {"loadBalancerClass": "example.com/lb"}},
        "service.loadBalancerClass needs service.type LoadBalancer"),
    "traffic-policy-on-cluster-ip": (
        {"service": {"externalTrafficPolicy": "Local"}},
        "service.externalTrafficPolicy needs service.type NodePort or LoadBalancer"),
    "node-ports-on-cluster-ip": ({"service": {"nodePorts": {"mqtt": 31883}}},
                                 "service.nodePorts needs service.type NodePort or LoadBalancer"),
    "spark-memory-unit": ({"spark": {"resources": {"driver": {"memory": "2GiB"}}}},
                          "must be a size in Spark's units, such as 512m or 2g"),
    "spark-api-server-path": ({"spark": {"apiServer": "https://10.0.0.1:6443/api"}},
                              "must be an https:// address without a path"),
    "spark-site-addresses": ({"spark": {"siteAddresses": "Hostname"}},
                             'spec.spark.siteAddresses: Unsupported value: "Hostname"'),
    "negative-partition": ({"updateStrategy": {"partition": -1}},
                           "spec.updateStrategy.partition in body should be greater than or "
                           "equal to 0"),
    "no-transition-history": ({"transitionHistoryLimit": 0},
                              "spec.transitionHistoryLimit in body should be greater than or "
                              "equal to 1"),
    "no-moves": ({"maxConcurrentMoves": 0},
                 "spec.maxConcurrentMoves in body should be greater than or equal to 1"),
    # kubectl asks for strict field validation: a typo is not silently pruned.
    "misspelt-key": ({"messages": {"nShard": 8}}, 'unknown field "spec.messages.nShard"'),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_spec_is_refused(crds: ControlPlane, namespace: str, case: str) -> None:
    spec, message = BAD_SPECS[case]
    assert message in refusal(crds, namespace, storage("mq", spec))
    listed = crds.kubectl("get", "-n", namespace, "durablestorages", "-o", "name").stdout
    assert listed == ""


def test_nshards_is_fixed_once_created(crds: ControlPlane, namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq"))
    message = refusal(crds, namespace, storage("mq", {"messages": {"nShards": 32}}))
    assert "nShards is fixed when the storage is created and cannot be changed" in message
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq", {"sites": 5}))
    spec = get_json(crds, namespace, "durablestorage", "mq")["spec"]
    assert (spec["sites"], spec["messages"]["nShards"]) == (5, 16)


def test_volume_can_grow_but_not_shrink_or_change_class(crds: ControlPlane,
                                                        namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage(
        "mq", {"storage": {"size": "10Gi", "storageClassName": "fast"}}))
    message = refusal(crds, namespace, storage(
        "mq", {"storage": {"size": "9Gi", "storageClassName": "fast"}}))
    assert "storage.size cannot shrink (a volume can be expanded, never shrunk)" in message
    message = refusal(crds, namespace, storage(
        "mq", {"storage": {"size": "10Gi", "storageClassName": "slow"}}))
    assert "storage.storageClassName cannot change" in message
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage(
        "mq", {"storage": {"size": "20Gi", "storageClassName": "fast"}}))
    spec = get_json(crds, namespace, "durablestorage", "mq")["spec"]
    assert spec["storage"] == {"size": "20Gi", "storageClassName": "fast"}


def test_scale_subresource(crds: ControlPlane, namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq"))
    crds.kubectl("scale", "-n", namespace, "durablestorage/mq", "--replicas=5")
    assert get_json(crds, namespace, "durablestorage", "mq")["spec"]["sites"] == 5
    scale = get_json(crds, namespace, "durablestorage", "mq", "--subresource=scale")
    assert scale["kind"] == "Scale"
    assert scale["spec"] == {"replicas": 5}
    # The status side of Scale, as the operator reports it.
    crds.kubectl("patch", "-n", namespace, "durablestorage/mq", "--subresource=status",
                 "--type=merge", "-p", json.dumps({"status": {
                     "replicas": 4, "selector": "app.kubernetes.io/instance=mq"}}))
    scale = get_json(crds, namespace, "durablestorage", "mq", "--subresource=scale")
    assert scale["status"] == {"replicas": 4, "selector": "app.kubernetes.io/instance=mq"}
    # Scaling below the replication factor is refused like any other bad spec.
    result = crds.kubectl("scale", "-n", namespace, "durablestorage/mq", "--replicas=2",
                          check=False)
    assert result.returncode != 0
    assert "messages.replicationFactor (default 3) must not exceed sites" in result.stderr
    assert get_json(crds, namespace, "durablestorage", "mq")["spec"]["sites"] == 5


def test_status_subresource_and_printer_columns(crds: ControlPlane, namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", "-",
                 input=storage("mq", {"sites": 4, "messages": {"nShards": 8}}))
    status = {
        "observedGeneration": 1, "phase": "Rebalancing", "replicas": 4, "readyReplicas": 3,
        "selector": "app.kubernetes.io/instance=mq", "underReplicatedShards": 2,
        "pendingTransitions": 5,
        "rebalance": {"plan": "6-abcdef", "trigger": "Scale", "message": "sites 3 -> 4",
                      "steps": 8, "stepsDone": 3, "startedAt": "2026-01-01T00:00:00Z",
                      "eta": "2026-01-01T00:05:00Z", "result": "Running"},
        "conditions": [{"type": "Ready", "status": "False", "reason": "SiteNotReady",
                        "message": "site mq-3 is not ready",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "sites": [{"id": "a1b2", "pod": "mq-0", "ready": True}],
        "databases": [{"name": "messages", "placementVersion": 7, "underReplicatedShards": 2,
                       "pendingTransitions": 5,
                       "shards": [{"shard": 0, "leader": "a1b2", "leaderEpoch": 3,
                                   "replicas": ["a1b2"], "underReplicated": True}]}],
    }
    crds.kubectl("patch", "-n", namespace, "durablestorage/mq", "--subresource=status",
                 "--type=merge", "-p", json.dumps({"status": status}))
    stored = get_json(crds, namespace, "durablestorage", "mq")
    assert stored["status"] == status
    # A spec change through the main resource does not touch status, and vice versa.
    assert stored["spec"]["sites"] == 4

    table = crds.kubectl("get", "-n", namespace, "durablestorages").stdout.splitlines()
    assert table[0].split() == ["NAME", "SITES", "READY", "SHARDS", "UNDER-REPLICATED",
                                "TRANSITIONS", "PHASE", "AGE"]
    assert table[1].split()[:7] == ["mq", "4", "3", "8", "2", "5", "Rebalancing"]

    result = crds.kubectl("patch", "-n", namespace, "durablestorage/mq",
                          "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": {"phase": "Happy"}}), check=False)
    assert result.returncode != 0
    assert 'status.phase: Unsupported value: "Happy"' in result.stderr


def transition(name: str, owner: dict[str, Any], **spec: Any) -> str:
    return yaml.safe_dump({
        "apiVersion": "stratamq.io/v1alpha1", "kind": "ReplicaTransition",
        "metadata": {"name": name, "ownerReferences": [{
            "apiVersion": "stratamq.io/v1alpha1", "kind": "DurableStorage",
            "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"durableStorage": owner["metadata"]["name"], "database": "messages",
                 "shard": 3, "action": "Add", "site": "c3d4", "step": 0, **spec}})


def test_replica_transitions(crds: ControlPlane, namespace: str) -> None:
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=storage("mq"))
    owner = get_json(crds, namespace, "durablestorage", "mq")
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=transition("mq-messages-3-add", owner,
                                                                       pod="mq-3"))
    crds.kubectl("apply", "-n", namespace, "-f", "-", input=transition(
        "mq-messages-3-remove", owner, action="Remove", site="a1b2", step=1, pod="mq-0"))
    crds.kubectl("patch", "-n", namespace, "replicatransition/mq-messages-3-add",
                 "--subresource=status", "--type=merge",
                 "-p", json.dumps({"status": {"phase": "CatchingUp"}}))
    crds.kubectl("patch", "-n", namespace, "rt/mq-messages-3-remove",
                 "--subresource=status", "--type=merge", "-p", json.dumps(
                     {"status": {"phase": "Failed", "reason": "SiteGone"}}))

    table = crds.kubectl("get", "-n", namespace, "replicatransitions").stdout.splitlines()
    assert table[0].split() == ["NAME", "STORAGE", "DATABASE", "SHARD", "ACTION", "SITE",
                                "POD", "STEP", "PHASE", "AGE"]
    assert [row.split()[:9] for row in table[1:]] == [
        ["mq-messages-3-add", "mq", "messages", "3", "Add", "c3d4", "mq-3", "0",
         "CatchingUp"],
        ["mq-messages-3-remove", "mq", "messages", "3", "Remove", "a1b2", "mq-0", "1",
         "Failed"]]
    wide = crds.kubectl("get", "-n", namespace, "rt", "-o", "wide").stdout.splitlines()
    assert wide[2].split()[-2] == "SiteGone"

    # A planned step is fixed; a bad one is refused.
    changed = transition("mq-messages-3-add", owner, site="e5f6")
    assert "a ReplicaTransition's spec is fixed once planned" in refusal(crds, namespace, changed)
    bad = transition("mq-messages-4-move", owner, action="Move")
    assert 'spec.action: Unsupported value: "Move": supported values: "Add", "Remove"' in (
        refusal(crds, namespace, bad))
    result = crds.kubectl("patch", "-n", namespace, "rt/mq-messages-3-add",
                          "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": {"phase": "Sleeping"}}), check=False)
    assert 'Unsupported value: "Sleeping"' in result.stderr

    # Owned by their DurableStorage: the controller manager's garbage collector
    # deletes them with it.
    crds.kubectl("delete", "-n", namespace, "durablestorage/mq", "--wait=true")
    crds.kubectl("wait", "-n", namespace, "--for=delete", "--timeout=60s",
                 "rt/mq-messages-3-add", "rt/mq-messages-3-remove")
    assert crds.kubectl("get", "-n", namespace, "rt", "-o", "name").stdout == ""
