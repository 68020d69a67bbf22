"""The learned topic structure: learning, matching, determinism, inheritance."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratamq.broker.ds.lts import EDGE_BYTES, END, PLUS, REST, Edge, Trie, TrieBounds
from stratamq.broker.metrics import Tally


def learn(trie: Trie, *topics: str) -> list[Edge]:
    learned: list[Edge] = []
    for topic in topics:
        trie.topic_key(topic.split("/"), learned)
    return learned


def test_worked_example_ten_concrete_streams_and_one_wildcard() -> None:
    trie = Trie([100, 10])
    learn(trie, *(f"sensor/d{n}/temp" for n in range(1, 13)))

    matches = trie.match(["sensor", "+", "temp"])
    assert len(matches) == 11
    wildcard = [m for m in matches if m.pattern == (PLUS,)]
    concrete = [m for m in matches if m.pattern == ()]
    assert len(wildcard) == 1 and len(concrete) == 10
    assert trie.static_path(wildcard[0].static) == ["sensor", PLUS, "temp", END]

    (d42,) = trie.match(["sensor", "d42", "temp"])
    assert d42.static == wildcard[0].static
    assert d42.pattern == ("d42",)
    key = trie.lookup(["sensor", "d42", "temp"])
    assert key is not None and key.varying == ("d42",)
    # the first ten were learned as exact levels
    assert trie.lookup(["sensor", "d3", "temp"]).varying == ()  # type: ignore[union-attr]
    # d11 and d12 arrived after the threshold and are varying
    assert trie.lookup(["sensor", "d11", "temp"]).varying == ("d11",)  # type: ignore[union-attr]


def test_exact_edge_is_preferred_over_plus() -> None:
    trie = Trie([2])
    learn(trie, "a/x", "a/y", "a/z")  # z goes through +
    (only_x,) = trie.match(["a", "x"])
    assert only_x.pattern == ()
    (z,) = trie.match(["a", "z"])
    assert z.pattern == ("z",)


def test_thresholds_are_per_depth() -> None:
    trie = Trie([3, 1])
    learn(trie, "r1/a", "r2/a", "r3/a", "r4/a", "r1/b")
    assert trie.lookup(["r4", "a"]).varying == ("r4",)  # type: ignore[union-attr]
    assert trie.lookup(["r1", "b"]).varying == ("b",)  # type: ignore[union-attr]


def test_dollar_topics_have_their_own_root() -> None:
    trie = Trie([100, 10])
    learn(trie, "$SYS/broker/uptime", "a/broker/uptime")
    assert len(trie.match(["#"])) == 1
    assert len(trie.match(["+", "broker", "uptime"])) == 1
    assert len(trie.match(["$SYS", "#"])) == 1
    assert len(trie.match(["$SYS", "+", "uptime"])) == 1


def test_hash_matches_parent_level() -> None:
    trie = Trie([100, 10])
    learn(trie, "sport", "sport/tennis", "sport/tennis/player1")
    assert len(trie.match(["sport", "#"])) == 3
    assert len(trie.match(["sport", "+"])) == 1
    assert len(trie.match(["sport"])) == 1
    assert trie.match(["sports"]) == []


def test_same_topics_build_identical_tries() -> None:
    topics = [f"f{a}/l{b}/x" for a in range(20) for b in range(15)]
    one, two = Trie([10, 5]), Trie([10, 5])
    learned_one, learned_two = learn(one, *topics), learn(two, *topics)
    assert learned_one == learned_two
    assert set(one.edges()) == set(two.edges())


def test_replica_applying_learned_edges_gets_the_same_keys() -> None:
    leader, replica = Trie([3]), Trie([3])
    learned = learn(leader, "a", "b", "c", "d", "e")
    for edge in learned:
        replica.add_edge(edge)
        replica.add_edge(edge)  # applying twice is harmless
    for topic in "abcde":
        assert leader.lookup([topic]) == replica.lookup([topic])


def test_removed_edges_are_forgotten() -> None:
    trie = Trie([100, 10])
    learned = learn(trie, "a/b")
    trie.remove_edges(learned)
    assert trie.lookup(["a", "b"]) is None
    assert len(trie) == 0


def test_new_generation_inherits_only_wildcard_paths() -> None:
    old = Trie([100, 2])
    learn(old, "s/a/t", "s/b/t", "s/c/t", "plain/topic")
    new = Trie([100, 2])
    for edge in old.wildcard_paths():
        new.add_edge(edge)
    assert new.lookup(["plain", "topic"]) is None
    key = new.lookup(["s", "zzz", "t"])
    assert key is not None and key.varying == ("zzz",)
    # with the + inherited, a new level goes through it rather than growing an edge
    assert new.topic_key(["s", "a", "t"], []).varying == ("a",)


def test_deep_topics_do_not_exhaust_the_stack() -> None:
    trie = Trie([100, 10])
    deep = "/".join(["l"] * 5000)
    learn(trie, deep)
    assert len(trie.match(["#"])) == 1
    assert len(trie.match(deep.split("/"))) == 1
    assert trie.wildcard_paths() == []


def test_rejects_bad_thresholds() -> None:
    for bad in ([], [0], [10, -1]):
        try:
            Trie(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


levels = st.sampled_from(["a", "b", "c", "d", "e", "$x", ""])
# unbounded; folding at the second level; folding once a few edges are learned
BOUNDS = [TrieBounds(), TrieBounds(max_levels=2), TrieBounds(max_bytes=6 * (EDGE_BYTES + 1))]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(levels, min_size=1, max_size=4), min_size=1, max_size=40),
       st.lists(st.sampled_from(["a", "b", "+", "c", ""]), min_size=0, max_size=3),
       st.booleans(), st.sampled_from(BOUNDS))
def test_every_learned_topic_is_found_by_every_matching_filter(
        topics: list[list[str]], filter_prefix: list[str], hash_tail: bool,
        bounds: TrieBounds) -> None:
    from stratamq.broker.topic import levels_match
    trie = Trie([2, 2], bounds=bounds)
    keys = {tuple(t): trie.topic_key(t, []) for t in topics}
    # a topic keeps its key however much is learned after it; lookup agrees
    for topic, key in keys.items():
        assert trie.topic_key(list(topic), []) == key
        assert trie.lookup(list(topic)) == key
    topic_filter = [*filter_prefix, "#"] if hash_tail else filter_prefix
    if not topic_filter:
        return
    matches = trie.match(topic_filter)
    for topic, key in keys.items():
        if levels_match(topic_filter, list(topic)):
            assert any(m.static == key.static and all(
                want in (PLUS, got) for want, got in zip(m.pattern, key.varying, strict=True))
                for m in matches), (topic, topic_filter)


@pytest.mark.parametrize("bounds", BOUNDS)
def test_match_static_agrees_with_match(bounds: TrieBounds) -> None:
    trie = Trie([3, 2], bounds=bounds)
    learned: list[Edge] = []
    topics = ["a", "a/b", "a/b/c", "$s/x", "x/1", "x/2", "x/3", "x/4/y", "x/5/z", "q/r/s/t",
              "q/r/u", "q/v", "q/w/1", "q/w/2", "q/w/3", "q/w/4", "a/b/c/d"]
    for topic in topics:
        trie.key_of_topic(topic, learned)
    statics = {edge.child for edge in trie.edges() if edge.label == "\x00"}
    levels = ["a", "b", "x", "4", "q", "w", "1", "7", "+", "$s", "r"]
    filters = [list(combo) for size in (1, 2, 3)
               for combo in itertools.product(levels, repeat=size)]
    filters += [[*f, "#"] for f in filters] + [["#"]]
    for filter_levels in filters:
        expected = {(m.static, m.pattern) for m in trie.match(filter_levels)}
        got = set()
        for static in statics:
            found = trie.match_static(filter_levels, static)
            if found is not None:
                got.add((found.static, found.pattern))
        assert got == expected, filter_levels


def test_levels_past_the_bound_fold_into_one_varying_level() -> None:
    folds = Tally()
    trie = Trie([100, 10], bounds=TrieBounds(max_levels=2), folds=folds)
    deep = trie.key_of_topic("a/b/c/d", [])
    assert deep.varying == ("c/d",)
    assert trie.static_path(deep.static) == ["a", "b", REST, END]
    assert trie.key_of_topic("a/b/e", []).static == deep.static  # one folded stream
    assert trie.key_of_topic("a/b", []).varying == ()  # not deeper than the bound
    assert folds.value == 2
    # the fold reads every filter that can match its topics, and only as far as it must
    for topic_filter, pattern in (("a/b/c/d", "c/d"), ("a/+/c/+", PLUS), ("a/#", PLUS),
                                  ("a/b/c", "c"), ("+/b/+/d", PLUS)):
        assert (deep.static, (pattern,)) in {
            (m.static, m.pattern) for m in trie.match(topic_filter.split("/"))}, topic_filter
    assert all(m.static != deep.static for m in trie.match(["a", "b"]))


def test_a_byte_budget_stops_learning_and_a_new_generation_inherits_no_fold() -> None:
    budget = 20 * (EDGE_BYTES + 2)
    trie = Trie([100, 10], bounds=TrieBounds(max_bytes=budget))
    for i in range(200):
        # every topic parts from the others at its first levels (the attack)
        trie.key_of_topic("/".join([*str(i)[::-1], *["x"] * 20]), [])
    learned_exact = sum(1 for edge in trie.edges() if edge.label not in (END, REST))
    assert learned_exact * EDGE_BYTES <= budget
    states = len({edge.parent for edge in trie.edges()})
    assert len(trie) <= learned_exact + 2 * states  # REST and END: one each per state
    assert all(edge.label != REST for edge in trie.wildcard_paths())


def test_a_replica_given_the_edges_folds_alike() -> None:
    leader = Trie([2], bounds=TrieBounds(max_levels=1))
    learned = learn(leader, "a/b/c", "a/d", "e/f")
    replica = Trie([2])  # a replica applies the leader's edges; it does not learn
    for edge in learned:
        replica.add_edge(edge)
    for topic in ("a/b/c", "a/d", "e/f", "a/zz/y"):
        assert replica.key_of_topic(topic, []) == leader.key_of_topic(topic, [])
