"""The push of a placement (`PUT /api/v1/ds/placement`), as every controller makes it,
with no I/O: which sites get it, what they get, and what a site's answer means for
the controller. The shells (`controller.py`, `operator/controller.py`) send it and
act on the answer."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..ds.replication import Placement
from ..ds.replication.term import NO_TERM, ControllerTerm, parse_term
from ..errors import PlacementError
from .sites import SiteState


def push_targets(sites: Iterable[SiteState], version: int, everyone: bool
                 ) -> list[SiteState]:
    """The sites to push placement `version` to: every site that answered
    (`everyone`: the placement, or what goes with it, changed), else those that answered
    with an older version or none; a site that misses it reports the old version and
    gets it next round."""
    return [site for site in sites if site.answered and (
        everyone or site.placement_version is None or site.placement_version < version)]


def peers_of(sites: Iterable[SiteState]) -> dict[str, str]:
    """site -> its peer address, of the sites whose address is known."""
    return {site.id: site.peer for site in sites if site.peer is not None}


def push_body(placement: Placement, peers: Mapping[str, str], forgotten: Collection[str],
              term: ControllerTerm) -> dict[str, Any]:
    """What a push carries: the placement, the peers map, the sites forgotten for good
    (the sites adopt the sessions they owned) and the controller's term."""
    return {"placement": json.loads(placement.to_json()), "peers": dict(peers),
            "forgotten": sorted(forgotten), "term": term.to_json()}


@dataclass(frozen=True)
class Refused:
    """The site keeps another placement (a newer one, or another under this version):
    the controller's is stale, and it adopts what the sites keep next round.
    `kept_version`: the version the site says it keeps, as it said it."""

    kept_version: object

    def note(self, site: str, version: int) -> str:
        """What a controller says of `site` refusing placement `version` so."""
        return (f"site {site} refused placement version {version}: it keeps version "
                f"{self.kept_version}; adopting the placement the sites keep")


@dataclass(frozen=True)
class Fenced:
    """The site holds `term`, newer than the controller's: it steps aside for good."""

    term: ControllerTerm


def push_answer(found: Mapping[str, Any] | None, own: ControllerTerm
                ) -> Refused | Fenced | None:
    """What a site's answer to a push (`found`, None: no answer) means to a controller
    of term `own`: None when it took it (or did not answer: it gets it again next
    round); `Fenced` when it refused it for a newer term; `Refused` otherwise when it
    refused it (`accepted: false`). A term it names that is not one counts as term 0."""
    if found is None or found.get("accepted") is not False:
        return None
    try:
        held = parse_term(found.get("term"))
    except PlacementError:
        held = NO_TERM
    if held > own:
        return Fenced(held)
    return Refused(found.get("version"))
