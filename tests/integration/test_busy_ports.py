"""A port another process holds: the site (each of its listeners) and the cluster
controller stop with one line that names the setting and the address, exit status 2,
and no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness.processes import ADMIN_TOKEN, HOST, free_port

STARTUP = 60.0  # a process that fails starts and stops within this (loaded 2 cores)


@pytest.fixture
def taken() -> Iterator[int]:
    """A port this test process listens on."""
    holder = socket.socket()
    holder.bind((HOST, free_port()))
    holder.listen()
    try:
        yield int(holder.getsockname()[1])
    finally:
        holder.close()


def site_config(tmp_path: Path, setting: str, taken: int) -> Path:
    binds = {"listeners.tcp.bind": f"{HOST}:{free_port()}",
             "listeners.ws.bind": f"{HOST}:{free_port()}",
             "admin.bind": f"{HOST}:{free_port()}",
             "cluster.peer_bind": f"{HOST}:{free_port()}"}
    binds[setting] = f"{HOST}:{taken}"
    config = {
        "listeners": {"tcp": {"bind": binds["listeners.tcp.bind"]},
                      "ws": {"bind": binds["listeners.ws.bind"]}},
        "admin": {"bind": binds["admin.bind"], "token": ADMIN_TOKEN},
        "durable_storage": {"messages": {"data_dir": str(tmp_path / "data"),
                                         "n_shards": 2}},
        "cluster": {"enable": setting == "cluster.peer_bind",
                    "peer_bind": binds["cluster.peer_bind"]},
    }
    path = tmp_path / "stratamq.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def assert_one_line_error(done: subprocess.CompletedProcess[str], setting: str,
                          taken: int) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    expected = (f"stratamq: {setting}: cannot listen on {HOST}:{taken}: Address already "
                "in use")
    assert expected in done.stderr, done.stderr


@pytest.mark.parametrize("setting", ["listeners.tcp.bind", "listeners.ws.bind",
                                     "admin.bind", "cluster.peer_bind"])
def test_a_site_names_the_busy_port(tmp_path: Path, taken: int, setting: str) -> None:
    config = site_config(tmp_path, setting, taken)
    done = subprocess.run([sys.executable, "-m", "stratamq.broker", "broker", "--config",
                           str(config)], capture_output=True, text=True, timeout=STARTUP,
                          check=False)
    assert_one_line_error(done, setting, taken)


def test_the_controller_names_the_busy_port(tmp_path: Path, taken: int) -> None:
    token = tmp_path / "token"
    token.write_text(ADMIN_TOKEN)
    done = subprocess.run(
        [sys.executable, "-m", "stratamq.broker", "cluster", "controller",
         "--data-dir", str(tmp_path / "state"), "--bind", f"{HOST}:{taken}",
         "--token-file", str(token), "--site", f"http://{HOST}:{free_port()}"],
        capture_output=True, text=True, timeout=STARTUP, check=False)
    assert_one_line_error(done, "--bind", taken)
