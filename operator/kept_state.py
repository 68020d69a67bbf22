"""The replication controller's state as the operator keeps it in the DurableStorage's
`status.controller` (docs/replication.md, "The controller"): the record it keeps
(`StatusRecord`), the document's form and its reading back, and its conditional
writes (`KeptState`, the operator's `StateStore`), which are the fence between two
operators (a Kopf peering hand-over): a write is made only at the resourceVersion this
operator last read or wrote."""

from __future__ import annotations

import base64
import binascii
import logging
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stratamq.broker.controller import decisions
from stratamq.broker.controller.decisions import ClusterState
from stratamq.broker.controller.sites import SiteState
from stratamq.broker.controller.store import KeepRefused, Kept
from stratamq.broker.ds.replication import Placement, Plan
from stratamq.broker.ds.replication.term import NO_TERM, ControllerTerm, parse_term
from stratamq.broker.errors import PlacementError

from . import kube
from .resources import API_VERSION, KIND, Owner

log = logging.getLogger(__name__)

KEEP_TRIES = 5  # conditional writes of status.controller refused by other writers' changes
# The placement and the plan grow with shards x databases x replicas (106 KB for three
# databases of 256 shards on 9 sites, against etcd's 1.5 MiB per object); above this
# size each is kept compressed, about 27 times smaller (4 KB there). Below it, as most
# storages are, they stay readable JSON, which older operators read too.
COMPRESS_ABOVE = 16 * 1024
COMPRESSED = "zlib+base64:"


def stored_text(text: str) -> str:
    """`text` (a placement's or plan's JSON) as status.controller keeps it."""
    if len(text) <= COMPRESS_ABOVE:
        return text
    return COMPRESSED + base64.b64encode(zlib.compress(text.encode(), 9)).decode()


def read_text(kept: str) -> str:
    """The inverse of `stored_text`; raises PlacementError when a compressed one is
    damaged (as a damaged JSON one does when parsed)."""
    if not kept.startswith(COMPRESSED):
        return kept
    try:
        return zlib.decompress(base64.b64decode(kept[len(COMPRESSED):],
                                                validate=True)).decode()
    except (binascii.Error, zlib.error, UnicodeDecodeError) as error:
        raise PlacementError(f"status.controller: a compressed document is damaged: "
                             f"{error}") from error


@dataclass(frozen=True)
class StatusRecord:
    """What status.controller keeps: the state, the sites known (site -> its peer
    address, None while unknown) with their pods (site -> pod), the sites forgotten
    (their pods went away while they held nothing: the sites adopt the sessions they
    owned), and the controller term taken."""

    state: ClusterState = field(default_factory=ClusterState)
    sites: Mapping[str, str | None] = field(default_factory=dict)
    pods: Mapping[str, str] = field(default_factory=dict)
    forgotten: frozenset[str] = frozenset()
    term: ControllerTerm = NO_TERM


def kept_document(record: StatusRecord) -> dict[str, Any]:
    """`status.controller`: the placement and plan as the local controller keeps them
    in its files (strings: their own checked formats, compressed when large:
    `stored_text`), the goals, the sites known
    (with their pods and peer addresses), the sites forgotten and the term."""
    state, term = record.state, record.term
    return {
        "term": {"number": term.number, "controller": term.controller},
        "placement": (stored_text(state.placement.to_json()) if state.placement.version > 0
                      else ""),
        "plan": "" if state.plan is None else stored_text(state.plan.to_json()),
        "goals": {database: list(goal) for database, goal in sorted(state.goals.items())},
        "sites": [{"id": site, "pod": record.pods.get(site, ""),
                   "peer": record.sites[site] or ""} for site in sorted(record.sites)],
        "forgotten": sorted(record.forgotten),
    }


