"""Which messages a site left delivers from storage when it forgets a site that had
members of a shared group (`Dispatcher.takes_lost_share`, used by
`core/shared_replay.py`): the lost site's share, each to exactly one site left, and
near the moment of forgetting also the messages whose choice moved between the sites
left (the other may have forgotten first)."""

from __future__ import annotations

from stratamq.broker.core.dispatch import Dispatcher, SharedGroup
from stratamq.broker.ds import Message, shared_site

GROUP = SharedGroup("g", "t/#")
BEFORE = ["A", "B", "L"]  # L: the lost site
MOVED_SINCE = 1_000


def dispatcher(site: str) -> Dispatcher:
    made = Dispatcher()
    made.site = site
    made.sites_with = lambda _filter: ["A", "B"]  # L is forgotten
    return made


def test_the_lost_share_goes_to_exactly_one_site_left() -> None:
    sites = {name: dispatcher(name) for name in ("A", "B")}
    for number in range(200):
        message = Message("t/x", b"", "pub", 1, timestamp=number)  # before MOVED_SINCE
        takers = [name for name, made in sites.items()
                  if made.takes_lost_share(GROUP, message, BEFORE, "L", MOVED_SINCE)]
        lost_one = shared_site(GROUP.key, f"pub|{number}", BEFORE) == "L"
        assert takers == ([shared_site(GROUP.key, f"pub|{number}", ["A", "B"])]
                          if lost_one else []), number


def test_near_the_forgetting_a_message_moved_between_sites_left_is_taken_too() -> None:
    here = dispatcher("A")
    moved = [number for number in range(MOVED_SINCE, MOVED_SINCE + 400)
             if shared_site(GROUP.key, f"pub|{number}", BEFORE) == "B"
             and shared_site(GROUP.key, f"pub|{number}", ["A", "B"]) == "A"]
    assert moved
    for number in moved:
        message = Message("t/x", b"", "pub", 1, timestamp=number)
        assert here.takes_lost_share(GROUP, message, BEFORE, "L", MOVED_SINCE)
        earlier = Message("t/x", b"", "pub", 1, timestamp=number - MOVED_SINCE)
        if shared_site(GROUP.key, f"pub|{number - MOVED_SINCE}", BEFORE) == "B":
            # long before: B delivered it with the old choice
            assert not here.takes_lost_share(GROUP, earlier, BEFORE, "L", MOVED_SINCE)
