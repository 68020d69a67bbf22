"""The replication planner on hand-made cases: first placements, adding and draining
sites, changing the replication factor, impossible requests, and failover. The
properties over many random cases are in test_replication_planner_properties.py."""

from __future__ import annotations

import ast
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stratamq.broker.ds.replication import (
    FIRST_EPOCH,
    Placement,
    Plan,
    PlannedSite,
    ShardPlacement,
    Transition,
    apply_transitions,
    breaks_zone_rule,
    failover,
    plan,
)
from stratamq.broker.ds.replication import placement as placement_module
from stratamq.broker.ds.replication import planner as planner_module
from stratamq.broker.ds.replication import zones as zones_module
from stratamq.broker.errors import (
    LastReplicaError,
    NoMajorityError,
    NotEnoughSitesError,
    PlacementError,
    PlanError,
    UnknownSiteError,
)

DATABASES = ["messages", "retained", "sessions"]


def sites(names: str, draining: str = "") -> list[PlannedSite]:
    return [PlannedSite(name, draining=name in draining) for name in names]


def replicas_per_site(placement: Placement, database: str) -> Counter[str]:
    return Counter(site for shard in placement.shards_of(database) for site in shard.replicas)


def leaders_per_site(placement: Placement, database: str) -> Counter[str]:
    return Counter(shard.leader for shard in placement.shards_of(database))


def shard(database: str, number: int, replicas: str, leader: str,
          epoch: int = 1) -> ShardPlacement:
    return ShardPlacement(database=database, shard=number, replicas=tuple(replicas),
                          leader=leader, epoch=epoch)


def test_first_placement_is_balanced_and_has_no_steps() -> None:
    result = plan(sites("ABC"), DATABASES, n_shards=16, replication_factor=3)
    assert result.transitions == ()
    assert result.start == result.target
    placement = result.target
    assert placement.version == 1
    assert placement.databases() == tuple(DATABASES)
    for database in DATABASES:
        assert placement.n_shards(database) == 16
        assert replicas_per_site(placement, database) == {"A": 16, "B": 16, "C": 16}
        assert sorted(leaders_per_site(placement, database).values()) == [5, 5, 6]
        assert {shard.epoch for shard in placement.shards_of(database)} == {FIRST_EPOCH}
    # The site that leads 6 shards of one database is not the same one each time.
    overall = Counter(shard.leader for shard in placement)
    assert sorted(overall.values()) == [16, 16, 16]


def test_first_placement_spreads_uneven_counts_over_databases() -> None:
    # 4 shards x 2 replicas on 3 sites: 8 replicas, so one site holds 2 of a database
    # and two hold 3; the sites holding 3 differ between databases.
    placement = plan(sites("ABC"), DATABASES, n_shards=4, replication_factor=2).target
    for database in DATABASES:
        assert sorted(replicas_per_site(placement, database).values()) == [2, 3, 3]
        assert sorted(leaders_per_site(placement, database).values()) == [1, 1, 2]
    overall = Counter(site for shard in placement for site in shard.replicas)
    assert sorted(overall.values()) == [8, 8, 8]


def test_a_balanced_placement_needs_no_step() -> None:
    first = plan(sites("ABCD"), DATABASES, 8, 3).target
    again = plan(sites("DCBA"), DATABASES, 8, 3, first)
    assert again.transitions == ()
    assert again.start is first and again.target == first


def test_adding_a_site_moves_its_share_adding_before_removing() -> None:
    first = plan(sites("ABC"), ["messages"], 6, 2).target
    assert replicas_per_site(first, "messages") == {"A": 4, "B": 4, "C": 4}
    grown = plan(sites("ABCD"), ["messages"], 6, 2, first)
    # D's share of 12 replicas over 4 sites is 3: three moves, each `+D` then `-X`.
    steps = grown.transitions
    assert len(steps) == 6
    assert [step.action for step in steps] == ["add", "remove"] * 3
    assert all(step.site == "D" for step in steps[::2])
    assert all(add.shard_id == remove.shard_id for add, remove in zip(steps[::2], steps[1::2],
                                                                       strict=True))
    assert replicas_per_site(grown.target, "messages") == {"A": 3, "B": 3, "C": 3, "D": 3}
    assert apply_transitions(grown.start, steps) == grown.target
    assert grown.target.version == first.version + 6
    # Leadership moved only with a leader's replica, and D leads some shard now.
    leaders = leaders_per_site(grown.target, "messages")
    assert sorted(leaders.values()) == [1, 1, 2, 2]
    for step in steps:
        if step.action == "remove" and first.shard("messages", step.shard).leader == step.site:
            assert step.leader is not None
    unchanged = [number for number in range(6)
                 if grown.target.shard("messages", number).replicas
                 == first.shard("messages", number).replicas]
    for number in unchanged:
        assert grown.target.shard("messages", number) == first.shard("messages", number)


