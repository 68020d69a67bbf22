"""The Kubernetes objects a DurableStorage is made of, built from its spec: pure
functions of (name, namespace, spec), no API calls, so every field can be unit-tested.

One pod of the StatefulSet is one site. Every object carries the same labels and an
owner reference to the DurableStorage, so deleting the storage garbage-collects them
(the volumes stay: a StatefulSet's claims are retained, as the data should be).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import config as broker_config_module
from .config import (
    ACL_MOUNT,
    ADVERTISE_ENV,
    CONFIG_FILE,
    CONFIG_MOUNT,
    CONFIG_PATH,
    DATA_MOUNT,
    PASSWORD_MOUNT,
    PEER_PORT,
    POD_IP_ENV,
    SPARK_WORK_MOUNT,
    TLS_MOUNT,
)
from .spec import parse_spec

Manifest = dict[str, Any]

GROUP = "stratamq.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DurableStorage"
PLURAL = "durablestorages"

MANAGED_BY = "stratamq-operator"
CONTAINER = "broker"
DATA_VOLUME = "data"
SPARK_WORK_VOLUME = "spark-work"
TOKEN_KEY = "token"
TOKEN_ENV = "STRATAMQ__ADMIN__TOKEN"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
# Hex digits of the config's hash in its ConfigMap's name.
CONFIG_NAME_HASH = 10
SERVICE_LABEL = f"{GROUP}/service"
# The operator's own image, which the chart sets (see operator_image).
OPERATOR_IMAGE_ENV = "STRATAMQ_OPERATOR_IMAGE"
OPERATOR_NAMESPACE_ENV = "STRATAMQ_OPERATOR_NAMESPACE"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# On the Spark jobs' pods (operator/spark.py), naming their storage; a site's pod has
# no such label.
SPARK_STORAGE_LABEL = f"{GROUP}/durable-storage"
# The chart's operator pods (charts/stratamq/templates/_helpers.tpl, operatorSelector),
# in whichever namespace the chart was installed.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "stratamq",
                       "app.kubernetes.io/component": "operator"}
# Long enough for a site to close connections, persist sessions and flush storage.
TERMINATION_GRACE_SECONDS = 60
# The user of the image (images/): the volume is made writable for its group.
RUN_AS_USER = 10001
# What Pod Security "restricted" asks of a pod (with each container's
# allowPrivilegeEscalation false and capabilities dropped): the sites' and the Spark
# jobs' pods carry it, and so does the chart's operator Deployment.
RESTRICTED_POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"}}
# A broker container's resources when spec.resources says none: a pod without
# requests is BestEffort, the first one a node under pressure evicts.
DEFAULT_RESOURCES: dict[str, Any] = {"requests": {"cpu": "250m", "memory": "512Mi"}}
HOSTNAME_KEY = "kubernetes.io/hostname"
ZONE_KEY = "topology.kubernetes.io/zone"


@dataclass(frozen=True, slots=True)
class Owner:
    """The DurableStorage the objects belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


# --- names and labels -----------------------------------------------------------------

def config_map_name(name: str, spec: dict[str, Any]) -> str:
    """`<storage>-config-<hash>`: a ConfigMap per rendered config, immutable, named by
    the pod template. A pod the roll has not reached (the roll paused, or held at a
    partition) and then recreated comes back on its own template's config, not on the
    new one; older ones go once no revision of the StatefulSet names them
    (`stale_config_maps`)."""
    return f"{name}-config-{config_hash(spec)[:CONFIG_NAME_HASH]}"


def is_config_map_of(name: str, storage: str) -> bool:
    """Whether `name` is one of `storage`'s config ConfigMaps (`<storage>-config`, the
    one an operator before per-config names made, included)."""
    return re.fullmatch(rf"{re.escape(storage)}-config(-[0-9a-f]{{{CONFIG_NAME_HASH}}})?",
                        name) is not None


