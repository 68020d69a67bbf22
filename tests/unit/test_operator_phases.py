"""The status words the operator writes (operator/phases.py) are the ones the CRDs
allow: a phase the schema lacks would be refused by the API server at the first
status patch that used it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from harness.processes import REPO
from stratamq.operator.phases import (
    ADD_PHASES,
    REMOVE_PHASES,
    ConditionType,
    PlanResult,
    PlanTrigger,
    StoragePhase,
    TransitionPhase,
)
from stratamq.operator.status import invalid_conditions


def status_schema(crd: Path) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(crd.read_text())["spec"]["versions"][0][
        "schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    return found


def test_every_phase_is_one_the_crds_allow_and_the_other_way_round() -> None:
    storage = status_schema(REPO / "crds" / "durablestorages.stratamq.io.yaml")
    assert storage["phase"]["enum"] == list(StoragePhase)
    transition = status_schema(REPO / "crds" / "replicatransitions.stratamq.io.yaml")
    assert sorted(transition["phase"]["enum"]) == sorted(TransitionPhase)
    rebalance = storage["rebalance"]["properties"]
    assert rebalance["trigger"]["enum"] == list(PlanTrigger)
    assert rebalance["result"]["enum"] == list(PlanResult)
    # Each phase is on a step's way, or where a replaced plan ends it.
    assert set(ADD_PHASES) | set(REMOVE_PHASES) | {TransitionPhase.FAILED} == set(
        TransitionPhase)


def test_the_words_are_the_strings_the_api_server_stores() -> None:
    # A StrEnum member is its string: what a status read back holds compares equal.
    read_back: dict[str, str] = {"phase": "Degraded", "step": "CatchingUp"}
    assert read_back["phase"] == StoragePhase.DEGRADED
    assert read_back["step"] == TransitionPhase.CATCHING_UP
    conditions = invalid_conditions([], "bad", 3, "2026-11-27T00:00:00Z")
    assert [condition["type"] for condition in conditions] == [
        "Ready", "Degraded", "Rebalancing"] == list(ConditionType)
    assert {condition["reason"] for condition in conditions} == {"InvalidConfig"}
    assert yaml.safe_load(yaml.safe_dump([str(StoragePhase.READY)])) == ["Ready"]
