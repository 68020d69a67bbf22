"""The replication controller's state as the operator keeps it in the DurableStorage's
`status.controller` (docs/replication.md, "The controller"): the document's form and
its reading back, and its conditional writes, which are the fence between two
operators (a Kopf peering hand-over): a write is made only at the resourceVersion this
operator last read or wrote."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from stratamq.broker.controller import decisions
from stratamq.broker.controller.decisions import ClusterState
from stratamq.broker.controller.sites import SiteState
from stratamq.broker.ds.replication import Placement, Plan
from stratamq.broker.ds.replication.term import NO_TERM, ControllerTerm, parse_term

from . import kube
from .resources import API_VERSION, KIND, Owner

log = logging.getLogger(__name__)

KEEP_TRIES = 5  # conditional writes of status.controller refused by other writers' changes


def kept_document(state: ClusterState, sites: Mapping[str, SiteState],
                  pods: Mapping[str, str], forgotten: Iterable[str] = (),
                  term: ControllerTerm = NO_TERM) -> dict[str, Any]:
    """`status.controller`: the placement and plan as the local controller keeps them
    in its files (strings: their own checked formats), the goals, the sites known
    (with their pods and peer addresses), the sites forgotten (their pods went away
    while they held nothing: the sites adopt the sessions they owned), and the
    controller term taken."""
    return {
        "term": {"number": term.number, "controller": term.controller},
        "placement": state.placement.to_json() if state.placement.version > 0 else "",
        "plan": "" if state.plan is None else state.plan.to_json(),
        "goals": {database: list(goal) for database, goal in sorted(state.goals.items())},
        "sites": [{"id": site, "pod": pods.get(site, ""), "peer": sites[site].peer or ""}
                  for site in sorted(sites)],
        "forgotten": sorted(forgotten),
    }


def term_of(document: Mapping[str, Any]) -> ControllerTerm:
    """The term kept in status.controller (term 0 when none: an operator before
    terms)."""
    kept = document.get("term") or {}
    return parse_term([kept["number"], kept["controller"]] if kept else None,
                      "status.controller.term")


def load_document(document: Mapping[str, Any], now: float
                  ) -> tuple[ClusterState, dict[str, SiteState], dict[str, str], set[str]]:
    """The inverse of `kept_document`; sites known from it get the grace of one that
    answered just now (as the local controller gives the sites of its files)."""
    placement = (Placement.from_json(document["placement"]) if document.get("placement")
                 else Placement.empty())
    plan = Plan.from_json(document["plan"]) if document.get("plan") else None
    goals = {database: tuple(goal) for database, goal in (document.get("goals") or {}).items()}
    catch_up = None if plan is None else decisions.resumed_catch_up(plan, placement)
    sites: dict[str, SiteState] = {}
    pods: dict[str, str] = {}
    for entry in document.get("sites") or []:
        sites[entry["id"]] = SiteState(id=entry["id"], admin_url="", last_seen=now,
                                       peer=entry.get("peer") or None)
        if entry.get("pod"):
            pods[entry["id"]] = entry["pod"]
    forgotten = set(document.get("forgotten") or [])
    return (ClusterState(placement=placement, plan=plan, goals=goals, catch_up=catch_up),
            sites, pods, forgotten)


class KeptState:
    """One storage's status.controller as this operator last read or wrote it
    (`saved`), and the storage's resourceVersion then, on which the next write is
    conditional."""

    def __init__(self, owner: Owner, document: Mapping[str, Any],
                 resource_version: str = "") -> None:
        self.owner = owner
        self.saved: Mapping[str, Any] = dict(document)
        # The storage's resourceVersion when status.controller was last read or written
        # here: the next write is conditional on it (the fence between two operators).
        self._resource_version = resource_version

    def write(self, document: dict[str, Any]) -> tuple[bool, Mapping[str, Any] | None]:
        """Write `document` as status.controller, on condition that the storage is at
        the resourceVersion this operator last saw. Refused (409): when the kept state
        is still the one written here, something else changed the storage (its spec,
        the status refresh, Kopf's own marks) and the write is tried again at the new
        version; when it is another state, another operator acts (a Kopf peering
        hand-over): not written, and that state returned, to be loaded in place of
        this round's (nothing is pushed). (written, the other operator's state).
        Not written either when the storage is gone or kept changing."""
        for _ in range(KEEP_TRIES):
            try:
                written = kube.patch_status_at(API_VERSION, KIND, self.owner.namespace,
                                               self.owner.name, {"controller": document},
                                               self._resource_version)
            except kube.StaleWriteError:
                current = kube.get(API_VERSION, KIND, self.owner.namespace, self.owner.name)
                if current is None:
                    return False, None
                self._resource_version = current["metadata"]["resourceVersion"]
                found = (current.get("status") or {}).get("controller") or {}
                if found != self.saved:
                    self.saved = dict(found)
                    return False, found
                continue
            if written is None:
                return False, None
            self._resource_version, self.saved = written, document
            return True, None
        log.warning("%s/%s: status.controller not written: the storage kept changing",
                    self.owner.namespace, self.owner.name)
        return False, None