def config_maps_named(pod_specs: Iterable[Mapping[str, Any]]) -> set[str]:
    """The ConfigMaps that pod specs (pods', or the pod templates of a StatefulSet's
    revisions) mount."""
    return {volume["configMap"]["name"] for pod_spec in pod_specs
            for volume in pod_spec.get("volumes") or [] if "configMap" in volume}


def stale_config_maps(storage: str, found: Iterable[str], named: Collection[str],
                      current: str) -> list[str]:
    """`storage`'s config ConfigMaps among `found` that neither `current` (the one its
    template names now) nor anything `named` (by its StatefulSet's revisions) still
    needs."""
    return sorted(name for name in found if is_config_map_of(name, storage)
                  and name != current and name not in named)


def peer_service_name(name: str) -> str:
    return f"{name}-peers"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin"


# The label naming a storage's objects after it.
INSTANCE_LABEL = "app.kubernetes.io/instance"
# What the site pods of every storage carry (site_selector_labels adds the storage's
# name): the operator watches the pods that have them.
SITE_POD_LABELS = {"app.kubernetes.io/name": "stratamq", "app.kubernetes.io/component": "broker"}


def selector_labels(name: str) -> dict[str, str]:
    """The StatefulSet's selector, which its volume claims carry too. A StatefulSet's
    selector is immutable, so this stays as first released; it also matches the chart's
    operator pod when a storage is named after the release (`durableStorage.create`),
    so whatever looks for the sites' pods uses `site_selector_labels` instead (the
    StatefulSet itself never adopts that pod: a ReplicaSet owns it)."""
    return {"app.kubernetes.io/name": "stratamq", INSTANCE_LABEL: name}


def label_selector(labels: Mapping[str, str]) -> str:
    """`labels` as a label selector string (`key=value,...`)."""
    return ",".join(f"{key}={value}" for key, value in labels.items())


def selector(name: str) -> str:
    """`selector_labels` as a string: finds the sites' volume claims."""
    return label_selector(selector_labels(name))


def site_selector_labels(name: str) -> dict[str, str]:
    """What selects the sites' pods and nothing else: Services, the disruption budget,
    the operator's pod listing and the scale subresource's selector."""
    return {**selector_labels(name), **SITE_POD_LABELS}


def site_selector(name: str) -> str:
    """`site_selector_labels` as a string (status.selector, the pod listing)."""
    return label_selector(site_selector_labels(name))


def labels(name: str) -> dict[str, str]:
    return {**site_selector_labels(name), "app.kubernetes.io/managed-by": MANAGED_BY}


def metadata(owner: Owner, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": labels(owner.name),
            "ownerReferences": [owner.reference()]}


# --- ports ----------------------------------------------------------------------------

def _listener(spec: dict[str, Any], name: str, default_port: int,
              default_enable: bool) -> tuple[bool, int]:
    given = spec.get("listeners", {}).get(name, {})
    return bool(given.get("enable", default_enable)), int(given.get("port", default_port))


