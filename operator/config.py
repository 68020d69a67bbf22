"""A DurableStorage spec as the broker configuration every one of its sites starts with.

The spec's sections are the broker's config sections with camelCase keys
(crds/README.md has the table); this module renames them, drops what is Kubernetes
only, and sets what the operator owns: binds on all addresses, the data folder on the
pod's volume and the files that come from Secrets.

Paths in the config are relative to the container's root (the pod runs with
`workingDir: /`): the same config then works in a real container and on the test
node (tests/support/kubelet.py), which runs each pod's broker in a folder of its own.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from stratamq.broker.config import Config

from .spec import parse_spec

# Where the pod's volumes are mounted (absolute, for the pod spec) ...
CONFIG_MOUNT = "/etc/stratamq"
DATA_MOUNT = "/var/lib/stratamq"
TLS_MOUNT = "/etc/stratamq-tls"
PASSWORD_MOUNT = "/etc/stratamq-passwd"
ACL_MOUNT = "/etc/stratamq-acl"
# The Spark jobs' shared volume (spec.spark.volume): a site writes the checkpoints the
# jobs read there, so it is at the same absolute path on the sites and the Spark pods.
SPARK_WORK_MOUNT = "/var/lib/stratamq-spark"
CONFIG_FILE = "stratamq.yaml"
# ... and the same places as the broker sees them from `workingDir: /`.
CONFIG_PATH = CONFIG_MOUNT.lstrip("/") + "/" + CONFIG_FILE
DATA_DIR = DATA_MOUNT.lstrip("/") + "/data"

# Spec sections that carry broker config keys one for one.
_PLAIN_SECTIONS = {"durableSessions": "durable_sessions", "mqtt": "mqtt"}
# Spec keys of `messages` that the broker config does not have: the replication factor
# is the operator's (the controller places the replicas), not a site's.
_MESSAGES_NOT_IN_CONFIG = {"replicationFactor"}
# The peer port (log shipping between replicas, writes forwarded to leaders).
PEER_PORT = 18084
# Where a site tells the others (through the operator's peers map) to reach its peer
# port: the Pod IP, from the downward API, expanded by the kubelet in the env value.
# Not the headless Service's DNS name: that resolves only once the pod's record is
# published and cached resolvers agree, and where no cluster DNS runs (the test node)
# not at all; the operator learns each site's address from its heartbeat every round
# and pushes the peers map again when a pod comes back with another IP.
POD_IP_ENV = "POD_IP"
ADVERTISE_ENV = "STRATAMQ__CLUSTER__ADVERTISE"


def snake(name: str) -> str:
    """`maxInflight` -> `max_inflight`."""
    return re.sub(r"([A-Z])", lambda match: "_" + match.group(1).lower(), name)


def snake_keys(value: Any) -> Any:
    """A spec value with every mapping key in snake_case (lists and scalars as they are)."""
    if isinstance(value, dict):
        return {snake(key): snake_keys(child) for key, child in value.items()}
    if isinstance(value, list):
        return [snake_keys(item) for item in value]
    return value


def _bind(port: int) -> str:
    # A pod has its own network namespace: all addresses means the pod's IP (and
    # loopback, for probes from inside).
    return f"0.0.0.0:{port}"


def _listeners(spec: dict[str, Any]) -> dict[str, Any]:
    listeners = spec.get("listeners", {})
    config: dict[str, Any] = {}
    if "backlog" in listeners:
        config["backlog"] = listeners["backlog"]
    for name, default_port in (("tcp", 1883), ("ws", 8083), ("tls", 8883)):
        given = listeners.get(name, {})
        section: dict[str, Any] = {"bind": _bind(given.get("port", default_port))}
        if "enable" in given:
            section["enable"] = given["enable"]
        if name == "ws" and "path" in given:
            section["path"] = given["path"]
        if name == "tls":
            if "verifyPeer" in given:
                section["verify_peer"] = given["verifyPeer"]
            if "secretName" in given:
                # A kubernetes.io/tls Secret mounted whole: tls.crt, tls.key, ca.crt.
                tls_dir = TLS_MOUNT.lstrip("/")
                section["certfile"] = f"{tls_dir}/tls.crt"
                section["keyfile"] = f"{tls_dir}/tls.key"
                if given.get("verifyPeer"):
                    section["cafile"] = f"{tls_dir}/ca.crt"
        config[name] = section
    return config


def _access_control(spec: dict[str, Any]) -> dict[str, Any]:
    access = spec.get("accessControl", {})
    config: dict[str, Any] = {}
    if "allowAnonymous" in access:
        config["allow_anonymous"] = access["allowAnonymous"]
    if "aclNoMatch" in access:
        config["acl_no_match"] = access["aclNoMatch"]
    if "passwordSecret" in access:
        config["password_file"] = (f"{PASSWORD_MOUNT.lstrip('/')}/"
                                   f"{access['passwordSecret'].get('key', 'passwd')}")
    if "aclSecret" in access:
        config["acl_file"] = (f"{ACL_MOUNT.lstrip('/')}/"
                              f"{access['aclSecret'].get('key', 'acl.yaml')}")
    return config


def broker_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The broker's config (as config/stratamq.yaml holds it) for a DurableStorage
    spec. Keys the spec leaves out keep the broker's defaults. The admin token is not
    here: it comes from a Secret through the environment (STRATAMQ__ADMIN__TOKEN)."""
    messages = {key: value for key, value in spec.get("messages", {}).items()
                if key not in _MESSAGES_NOT_IN_CONFIG}
    config: dict[str, Any] = {
        "durable_storage": {"messages": {**snake_keys(messages), "data_dir": DATA_DIR}},
    }
    for spec_key, config_key in _PLAIN_SECTIONS.items():
        if spec_key in spec:
            config[config_key] = snake_keys(spec[spec_key])
    config["listeners"] = _listeners(spec)
    access = _access_control(spec)
    if access:
        config["access_control"] = access
    config["admin"] = {"enable": True, "bind": _bind(parse_spec(spec).admin_port)}
    if spec.get("spark", {}).get("volume", {}).get("claimName"):
        # The Spark launch asks each site for its checkpoint in the shared volume; the
        # admin API refuses folders outside those it is given.
        config["admin"]["checkpoint_dirs"] = [SPARK_WORK_MOUNT]
    # The advertised address comes from the environment (ADVERTISE_ENV): the Pod IP is
    # not known when the ConfigMap is made.
    config["cluster"] = {**snake_keys(spec.get("cluster", {})), "enable": True,
                         "peer_bind": _bind(PEER_PORT)}
    return config


def config_problems(spec: dict[str, Any]) -> list[str]:
    """What the broker would refuse in the config made of this spec (the CRD's schema
    cannot say everything, e.g. mqtt.maxPacketSize above 256MiB), as `key: why` lines;
    empty when the broker accepts it. Checked by the broker's own config model."""
    try:
        Config.model_validate(broker_config(spec))
    except ValidationError as error:
        return [".".join(str(part) for part in problem["loc"]) + ": " + problem["msg"]
                for problem in error.errors()]
    return []
