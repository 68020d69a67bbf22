"""The `stratamq` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .config import load_config
from .errors import StratamqError
from .site import open_storage

log = logging.getLogger("stratamq")


async def run_broker(config_path: str | None) -> None:
    config = load_config(config_path)
    storage = await open_storage(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("site running; durable storage open. MQTT listeners are not built yet "
             "(see README). Stop with Ctrl-C or SIGTERM.")
    await stop.wait()
    log.info("stopping: flushing write buffers and closing storage")
    await storage.close()
    log.info("stopped cleanly")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratamq", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    broker = commands.add_parser("broker", help="run a site")
    broker.add_argument("--config", help="YAML configuration file (defaults apply without)")
    return parser


def main(argv: list[str] | None = None) -> None:
    arguments = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if arguments.command == "broker":
            import uvloop

            uvloop.run(run_broker(arguments.config))
    except StratamqError as error:
        print(f"stratamq: {error.message}", file=sys.stderr)
        raise SystemExit(2) from error