def zoned(zones: str, draining: str = "") -> list[PlannedSite]:
    """Sites A, B, ... in the zones named by the letters of `zones` ("." for none)."""
    return [PlannedSite(chr(ord("A") + position), draining=chr(ord("A") + position) in draining,
                 zone=None if zone == "." else f"zone-{zone}")
            for position, zone in enumerate(zones)]


def zones_of(placement: Placement, database: str, sites: list[PlannedSite]) -> list[list[str]]:
    zone = {site.id: site.zone for site in sites}
    return [sorted((zone[site] or site) for site in shard.replicas)
            for shard in placement.shards_of(database)]


def test_two_zones_get_one_replica_of_each_shard_each() -> None:
    # Round-robin over A B C D would put shards 0 and 2 on A and B, both in zone x.
    four = zoned("xxyy")
    result = plan(four, ["messages"], n_shards=8, replication_factor=2)
    assert zones_of(result.target, "messages", four) == [["zone-x", "zone-y"]] * 8
    assert replicas_per_site(result.target, "messages") == Counter(A=4, B=4, C=4, D=4)
    assert plan(four, ["messages"], 8, 2, result.target).transitions == ()


def test_labelling_zones_moves_replicas_apart_adding_before_removing() -> None:
    before = plan(sites("ABCD"), ["messages"], n_shards=4, replication_factor=2).target
    four = zoned("xxyy")
    assert breaks_zone_rule(four, before, "messages", 2)
    assert not breaks_zone_rule(sites("ABCD"), before, "messages", 2)
    assert not breaks_zone_rule(zoned("xxyy")[:3], before, "messages", 2)  # D not given
    result = plan(four, ["messages"], 4, 2, before)
    assert not breaks_zone_rule(four, result.target, "messages", 2)
    assert zones_of(result.target, "messages", four) == [["zone-x", "zone-y"]] * 4
    assert replicas_per_site(result.target, "messages") == Counter(A=2, B=2, C=2, D=2)
    # One move per shard, each a follower's: no leader is handed over.
    assert result.describe() == ["messages/0: +C", "messages/0: -B",
                                 "messages/1: +B", "messages/1: -D",
                                 "messages/2: +D", "messages/2: -A",
                                 "messages/3: +A", "messages/3: -C"]


def test_a_zone_of_one_site_holds_every_shard_when_the_rule_demands() -> None:
    three = zoned("xxy")
    result = plan(three, ["messages"], n_shards=6, replication_factor=2)
    assert replicas_per_site(result.target, "messages") == Counter(A=3, B=3, C=6)


def test_zones_too_few_for_the_rule_plan_as_without_zones() -> None:
    # 4 replicas, 2 zones: at most 2 per zone, but zone y has 1 site: cannot be met.
    infeasible = zoned("xxxy")
    assert (plan(infeasible, ["messages"], 4, 4) == plan(sites("ABCD"), ["messages"], 4, 4))
    # A site of unknown zone is a zone of its own: 3 zones, so 1 replica per zone.
    unknown = zoned("xx.")
    result = plan(unknown, ["messages"], n_shards=4, replication_factor=3)
    assert zones_of(result.target, "messages", unknown) == [["C", "zone-x", "zone-x"]] * 4
    result = plan(zoned("xx.."), ["messages"], n_shards=4, replication_factor=3)
    assert all(sorted(shard.replicas)[:2] != ["A", "B"] for shard in result.target)


def test_draining_a_zone_keeps_the_rule_while_zones_remain() -> None:
    six = zoned("xxyyzz")
    first = plan(six, ["messages"], n_shards=6, replication_factor=3).target
    draining = zoned("xxyyzz", draining="F")
    result = plan(draining, ["messages"], 6, 3, first)
    assert all(step.site != "F" for step in result.transitions if step.action == "add")
    assert zones_of(result.target, "messages", draining) == [
        ["zone-x", "zone-y", "zone-z"]] * 6
    assert replicas_per_site(result.target, "messages")["F"] == 0


