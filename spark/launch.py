"""`stratamq spark launch JOB --site URL ... --workdir DIR`: one scheduled run of a job,
the program the operator's Spark driver runs (`spark-submit ... spark-main.py launch
...`, or a SparkApplication's `mainApplicationFile`).

For each site in turn: a checkpoint through the site's admin API into the shared work
folder (a volume every site and every Spark pod mounts at the same path), the job on
that checkpoint in this driver's SparkSession, the result applied through the same
admin API (`gc`: the plan; `export` leaves its Parquet in the folder), then the
checkpoint is removed (its results stay). Every site, because a site's checkpoint
holds only the shards it has a replica of (what it applies goes through each shard's
log, to every replica). `learn-topics` takes every site's checkpoint first and learns
one seed from all of them (each shard counted once, from its newest copy), which it
then gives every site: a seed learned per site would leave the last site's.

The admin token comes from $STRATAMQ_ADMIN_TOKEN (the storage's admin Secret). A run
writes under `DIR/RUN/site-N/`; RUN is the launching Job's name (`--run`), so a run
started twice by hand never writes over another. Its outcome goes to
`DIR/RUN/result.json`, which `stratamq spark submit` (the launching Job's command,
around spark-submit) turns into the Job's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratamq.broker.admin.ctl import TOKEN_ENV, AdminClient, CtlError
from stratamq.broker.config import parse_duration
from stratamq.broker.ds import RetentionRules
from stratamq.broker.errors import StratamqError

DATABASE = "messages"
# The outcome of a run, in its folder.
RESULT_FILE = "result.json"


@dataclass(frozen=True, slots=True)
class SiteRun:
    """What one site's part of a run left: its folder and what the site answered."""

    site: str
    folder: Path
    applied: dict[str, Any] | None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratamq spark launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=["gc", "learn-topics", "export"])
    parser.add_argument("--site", action="append", required=True, metavar="URL",
                        help="a site's admin API base URL (repeatable: every site)")
    parser.add_argument("--workdir", required=True,
                        help="the shared folder (same path on the sites and here)")
    parser.add_argument("--run", default="", help="this run's name (default: the time)")
    parser.add_argument("--db", default=DATABASE, help=f"the database (default {DATABASE})")
    parser.add_argument("--default", default="1d", help="gc: retention of topics no rule "
                                                        "takes (the config's "
                                                        "message_retention_period)")
    parser.add_argument("--rule", action="append", default=[], metavar="FILTER=DURATION",
                        help="gc: a retention rule (repeatable)")
    parser.add_argument("--wildcard-thresholds", default="",
                        help="learn-topics: the sites' layout.wildcard_thresholds, "
                             "comma-separated (default: the broker's)")
    parser.add_argument("--hot-share", type=float, default=None,
                        help="learn-topics: see `stratamq spark learn-topics`")
    parser.add_argument("--top", type=int, default=8, help="export: patterns in the plot")
    parser.add_argument("--master", default="",
                        help='Spark master ("" (default) keeps spark-submit\'s)')
    return parser


def rules(arguments: argparse.Namespace) -> RetentionRules:
    found = {}
    for rule in arguments.rule:
        topic_filter, equals, duration = rule.rpartition("=")
        if not equals or not topic_filter:
            raise ValueError(f"--rule {rule!r}: write FILTER=DURATION, such as sensors/#=7d")
        found[topic_filter] = parse_duration(duration)
    return RetentionRules(parse_duration(arguments.default), found)


def thresholds(arguments: argparse.Namespace) -> list[int] | None:
    text: str = arguments.wildcard_thresholds
    return [int(part) for part in text.split(",")] if text else None


def client(url: str) -> AdminClient:
    token = os.environ.get(TOKEN_ENV)
    # A checkpoint of a large database takes a while.
    return AdminClient(url, f"Bearer {token}" if token else None, timeout=600.0)


def run_site(spark: Any, arguments: argparse.Namespace, site: AdminClient,
             folder: Path) -> dict[str, Any] | None:
    """Checkpoint, job, apply for one site (`gc`, `export`); the site's answer to the
    apply (None for export)."""
    database = urllib.parse.quote(arguments.db, safe="")
    checkpoint = folder / "checkpoint"
    folder.mkdir(parents=True)
    site.post(f"/api/v1/ds/storages/{database}/checkpoints", {"dir": str(checkpoint)})
    try:
        if arguments.job == "gc":
            from .gc import make_plan

            plan = make_plan(spark, str(checkpoint), rules(arguments))
            (folder / "gc-plan.json").write_text(json.dumps(plan, indent=2) + "\n",
                                                 encoding="utf-8")
            answer: dict[str, Any] = site.post(f"/api/v1/ds/storages/{database}/gc-plan",
                                               plan)
            return answer
        from .export import export_usage
        from .topics import DEFAULT_THRESHOLDS

        export_usage(spark, str(checkpoint), str(folder / "usage.parquet"),
                     str(folder / "usage.png"), arguments.top,
                     thresholds(arguments) or DEFAULT_THRESHOLDS)
        return None
    finally:
        # The checkpoint holds the site's files (hard links on the site's side, or
        # copies on this volume): only the results are worth keeping.
        shutil.rmtree(checkpoint, ignore_errors=True)


