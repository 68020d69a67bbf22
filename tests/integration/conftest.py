"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.mqtt_clients import PahoClient


@pytest.fixture
def clients() -> Iterator[list[PahoClient]]:
    """Put the PahoClients a test makes here: they are stopped when it ends."""
    made: list[PahoClient] = []
    yield made
    for client in made:
        client.stop()