def test_plan_reads_as_plus_minus_site_per_shard() -> None:
    first = plan(sites("AB"), ["messages"], 2, 1).target
    assert [(s.replicas, s.leader) for s in first] == [(("A",), "A"), (("B",), "B")]
    drained = plan(sites("ABC", draining="A"), ["messages"], 2, 1, first)
    assert drained.describe() == ["messages/0: +C", "messages/0: -A (leader -> C)"]


def test_draining_a_site_moves_every_replica_off_it_once() -> None:
    first = plan(sites("ABCDE"), DATABASES, 10, 3).target
    drained = plan(sites("ABCDE", draining="C"), DATABASES, 10, 3, first)
    for database in DATABASES:
        before = replicas_per_site(first, database)["C"]
        removed = [step for step in drained.transitions
                   if step.database == database and step.action == "remove"]
        assert len(removed) == before
        assert all(step.site == "C" for step in removed)
        after = replicas_per_site(drained.target, database)
        assert "C" not in after
        assert max(after.values()) - min(after.values()) <= 1
        assert "C" not in leaders_per_site(drained.target, database)
    for step in drained.transitions:
        if step.action == "remove":
            was = first.shard(step.database, step.shard)
            now = drained.target.shard(step.database, step.shard)
            assert (step.leader is not None) == (was.leader == "C")
            assert now.epoch == was.epoch + (1 if was.leader == "C" else 0)


def test_raising_the_replication_factor_only_adds() -> None:
    first = plan(sites("ABCD"), ["messages"], 4, 1).target
    raised = plan(sites("ABCD"), ["messages"], 4, 3, first)
    assert {step.action for step in raised.transitions} == {"add"}
    assert len(raised.transitions) == 8
    assert all(len(s.replicas) == 3 for s in raised.target)
    assert [s.leader for s in raised.target] == [s.leader for s in first]
    assert replicas_per_site(raised.target, "messages") == {"A": 3, "B": 3, "C": 3, "D": 3}


def test_lowering_the_replication_factor_only_removes() -> None:
    first = plan(sites("ABCD"), ["messages"], 4, 3).target
    lowered = plan(sites("ABCD"), ["messages"], 4, 2, first)
    assert {step.action for step in lowered.transitions} == {"remove"}
    assert len(lowered.transitions) == 4
    assert replicas_per_site(lowered.target, "messages") == {"A": 2, "B": 2, "C": 2, "D": 2}
    # Followers leave, not leaders: nothing had to hand over.
    assert [s.leader for s in lowered.target] == [s.leader for s in first]


def test_a_new_database_is_placed_in_start_and_the_others_kept() -> None:
    first = plan(sites("ABC"), ["messages"], 4, 2).target
    more = plan(sites("ABC"), ["messages", "retained"], 4, 2, first)
    assert more.transitions == ()
    assert more.start.version == first.version + 1
    assert more.start.shards_of("messages") == first.shards_of("messages")
    assert more.start.n_shards("retained") == 4
    assert more.target == more.start


def test_databases_not_named_are_left_alone() -> None:
    # One database on its own set of sites (`set-replicas retained A B`).
    first = plan(sites("ABC"), DATABASES, 4, 2).target
    retained = plan(sites("AB") + sites("C", draining="C"), ["retained"], 4, 2, first)
    assert {step.database for step in retained.transitions} == {"retained"}
    assert replicas_per_site(retained.target, "retained") == {"A": 4, "B": 4}
    for database in ("messages", "sessions"):
        assert retained.target.shards_of(database) == first.shards_of(database)


def test_fewer_sites_than_the_replication_factor_is_refused() -> None:
    with pytest.raises(NotEnoughSitesError, match=r"replication factor 3 needs 3 sites that "
                                                  r"may hold replicas; there are 2$"):
        plan(sites("AB"), DATABASES, 4, 3)
    first = plan(sites("ABC"), DATABASES, 4, 3).target
    with pytest.raises(NotEnoughSitesError, match=r"there are 2 \(1 more draining\)"):
        plan(sites("ABC", draining="B"), DATABASES, 4, 3, first)


