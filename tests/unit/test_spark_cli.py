"""`stratamq spark` refuses what it cannot do before Spark starts: a second of the
user's time, not a minute of work and a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.spark.cli import spark_main


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