def container_ports(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The broker's ports, named (Services and probes refer to them by name)."""
    ports = []
    for listener, port_name, default_port, default_enable in (
            ("tcp", "mqtt", 1883, True), ("ws", "mqtt-ws", 8083, True),
            ("tls", "mqtts", 8883, False)):
        enabled, port = _listener(spec, listener, default_port, default_enable)
        if enabled:
            ports.append({"name": port_name, "containerPort": port, "protocol": "TCP"})
    ports.append({"name": "admin", "containerPort": parse_spec(spec).admin_port,
                  "protocol": "TCP"})
    ports.append({"name": "peer", "containerPort": PEER_PORT, "protocol": "TCP"})
    return ports


def host_network(spec: dict[str, Any]) -> bool:
    """spec.hostNetwork: the sites run in their node's network namespace."""
    return bool(spec.get("hostNetwork", False))


# The broker config keys (as STRATAMQ__ variables) that bind each port, by port name.
_BIND_ENV = {"mqtt": "STRATAMQ__LISTENERS__TCP__BIND",
             "mqtt-ws": "STRATAMQ__LISTENERS__WS__BIND",
             "mqtts": "STRATAMQ__LISTENERS__TLS__BIND",
             "admin": "STRATAMQ__ADMIN__BIND",
             "peer": "STRATAMQ__CLUSTER__PEER_BIND"}


def _pod_ip_binds(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """On the host network a site binds its node's address (its pod IP) only, not all
    of the node's addresses: the node's other interfaces, and other sites on the same
    node at other addresses, keep their ports. The kubelet expands $(POD_IP) because
    these variables come after it in the env list."""
    return [{"name": _BIND_ENV[port["name"]], "value": f"$({POD_IP_ENV}):{port['containerPort']}"}
            for port in container_ports(spec)]


# spec.service.nodePorts' keys, by port name
_NODE_PORT_KEYS = {"mqtt": "mqtt", "mqtt-ws": "mqttWs", "mqtts": "mqtts"}


def _service_ports(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The MQTT listeners only: the peer port is between sites and the admin API (and
    /metrics) is for the operator and Prometheus, both on the headless Service."""
    node_ports = spec.get("service", {}).get("nodePorts", {})
    ports = []
    for port in container_ports(spec):
        if port["name"] not in _NODE_PORT_KEYS:
            continue
        made = {"name": port["name"], "port": port["containerPort"],
                "targetPort": port["name"], "protocol": "TCP"}
        if _NODE_PORT_KEYS[port["name"]] in node_ports:
            made["nodePort"] = node_ports[_NODE_PORT_KEYS[port["name"]]]
        ports.append(made)
    return ports


# --- objects --------------------------------------------------------------------------

def rendered_config(spec: dict[str, Any]) -> str:
    return yaml.safe_dump(broker_config_module.broker_config(spec), sort_keys=True)


def config_map(owner: Owner, spec: dict[str, Any]) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(owner, config_map_name(owner.name, spec)),
            "immutable": True, "data": {CONFIG_FILE: rendered_config(spec)}}


def admin_secret(owner: Owner, token: str) -> Manifest:
    """The admin API token the sites accept and the operator calls them with. Made
    once (a new token on every reconcile would lock the operator out of running pods)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(owner, admin_secret_name(owner.name)),
            "stringData": {TOKEN_KEY: token}}


def peer_service(owner: Owner, spec: dict[str, Any]) -> Manifest:
    """Headless: one DNS name per pod (<pod>.<name>-peers), published before the pods
    are ready, since sites and the operator must reach a site while it is joining.
    It carries the admin port too: the operator and Prometheus (the ServiceMonitor,
    which then scrapes a site that is not ready as well) reach each site by it."""
    meta = metadata(owner, peer_service_name(owner.name))
    meta["labels"][SERVICE_LABEL] = "peers"  # what the ServiceMonitor selects
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": site_selector_labels(owner.name),
                     "ports": [{"name": "admin", "port": parse_spec(spec).admin_port,
                                "targetPort": "admin", "protocol": "TCP"},
                               {"name": "peer", "port": PEER_PORT,
                                "targetPort": "peer", "protocol": "TCP"}]}}


def client_service(owner: Owner, spec: dict[str, Any]) -> Manifest:
    """The MQTT clients' Service `<name>`, of spec.service's type (ClusterIP by
    default; NodePort or LoadBalancer for clients outside the cluster)."""
    given = spec.get("service", {})
    meta = metadata(owner, owner.name)
    # the operator's labels win; annotations are the user's (a cloud's load balancer
    # settings)
    meta["labels"] = {**given.get("labels", {}), **meta["labels"], SERVICE_LABEL: "client"}
    if given.get("annotations"):
        meta["annotations"] = dict(given["annotations"])
    service_type = given.get("type", "ClusterIP")
    made: dict[str, Any] = {"type": service_type,
                            "selector": site_selector_labels(owner.name),
                            "ports": _service_ports(spec)}
    if service_type != "ClusterIP" and "externalTrafficPolicy" in given:
        made["externalTrafficPolicy"] = given["externalTrafficPolicy"]
    if service_type == "LoadBalancer":
        for key in ("loadBalancerClass", "loadBalancerSourceRanges"):
            if key in given:
                made[key] = given[key]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": made}


