"""What the controller knows of each site: where to reach it, when it last answered
its heartbeat probe (`GET /api/v1/ds/replication`), and what it reported there;
the placement it keeps (`GET /api/v1/ds/placement`). Pure data, parsing and the
paths of the sites' admin API that every controller calls; the controllers' site
clients (`site_client.py`, `operator/sites.py`) do the polling."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ds.replication import Placement, ShardId
from ..ds.replication.placement import check_database, check_site_id
from ..ds.replication.term import ControllerTerm, parse_term
from ..errors import PlacementError, StratamqError

ROLES = frozenset({"leader", "follower", "none"})

# The sites' admin API as a controller calls it (docs/peer-protocol.md).
REPLICATION_PATH = "/api/v1/ds/replication"  # the heartbeat probe
PLACEMENT_PATH = "/api/v1/ds/placement"  # the placement kept (GET), pushed (PUT)
TERM_PATH = "/api/v1/ds/controller-term"  # the claim of the controller term


class BadReportError(StratamqError):
    """A site's answer to the heartbeat probe that does not have the agreed shape."""


@dataclass(frozen=True)
class ShardReport:
    """One shard as a site reports it: its role, the epoch it knows, where its log
    ends (`last`, (epoch, offset)), the committed offset it knows, and how far it has
    applied committed entries to its storage. `quorum_age`, from the shard's leader
    only: seconds since a majority of its replicas last answered it (None
    elsewhere)."""

    role: str
    epoch: int
    last: tuple[int, int]
    committed: int
    applied: int
    quorum_age: float | None = None


@dataclass(frozen=True)
class Report:
    """One answer of `GET /api/v1/ds/replication`."""

    site: str
    peer: str
    placement_version: int | None
    shards: Mapping[ShardId, ShardReport]
    # at a graceful stop: it waits for its shards' leaderships to go elsewhere
    stopping: bool
    # seconds between an idle leader's heartbeats to its followers
    heartbeat_interval: float
    # the highest controller term the site has seen
    term: ControllerTerm
    # the site's failure zone (`cluster.zone`); None: not known, or a site older than
    # the report's `zone` key
    zone: str | None = None


class Refused:
    """A probe's answer where nothing listened at the site's address: the connection
    was refused, twice (`REFUSAL_RECHECK` apart). Its process is down (killed,
    crashed, restarting), not slow: a loaded or cut-off site times out instead."""

    def __repr__(self) -> str:
        return "REFUSED"


REFUSED = Refused()
# A refused probe is tried again once after this: a listener that is being replaced
# in a running process is not a site down.
REFUSAL_RECHECK = 0.1


@dataclass(frozen=True)
class SiteState:
    """A site the controller knows. `last_seen` is the controller's monotonic clock
    at the last answer (for a site known from disk, at the controller's start, so that
    a restarted controller gives it the same grace as a site that just answered);
    `answered` says whether it has answered since the controller started. Until it
    has, what it reports (`peer`, `placement_version`, `shards`, `stopping`,
    `heartbeat_interval`, `term`) is not known: None or empty. `zone`: the site's
    failure zone, which the planner keeps a shard's replicas apart by: as the site
    reports it (`cluster.zone`), or as the operator reads it from the site's node;
    None when not known. `refused`: its last probe found nothing listening at its
    address (`REFUSED`): down now, not in `gone_after`."""

    id: str
    admin_url: str
    last_seen: float
    answered: bool = False
    peer: str | None = None
    placement_version: int | None = None
    shards: Mapping[ShardId, ShardReport] = field(default_factory=dict)
    stopping: bool = False
    heartbeat_interval: float | None = None
    term: ControllerTerm | None = None
    zone: str | None = None
    refused: bool = False

    def seen(self, report: Report, now: float) -> SiteState:
        return SiteState(id=self.id, admin_url=self.admin_url, last_seen=now, answered=True,
                         peer=report.peer, placement_version=report.placement_version,
                         shards=report.shards, stopping=report.stopping,
                         heartbeat_interval=report.heartbeat_interval, term=report.term,
                         zone=report.zone)


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadReportError(f"{where}: {value!r} is not a whole number >= 0")
    return value


