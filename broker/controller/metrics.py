"""The controller's metrics (`/metrics` of its API), computed at scrape time from its
state: sites up, the placement version, leader changes, placements adopted from the
sites, steps of the pending plan,
under-replicated shards and each replica's lag; and the guard's counters of its
API's connections (`http/guard.py`). A registry of its own, so that the
broker's metrics (registered when broker modules are imported) do not show up as
zeros next to them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import PlanError
from ..http.guard import BAD_REQUESTS, EVICTED, REFUSED, TIMED_OUT
from .decisions import ClusterState, Settings, is_gone
from .sites import SiteState


@dataclass(frozen=True)
class Snapshot:
    state: ClusterState
    sites: Mapping[str, SiteState]
    leader_changes: int
    adoptions: int = 0
    # the controller term's number (0 before one is taken) and whether a newer
    # controller fenced this one
    term: int = 0
    fenced: bool = False


class ControllerCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot], settings: Settings) -> None:
        self._snapshot = snapshot
        self._settings = settings

    def collect(self) -> Iterator[Metric]:
        found = self._snapshot()
        now = time.monotonic()
        placement = found.state.placement
        up = {site.id for site in found.sites.values()
              if site.answered and not is_gone(site, now, self._settings)}

        sites = GaugeMetricFamily("stratamq_cluster_sites", "Sites the controller knows, "
                                  "by whether they answer their heartbeats", labels=["state"])
        sites.add_metric(["up"], len(up))
        sites.add_metric(["down"], len(found.sites) - len(up))
        yield sites
        yield GaugeMetricFamily("stratamq_cluster_placement_version",
                                "Version of the placement the controller holds",
                                value=placement.version)
        changes = CounterMetricFamily("stratamq_cluster_leader_changes",
                                      "Shard leaders changed (failovers and handovers)")
        changes.add_metric([], found.leader_changes)
        yield changes
        adoptions = CounterMetricFamily(
            "stratamq_cluster_placement_adoptions", "Times the controller took the "
            "placement the sites keep for its own (its own was older: a data folder "
            "restored from an older copy, or lost)")
        adoptions.add_metric([], found.adoptions)
        yield adoptions
        yield GaugeMetricFamily("stratamq_cluster_controller_term",
                                "Number of the controller term this controller took (0: "
                                "none yet)", value=found.term)
        yield GaugeMetricFamily("stratamq_cluster_controller_fenced",
                                "1 when the sites hold a newer controller's term: this "
                                "controller decides and pushes nothing", value=int(found.fenced))
        remaining = 0
        if found.state.plan is not None:
            try:
                remaining = len(found.state.plan.remaining(placement))
            except PlanError:
                remaining = 0
        yield GaugeMetricFamily("stratamq_cluster_transitions_pending",
                                "Replica transitions (+site / -site) of the pending plan "
                                "not yet taken", value=remaining)
        under = GaugeMetricFamily(
            "stratamq_cluster_under_replicated_shards", "Shards with fewer replicas up than "
            "the replication factor", labels=["db"])
        lag = GaugeMetricFamily(
            "stratamq_cluster_replica_lag", "Committed entries of the shard's leader that "
            "a replica has not applied (as last reported)", labels=["db", "shard", "site"])
        counts: dict[str, int] = {}
        for shard in placement.shards:
            alive = [site for site in shard.replicas if site in up]
            short = len(alive) < self._settings.replication_factor
            counts[shard.database] = counts.get(shard.database, 0) + int(short)
            leader = found.sites.get(shard.leader)
            leader_report = None if leader is None else leader.shards.get(shard.id)
            if leader_report is None:
                continue
            for site in alive:
                report = found.sites[site].shards.get(shard.id)
                if report is not None:
                    lag.add_metric([shard.database, str(shard.shard), site],
                                   max(0, leader_report.committed - report.applied))
        for database, count in sorted(counts.items()):
            under.add_metric([database], count)
        yield under
        yield lag


def controller_registry(snapshot: Callable[[], Snapshot], settings: Settings
                        ) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ControllerCollector(snapshot, settings))
    # the guard's counters of the controller's API (listener="controller")
    for counter in (REFUSED, EVICTED, TIMED_OUT, BAD_REQUESTS):
        registry.register(counter)
    return registry
