"""The pure parts of routing: which messages a site's filters want, what
each peer told and for how long it counts, and the one site that delivers a message
to a shared group."""

from __future__ import annotations

import pytest

from stratamq.broker.routing.interest import (
    FilterSet,
    Forgotten,
    InterestTable,
    plain_filter,
    shared_site,
)
from stratamq.broker.topic import topic_matches

S1, S2 = "10.0.0.1:7000", "10.0.0.2:7000"


@pytest.mark.parametrize(("filters", "topic", "wanted"), [
    (["a/b"], "a/b", True),
    (["a/b"], "a/c", False),
    (["a/+"], "a/c", True),
    (["a/+"], "a/c/d", False),
    (["a/#"], "a", True),  # `#` matches its parent level too
    (["a/#"], "a/c/d", True),
    (["#"], "x/y", True),
    (["#"], "$SYS/x", False),  # no wildcard at the first level matches a $ topic
    (["+/x"], "$SYS/x", False),
    (["$SYS/#"], "$SYS/x", True),
    (["$share/g/a/+"], "a/b", True),  # a shared subscription wants its filter's topics
    (["$share/g/a/+"], "$share/g/a/b", False),
    (["x/y", "a/+/c"], "a/b/c", True),
    ([], "a", False),
])
def test_a_filter_set_wants_what_one_of_its_filters_matches(filters: list[str], topic: str,
                                                            wanted: bool) -> None:
    assert FilterSet(filters).matches(topic) is wanted


def test_a_filter_set_agrees_with_topic_matches_filter_by_filter() -> None:
    filters = ["a/b", "a/+", "a/#", "+/b/#", "#", "+", "a/+/c", "$SYS/+"]
    topics = ["a", "a/b", "a/b/c", "b/b", "b/b/x", "$SYS/a", "x", "a/x/c"]
    for topic_filter in filters:
        for topic in topics:
            assert FilterSet([topic_filter]).matches(topic) == \
                topic_matches(topic_filter, topic), (topic_filter, topic)


def test_plain_filter_strips_the_share_prefix() -> None:
    assert plain_filter("$share/group/a/+/#") == "a/+/#"
    assert plain_filter("a/b") == "a/b"


def at_once(*sites: str) -> list[tuple[str, int]]:
    """Members that joined before any message."""
    return [(site, 0) for site in sites]


def test_the_shared_site_is_one_of_the_sites_and_the_same_whatever_their_order() -> None:
    sites = at_once("s3", "s1", "s2")
    chosen = [shared_site("g/a/#", f"pub|{n}", sites, 10) for n in range(3000)]
    for site in ("s1", "s2", "s3"):  # every site takes its share, about a third
        assert 800 < chosen.count(site) < 1200, {s: chosen.count(s) for s in set(chosen)}
    for n in range(50):
        key = f"pub|{n}"
        assert shared_site("g/a/#", key, sites, 10) \
            == shared_site("g/a/#", key, sorted(sites), 10) \
            == shared_site("g/a/#", key, [*sites, ("s1", 0)], 10)
    assert shared_site("g/a/#", "pub|1", [], 10) is None
    assert shared_site("g/a/#", "pub|1", at_once("only"), 10) == "only"


def test_a_site_joining_or_leaving_moves_only_the_messages_it_is_chosen_for() -> None:
    """Rendezvous hashing: the sites that stay never trade messages, so sites that
    learn of a change at different moments still agree on the messages of the others."""
    before = at_once("s1", "s2", "s3")
    after = at_once("s1", "s2", "s3", "s4")
    moved = 0
    for n in range(2000):
        old = shared_site("g/a/#", f"pub|{n}", before, 10)
        new = shared_site("g/a/#", f"pub|{n}", after, 10)
        assert new in (old, "s4"), n
        moved += new != old
    assert 300 < moved < 700  # s4 takes about a quarter


