"""Real network separation for partition tests (issue 7, "Partitions with real network
separation").

`open_network(n)` gives `n` members (sites, a controller), each with an address the
others and the test process reach it at, and `cut(k)` / `heal(k)` to separate member
`k` from the other members and join it again (`separate(group, others)`: only some
members from some others, an asymmetric cut). Two kinds:

- `NetnsNetwork` (root and iproute2): a Linux network namespace per member, joined by
  veth pairs to one bridge in a hub namespace the network makes too; member k is
  `10.77.0.(k+1)`/24 and the hub `10.77.0.254`. Nothing is made in the test's own
  namespace: no link, no address, no route (every run has namespaces of its own, so
  runs never collide on the subnet). A process runs inside with `command(k, argv)`
  (`ip netns exec`). The test process reaches member k's `port` at `reach(k, port)`:
  a TCP proxy listening on `127.0.0.(k+1)` at the same port, whose connections to
  the member start from the hub (its thread enters the hub's namespace). A cut routes
  the traffic between two members into a veth whose peer is down and which does no
  ARP: packets vanish, as in a real partition (connections time out, nothing is
  refused), while the hub, and so the test, keeps reaching every member, so a test
  still talks to the cut-off side. (This kernel has no nftables/iptables and no tc
  actions, so routes do the cutting; the bridge stays intact.)
- `ProxyNetwork` (the fallback without namespaces): member k is `127.0.0.(k+1)` and
  a member reaches another member's port through `proxy(src, dst, port)`, a TCP
  proxy for that pair that `cut` stops (open connections closed, new ones refused),
  or through `front(dst, port)`, one proxy on `dst`'s address for every member, which
  tells them apart by the source address of their connections (each member binds its
  outgoing connections to its own address) and refuses and closes those of members a
  cut separates from `dst`. It separates only traffic that goes through its proxies.

Every namespace made carries the prefix `smq`, the test process's pid and a tag of
the run; `cleanup_leftovers()` removes those of runs whose process is gone, with the
processes left inside (it runs at every open).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import os
import re
import secrets
import selectors
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")

PREFIX = "smq"
NULL_DEVICE = "smqnull"  # inside every namespace: where cut traffic is routed
BRIDGE = "smqbridge"  # inside the hub namespace
SUBNET = "10.77.0"  # inside the run's own namespaces only
HUB = "hub"
_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{4}})-(\d+|{HUB})$")
_CLONE_NEWNET = 0x40000000  # <sched.h>


def enter_network_namespace(name: str) -> None:
    """Move the calling thread (only it) into the named network namespace
    (`ip netns add` made it): sockets it makes from now on live there, those it made
    before stay where they were. Python 3.11 has no `os.setns` (3.12 does): libc's."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}", "rb") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True,
                          timeout=30)


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@functools.cache
def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can (asked
    once per process)."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-0"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _kill_processes_in(namespace: str) -> None:
    """SIGKILL the processes inside one of our namespaces (ours: a test started them)."""
    for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)


def cleanup_leftovers() -> list[str]:
    """Remove the namespaces of earlier runs whose process is gone, and the processes
    left inside them (their links go with them); returns the namespaces removed."""
    removed = []
    for namespace in _namespaces():
        match = _NAMESPACE.match(namespace)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        _kill_processes_in(namespace)
        _ip("netns", "del", namespace, check=False)
        removed.append(namespace)
    return removed