def _secret_volumes(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(volume name, Secret name, mount path) of the Secrets the config refers to."""
    found = []
    tls = spec.get("listeners", {}).get("tls", {})
    if "secretName" in tls:
        found.append(("tls", tls["secretName"], TLS_MOUNT))
    access = spec.get("accessControl", {})
    if "passwordSecret" in access:
        found.append(("passwd", access["passwordSecret"]["name"], PASSWORD_MOUNT))
    if "aclSecret" in access:
        found.append(("acl", access["aclSecret"]["name"], ACL_MOUNT))
    return found


def spark_claim(spec: dict[str, Any]) -> str | None:
    """The Spark jobs' shared volume claim (spec.spark.volume), if any."""
    claim: str | None = spec.get("spark", {}).get("volume", {}).get("claimName")
    return claim


def image_pull_secrets(spec: dict[str, Any]) -> list[str]:
    """The names of spec.pod.imagePullSecrets: the sites' pods and the Spark jobs'
    pull the same image with them."""
    return [secret["name"] for secret in spec.get("pod", {}).get("imagePullSecrets", [])]


def split_image(reference: str) -> tuple[str, str]:
    """`registry:5000/team/stratamq:1.2` -> (`registry:5000/team/stratamq`, `1.2`); a
    reference without a tag has `latest`, as the container runtime reads it."""
    repository, colon, tag = reference.rpartition(":")
    if not colon or "/" in tag:
        return reference, "latest"
    return repository, tag


def operator_namespace() -> str | None:
    """The namespace the operator's pod runs in: STRATAMQ_OPERATOR_NAMESPACE (the chart
    sets it from the downward API), else its service account's; None outside a pod."""
    given = os.environ.get(OPERATOR_NAMESPACE_ENV)
    if given:
        return given
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
    except OSError:
        return None


def operator_image() -> str:
    """The image the operator runs, which the chart gives it
    (STRATAMQ_OPERATOR_IMAGE); outside the chart, stratamq/stratamq at this package's
    version. The sites run the same image by default."""
    given = os.environ.get(OPERATOR_IMAGE_ENV)
    if given:
        return given
    try:
        version = importlib.metadata.version("stratamq")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version = "0.1.0"
    return f"stratamq/stratamq:{version}"


def image(spec: dict[str, Any], default: str | None = None) -> str:
    """The sites' image: spec.image's repository and tag, each defaulting to the
    operator's own image's (`default`, else `operator_image()`) when the objects are
    applied, so a new operator rolls the sites to its version unless a tag is set."""
    repository, tag = split_image(operator_image() if default is None else default)
    given = spec.get("image", {})
    return f"{given.get('repository', repository)}:{given.get('tag', tag)}"


def _container(owner: Owner, spec: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image(spec),
        "imagePullPolicy": spec.get("image", {}).get("pullPolicy", "IfNotPresent"),
        "command": ["stratamq", "broker", "--config", CONFIG_PATH],
        # The config's paths are relative to the root (see config.py).
        "workingDir": "/",
        "ports": container_ports(spec),
        "env": [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                    "name": admin_secret_name(owner.name), "key": TOKEN_KEY}}},
                {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                # $(POD_IP): the kubelet expands variables defined before this one.
                {"name": ADVERTISE_ENV, "value": f"$({POD_IP_ENV}):{PEER_PORT}"},
                *(_pod_ip_binds(spec) if host_network(spec) else [])],
        # /healthz answers while a large storage is still opening; /readyz only once
        # the site serves clients.
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "admin"},
                           "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "admin"},
                          "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": DATA_VOLUME, "mountPath": DATA_MOUNT},
            *({"name": volume, "mountPath": path, "readOnly": True}
              for volume, _, path in _secret_volumes(spec)),
            *([{"name": SPARK_WORK_VOLUME, "mountPath": SPARK_WORK_MOUNT}]
              if spark_claim(spec) else []),
        ],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    container["resources"] = spec.get("resources") or DEFAULT_RESOURCES
    pod = spec.get("pod", {})
    container["env"] += pod.get("env", [])
    container["volumeMounts"] += pod.get("volumeMounts", [])
    return container


