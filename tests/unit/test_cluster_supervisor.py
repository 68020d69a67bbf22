"""`stratamq cluster`'s layout: site k on 127.0.0.(k+1) with the standard ports (or
consecutive ones from --ports-from), its own folder, and a configuration every site
accepts with the cluster's settings over the --site-config ones."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from stratamq.broker.config import Config
from stratamq.broker.controller.commands import cluster_main, cluster_parser
from stratamq.broker.controller.supervisor import (
    HEALTHY_RUN,
    RESTART_DELAY,
    RESTART_DELAY_MAX,
    ClusterOptions,
    controller_command,
    layout,
    restart_delay,
    site_config,
)
from stratamq.broker.errors import ConfigError


def options(tmp_path: Path, ports_from: int | None = None) -> ClusterOptions:
    return ClusterOptions(sites=3, data_dir=tmp_path / "cluster", replication_factor=3,
                          n_shards=8, heartbeat_interval=0.5, ports_from=ports_from)


def test_standard_layout(tmp_path: Path) -> None:
    sites, controller = layout(options(tmp_path))
    assert controller == "127.0.0.1:18090"
    assert [site.host for site in sites] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    for index, site in enumerate(sites):
        assert (site.mqtt, site.ws, site.admin, site.peer) == (1883, 8083, 18083, 18084)
        assert site.folder == str((tmp_path / "cluster" / f"site-{index}").resolve())
        assert site.admin_url == f"http://127.0.0.{index + 1}:18083"


def test_ports_from(tmp_path: Path) -> None:
    sites, controller = layout(options(tmp_path, ports_from=21000))
    assert controller == "127.0.0.1:21004"
    assert {(site.mqtt, site.ws, site.admin, site.peer) for site in sites} == \
        {(21000, 21001, 21002, 21003)}


def test_site_configs_are_valid_and_override_the_base(tmp_path: Path) -> None:
    sites, _ = layout(options(tmp_path))
    base = {"listeners": {"tcp": {"bind": "0.0.0.0:1"}},
            "durable_sessions": {"renew_streams_interval": "200ms"}}
    config = Config.model_validate(site_config(sites[1], "t" * 32, options(tmp_path), base))
    assert config.listeners.tcp.bind == "127.0.0.2:1883"
    assert config.listeners.ws.bind == "127.0.0.2:8083"
    assert config.admin.bind == "127.0.0.2:18083" and config.admin.token == "t" * 32
    assert config.cluster.enable and config.cluster.peer_bind == "127.0.0.2:18084"
    assert config.durable_storage.messages.n_shards == 8
    assert config.durable_storage.messages.data_dir == str(Path(sites[1].folder) / "data")
    assert config.durable_sessions.heartbeat_interval == 0.5
    assert config.durable_sessions.renew_streams_interval == 0.2  # from the base


def test_the_controller_gets_every_site_and_the_same_settings(tmp_path: Path) -> None:
    sites, bind = layout(options(tmp_path))
    command = controller_command(options(tmp_path), bind, sites, tmp_path / "token")
    assert command[command.index("--bind") + 1] == "127.0.0.1:18090"
    assert [command[i + 1] for i, arg in enumerate(command) if arg == "--site"] == \
        [site.admin_url for site in sites]
    assert command[command.index("--n-shards") + 1] == "8"
    assert command[command.index("--heartbeat-interval") + 1] == "0.5"


def test_a_controller_that_keeps_dying_waits_longer_up_to_the_cap() -> None:
    delays = []
    delay = RESTART_DELAY / 2
    for _ in range(8):
        delay = restart_delay(delay, ran=0.5)
        delays.append(delay)
    assert delays[0] == RESTART_DELAY
    assert delays == sorted(delays) and delays[-1] == RESTART_DELAY_MAX
    # one that ran long enough was healthy: the wait starts over
    assert restart_delay(RESTART_DELAY_MAX, ran=HEALTHY_RUN) == RESTART_DELAY


def test_zones_give_each_site_its_own(tmp_path: Path) -> None:
    sites, _ = layout(options(tmp_path))
    zoned = replace(options(tmp_path), zones=("a", "a", "b"))
    assert [Config.model_validate(site_config(site, "t" * 32, zoned, {})).cluster.zone
            for site in sites] == ["a", "a", "b"]
    assert Config.model_validate(site_config(sites[0], "t" * 32, options(tmp_path),
                                             {})).cluster.zone is None
    assert cluster_parser().parse_args(["--zones", "a,a,b"]).zones == ("a", "a", "b")
    with pytest.raises(SystemExit):
        cluster_parser().parse_args(["--zones", "a,,b"])
    with pytest.raises(ConfigError, match="--zones names 2 zones for 3 sites"):
        cluster_main(["--sites", "3", "--zones", "a,b"])
