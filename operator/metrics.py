"""The operator's own Prometheus metrics, served on their own port (`/metrics`), and
its controllers' (`OperatorCollector`).

The port is guarded as the sites' listeners are (broker/http/guard.py): at most
MAX_CONNECTIONS, headers due within seconds. prometheus_client's own server, used
before, gave each connection a thread and never timed one out: 1,026 idle connections
held 1,022 threads and /metrics answered nobody, and in the operator's 256 MiB each
thread is memory a pod could be killed for."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stratamq.broker.controller.metrics import ControllerCollector
from stratamq.broker.http.guard import (
    HEADER_TIMEOUT,
    KEEPALIVE_TIMEOUT,
    ConnectionGuard,
    GuardedListener,
    descriptor_share,
)
from stratamq.broker.net.address import split_bind

from .controller import Controllers
from .phases import StoragePhase

# Its clients are Prometheus and a probe or two.
MAX_CONNECTIONS = 64

RECONCILES = Counter(
    "stratamq_operator_reconciles_total",
    "Reconciles of a DurableStorage (its objects applied), by result.", ["result"])
APPLY_ERRORS = Counter(
    "stratamq_operator_apply_errors_total",
    "Objects of a DurableStorage the API server did not take at a reconcile (the others "
    "were applied), by kind.", ["kind"])
RECONCILE_SECONDS = Histogram(
    "stratamq_operator_reconcile_seconds", "Time one reconcile took.")
STATUS_REFRESHES = Counter(
    "stratamq_operator_status_refreshes_total",
    "Status refreshes of a DurableStorage (pods and sites observed), by result.", ["result"])
SITES = Gauge("stratamq_operator_sites", "Sites (pods) that exist, per DurableStorage.",
              ["namespace", "name"])
SITES_READY = Gauge("stratamq_operator_sites_ready",
                    "Sites ready and known by id, per DurableStorage.", ["namespace", "name"])
STORAGE_PHASE = Gauge("stratamq_operator_storage_phase",
                      "1 for the phase a DurableStorage is in, 0 for the others.",
                      ["namespace", "name", "phase"])


def set_phase(namespace: str, name: str, phase: str) -> None:
    """Every phase's series of a storage, so an alert can ask how long it has been in
    one (a series for the current phase alone would vanish with each change)."""
    for each in StoragePhase:
        STORAGE_PHASE.labels(namespace, name, each).set(1 if each == phase else 0)


async def serve(bind: str) -> GuardedListener:
    """Serve /metrics on `bind` (host:port) on the running loop, guarded; stop it with
    the listener's `stop`. OSError when the address cannot be bound."""
    guard = ConnectionGuard("operator", descriptor_share(MAX_CONNECTIONS), HEADER_TIMEOUT,
                            KEEPALIVE_TIMEOUT)
    app = web.Application(middlewares=[guard.middleware])
    app.add_routes([web.get("/metrics", _metrics)])
    listener = GuardedListener(app, guard, shutdown_timeout=2.0)
    host, port = split_bind(bind)
    await listener.start(host, port)
    return listener


async def _metrics(_request: web.Request) -> web.Response:
    # Off the loop: the controllers' collector takes their locks.
    body = await asyncio.to_thread(generate_latest, REGISTRY)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def forget(namespace: str, name: str) -> None:
    """Drop the series of a deleted DurableStorage."""
    for gauge in (SITES, SITES_READY):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for phase in StoragePhase:
        with contextlib.suppress(KeyError):
            STORAGE_PHASE.remove(namespace, name, phase)


class OperatorCollector(Collector):
    """The local controller's metrics (`stratamq_cluster_*`, broker/controller/metrics.py),
    one series set per DurableStorage, labelled with its namespace and name, so the
    replication dashboard's controller panels work under Kubernetes too; of the
    controllers that ran a round in the last `within` seconds only (a paused replica
    of the operator exports none)."""

    def __init__(self, controllers: Controllers, within: float) -> None:
        self._controllers = controllers
        self._within = within

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for controller in self._controllers.acting(time.monotonic(), self._within):
            extra = {"namespace": controller.owner.namespace, "name": controller.owner.name}
            collector = ControllerCollector(controller.snapshot, controller.settings)
            for family in collector.collect():
                into = merged.setdefault(family.name, Metric(family.name,
                                                             family.documentation,
                                                             family.type))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, **extra}, sample.value)
        yield from merged.values()