def _placement(owner: Owner, spec: dict[str, Any]) -> dict[str, Any]:
    """Where the sites' pods may and would rather run (spec.pod). Unless the spec says
    otherwise, a node takes a second site only when it must (a shard's replicas on
    one node all go with it), and the sites spread over the zones when the nodes
    have zones: both preferences, so a small cluster still runs every site."""
    pod = spec.get("pod", {})
    sites = {"matchLabels": site_selector_labels(owner.name)}
    found: dict[str, Any] = {
        "affinity": pod.get("affinity", {"podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100,
                "podAffinityTerm": {"topologyKey": HOSTNAME_KEY, "labelSelector": sites}}]}}),
        "topologySpreadConstraints": pod.get("topologySpreadConstraints", [{
            "maxSkew": 1, "topologyKey": ZONE_KEY, "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": sites}]),
    }
    for key in ("nodeSelector", "tolerations", "priorityClassName", "imagePullSecrets",
                "serviceAccountName"):
        if key in pod:
            found[key] = pod[key]
    return found


def _volume_claim_template(spec: dict[str, Any]) -> dict[str, Any]:
    storage = spec.get("storage", {})
    size = parse_spec(spec).storage_size
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": size}}}
    if "storageClassName" in storage:
        claim["storageClassName"] = storage["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": DATA_VOLUME}, "spec": claim}


def config_hash(spec: dict[str, Any]) -> str:
    """Changes whenever the rendered config does: the pod template carries it, so a new
    config rolls the pods (the broker reads its config at start only)."""
    return hashlib.sha256(rendered_config(spec).encode()).hexdigest()[:16]


def update_strategy(spec: dict[str, Any], replicas: int) -> dict[str, Any]:
    """spec.updateStrategy as the StatefulSet's: a rolling update whose partition is
    the spec's, or every pod (`replicas`) while paused."""
    given = spec.get("updateStrategy", {})
    partition = replicas if given.get("paused", False) else int(given.get("partition", 0))
    return {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}


def held_pods(spec: dict[str, Any], replicas: int) -> int:
    """How many of `replicas` pods spec.updateStrategy keeps on their template."""
    partition: int = update_strategy(spec, replicas)["rollingUpdate"]["partition"]
    return min(replicas, partition)


# On the sites' StatefulSet: the storage's spec it was last applied from. An operator
# that starts while the storage's spec is one the broker would refuse (nothing of it
# applied) follows this one, so failovers go on (handlers.control).
APPLIED_SPEC_ANNOTATION = f"{GROUP}/applied-spec"