def test_draining_every_site_is_removing_the_last_replica() -> None:
    first = plan(sites("A"), ["messages"], 2, 1).target
    with pytest.raises(LastReplicaError, match="every site of messages is draining"):
        plan(sites("A", draining="A"), ["messages"], 2, 1, first)


def test_a_replica_on_a_site_not_given_is_refused() -> None:
    first = plan(sites("ABC"), DATABASES, 4, 2).target
    with pytest.raises(UnknownSiteError, match="messages has replicas on C, not among the "
                                               "sites given"):
        plan(sites("ABD"), DATABASES, 4, 2, first)


@pytest.mark.parametrize(("arguments", "error"), [
    ((sites("AB") + sites("A"), ["messages"], 4, 1), "sites: A is given twice"),
    ((sites("AB"), "messages", 4, 1), "expected a list of names"),
    ((sites("AB"), [], 4, 1), "at least one database"),
    ((sites("AB"), ["messages", "messages"], 4, 1), "messages given more than once"),
    ((sites("AB"), ["Messages"], 4, 1), "'Messages' is not a database name"),
    ((sites("AB"), ["messages"], 0, 1), "n_shards: 0 is not a whole number >= 1"),
    ((sites("AB"), ["messages"], 4, 0), "replication_factor: 0 is not"),
    ((sites("AB"), ["messages"], 4, True), "replication_factor: True is not"),
])
def test_bad_requests_are_refused(arguments: tuple[object, ...], error: str) -> None:
    with pytest.raises((PlanError, PlacementError), match=error):
        plan(*arguments)  # type: ignore[arg-type]


def test_the_number_of_shards_is_fixed() -> None:
    first = plan(sites("AB"), ["messages"], 4, 1).target
    with pytest.raises(PlanError, match="messages has 4 shards, 8 asked for"):
        plan(sites("AB"), ["messages"], 8, 1, first)


def test_a_step_of_the_plan_refuses_a_placement_it_was_not_made_for() -> None:
    first = plan(sites("ABC"), ["messages"], 3, 1).target
    step = Transition("messages", 0, "remove", "B")
    with pytest.raises(PlacementError, match="B holds no replica of messages/0"):
        apply_transitions(first, [step])


def test_a_kept_plan_round_trips_and_says_what_remains() -> None:
    first = plan(sites("ABC"), ["messages"], 3, 2).target
    grown = plan(sites("ABCD"), ["messages"], 3, 2, first)
    text = grown.to_json()
    assert text.splitlines()[-4:] == [
        '    {"database": "messages", "shard": 2, "action": "add", "site": "D"},',
        '    {"database": "messages", "shard": 2, "action": "remove", "site": "C"}',
        "  ]", "}"]
    kept = Plan.from_json(text)
    assert kept == grown
    assert kept.remaining(grown.start) == grown.transitions
    one_step = apply_transitions(grown.start, grown.transitions[:1])
    assert kept.remaining(one_step) == grown.transitions[1:]
    assert kept.remaining(grown.target) == ()
    # A failover changed the placement: the plan no longer applies.
    moved = failover(one_step, ("messages", 0), {"A", "B"}, {"A": (1, 5), "B": (1, 6)})
    with pytest.raises(PlanError, match="version 3 is not a step of the plan from "
                                        "version 1 to 3; plan again"):
        kept.remaining(moved)


@pytest.mark.parametrize(("change", "error"), [
    (lambda d: d.update(format=2), "plan: format 2 is not 1"),
    (lambda d: d.pop("start"), "expected the keys format, start, transitions"),
    (lambda d: d["transitions"][0].update(action="move"),
     r"transitions\[0\]: transition: action 'move' is not add or remove"),
    (lambda d: d["transitions"][1].update(site="A"), "A holds no replica of messages/2"),
    (lambda d: d["transitions"].insert(0, d["transitions"][0]), "D already holds messages/2"),
    (lambda d: d["transitions"][0].update(colour="red"), r"unknown key\(s\) colour"),
])
def test_a_damaged_plan_is_refused(change: Callable[[dict[str, Any]], None],
                                   error: str) -> None:
    first = plan(sites("ABC"), ["messages"], 3, 2).target
    document = json.loads(plan(sites("ABCD"), ["messages"], 3, 2, first).to_json())
    change(document)
    with pytest.raises(PlacementError, match=error):
        Plan.from_json(json.dumps(document))


