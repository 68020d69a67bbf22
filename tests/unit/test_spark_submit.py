"""`stratamq spark submit --result FILE -- COMMAND`: the operator's Job command around
spark-submit. In Kubernetes cluster mode spark-submit exits 0 whatever the driver did,
so the outcome is the run's result file; here COMMAND is a process that exits 0 as
spark-submit does there (the whole chain under a real spark-submit:
tests/spark/test_launch.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
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


def test_a_stopped_job_stops_spark_submit(tmp_path: Path) -> None:
    """The Job's pod is stopped with SIGTERM (its deadline, a deletion): `stratamq spark
    submit` passes it on to spark-submit, whose driver then stops its executors,
    rather than leaving it running (as the pod's first process, it would otherwise
    ignore SIGTERM until the kubelet's SIGKILL)."""
    started = tmp_path / "child.pid"
    child = ("import os, pathlib, time; "
             f"pathlib.Path({str(started)!r}).write_text(str(os.getpid())); time.sleep(120)")
    submit = subprocess.Popen(
        [str(Path(sys.executable).with_name("stratamq")), "spark", "submit", "--result",
         str(tmp_path / "result.json"), "--", sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 60
        while not started.exists() or not started.read_text():
            assert time.monotonic() < deadline and submit.poll() is None
            time.sleep(0.1)
        child_pid = int(started.read_text())
        submit.send_signal(signal.SIGTERM)
        assert submit.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child_pid}").exists() and "zombie" not in Path(
                f"/proc/{child_pid}/status").read_text(errors="replace"):
            assert time.monotonic() < deadline, "spark-submit was left running"
            time.sleep(0.1)
    finally:
        submit.kill()
        submit.wait()