def applied_spec_of(stateful_set: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The spec a StatefulSet made here was applied from (APPLIED_SPEC_ANNOTATION);
    None when it has none or it is not a JSON object."""
    annotations = ((stateful_set or {}).get("metadata") or {}).get("annotations") or {}
    try:
        found = json.loads(annotations.get(APPLIED_SPEC_ANNOTATION, ""))
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def stateful_set(owner: Owner, spec: dict[str, Any], replicas: int | None = None) -> Manifest:
    """`replicas`: the pods to keep, which is more than spec.sites while departing
    pods still hold replicas (the operator drains them before it shrinks the set)."""
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(owner.name, spec)}}]
    volumes += [{"name": volume, "secret": {"secretName": secret}}
                for volume, secret, _ in _secret_volumes(spec)]
    claim = spark_claim(spec)
    if claim:
        volumes.append({"name": SPARK_WORK_VOLUME,
                        "persistentVolumeClaim": {"claimName": claim}})
    pod = spec.get("pod", {})
    volumes += pod.get("volumes", [])
    count = parse_spec(spec).sites if replicas is None else replicas
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {**metadata(owner, owner.name), "annotations": {
            APPLIED_SPEC_ANNOTATION: json.dumps(spec, sort_keys=True, separators=(",", ":"))}},
        "spec": {
            "replicas": count,
            "serviceName": peer_service_name(owner.name),
            # Sites start independently; nothing is gained by starting them in order.
            "podManagementPolicy": "Parallel",
            # No revisions kept beyond those a roll needs (the current and the update
            # one, which a held roll's pods come back from): each names its config's
            # ConfigMap, which stays while one does.
            "revisionHistoryLimit": 0,
            "updateStrategy": update_strategy(spec, count),
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain",
                                                     "whenScaled": "Retain"},
            "selector": {"matchLabels": selector_labels(owner.name)},
            "template": {
                # the operator's own labels and annotation win over spec.pod's
                "metadata": {"labels": {**pod.get("labels", {}), **labels(owner.name)},
                             "annotations": {**pod.get("annotations", {}),
                                             CONFIG_HASH_ANNOTATION: config_hash(spec)}},
                "spec": {
                    "containers": [_container(owner, spec)],
                    "volumes": volumes,
                    "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    # OnRootMismatch: the kubelet walks the whole RocksDB volume at every
                    # mount otherwise, to set its group again
                    "securityContext": {**RESTRICTED_POD_SECURITY, "fsGroup": RUN_AS_USER,
                                        "fsGroupChangePolicy": "OnRootMismatch"},
                    **_placement(owner, spec),
                    **({"hostNetwork": True,
                        # Cluster DNS stays reachable from the node's namespace.
                        "dnsPolicy": "ClusterFirstWithHostNet"} if host_network(spec) else {}),
                },
            },
            "volumeClaimTemplates": [_volume_claim_template(spec)],
        },
    }


def disruption_budget(spec: dict[str, Any], tolerated: int | None) -> int:
    """The sites' PodDisruptionBudget's maxUnavailable: the sites that may go down at
    once with every shard keeping a majority of caught-up replicas (`tolerated`, from
    the replication controller, broker/controller/disruption.py; 0 while it does not
    know, so nothing is evicted on a guess), and at most
    spec.podDisruptionBudget.maxUnavailable when that is set. A PDB alone counts Ready
    pods, and a Ready pod whose replicas still catch up does not keep its shards'
    quorum: the operator sets the budget again as the replicas catch up or fall behind."""
    allowed = 0 if tolerated is None else tolerated
    cap = parse_spec(spec).max_unavailable
    return allowed if cap is None else min(allowed, cap)


def pod_disruption_budget(owner: Owner, spec: dict[str, Any],
                          tolerated: int | None = None) -> Manifest | None:
    """None when the spec turns it off. `tolerated`: see disruption_budget. A site
    that is not Ready (crash-looping, or still catching up) may always be evicted:
    it keeps no shard's quorum (it is not counted in `tolerated`), and with the
    default policy a budget of 0 would keep its node from ever draining."""
    if not parse_spec(spec).disruption_budget:
        return None
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(owner, owner.name),
            "spec": {"maxUnavailable": disruption_budget(spec, tolerated),
                     "selector": {"matchLabels": site_selector_labels(owner.name)},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def network_policy(owner: Owner, spec: dict[str, Any], operator_in: str | None
                   ) -> Manifest | None:
    """spec.networkPolicy: the sites' ingress. The MQTT listeners from
    `networkPolicy.clients` (anyone when unset); the peer port from the storage's own
    sites only; the admin API (and /metrics) from the operator's pods in its namespace
    `operator_in` (the storage's when not known: an operator outside the cluster is
    outside any NetworkPolicy anyway), the storage's Spark jobs, its sites
    (`stratamq ctl` run in a site's pod), and `networkPolicy.admin` (Prometheus, say).
    None unless enabled. A site on the host network (spec.hostNetwork) is outside any
    NetworkPolicy."""
    if not parse_spec(spec).network_policy:
        return None
    given = spec.get("networkPolicy", {})
    sites = {"podSelector": {"matchLabels": site_selector_labels(owner.name)}}
    mqtt = [{"port": port["containerPort"], "protocol": "TCP"}
            for port in container_ports(spec) if port["name"] in _NODE_PORT_KEYS]
    clients: dict[str, Any] = {"ports": mqtt}
    if given.get("clients"):
        clients["from"] = given["clients"]
    operator_pods: dict[str, Any] = {"podSelector": {"matchLabels": OPERATOR_POD_LABELS}}
    if operator_in is not None:
        # Only there: a pod with the operator's labels elsewhere is anybody's.
        operator_pods["namespaceSelector"] = {
            "matchLabels": {"kubernetes.io/metadata.name": operator_in}}
    admin_from = [operator_pods,
                  {"podSelector": {"matchLabels": {SPARK_STORAGE_LABEL: owner.name}}},
                  sites, *given.get("admin", [])]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, owner.name),
            "spec": {"podSelector": {"matchLabels": site_selector_labels(owner.name)},
                     "policyTypes": ["Ingress"],
                     "ingress": [
                         clients,
                         {"from": [sites], "ports": [{"port": PEER_PORT, "protocol": "TCP"}]},
                         {"from": admin_from,
                          "ports": [{"port": parse_spec(spec).admin_port,
                                     "protocol": "TCP"}]}]}}


# The pod label that names a site's storage, as Prometheus' Kubernetes discovery
# gives it to relabelling.
STORAGE_POD_LABEL = "__meta_kubernetes_pod_label_app_kubernetes_io_instance"


def service_monitor(owner: Owner) -> Manifest:
    """For the Prometheus operator (made only where its CRD exists): scrapes every
    site's /metrics through the headless Service's endpoints: every pod once, ready or
    not (a site that is not ready is the one whose metrics say why)."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": metadata(owner, owner.name),
            "spec": {"selector": {"matchLabels": {**selector_labels(owner.name),
                                                  SERVICE_LABEL: "peers"}},
                     "endpoints": [{"port": "admin", "path": "/metrics",
                                    "relabelings": [
                                        # the dashboards' Storage variable
                                        {"sourceLabels": [STORAGE_POD_LABEL],
                                         "targetLabel": "storage"},
                                        # a site by its pod (iot/mq-0), not its IP and
                                        # port, in the dashboards' legends and the
                                        # alerts; with its namespace, so that two
                                        # storages' mq-0 stay apart in every `by`
                                        {"sourceLabels": ["__meta_kubernetes_namespace",
                                                          "__meta_kubernetes_pod_name"],
                                         "separator": "/", "targetLabel": "instance"}]}]}}


def desired_objects(owner: Owner, spec: dict[str, Any], *, service_monitors: bool,
                    replicas: int | None = None,
                    tolerated: int | None = None) -> list[Manifest]:
    """Everything but the admin Secret (made once, see admin_secret), in the order to
    apply: what the pods mount before the pods. `replicas`: see stateful_set;
    `tolerated`: see disruption_budget."""
    objects = [config_map(owner, spec), peer_service(owner, spec),
               client_service(owner, spec), stateful_set(owner, spec, replicas)]
    budget = pod_disruption_budget(owner, spec, tolerated)
    if budget is not None:
        objects.append(budget)
    policy = network_policy(owner, spec, operator_namespace())
    if policy is not None:
        objects.append(policy)
    if service_monitors:
        objects.append(service_monitor(owner))
    return objects
