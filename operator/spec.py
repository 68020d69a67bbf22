"""A DurableStorage's spec as the operator decides on it: the values the replication
controller, the handlers and the objects' builders read, each with its default (the
CRD's, for a spec the API server has not defaulted, as in the unit tests), parsed from
the spec's dict by one function. The handlers parse it once per call and hand it on.

The sections that are rendered as they are (the broker's config from listeners,
messages, cluster and the rest; spec.pod into the pod template) stay the dict they
are: config.py and resources.py render them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_SITES = 3
DEFAULT_REPLICATION_FACTOR = 3
DEFAULT_N_SHARDS = 16
DEFAULT_HISTORY_LIMIT = 3
DEFAULT_MAX_CONCURRENT_MOVES = 1
DEFAULT_ADMIN_PORT = 18083
DEFAULT_STORAGE_SIZE = "10Gi"
DEFAULT_PROGRESS_DEADLINE = 600


@dataclass(frozen=True, slots=True)
class StorageSpec:
    sites: int  # spec.sites: the pods asked for, one site each
    replication_factor: int  # spec.messages.replicationFactor
    n_shards: int  # spec.messages.nShards
    # spec.transitionHistoryLimit: the plans whose ReplicaTransitions are kept (at least 1)
    history_limit: int
    # spec.maxConcurrentMoves: the shards a plan moves at once (at least 1)
    max_concurrent_moves: int
    admin_port: int  # spec.admin.port: the sites' admin API (and /metrics)
    storage_size: str  # spec.storage.size: each site's volume
    disruption_budget: bool  # spec.podDisruptionBudget.enable
    # spec.podDisruptionBudget.maxUnavailable: the cap on the budget (None: none)
    max_unavailable: int | None
    network_policy: bool  # spec.networkPolicy.enable
    # spec.updateStrategy.progressDeadlineSeconds: a pod not ready longer than this while
    # a roll or a scale is under way makes the storage Degraded (RolloutStuck)
    progress_deadline: float = float(DEFAULT_PROGRESS_DEADLINE)


def parse_spec(spec: Mapping[str, Any]) -> StorageSpec:
    """The spec's values (see StorageSpec), defaults filled in."""
    messages = spec.get("messages", {})
    budget = spec.get("podDisruptionBudget", {})
    cap = budget.get("maxUnavailable")
    return StorageSpec(
        sites=int(spec.get("sites", DEFAULT_SITES)),
        replication_factor=int(messages.get("replicationFactor", DEFAULT_REPLICATION_FACTOR)),
        n_shards=int(messages.get("nShards", DEFAULT_N_SHARDS)),
        history_limit=max(1, int(spec.get("transitionHistoryLimit", DEFAULT_HISTORY_LIMIT))),
        max_concurrent_moves=max(1, int(spec.get("maxConcurrentMoves",
                                                  DEFAULT_MAX_CONCURRENT_MOVES))),
        admin_port=int(spec.get("admin", {}).get("port", DEFAULT_ADMIN_PORT)),
        storage_size=str(spec.get("storage", {}).get("size", DEFAULT_STORAGE_SIZE)),
        disruption_budget=bool(budget.get("enable", True)),
        max_unavailable=None if cap is None else int(cap),
        network_policy=bool(spec.get("networkPolicy", {}).get("enable", False)),
        progress_deadline=float(spec.get("updateStrategy", {}).get(
            "progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE)),
    )
