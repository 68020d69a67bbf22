"""The local controller's term at the sites (`controller.py`): the I/O around
`TermKeeper` under `TermRule.MAJORITY_CLAIM` (`terms.py`). Each round it takes the
term when `TermKeeper.take` says (kept, through the controller, before any site is
asked to hold it), claims it at the sites that report another
(`PUT /api/v1/ds/controller-term`, `SiteClient.claim`), and asks `TermKeeper.settle`
whether a majority holds it; it says once why it waits, and once that the controller
stepped aside for a newer term (a site reported it, or named it in an answer)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from ..ds.replication import Placement
from ..ds.replication.term import ControllerTerm, parse_term
from ..errors import ControllerFencedError, PlacementError
from .site_client import SiteClient
from .sites import SiteState
from .terms import TermKeeper, TermStep

log = logging.getLogger(__name__)


class TermHolder:
    """`keeper`'s term at the sites, claimed through `client`."""

    def __init__(self, keeper: TermKeeper, client: SiteClient) -> None:
        self.keeper = keeper
        self._client = client
        self._term_note = ""

    async def hold(self, reported: Mapping[str, ControllerTerm | None],
                   sites: Mapping[str, SiteState], placement: Placement, configured: int,
                   keep: Callable[[], Awaitable[None]]) -> TermStep:
        """This round's last step of the term: `goes_on` when the controller may decide
        and push (it has taken a term once a majority of the electorate answered, a
        majority of the electorate holds it, claimed where a site reports another, and
        no site holds a newer one, else it steps aside for good); `held_now` when a
        majority holds it from this round on. `reported`: site -> the term it reports,
        of the sites that answered; `configured`: the sites the controller was given;
        `keep`: keeps the controller's state, with the term just taken."""
        keeper = self.keeper
        step = keeper.take(reported, placement, configured)
        self._say_waiting(step)
        if step.taken:
            await keep()
            log.info("controller term %s taken", keeper.term)
        if step.fenced_by is not None:
            self._say_fenced(step.fenced_by)
        if not step.goes_on:
            return step
        claims = await asyncio.gather(*(self._claim(sites[site]) for site in step.claim_at))
        step = keeper.settle(
            reported, [site for site, held in zip(step.claim_at, claims, strict=True) if held],
            placement, configured)
        self._say_waiting(step)
        if step.held_now:
            log.info("controller term %s held by a majority of the sites: deciding",
                     keeper.term)
        return step

    def fence(self, newer: ControllerTerm) -> None:
        """A site holds `newer`: step aside when it is newer (said once)."""
        if self.keeper.fence(newer):
            self._say_fenced(newer)

    def check(self) -> None:
        """ControllerFencedError once the controller stepped aside."""
        keeper = self.keeper
        if keeper.fenced_by is not None:
            raise ControllerFencedError(
                f"this controller (term {keeper.term}) is fenced: the sites hold term "
                f"{keeper.fenced_by} of a newer controller; ask that one")

    def _say_waiting(self, step: TermStep) -> None:
        """Why this controller waits, said once (not every round)."""
        if step.waiting and step.waiting != self._term_note:
            log.info("%s", step.waiting)
            self._term_note = step.waiting

    async def _claim(self, site: SiteState) -> bool:
        """Claim this controller's term at `site`: True when it holds it now."""
        own = self.keeper.term
        assert own is not None
        answer = await self._client.claim(site, own)
        if answer is None:
            return False
        self._notice_term(site.id, answer.term)
        return answer.accepted

    def _notice_term(self, site: str, value: object) -> None:
        """A site's answer named the term it holds: step aside when it is newer."""
        try:
            held = parse_term(value)
        except PlacementError:
            log.warning("site %s answered with a controller term that is not one: %r",
                        site, value)
            return
        self.fence(held)

    def _say_fenced(self, newer: ControllerTerm) -> None:
        """Say, once, that this controller stepped aside for `newer`."""
        log.error("controller term %s is fenced: the sites hold term %s of a newer "
                  "controller. This controller decides and pushes nothing from now on; "
                  "stop it (or stop the other controller and restart this one)",
                  self.keeper.term, newer)
