"""`stratamq cluster ...` (a local cluster: controller and sites) and `stratamq cluster
controller ...` (the controller alone, as the supervisor and tests start it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import parse_duration
from ..errors import ConfigError
from .decisions import Settings


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number >= 1")
    return value


def _zones(text: str) -> tuple[str, ...]:
    zones = tuple(text.split(","))
    if not all(zones):
        raise argparse.ArgumentTypeError(f"{text!r} is not zone names separated by commas")
    return zones


def _duration(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive duration")
    return value


def cluster_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stratamq cluster",
        description="Run a local cluster: a controller and N sites, site k on "
                    "127.0.0.(k+1) with the standard ports. Ctrl-C stops them all. "
                    "`stratamq cluster controller --help`: the controller alone.")
    parser.add_argument("--sites", type=_positive, default=3, help="number of sites (3)")
    parser.add_argument("--data-dir", type=Path, default=Path("data/cluster"),
                        help="folder of the cluster: site-k/, controller/, admin-token "
                             "(data/cluster)")
    parser.add_argument("--replication-factor", type=_positive,
                        help="replicas per shard (default: 3, or the number of sites if "
                             "fewer)")
    parser.add_argument("--n-shards", type=_positive, default=16,
                        help="shards of the messages database (16)")
    parser.add_argument("--heartbeat-interval", type=_duration, default=1.0,
                        help="how often the controller probes each site; 3 missed "
                             "heartbeats and a site's shards fail over (1s)")
    parser.add_argument("--ports-from", type=_positive,
                        help="use ports P (MQTT), P+1 (WebSocket), P+2 (admin), P+3 (peer) "
                             "on each site's address and P+4 for the controller, instead "
                             "of the standard ports")
    parser.add_argument("--site-config", type=Path,
                        help="a YAML configuration under every site's own (listeners, "
                             "data folders, admin token and cluster settings are set over it)")
    parser.add_argument("--zones", type=_zones,
                        help="each site's failure zone (cluster.zone), in site order, "
                             "separated by commas (e.g. a,a,b,b): the controller keeps a "
                             "shard's replicas in distinct zones (default: none known)")
    _add_moves(parser)
    return parser


def controller_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stratamq cluster controller",
        description="Run the controller alone: it probes the sites, places shards, fails "
                    "over, carries out replica plans and serves the cluster API.")
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="the controller's state (placement, plan, known sites)")
    parser.add_argument("--bind", default="127.0.0.1:18090",
                        help="address of the cluster API (127.0.0.1:18090)")
    parser.add_argument("--site", action="append", default=[], metavar="URL",
                        help="a site's admin API base URL (http://127.0.0.2:18083); repeat "
                             "for each site")
    parser.add_argument("--token-file", type=Path, required=True,
                        help="the admin token the sites accept; the cluster API accepts the "
                             "same")
    parser.add_argument("--replication-factor", type=_positive, default=3)
    parser.add_argument("--n-shards", type=_positive, default=16,
                        help="shards of the messages database; must be the sites' n_shards")
    parser.add_argument("--heartbeat-interval", type=_duration, default=1.0)
    _add_moves(parser)
    return parser


def _add_moves(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-concurrent-moves", type=_positive, default=1,
                        help="how many shards a replica plan moves at once; each joining "
                             "replica copies its shard from the leader (1)")


def cluster_main(argv: list[str]) -> int:
    # Imported here: the supervisor does not need aiohttp, the controller does.
    if argv[:1] == ["controller"]:
        from .controller import ControllerConfig, run_controller
        from .site_client import site_url

        arguments = controller_parser().parse_args(argv[1:])
        try:
            urls = tuple(site_url(address) for address in arguments.site)
            token = arguments.token_file.read_text(encoding="utf-8").strip()
        except (ValueError, OSError) as exc:
            raise ConfigError(f"stratamq cluster controller: {exc}") from exc
        if not token:
            raise ConfigError(f"{arguments.token_file}: the admin token file is empty")
        settings = Settings(replication_factor=arguments.replication_factor,
                            n_shards=arguments.n_shards,
                            heartbeat_interval=arguments.heartbeat_interval,
                            expected_sites=len(urls),
                            max_concurrent_moves=arguments.max_concurrent_moves)
        config = ControllerConfig(data_dir=arguments.data_dir, bind=arguments.bind,
                                  site_urls=urls, token=token, settings=settings)
        import uvloop

        uvloop.run(run_controller(config))
        return 0

    from .supervisor import ClusterOptions, run_cluster

    arguments = cluster_parser().parse_args(argv)
    factor = arguments.replication_factor or min(3, arguments.sites)
    if factor > arguments.sites:
        raise ConfigError(f"replication factor {factor} needs at least {factor} sites; "
                          f"--sites is {arguments.sites}")
    if arguments.sites > 254:
        raise ConfigError("at most 254 sites (127.0.0.1 to 127.0.0.254)")
    if arguments.zones is not None and len(arguments.zones) != arguments.sites:
        raise ConfigError(f"--zones names {len(arguments.zones)} zones for "
                          f"{arguments.sites} sites: one per site")
    return run_cluster(ClusterOptions(
        sites=arguments.sites, data_dir=arguments.data_dir, replication_factor=factor,
        n_shards=arguments.n_shards, heartbeat_interval=arguments.heartbeat_interval,
        ports_from=arguments.ports_from, site_config=arguments.site_config,
        zones=arguments.zones or (), max_concurrent_moves=arguments.max_concurrent_moves))
