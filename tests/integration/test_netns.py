"""The partition tool (tests/support/netns.py) with real processes: a TCP echo server in
one member, clients in the others and in the test process: reachable, cut, healed;
and nothing left behind, also after a crashed run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.support.netns import (
    PREFIX,
    NetnsNetwork,
    ProxyNetwork,
    cleanup_leftovers,
    namespaces_unavailable,
    open_network,
)

pytestmark = pytest.mark.cluster

ECHO_SERVER = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
def echo(connection):
    with connection:
        while data := connection.recv(1024):
            connection.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""

# exits 0 when the echo answers within the timeout, 1 otherwise
ECHO_CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0) as c:
        c.sendall(b"ping")
        sys.exit(0 if c.recv(4) == b"ping" else 1)
except OSError:
    sys.exit(1)
"""

PORT = 9000  # inside a fresh namespace every port is free

needs_namespaces = pytest.mark.skipif(namespaces_unavailable() is not None,
                                      reason=f"no network namespaces here: "
                                             f"{namespaces_unavailable()}")


def echo_server(argv: list[str]) -> subprocess.Popen[str]:
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server


def reaches(argv: list[str], host: str, port: int) -> bool:
    """Whether a client process started with `argv` prefix gets its echo back."""
    done = subprocess.run([*argv, sys.executable, "-c", ECHO_CLIENT, host, str(port)],
                          timeout=20, check=False)
    return done.returncode == 0


def host_reaches(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0) as connection:
            connection.sendall(b"ping")
            return connection.recv(4) == b"ping"
    except OSError:
        return False


@needs_namespaces
def test_namespaces_cut_a_member_off_from_the_others_and_heal_it() -> None:
    with open_network(3) as network:
        assert isinstance(network, NetnsNetwork)
        server = echo_server(network.command(1, [sys.executable, "-c", ECHO_SERVER,
                                                 network.address(1), str(PORT)]))
        try:
            target = network.address(1), PORT
            assert reaches(network.command(0, []), *target)
            assert reaches(network.command(2, []), *target)
            assert host_reaches(*target)
            assert not host_reaches("127.0.0.1", PORT)  # it listens in its own namespace

            network.cut(1)
            assert not reaches(network.command(0, []), *target)
            assert not reaches(network.command(2, []), *target)
            assert host_reaches(*target), "the host must still reach a cut-off member"

            network.separate([0], [2])  # 0 and 2 apart too; 1 healed next must reach both
            network.heal(1)
            assert reaches(network.command(0, []), *target)
            assert reaches(network.command(2, []), *target)
            network.heal()
        finally:
            server.kill()
            server.wait()
        assert network.leftovers() != []
    assert network.leftovers() == []


@needs_namespaces
def test_close_kills_processes_left_inside_and_removes_everything() -> None:
    network = NetnsNetwork(2)
    with network.open():
        server = echo_server(network.command(0, [sys.executable, "-c", ECHO_SERVER,
                                                 network.address(0), str(PORT)]))
    server.wait(10)  # SIGKILLed by close
    assert network.leftovers() == []


@needs_namespaces
def test_leftovers_of_a_crashed_run_are_removed() -> None:
    """A run whose process is gone (here: a pid that is not alive) left a namespace and
    a bridge; the next cleanup removes them, and leaves a live run's alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed = f"{PREFIX}-{dead.pid}-abcd-0"
    subprocess.run(["ip", "netns", "add", crashed], check=True)
    subprocess.run(["ip", "link", "add", f"{PREFIX}abcdb", "type", "bridge"], check=True)
    with NetnsNetwork(1).open() as alive:
        removed = cleanup_leftovers()
        # Other leftovers of gone runs may be removed too: a veth of a namespace
        # deleted a moment ago outlives it while the kernel tears the namespace down.
        assert {crashed, f"{PREFIX}abcdb"} <= set(removed), removed
        assert not [name for name in removed
                    if f"-{alive.tag}-" in name or name.startswith(f"{PREFIX}{alive.tag}")]
        assert alive.leftovers() != []
    assert os.path.exists(f"/run/netns/{crashed}") is False


def test_proxies_cut_a_member_off_and_heal_it() -> None:
    """The fallback without namespaces, tested everywhere."""
    with open_network(3, force_proxy=True) as network:
        assert isinstance(network, ProxyNetwork)
        listener = socket.create_server((network.address(1), 0))
        port = listener.getsockname()[1]
        listener.close()
        server = echo_server([sys.executable, "-c", ECHO_SERVER, network.address(1),
                              str(port)])
        try:
            from_0 = network.proxy(0, 1, port)
            from_2 = network.proxy(2, 1, port)
            assert host_reaches(*from_0) and host_reaches(*from_2)
            with socket.create_connection(from_0, timeout=1.0) as open_before:
                network.cut(1)
                open_before.settimeout(2.0)
                assert open_before.recv(4) == b"", "an open connection must be closed"
            assert not host_reaches(*from_0) and not host_reaches(*from_2)
            assert host_reaches(network.address(1), port)  # not through a proxy
            network.heal(1)
            assert host_reaches(*from_0) and host_reaches(*from_2)
        finally:
            server.kill()
            server.wait()