class NetnsNetwork:
    kind = "netns"

    def __init__(self, members: int) -> None:
        self.members = members
        self.tag = secrets.token_hex(2)
        self.hub = f"{PREFIX}-{os.getpid()}-{self.tag}-{HUB}"
        self._cuts: set[tuple[int, int]] = set()  # (from, to): from's route to `to` is cut
        self._reach: dict[tuple[int, int], TcpProxy] = {}
        self._made = False

    def namespace(self, k: int) -> str:
        return f"{PREFIX}-{os.getpid()}-{self.tag}-{k}"

    def address(self, k: int) -> str:
        """Where member k is reached from the other members (and binds)."""
        return f"{SUBNET}.{k + 1}"

    @staticmethod
    def reach_host(k: int) -> str:
        """The address the test process reaches member k at (see `reach`)."""
        return f"127.0.0.{k + 1}"

    def reach(self, k: int, port: int) -> tuple[str, int]:
        """Where the test process reaches member k's `port`: a proxy on
        `127.0.0.(k+1)` at the same port, dialing from the hub (a member restarted
        on that port is reached again; while nothing listens there, a connection is
        accepted and closed at once)."""
        key = (k, port)
        if key not in self._reach:
            proxy = TcpProxy(self.reach_host(k), (self.address(k), port), dial_from=self.hub)
            proxy.port = port
            proxy.start()
            self._reach[key] = proxy
        return self.reach_host(k), port

    def from_hub(self, call: Callable[[], T]) -> T:
        """`call()` on a thread inside the hub's namespace, which reaches every member
        at its address, cut off or not: for a client that takes the members'
        addresses from the members themselves (`ctl ds verify` asks the controller
        for the sites' admin URLs)."""
        with concurrent.futures.ThreadPoolExecutor(
                1, initializer=enter_network_namespace, initargs=(self.hub,)) as pool:
            return pool.submit(call).result()

    def describe(self) -> str:
        return (f"network namespaces {self.namespace(0)}.. joined by a bridge in "
                f"{self.hub}, members at {SUBNET}.1-{self.members}, reached from the "
                f"test at 127.0.0.1-{self.members} through proxies")

    def command(self, k: int, argv: list[str]) -> list[str]:
        """`argv` run inside member k's namespace (ip netns exec execs it: the pid is
        the process's own, so a SIGKILL reaches it)."""
        return ["ip", "netns", "exec", self.namespace(k), *argv]

    def open(self) -> NetnsNetwork:
        self._made = True
        hub = ("-n", self.hub)
        _ip("netns", "add", self.hub)
        _ip(*hub, "link", "set", "lo", "up")
        _ip(*hub, "link", "add", BRIDGE, "type", "bridge")
        _ip(*hub, "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
        _ip(*hub, "link", "set", BRIDGE, "up")
        for k in range(self.members):
            namespace = self.namespace(k)
            hub_end, inner_end = f"{PREFIX}{k}", f"{PREFIX}eth"
            _ip("netns", "add", namespace)
            # made in the hub with its peer straight in the member: never in ours
            _ip(*hub, "link", "add", hub_end, "type", "veth", "peer", "name", inner_end,
                "netns", namespace)
            _ip(*hub, "link", "set", hub_end, "master", BRIDGE)
            _ip(*hub, "link", "set", hub_end, "up")
            inside = ("-n", namespace)
            _ip(*inside, "addr", "add", f"{self.address(k)}/24", "dev", inner_end)
            _ip(*inside, "link", "set", inner_end, "up")
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "link", "add", NULL_DEVICE, "type", "veth", "peer", "name",
                f"{NULL_DEVICE}p")
            _ip(*inside, "link", "set", NULL_DEVICE, "arp", "off", "up")  # peer stays down
        return self

    def separate(self, group: list[int], others: list[int]) -> None:
        """No packet between a member of `group` and one of `others`, either way."""
        for a in group:
            for b in others:
                for source, target in ((a, b), (b, a)):
                    if (source, target) not in self._cuts:
                        _ip("-n", self.namespace(source), "route", "add",
                            f"{self.address(target)}/32", "dev", NULL_DEVICE)
                        self._cuts.add((source, target))

    def cut(self, k: int) -> None:
        """Member k reaches no other member and none reaches it; the host reaches all."""
        self.separate([k], [j for j in range(self.members) if j != k])

    def heal(self, k: int | None = None) -> None:
        """Undo the cuts that involve member k (every cut when None)."""
        for source, target in sorted(self._cuts):
            if k is None or k in (source, target):
                _ip("-n", self.namespace(source), "route", "del",
                    f"{self.address(target)}/32", "dev", NULL_DEVICE)
                self._cuts.discard((source, target))

    def close(self) -> None:
        for proxy in self._reach.values():
            proxy.stop()
        self._reach.clear()
        if not self._made:
            return
        for namespace in [*map(self.namespace, range(self.members)), self.hub]:
            _kill_processes_in(namespace)
            _ip("netns", "del", namespace, check=False)
        self._made = False

    def leftovers(self) -> list[str]:
        """What of this network still exists (for the tool's own test)."""
        return [n for n in _namespaces() if f"-{self.tag}-" in n]

    def __enter__(self) -> NetnsNetwork:
        return self

    def __exit__(self, _t: type[BaseException] | None, _e: BaseException | None,
                 _tb: TracebackType | None) -> None:
        self.close()


