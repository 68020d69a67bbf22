"""Checkpoints of a running site (`POST /api/v1/ds/storages/{db}/checkpoints`,
`stratamq ctl ds checkpoint`): every shard copied with a manifest, readable through
the storage's read-only snapshots; a stopped site's data folder reads the same way;
clear errors for an unknown database, an existing folder and a bad body."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.ds import Snapshot
from stratamq.broker.errors import FolderInUseError
from tests.support.checkpoints import (
    Published,
    admin_post,
    make_checkpoint,
    publish_all,
    snapshot_messages,
)
from tests.support.clients import ADMIN_TOKEN

MESSAGES = [Published(f"pub-{i % 5}", f"plant/{i % 3}/line/{i % 7}", b"m%d" % i, 1 + i % 2)
            for i in range(120)]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path / "site") as process:
        yield process


def read_everything(snapshot: Snapshot) -> list[tuple[str, str, bytes, int, int]]:
    """(client, topic, payload, qos, timestamp) of every message, by replaying `#`
    through each shard's streams with the snapshot's iterators."""
    return [(m.client_id, m.topic, m.payload, m.qos, m.timestamp)
            for _shard, _generation, _stream, m in snapshot_messages(snapshot, batch_size=50)]


def expected() -> list[tuple[str, str, bytes, int]]:
    return sorted((m.client_id, m.topic, m.payload, m.qos) for m in MESSAGES)


def test_checkpoint_holds_every_shard_and_reads_back(broker: BrokerProcess,
                                                     tmp_path: Path) -> None:
    publish_all(broker, MESSAGES)
    folder = tmp_path / "checkpoints" / "one"
    manifest = make_checkpoint(broker, folder)
    assert manifest["db"] == "messages" and manifest["n_shards"] == 4
    assert manifest["site"] == (broker.workdir / "data" / "site-id").read_text().strip()
    assert [shard["id"] for shard in manifest["shards"]] == [0, 1, 2, 3]
    for shard in manifest["shards"]:
        (current,) = [g for g in shard["generations"] if g["current"]]
        assert current["until"] is None and current["layout"] == "wildcard_optimized_v2"
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert not (tmp_path / "checkpoints" / "one.partial").exists()
    with Snapshot(folder) as snapshot:
        assert snapshot.manifest() == manifest
        found = read_everything(snapshot)
    assert sorted(row[:4] for row in found) == expected()
    # the committed position covers every message copied
    newest = max(shard["committed_timestamp"] for shard in manifest["shards"])
    assert max(row[4] for row in found) <= newest
    # publishing goes on; the checkpoint does not change
    publish_all(broker, [Published("late", "plant/late", b"x", 1)])
    with Snapshot(folder) as snapshot:
        assert len(read_everything(snapshot)) == len(MESSAGES)


def test_a_checkpoint_of_some_shards_holds_those_only(broker: BrokerProcess,
                                                      tmp_path: Path) -> None:
    """What a Spark run takes at each site (spark/launch.py): each shard's copy once."""
    publish_all(broker, MESSAGES)
    folder = tmp_path / "checkpoints" / "some"
    status, answer = admin_post(broker, "/api/v1/ds/storages/messages/checkpoints",
                                {"dir": str(folder), "shards": [3, 1]})
    assert status == 201, answer
    manifest = answer["manifest"]
    assert [shard["id"] for shard in manifest["shards"]] == [1, 3]
    assert sorted(path.name for path in folder.iterdir() if path.is_dir()) == ["1", "3"]
    with Snapshot(folder) as snapshot:
        assert snapshot.shard_ids == [1, 3] and snapshot.manifest() == manifest
        found = read_everything(snapshot)
    whole = make_checkpoint(broker, tmp_path / "checkpoints" / "all")
    with Snapshot(tmp_path / "checkpoints" / "all") as snapshot:
        in_those = [row for row in read_everything(snapshot)
                    if row in found]
    assert found and sorted(found) == sorted(in_those)
    assert len(found) < len(MESSAGES) and whole["n_shards"] == 4
    for bad in ([4], [-1], ["1"], 2, [True]):
        status, answer = admin_post(broker, "/api/v1/ds/storages/messages/checkpoints",
                                    {"dir": str(tmp_path / "bad"), "shards": bad})
        assert status == 400 and "shard ids from 0 to 3" in answer["message"], (bad, answer)
    assert not (tmp_path / "bad").exists()


