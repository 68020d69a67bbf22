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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from stratamq.broker.admin.ctl import human_bytes
from stratamq.broker.config import load_config, parse_duration
from stratamq.broker.ds import RetentionRules, Snapshot
from stratamq.broker.ds.gc import ACTIONS
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
                    help="say what the plan would do, per rule, and write nothing")
    gc.add_argument("--json", action="store_true",
                    help="print the plan's JSON (what goes and stays per rule goes to "
                         "stderr then)")
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
    if arguments.plan and not arguments.dry_run:
        Path(arguments.plan).write_text(text + "\n", encoding="utf-8")
    if arguments.json:
        print(text)  # the plan, for a program; what it does, for a person, beside it
    print(plan_report(plan), file=sys.stderr if arguments.json else sys.stdout)
    print(summary_line(plan, None if arguments.dry_run else arguments.plan),
          file=sys.stderr if arguments.json else sys.stdout)
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


def plan_report(plan: dict[str, Any]) -> str:
    """What a GC plan does, for a person: per rule, the generations of each action
    holding its messages (drop/rewrite/keep), its messages, those that go and those
    that stay, and their payload bytes; then the generations holding no message.
    Expired messages of a kept generation stay (the current one is never touched)."""
    retention = plan["retention"]
    rows: dict[str, dict[str, Any]] = {}
    for entry in plan["generations"]:
        for rule, counts in entry["by_rule"].items():
            row = rows.setdefault(rule, {"actions": dict.fromkeys(ACTIONS, 0), "messages": 0,
                                         "go": 0, "bytes_go": 0, "bytes": 0})
            row["actions"][entry["action"]] += 1
            row["messages"] += counts["messages"]
            row["bytes"] += counts["payload_bytes"]
            if entry["action"] != "keep":
                row["go"] += counts["expired_messages"]
                row["bytes_go"] += counts["expired_payload_bytes"]
    total_actions = {action: sum(1 for g in plan["generations"] if g["action"] == action)
                     for action in ACTIONS}
    table: list[tuple[str, ...]] = [
        ("rule", "retention", "generations", "messages", "go", "stay", "bytes go",
         "bytes stay"),
        ("", "", "drop/rewrite/keep", "", "", "", "(payload)", "(payload)")]
    for rule, row in sorted(rows.items(), key=lambda item: -item[1]["messages"]):
        seconds = retention["rules"].get(rule, retention["default"])
        table.append(_report_row(rule, _duration(seconds), row["actions"], row))
    empty = {action: sum(1 for g in plan["generations"]
                         if g["action"] == action and not g["messages"])
             for action in ACTIONS}
    totals = {key: sum(row[key] for row in rows.values())
              for key in ("messages", "go", "bytes_go", "bytes")}
    if any(empty.values()):  # no rule's: else the total's generations do not add up
        table.append(_report_row("(no messages)", "", empty, dict.fromkeys(totals, 0)))
    table.append(_report_row("total", "", total_actions, totals))
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    made = plan["made_at"]
    lines = [f"GC plan of {plan['db']} on site {plan['site']} from checkpoint "
             f"{plan['checkpoint']['dir']} ({_utc(plan['checkpoint']['created_at'])}), "
             f"expiry judged at {_utc(made)}:"]
    for line in table:
        lines.append("  ".join(cell.ljust(width) if column < 2 else cell.rjust(width)
                               for column, (cell, width) in enumerate(zip(line, widths,
                                                                          strict=True)))
                     .rstrip())
    return "\n".join(lines)


def _report_row(rule: str, retention: str, actions: dict[str, int],
                row: dict[str, int]) -> tuple[str, ...]:
    return (rule, retention, "/".join(str(actions[action]) for action in ACTIONS),
            str(row["messages"]), str(row["go"]), str(row["messages"] - row["go"]),
            human_bytes(row["bytes_go"]), human_bytes(row["bytes"] - row["bytes_go"]))


def _duration(seconds: float) -> str:
    """7d, 1h, 90s: the largest unit that takes it whole."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _utc(microseconds: int) -> str:
    moment = datetime.fromtimestamp(microseconds / 1_000_000, UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def summary_line(plan: dict[str, Any], path: str | None) -> str:
    """What the plan does, in a line: written to `path`, or a dry run's (None)."""
    summary = plan["summary"]
    stay = sum(g["messages"] for g in plan["generations"]) - summary["expired_messages"]
    kept_expired = stay - summary["live_messages"]
    what = (f"drop {summary['drop_generations']} generations "
            f"({human_bytes(summary['stored_bytes_dropped'])}), rewrite "
            f"{summary['rewrite_generations']}, keep {summary['keep_generations']}; "
            f"{summary['expired_messages']} expired messages go, {stay} stay "
            f"({summary['live_messages']} live, {kept_expired} expired in kept generations)")
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