class TcpProxy:
    """A TCP proxy from `listen` to `target` on one thread; `stop` closes the listener
    and every open connection, `start` listens again on the same port."""

    def __init__(self, listen_host: str, target: tuple[str, int],
                 dial_from: str | None = None) -> None:
        """`dial_from`: the network namespace its connections to `target` start in
        (the listener stays in the test's)."""
        self.target = target
        self.listen_host = listen_host
        self.dial_from = dial_from
        self.port = 0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.listen_host, self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, args=(listener,), daemon=True,
                                        name=f"proxy-{self.port}")
        self._thread.start()

    def _run(self, listener: socket.socket) -> None:
        if self.dial_from is not None:
            enter_network_namespace(self.dial_from)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        pairs: dict[socket.socket, socket.socket] = {}
        try:
            while not self._stopping.is_set():
                self._sweep(selector, pairs)
                for key, _ in selector.select(0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is listener:
                        self._accept(listener, selector, pairs)
                    elif sock not in pairs:
                        continue  # closed with its pair earlier in this round
                    elif not self._forward(sock, pairs):
                        self._drop(sock, selector, pairs)
        finally:
            for sock in list(pairs):
                sock.close()
            selector.close()
            listener.close()

    def _accept(self, listener: socket.socket, selector: selectors.BaseSelector,
                pairs: dict[socket.socket, socket.socket]) -> None:
        client, (source, *_rest) = listener.accept()
        if not self._admits(source):
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target, timeout=2)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setblocking(True)
            selector.register(sock, selectors.EVENT_READ)
        pairs[client], pairs[upstream] = upstream, client
        self._accepted(client, source)

    def _admits(self, source: str) -> bool:
        """Whether a connection from `source` is let through."""
        return True

    def _accepted(self, client: socket.socket, source: str) -> None:
        """Called on the proxy's thread with each connection let through."""

    def _sweep(self, selector: selectors.BaseSelector,
               pairs: dict[socket.socket, socket.socket]) -> None:
        """Called on the proxy's thread between polls."""

    @staticmethod
    def _forward(sock: socket.socket, pairs: dict[socket.socket, socket.socket]) -> bool:
        try:
            data = sock.recv(65536)
            if data:
                pairs[sock].sendall(data)
        except OSError:
            return False
        return bool(data)

    @staticmethod
    def _drop(sock: socket.socket, selector: selectors.BaseSelector,
              pairs: dict[socket.socket, socket.socket]) -> None:
        other = pairs.pop(sock)
        pairs.pop(other, None)
        for each in (sock, other):
            selector.unregister(each)
            each.close()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _Front(TcpProxy):
    """A proxy that refuses connections from `blocked` source addresses and closes
    the open ones (within a poll) once their source is blocked."""

    def __init__(self, listen_host: str, target: tuple[str, int]) -> None:
        super().__init__(listen_host, target)
        self.blocked: frozenset[str] = frozenset()  # replaced whole, read by the thread
        self._sources: dict[socket.socket, str] = {}

    def _admits(self, source: str) -> bool:
        return source not in self.blocked

    def _accepted(self, client: socket.socket, source: str) -> None:
        self._sources[client] = source

    def _sweep(self, selector: selectors.BaseSelector,
               pairs: dict[socket.socket, socket.socket]) -> None:
        for client, source in list(self._sources.items()):
            if client not in pairs:
                del self._sources[client]
            elif source in self.blocked:
                del self._sources[client]
                self._drop(client, selector, pairs)