def parse_held(document: Any) -> tuple[Placement, frozenset[str]] | None:
    """A site's answer to `GET /api/v1/ds/placement`: the placement it keeps and the
    sites it was told are forgotten; None when it keeps none. `BadReportError` says
    what is wrong."""
    if not isinstance(document, dict):
        raise BadReportError(f"expected an object, got {type(document).__name__}")
    if document.get("placement") is None:
        return None
    try:
        placement = Placement.from_dict(document["placement"])
        forgotten = document.get("forgotten", [])
        if not isinstance(forgotten, list):
            raise BadReportError(f"forgotten: {forgotten!r} is not a list of site ids")
        sites = frozenset(check_site_id(site, "forgotten") for site in forgotten)
    except PlacementError as exc:
        raise BadReportError(exc.message) from exc
    return placement, sites


def _seconds(value: object, where: str) -> float | None:
    """An optional number of seconds >= 0 (None or absent: not told)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
            or value == float("inf"):
        raise BadReportError(f"{where}: {value!r} is not a number of seconds >= 0")
    return float(value)


def parse_report(document: Any) -> Report:
    """Check and read a site's answer; `BadReportError` says what is wrong."""
    if not isinstance(document, dict):
        raise BadReportError(f"expected an object, got {type(document).__name__}")
    try:
        site = check_site_id(document.get("site"), "site")
        peer = document.get("peer")
        if not isinstance(peer, str) or not peer:
            raise BadReportError(f"peer: {peer!r} is not host:port")
        version = document.get("placement_version")
        if version is not None:
            version = _count(version, "placement_version")
        stopping = document.get("stopping")
        if not isinstance(stopping, bool):
            raise BadReportError(f"stopping: {stopping!r} is not true or false")
        heartbeat_interval = _seconds(document.get("heartbeat_interval"),
                                      "heartbeat_interval")
        if heartbeat_interval is None:
            raise BadReportError("heartbeat_interval: missing")
        term_value = document.get("controller_term")
        if term_value is None:
            raise BadReportError("controller_term: missing")
        term = parse_term(term_value, "controller_term")
        # Absent from the reports of sites older than zones: not known, as null.
        zone = document.get("zone")
        if zone is not None and (not isinstance(zone, str) or not zone):
            raise BadReportError(f"zone: {zone!r} is not a zone name or null")
        entries = document.get("shards")
        if not isinstance(entries, list):
            raise BadReportError(f"shards: expected a list, got {type(entries).__name__}")
        shards: dict[ShardId, ShardReport] = {}
        for number, entry in enumerate(entries):
            where = f"shards[{number}]"
            if not isinstance(entry, dict):
                raise BadReportError(f"{where}: expected an object")
            database = check_database(entry.get("db"), f"{where}.db")
            shard = _count(entry.get("shard"), f"{where}.shard")
            role = entry.get("role")
            if role not in ROLES:
                raise BadReportError(f"{where}.role: {role!r} is not one of {sorted(ROLES)}")
            last = entry.get("last")
            if not isinstance(last, list) or len(last) != 2:
                raise BadReportError(f"{where}.last: {last!r} is not [epoch, offset]")
            shards[(database, shard)] = ShardReport(
                role=str(role), epoch=_count(entry.get("epoch"), f"{where}.epoch"),
                last=(_count(last[0], f"{where}.last"), _count(last[1], f"{where}.last")),
                committed=_count(entry.get("committed"), f"{where}.committed"),
                applied=_count(entry.get("applied"), f"{where}.applied"),
                quorum_age=_seconds(entry.get("quorum_age"), f"{where}.quorum_age"))
    except StratamqError as exc:
        if isinstance(exc, BadReportError):
            raise
        raise BadReportError(exc.message) from exc
    return Report(site=site, peer=peer, placement_version=version, shards=shards,
                  stopping=stopping, heartbeat_interval=heartbeat_interval, term=term,
                  zone=zone)
