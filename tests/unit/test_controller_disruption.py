"""How many sites may go at once (`broker/controller/disruption.py`): only replicas
that are up and hold what their leader committed count, and taking down any that
many sites leaves every shard a majority of such replicas."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import replace
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from stratamq.broker.controller.decisions import Settings
from stratamq.broker.controller.disruption import (
    caught_up_replicas,
    quorum_tolerance,
    tolerated_disruptions,
)
from stratamq.broker.controller.sites import ShardReport, SiteState
from stratamq.broker.ds.replication import Placement, ShardPlacement
from stratamq.broker.ds.replication.commit import majority

SETTINGS = Settings(replication_factor=3, n_shards=2, heartbeat_interval=1.0,
                    databases=("messages",))
DB = "messages"
NOW = 100.0
COMMITTED = 50


def placement_of(*replica_sets: str, leaders: str | None = None) -> Placement:
    leaders = leaders or "".join(replicas[0] for replicas in replica_sets)
    return Placement(version=3, shards=tuple(
        ShardPlacement(database=DB, shard=number, replicas=tuple(replicas),
                       leader=leaders[number], epoch=2)
        for number, replicas in enumerate(replica_sets)))


def sites_for(placement: Placement, behind: Set[tuple[int, str]] = frozenset(),
              gone: Set[str] = frozenset()) -> dict[str, SiteState]:
    """Every site of `placement` reporting its shards: the leader has committed
    COMMITTED; a follower in `behind` (shard, site) ends short of it; the sites in
    `gone` last answered long ago."""
    names = sorted({site for shard in placement.shards for site in shard.replicas})
    found = {}
    for name in names:
        shards = {}
        for shard in placement.shards:
            if name in shard.replicas:
                end = COMMITTED - 10 if (shard.shard, name) in behind else COMMITTED
                leading = shard.leader == name
                shards[shard.id] = ShardReport(
                    "leader" if leading else "follower", shard.epoch, (shard.epoch, end),
                    committed=COMMITTED if leading else min(end, COMMITTED - 10),
                    applied=0)
        seen = NOW - 60 if name in gone else NOW
        found[name] = SiteState(id=name, admin_url=f"http://{name}", last_seen=seen,
                                answered=True, peer=f"{name}:1", placement_version=3,
                                shards=shards)
    return found


def test_a_healthy_shard_at_replication_factor_3_tolerates_one_site_down() -> None:
    placement = placement_of("ABC", "BCD")
    assert tolerated_disruptions(placement, sites_for(placement), {}, NOW, SETTINGS) == 1


def test_a_replica_catching_up_counts_as_down() -> None:
    """Its pod is Ready, but its log lacks what the leader committed: taking another
    replica of that shard down would leave one that can acknowledge."""
    placement = placement_of("ABC", "BCD")
    sites = sites_for(placement, behind={(1, "D")})
    assert caught_up_replicas(placement.shards[1], sites, {}, NOW, SETTINGS) == ["B", "C"]
    assert tolerated_disruptions(placement, sites, {}, NOW, SETTINGS) == 0


def test_a_follower_is_measured_against_what_its_leader_committed_a_round_before() -> None:
    """Probed one after the other under load, the leader (probed last) has committed
    more than its followers' logs hold; a round earlier it had committed less."""
    placement = placement_of("ABC")
    now_sites = sites_for(placement, behind={(0, "B"), (0, "C")})
    assert tolerated_disruptions(placement, now_sites, {}, NOW, SETTINGS) == 0
    earlier = {name: replace(site, shards={
        shard: replace(report, committed=COMMITTED - 20)
        for shard, report in site.shards.items()}) for name, site in now_sites.items()}
    assert tolerated_disruptions(placement, now_sites, earlier, NOW, SETTINGS) == 1
    # an earlier report of another epoch (a failover since) does not count
    other_epoch = {name: replace(site, shards={
        shard: replace(report, epoch=1, committed=0)
        for shard, report in site.shards.items()}) for name, site in now_sites.items()}
    assert tolerated_disruptions(placement, now_sites, other_epoch, NOW, SETTINGS) == 0


def test_a_site_down_leaves_no_room_at_3_and_one_more_at_5() -> None:
    three = placement_of("ABC", "BCD")
    assert tolerated_disruptions(three, sites_for(three, gone={"C"}), {}, NOW, SETTINGS) == 0
    five = placement_of("ABCDE")
    assert tolerated_disruptions(five, sites_for(five, gone={"E"}), {}, NOW, SETTINGS) == 1
    assert tolerated_disruptions(five, sites_for(five), {}, NOW, SETTINGS) == 2


def test_a_shard_whose_leader_is_down_tolerates_nothing() -> None:
    placement = placement_of("ABC", "BCD", leaders="AB")
    assert tolerated_disruptions(placement, sites_for(placement, gone={"A"}), {}, NOW,
                                 SETTINGS) == 0


def test_nothing_is_known_before_the_first_placement() -> None:
    assert tolerated_disruptions(Placement(version=0, shards=()), {}, {}, NOW, SETTINGS) is None


def test_a_healthy_cluster_tolerates_what_its_replication_factor_allows() -> None:
    assert [quorum_tolerance(rf) for rf in range(1, 8)] == [0, 0, 1, 1, 2, 2, 3]


SITES = "ABCDEF"


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Placement, dict[str, SiteState]]:
    n_shards = draw(st.integers(1, 4))
    replica_sets = []
    for _ in range(n_shards):
        size = draw(st.integers(1, 5))
        replica_sets.append("".join(draw(st.permutations(SITES))[:size]))
    placement = placement_of(*replica_sets)
    behind = draw(st.sets(st.tuples(st.integers(0, n_shards - 1), st.sampled_from(SITES))))
    behind = {(shard, site) for shard, site in behind
              if site in replica_sets[shard] and site != replica_sets[shard][0]}
    gone = draw(st.sets(st.sampled_from(SITES), max_size=2))
    return placement, sites_for(placement, behind, gone)


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_any_tolerated_set_of_sites_down_leaves_every_shard_its_majority(
        cluster: tuple[Placement, dict[str, SiteState]]) -> None:
    placement, sites = cluster
    tolerated = tolerated_disruptions(placement, sites, {}, NOW, SETTINGS)
    assert tolerated is not None and tolerated >= 0
    caught_up = {shard.id: caught_up_replicas(shard, sites, {}, NOW, SETTINGS)
                 for shard in placement.shards}

    def keeps_majority(shard: ShardPlacement, down: tuple[str, ...]) -> bool:
        left = [site for site in caught_up[shard.id] if site not in down]
        return len(left) >= majority(len(shard.replicas))

    # a shard that has its majority keeps it, whichever sites go
    whole = [shard for shard in placement.shards if keeps_majority(shard, ())]
    for down in combinations(sorted(sites), tolerated):
        assert all(keeps_majority(shard, down) for shard in whole), down
    # and it is the most that is safe: one more, chosen badly, breaks some shard
    if len(whole) == len(placement.shards):
        assert any(not keeps_majority(shard, down)
                   for down in combinations(sorted(sites), tolerated + 1)
                   for shard in placement.shards)
    else:
        assert tolerated == 0