class ProxyNetwork:
    kind = "proxy"

    def __init__(self, members: int, reason: str = "") -> None:
        self.members = members
        self.reason = reason
        self._proxies: dict[tuple[int, int, int], TcpProxy] = {}
        self._fronts: dict[tuple[int, int], _Front] = {}
        self._cut: set[int] = set()
        self._separated: set[frozenset[int]] = set()  # pairs apart by `separate`

    def address(self, k: int) -> str:
        return f"127.0.0.{k + 1}"

    def describe(self) -> str:
        return (f"TCP proxies per member pair or in front of a member (no network "
                f"namespaces: {self.reason}); "
                f"members at 127.0.0.1-{self.members}")

    def command(self, k: int, argv: list[str]) -> list[str]:
        return list(argv)

    def open(self) -> ProxyNetwork:
        return self

    def proxy(self, source: int, target: int, port: int) -> tuple[str, int]:
        """Where member `source` dials to reach member `target`'s `port`."""
        key = (source, target, port)
        if key not in self._proxies:
            proxy = TcpProxy(self.address(source), (self.address(target), port))
            self._proxies[key] = proxy
            if not self._apart(source, target):
                proxy.start()
            else:  # bind now so the address is known; refuse until healed
                proxy.start()
                proxy.stop()
        return self.address(source), self._proxies[key].port

    def front(self, target: int, port: int) -> tuple[str, int]:
        """Where every member dials to reach member `target`'s `port`: a proxy on
        `target`'s address that refuses members a cut separates from it (by the
        source address of their connections; others, such as the test, pass)."""
        key = (target, port)
        if key not in self._fronts:
            front = _Front(self.address(target), (self.address(target), port))
            front.blocked = self._blocked(target)
            front.start()
            self._fronts[key] = front
        return self.address(target), self._fronts[key].port

    def _blocked(self, target: int) -> frozenset[str]:
        """The source addresses of members cut off from `target`."""
        return frozenset(self.address(member) for member in range(self.members)
                         if member != target and self._apart(member, target))

    def _apart(self, a: int, b: int) -> bool:
        """Whether a cut or a `separate` keeps members `a` and `b` apart."""
        return bool(self._cut & {a, b}) or frozenset((a, b)) in self._separated

    def _update_fronts(self) -> None:
        for (target, _port), front in self._fronts.items():
            front.blocked = self._blocked(target)

    def separate(self, group: list[int], others: list[int]) -> None:
        """No connection between a member of `group` and one of `others`, either way
        (an asymmetric cut: the members outside both still reach everyone)."""
        self._separated |= {frozenset((a, b)) for a in group for b in others if a != b}
        self._stop_apart()

    def cut(self, k: int) -> None:
        self._cut.add(k)
        self._stop_apart()

    def _stop_apart(self) -> None:
        for (source, target, _), proxy in self._proxies.items():
            if self._apart(source, target):
                proxy.stop()
        self._update_fronts()

    def heal(self, k: int | None = None) -> None:
        """Undo the cuts and separations that involve member k (all when None)."""
        was_apart = {key for key in self._proxies if self._apart(key[0], key[1])}
        self._cut -= set(self._cut) if k is None else {k}
        self._separated = {pair for pair in self._separated if k is not None and k not in pair}
        for key in was_apart:
            if not self._apart(key[0], key[1]):
                self._proxies[key].start()
        self._update_fronts()

    def close(self) -> None:
        for proxy in [*self._proxies.values(), *self._fronts.values()]:
            proxy.stop()

    def __enter__(self) -> ProxyNetwork:
        return self

    def __exit__(self, _t: type[BaseException] | None, _e: BaseException | None,
                 _tb: TracebackType | None) -> None:
        self.close()


Network = NetnsNetwork | ProxyNetwork


@contextlib.contextmanager
def open_network(members: int, *, force_proxy: bool = False) -> Iterator[Network]:
    """Namespaces where they can be made, else proxies; prints which (pytest -s shows
    it, and it lands in the captured output of a failure)."""
    reason = "asked for proxies" if force_proxy else namespaces_unavailable()
    network: Network
    if reason is None:
        removed = cleanup_leftovers()
        if removed:
            print(f"partition tool: removed leftovers of crashed runs: {removed}")
        network = NetnsNetwork(members)
    else:
        network = ProxyNetwork(members, reason)
    try:
        network.open()
        print(f"partition tool: {network.describe()}")
        yield network
    finally:
        network.close()
