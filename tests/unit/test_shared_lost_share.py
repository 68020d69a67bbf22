"""Which messages a site left delivers from storage when a site that had members of
a shared group left it or was forgotten (`SiteChoice.takes_lost_share`, used by
`shared/replay.py`): the lost site's share, each to exactly one site left, and
nothing else (the sites left never trade messages: the choice is a rendezvous hash)."""

from __future__ import annotations

from stratamq.broker.ds import Message
from stratamq.broker.routing.interest import shared_site
from stratamq.broker.shared.choice import SiteChoice
from stratamq.broker.shared.groups import SharedGroup

GROUP = SharedGroup("g", "t/#")
LEFT = [("A", 0), ("B", 0)]
LOST = ("L", 0)


def choice(site: str) -> SiteChoice:
    return SiteChoice(site, lambda _filter: LEFT)  # L is gone


def test_the_lost_share_goes_to_exactly_one_site_left() -> None:
    sites = {name: choice(name) for name in ("A", "B")}
    lost_ones = 0
    for number in range(300):
        message = Message("t/x", b"", "pub", 1, timestamp=number)
        takers = [name for name, made in sites.items()
                  if made.takes_lost_share(GROUP, message, LOST)]
        chosen_before = shared_site(GROUP.key, f"pub|{number}", [*LEFT, LOST], number)
        if chosen_before == "L":
            lost_ones += 1
            assert takers == [shared_site(GROUP.key, f"pub|{number}", LEFT, number)], number
        else:  # delivered by the site chosen before, which is still chosen
            assert takers == [], number
            assert shared_site(GROUP.key, f"pub|{number}", LEFT, number) == chosen_before
    assert 60 < lost_ones < 140  # about a third


def test_a_lost_site_that_had_not_taken_effect_had_no_share() -> None:
    here = choice("A")
    late = ("L", 1_000)
    for number in range(200):
        message = Message("t/x", b"", "pub", 1, timestamp=number)  # before L took effect
        assert not here.takes_lost_share(GROUP, message, late)
