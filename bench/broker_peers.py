"""The brokers the broker benchmark compares, as subprocesses on free loopback ports,
each with its own configuration file and data/persistence directory:

- stratamq: `python -m stratamq.broker broker --config FILE`, the defaults of
  config/stratamq.yaml apart from the listen addresses and the data directory;
- Mosquitto (Debian package): `persistence true`, `max_queued_messages 0` and one
  listener, everything else at its documented default (autosave_interval 1800 s);
- amqtt (PyPI): the `amqtt` command with its own default_broker.yaml, the listener's
  address changed and `allow_anonymous: false` (then its AnonymousAuthPlugin accepts
  any client with a user name): amqtt keeps no offline messages for anonymous
  clients, so the persistent-session loads could not run on it otherwise.

`cpu_seconds()` reads utime + stime of the broker process (all its threads) from
/proc/<pid>/stat.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import shutil
import sys
import urllib.request
from pathlib import Path

import yaml

from harness.processes import HOST, BrokerProcess, ManagedProcess

VENV_BIN = Path(sys.executable).parent
class Stratamq(BrokerProcess):
    """stratamq with the shipped defaults (config/stratamq.yaml) apart from the listen
    addresses and the data directory."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, fast=False)

    def dropped(self) -> dict[str, float]:
        """stratamq_messages_dropped_total by reason, from the admin API's /metrics."""
        request = urllib.request.Request(
            f"http://{HOST}:{self.admin_port}/metrics",
            headers={"Authorization": f"Bearer {self.ADMIN_TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        found = {}
        for match in re.finditer(r'^stratamq_messages_dropped_total\{reason="([^"]+)"\} (\S+)$',
                                 text, re.MULTILINE):
            found[match[1]] = float(match[2])
        return found


class Mosquitto(ManagedProcess):
    name = "mosquitto"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        persistence = self.workdir / "persistence"
        persistence.mkdir(exist_ok=True)
        if os.geteuid() == 0:  # mosquitto started as root runs as user mosquitto
            shutil.chown(persistence, "mosquitto", "mosquitto")
        self.config_path = self.workdir / "mosquitto.conf"
        self.config_path.write_text(
            f"listener {self.port} {HOST}\n"
            "allow_anonymous true\n"
            "persistence true\n"
            f"persistence_location {persistence}/\n"
            "max_queued_messages 0\n")

    def command(self) -> list[str]:
        return [mosquitto_binary(), "-c", str(self.config_path)]


class Amqtt(ManagedProcess):
    name = "amqtt"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        default = importlib.resources.files("amqtt.scripts") / "default_broker.yaml"
        config = yaml.safe_load(default.read_text())
        config["listeners"]["default"]["bind"] = f"{HOST}:{self.port}"
        config["plugins"]["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {
            "allow_anonymous": False}
        self.config_path = self.workdir / "amqtt.yaml"
        self.config_path.write_text(yaml.safe_dump(config))

    def command(self) -> list[str]:
        return [str(VENV_BIN / "amqtt"), "-c", str(self.config_path)]


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/sbin")
    if found is None:
        raise RuntimeError("mosquitto is not installed: apt-get install -y mosquitto "
                           "mosquitto-clients")
    return found


def missing_peers() -> list[str]:
    """What the benchmark needs and cannot find."""
    missing = []
    try:
        mosquitto_binary()
    except RuntimeError:
        missing.append("mosquitto (Debian package mosquitto)")
    for client in ("mosquitto_pub", "mosquitto_sub"):
        if shutil.which(client) is None:
            missing.append(f"{client} (Debian package mosquitto-clients)")
    if not (VENV_BIN / "amqtt").exists():
        missing.append("amqtt (pip install amqtt into .venv)")
    return missing


BROKERS: dict[str, type[ManagedProcess]] = {
    "stratamq": Stratamq, "mosquitto": Mosquitto, "amqtt": Amqtt}