def record_of(document: Mapping[str, Any]) -> StatusRecord:
    """The inverse of `kept_document`; the term is term 0 when none is kept (an
    operator before terms)."""
    placement = (Placement.from_json(read_text(document["placement"]))
                 if document.get("placement") else Placement.empty())
    plan = Plan.from_json(read_text(document["plan"])) if document.get("plan") else None
    goals = {database: tuple(goal) for database, goal in (document.get("goals") or {}).items()}
    catch_ups = () if plan is None else decisions.resumed_catch_ups(plan, placement)
    entries = document.get("sites") or []
    kept_term = document.get("term") or {}
    return StatusRecord(
        state=ClusterState(placement=placement, plan=plan, goals=goals, catch_ups=catch_ups),
        sites={entry["id"]: entry.get("peer") or None for entry in entries},
        pods={entry["id"]: entry["pod"] for entry in entries if entry.get("pod")},
        forgotten=frozenset(document.get("forgotten") or []),
        term=parse_term([kept_term["number"], kept_term["controller"]] if kept_term
                        else None, "status.controller.term"))


def known_sites(record: StatusRecord, now: float) -> dict[str, SiteState]:
    """The sites `record` knows, with the grace of one that answered just now (as the
    local controller gives the sites of its files)."""
    return {site: SiteState(id=site, admin_url="", last_seen=now, peer=peer)
            for site, peer in record.sites.items()}


class KeptState:
    """One storage's status.controller as this operator last read or wrote it
    (`saved`), and the storage's resourceVersion then, on which the next write is
    conditional: the operator's `StateStore` of `StatusRecord`s."""

    def __init__(self, owner: Owner, document: Mapping[str, Any],
                 resource_version: str = "") -> None:
        self.owner = owner
        self.saved: Mapping[str, Any] = dict(document)
        # The storage's resourceVersion when status.controller was last read or written
        # here: the next write is conditional on it (the fence between two operators).
        self._resource_version = resource_version

    def load(self) -> StatusRecord:
        """The record as this operator last read or wrote it."""
        return record_of(self.saved)

    def reload(self) -> StatusRecord | None:
        """The record as the API server has it now (another operator may have kept
        since), read again, and its resourceVersion the one the next write is
        conditional on; None when the storage is gone."""
        current = kube.get(API_VERSION, KIND, self.owner.namespace, self.owner.name)
        if current is None:
            return None
        self._resource_version = current["metadata"]["resourceVersion"]
        self.saved = dict((current.get("status") or {}).get("controller") or {})
        return record_of(self.saved)

    def keep(self, record: StatusRecord) -> Kept | KeepRefused[StatusRecord]:
        """Write `record` as status.controller (unless it is kept already), on
        condition that the storage is at the resourceVersion this operator last saw.
        Refused (409): when the kept state is still the one written here, something
        else changed the storage (its spec, the status refresh, Kopf's own marks) and
        the write is tried again at the new version; when it is another state, another
        operator acts (a Kopf peering hand-over): refused, with that state, to be
        loaded in place of this round's (nothing is pushed). Refused too, with none,
        when the storage is gone or kept changing."""
        document = kept_document(record)
        if document == self.saved:
            return Kept()
        for _ in range(KEEP_TRIES):
            try:
                written = kube.patch_status_at(API_VERSION, KIND, self.owner.namespace,
                                               self.owner.name, {"controller": document},
                                               self._resource_version)
            except kube.StaleWriteError:
                current = kube.get(API_VERSION, KIND, self.owner.namespace, self.owner.name)
                if current is None:
                    return KeepRefused(None)
                self._resource_version = current["metadata"]["resourceVersion"]
                found = (current.get("status") or {}).get("controller") or {}
                if found != self.saved:
                    self.saved = dict(found)
                    return KeepRefused(record_of(found))
                continue
            if written is None:
                return KeepRefused(None)
            self._resource_version, self.saved = written, document
            return Kept()
        log.warning("%s/%s: status.controller not written: the storage kept changing",
                    self.owner.namespace, self.owner.name)
        return KeepRefused(None)