def test_checkpoint_errors_are_clear(broker: BrokerProcess, tmp_path: Path) -> None:
    status, answer = admin_post(broker, "/api/v1/ds/storages/nope/checkpoints",
                                {"dir": str(tmp_path / "a")})
    assert status == 404 and "nope" in answer["message"], answer
    make_checkpoint(broker, tmp_path / "a")
    status, answer = admin_post(broker, "/api/v1/ds/storages/messages/checkpoints",
                                {"dir": str(tmp_path / "a")})
    assert status == 409 and "already exists" in answer["message"], answer
    status, answer = admin_post(broker, "/api/v1/ds/storages/messages/checkpoints",
                                {"folder": "x"})
    assert status == 400 and "dir" in answer["message"], answer
    # a relative folder goes under the site's data dir
    status, answer = admin_post(broker, "/api/v1/ds/storages/sessions/checkpoints",
                                {"dir": "sessions-copy"})
    assert status == 201, answer
    assert Path(answer["dir"]) == broker.workdir / "data" / "checkpoints" / "sessions-copy"
    assert answer["manifest"]["key_value"] is True


def test_ctl_checkpoint_and_stopped_site_folder(broker: BrokerProcess,
                                                tmp_path: Path) -> None:
    publish_all(broker, MESSAGES)
    done = subprocess.run(
        [sys.executable, "-m", "stratamq.broker", "ctl", "ds", "checkpoint", "messages",
         "ctl-copy", "--url", f"http://127.0.0.1:{broker.admin_port}"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "STRATAMQ_ADMIN_TOKEN": ADMIN_TOKEN})
    assert done.returncode == 0, done.stderr
    assert f"in {tmp_path / 'ctl-copy'}" in done.stdout
    assert "messages/3" in done.stdout and "current" in done.stdout
    again = subprocess.run(
        [sys.executable, "-m", "stratamq.broker", "ctl", "ds", "checkpoint", "messages",
         "ctl-copy", "--url", f"http://127.0.0.1:{broker.admin_port}"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "STRATAMQ_ADMIN_TOKEN": ADMIN_TOKEN})
    assert again.returncode == 1 and "409" in again.stderr and "already exists" in again.stderr
    # The running site's own folder is refused at once, not read while it changes (a
    # Spark job failed on a missing column family minutes in).
    live = broker.workdir / "data" / "messages"
    with pytest.raises(FolderInUseError, match="running site"):
        Snapshot(live)
    job = subprocess.run(
        [sys.executable, "-m", "stratamq.broker", "spark", "gc", "--checkpoint", str(live),
         "--dry-run"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert job.returncode == 1, job.stderr
    assert "is the folder of a running site" in job.stderr
    assert "stratamq ctl ds checkpoint messages DIR" in job.stderr
    assert broker.stop() == 0
    # Stopped, it reads, by readers in parallel too (Spark's workers are processes):
    # one reader's check does not refuse another's.
    with (live / "0" / "LOCK").open("rb") as held:
        fcntl.lockf(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
        reader = subprocess.run(
            [sys.executable, "-c", "import sys; from stratamq.broker.ds import Snapshot; "
                                   "Snapshot(sys.argv[1]).close()", str(live)],
            capture_output=True, text=True, timeout=60)
        assert reader.returncode == 0, reader.stderr
    with Snapshot(broker.workdir / "data" / "messages") as stopped:
        manifest = stopped.manifest()
        assert manifest["created_at"] is None and manifest["n_shards"] == 4
        assert sorted(row[:4] for row in read_everything(stopped)) == expected()
