from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stratamq.broker.subscription_index import SubscriptionIndex
from stratamq.broker.topic import topic_matches


def test_wildcards_and_dollar_topics() -> None:
    index: SubscriptionIndex[str] = SubscriptionIndex()
    for name, topic_filter in [("a", "sport/#"), ("b", "sport/+"), ("c", "#"), ("d", "+/tennis"),
                               ("e", "$SYS/#"), ("f", "sport")]:
        index.add(topic_filter, name)
    assert sorted(s for s, _ in index.match("sport")) == ["a", "c", "f"]
    assert sorted(s for s, _ in index.match("sport/tennis")) == ["a", "b", "c", "d"]
    assert sorted(s for s, _ in index.match("$SYS/uptime")) == ["e"]


def test_remove_prunes_and_counts() -> None:
    index: SubscriptionIndex[str] = SubscriptionIndex()
    index.add("a/b/c", "x")
    index.add("a/b/c", "y")
    assert len(index) == 2
    assert index.remove("a/b/c", "x")
    assert not index.remove("a/b/c", "x")
    assert index.remove("a/b/c", "y")
    assert len(index) == 0
    assert index._root.children == {}


levels = st.sampled_from(["a", "b", "$c", ""])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["a", "b", "+", ""]), min_size=1, max_size=3)
                .map(lambda ls: "/".join(ls)), max_size=8),
       st.booleans(),
       st.lists(levels, min_size=1, max_size=4).map("/".join))
def test_matches_like_the_reference_rule(filters: list[str], with_hash: bool, topic: str) -> None:
    index: SubscriptionIndex[int] = SubscriptionIndex()
    all_filters = [*filters, "#", "a/#"] if with_hash else filters
    for number, topic_filter in enumerate(all_filters):
        index.add(topic_filter, number)
    got = sorted(s for s, _ in index.match(topic))
    expected = sorted(n for n, f in enumerate(all_filters) if topic_matches(f, topic))
    assert got == expected
