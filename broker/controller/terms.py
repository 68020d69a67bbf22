"""The controller's side of the controller term (`broker/ds/replication/term.py`), as
pure functions: whom it must hear before it takes a term, when its claim holds, and
whether a site reports a newer controller. No I/O and no clock; `controller.py`
probes, claims and steps aside.

A controller takes its term only once a majority of the electorate answered its
probes, so that a controller cut off from most sites (a stale copy that reaches one
site) does not raise that site's term and depose the controller that works; and it
decides nothing until a majority of the electorate holds its term, so that after
that a deposed controller's pushes can reach only a minority.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ..ds.replication import Placement, majority
from ..ds.replication.term import ControllerTerm


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