# --- failover -------------------------------------------------------------------------

def three_replicas() -> Placement:
    return Placement(version=5, shards=(
        shard("messages", 0, "ABC", "A", epoch=3),
        shard("messages", 1, "BCD", "B", epoch=2),
        shard("messages", 2, "BCD", "B", epoch=2),
    ))


def test_failover_picks_the_replica_with_the_highest_epoch_then_offset() -> None:
    placement = three_replicas()
    after = failover(placement, ("messages", 0), alive_sites={"B", "C"},
                     positions={"B": (3, 120), "C": (2, 500)})
    assert after.version == 6
    assert after.shard("messages", 0) == shard("messages", 0, "ABC", "B", epoch=4)
    assert after.shard("messages", 1) == placement.shard("messages", 1)
    after = failover(placement, ("messages", 0), alive_sites={"B", "C"},
                     positions={"B": (3, 120), "C": (3, 121)})
    assert after.shard("messages", 0).leader == "C"


def test_failover_epoch_passes_every_epoch_a_replica_has_seen() -> None:
    # A replica can hold entries of an epoch newer than the placement it was given
    # (the push of the placement raced the leader's first append).
    after = failover(three_replicas(), ("messages", 0), alive_sites={"B", "C"},
                     positions={"B": (5, 1), "C": (3, 9)})
    assert after.shard("messages", 0).leader == "B"
    assert after.shard("messages", 0).epoch == 6


def test_failover_ties_go_to_the_leader_then_to_who_leads_least() -> None:
    placement = three_replicas()
    again = failover(placement, ("messages", 0), alive_sites={"A", "B", "C"},
                     positions={"A": (3, 7), "B": (3, 7), "C": (3, 7)})
    assert again.shard("messages", 0).leader == "A"
    assert again.shard("messages", 0).epoch == 4
    # B leads two other shards, C none.
    tie = failover(placement, ("messages", 0), alive_sites={"B", "C"},
                   positions={"B": (3, 7), "C": (3, 7)})
    assert tie.shard("messages", 0).leader == "C"


def test_failover_needs_a_majority_of_alive_reporting_replicas() -> None:
    placement = three_replicas()
    with pytest.raises(NoMajorityError, match=r"messages/0: 1 of its 3 replicas are alive and "
                                              r"reported a position \(B\); a new leader "
                                              r"needs 2. Waiting on A, C"):
        failover(placement, ("messages", 0), alive_sites={"B", "C"},
                 positions={"B": (3, 1), "D": (9, 9)})
    with pytest.raises(NoMajorityError):
        failover(placement, ("messages", 0), alive_sites={"B"},
                 positions={"B": (3, 1), "C": (3, 1)})
    assert NoMajorityError("x").recoverable
    # A site that is not a replica never becomes the leader, however far it is.
    after = failover(placement, ("messages", 0), alive_sites={"B", "C", "D"},
                     positions={"B": (3, 1), "C": (3, 0), "D": (9, 9)})
    assert after.shard("messages", 0).leader == "B"


def test_failover_of_a_single_replica_shard_and_bad_input() -> None:
    single = Placement(version=1, shards=(shard("messages", 0, "A", "A"),))
    with pytest.raises(NoMajorityError, match="0 of its 1 replicas"):
        failover(single, ("messages", 0), alive_sites=set(), positions={})
    assert failover(single, ("messages", 0), {"A"}, {"A": (0, 0)}).shard(
        "messages", 0).epoch == 2
    with pytest.raises(PlacementError, match=r"position of A: \(1,\) is not \(epoch, offset\)"):
        failover(single, ("messages", 0), {"A"}, {"A": (1,)})  # type: ignore[dict-item]
    with pytest.raises(PlacementError, match="has no shard messages/3"):
        failover(single, ("messages", 3), {"A"}, {"A": (1, 1)})


def test_the_planner_and_placement_do_no_io() -> None:
    """The operator and the controller import these: they must stay pure, which their
    imports show (no os, pathlib, socket, asyncio, subprocess, ...)."""
    pure = {"__future__", "collections", "collections.abc", "dataclasses", "json", "re",
            "typing", "...errors", ".placement", ".zones"}
    for module in (planner_module, placement_module, zones_module):
        assert module.__file__ is not None
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add("." * node.level + (node.module or ""))
        assert imported <= pure, (module.__name__, imported - pure)
