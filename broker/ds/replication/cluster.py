"""Replication in a running site: one `ShardReplica` per shard of the replicated
database, the placement the controller pushed (kept on disk with the peers' peer-port
addresses, so a restarted site takes its roles again before the controller speaks),
and the peer port.

Placements name only the `messages` database: sessions' QoS 2 records and the
messages of a client are written in the same cooked batch of its shard."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from ...errors import CorruptDataError, PlacementError, StalePlacementError, StorageError
from ...files import write_atomically
from ...net.address import source_address, split_bind
from ..database import Database
from ..message import Message
from . import entries
from .bootstrap import CHECKPOINTS_DIR, finish_install, remove_checkpoints, serve_checkpoint
from .feed import CommitFeed
from .log import ShardLog, StaleEpochError
from .peer import PeerClient, PeerServer
from .placement import Placement, check_site_id
from .remote import RemoteReads
from .replica import NotLeaderError, ReplicaSettings, ShardReplica
from .store import PlacementStore
from .wire import decode_submit

log = logging.getLogger(__name__)

PEERS_FILE = "peers.json"
REPLICATION_DIR = "replication"


def parse_peers(value: object) -> dict[str, str]:
    """The `peers` of a placement push: site id -> host:port of its peer port."""
    if not isinstance(value, dict):
        raise PlacementError(f"peers: expected an object of site id -> host:port, got "
                             f"{type(value).__name__}")
    peers: dict[str, str] = {}
    for site, address in value.items():
        check_site_id(site, "peers")
        if not isinstance(address, str) or not address.rpartition(":")[2].isdigit():
            raise PlacementError(f"peers.{site}: {address!r} is not host:port")
        peers[site] = address
    return peers


class SiteReplication:
    """Implements `database.Replication` for one database of this site."""

    def __init__(self, site: str, advertised: str, data_dir: Path, database: Database,
                 executor: Executor, settings: ReplicaSettings, store: PlacementStore,
                 logs: list[ShardLog], peers: dict[str, str],
                 local_addr: tuple[str, int] | None = None) -> None:
        self.site = site
        self.advertised = advertised
        self.database = database
        self._data_dir = data_dir
        self._executor = executor
        self._store = store
        self._logs = logs
        self.peers = peers
        self._server = PeerServer(self._log_of, executor, self._on_append, self._submit,
                                  self._barrier, self._read_records)
        # connections to peers start from this site's own address (when it binds one)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(local_addr=local_addr))
        client = PeerClient(self._session, timeout=max(settings.write_timeout, 1.0))
        self.replicas = [ShardReplica(database, shard, shard_log,
                                      self._server.lock(database.name, shard), executor,
                                      client, settings)
                         for shard, shard_log in enumerate(logs)]
        self._take_lock = asyncio.Lock()
        # reads of the shards held elsewhere, and the commit feed to and from them
        self.remote = RemoteReads(site, database, self.placement_of, lambda: self.peers,
                                  self._barrier_here, self._session,
                                  max(settings.write_timeout, 1.0))
        self.feed = CommitFeed(site, database, self._leads, self.placement_of,
                               lambda: self.peers, self.remote, self._session,
                               max(settings.write_timeout, 1.0))
        self._server.extra_routes += [self._bootstrap_routes, self.remote.add_routes,
                                      self.feed.add_routes]
        database.attach_remote(self.remote)

    @classmethod
    async def start(cls, database: Database, data_dir: Path, site: str, peer_bind: str,
                    advertised: str, settings: ReplicaSettings,
                    executor: Executor) -> SiteReplication:
        """Open the shard logs and the kept placement, attach to `database`, listen on
        the peer port and take the roles the kept placement gives."""
        loop = asyncio.get_running_loop()
        logs_dir = data_dir / REPLICATION_DIR / database.name
        logs: list[ShardLog] = []
        try:
            for shard in range(len(database.shards)):
                logs.append(await loop.run_in_executor(executor, ShardLog,
                                                       logs_dir / str(shard)))
            for shard, shard_log in enumerate(logs):
                # a checkpoint installed just before a crash: its log starts there
                await loop.run_in_executor(executor, finish_install,
                                           database.shards[shard].path, shard_log)
                applied = database.shards[shard].applied_offset
                if applied > shard_log.last.offset:
                    raise CorruptDataError(
                        f"{database.name}/{shard} applied log entries up to {applied}, but "
                        f"its log in {shard_log.path} ends at {shard_log.last.offset}: the "
                        f"log was removed or replaced; bootstrap this site's replica again")
            await loop.run_in_executor(executor, remove_checkpoints,
                                       data_dir / REPLICATION_DIR / CHECKPOINTS_DIR)
            store = await loop.run_in_executor(executor, PlacementStore, data_dir)
            peers = await loop.run_in_executor(executor, _load_peers, data_dir)
        except BaseException:
            for shard_log in logs:
                shard_log.close()
            raise
        replication = cls(site, advertised, data_dir, database, executor, settings, store,
                          logs, peers, source_address(peer_bind))
        database.attach_replication(replication)
        host, port = split_bind(peer_bind)
        try:
            await replication._server.start(host, port)
        except BaseException:
            await replication.close()
            raise
        log.info("peer port listening on %s (advertised %s)", peer_bind, advertised)
        if store.current is not None:
            await replication._take(store.current)
        replication.remote.start()
        replication.feed.start()
        return replication

    # -- the admin API ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        current = self._store.current
        return {"site": self.site, "peer": self.advertised,
                "placement_version": None if current is None else current.version,
                "shards": [replica.status() for replica in self.replicas],
                # the topic filters each peer said its subscribers hold
                "interest": self.feed.interest_of()}

    async def offer(self, document: object, peers_value: object) -> tuple[bool, int]:
        """A placement pushed by the controller: (accepted, the version kept).
        PlacementError when it does not parse."""
        placement = Placement.from_dict(document)
        peers = parse_peers(peers_value)
        loop = asyncio.get_running_loop()
        async with self._take_lock:
            try:
                accepted = await loop.run_in_executor(self._executor, self._store.offer,
                                                      placement)
            except StalePlacementError as exc:
                log.info("placement version %d not taken: %s", placement.version, exc.message)
                accepted = False
            kept = self._store.current
            if accepted or (kept == placement and peers != self.peers):
                if peers != self.peers:
                    self.peers = peers
                    await loop.run_in_executor(self._executor, _store_peers,
                                               self._data_dir, peers)
                assert kept is not None
                await self._take(kept)
        return accepted, kept.version if kept is not None else placement.version

    async def _take(self, placement: Placement) -> None:
        name = self.database.name
        shards = placement.shards_of(name)
        if shards and len(shards) != len(self.replicas):
            log.error("placement version %d has %d shards of %s, this site %d: shards "
                      "beyond either count are left alone", placement.version, len(shards),
                      name, len(self.replicas))
        for shard_placement in shards:
            if shard_placement.shard < len(self.replicas):
                try:
                    await self.replicas[shard_placement.shard].take(shard_placement,
                                                                    self.peers)
                except StaleEpochError as exc:
                    # this shard's log knows a newer leader than the placement: it
                    # follows that one; the other shards take their roles regardless
                    log.warning("%s/%d: placement version %d is stale here: %s", name,
                                shard_placement.shard, placement.version, exc.message)
        self.remote.placement_changed()
        self.feed.placement_changed()

    async def _barrier_here(self, shard: int) -> None:
        await self.replicas[shard].read_barrier()

    def _leads(self, shard: int) -> bool:
        return self.replicas[shard].leadership is not None

    # -- the peer port --------------------------------------------------------------

    def _log_of(self, db: str, shard: int) -> ShardLog:
        if db != self.database.name:
            raise KeyError(db)
        return self._logs[shard]

    def _on_append(self, db: str, shard: int) -> None:
        if db == self.database.name and 0 <= shard < len(self.replicas):
            replica = self.replicas[shard]
            replica.committed_moved()
            leadership = replica.leadership
            if leadership is not None and not leadership.current:
                replica.step_down_for_newer_epoch()

    async def _submit(self, db: str, shard: int, body: bytes) -> None:
        if db != self.database.name or not 0 <= shard < len(self.replicas):
            raise NotLeaderError(f"this site holds no shard {db}/{shard}")
        messages, puts, deletes = decode_submit(body)
        await self.replicas[shard].submit_forwarded(messages, puts, deletes)

    async def _barrier(self, db: str, shard: int) -> int:
        if db != self.database.name or not 0 <= shard < len(self.replicas):
            raise NotLeaderError(f"this site holds no shard {db}/{shard}")
        return await self.replicas[shard].barrier_offset()

    async def _read_records(self, db: str, shard: int,
                            prefix: bytes) -> list[tuple[bytes, bytes]]:
        if db != self.database.name or not 0 <= shard < len(self.replicas):
            raise NotLeaderError(f"this site holds no shard {db}/{shard}")
        return await self.replicas[shard].read_records_for_peer(prefix)

    def _bootstrap_routes(self, app: web.Application) -> None:
        app.router.add_get("/peer/v1/checkpoints/{db}/{shard}", self._send_checkpoint)
        app.router.add_post("/peer/v1/bootstraps/{db}/{shard}", self._bootstrap)

    def _replica_of(self, http: web.Request) -> ShardReplica | None:
        try:
            shard = int(http.match_info["shard"])
        except ValueError:
            return None
        if http.match_info["db"] != self.database.name or not 0 <= shard < len(self.replicas):
            return None
        return self.replicas[shard]

    async def _send_checkpoint(self, http: web.Request) -> web.StreamResponse:
        """A checkpoint of one shard for a replica that bootstraps from it."""
        replica = self._replica_of(http)
        if replica is None:
            return web.json_response({"error": "unknown_shard"}, status=404)
        return await serve_checkpoint(http, self.database, replica.shard_id, replica.log,
                                      self._data_dir / REPLICATION_DIR / CHECKPOINTS_DIR)

    async def _bootstrap(self, http: web.Request) -> web.Response:
        """The shard's leader asks this site to bootstrap its replica from it."""
        replica = self._replica_of(http)
        if replica is None:
            return web.json_response({"error": "unknown_shard"}, status=404)
        try:
            source = (await http.json())["from"]
            if not isinstance(source, str):
                raise TypeError(source)
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "bad_request",
                                      "message": 'expected {"from": "host:port"}'},
                                     status=400)
        try:
            last = await replica.bootstrap_from(source)
        except StorageError as error:
            return web.json_response({"error": type(error).__name__,
                                      "message": error.message}, status=503)
        return web.json_response({"last": [last.epoch, last.offset]})

    # -- database.Replication ---------------------------------------------------------

    async def write(self, shard_id: int, messages: list[Message],
                    record_puts: list[tuple[bytes, bytes]], record_deletes: list[bytes]) -> None:
        await self.replicas[shard_id].write(messages, record_puts, record_deletes)

    async def read_records(self, shard_id: int, prefix: bytes) -> list[tuple[bytes, bytes]]:
        return await self.replicas[shard_id].read_records(prefix)

    def placement_of(self, shard_id: int) -> tuple[tuple[str, ...], str]:
        placement = self.replicas[shard_id].placement
        return ((), "") if placement is None else (placement.replicas, placement.leader)

    async def add_generation(self, shard_id: int) -> bool:
        return await self.replicas[shard_id].add_generation()

    async def drop_generation(self, shard_id: int, generation_id: int) -> bool:
        return await self.replicas[shard_id].propose(entries.DropGeneration(generation_id))

    async def close(self) -> None:
        """Stop serving the peer port, stop every replica's loops, close the logs."""
        await self._server.stop()
        await self.feed.close()
        await self.remote.close()
        for replica in self.replicas:
            await replica.close()
        await self._session.close()
        loop = asyncio.get_running_loop()
        for shard_log in self._logs:
            await loop.run_in_executor(self._executor, shard_log.close)
        self._logs = []


def _load_peers(data_dir: Path) -> dict[str, str]:
    path = data_dir / REPLICATION_DIR / PEERS_FILE
    try:
        return parse_peers(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}
    except (ValueError, PlacementError) as exc:
        raise CorruptDataError(f"{path}: the peers' addresses do not parse ({exc}); "
                               f"remove the file to wait for the controller's next push"
                               ) from exc


def _store_peers(data_dir: Path, peers: dict[str, str]) -> None:
    folder = data_dir / REPLICATION_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / PEERS_FILE, json.dumps(peers, sort_keys=True, indent=1))
