"""Which shards a Spark run reads at which site (`spark.launch.shards_to_read`): each
shard's copy once, at its leader where it can, and every site's own shards where
sites run without replication."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stratamq.spark.launch import admin_url, parser, shards_to_read, site_urls


def view(*shards: tuple[int, list[str], str]) -> dict[str, Any]:
    return {"shards": [{"id": shard, "replicas": replicas, "leader": leader}
                       for shard, replicas, leader in shards]}


def test_a_replicated_shard_is_read_at_its_leader_once() -> None:
    placement = [(0, ["A", "B", "C"], "B"), (1, ["A", "B", "C"], "A"), (2, ["B", "C"], "C")]
    # every site lists every shard; C holds all three, A not shard 2
    views = [("A", view(*placement)), ("B", view(*placement)), ("C", view(*placement))]
    assert shards_to_read(views) == [[1], [0], [2]]
    # the leader's site not asked (gone, or left out): the first site holding one
    assert shards_to_read(views[:1] + views[2:]) == [[0, 1], [2]]


def test_sites_without_replication_each_read_their_own_shards() -> None:
    views = [("A", view((0, ["A"], "A"), (1, ["A"], "A"))),
             ("B", view((0, ["B"], "B"), (1, ["B"], "B")))]
    assert shards_to_read(views) == [[0, 1], [0, 1]]


@given(st.integers(1, 5).flatmap(lambda sites: st.tuples(
    st.just(sites),
    st.lists(st.tuples(st.sets(st.integers(0, sites - 1), min_size=1),
                       st.integers(0, 4)), min_size=1, max_size=8),
    st.sets(st.integers(0, sites - 1), min_size=1))))
def test_every_held_shard_is_read_exactly_once(case: tuple[int, list[Any], set[int]]) -> None:
    sites, shards, asked = case
    names = [f"S{n}" for n in range(sites)]
    placement = [(shard_id, sorted(names[n] for n in holders),
                  names[sorted(holders)[pick % len(holders)]])
                 for shard_id, (holders, pick) in enumerate(shards)]
    order = sorted(asked)
    read = shards_to_read([(names[n], view(*placement)) for n in order])
    for shard_id, replicas, leader in placement:
        readers = [names[n] for n, ids in zip(order, read, strict=True) if shard_id in ids]
        holders_asked = [names[n] for n in order if names[n] in replicas]
        assert len(readers) == (1 if holders_asked else 0), (shard_id, readers)
        if leader in holders_asked:
            assert readers == [leader]
        elif holders_asked:
            assert readers == holders_asked[:1]


def test_a_site_is_given_by_its_url_or_by_its_pod() -> None:
    """--site and --site-pod exclude each other; a pod's site is at its IP."""
    given = parser().parse_args(["gc", "--site", "http://a:1", "--site", "http://b:1",
                                 "--workdir", "/w"])
    assert site_urls(given) == ["http://a:1", "http://b:1"]
    by_pod = parser().parse_args(["gc", "--site-pod", "mq-0", "--site-pod", "mq-1",
                                  "--admin-port", "18099", "--workdir", "/w"])
    assert (by_pod.site_pod, by_pod.admin_port, by_pod.site) == (["mq-0", "mq-1"], 18099, None)
    assert admin_url("10.1.2.3", 18083) == "http://10.1.2.3:18083"
    assert admin_url("fd00::5", 18083) == "http://[fd00::5]:18083"
    for argv in (["gc", "--workdir", "/w"],
                 ["gc", "--site", "http://a:1", "--site-pod", "mq-0", "--workdir", "/w"]):
        with pytest.raises(SystemExit) as exited:
            parser().parse_args(argv)
        assert exited.value.code == 2
