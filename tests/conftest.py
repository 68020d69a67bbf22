"""Fixtures shared by every test.

`broker` is one real site per test module. A module configures it by defining
`BROKER_CONFIG` (a dict merged over the harness's test configuration, or a function of
the work directory returning one, for files such as a password file that must be
written first). Tests that need a site of their own (restarts, kill -9, a config of
their own) ask `broker_factory` for one instead.

Each test is marked with its tier, the name of its folder (unit, integration, spark,
kube, realnode: `pytest -m unit`, or the Makefile's `make test-unit`); the integration
modules that run several sites also carry `cluster` (their own `pytestmark`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.processes import BrokerProcess, running_broker
from tests.support.clients import PahoClient

BrokerConfig = dict[str, Any] | Callable[[Path], dict[str, Any]]

TESTS = Path(__file__).parent
TIERS = ("unit", "integration", "spark", "kube", "realnode")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0]
        if folder in TIERS:
            item.add_marker(folder)


def _config_of(module: object, workdir: Path) -> dict[str, Any]:
    config: BrokerConfig = getattr(module, "BROKER_CONFIG", {})
    return config(workdir) if callable(config) else config


@pytest.fixture(scope="module")
def broker(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """The module's site; at the end it must still be alive with no traceback logged."""
    workdir = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with running_broker(workdir, _config_of(request.module, workdir)) as process:
        yield process


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """`broker_factory(config=None, start=True)`: a site of this test's own, in a
    fresh folder under tmp_path; every one made is killed when the test ends."""
    made: list[BrokerProcess] = []

    def make(config: dict[str, Any] | None = None, start: bool = True) -> BrokerProcess:
        process = BrokerProcess(tmp_path / f"site-{len(made)}", config)
        made.append(process)
        return process.start() if start else process

    yield make
    for process in made:
        process.kill()


@pytest.fixture
def clients() -> Iterator[list[PahoClient]]:
    """Put the PahoClients a test makes here: they are stopped when it ends."""
    made: list[PahoClient] = []
    yield made
    for client in made:
        client.stop()
