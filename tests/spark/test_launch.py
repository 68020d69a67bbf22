"""`stratamq spark launch`, the program of the operator's scheduled runs, under a real
`spark-submit` (local master here instead of `k8s://`, the same `--master ""` path of
the driver) against two real sites: each site is checkpointed through its admin API
into the shared folder, GC is planned on Spark and applied through the same API, and
the checkpoints are removed while the plans stay; `stratamq spark submit` (the
operator's Job command around spark-submit) passes the run's outcome on, also when a
site does not answer.

Both sites keep alerts 90 days (the site itself drops a generation only after the
longest rule), so generation 1 goes only if the launched plan drops it. The run's
rules say other topics live 1 s; every message is older than that when Spark plans
(published, then 1.5 s and a rollover waited for), so no outcome depends on speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.processes import REPO, free_port, running_broker
from tests.spark.test_gc import wait_for_rollover
from tests.support.checkpoints import Published, publish_all
from tests.support.clients import ADMIN_TOKEN, admin_get, generations

CONFIG = {"durable_storage": {"messages": {"n_shards": 1}},
          "durable_sessions": {"message_retention_period": "4s",
                               "retention_rules": {"alerts/#": "90d"}}}


def submit(work: Path, run: str, sites: list[str]) -> subprocess.CompletedProcess[str]:
    """The operator's Job command, but for the master: `stratamq spark submit` around
    spark-submit of spark/main.py `launch gc` with the storage's rules."""
    command = [
        str(Path(sys.executable).parent / "stratamq"), "spark", "submit",
        "--result", str(work / run / "result.json"), "--",
        str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]",
        "--conf", "spark.ui.enabled=false", str(REPO / "spark" / "main.py"),
        "launch", "gc", *(part for site in sites for part in ("--site", site)),
        "--workdir", str(work), "--run", run, "--default", "1s", "--rule", "alerts/#=90d"]
    return subprocess.run(command, capture_output=True, text=True, timeout=800, env={
        **os.environ, "STRATAMQ_ADMIN_TOKEN": ADMIN_TOKEN,
        "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable})


@pytest.mark.timeout(900)  # JVMs of Spark local on a shared 2-core machine
def test_launch_plans_and_applies_gc_on_every_site(tmp_path: Path) -> None:
    with running_broker(tmp_path / "site-a", CONFIG) as first, \
            running_broker(tmp_path / "site-b", CONFIG) as second:
        # first: only logs (its generation 1 is dropped); second: logs and alerts
        # (rewritten: the alerts stay)
        publish_all(first, [Published("logger-a", f"logs/{n}", b"a", 1) for n in range(5)])
        publish_all(second, [Published("logger-b", f"logs/{n}", b"b", 1) for n in range(5)]
                    + [Published("alerter-b", f"alerts/{n}", b"!", 1) for n in range(3)])
        time.sleep(1.5)
        for site in (first, second):
            wait_for_rollover(site)

        work = tmp_path / "shared"
        done = submit(work, "run-1", [f"http://127.0.0.1:{first.admin_port}",
                                      f"http://127.0.0.1:{second.admin_port}"])
        assert done.returncode == 0, done.stderr[-4000:]
        result = json.loads((work / "run-1" / "result.json").read_text())
        assert (result["result"], len(result["sites_done"])) == ("Succeeded", 2)

        for index, site in enumerate((first, second)):
            folder = work / "run-1" / f"site-{index}"
            # the plan stays, and what the run read (each site its own one shard)
            assert sorted(path.name for path in folder.iterdir()) == ["checkpoint.json",
                                                                      "gc-plan.json"]
            read = json.loads((folder / "checkpoint.json").read_text())
            assert [shard["id"] for shard in read["shards"]] == [0]
            plan = json.loads((folder / "gc-plan.json").read_text())
            [site_view] = admin_get(site, "/api/v1/ds/sites")["data"]
            assert plan["site"] == site_view["site"]
            actions = {g["generation"]: g["action"] for g in plan["generations"]}
            assert actions[1] == ("drop" if site is first else "rewrite"), plan
        assert 1 not in generations(first)[0]
        assert 1 in generations(second)[0]

        # A site that does not answer: the run fails, says why in its result, and the
        # launching command fails with it.
        failed = submit(work, "run-2", [f"http://127.0.0.1:{second.admin_port}",
                                        f"http://127.0.0.1:{free_port()}"])
        assert failed.returncode == 1, failed.stderr[-4000:]
        result = json.loads((work / "run-2" / "result.json").read_text())
        assert result["result"] == "Failed" and "cannot reach" in result["message"], result
        assert [done["site"] for done in result["sites_done"]] == [
            f"http://127.0.0.1:{second.admin_port}"]
        # (locally the driver is spark-submit's own process, whose exit code it passes
        # on; in Kubernetes cluster mode only the result file tells)
        assert "spark-submit exited with 1" in failed.stderr

        # A second run of the same name writes over nothing: it fails at once.
        again = subprocess.run([sys.executable, "-m", "stratamq.broker", "spark", "launch",
                                "gc", "--site", f"http://127.0.0.1:{first.admin_port}",
                                "--workdir", str(work), "--run", "run-1", "--master",
                                "local[1]"],
                               capture_output=True, text=True, timeout=600,
                               env={**os.environ, "STRATAMQ_ADMIN_TOKEN": ADMIN_TOKEN})
        assert again.returncode == 1 and "exists" in again.stderr, again.stderr[-3000:]
