"""Crash safety: a writer killed with SIGKILL loses nothing it was told was stored."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stratamq.broker.ds import DurableStorage
from tests.integration.ds_crash_writer import KV_SHARDS, OPTIONS, batch_messages, kv_entry
from tests.support.storage import open_with_shards, read_filter, run

REPO = Path(__file__).resolve().parents[2]


def run_writer_until_killed(data_dir: Path, run_id: int, acks_before_kill: int,
                            layout: str) -> list[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.ds_crash_writer", str(data_dir), str(run_id),
         layout],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    acked: list[str] = []
    batches = 0  # only message batches count: key-value writes may go much faster
    for line in process.stdout:
        if line.startswith(("acked", "kv-acked")):
            acked.append(line)
            batches += line.startswith("acked")
            if batches >= acks_before_kill:
                break
    os.kill(process.pid, signal.SIGKILL)
    # whatever it printed before dying was acknowledged too
    acked += [line for line in process.stdout.read().splitlines()
              if line.startswith(("acked", "kv-acked"))]
    process.wait()
    assert process.returncode == -signal.SIGKILL
    return acked


# The layout each of the three writer runs gives its new generations: the writer
# adds generations as it goes, so "mixed" leaves generations of both layouts, and a
# crash in the middle of either.
LAYOUT_PLANS = {"v2": ["wildcard_optimized_v2"] * 3,
                "mixed": ["wildcard_optimized", "wildcard_optimized_v2", "wildcard_optimized"]}


@pytest.mark.parametrize("plan", LAYOUT_PLANS)
def test_acknowledged_batches_survive_sigkill(tmp_path: Path, plan: str) -> None:
    rng = random.Random(7)
    expected: set[bytes] = set()
    kv_expected: set[bytes] = set()
    kv_last: dict[bytes, int] = {}  # newest acknowledged value per overwritten key
    for run_id, layout in enumerate(LAYOUT_PLANS[plan]):
        for line in run_writer_until_killed(tmp_path, run_id, rng.randint(150, 600), layout):
            word, writer, batch = line.split()
            if word == "kv-acked":
                _routing, key, value = kv_entry(run_id, int(writer), int(batch))
                kv_expected.add(b"each/" + value)
                kv_last[key] = max(kv_last.get(key, -1), int(batch))
                continue
            expected |= {m.payload for m in batch_messages(run_id, int(writer), int(batch))}
    assert kv_expected, "the key-value writers were never acknowledged"

    async def check() -> None:
        storage = DurableStorage(tmp_path)
        database, shard_set = await open_with_shards(storage, "messages", OPTIONS)
        stored = await read_filter(storage, "messages", "crash/#", batch_size=500)
        payloads = {m.payload for m in stored}
        assert expected <= payloads, f"{len(expected - payloads)} acknowledged messages lost"
        # the learned structure is intact: every stored topic maps to a stream again
        for message in stored[:200]:
            levels = message.topic.split("/")
            assert any(g.trie.lookup(levels) is not None
                       for shard in shard_set.shards for g in shard.generations.values())
        # the generation table is intact: per shard, one current generation, the
        # newest, and every closed one ends where the next begins
        generations = database.list_generations()
        for shard in range(4):
            infos = [info for (s, _g), info in sorted(generations.items()) if s == shard]
            assert [info.is_current for info in infos] == [False] * (len(infos) - 1) + [True]
            assert all(a.until == b.since for a, b in itertools.pairwise(infos))
        assert len(generations) > 4  # the writers added generations before dying
        assert {info.layout for info in generations.values()} == set(LAYOUT_PLANS[plan])
        # every acknowledged key-value write is there; an overwritten key holds its
        # newest acknowledged value or a later one
        kv = await storage.open_kv_db("sessions", KV_SHARDS)
        kv_stored = {key for key, _value in await kv.scan(b"each/")}
        assert kv_expected <= kv_stored, f"{len(kv_expected - kv_stored)} kv writes lost"
        for key, number in kv_last.items():
            stored_value = dict(await kv.scan(key))[key]
            assert int(stored_value.split(b":")[2]) >= number
        # and it still takes writes
        await storage.store_batch("messages", batch_messages(99, 0, 0))
        await storage.close()
    run(check())
