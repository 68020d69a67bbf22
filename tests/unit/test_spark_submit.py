"""`stratamq spark submit --result FILE -- COMMAND`: the operator's Job command around
spark-submit. In Kubernetes cluster mode spark-submit exits 0 whatever the driver did,
so the outcome is the run's result file; here COMMAND is a process that exits 0 as
spark-submit does there (the whole chain under a real spark-submit:
tests/spark/test_launch.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stratamq.spark.cli import spark_main

EXITS_0 = [sys.executable, "-c", "pass"]


def test_succeeded_only_when_the_result_says_so(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "result.json"
    assert spark_main(["submit", "--result", str(result), "--", *EXITS_0]) == 1
    assert "the driver left no result" in capsys.readouterr().err
    result.write_text(json.dumps({"result": "Failed", "message": "CtlError: 409 Conflict"}))
    assert spark_main(["submit", "--result", str(result), "--", *EXITS_0]) == 1
    assert "the run failed: CtlError: 409 Conflict" in capsys.readouterr().err
    result.write_text(json.dumps({"result": "Succeeded", "message": ""}))
    assert spark_main(["submit", "--result", str(result), "--", *EXITS_0]) == 0


def test_a_failing_command_fails_with_its_code(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"result": "Succeeded", "message": ""}))
    assert spark_main(["submit", "--result", str(result), "--", sys.executable, "-c",
                       "raise SystemExit(3)"]) == 3
    assert spark_main(["submit", "--result", str(result)]) == 2


def test_a_failed_driver_in_client_mode_says_why(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """In client mode spark-submit exits with the driver's code; the Job's message (the
    log's last line) is still the run's reason from the result file."""
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"result": "Failed", "message": "CtlError: 409 Conflict"}))
    assert spark_main(["submit", "--result", str(result), "--", sys.executable, "-c",
                       "raise SystemExit(1)"]) == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.endswith("exited with 1: CtlError: 409 Conflict"), last_line
