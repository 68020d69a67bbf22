"""The controller's side of the controller term (`broker/ds/replication/term.py`), with
no I/O and no clock: whom it must hear before it takes a term, when its claim holds,
whether a site reports a newer controller, and `TermKeeper`, the term one controller
holds through its rounds under its `TermRule`. The shells (`controller.py`,
`operator/controller.py`) probe, claim, keep and say what it found.

Under `TermRule.MAJORITY_CLAIM` (`stratamq cluster controller`) a controller takes its
term only once a majority of the electorate answered its probes, so that a controller
cut off from most sites (a stale copy that reaches one site) does not raise that
site's term and depose the controller that works; and it decides nothing until a
majority of the electorate holds its term, so that after that a deposed controller's
pushes can reach only a minority. Under `TermRule.FIRST_REPORTS` (the operator) it
takes its term on its first round with reports and claims nothing, and yields (its
term and its fence with it) to a newer term that another replica of the operator
kept (`TermKeeper.yields_to`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from ..ds.replication import Placement, majority
from ..ds.replication.term import ControllerTerm, next_term


def electorate(placement: Placement, answered: Collection[str],
               configured: int) -> tuple[frozenset[str], int]:
    """(the sites whose terms count, how many make up the whole): the sites the
    placement names, or before the first placement those that answered, out of at
    least the number of sites the controller was given."""
    members = placement.sites()
    if members:
        return members, len(members)
    return frozenset(answered), max(configured, len(answered), 1)


def has_quorum(members: frozenset[str], size: int, sites: Iterable[str]) -> bool:
    """Whether `sites` include a majority of an electorate of `size`."""
    return len(members & set(sites)) >= majority(size)


def newer_term(own: ControllerTerm, reported: Iterable[ControllerTerm | None]
               ) -> ControllerTerm | None:
    """The highest reported term above `own`, or None: a newer controller exists and
    this one must step aside."""
    above = [term for term in reported if term is not None and term > own]
    return max(above) if above else None


class TermRule(Enum):
    """How a controller comes to hold its term: the one way in which the local
    controller and the operator differ here, on purpose.

    MAJORITY_CLAIM: nothing but the term keeps a second `stratamq cluster controller`
    (a copy of its folder, started elsewhere) from acting, so it takes its term once a
    majority of the electorate answered, claims it at the sites that report another
    (`PUT /api/v1/ds/controller-term`), and decides once a majority holds it.

    FIRST_REPORTS: Kopf's peering and the conditional writes of status.controller
    already keep one operator acting, so it takes its term on its first round with
    reports, claims nothing, and decides (pushing nothing) before it has one."""

    MAJORITY_CLAIM = "majority-claim"
    FIRST_REPORTS = "first-reports"


@dataclass(frozen=True)
class TermStep:
    """What a step of `TermKeeper` found this round. `goes_on`: the round goes on
    (to the claims, or to deciding); `taken`: the term was taken now (keep it, say
    it); `fenced_by`: a site holds this newer term, and the controller stepped aside
    now (say it); `waiting`: why it waits (say it once); `claim_at`: the
    sites to claim the term at before `TermKeeper.settle`; `held_now`: a majority
    holds the term from now on (adopt what the sites keep before deciding)."""

    goes_on: bool
    taken: bool = False
    fenced_by: ControllerTerm | None = None
    waiting: str = ""
    claim_at: tuple[str, ...] = ()
    held_now: bool = False


class TermKeeper:
    """The term one controller holds, under its `rule`: `term` (None until taken),
    `last_term` (the last taken, by this controller or the one whose state it goes on
    from: kept with the state, the floor of the next), `holds` (it may push: a
    majority holds it, or under FIRST_REPORTS it is taken) and `fenced_by` (the newer
    term it stepped aside for: for good, but under FIRST_REPORTS see `yields_to`). A
    round calls `take` with the terms the sites that answered report, claims the term
    where `claim_at` says, then calls `settle` with the sites that took the claim."""

    def __init__(self, rule: TermRule, controller_id: str, last_term: ControllerTerm
                 ) -> None:
        self.rule = rule
        self.controller_id = controller_id
        self.last_term = last_term
        self.term: ControllerTerm | None = None
        self.holds = False
        self.fenced_by: ControllerTerm | None = None

    @property
    def in_charge(self) -> bool:
        """Whether it may push: it holds its term and is not fenced."""
        return self.holds and self.fenced_by is None

    def take(self, reported: Mapping[str, ControllerTerm | None], placement: Placement,
             configured: int) -> TermStep:
        """The first step of a round: take the term when it is time (above
        `last_term` and every term `reported`: site -> the term it reports, of the
        sites that answered), and step aside when a site holds a newer one.
        `configured`: the sites this controller was given (the electorate before the
        first `placement`)."""
        if self.fenced_by is not None:
            return TermStep(goes_on=False)
        taken = False
        if self.term is None:
            if self.rule is TermRule.FIRST_REPORTS:
                if not reported:
                    return TermStep(goes_on=True)  # decides; pushes nothing without a term
            else:
                members, size = electorate(placement, reported, configured)
                if not has_quorum(members, size, reported):
                    return TermStep(goes_on=False, waiting=(
                        f"waiting for a majority of the sites to answer before taking a "
                        f"controller term ({len(members & set(reported))} of {size})"))
            self.term = next_term(self.last_term,
                                  [term for term in reported.values() if term is not None],
                                  self.controller_id)
            self.last_term = self.term
            taken = True
        newer = newer_term(self.term, reported.values())
        if newer is not None:
            self.fence(newer)
            return TermStep(goes_on=False, taken=taken, fenced_by=newer)
        if self.rule is TermRule.FIRST_REPORTS:
            self.holds = True
            return TermStep(goes_on=True, taken=taken)
        return TermStep(goes_on=True, taken=taken, claim_at=tuple(sorted(
            site for site, term in reported.items() if term != self.term)))

    def settle(self, reported: Mapping[str, ControllerTerm | None], claimed: Collection[str],
               placement: Placement, configured: int) -> TermStep:
        """The second step (after the claims of `take`'s `claim_at`, `claimed`: the
        sites that took it): whether the controller may decide. Under MAJORITY_CLAIM
        once a majority of the electorate holds the term (`reported` and `configured`
        as `take` had them); under FIRST_REPORTS as `take` said."""
        if self.fenced_by is not None:
            return TermStep(goes_on=False)
        if self.holds or self.rule is TermRule.FIRST_REPORTS:
            return TermStep(goes_on=True)
        assert self.term is not None
        members, size = electorate(placement, reported, configured)
        holding = {site for site, term in reported.items() if term == self.term} | set(claimed)
        if not has_quorum(members, size, holding):
            return TermStep(goes_on=False, waiting=(
                f"controller term {self.term}: held by {len(members & holding)} of {size} "
                f"sites, waiting for a majority before deciding"))
        self.holds = True
        return TermStep(goes_on=True, held_now=True)

    def fence(self, newer: ControllerTerm) -> bool:
        """Step aside for `newer` (a site holds it); True the first time (to say it),
        False when already fenced or `newer` is not newer. For good under
        MAJORITY_CLAIM; under FIRST_REPORTS see `yields_to`."""
        if self.fenced_by is not None or self.term is None or not newer > self.term:
            return False
        self.fenced_by = newer
        return True

    def yields_to(self, kept: ControllerTerm, reported: Iterable[ControllerTerm | None]
                  ) -> bool:
        """Under FIRST_REPORTS, whether this controller is to give up its term (and
        whatever it holds in memory) for the state the operator keeps, whose term is
        `kept`: true when `kept` is above its own term (or, fenced, no older than the
        term that fenced it) and no older than any term `reported` (what the sites
        hold now). Then another replica of the operator took that term (the state is
        kept before anything is pushed) while Kopf's peering paused this one, and this
        one acts again, so the other is paused or gone: the operator goes on from the
        kept state, with a term above it. A newer term the kept state does not hold is
        another controller's (a `stratamq cluster controller` run against the same
        sites): the fence stays. Nothing changes here."""
        if self.rule is not TermRule.FIRST_REPORTS:
            return False
        known = [term for term in reported if term is not None]
        if known and kept < max(known):
            return False
        if self.fenced_by is not None:
            return kept >= self.fenced_by
        return self.term is not None and kept > self.term
