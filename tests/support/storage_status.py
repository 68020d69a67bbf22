"""Reading a DurableStorage's status (as `kubectl get -o json` gives it) and the output
of `kubectl get replicatransitions -w`: shared by the operator's tests on the stand-in
kubelet (tests/kube) and on real nodes (tests/realnode)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATABASES = ("messages", "sessions", "retained")


def site_of_pod(status: dict[str, Any]) -> dict[str, str]:
    return {site["pod"]: site["id"] for site in status.get("sites", [])}


def shards(status: dict[str, Any], database: str = "messages") -> list[dict[str, Any]]:
    [found] = [entry["shards"] for entry in status["databases"] if entry["name"] == database]
    return found  # type: ignore[no-any-return]


def every_shard(status: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """(database, shard) -> its status entry, for every replicated database."""
    return {(database, shard["shard"]): shard for database in DATABASES
            for shard in shards(status, database)}


def placed_shards(status: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """(database, shard) -> {"leader", "leaderEpoch"} from the placement the operator's
    controller keeps in `status.controller` (written every round, so it shows a new
    leader at once; `status.databases` follows at the next status refresh, which is
    10 s apart by default)."""
    placement = json.loads((status.get("controller") or {}).get("placement") or "{}")
    return {(database, entry["shard"]): {"leader": entry["leader"],
                                         "leaderEpoch": entry["epoch"]}
            for database, entries in placement.get("databases", {}).items()
            for entry in entries}


UNDER_WAY = ("Bootstrapping", "CatchingUp", "Joined", "Removing")


def most_under_way(path: Path) -> int:
    """The most ReplicaTransitions under way (Bootstrapping, CatchingUp, Joined or
    Removing) at one time, by the order in which `kubectl get -w` (`watched`'s input)
    showed their phases."""
    current: dict[str, str] = {}
    most = 0
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] != "<none>":
            current[parts[0]] = parts[1]
            most = max(most, sum(phase in UNDER_WAY for phase in current.values()))
    return most


def watched(path: Path) -> dict[str, list[str]]:
    """The phases each ReplicaTransition went through, in order, from the output of
    `kubectl get replicatransitions -w -o custom-columns=NAME:...,PHASE:...`."""
    phases: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] != "<none>":
            seen = phases.setdefault(parts[0], [])
            if not seen or seen[-1] != parts[1]:
                seen.append(parts[1])
    return phases
