"""`stratamq spark JOB --checkpoint DIR ...`: the data pipeline's jobs. Locally Spark
runs in `local[*]` and says only its errors; under `spark-submit --master k8s://...`
give `--master ""` to keep spark-submit's master. Paths are whatever the job's
machine sees (a volume in Kubernetes): nothing here assumes a local folder.

    stratamq spark gc --checkpoint /ckpt/messages-1 --config stratamq.yaml --dry-run
    stratamq spark gc --checkpoint /ckpt/messages-1 --rule 'sensors/#=7d' \\
        --default 1d --plan gc-plan.json
    stratamq spark learn-topics --checkpoint /ckpt/messages-1 --seed seed.json
    stratamq spark export --checkpoint /ckpt/messages-1 --out usage.parquet --plot usage.png

`stratamq spark launch JOB --site URL ... --workdir DIR` is what the operator's
scheduled runs execute (checkpoint of every site, the job, its result applied; see
stratamq.spark.launch and `stratamq spark launch --help`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stratamq.broker.admin.ctl import human_bytes
from stratamq.broker.config import load_config, parse_duration
from stratamq.broker.ds import RetentionRules, Snapshot
from stratamq.broker.errors import StratamqError

JOBS = ("gc", "learn-topics", "export")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratamq spark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    gc = jobs.add_parser("gc", help="generation GC with per-topic retention: write a plan")
    gc.add_argument("--checkpoint", required=True,
                    help="a checkpoint folder (stratamq ctl ds checkpoint) or a stopped "
                         "site's database folder")
    gc.add_argument("--config", help="broker config file: durable_sessions."
                                     "message_retention_period and retention_rules")
    gc.add_argument("--rule", action="append", default=[], metavar="FILTER=DURATION",
                    help="a retention rule (repeatable; over the config's rules)")
    gc.add_argument("--default", help="retention of topics no rule takes (over the config)")
    gc.add_argument("--now", type=int, help="the plan's time in µs (default: now)")
    gc.add_argument("--plan", help="write the plan to this file")
    gc.add_argument("--dry-run", action="store_true",
                    help="print the plan and write nothing")
    learn = jobs.add_parser("learn-topics", help="a seed topic structure for the next "
                                                 "generation, from the whole topic population")
    learn.add_argument("--checkpoint", required=True, action="append",
                       help="a checkpoint; repeat it with every site's checkpoint of a "
                            "cluster: each shard is counted once, from its newest copy")
    learn.add_argument("--config", help="broker config file: the wildcard thresholds")
    learn.add_argument("--hot-share", type=float, default=None,
                       help="share of a level's messages that earns a value its own "
                            "streams (default 0.25)")
    learn.add_argument("--seed", help="write the seed to this file (else print it)")
    export = jobs.add_parser("export", help="usage per topic pattern and hour to Parquet")
    export.add_argument("--checkpoint", required=True)
    export.add_argument("--out", required=True, help="a new Parquet folder")
    export.add_argument("--plot", help="also draw messages per hour of the top patterns "
                                       "into this PNG")
    export.add_argument("--top", type=int, default=8, help="patterns in the plot")
    export.add_argument("--config", help="broker config file: the wildcard thresholds the "
                                         "patterns are learned with")
    for job in (gc, learn, export):
        job.add_argument("--master", default="local[*]",
                         help='Spark master (default local[*]; "" keeps spark-submit\'s)')
    # Listed for --help only: `spark_main` hands them their arguments before parsing.
    jobs.add_parser("launch", add_help=False,
                    help="a scheduled run: checkpoint every site, run a job, apply its "
                         "result (the operator's runs; launch --help)")
    jobs.add_parser("submit", add_help=False,
                    help="run spark-submit, then fail unless the run's result file says "
                         "Succeeded (submit --help)")
    return parser


def retention_rules(arguments: argparse.Namespace) -> RetentionRules:
    sessions = load_config(arguments.config).durable_sessions
    default = sessions.message_retention_period
    rules = dict(sessions.retention_rules)
    if arguments.default:
        default = parse_duration(arguments.default)
    for rule in arguments.rule:
        topic_filter, equals, duration = rule.rpartition("=")
        if not equals or not topic_filter:
            raise ValueError(f"--rule {rule!r}: write FILTER=DURATION, such as sensors/#=7d")
        rules[topic_filter] = parse_duration(duration)
    return RetentionRules(default, rules)


def _check_checkpoint(path: str) -> None:
    """Fail before Spark starts (seconds) when the checkpoint cannot be read."""
    with Snapshot(path) as snapshot:
        snapshot.manifest()


def _gc(arguments: argparse.Namespace) -> int:
    if not arguments.dry_run and not arguments.plan:
        raise ValueError("give --plan FILE to write the plan, or --dry-run to print it")
    rules = retention_rules(arguments)
    _check_checkpoint(arguments.checkpoint)
    from .gc import make_plan
    from .session import spark_session

    spark = spark_session("stratamq-gc", arguments.master or None)
    try:
        plan = make_plan(spark, arguments.checkpoint, rules, arguments.now)
    finally:
        spark.stop()
    text = json.dumps(plan, indent=2)
    if arguments.dry_run:
        print(text)  # the plan, for a program; what it does, for a person:
        print(_summary_line(plan, None), file=sys.stderr)
    else:
        Path(arguments.plan).write_text(text + "\n", encoding="utf-8")
        print(_summary_line(plan, arguments.plan), file=sys.stderr)
    return 0


def _learn_topics(arguments: argparse.Namespace) -> int:
    thresholds = load_config(arguments.config).durable_storage.messages.layout.wildcard_thresholds
    from .session import spark_session
    from .topics import DEFAULT_HOT_SHARE, make_seed

    hot_share = DEFAULT_HOT_SHARE if arguments.hot_share is None else arguments.hot_share
    for checkpoint in arguments.checkpoint:
        _check_checkpoint(checkpoint)
    spark = spark_session("stratamq-learn-topics", arguments.master or None)
    try:
        seed = make_seed(spark, arguments.checkpoint, thresholds, hot_share)
    finally:
        spark.stop()
    text = json.dumps(seed, indent=2)
    if arguments.seed:
        Path(arguments.seed).write_text(text + "\n", encoding="utf-8")
        print(f"seed of {len(seed['patterns'])} stream patterns ({seed['topics']} topics) "
              f"written to {arguments.seed}. Apply it with: stratamq ctl ds seed-topics "
              f"{seed['db']} {arguments.seed}", file=sys.stderr)
    else:
        print(text)
    return 0


def _export(arguments: argparse.Namespace) -> int:
    # Refused before any work: Spark would fail on it after reading everything.
    if "://" not in arguments.out and Path(arguments.out).exists():
        raise ValueError(f"--out {arguments.out} exists: the export writes a new folder "
                         "(remove it, or name another)")
    from .export import export_usage
    from .session import spark_session

    thresholds = load_config(arguments.config).durable_storage.messages.layout.wildcard_thresholds
    _check_checkpoint(arguments.checkpoint)
    spark = spark_session("stratamq-export", arguments.master or None)
    try:
        summary = export_usage(spark, arguments.checkpoint, arguments.out, arguments.plot,
                               arguments.top, thresholds)
    finally:
        spark.stop()
    print(json.dumps(summary, indent=2))
    return 0


def _summary_line(plan: dict[str, Any], path: str | None) -> str:
    """What the plan does, in a line: written to `path`, or a dry run's (None)."""
    summary = plan["summary"]
    what = (f"drop {summary['drop_generations']} generations "
            f"({human_bytes(summary['stored_bytes_dropped'])}), rewrite "
            f"{summary['rewrite_generations']}, keep {summary['keep_generations']}; "
            f"{summary['expired_messages']} expired messages go, "
            f"{summary['live_messages']} live stay")
    if path is None:
        return f"dry run, nothing written: the plan would {what}."
    return (f"plan written to {path}: {what}. Apply it with: stratamq ctl ds apply-gc "
            f"{path}")


def spark_main(argv: list[str]) -> int:
    """Returns the exit code: 0 done, 1 failed, 2 bad usage."""
    if argv[:1] == ["launch"]:
        from .launch import launch_main

        return launch_main(argv[1:])
    if argv[:1] == ["submit"]:
        from .launch import submit_main

        return submit_main(argv[1:])
    try:
        arguments = _parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        if arguments.job == "learn-topics":
            return _learn_topics(arguments)
        if arguments.job == "export":
            return _export(arguments)
        return _gc(arguments)
    except (StratamqError, ValueError, OSError) as exc:
        print(f"stratamq spark {arguments.job}: {exc}", file=sys.stderr)
        return 1
