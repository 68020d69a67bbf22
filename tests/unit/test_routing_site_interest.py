"""This site's interest as the dispatcher sets it (routing/site_interest.py): when
its membership of a shared group takes effect, where the members of a group that
went stopped, and which sites hold a group."""

from __future__ import annotations

from stratamq.broker.routing.interest import JOIN_DELAY_US
from stratamq.broker.routing.site_interest import SiteInterest

SHARED = "$share/g/a/#"


def test_a_group_that_goes_stopped_at_its_first_unsettled_message_or_after_the_feed(
    ) -> None:
    fed = [10, 20]
    interest = SiteInterest("s1", lambda: fed)
    interest.set_here(frozenset({SHARED, "plain/+"}))
    assert interest.changed.is_set()
    assert interest.joined[SHARED] >= JOIN_DELAY_US
    assert "plain/+" not in interest.joined
    # shard 0 has a message unsettled at 5; shard 1 was settled through the feed
    assert interest.stop_positions({SHARED: {0: 5}}) == {SHARED: [5, 21]}
    interest.set_here(frozenset({"plain/+"}), {SHARED: {0: 7, 1: 99}})
    stopped, _at = interest.left[SHARED]
    assert stopped == [7, 21]
    assert SHARED not in interest.joined
    assert interest.stop_positions({}) == {}


def test_the_members_of_a_group_are_the_peers_that_told_it_and_this_site() -> None:
    interest = SiteInterest("s1", lambda: [0])
    interest.peers.take("s2", "s2:7000", frozenset({SHARED}), 0.0, {SHARED: 3},
                        {SHARED: [1]})
    assert interest.members_with(SHARED) == [("s2", 3)]
    interest.set_here(frozenset({SHARED}))
    assert interest.members_with(SHARED) == [("s2", 3), ("s1", interest.joined[SHARED])]
    assert interest.shared_joined_of() == {"s2": {SHARED: 3},
                                           "s1": {SHARED: interest.joined[SHARED]}}
    assert interest.interest_of() == {"s2": [SHARED]}
