"""The spec as the operator decides on it (operator/spec.py): one parse, whose
defaults are the CRD's, for a spec the API server has not defaulted."""

from __future__ import annotations

from typing import Any

import yaml

from harness.processes import REPO
from stratamq.operator.spec import StorageSpec, parse_spec


def crd_default(*path: str) -> Any:
    schema = yaml.safe_load((REPO / "crds" / "durablestorages.stratamq.io.yaml").read_text())[
        "spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for key in path:
        schema = schema["properties"][key]
    return schema["default"]


def test_an_empty_spec_has_the_crds_defaults() -> None:
    assert parse_spec({}) == StorageSpec(
        sites=crd_default("sites"),
        replication_factor=crd_default("messages", "replicationFactor"),
        n_shards=crd_default("messages", "nShards"),
        history_limit=crd_default("transitionHistoryLimit"),
        max_concurrent_moves=crd_default("maxConcurrentMoves"),
        admin_port=crd_default("admin", "port"),
        storage_size=crd_default("storage", "size"),
        disruption_budget=crd_default("podDisruptionBudget", "enable"),
        max_unavailable=None,
        network_policy=crd_default("networkPolicy", "enable"))


def test_the_values_given_are_read() -> None:
    parsed = parse_spec({"sites": 5, "messages": {"replicationFactor": 2, "nShards": 4},
                         "transitionHistoryLimit": 10, "maxConcurrentMoves": 4,
                         "admin": {"port": 9000},
                         "storage": {"size": "1Gi"},
                         "podDisruptionBudget": {"enable": False, "maxUnavailable": 1},
                         "networkPolicy": {"enable": True}})
    assert parsed == StorageSpec(sites=5, replication_factor=2, n_shards=4, history_limit=10,
                                 max_concurrent_moves=4, admin_port=9000, storage_size="1Gi",
                                 disruption_budget=False, max_unavailable=1,
                                 network_policy=True)
    # At least one plan's ReplicaTransitions are kept, whatever a spec (not checked by
    # an API server) says.
    assert parse_spec({"transitionHistoryLimit": 0}).history_limit == 1
    assert parse_spec({"maxConcurrentMoves": 0}).max_concurrent_moves == 1
