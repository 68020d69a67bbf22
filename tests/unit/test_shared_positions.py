"""The file that keeps a site's shared groups across restarts (core/shared_positions.py):
what round-trips, what is refused, what is too old to load."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stratamq.broker.core.dispatch import AbsentGroup, Dispatcher
from stratamq.broker.core.shared_positions import FILE_NAME, SharedPositions, decode, encode
from stratamq.broker.errors import CorruptDataError

GROUPS = {"g/t/#": AbsentGroup({0: 17, 3: 1_700_000_000_000_000}, {"a", "b"}),
          "h/x": AbsentGroup({}, {"c"})}


def test_groups_round_trip() -> None:
    assert decode(encode(GROUPS, 12.5)) == (GROUPS, 12.5)


@pytest.mark.parametrize("text", ["", "[]", '{"format": 2, "saved_at": 1, "groups": {}}',
                                  '{"format": 1, "saved_at": 1}',
                                  '{"format": 1, "saved_at": 1, "groups": {"g/t": '
                                  '{"since": {"x": 1}, "away": []}}}'])
def test_a_damaged_file_is_refused(text: str) -> None:
    with pytest.raises(CorruptDataError):
        decode(text)


def load(path: Path, text: str, keep_for: float) -> list[str]:
    """The absent groups a dispatcher has after loading `text` from the file."""
    (path / FILE_NAME).write_text(text)
    dispatcher = Dispatcher()
    with ThreadPoolExecutor(1) as executor:
        asyncio.run(SharedPositions(dispatcher, path, executor, keep_for).load())
    return sorted(dispatcher.absent_groups)


def test_a_site_finds_the_groups_it_kept_unless_too_old_or_damaged(tmp_path: Path) -> None:
    assert load(tmp_path, encode(GROUPS, time.time()), 3600) == ["g/t/#", "h/x"]
    # older than the longest retention: storage holds nothing to read from there
    assert load(tmp_path, encode(GROUPS, time.time() - 7200), 3600) == []
    assert load(tmp_path, "{not json", 3600) == []  # logged; the groups start live
