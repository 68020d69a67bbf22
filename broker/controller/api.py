"""The controller's HTTP API (docs/peer-protocol.md, "The controller's API"): the
cluster API of the admin CLI (`stratamq ctl ds ...`) with the same bearer-token scheme
as the sites, `/healthz` and `/metrics`. Its listener is guarded (`http/guard.py`):
whoever reaches it cannot hold the controller's file descriptors.

It shows the controller's state (`views.py`, `metrics.py`) and hands every change to
the controller (`ClusterControl`), which applies it under its lock, keeps it on disk
and logs it; here are the requests and their answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..admin.credentials import Credentials
from ..admin.http_errors import BadRequestError
from ..admin.middleware import authentication, errors, json_value, listing
from ..errors import UnknownDatabaseError, UnknownSiteError
from ..http.guard import (
    HEADER_TIMEOUT,
    KEEPALIVE_TIMEOUT,
    ConnectionGuard,
    GuardedListener,
    descriptor_share,
)
from . import decisions
from .decisions import ClusterState, Settings
from .metrics import Snapshot, controller_registry
from .site_client import site_url
from .sites import SiteState
from .terms import TermKeeper
from .views import site_view, storage_summary, storage_view

API = "/api/v1"
OPEN_PATHS = frozenset({"/healthz", "/metrics"})
# The most connections the API holds (`http/guard.py`; then the one waiting longest
# for its first request is closed). Its clients are the admin CLI, the operator,
# Prometheus and probes: a handful at a time; 256 as the sites' admin ports.
API_MAX_CONNECTIONS = 256


class ClusterControl(Protocol):
    """What the API reads of the controller and asks of it (`controller.Controller`)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def state(self) -> ClusterState: ...

    @property
    def sites(self) -> Mapping[str, SiteState]: ...

    @property
    def term_keeper(self) -> TermKeeper: ...

    def snapshot(self) -> Snapshot: ...

    def add_site(self, url: str) -> None: ...

    async def change(self, database: str,
                     change: Callable[[ClusterState, float], ClusterState]) -> None: ...

    async def forget(self, site: str) -> None: ...


class ControllerAPI:
    """The API's routes over a `ClusterControl`, served by the listener it builds."""

    def __init__(self, control: ClusterControl, token: str) -> None:
        self._control = control
        self._token = token
        self._registry = controller_registry(control.snapshot, control.settings)

    def listener(self) -> GuardedListener:
        """A guarded listener of the API, not started."""
        guard = ConnectionGuard("controller", descriptor_share(API_MAX_CONNECTIONS),
                                HEADER_TIMEOUT, KEEPALIVE_TIMEOUT)
        app = web.Application(middlewares=[
            guard.middleware, errors,
            authentication(Credentials(token=self._token), OPEN_PATHS)])
        app.add_routes([
            web.get("/healthz", self._healthz),
            web.get("/metrics", self._metrics),
            web.get(f"{API}/ds/sites", self._sites),
            web.post(f"{API}/ds/sites", self._add_site),
            web.get(f"{API}/ds/sites/{{site}}", self._site),
            web.delete(f"{API}/ds/sites/{{site}}", self._forget),
            web.get(f"{API}/ds/storages", self._storages),
            web.get(f"{API}/ds/storages/{{db}}", self._storage),
            web.put(f"{API}/ds/storages/{{db}}/replicas", self._set_replicas),
            web.put(f"{API}/ds/storages/{{db}}/replicas/{{site}}", self._join),
            web.delete(f"{API}/ds/storages/{{db}}/replicas/{{site}}", self._leave),
        ])
        return GuardedListener(app, guard, shutdown_timeout=2.0)

    async def _healthz(self, _request: web.Request) -> web.Response:
        """200 `ok`, or 503 `fenced` once the sites hold a newer controller's term;
        with this controller's term and whether a majority of the sites holds it."""
        keeper = self._control.term_keeper
        fenced = keeper.fenced_by is not None
        return web.json_response({
            "status": "fenced" if fenced else "ok",
            "term": None if keeper.term is None else keeper.term.to_json(),
            "holds_term": keeper.in_charge,
            "fenced_by": None if keeper.fenced_by is None else keeper.fenced_by.to_json(),
        }, status=503 if fenced else 200)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _site_state(self, site: str) -> SiteState:
        found = self._control.sites.get(site)
        if found is None:
            raise UnknownSiteError(f"unknown site {site!r} (known: "
                                   f"{', '.join(sorted(self._control.sites)) or 'none'})")
        return found

    async def _sites(self, _request: web.Request) -> web.Response:
        now = time.monotonic()
        control = self._control
        return listing([site_view(control.sites[site], control.state.placement, now,
                                  control.settings)
                        for site in sorted(control.sites)])

    async def _add_site(self, request: web.Request) -> web.Response:
        """Probe one more site from now on: body `{"admin_url": "http://host:port"}`.
        It is known by its id once it answers; `ds join` / `set-replicas` give it
        replicas."""
        body = await json_value(request)
        address = body.get("admin_url") if isinstance(body, dict) else None
        try:
            url = site_url(address) if isinstance(address, str) else None
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        if url is None:
            raise BadRequestError('give the site as {"admin_url": "http://host:port"}')
        self._control.add_site(url)
        return web.json_response({"admin_url": url, "probed": True}, status=202)

    async def _site(self, request: web.Request) -> web.Response:
        found = self._site_state(request.match_info["site"])
        return web.json_response(site_view(found, self._control.state.placement,
                                           time.monotonic(), self._control.settings))

    def _database(self, request: web.Request) -> str:
        database = request.match_info["db"]
        if database not in self._control.settings.databases:
            raise UnknownDatabaseError(f"no database {database!r} (the cluster has: "
                                       f"{', '.join(self._control.settings.databases)})")
        return database

    async def _storages(self, _request: web.Request) -> web.Response:
        control = self._control
        return listing([storage_summary(database, control.state, control.settings)
                        for database in control.settings.databases])

    async def _storage(self, request: web.Request) -> web.Response:
        control = self._control
        return web.json_response(storage_view(self._database(request), control.state,
                                              control.sites, control.settings))

    async def _change(self, database: str,
                      change: Callable[[ClusterState, float], ClusterState]) -> web.Response:
        """An operator request, kept by the controller before it is answered with the
        database as it is now."""
        control = self._control
        await control.change(database, change)
        return web.json_response(storage_view(database, control.state, control.sites,
                                              control.settings))

    async def _set_replicas(self, request: web.Request) -> web.Response:
        database = self._database(request)
        body = await json_value(request)
        wanted = body.get("sites") if isinstance(body, dict) else body
        if not isinstance(wanted, list) or not all(isinstance(site, str) for site in wanted):
            raise BadRequestError('give the sites as a JSON list of site ids, or as '
                                  '{"sites": ["SITE", ...]}')
        control = self._control
        return await self._change(database, lambda state, now: decisions.set_replicas(
            state, database, wanted, control.sites, now, control.settings))

    async def _join(self, request: web.Request) -> web.Response:
        database, site = self._database(request), request.match_info["site"]
        control = self._control
        return await self._change(database, lambda state, now: decisions.join(
            state, database, site, control.sites, now, control.settings))

    async def _leave(self, request: web.Request) -> web.Response:
        database, site = self._database(request), request.match_info["site"]
        control = self._control
        return await self._change(database, lambda state, now: decisions.leave(
            state, database, site, control.sites, now, control.settings))

    async def _forget(self, request: web.Request) -> web.Response:
        site = request.match_info["site"]
        await self._control.forget(site)
        return web.json_response({"site": site, "forgotten": True})
