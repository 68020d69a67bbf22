"""A site's copy of the placement on a real folder: newest version wins, survives
reopening and kill -9 in the middle of writes, and a damaged file is a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stratamq.broker.ds.replication import Placement, PlannedSite, failover, plan
from stratamq.broker.ds.replication.store import PLACEMENT_FILE, PlacementStore
from stratamq.broker.errors import CorruptDataError, StalePlacementError

REPO = Path(__file__).resolve().parents[2]


def placements() -> tuple[Placement, Placement]:
    """Version 1, and version 2 after a failover of messages/0."""
    first = plan([PlannedSite(s) for s in "ABC"], ["messages", "sessions"], 4, 3).target
    shard = first.shard("messages", 0)
    second = failover(first, shard.id, alive_sites=set(shard.replicas) - {shard.leader},
                      positions={site: (1, 10) for site in shard.replicas})
    return first, second


def test_newest_version_wins_and_survives_reopening(tmp_path: Path) -> None:
    first, second = placements()
    folder = tmp_path / "site"  # not there yet: the store makes it
    store = PlacementStore(folder)
    assert store.current is None
    assert store.offer(first) is True
    assert PlacementStore(folder).current == first
    assert (folder / PLACEMENT_FILE).read_text() == first.to_json()
    assert (folder / PLACEMENT_FILE).stat().st_mode & 0o777 == 0o600

    # The same document again is no change; the file is not rewritten.
    inode = (folder / PLACEMENT_FILE).stat().st_ino
    assert store.offer(first) is False
    assert (folder / PLACEMENT_FILE).stat().st_ino == inode

    assert store.offer(second) is True
    with pytest.raises(StalePlacementError, match="version 1 is older than version 2"):
        store.offer(first)
    changed = Placement(version=2, shards=first.shards)
    with pytest.raises(StalePlacementError, match="differs from the document"):
        store.offer(changed)
    reopened = PlacementStore(folder)
    assert reopened.current == second
    # A reopened store refuses the older version just the same.
    with pytest.raises(StalePlacementError):
        reopened.offer(first)
    assert sorted(path.name for path in folder.iterdir()) == [PLACEMENT_FILE]


@pytest.mark.parametrize(("damage", "error"), [
    (lambda text: text[: len(text) // 2], "not JSON"),
    (lambda text: "", "not JSON"),
    (lambda text: text.replace('"leader": "A"', '"leader": "Z"', 1),
     "the leader 'Z' is not one of its replicas"),
    (lambda text: text.replace('"format": 1', '"format": 9'), "format 9 is not 1"),
])
def test_a_damaged_file_is_a_clear_error(tmp_path: Path, damage: Callable[[str], str],
                                        error: str) -> None:
    first, _ = placements()
    PlacementStore(tmp_path).offer(first)
    path = tmp_path / PLACEMENT_FILE
    path.write_text(damage(path.read_text()))
    with pytest.raises(CorruptDataError, match=f"{PLACEMENT_FILE}: the stored placement is "
                                               f"damaged .*{error}.*remove it"):
        PlacementStore(tmp_path)
    # Nothing was overwritten by the failed open.
    assert path.read_text() == damage(first.to_json())


def test_a_leftover_temp_file_of_a_crashed_write_is_removed(tmp_path: Path) -> None:
    first, _ = placements()
    PlacementStore(tmp_path).offer(first)
    leftover = tmp_path / f".{PLACEMENT_FILE}.abc123.tmp"
    leftover.write_text(first.to_json()[:100])
    assert PlacementStore(tmp_path).current == first
    assert not leftover.exists()


def test_kept_versions_survive_kill_9_during_writes(tmp_path: Path) -> None:
    for _round in range(3):
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.placement_crash_writer", str(tmp_path)],
            cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        kept: list[int] = []
        for line in process.stdout:
            if line.startswith("kept"):
                kept.append(int(line.split()[1]))
                if len(kept) >= 20:
                    break
        os.kill(process.pid, signal.SIGKILL)
        kept += [int(line.split()[1]) for line in process.stdout.read().splitlines()
                 if line.startswith("kept")]
        process.wait()
        assert process.returncode == -signal.SIGKILL
        # The file holds a whole document, at least as new as the last one promised
        # (one more may have been written and not yet reported).
        current = PlacementStore(tmp_path).current
        assert current is not None
        assert current.version in (kept[-1], kept[-1] + 1)
        assert current.n_shards("messages") == 256
