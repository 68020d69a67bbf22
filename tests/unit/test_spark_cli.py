"""`stratamq spark` refuses what it cannot do before Spark starts: a second of the
user's time, not a minute of work and a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stratamq.spark import gc
from stratamq.spark.cli import plan_report, spark_main, summary_line
from stratamq.spark.gc import DEFAULT_RULE


def test_export_to_an_existing_folder_is_refused_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "usage.parquet"
    out.mkdir()
    assert spark_main(["export", "--checkpoint", str(tmp_path / "none"), "--out",
                       str(out)]) == 1
    error = capsys.readouterr().err
    assert error.splitlines() == [f"stratamq spark export: --out {out} exists: the export "
                                  "writes a new folder (remove it, or name another)"]


def test_a_folder_that_is_no_checkpoint_is_refused_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spark_main(["gc", "--checkpoint", str(tmp_path), "--dry-run"]) == 1
    assert "is not a stratamq database folder or checkpoint" in capsys.readouterr().err


def generation(generation_id: int, *, current: bool = False, stored: int = 1000
               ) -> dict[str, Any]:
    return {"id": generation_id, "since": generation_id * 10, "until": None if current
            else generation_id * 10 + 10, "current": current, "bytes": stored}


def counts(messages: int, expired: int, size: int = 10) -> dict[str, int]:
    return {"messages": messages, "expired_messages": expired,
            "payload_bytes": messages * size, "expired_payload_bytes": expired * size}


def test_a_plan_is_told_per_rule_for_a_person() -> None:
    """`gc --dry-run` says what goes and what stays per rule (issue 28: 1,876 lines of
    JSON and no summary), from the plan the job makes (`gc._entry`, `gc._summary`)."""
    entries = [
        # shard 0: logs only, every message expired: dropped
        gc._entry(0, generation(1, stored=4096), {DEFAULT_RULE: counts(5, 5)}),
        # shard 1: sensors partly expired, logs all: rewritten
        gc._entry(1, generation(1), {"sensors/#": counts(4, 1, 100),
                                     DEFAULT_RULE: counts(2, 2)}),
        # shard 1's current generation: kept, though its logs expired too
        gc._entry(1, generation(2, current=True), {DEFAULT_RULE: counts(3, 3)}),
        # shard 2: an empty generation, dropped, and its current one, empty too
        gc._entry(2, generation(1, stored=100), {}),
        gc._entry(2, generation(2, current=True), {}),
    ]
    assert [entry["action"] for entry in entries] == ["drop", "rewrite", "keep", "drop", "keep"]
    plan = {"db": "messages", "site": "S1", "made_at": 1_795_860_000_000_000,
            "checkpoint": {"dir": "/ckpt/one", "created_at": 1_795_850_000_000_000},
            "retention": {"default": 86400.0, "rules": {"sensors/#": 604800.0}},
            "summary": gc._summary(entries), "generations": entries}
    lines = plan_report(plan).splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(
        ("sensors/#", DEFAULT_RULE, "(no messages)", "total"))}
    # rule, retention, generations drop/rewrite/keep, messages, go, stay, bytes go, stay
    assert rows["sensors/#"] == ["sensors/#", "7d", "0/1/0", "4", "1", "3", "100", "B",
                                 "300", "B"]
    assert rows[DEFAULT_RULE] == [DEFAULT_RULE, "1d", "1/1/1", "10", "7", "3", "70", "B",
                                  "30", "B"]
    assert rows["(no"] == ["(no", "messages)", "1/0/1", "0", "0", "0", "0", "B", "0", "B"]
    assert rows["total"] == ["total", "2/1/2", "14", "8", "6", "170", "B", "330", "B"]
    assert "/ckpt/one" in lines[0] and "2026-11-" in lines[0]
    assert summary_line(plan, None) == (
        "dry run, nothing written: the plan would drop 2 generations (4.1 KiB), rewrite 1, "
        "keep 2; 8 expired messages go, 6 stay (3 live, 3 expired in kept generations).")


def test_a_sites_data_folder_points_to_its_databases(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user gives the site's data folder (`data_dir`): the error names the database
    folders in it, which are what a job reads."""
    for db in ("messages", "sessions"):
        (tmp_path / db).mkdir()
        (tmp_path / db / "db.json").write_text('{"n_shards": 1}')
    assert spark_main(["gc", "--checkpoint", str(tmp_path), "--dry-run"]) == 1
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1, error
    assert f"a site's data folder: give a database's, such as {tmp_path / 'messages'}" \
        in error, error
