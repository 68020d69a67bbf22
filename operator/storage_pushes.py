"""One storage's controller term and its pushes, as the operator's controller
(`controller.py`) makes them: the term taken on the first round with reports
(`TermKeeper` under `TermRule.FIRST_REPORTS`, kept in status.controller with the
state), the placement pushed one site after another (`broker/controller/pushes.py`:
whom, what), the answers read (a newer term fences the operator, a refused placement
is adopted next round from what the sites keep, `decisions.adopt`), and the Warning
events that says, for the handler to post."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from stratamq.broker.controller import decisions
from stratamq.broker.controller.decisions import ClusterState
from stratamq.broker.controller.pushes import (
    Fenced,
    peers_of,
    push_answer,
    push_body,
    push_targets,
)
from stratamq.broker.controller.sites import SiteState
from stratamq.broker.controller.terms import TermKeeper
from stratamq.broker.ds.replication import Placement
from stratamq.broker.ds.replication.term import ControllerTerm

from .phases import EventReason
from .resources import Owner
from .sites import held_placement, push

log = logging.getLogger(__name__)


class StoragePushes:
    """The term `term_keeper` holds for the storage of `owner`, and its pushes."""

    def __init__(self, owner: Owner, term_keeper: TermKeeper) -> None:
        self.owner = owner
        self.term_keeper = term_keeper
        self.refused = False  # a site refused the last push: adopt what the sites keep
        # (reason, message) of the Warning events the handler is to post
        self._warnings: list[tuple[EventReason, str]] = []
        # the peers and forgotten every site was last told (None: tell them again)
        self._pushed_told: dict[str, Any] | None = None

    def hold_term(self, reported: Mapping[str, ControllerTerm | None],
                  placement: Placement) -> bool:
        """Take the term on the first round with reports (`reported`: site -> the term
        it reports; before it, nothing is pushed); False (nothing decided or pushed)
        once a site holds a newer one (`TermKeeper`, `TermRule.FIRST_REPORTS`)."""
        step = self.term_keeper.take(reported, placement, len(reported))
        if step.taken:
            log.info("%s/%s: controller term %s taken", self.owner.namespace,
                     self.owner.name, self.term_keeper.term)
        if step.fenced_by is not None:
            self._say_fenced(step.fenced_by)
        return step.goes_on

    def _say_fenced(self, newer: ControllerTerm) -> None:
        """Say (an error and a Warning event), once, that this operator stepped aside
        for `newer`."""
        message = (f"controller term {self.term_keeper.term} is fenced: the sites hold term "
                   f"{newer} of another controller; unless status.controller holds that term "
                   f"(another replica of this operator took it), this operator pushes "
                   f"nothing to this storage (stop the other controller, then restart the "
                   f"operator)")
        log.error("%s/%s: %s", self.owner.namespace, self.owner.name, message)
        self._warnings.append((EventReason.CONTROLLER_FENCED, message))

    def take_warnings(self) -> list[tuple[EventReason, str]]:
        """The Warning events to post since the last call (the handler posts them)."""
        warnings, self._warnings = self._warnings, []
        return warnings

    def adopt_held(self, state: ClusterState, sites: Mapping[str, SiteState],
                   urls: Mapping[str, str], token: str) -> ClusterState:
        """`state` after adopting the newest placement the sites keep, when it is
        not this operator's (`decisions.adopt`)."""
        self.refused = False
        held = {site: found for site in sites if site in urls and sites[site].answered
                and (found := held_placement(urls[site], token)) is not None}
        adoption = decisions.adopt(state, held)
        for note in adoption.notes:
            log.warning("%s/%s: %s", self.owner.namespace, self.owner.name, note)
        if adoption.state.placement != state.placement:
            # e.g. a storage deleted and made again over its retained volumes: its
            # sites hold a placement its new status.controller does not know
            self._warnings.append((EventReason.PLACEMENT_ADOPTED, "; ".join(adoption.notes)))
        return adoption.state

    def push_answered(self, site: str, version: int, found: Mapping[str, Any]) -> None:
        """A site's answer to a push: a newer term fences this operator; a refused
        placement (the site keeps a newer one) is adopted next round."""
        own = self.term_keeper.term
        assert own is not None
        answer = push_answer(found, own)
        if answer is None:
            return
        if isinstance(answer, Fenced):
            if self.term_keeper.fence(answer.term):
                self._say_fenced(answer.term)
            return
        message = answer.note(site, version)
        log.warning("%s/%s: %s", self.owner.namespace, self.owner.name, message)
        self._warnings.append((EventReason.PLACEMENT_REFUSED, message))
        self.refused = True

    def tell_again(self) -> None:
        """The next push goes to every site (the state was another operator's)."""
        self._pushed_told = None

    def push(self, placement: Placement, sites: Mapping[str, SiteState],
             urls: Mapping[str, str], forgotten: Collection[str], token: str) -> None:
        """Push `placement` to the sites at `urls` that need it (every site while the
        peers or the forgotten they were told changed, or one of them missed it)."""
        if placement.version == 0 or not self.term_keeper.in_charge:
            return
        own = self.term_keeper.term
        assert own is not None
        peers = peers_of(sites.values())
        told = {"peers": peers, "forgotten": sorted(forgotten)}
        everyone = told != self._pushed_told
        body = push_body(placement, peers, forgotten, own)
        missed = False
        for site in push_targets([site for site in sites.values()
                                  if site.id in urls], placement.version, everyone):
            found = push(urls[site.id], token, body)
            missed |= found is None
            if found is not None:
                self.push_answered(site.id, placement.version, found)
        if not missed:
            self._pushed_told = told
