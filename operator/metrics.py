"""The operator's own Prometheus metrics, served on their own port (`/metrics`)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter(
    "stratamq_operator_reconciles_total",
    "Reconciles of a DurableStorage (its objects applied), by result.", ["result"])
RECONCILE_SECONDS = Histogram(
    "stratamq_operator_reconcile_seconds", "Time one reconcile took.")
STATUS_REFRESHES = Counter(
    "stratamq_operator_status_refreshes_total",
    "Status refreshes of a DurableStorage (pods and sites observed), by result.", ["result"])
SITES = Gauge("stratamq_operator_sites", "Sites (pods) that exist, per DurableStorage.",
              ["namespace", "name"])
SITES_READY = Gauge("stratamq_operator_sites_ready",
                    "Sites ready and known by id, per DurableStorage.", ["namespace", "name"])


def serve(bind: str) -> None:
    """Serve /metrics on `bind` (host:port) from a daemon thread."""
    host, _, port = bind.rpartition(":")
    start_http_server(int(port), addr=host or "0.0.0.0")


def forget(namespace: str, name: str) -> None:
    """Drop the series of a deleted DurableStorage."""
    for gauge in (SITES, SITES_READY):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
