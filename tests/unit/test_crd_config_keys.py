"""The DurableStorage CRD speaks the broker's configuration: its sections carry the
config keys in camelCase, with the same defaults (no API server needed here; the
schema's behaviour on a real one is in tests/kube/test_crds.py)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from harness.processes import REPO
from stratamq.broker.config import Config

CRD = REPO / "crds" / "durablestorages.stratamq.io.yaml"

# spec section -> config section, for the sections the CRD carries key for key.
SECTIONS = {"messages": ("durable_storage", "messages"),
            "durableSessions": ("durable_sessions",),
            "mqtt": ("mqtt",),
            "cluster": ("cluster",)}
# Config keys the operator sets itself (each site's data folder is its volume; the
# peer port and the address a site advertises are the pod's) or does without (a
# site's zone is its node's, which the operator reads itself).
SET_BY_OPERATOR = {"messages": {"data_dir"},
                   "cluster": {"enable", "peer_bind", "advertise", "zone"}}
# Spec keys that are not broker config: the replication factor is the replication
# controller's (the operator places the replicas), not a site's.
NOT_IN_CONFIG = {"messages": {"replicationFactor"}}


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    schema: dict[str, Any] = (
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])
    return schema


def snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def defaults(schema: dict[str, Any]) -> Any:
    """What the API server fills in for an absent object: its properties' defaults."""
    if "properties" in schema:
        return {snake(key): defaults(child) for key, child in schema["properties"].items()
                if "default" in child}
    return schema["default"]


def section(config: Config, path: tuple[str, ...]) -> Any:
    node: Any = config
    for part in path:
        node = getattr(node, part)
    return node


def test_sections_carry_the_config_keys() -> None:
    spec = spec_schema()["properties"]
    for spec_key, path in SECTIONS.items():
        spec_keys = {snake(key) for key in spec[spec_key]["properties"]}
        config_keys = set(type(section(Config(), path)).model_fields)
        assert spec_keys - {snake(k) for k in NOT_IN_CONFIG.get(spec_key, ())} == (
            config_keys - SET_BY_OPERATOR.get(spec_key, set())), spec_key


def test_defaults_are_the_config_defaults() -> None:
    spec = spec_schema()["properties"]
    data: dict[str, Any] = {}
    for spec_key, path in SECTIONS.items():
        values = defaults(spec[spec_key])
        for key in NOT_IN_CONFIG.get(spec_key, ()):
            del values[snake(key)]
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = values
    # Parsed as a config file ("16MiB", "10s"), then compared to the built-in defaults.
    from_crd = Config.model_validate(data)
    for path in SECTIONS.values():
        assert section(from_crd, path) == section(Config(), path), path


def test_listener_and_access_defaults() -> None:
    spec = spec_schema()["properties"]
    listeners = defaults(spec["listeners"])
    config = Config()
    assert listeners["backlog"] == config.listeners.backlog
    for name in ("tcp", "ws", "tls"):
        built_in = getattr(config.listeners, name)
        assert listeners[name]["enable"] == built_in.enable, name
        assert listeners[name]["port"] == int(built_in.bind.rsplit(":", 1)[1]), name
    assert listeners["ws"]["path"] == config.listeners.ws.path
    assert listeners["tls"]["verify_peer"] == config.listeners.tls.verify_peer
    access = defaults(spec["accessControl"])
    assert access == {"allow_anonymous": config.access_control.allow_anonymous,
                      "acl_no_match": config.access_control.acl_no_match}
    assert defaults(spec["admin"])["port"] == int(config.admin.bind.rsplit(":", 1)[1])
