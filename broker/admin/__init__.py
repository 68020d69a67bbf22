"""The admin HTTP API of a site: REST under `/api/v1` (authenticated), `/metrics`
(Prometheus text format), `/healthz` and `/readyz` (probes); and `stratamq ctl`
commands that call it."""

from __future__ import annotations

from .server import AdminServer, start_admin

__all__ = ["AdminServer", "start_admin"]