def test_a_site_takes_its_share_only_of_messages_from_when_it_joined() -> None:
    members = [("s1", 0), ("s2", 1_000), ("s3", 2_000)]
    early = {shared_site("g/a/#", f"pub|{n}", members, 500) for n in range(200)}
    assert early == {"s1"}
    middle = {shared_site("g/a/#", f"pub|{n}", members, 1_500) for n in range(200)}
    assert middle == {"s1", "s2"}
    late = {shared_site("g/a/#", f"pub|{n}", members, 2_000) for n in range(200)}
    assert late == {"s1", "s2", "s3"}
    # before any member took effect, the first to join takes the messages: the first
    # members of a group get what is published at once
    waiting = [("s2", 1_000), ("s3", 2_000)]
    assert {shared_site("g/a/#", f"pub|{n}", waiting, 10) for n in range(50)} == {"s2"}


def test_a_peer_that_stops_telling_is_forgotten_and_learns_so_when_it_tells_again() -> None:
    table = InterestTable(expiry=5)
    assert table.take("s1", "10.0.0.1:7000", frozenset({"a/#"}), 0, {}, {}) is False
    assert table.take("s2", "10.0.0.2:7000", frozenset({"b/+"}), 0, {}, {}) is False
    assert table.take("s1", "10.0.0.1:7000", frozenset({"a/#"}), 1, {}, {}) is True
    assert table.address_of("s1") == "10.0.0.1:7000"
    assert table.take("s1", "10.0.0.9:7000", frozenset({"a/#", "c"}), 4, {}, {}) is False
    assert table.address_of("s1") == "10.0.0.9:7000"
    assert table.filters_of("s1").matches("c")

    assert table.expire(now=5) == []  # s2's five seconds are not over yet
    assert table.expire(now=5.5) == [Forgotten("s2", frozenset({"b/+"}), 0, {}, {})]
    assert [site for site, _filters in table.items()] == ["s1"]
    assert table.address_of("s2") is None and not table.filters_of("s2")

    # back: what it tells again was not had, so it reads what it missed from storage
    assert table.take("s2", "10.0.0.2:7000", frozenset({"b/+"}), 7, {}, {}) is False
    assert table.expire(now=9.5) == [Forgotten("s1", frozenset({"a/#", "c"}), 4, {}, {})]
    assert [gone.site for gone in table.expire(now=20)] == ["s2"]
    assert not table


def test_the_table_keeps_when_each_site_joined_each_shared_group() -> None:
    table = InterestTable(expiry=5)
    positions = {"$share/g/a": [1, 1]}
    table.take("s1", S1, frozenset({"$share/g/a", "b"}), 0, {"$share/g/a": 7}, positions)
    # s2 left the group while its telling was made: no time for it, so at once
    table.take("s2", S2, frozenset({"$share/g/a"}), 0, {}, positions)
    assert sorted(table.members_of("$share/g/a")) == [("s1", 7), ("s2", 0)]
    assert table.joined_of("s1") == {"$share/g/a": 7}  # shared filters only
    table.take("s1", S1, frozenset({"b"}), 1, {}, {})
    assert table.members_of("$share/g/a") == [("s2", 0)]
    assert table.joined_of("s1") == {}


def test_a_forgotten_site_leaves_where_its_members_stopped_as_it_last_told() -> None:
    """A site tells with its filters, per shard, where the members of each of its
    shared groups stopped settling messages; when it is forgotten (killed, cut off),
    the sites left deliver its share from there, however far behind it was."""
    table = InterestTable(expiry=5)
    table.take("s1", S1, frozenset({"$share/g/a", "b"}), now=0, joined={"$share/g/a": 7},
               unsettled={"$share/g/a": [100, 200], "$share/h/x": [1, 1]})  # h: not held
    table.take("s1", S1, frozenset({"$share/g/a", "b"}), now=1, joined={"$share/g/a": 7},
               unsettled={"$share/g/a": [150, 200]})  # it settled more
    gone = {forgotten.site: forgotten for forgotten in table.expire(now=10)}
    assert gone["s1"].unsettled == {"$share/g/a": [150, 200]}
