"""The retained messages' topic index: for any filter it finds exactly the topics
`topic_matches` accepts (checked against a brute-force scan of the same topics), and
removing topics shrinks the trie back."""

from __future__ import annotations

import random

from stratamq.broker.core.topic_index import TopicIndex
from stratamq.broker.topic import topic_matches

TOPICS = ["a", "a/b", "a/b/c", "a/c", "a//c", "/a", "b/a", "$SYS/x", "$SYS", "a/$x",
          "a/b/c/d", "x/y/z"]
FILTERS = ["#", "+", "a", "a/#", "a/+", "a/+/c", "+/a", "/#", "+/+", "$SYS/#", "$SYS",
           "+/b/#", "a/b/c/#", "a//+", "+/+/+/+", "z", "a/b/c/d/e"]


def test_matches_what_a_scan_of_every_topic_matches() -> None:
    index = TopicIndex()
    for topic in TOPICS:
        index.add(topic)
    for topic_filter in FILTERS:
        expected = sorted(t for t in TOPICS if topic_matches(topic_filter, t))
        assert sorted(index.matching(topic_filter.split("/"))) == expected, topic_filter


def test_random_topics_against_a_scan() -> None:
    rng = random.Random(7)
    index = TopicIndex()
    topics: set[str] = set()
    for _ in range(2000):
        topic = "/".join(rng.choice(["a", "b", "", "$s"]) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.3 and topics:
            gone = rng.choice(sorted(topics))
            index.remove(gone)
            topics.discard(gone)
        else:
            index.add(topic)
            topics.add(topic)
    assert len(index) == len(topics)
    for topic_filter in ["#", "+/#", "a/+", "+/+/+", "b/#", "$s/#", "/+", "a/b/#"]:
        expected = sorted(t for t in topics if topic_matches(topic_filter, t))
        assert sorted(index.matching(topic_filter.split("/"))) == expected, topic_filter


def test_removing_every_topic_leaves_an_empty_trie() -> None:
    index = TopicIndex()
    for topic in TOPICS:
        index.add(topic)
    index.add("a/b")  # twice: still one
    assert len(index) == len(TOPICS)
    for topic in TOPICS:
        index.remove(topic)
        assert topic not in index
    index.remove("never/there")
    assert len(index) == 0
    assert index._root.children == {}  # no node is left behind


def test_a_walk_goes_on_while_topics_come_and_go() -> None:
    """The walk of a large retained set is consumed across awaits: topics added and
    removed meanwhile never break it, and every topic there all along is found."""
    index = TopicIndex()
    kept = [f"k/{i}/{j}" for i in range(20) for j in range(20)]
    for topic in kept:
        index.add(topic)
    for topic_filter in ["#", "k/#", "k/+/+"]:
        found = []
        for step, topic in enumerate(index.matching(topic_filter.split("/"))):
            found.append(topic)
            index.add(f"k/n{step}/new")  # a new branch under one being walked
            index.add(f"k/{step % 20}/n{step}")  # a new leaf in an old branch
            index.remove(f"k/n{step - 1}/new")  # a branch removed again
            index.add(f"other/{step}")
        assert set(kept) <= set(found), topic_filter
        assert all(topic_matches(topic_filter, topic) for topic in found)
