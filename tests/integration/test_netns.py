"""The partition tool (harness/netns.py) with real processes: a TCP echo server in
one member, clients in the others and in the test process: reachable, cut, healed;
and nothing left behind, also after a crashed run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from harness.netns import (
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


def closed_by_peer(connection: socket.socket) -> bool:
    """Whether the other end closed `connection`: an end of stream, or a reset when
    the proxy stopped before it accepted the connection from its listen backlog (the
    kernel resets what a closed listener held; seen on a loaded machine). A timeout
    (the connection still open) is not."""
    try:
        return connection.recv(4) == b""
    except ConnectionResetError:
        return True


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
            from_test = network.reach(1, PORT)
            assert from_test == ("127.0.0.2", PORT)
            assert reaches(network.command(0, []), *target)
            assert reaches(network.command(2, []), *target)
            assert host_reaches(*from_test)
            assert not host_reaches(*target), "the member's address is not the test's"

            network.cut(1)
            assert not reaches(network.command(0, []), *target)
            assert not reaches(network.command(2, []), *target)
            assert host_reaches(*from_test), "the test must still reach a cut-off member"

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
    assert not host_reaches(*from_test), "the proxy must stop with the network"


def host_network() -> tuple[set[str], set[tuple[str, str]], set[str]]:
    """The test namespace's link names, (link, address) pairs and route
    destinations (no lifetimes or counters: those change by themselves)."""
    def ip(*args: str) -> list[list[str]]:
        listed = subprocess.run(["ip", *args], capture_output=True, text=True, check=True)
        return [line.split() for line in listed.stdout.splitlines() if line.strip()]

    links = {fields[1].rstrip(":").split("@")[0] for fields in ip("-o", "link")}
    addresses = {(fields[1], fields[3]) for fields in ip("-o", "addr")}
    routes = {fields[0] for fields in ip("route")}
    return links, addresses, routes


@needs_namespaces
def test_nothing_is_made_in_the_test_namespace() -> None:
    """No link, address or route of the network in the namespace the test runs in:
    the members, the bridge and their subnet live in namespaces of the run's own."""
    before = host_network()
    with open_network(2) as network:
        assert isinstance(network, NetnsNetwork)
        network.reach(0, PORT)
        assert host_network() == before
    assert host_network() == before


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
    """A run whose process is gone (here: a pid that is not alive) left a namespace
    with a process inside; the next cleanup removes both, and leaves a live run's
    alone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed = f"{PREFIX}-{dead.pid}-abcd-hub"
    subprocess.run(["ip", "netns", "add", crashed], check=True)
    left = subprocess.Popen(["ip", "netns", "exec", crashed, "sleep", "600"])
    try:
        with NetnsNetwork(1).open() as alive:
            removed = cleanup_leftovers()
            assert crashed in removed, removed
            assert not [name for name in removed if f"-{alive.tag}-" in name]
            assert alive.leftovers() != []
        assert left.wait(10) == -9
    finally:
        left.kill()
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
                assert closed_by_peer(open_before), "an open connection must be closed"
            assert not host_reaches(*from_0) and not host_reaches(*from_2)
            assert host_reaches(network.address(1), port)  # not through a proxy
            network.heal(1)
            assert host_reaches(*from_0) and host_reaches(*from_2)
        finally:
            server.kill()
            server.wait()
