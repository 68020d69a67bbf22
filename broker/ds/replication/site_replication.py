"""Replication in a running site: one `ShardReplica` per shard of each replicated
database (`messages`, `sessions`, `retained`), the roles they take from the placement
the controller pushed (kept in `kept_placement`), and the peer port, shared by them
all (what other sites ask on it is answered in `peer_requests`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from ...errors import CorruptDataError
from ...net.address import listening, source_address, split_bind
from ..shard_set import ShardSet
from .backend import ReplicatedBackend
from .bootstrap import (
    CHECKPOINTS_DIR,
    finish_install,
    remove_checkpoints,
)
from .clock import ClockOffsets
from .kept_placement import (
    FORGOTTEN_FILE,
    PEERS_FILE,
    REPLICATION_DIR,
    KeptPlacement,
    load_kept,
    parse_forgotten,
    parse_peers,
)
from .log import ShardLog, StaleEpochError
from .peer import PeerClient, PeerError, PeerHandler, PeerServer
from .peer_requests import PeerRequests
from .placement import Placement
from .remote import RemoteReads
from .replica import ShardReplica
from .replica_context import ReplicaSettings
from .store import PlacementStore
from .term import TermStore

log = logging.getLogger(__name__)


class PeerService(Protocol):
    """A part of the site beside storage replication that serves on the peer port
    and follows the placement (the broker's relay, `broker/routing`): its routes
    are added before the port listens, it hears of every placement taken and of
    every shard of the first database this site begins to lead, it starts once the
    port listens and closes before the connections to peers do."""

    def add_routes(self, app: web.Application) -> None: ...

    def placement_changed(self) -> None: ...

    def began_leading(self, shard_id: int) -> None: ...

    def start(self) -> None: ...

    async def close(self) -> None: ...


class SiteReplication:
    """The replication of this site: every replicated database's shard replicas, the
    kept placement (`kept`) and the peer port."""

    def __init__(self, site: str, advertised: str, data_dir: Path, shard_sets: list[ShardSet],
                 executor: Executor, settings: ReplicaSettings, store: PlacementStore,
                 terms: TermStore, logs: dict[str, list[ShardLog]], peers: dict[str, str],
                 forgotten: frozenset[str], peer_bind: str) -> None:
        self.site = site
        self.advertised = advertised
        self.executor = executor
        # the placement, controller term, peers and forgotten sites the controller
        # pushed, as this site keeps them
        self.kept = KeptPlacement(site, data_dir, executor, store, terms, peers,
                                  forgotten, self._take)
        self.stopping = False
        self._peer_bind = peer_bind
        # set (and replaced) each time this site has taken a placement
        self._placement_taken = asyncio.Event()
        self._requests = PeerRequests(site, store, lambda db: self.databases.get(db),
                                      data_dir / REPLICATION_DIR / CHECKPOINTS_DIR,
                                      settings.checkpoint_rate)
        requests = self._requests
        self._server = PeerServer(requests.log_of, executor, requests.on_append,
                                  requests.submit, requests.barrier, requests.read_records,
                                  requests.change, requests.holds_replica)
        self._server.add_route("POST", "/peer/v1/broker/{name}", requests.broker_request)
        # connections to peers start from this site's own address (when it binds one)
        # every peer's answer tells its clock: how far it is from this site's
        clocks = ClockOffsets()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(local_addr=source_address(peer_bind)),
            trace_configs=[clocks.trace_config()])
        self.client = PeerClient(self._session, timeout=max(settings.write_timeout, 1.0),
                                 clocks=clocks)
        self._heartbeat_interval = settings.heartbeat_interval
        self._zone = settings.zone
        # how long a request to a peer may take
        self.peer_timeout = max(settings.write_timeout, 1.0)
        # each database's backend; the first (`messages`, whose streams the
        # subscribers read) reads the shards held elsewhere
        self.databases: dict[str, ReplicatedBackend] = {
            shard_set.name: ReplicatedBackend(self, shard_set, logs[shard_set.name], settings,
                                              remote_reads=number == 0)
            for number, shard_set in enumerate(shard_sets)}
        self._open = set(self.databases)
        self.messages = self.databases[shard_sets[0].name]
        assert self.messages.remote is not None
        self.remote: RemoteReads = self.messages.remote
        self._server.extra_routes += [requests.add_routes, self.remote.service.add_routes]
        self._services: list[PeerService] = []

    @property
    def peer_session(self) -> aiohttp.ClientSession:
        """The client connections to the peers' peer ports (closed with this)."""
        return self._session

    def add_service(self, service: PeerService) -> None:
        """Run `service` beside replication on the peer port (before `listen`)."""
        self._services.append(service)
        self._server.extra_routes.append(service.add_routes)
        for shard, replica in enumerate(self.messages.replicas):
            replica.add_leading_listener(functools.partial(service.began_leading, shard))

    def leaderships(self) -> list[str]:
        """The shards (`db/n`) this site leads, or is named to lead."""
        return [f"{name}/{replica.shard_id}" for name, replicated in self.databases.items()
                for replica in replicated.replicas
                if replica.role == "leader" or (replica.placement is not None
                                                and replica.placement.leader == self.site)]

    async def hand_over(self, within: float) -> None:
        """At a graceful stop: report `stopping` to the controller, which then names
        other replicas leaders of the shards this site leads (`decisions.handovers`),
        and wait for that, at most `within` seconds, serving meanwhile. Writes then
        wait only for the new leaders' takeover, not for this site to be taken for
        gone (a few heartbeats) first. What is still led here at the deadline fails
        over once the site is gone."""
        led = self.leaderships()
        if not led:
            return
        self.stopping = True
        log.info("stopping: waiting up to %.0fs for the controller to hand the leadership "
                 "of %s to other replicas", within, ", ".join(led))
        began = time.monotonic()
        try:
            async with asyncio.timeout(within):
                while self.leaderships():
                    await self._placement_taken.wait()
        except TimeoutError:
            log.warning("stopping: still leading %s after %.0fs; they fail over once this "
                        "site is gone", ", ".join(self.leaderships()), within)
            return
        log.info("stopping: other replicas lead %s now (after %.1fs)", ", ".join(led),
                 time.monotonic() - began)

    @property
    def replicas(self) -> list[ShardReplica]:
        """Every shard replica of this site, database by database."""
        return [replica for replicated in self.databases.values()
                for replica in replicated.replicas]

    def catching_up(self) -> list[str]:
        """The shards (`db/shard`) whose replica here has not yet caught up with its
        leader since this site started: the site says it is not ready until none is
        left, so that a rolling restart stops the next site only once this one holds
        its share again."""
        return [f"{replica.shard_set.name}/{replica.shard_id}" for replica in self.replicas
                if replica.catching_up]

    def backend(self, shard_set: ShardSet) -> ReplicatedBackend:
        """The backend of a database this site replicates, built over its copy
        `shard_set`, for its `Database` (`DurableStorage.open_db`)."""
        return self.databases[shard_set.name]

    @classmethod
    async def open(cls, shard_sets: list[ShardSet], data_dir: Path, site: str,
                   peer_bind: str, advertised: str, settings: ReplicaSettings
                   ) -> SiteReplication:
        """Open the shard logs and the kept placement and build each database's
        backend over its shards (`backend`); `listen` then listens on the peer port.
        The first database is the one subscribers read streams of (`messages`): it
        gets the remote reads of the shards that this site holds no replica of.
        The blocking work runs on the storage's executor, the one the shards use."""
        executor = shard_sets[0].executor
        loop = asyncio.get_running_loop()
        logs: dict[str, list[ShardLog]] = {}
        try:
            for shard_set in shard_sets:
                logs_dir = data_dir / REPLICATION_DIR / shard_set.name
                opened = logs[shard_set.name] = []
                for shard in range(len(shard_set.shards)):
                    opened.append(await loop.run_in_executor(
                        executor, ShardLog, logs_dir / str(shard),
                        (shard_set.name, str(shard))))
                for shard, shard_log in enumerate(opened):
                    # a checkpoint installed just before a crash: its log starts there
                    await loop.run_in_executor(executor, finish_install,
                                               shard_set.shards[shard].path, shard_log)
                    applied = shard_set.shards[shard].applied_offset
                    if applied > shard_log.last.offset:
                        raise CorruptDataError(
                            f"{shard_set.name}/{shard} applied log entries up to {applied}, "
                            f"but its log in {shard_log.path} ends at "
                            f"{shard_log.last.offset}: the log was removed or replaced; "
                            f"bootstrap this site's replica again")
            await loop.run_in_executor(executor, remove_checkpoints,
                                       data_dir / REPLICATION_DIR / CHECKPOINTS_DIR)
            store = await loop.run_in_executor(executor, PlacementStore, data_dir)
            terms = await loop.run_in_executor(executor, TermStore, data_dir)
            peers = await loop.run_in_executor(executor, load_kept, data_dir, PEERS_FILE,
                                               parse_peers, {})
            forgotten = await loop.run_in_executor(executor, load_kept, data_dir,
                                                   FORGOTTEN_FILE, parse_forgotten,
                                                   frozenset())
        except BaseException:
            for opened_logs in logs.values():
                for shard_log in opened_logs:
                    shard_log.close()
            raise
        return cls(site, advertised, data_dir, shard_sets, executor, settings, store, terms,
                   logs, peers, forgotten, peer_bind)

    async def listen(self) -> None:
        """Listen on the peer port, take the roles the kept placement gives, and start
        the remote reads and the services added."""
        host, port = split_bind(self._peer_bind)
        try:
            with listening("cluster.peer_bind", self._peer_bind):
                await self._server.start(host, port)
        except BaseException:
            await self.close()
            raise
        log.info("peer port listening on %s (advertised %s)", self._peer_bind,
                 self.advertised)
        if self.kept.store.current is not None:
            await self._take(self.kept.store.current)
        self.remote.start()
        for service in self._services:
            service.start()

    # -- the admin API ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        current = self.kept.store.current
        return {"site": self.site, "peer": self.advertised,
                "placement_version": None if current is None else current.version,
                # the highest controller term this site has seen (the controller
                # steps aside when it is not its own)
                "controller_term": self.kept.terms.current.to_json(),
                "shards": [replica.status() for replica in self.replicas],
                # the sites forgotten for good, whose sessions this site may adopt
                "forgotten": sorted(self.kept.forgotten),
                # a graceful stop waits for the controller to move its leaderships
                "stopping": self.stopping,
                # how often an idle leader hears its followers: the controller allows
                # a shard's `quorum_age` a few of these before it fails the shard over
                "heartbeat_interval": self._heartbeat_interval,
                # the site's failure zone (`cluster.zone`, null: not known): the
                # controller keeps a shard's replicas in distinct zones
                "zone": self._zone,
                # per peer address: how far its wall clock runs ahead of this site's
                # (seconds, negative when behind), right within `uncertainty`
                "clock_offsets": self.client.clocks.status()}

    async def _take(self, placement: Placement) -> None:
        for name, replicated in self.databases.items():
            replicas = replicated.replicas
            shards = placement.shards_of(name)
            if shards and len(shards) != len(replicas):
                log.error("placement version %d has %d shards of %s, this site %d: shards "
                          "beyond either count are left alone", placement.version,
                          len(shards), name, len(replicas))
            for shard_placement in shards:
                if shard_placement.shard < len(replicas):
                    try:
                        await replicas[shard_placement.shard].take(shard_placement,
                                                                   self.kept.peers)
                    except StaleEpochError as exc:
                        # this shard's log knows a newer leader than the placement: it
                        # follows that one; the other shards take their roles regardless
                        log.warning("%s/%d: placement version %d is stale here: %s", name,
                                    shard_placement.shard, placement.version, exc.message)
        self.remote.placement_changed()
        for service in self._services:
            service.placement_changed()
        self._placement_taken.set()
        self._placement_taken = asyncio.Event()

    def leads(self, shard: int) -> bool:
        """Whether this site leads the shard of the first database (`messages`)."""
        return self.messages.replicas[shard].leadership is not None

    # -- the peer port --------------------------------------------------------------

    def log_lock(self, db: str, shard: int) -> asyncio.Lock:
        """Held while a shard log is written or closed (see `PeerServer.lock`)."""
        return self._server.lock(db, shard)

    def serve(self, name: str, handler: PeerHandler) -> None:
        """Serve `POST /peer/v1/broker/{name}` on the peer port with `handler` (the
        broker's requests between sites, such as a session taken over elsewhere)."""
        self._requests.serve(name, handler)

    async def call(self, site: str, name: str, body: dict[str, Any],
                   within: float) -> dict[str, Any]:
        """POST a broker request to `site`'s peer port; its JSON answer. PeerError
        when the site is unknown, does not answer in time, or answers with an error."""
        address = self.kept.peers.get(site)
        if address is None:
            raise PeerError(f"no peer address known for site {site}")
        return await self.client.call(address, name, body, within)

    def peers_clock_lead(self) -> float:
        """Seconds the peer clock furthest ahead of this site's may run ahead of it."""
        return self.client.clocks.largest_lead()

    def peer_time(self, site: str, local: float) -> float:
        """This site's wall clock time `local` in `site`'s clock (as far as its
        answers tell; unchanged for a site not heard from)."""
        address = self.kept.peers.get(site)
        return local if address is None else self.client.clocks.peer_time(address, local)

    @property
    def forgotten(self) -> frozenset[str]:
        """The sites the controller forgot for good: this site may adopt their
        sessions."""
        return self.kept.forgotten

    def peer_address(self, site: str) -> str | None:
        return self.kept.peers.get(site)

    async def database_closed(self, replicated: ReplicatedBackend) -> None:
        self._open.discard(replicated.shard_set.name)
        if not self._open:
            await self._server.stop()
            for service in self._services:
                await service.close()
            await self.remote.close()
            await self.client.close()
            await self._session.close()

    async def close(self) -> None:
        """Stop serving the peer port, stop every replica's loops, close the logs."""
        for service in self._services:
            await service.close()
        await self.remote.close()
        for replicated in list(self.databases.values()):
            if replicated.shard_set.name in self._open:
                await replicated.close()
        await self._server.stop()
        await self.client.close()
        if not self._session.closed:
            await self._session.close()


