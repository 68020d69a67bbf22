"""The pure parts of the commit feed: which messages a site's filters want, what
each peer told and for how long it counts, and the one site that delivers a message
to a shared group."""

from __future__ import annotations

import pytest

from stratamq.broker.ds.replication.interest import (
    FilterSet,
    Forgotten,
    InterestTable,
    plain_filter,
    shared_site,
)
from stratamq.broker.topic import topic_matches


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


def test_the_shared_site_is_one_of_the_sites_and_the_same_whatever_their_order() -> None:
    sites = ["s3", "s1", "s2"]
    chosen = {shared_site("g/a/#", f"pub|{n}", sites) for n in range(200)}
    assert chosen == {"s1", "s2", "s3"}  # every site takes a share
    for n in range(50):
        key = f"pub|{n}"
        assert shared_site("g/a/#", key, sites) == shared_site("g/a/#", key, sorted(sites)) \
            == shared_site("g/a/#", key, [*sites, "s1"])
    assert shared_site("g/a/#", "pub|1", []) is None
    assert shared_site("g/a/#", "pub|1", ["only"]) == "only"


def test_a_peer_that_stops_telling_is_forgotten_and_learns_so_when_it_tells_again() -> None:
    table = InterestTable(expiry=5)
    assert table.take("s1", "10.0.0.1:7000", frozenset({"a/#"}), now=0) is False
    assert table.take("s2", "10.0.0.2:7000", frozenset({"b/+"}), now=0) is False
    assert table.take("s1", None, frozenset({"a/#"}), now=1) is True  # told no address
    assert table.address_of("s1") == "10.0.0.1:7000"
    assert table.take("s1", "10.0.0.9:7000", frozenset({"a/#", "c"}), now=4) is False
    assert table.address_of("s1") == "10.0.0.9:7000"
    assert table.filters_of("s1").matches("c")

    assert table.expire(now=5) == []  # s2's five seconds are not over yet
    assert table.expire(now=5.5) == [Forgotten("s2", frozenset({"b/+"}), 0)]
    assert [site for site, _filters in table.items()] == ["s1"]
    assert table.address_of("s2") is None and not table.filters_of("s2")

    # back: what it tells again was not had, so it reads what it missed from storage
    assert table.take("s2", "10.0.0.2:7000", frozenset({"b/+"}), now=7) is False
    assert table.expire(now=9.5) == [Forgotten("s1", frozenset({"a/#", "c"}), 4)]
    assert [gone.site for gone in table.expire(now=20)] == ["s2"]
    assert not table
