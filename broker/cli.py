"""The `stratamq` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .admin.ctl import ctl_main
from .auth import passwd_main
from .config import load_config
from .errors import StratamqError
from .site import start_site

log = logging.getLogger("stratamq")


async def run_broker(config_path: str | None) -> None:
    config = load_config(config_path)
    site = await start_site(config)
    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()

    def stop_on(signum: int) -> None:
        received.append(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_on, signum)
    log.info("site running (ports %s). Stop with Ctrl-C or SIGTERM.", site.listeners.ports)
    await stop.wait()
    # SIGTERM (Kubernetes, a rolling restart) stops one site of a running cluster: it
    # hands the shards it leads over first. Ctrl-C stops now (a whole local cluster
    # stops at once, with no replica left to hand over to): they fail over.
    await site.stop(hand_over=received[0] == signal.SIGTERM)
    log.info("stopped cleanly")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratamq", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    broker = commands.add_parser("broker", help="run a site")
    broker.add_argument("--config", help="YAML configuration file (defaults apply without)")
    ctl = commands.add_parser("ctl", help="administration commands")
    ctl.add_argument("ctl_command", choices=["passwd", "clients", "ds"],
                     help="passwd: edit a password file; clients: connected clients; "
                          "ds info: databases, shards, sites, generations (of a site, or "
                          "of a cluster from its controller); ds checkpoint DB DIR: a "
                          "checkpoint for the Spark jobs; ds set-replicas DB SITE..., ds "
                          "join DB SITE, ds leave DB SITE, ds forget SITE: replica "
                          "placement, asked of the cluster controller")
    ctl.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the command")
    cluster = commands.add_parser(
        "cluster", help="a local cluster: controller and sites on one machine "
                        "(`cluster controller`: the controller alone)", add_help=False)
    cluster.add_argument("rest", nargs=argparse.REMAINDER,
                         help="options of `stratamq cluster` (--help for them)")
    spark = commands.add_parser("spark", help="the data pipeline's Spark jobs (gc, learn-topics, "
                                              "export); needs the spark extra (PySpark) "
                                              "and Java",
                                add_help=False)
    spark.add_argument("rest", nargs=argparse.REMAINDER, help="the job and its arguments")
    return parser


def run_spark(argv: list[str]) -> int:
    # Imported here: the broker runs without PySpark, which only the jobs need.
    try:
        from stratamq.spark.cli import spark_main
    except ImportError as exc:
        print(f"stratamq spark: {exc}: install the spark extra (pip install "
              "'stratamq[spark]'; Java 17+ must be on the machine)", file=sys.stderr)
        return 1
    return spark_main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["cluster"], ["spark"]):
        # Their own parsers (--help included): argparse's REMAINDER would not take
        # options that come first.
        argv = [argv[0], "--", *argv[1:]]
    arguments = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if arguments.command == "broker":
            import uvloop

            uvloop.run(run_broker(arguments.config))
        elif arguments.command == "cluster":
            from .controller.commands import cluster_main

            raise SystemExit(cluster_main(arguments.rest[1:]))
        elif arguments.command == "spark":
            raise SystemExit(run_spark(arguments.rest[1:]))
        elif arguments.ctl_command == "passwd":
            raise SystemExit(passwd_main(arguments.rest))
        else:
            raise SystemExit(ctl_main(arguments.ctl_command, arguments.rest))
    except StratamqError as error:
        print(f"stratamq: {error.message}", file=sys.stderr)
        raise SystemExit(2) from error
