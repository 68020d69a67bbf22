"""The DurableStorage CRD speaks the broker's configuration: the sections that mirror
it are generated from the config model (operator/crd_schema.py, `make crds`), keys in
camelCase, with the same defaults; the rest is written by hand (no API server needed
here; the schema's behaviour on a real one is in tests/kube/test_crds.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from harness.processes import REPO
from stratamq.broker.config import Config, parse_byte_size, parse_duration
from stratamq.operator.config import snake
from stratamq.operator.crd_schema import (
    BEGIN,
    CRD_FILE,
    END,
    SECTIONS,
    format_byte_size,
    format_duration,
    generate,
)

CRD = REPO / CRD_FILE

# spec section -> config section, for the generated sections.
SPEC_SECTIONS = {"messages": ("durable_storage", "messages"),
                 "durableSessions": ("durable_sessions",),
                 "mqtt": ("mqtt",),
                 "cluster": ("cluster",)}
# Spec keys of those sections that are not broker config (written by hand): the
# replication factor is the replication controller's (the operator places the
# replicas), not a site's.
NOT_IN_CONFIG = {"messages": {"replicationFactor"}}


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    schema: dict[str, Any] = (
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])
    return schema


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


def test_the_crd_is_what_the_config_model_generates() -> None:
    text = CRD.read_text()
    assert generate(text) == text, (
        f"{CRD_FILE} is not what the broker's config model generates: run `make crds`")


def test_the_generated_blocks_hold_nothing_written_by_hand() -> None:
    """Emptied, every generated block is written again whole."""
    text = CRD.read_text()
    emptied: list[str] = []
    lines = iter(text.splitlines())
    for line in lines:
        emptied.append(line)
        begin = BEGIN.match(line)
        if begin:
            end = begin["indent"] + END.format(section=begin["section"])
            emptied.append(next(old for old in lines if old == end))
    assert {begin["section"] for begin in map(BEGIN.match, emptied) if begin} == set(SECTIONS)
    assert generate("\n".join(emptied) + "\n") == text


def test_defaults_are_the_config_defaults() -> None:
    spec = spec_schema()["properties"]
    data: dict[str, Any] = {}
    for spec_key, path in SPEC_SECTIONS.items():
        values = defaults(spec[spec_key])
        for key in NOT_IN_CONFIG.get(spec_key, ()):
            del values[snake(key)]
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = values
    # Parsed as a config file ("16MiB", "10s"), then compared to the built-in defaults.
    from_crd = Config.model_validate(data)
    for path in SPEC_SECTIONS.values():
        assert section(from_crd, path) == section(Config(), path), path


@given(st.integers(min_value=0, max_value=10**10))
def test_a_formatted_duration_parses_back(milliseconds: int) -> None:
    # Within a float's rounding: the parser multiplies by the unit's seconds.
    assert parse_duration(format_duration(milliseconds / 1000)) == pytest.approx(
        milliseconds / 1000, rel=1e-12)


@given(st.integers(min_value=1, max_value=2**40))
def test_a_formatted_byte_size_parses_back(size: int) -> None:
    assert parse_byte_size(format_byte_size(size)) == size


def test_listener_and_access_defaults() -> None:
    """The hand-written sections that carry config keys."""
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
