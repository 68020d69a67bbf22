"""The admin HTTP server (aiohttp) on `admin.bind`.

It starts before the storage opens, so `/healthz` answers while a large RocksDB is
still opening; `/readyz` and `/api/v1` answer 503 until the site is attached and
again once it starts stopping. The listener is guarded (`http/guard.py`: a connection
limit of its own, a header timeout) and `/metrics` is cached (`metrics_cache.py`), so
that nobody who reaches the port can take MQTT down. Every response of `/api/v1` is
JSON; every error is
`{"error": CODE, "message": why}` with CODE the HTTP status phrase (`NOT_FOUND`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ..channel.channel import Channel as Connection
from ..config import AdminConfig
from ..core.broker import Broker
from ..ds import (
    DIGEST_DIR,
    Database,
    DbDescription,
    DurableStorage,
    SiteReplication,
)
from ..errors import StorageClosedError, UnknownDatabaseError, UnknownSiteError
from ..http.guard import ConnectionGuard, GuardedListener
from ..net.address import listening, split_bind
from ..net.listeners import ListenerSet
from .credentials import Credentials, resolve_credentials
from .digests import ShardDigests
from .http_errors import BadRequestError, ReplicationOffError, UnknownClientError
from .metrics_cache import MetricsCache
from .middleware import BODY_TIMEOUT, authentication, errors, json_body, listing
from .paths import checkpoint_folder
from .views import (
    Json,
    client_view,
    shared_group_views,
    site_view,
    storage_summary,
    storage_view,
    subscription_view,
)

log = logging.getLogger(__name__)

API = "/api/v1"
# The only paths served without credentials (`/metrics` too unless
# `admin.metrics_auth`); everything else (unknown paths too) needs them, so a typo in
# a route never opens it.
PROBES = frozenset({"/healthz", "/readyz"})


@dataclass(frozen=True, slots=True)
class SiteParts:
    storage: DurableStorage
    broker: Broker
    listeners: ListenerSet
    replication: SiteReplication | None = None


class AdminServer:
    def __init__(self, credentials: Credentials, settings: AdminConfig | None = None) -> None:
        self.credentials = credentials
        self.settings = settings or AdminConfig()
        self.port = 0
        self._parts: SiteParts | None = None
        self._stopping = False
        self._listener: GuardedListener | None = None
        # by data folder (one, once the storage is attached): one digest at a time
        self._digests: dict[Path, ShardDigests] = {}
        self._metrics_cache = MetricsCache(self.settings.metrics_interval,
                                           self._refresh_disk_metrics)

    # -- lifecycle ------------------------------------------------------------------

    def attach(self, storage: DurableStorage, broker: Broker, listeners: ListenerSet,
               replication: SiteReplication | None = None) -> None:
        """The site is up: serve the API and report ready."""
        self._parts = SiteParts(storage, broker, listeners, replication)
        log.info("admin API serving site %s", storage.site_id)

    def stopping(self) -> None:
        """The site is stopping but still serves (it hands its shards over): report
        not ready, so no new client is sent here; the API keeps answering."""
        self._stopping = True

    def detach(self) -> None:
        """The site is stopping: report not ready, answer the API with 503."""
        self._parts = None

    async def start(self, bind: str) -> None:
        settings = self.settings
        open_paths = PROBES if settings.metrics_auth else PROBES | {"/metrics"}
        guard = ConnectionGuard("admin", settings.max_connections, settings.header_timeout)
        app = web.Application(middlewares=[guard.middleware, errors,
                                           authentication(self.credentials, open_paths)])
        app[BODY_TIMEOUT] = settings.body_timeout
        app.add_routes([
            web.get("/healthz", self._healthz),
            web.get("/readyz", self._readyz),
            web.get("/metrics", self._metrics),
            web.get(f"{API}/clients", self._clients),
            web.get(f"{API}/clients/{{client_id}}", self._client),
            web.get(f"{API}/subscriptions", self._subscriptions),
            web.get(f"{API}/shared_groups", self._shared_groups),
            web.get(f"{API}/ds/storages", self._storages),
            web.get(f"{API}/ds/storages/{{db}}", self._storage),
            web.post(f"{API}/ds/storages/{{db}}/checkpoints", self._checkpoint),
            web.post(f"{API}/ds/storages/{{db}}/gc-plan", self._gc_plan),
            web.put(f"{API}/ds/storages/{{db}}/topic-structure", self._topic_structure),
            web.get(f"{API}/ds/storages/{{db}}/shards/{{shard}}/digest", self._digest),
            web.get(f"{API}/ds/sites", self._sites),
            web.get(f"{API}/ds/sites/{{site}}", self._site_detail),
            web.get(f"{API}/ds/replication", self._replication_status),
            web.get(f"{API}/ds/placement", self._held_placement),
            web.put(f"{API}/ds/placement", self._placement),
            web.put(f"{API}/ds/controller-term", self._controller_term),
        ])
        listener = GuardedListener(app, guard, shutdown_timeout=5.0)
        host, port = split_bind(bind)
        with listening("admin.bind", bind):
            await listener.start(host, port)
        self._listener = listener
        self.port = listener.port
        log.info("admin API listening on http://%s:%d", host, self.port)

    async def stop(self) -> None:
        self.detach()
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None

    def _running(self) -> SiteParts:
        if self._parts is None:
            raise StorageClosedError("the site is starting or stopping")
        return self._parts

    # -- probes and metrics -----------------------------------------------------------

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        parts = self._parts
        checks = {
            "storage": parts is not None and bool(parts.storage.databases),
            "listeners": parts is not None and all(
                server.is_serving() for server in parts.listeners.servers),
            "running": not self._stopping,
            # A replica that restarted behind its leader has caught up: a rolling
            # restart (the StatefulSet waits for Ready) stops the next site only then.
            "replicas": parts is not None and (parts.replication is None
                                               or not parts.replication.catching_up()),
        }
        ready = all(checks.values())
        return web.json_response(
            {"status": "ready" if ready else "not_ready",
             "checks": {name: "ok" if ok else "failing" for name, ok in checks.items()}},
            status=200 if ready else 503)

    async def _refresh_disk_metrics(self) -> None:
        if self._parts is not None:
            await self._parts.storage.refresh_disk_metrics()

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=await self._metrics_cache.body(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- /api/v1 ----------------------------------------------------------------------

    def _connections(self) -> list[Connection]:
        found = [connection for connection in self._running().broker.connections.values()
                 if isinstance(connection, Connection)]
        return sorted(found, key=lambda connection: connection.client_id)

    async def _clients(self, _request: web.Request) -> web.Response:
        return listing([client_view(connection) for connection in self._connections()])

    async def _client(self, request: web.Request) -> web.Response:
        client_id = request.match_info["client_id"]
        connection = self._running().broker.connections.get(client_id)
        if not isinstance(connection, Connection):
            raise UnknownClientError(f"no connected client {client_id!r}")
        return web.json_response(client_view(connection))

    async def _subscriptions(self, _request: web.Request) -> web.Response:
        sessions = sorted(self._running().broker.sessions.values(),
                          key=lambda session: session.client_id)
        return listing([subscription_view(session, subscription)
                        for session in sessions
                        for _, subscription in sorted(session.subscriptions.items())])

    async def _shared_groups(self, _request: web.Request) -> web.Response:
        broker = self._running().broker
        return listing(shared_group_views(broker.dispatcher, broker.shared_positions.saved))

    async def _descriptions(self) -> list[DbDescription]:
        databases = self._running().storage.databases
        return [await databases[name].describe() for name in sorted(databases)]

    async def _storages(self, _request: web.Request) -> web.Response:
        return listing([storage_summary(found) for found in await self._descriptions()])

    async def _storage(self, request: web.Request) -> web.Response:
        database = self._running().storage.db(request.match_info["db"])
        return web.json_response(storage_view(await database.describe()))

    def _any_database(self, name: str) -> Database:
        """A messages or key-value database of this site, by name."""
        storage = self._running().storage
        if name in storage.databases:
            return storage.databases[name]
        if name in storage.kv_databases:
            return storage.kv_databases[name].database
        known = sorted([*storage.databases, *storage.kv_databases])
        raise UnknownDatabaseError(f"no database {name!r} (this site has: {', '.join(known)})")

    async def _checkpoint(self, request: web.Request) -> web.Response:
        """Make a checkpoint of a database: body `{"dir": FOLDER}`, a new folder on
        the site's machine; relative folders are taken under `<data dir>/checkpoints`,
        absolute ones must lie there or in one of `admin.checkpoint_dirs`. With
        `"shards": [ids]`, of those shards only (a Spark run reads each shard's copy
        at one site)."""
        database = self._any_database(request.match_info["db"])
        body = await json_body(request)
        target = checkpoint_folder(body.get("dir"), self._running().storage.data_dir,
                                   [Path(folder) for folder in self.settings.checkpoint_dirs])
        shards = body.get("shards")
        if shards is not None and not (
                isinstance(shards, list)
                and all(isinstance(shard, int) and not isinstance(shard, bool)
                        and 0 <= shard < database.shard_count for shard in shards)):
            raise BadRequestError(f'give "shards" as a list of shard ids from 0 to '
                                  f'{database.shard_count - 1}')
        manifest = await database.checkpoint(target, shards)
        log.info("checkpoint of %r made in %s", database.name, target)
        return web.json_response({"dir": str(target), "manifest": manifest}, status=201)

    async def _gc_plan(self, request: web.Request) -> web.Response:
        """Apply a generation GC plan of `stratamq spark gc` (the body): what was
        dropped or rewritten per generation, and the bytes freed."""
        database = self._running().storage.db(request.match_info["db"])
        report = await database.apply_gc_plan(await json_body(request))
        log.info("GC plan applied to %r: %d messages deleted, %d bytes freed",
                 database.name, report["deleted_messages"], report["bytes_freed"])
        return web.json_response(report)

    async def _topic_structure(self, request: web.Request) -> web.Response:
        """Seed the next generation's learned topic structure: body `{"patterns":
        [...]}` (a seed of `stratamq spark learn-topics`)."""
        database = self._running().storage.db(request.match_info["db"])
        patterns = (await json_body(request)).get("patterns")
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise BadRequestError('give the seed as {"patterns": ["fleet/+/+/temp", ...]}')
        await database.set_topic_seed(patterns)
        log.info("topic seed of %d patterns set on %r: used from its next generation",
                 len(patterns), database.name)
        return web.json_response({"db": database.name, "patterns": len(patterns),
                                  "applies_to": "the next generation of every shard"})

    async def _digest(self, request: web.Request) -> web.Response:
        """The digest of one shard's applied content (`digests.py`)."""
        storage = self._running().storage
        digests = self._digests.setdefault(storage.data_dir, ShardDigests(
            storage.data_dir / DIGEST_DIR))
        return web.json_response(await digests.answer(
            storage.site_id, self._any_database(request.match_info["db"]),
            request.match_info["shard"], dict(request.query)))

    async def _sites(self, _request: web.Request) -> web.Response:
        return listing([await self._site_view()])

    async def _site_detail(self, request: web.Request) -> web.Response:
        site_id = self._running().storage.site_id
        if request.match_info["site"] != site_id:
            raise UnknownSiteError(f"no site {request.match_info['site']!r} (this site is "
                                   f"{site_id}; no other site is known)")
        return web.json_response(await self._site_view())

    def _replication(self) -> SiteReplication:
        replication = self._running().replication
        if replication is None:
            raise ReplicationOffError("this site runs without replication (cluster.enable "
                                      "is false)")
        return replication

    async def _replication_status(self, _request: web.Request) -> web.Response:
        """This site's shard replicas: role, epoch, log end, committed and applied
        offsets. Also the controller's heartbeat probe."""
        status = self._replication().status()
        relay = self._running().broker.relay
        if relay is not None:
            status.update(relay.status())
        return web.json_response(status)

    async def _held_placement(self, _request: web.Request) -> web.Response:
        """The placement this site keeps (`null` before the first push), the peers'
        addresses and the sites forgotten: `{"placement": document, "peers": {...},
        "forgotten": [...]}`. A controller whose own copy is older adopts it."""
        return web.json_response(self._replication().kept.held())

    async def _placement(self, request: web.Request) -> web.Response:
        """Take a placement pushed by the controller: body `{"placement": document,
        "peers": {site: "host:port"}, "forgotten": [site, ...], "term": [number,
        "controller id"]}`. The controller and the operator send every field; a push
        by hand, where no controller runs, may leave out `forgotten` (not told) and
        `term` (term 0)."""
        replication = self._replication()
        body = await json_body(request)
        if "placement" not in body or "peers" not in body:
            raise BadRequestError('give {"placement": {...}, "peers": {"<site>": '
                                  '"host:port", ...}}')
        # accepted: false (this site keeps another document, or holds a newer controller
        # term) tells the controller that its placement, or itself, is stale
        accepted, version, term = await replication.kept.offer(
            body["placement"], body["peers"], body.get("forgotten"), body.get("term"))
        return web.json_response({"accepted": accepted, "version": version,
                                  "term": term.to_json()})

    async def _controller_term(self, request: web.Request) -> web.Response:
        """A controller claims its term before it decides: body `{"term": [number,
        "controller id"]}`; `accepted: false` with the term this site holds when that
        is higher (the claimant is fenced)."""
        replication = self._replication()
        body = await json_body(request)
        if "term" not in body:
            raise BadRequestError('give {"term": [number, "controller id"]}')
        accepted, term = await replication.kept.claim(body["term"])
        return web.json_response({"accepted": accepted, "term": term.to_json()})

    async def _site_view(self) -> Json:
        return site_view(self._running().storage.site_id, await self._descriptions())


async def start_admin(config: AdminConfig, data_dir: Path) -> AdminServer:
    """Resolve the credentials (generating a token when none is configured) and start
    serving probes and metrics. The site id comes from the storage, once attached."""
    server = AdminServer(resolve_credentials(config, data_dir), config)
    await server.start(config.bind)
    return server