def learn_topics(spark: Any, arguments: argparse.Namespace, run_folder: Path) -> list[SiteRun]:
    """Every site's checkpoint, one seed from all of them, the seed given to every
    site; the checkpoints are removed, `seed.json` stays in the run's folder."""
    from .topics import DEFAULT_HOT_SHARE, make_seed

    database = urllib.parse.quote(arguments.db, safe="")
    sites = [client(url) for url in arguments.site]
    folders = [run_folder / f"site-{index}" for index in range(len(sites))]
    try:
        for site, folder in zip(sites, folders, strict=True):
            folder.mkdir(parents=True)
            site.post(f"/api/v1/ds/storages/{database}/checkpoints",
                      {"dir": str(folder / "checkpoint")})
        hot_share = (DEFAULT_HOT_SHARE if arguments.hot_share is None
                     else arguments.hot_share)
        seed = make_seed(spark, [str(folder / "checkpoint") for folder in folders],
                         thresholds(arguments), hot_share)
    finally:
        for folder in folders:
            shutil.rmtree(folder / "checkpoint", ignore_errors=True)
    (run_folder / "seed.json").write_text(json.dumps(seed, indent=2) + "\n",
                                          encoding="utf-8")
    done = []
    for url, site, folder in zip(arguments.site, sites, folders, strict=True):
        answer = site.put(f"/api/v1/ds/storages/{database}/topic-structure",
                          {"patterns": seed["patterns"]})
        done.append(SiteRun(site=url, folder=folder, applied=answer))
        print(f"stratamq spark launch learn-topics: seed given to {url}", file=sys.stderr)
    return done


def launch(arguments: argparse.Namespace) -> list[SiteRun]:
    """The run; its outcome is also written to `RUN/result.json` (what `stratamq spark
    submit` checks: spark-submit in cluster mode does not pass the driver's exit
    code on)."""
    from .session import spark_session

    run = arguments.run or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_folder = Path(arguments.workdir).absolute() / run
    if run_folder.exists():  # before Spark starts (seconds), and never another run's
        raise FileExistsError(f"{run_folder} exists: give each run a name of its own")
    run_folder.mkdir(parents=True)
    done: list[SiteRun] = []
    try:
        spark = spark_session(f"stratamq-{arguments.job}", arguments.master or None)
        try:
            if arguments.job == "learn-topics":
                done += learn_topics(spark, arguments, run_folder)
            else:
                for index, url in enumerate(arguments.site):
                    folder = run_folder / f"site-{index}"
                    answer = run_site(spark, arguments, client(url), folder)
                    done.append(SiteRun(site=url, folder=folder, applied=answer))
                    print(f"stratamq spark launch {arguments.job}: {url} done in {folder}",
                          file=sys.stderr)
        finally:
            spark.stop()
    except BaseException as exc:
        write_result(run_folder, "Failed", done, f"{type(exc).__name__}: {exc}")
        raise
    write_result(run_folder, "Succeeded", done, "")
    return done


def write_result(run_folder: Path, result: str, done: list[SiteRun], message: str) -> None:
    sites = [{"site": run.site, "folder": str(run.folder), "applied": run.applied}
             for run in done]
    (run_folder / RESULT_FILE).write_text(json.dumps(
        {"result": result, "message": message, "sites_done": sites}, indent=2) + "\n",
        encoding="utf-8")


def launch_main(argv: list[str]) -> int:
    """Returns the exit code: 0 done, 1 failed (a site's part failed: the runs of the
    sites before it stand), 2 bad usage."""
    try:
        arguments = parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        launch(arguments)
    except (CtlError, StratamqError, ValueError, OSError) as exc:
        print(f"stratamq spark launch {arguments.job}: {exc}", file=sys.stderr)
        return 1
    return 0


def submit_main(argv: list[str]) -> int:
    """`stratamq spark submit --result FILE -- spark-submit ...`: run spark-submit, then
    fail unless the run's result file says Succeeded. spark-submit in Kubernetes
    cluster mode exits 0 whatever the driver did (Spark 4.x), so the launching Job's
    own outcome (status.spark) comes from the file the driver writes (`launch`)."""
    if "--" not in argv:
        print("usage: stratamq spark submit --result FILE -- spark-submit ...",
              file=sys.stderr)
        return 2
    own, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    submit = argparse.ArgumentParser(prog="stratamq spark submit")
    submit.add_argument("--result", required=True, help="the run's result.json")
    try:
        arguments = submit.parse_args(own)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    if not command:
        print("stratamq spark submit: no command after --", file=sys.stderr)
        return 2
    code = subprocess.run(command, check=False).returncode  # its output is the pod's log
    if code != 0:
        print(f"stratamq spark submit: {command[0]} exited with {code}", file=sys.stderr)
        return code
    try:
        result = json.loads(Path(arguments.result).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"stratamq spark submit: the driver left no result ({exc}): it stopped "
              f"before the end; see the driver pod's log", file=sys.stderr)
        return 1
    if result.get("result") != "Succeeded":
        print(f"stratamq spark submit: the run failed: {result.get('message')}",
              file=sys.stderr)
        return 1
    return 0
