"""The controller's pure decisions (`broker/controller/decisions.py`): sites gone after
missed heartbeats, the first placement, failover to the most advanced replica of a
majority, plans carried out one step at a time (never below the replication factor,
a joining replica caught up before anyone leaves), requests refused without change,
and a plan resumed from the controller's files after a restart."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stratamq.broker.controller import decisions
from stratamq.broker.controller.decisions import ClusterState, Settings
from stratamq.broker.controller.sites import (
    BadReportError,
    Report,
    ShardReport,
    SiteState,
    parse_held,
    parse_report,
)
from stratamq.broker.controller.state import (
    FolderLock,
    FolderLockedError,
    FolderRecord,
    SiteAddress,
    StateFiles,
)
from stratamq.broker.ds.replication import Placement, ShardId, ShardPlacement
from stratamq.broker.ds.replication.term import NO_TERM, ControllerTerm
from stratamq.broker.errors import (
    ClusterNotReadyError,
    CorruptDataError,
    LastReplicaError,
    NotEnoughSitesError,
    SiteStateError,
    UnknownDatabaseError,
    UnknownSiteError,
)

# One database keeps these cases small; the sites' default is all three.
SETTINGS = Settings(replication_factor=3, n_shards=4, heartbeat_interval=1.0,
                    expected_sites=3, databases=("messages",))
DB = "messages"


def site(name: str, now: float = 100.0, placement: Placement | None = None,
         positions: dict[int, tuple[int, int]] | None = None, applied: int = 0,
         committed: int = 0, answered: bool = True, n_shards: int = 4) -> SiteState:
    """A site that answered at `now`, reporting every shard of `placement` it holds
    (log end from `positions`, default (epoch, 0))."""
    shards = {}
    if placement is None:
        # Before any placement a site reports every shard with no role.
        shards = {(DB, number): ShardReport("none", 0, (0, 0), 0, 0)
                  for number in range(n_shards)}
    else:
        for shard in placement.shards:
            if name in shard.replicas:
                last = (positions or {}).get(shard.shard, (shard.epoch, 0))
                shards[shard.id] = ShardReport(
                    role="leader" if shard.leader == name else "follower", epoch=shard.epoch,
                    last=last, committed=committed, applied=applied)
    return SiteState(id=name, admin_url=f"http://{name}", last_seen=now, answered=answered,
                     peer=f"{name}:1", placement_version=None if placement is None
                     else placement.version, shards=shards)


def sites_of(*states: SiteState) -> dict[str, SiteState]:
    return {state.id: state for state in states}


def placed(names: Iterable[str] = "ABC", now: float = 100.0) -> ClusterState:
    sites = sites_of(*(site(name, now) for name in names))
    decision = decisions.decide(ClusterState(), sites, now, started=0.0, settings=SETTINGS)
    assert decision.state.placement.version == 1
    return decision.state


def one_shard(replicas: str, leader: str, epoch: int = 1, version: int = 5) -> Placement:
    return Placement(version=version, shards=(ShardPlacement(
        database=DB, shard=0, replicas=tuple(replicas), leader=leader, epoch=epoch),))


# --- sites ------------------------------------------------------------------------------

def test_a_site_is_gone_after_three_missed_heartbeats() -> None:
    state = site("A", now=100.0)
    assert not decisions.is_gone(state, 103.0, SETTINGS)
    assert decisions.is_gone(state, 103.01, SETTINGS)
    slow = replace(SETTINGS, heartbeat_interval=0.5)
    assert decisions.is_gone(state, 101.6, slow)


def test_a_site_whose_address_refuses_the_probe_is_gone_at_once() -> None:
    """Nothing listening where a site answered before: its process is down, its
    shards fail over this round, not three heartbeats later. One that has not
    answered since the controller started (sites starting together) keeps the grace
    of its `last_seen`; one that answers again is back."""
    state = replace(site("A", now=100.0), refused=True)
    assert decisions.is_gone(state, 100.5, SETTINGS)
    assert not decisions.is_gone(replace(state, answered=False), 100.5, SETTINGS)
    assert decisions.is_gone(replace(state, answered=False), 103.01, SETTINGS)

    cluster = placed("ABCD")
    placement = cluster.placement
    led = [shard.id for shard in placement.shards if shard.leader == "A"]
    assert led
    sites = sites_of(replace(site("A", placement=placement), refused=True),
                     *(site(name, placement=placement) for name in "BCD"))
    decision = decisions.decide(cluster, sites, 100.5, started=0.0, settings=SETTINGS)
    assert all(decision.state.placement.shard(*shard).leader != "A" for shard in led)
    assert {move.old_leader for move in decision.leader_moves} == {"A"}
    back = site("A", placement=placement).seen(
        Report("A", "A:1", placement.version, {}, False, 1.0, NO_TERM), 100.6)
    assert not back.refused


def test_reports_are_checked() -> None:
    entry: dict[str, Any] = {"db": DB, "shard": 0, "role": "none", "epoch": 0,
                             "last": [0, 0], "committed": 0, "applied": 0}
    good: dict[str, Any] = {"site": "A", "peer": "127.0.0.1:18084",
                            "placement_version": None, "shards": [entry],
                            "stopping": False, "heartbeat_interval": 0.5,
                            "controller_term": [0, ""]}
    report = parse_report(good)
    assert report.shards[(DB, 0)] == ShardReport("none", 0, (0, 0), 0, 0)
    assert not report.stopping
    assert parse_report({**good, "stopping": True}).stopping
    assert report.heartbeat_interval == 0.5 and report.term == NO_TERM
    leading = parse_report({**good, "controller_term": [2, "k"],
                            "shards": [{**entry, "role": "leader", "quorum_age": 1.25}]})
    assert leading.term == ControllerTerm(2, "k")
    assert leading.shards[(DB, 0)].quorum_age == 1.25
    # A site's zone: absent (a site older than zones) or null is not known.
    assert report.zone is None and parse_report({**good, "zone": None}).zone is None
    assert parse_report({**good, "zone": "eu-west-1a"}).zone == "eu-west-1a"
    assert site("A").seen(parse_report({**good, "zone": "z1"}), 1.0).zone == "z1"
    missing = [{key: value for key, value in good.items() if key != name}
               for name in ("stopping", "heartbeat_interval", "controller_term")]
    for broken in (*missing, {**good, "site": "a b"}, {**good, "shards": {}},
                   {**good, "stopping": "yes"}, {**good, "heartbeat_interval": "1s"},
                   {**good, "controller_term": [1]},
                   {**good, "shards": [{**entry, "quorum_age": -1}]},
                   {**good, "shards": [{**entry, "quorum_age": float("nan")}]},
                   {**good, "shards": [{**entry, "role": "boss"}]},
                   {**good, "shards": [{**entry, "last": [1]}]},
                   {**good, "shards": [{**entry, "applied": -1}]},
                   {**good, "zone": ""}, {**good, "zone": 3}):
        with pytest.raises(BadReportError):
            parse_report(broken)


# --- first placement ---------------------------------------------------------------------

def test_first_placement_waits_for_enough_sites() -> None:
    two = sites_of(site("A"), site("B"))
    decision = decisions.decide(ClusterState(), two, 100.0, started=0.0, settings=SETTINGS)
    assert decision.state == ClusterState()
    assert "waiting for sites" in decision.notes[0]
    state = placed("ABC")
    assert state.goals == {DB: ("A", "B", "C")}
    assert state.plan is None
    for shard in state.placement.shards_of(DB):
        assert sorted(shard.replicas) == ["A", "B", "C"]
        assert shard.epoch == 1


def test_plans_keep_a_shard_in_distinct_zones_as_the_sites_report_them() -> None:
    """The zones the sites report reach the planner: the first placement and a plan
    to new sites put the two replicas of each shard in different zones."""
    settings = replace(SETTINGS, replication_factor=2, expected_sites=4)
    zone = {"A": "x", "B": "x", "C": "y", "D": "y", "E": "x", "F": "y"}

    def zoned(names: str, placement: Placement | None = None) -> dict[str, SiteState]:
        return sites_of(*(replace(site(name, 100.0, placement), zone=zone[name])
                          for name in names))

    def zones_apart(placement: Placement) -> bool:
        return all(sorted(zone[site] for site in shard.replicas) == ["x", "y"]
                   for shard in placement.shards)

    state = decisions.decide(ClusterState(), zoned("ABCD"), 100.0, started=0.0,
                             settings=settings).state
    assert zones_apart(state.placement)
    goals = {DB: tuple("ABCDEF")}
    assert zones_apart(decisions.plan_goals(state.placement, goals,
                                            zoned("ABCDEF", state.placement),
                                            settings).target)
    # Sites that report no zone are planned as before.
    unzoned = sites_of(*(site(name, 100.0, state.placement) for name in "ABCDEF"))
    before = decisions.plan_goals(state.placement, goals, unzoned, settings)
    assert not zones_apart(before.target)


def test_zones_reported_after_the_placement_get_a_plan_that_moves_replicas_apart() -> None:
    settings = replace(SETTINGS, replication_factor=2, expected_sites=4)
    state = decisions.decide(ClusterState(), sites_of(*(site(name) for name in "ABCD")),
                             100.0, started=0.0, settings=settings).state
    zone = {"A": "x", "B": "x", "C": "y", "D": "y"}

    def zones_apart(placement: Placement) -> bool:
        return all(sorted(zone[site] for site in shard.replicas) == ["x", "y"]
                   for shard in placement.shards)

    assert not zones_apart(state.placement)
    # Without zones, and while a site of the goal is down, nothing is planned.
    unzoned = sites_of(*(site(name, 101.0, state.placement) for name in "ABCD"))
    assert decisions.decide(state, unzoned, 101.0, 0.0, settings).state.plan is None
    one_down = {**{name: replace(found, zone=zone[name]) for name, found in unzoned.items()},
                "D": replace(unzoned["D"], zone="y", last_seen=90.0)}
    assert decisions.decide(state, one_down, 101.0, 0.0, settings).state.plan is None
    zoned = {name: replace(found, zone=zone[name]) for name, found in unzoned.items()}
    decision = decisions.decide(state, zoned, 101.0, 0.0, settings)
    assert decision.state.plan is not None and "share zones: planned apart" in decision.notes[0]
    # Carried out round by round as any plan, to a placement that needs no other.
    for number in range(100):
        now = 102.0 + number
        zoned = {name: replace(site(name, now, decision.state.placement, committed=7,
                                    applied=7), zone=zone[name]) for name in "ABCD"}
        decision = decisions.decide(decision.state, zoned, now, 0.0, settings)
        if decision.state.plan is None:
            break
    assert decision.state.plan is None and zones_apart(decision.state.placement)


def test_first_placement_waits_a_little_for_expected_sites() -> None:
    settings = replace(SETTINGS, expected_sites=4)
    three = sites_of(site("A"), site("B"), site("C"))
    early = decisions.decide(ClusterState(), three, 5.0, started=0.0, settings=settings)
    assert early.state.placement.version == 0
    late = decisions.decide(ClusterState(), three, 10.0, started=0.0, settings=settings)
    assert late.state.placement.sites() == {"A", "B", "C"}


def test_no_first_placement_over_sites_that_hold_one() -> None:
    # A controller whose data folder was lost must not place shards anew (epoch 1)
    # over sites whose logs are at later epochs.
    old = one_shard("ABC", leader="A", epoch=4, version=9)
    sites = sites_of(site("A", placement=old), site("B"), site("C"))
    decision = decisions.decide(ClusterState(), sites, 100.0, started=0.0, settings=SETTINGS)
    assert decision.state == ClusterState()
    assert "waiting to adopt the newest they hold" in decision.notes[0]
    # what the controller does once it has fetched the sites' placements
    adopted = decisions.adopt(ClusterState(), {"A": old})
    assert adopted.state.placement == old
    assert adopted.state.goals == {DB: ("A", "B", "C")}


def test_no_first_placement_when_the_sites_have_other_shard_counts() -> None:
    sites = sites_of(site("A"), site("B"), site("C", n_shards=8))
    decision = decisions.decide(ClusterState(), sites, 100.0, started=0.0, settings=SETTINGS)
    assert decision.state == ClusterState()
    assert "C has 8 shards of messages" in decision.notes[0]


def test_sites_that_never_answered_do_not_count() -> None:
    sites = sites_of(site("A"), site("B"), site("C", answered=False))
    decision = decisions.decide(ClusterState(), sites, 100.0, started=0.0, settings=SETTINGS)
    assert decision.state.placement.version == 0


# --- failover ---------------------------------------------------------------------------

def test_failover_picks_the_highest_position_among_the_alive_majority() -> None:
    placement = one_shard("ABC", leader="A", epoch=2)
    state = ClusterState(placement=placement, goals={DB: ("A", "B", "C")})
    settings = replace(SETTINGS, n_shards=1)
    sites = sites_of(site("A", now=90.0, placement=placement),
                     site("B", placement=placement, positions={0: (2, 10)}),
                     site("C", placement=placement, positions={0: (2, 12)}))
    decision = decisions.decide(state, sites, 100.0, started=0.0, settings=settings)
    shard = decision.state.placement.shard(DB, 0)
    assert (shard.leader, shard.epoch) == ("C", 3)
    assert decision.state.placement.version == placement.version + 1
    assert shard.replicas == ("A", "B", "C")  # the gone site stays a replica


def test_a_higher_epoch_beats_a_longer_log() -> None:
    placement = one_shard("ABC", leader="A", epoch=3)
    settings = replace(SETTINGS, n_shards=1)
    sites = sites_of(site("A", now=0.0, placement=placement),
                     site("B", placement=placement, positions={0: (3, 4)}),
                     site("C", placement=placement, positions={0: (2, 50)}))
    notes: list[str] = []
    after = decisions.failovers(placement, sites, 100.0, settings, notes)
    assert after.shard(DB, 0).leader == "B"
    assert after.shard(DB, 0).epoch == 4


def test_no_failover_without_a_majority() -> None:
    placement = one_shard("ABC", leader="A")
    state = ClusterState(placement=placement, goals={DB: ("A", "B", "C")})
    sites = sites_of(site("A", now=0.0, placement=placement),
                     site("B", now=0.0, placement=placement),
                     site("C", placement=placement))
    decision = decisions.decide(state, sites, 100.0, started=0.0,
                                settings=replace(SETTINGS, n_shards=1))
    assert decision.state == state
    assert any("a new leader needs 2" in note for note in decision.notes)


def test_a_failover_epoch_is_above_every_epoch_a_site_reports() -> None:
    # The controller's placement says epoch 2, but B has seen epoch 5 (a placement
    # the controller does not know): the new leader must not reuse an epoch.
    placement = one_shard("ABC", leader="A", epoch=2)
    settings = replace(SETTINGS, n_shards=1)
    b = site("B", placement=placement, positions={0: (3, 10)})
    b = replace(b, shards={(DB, 0): replace(b.shards[(DB, 0)], epoch=5)})
    sites = sites_of(site("A", now=0.0, placement=placement), b,
                     site("C", placement=placement, positions={0: (3, 10)}))
    assert decisions.reported_epoch(sites, (DB, 0)) == 5
    after = decisions.failovers(placement, sites, 100.0, settings, [])
    assert after.shard(DB, 0).epoch == 6
    stopping = sites_of(replace(site("A", placement=placement), stopping=True), b,
                        site("C", placement=placement, positions={0: (3, 10)}))
    handed = decisions.handovers(placement, stopping, 100.0, settings, [])
    assert handed.shard(DB, 0).leader != "A"
    assert handed.shard(DB, 0).epoch == 6


def test_only_positions_reported_in_this_round_count() -> None:
    placement = one_shard("ABC", leader="A")
    settings = replace(SETTINGS, n_shards=1)
    # B did not answer this round: its report (from 2s ago) may be behind its log.
    sites = sites_of(site("A", now=0.0, placement=placement),
                     site("B", now=98.0, placement=placement, positions={0: (1, 10)}),
                     site("C", placement=placement, positions={0: (1, 8)}))
    notes: list[str] = []
    assert decisions.failovers(placement, sites, 100.0, settings, notes) == placement
    assert notes and "a new leader needs 2" in notes[0]


def test_only_shards_led_by_the_gone_site_move() -> None:
    state = placed("ABCD")
    placement = state.placement
    sites = sites_of(site("A", now=0.0, placement=placement),
                     *(site(name, placement=placement) for name in "BCD"))
    decision = decisions.decide(state, sites, 100.0, started=0.0, settings=SETTINGS)
    for before in placement.shards:
        after = decision.state.placement.shard(*before.id)
        if before.leader == "A":
            assert after.leader != "A" and after.epoch == before.epoch + 1
        else:
            assert after == before
    moved = sum(1 for shard in placement.shards if shard.leader == "A")
    assert moved > 0
    assert decision.state.placement.version == placement.version + moved


def test_a_stopping_leader_hands_its_shards_over_while_it_is_alive() -> None:
    state = placed("ABCD")
    placement = state.placement
    sites = sites_of(replace(site("A", placement=placement), stopping=True),
                     *(site(name, placement=placement) for name in "BCD"))
    decision = decisions.decide(state, sites, 100.0, started=0.0, settings=SETTINGS)
    moved = [shard for shard in placement.shards if shard.leader == "A"]
    assert moved
    for before in placement.shards:
        after = decision.state.placement.shard(*before.id)
        if before.leader == "A":
            assert after.leader != "A" and after.epoch == before.epoch + 1
            assert after.replicas == before.replicas  # it stays a replica: only a stop
        else:
            assert after == before
    assert sum("is stopping;" in note for note in decision.notes) == len(moved)
    # the next round leaves it alone: it leads nothing any more
    again = sites_of(replace(site("A", now=101.0, placement=decision.state.placement),
                             stopping=True),
                     *(site(name, 101.0, decision.state.placement) for name in "BCD"))
    assert decisions.decide(decision.state, again, 101.0, started=0.0,
                            settings=SETTINGS).state.placement == decision.state.placement


def test_a_round_tells_the_leaders_it_moved() -> None:
    """What the operator posts an Event for (issue 23): each failover and handover,
    with the old and new leader and the new epoch; a plan step tells none."""
    state = placed("ABCD")
    placement = state.placement
    led_by_a = [shard for shard in placement.shards if shard.leader == "A"]
    assert led_by_a
    gone = sites_of(site("A", now=0.0, placement=placement),
                    *(site(name, placement=placement) for name in "BCD"))
    failed_over = decisions.decide(state, gone, 100.0, started=0.0, settings=SETTINGS)
    after = failed_over.state.placement
    assert failed_over.leader_moves == tuple(
        decisions.LeaderMove(shard.id, "A", after.shard(*shard.id).leader, shard.epoch + 1,
                             handover=False) for shard in led_by_a)
    stopping = sites_of(replace(site("A", placement=placement), stopping=True),
                        *(site(name, placement=placement) for name in "BCD"))
    handed = decisions.decide(state, stopping, 100.0, started=0.0, settings=SETTINGS)
    assert [move.handover for move in handed.leader_moves] == [True] * len(led_by_a)
    # The next round moves nobody.
    again = sites_of(*(site(name, 101.0, after) for name in "BCD"),
                     site("A", now=0.0, placement=after))
    assert decisions.decide(failed_over.state, again, 101.0, started=0.0,
                            settings=SETTINGS).leader_moves == ()


def test_a_stopping_leader_keeps_a_shard_without_another_majority() -> None:
    placement = one_shard("ABC", leader="A")
    settings = replace(SETTINGS, n_shards=1)
    sites = sites_of(replace(site("A", placement=placement), stopping=True),
                     site("B", now=0.0, placement=placement),  # gone
                     site("C", placement=placement))
    notes: list[str] = []
    assert decisions.handovers(placement, sites, 100.0, settings, notes) == placement
    assert notes and "is stopping and keeps it for now" in notes[0]


def test_a_stopping_site_is_no_successor() -> None:
    placement = one_shard("ABC", leader="A", epoch=2)
    settings = replace(SETTINGS, n_shards=1)
    # B has the longest log but is stopping; A is stopping too
    sites = sites_of(replace(site("A", placement=placement, positions={0: (2, 9)}),
                             stopping=True),
                     replace(site("B", placement=placement, positions={0: (2, 12)}),
                             stopping=True),
                     site("C", placement=placement, positions={0: (2, 10)}))
    notes: list[str] = []
    after = decisions.handovers(placement, sites, 100.0, settings, notes)
    assert after == placement  # C alone is no majority of A, B, C
    sites["B"] = replace(sites["B"], stopping=False)
    after = decisions.handovers(placement, sites, 100.0, settings, notes)
    assert (after.shard(DB, 0).leader, after.shard(DB, 0).epoch) == ("B", 3)


def lost(placement: Placement, leader: str, quorum_age: float | None,
         heartbeat_interval: float | None = None, **positions: tuple[int, int]
         ) -> dict[str, SiteState]:
    """Every replica of shard 0 answering this round; `leader` reports `quorum_age`."""
    states = []
    for name in placement.shard(DB, 0).replicas:
        state = site(name, placement=placement,
                     positions={0: positions[name]} if name in positions else None)
        if name == leader:
            report = replace(state.shards[(DB, 0)], quorum_age=quorum_age)
            state = replace(state, shards={(DB, 0): report},
                            heartbeat_interval=heartbeat_interval)
        states.append(state)
    return sites_of(*states)


def test_a_leader_that_hears_no_majority_fails_over_though_it_is_alive() -> None:
    placement = one_shard("ABC", leader="A", epoch=2)
    state = ClusterState(placement=placement, goals={DB: ("A", "B", "C")})
    settings = replace(SETTINGS, n_shards=1)
    # A holds the longest log (an uncommitted tail) but has heard from nobody for 3.5s
    sites = lost(placement, "A", 3.5, A=(2, 20), B=(2, 10), C=(2, 12))
    decision = decisions.decide(state, sites, 100.0, started=0.0, settings=settings)
    shard = decision.state.placement.shard(DB, 0)
    assert (shard.leader, shard.epoch) == ("C", 3)
    assert shard.replicas == ("A", "B", "C")
    assert any("A has heard from no majority of its replicas for 3.5s" in note
               for note in decision.notes), decision.notes


def test_a_leader_within_its_allowance_keeps_the_shard() -> None:
    placement = one_shard("ABC", leader="A")
    settings = replace(SETTINGS, n_shards=1)
    for age in (None, 0.0, 2.9, 3.0):  # gone_after: 3 heartbeats of 1s
        notes: list[str] = []
        assert decisions.failovers(placement, lost(placement, "A", age), 100.0, settings,
                                   notes) == placement, age
        assert notes == []
    # A site that heartbeats its followers every 2s is allowed three of those
    slow = lost(placement, "A", 5.9, heartbeat_interval=2.0)
    assert decisions.failovers(placement, slow, 100.0, settings, []) == placement
    slower = lost(placement, "A", 6.1, heartbeat_interval=2.0)
    assert decisions.failovers(placement, slower, 100.0, settings, []).shard(DB, 0).leader \
        != "A"


def test_a_lost_quorum_reported_at_an_older_epoch_is_not_acted_on() -> None:
    placement = one_shard("ABC", leader="A", epoch=3)
    settings = replace(SETTINGS, n_shards=1)
    sites = lost(placement, "A", 9.0)
    stale = replace(sites["A"].shards[(DB, 0)], epoch=2)  # from before it took epoch 3
    sites["A"] = replace(sites["A"], shards={(DB, 0): stale})
    assert decisions.failovers(placement, sites, 100.0, settings, []) == placement


def test_a_lost_leader_keeps_the_shard_without_another_majority() -> None:
    placement = one_shard("ABC", leader="A")
    settings = replace(SETTINGS, n_shards=1)
    sites = lost(placement, "A", 9.0)
    sites["B"] = replace(sites["B"], last_seen=0.0)  # gone
    notes: list[str] = []
    assert decisions.failovers(placement, sites, 100.0, settings, notes) == placement
    assert len(notes) == 1 and "heard from no majority" in notes[0] \
        and "a new leader needs 2" in notes[0], notes


# --- plans ------------------------------------------------------------------------------

def run_plan(state: ClusterState, names: str, settings: Settings = SETTINGS,
             rounds: int = 200) -> tuple[ClusterState, list[Placement]]:
    """Rounds of `decide` with every site up and each replica applying everything
    once it has the placement, until the plan is done; the placements passed."""
    seen = [state.placement]
    for number in range(rounds):
        now = 100.0 + number
        sites = sites_of(*(site(name, now, state.placement, committed=7, applied=7)
                           for name in names))
        state = decisions.decide(state, sites, now, started=0.0, settings=settings).state
        if state.placement != seen[-1]:
            seen.append(state.placement)
        if state.plan is None:
            return state, seen
    raise AssertionError("the plan did not finish")


def test_a_join_is_carried_out_step_by_step_never_below_the_replication_factor() -> None:
    state = placed("ABC")
    sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABCD"))
    state = decisions.join(state, DB, "D", sites, 100.0, SETTINGS)
    assert state.plan is not None and state.plan.transitions
    assert state.goals[DB] == ("A", "B", "C", "D")
    final, seen = run_plan(state, "ABCD")
    assert final.placement == state.plan.target
    for placement in seen:
        for shard in placement.shards:
            assert len(shard.replicas) >= SETTINGS.replication_factor
    assert {site for shard in final.placement.shards for site in shard.replicas} \
        == {"A", "B", "C", "D"}
    assert [p.version for p in seen] == list(range(1, 2 + len(state.plan.transitions)))


def test_the_next_step_waits_until_the_joined_replica_has_caught_up() -> None:
    state = placed("ABC")
    first = state.placement
    sites = sites_of(*(site(name, 100.0, first) for name in "ABCD"))
    state = decisions.join(state, DB, "D", sites, 100.0, SETTINGS)
    assert state.plan is not None
    step = state.plan.transitions[0]
    assert (step.action, step.site) == ("add", "D")
    state = decisions.decide(state, sites, 100.0, 0.0, SETTINGS).state
    added = state.placement
    assert added.version == first.version + 1
    assert [catch_up.site for catch_up in state.catch_ups] == ["D"]

    def round_with(applied_by_d: int, d_version: int) -> ClusterState:
        others = [site(name, 101.0, added, committed=40, applied=40) for name in "ABC"]
        joiner = replace(site("D", 101.0, added, committed=0, applied=applied_by_d),
                         placement_version=d_version)
        return decisions.decide(state, sites_of(*others, joiner), 101.0, 0.0, SETTINGS).state

    # D has not got the placement yet: no target, no step.
    waiting = round_with(applied_by_d=0, d_version=first.version)
    assert waiting.placement == added and waiting.catch_ups == state.catch_ups
    # D has it: the target is the leader's committed offset; not reached, no step.
    state = round_with(applied_by_d=39, d_version=added.version)
    assert state.placement == added
    assert [catch_up.target for catch_up in state.catch_ups] == [40]
    # Reached: the next step (a removal) goes.
    state = round_with(applied_by_d=40, d_version=added.version)
    assert state.placement.version == added.version + 1
    assert state.catch_ups == ()


def test_several_shards_move_at_once_up_to_max_concurrent_moves() -> None:
    """With `max_concurrent_moves` 3 a join takes the first steps of three shards in
    one round, each on a shard of its own, never more, never below the replication
    factor, and ends where the one-at-a-time plan ends, in fewer rounds."""
    one_at_a_time: dict[int, tuple[ClusterState, list[Placement]]] = {}
    for width in (1, 3):
        settings_ = replace(SETTINGS, max_concurrent_moves=width)
        state = placed("ABC")
        sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABCD"))
        state = decisions.join(state, DB, "D", sites, 100.0, settings_)
        one_at_a_time[width] = run_plan(state, "ABCD", settings_)
    (single, single_seen), (wide, wide_seen) = one_at_a_time[1], one_at_a_time[3]
    assert wide.placement.shards == single.placement.shards
    assert len(wide_seen) < len(single_seen)
    jumps = []
    for before, after in itertools.pairwise(wide_seen):
        changed = [shard.id for shard in after.shards if shard != before.shard(*shard.id)]
        jumps.append(after.version - before.version)
        # one step per shard changed in a round, each shard moved once a round
        assert len(changed) == after.version - before.version <= 3, (before, after)
        assert all(len(shard.replicas) >= 3 for shard in after.shards)
    assert max(jumps) == 3, jumps
    assert all(jump == 1 for jump in [after.version - before.version for before, after
                                      in itertools.pairwise(single_seen)])


def test_each_shard_waits_for_its_own_joiner_and_the_moves_stay_bounded() -> None:
    """Two shards joined at once: the removal on the shard whose joiner caught up goes;
    the other shard's waits for its own joiner; and while that one catches up, one more
    shard may start (two in flight), not two."""
    settings_ = replace(SETTINGS, max_concurrent_moves=2)
    state = placed("ABC")
    sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABCD"))
    state = decisions.join(state, DB, "D", sites, 100.0, settings_)
    assert state.plan is not None
    steps = state.plan.transitions
    # Waves of two: +D on two shards, then their removals, then the third shard.
    assert [(step.action, step.site) for step in steps[:2]] == [("add", "D")] * 2
    assert [step.action for step in steps[2:4]] == ["remove"] * 2
    first, second = steps[0].shard_id, steps[1].shard_id
    assert first != second and {steps[2].shard_id, steps[3].shard_id} == {first, second}
    state = decisions.decide(state, sites, 100.0, 0.0, settings_).state
    added = state.placement
    assert added.version == placed("ABC").placement.version + 2
    assert sorted(catch_up.shard for catch_up in state.catch_ups) == sorted([first, second])

    def round_with(applied: dict[ShardId, int], now: float) -> decisions.Decision:
        others = [site(name, now, state.placement, committed=40, applied=40)
                  for name in "ABC"]
        joiner = site("D", now, state.placement, committed=0)
        joiner = replace(joiner, shards={
            shard: replace(report, applied=applied.get(shard, 0))
            for shard, report in joiner.shards.items()})
        return decisions.decide(state, sites_of(*others, joiner), now, 0.0, settings_)

    # Neither has caught up: no step.
    decision = round_with({}, 101.0)
    state = decision.state
    assert state.placement == added
    assert sum(note.startswith("waiting: messages/") for note in decision.notes) == 2
    # The joiner of the second shard caught up: its removal is not at the head of
    # the plan (the first shard's is), so nothing goes.
    state = round_with({second: 40}, 102.0).state
    assert state.placement == added
    assert [catch_up.shard for catch_up in state.catch_ups] == [first]
    # The first one too: both removals go (two shards moved in the round).
    state = round_with({first: 40, second: 40}, 103.0).state
    assert state.placement.version == added.version + 2
    assert state.catch_ups == ()
    assert all(len(shard.replicas) == 3 for shard in state.placement.shards)


def test_a_restart_watches_every_replica_still_joining(tmp_path: Path) -> None:
    settings_ = replace(SETTINGS, max_concurrent_moves=2)
    state = placed("ABC")
    sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABCD"))
    state = decisions.join(state, DB, "D", sites, 100.0, settings_)
    state = decisions.decide(state, sites, 100.0, 0.0, settings_).state  # two +D
    assert len(state.catch_ups) == 2
    files = StateFiles(tmp_path)
    files.keep(FolderRecord(state, ()))
    loaded = StateFiles(tmp_path).load().state
    assert sorted(catch_up.shard for catch_up in loaded.catch_ups) \
        == sorted(catch_up.shard for catch_up in state.catch_ups)
    final, _ = run_plan(loaded, "ABCD", settings_)
    assert state.plan is not None and final.placement == state.plan.target


def test_a_failover_during_a_plan_plans_again_and_still_reaches_the_goal() -> None:
    state = placed("ABC")
    sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABCD"))
    state = decisions.join(state, DB, "D", sites, 100.0, SETTINGS)
    state = decisions.decide(state, sites, 100.0, 0.0, SETTINGS).state  # +D
    victim = next(shard.leader for shard in state.placement.shards)
    gone = sites_of(*(site(name, 0.0 if name == victim else 105.0, state.placement)
                      for name in "ABCD"))
    after = decisions.decide(state, gone, 105.0, 0.0, SETTINGS).state
    assert all(shard.leader != victim for shard in after.placement.shards)
    assert after.plan is not None
    after.plan.remaining(after.placement)  # the new plan starts where the sites are
    final, _ = run_plan(after, "ABCD")
    assert {site for shard in final.placement.shards for site in shard.replicas} \
        == {"A", "B", "C", "D"}


def test_a_restart_resumes_the_plan_from_the_files(tmp_path: Path) -> None:
    state = placed("ABC")
    sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABCD"))
    state = decisions.join(state, DB, "D", sites, 100.0, SETTINGS)
    state = decisions.decide(state, sites, 100.0, 0.0, SETTINGS).state  # +D, catching up
    files = StateFiles(tmp_path)
    known = tuple(SiteAddress(id=name, admin_url=f"http://{name}", peer=f"{name}:1")
                  for name in "ABCD")
    files.keep(FolderRecord(state, known, frozenset({"E"}), ControllerTerm(3, "c0")))

    kept = StateFiles(tmp_path).load()
    loaded = kept.state
    assert kept.sites == known
    assert kept.forgotten == {"E"}
    assert kept.term == ControllerTerm(3, "c0")  # a restarted controller takes a higher one
    assert loaded.placement == state.placement
    assert loaded.plan == state.plan
    assert loaded.goals == state.goals
    # The replica that joined last is waited for again after the restart.
    assert [catch_up.site for catch_up in loaded.catch_ups] == ["D"]
    final, _ = run_plan(loaded, "ABCD")
    assert state.plan is not None
    assert final.placement == state.plan.target
    files.keep(FolderRecord(final, known))
    assert not (tmp_path / "plan.json").exists()
    again = StateFiles(tmp_path).load()
    assert again.forgotten == set() and again.term == NO_TERM
    assert again.state.plan is None and again.state.placement == final.placement


@pytest.mark.parametrize("left_out", ["sites", "goals", "forgotten", "term"])
def test_a_cluster_file_without_a_field_is_damaged(tmp_path: Path, left_out: str) -> None:
    StateFiles(tmp_path).keep(FolderRecord(placed("ABC"), (SiteAddress("A", "http://A", None),)))
    path = tmp_path / "cluster.json"
    document = json.loads(path.read_text())
    del document[left_out]
    path.write_text(json.dumps(document))
    with pytest.raises(CorruptDataError, match="damaged"):
        StateFiles(tmp_path).load()


# --- requests ---------------------------------------------------------------------------

def test_bad_requests_are_refused_and_change_nothing() -> None:
    state = placed("ABC")
    placement = state.placement
    sites = sites_of(*(site(name, 100.0, placement) for name in "ABC"),
                     site("E", now=0.0))
    cases: list[tuple[Callable[[], object], type[Exception]]] = [
        (lambda: decisions.set_replicas(state, DB, ["A", "B"], sites, 100.0, SETTINGS),
         NotEnoughSitesError),
        (lambda: decisions.set_replicas(state, DB, ["A", "B", "Z"], sites, 100.0, SETTINGS),
         UnknownSiteError),
        (lambda: decisions.leave(state, DB, "A", sites, 100.0, SETTINGS), NotEnoughSitesError),
        (lambda: decisions.join(state, DB, "E", sites, 100.0, SETTINGS), SiteStateError),
        (lambda: decisions.join(state, "nope", "A", sites, 100.0, SETTINGS),
         UnknownDatabaseError),
        (lambda: decisions.forget(state, "A", sites, 100.0, SETTINGS), SiteStateError),
        (lambda: decisions.forget(state, "Z", sites, 100.0, SETTINGS), UnknownSiteError),
        (lambda: decisions.join(ClusterState(), DB, "A", sites, 100.0, SETTINGS),
         ClusterNotReadyError),
    ]
    for request, error in cases:
        with pytest.raises(error):
            request()
    assert state.placement == placement and state.plan is None


def test_removing_the_last_replica_is_refused() -> None:
    settings = replace(SETTINGS, replication_factor=1, n_shards=2)
    one = sites_of(site("A", n_shards=2))
    state = decisions.decide(ClusterState(), one, 100.0, 0.0, replace(settings,
                                                                        expected_sites=1)).state
    assert state.placement.version == 1
    with pytest.raises(LastReplicaError):
        decisions.set_replicas(state, DB, [], one, 100.0, settings)


def test_a_down_site_holding_nothing_can_be_forgotten() -> None:
    state = placed("ABC")
    sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABC"),
                     site("E", now=0.0))
    state = replace(state, goals={DB: ("A", "B", "C", "E")})
    after = decisions.forget(state, "E", sites, 100.0, SETTINGS)
    assert after.goals == {DB: ("A", "B", "C")}
    assert after.placement == state.placement


def test_leaving_a_site_drains_it() -> None:
    state = placed("ABCD")
    sites = sites_of(*(site(name, 100.0, state.placement) for name in "ABCD"))
    state = decisions.leave(state, DB, "B", sites, 100.0, SETTINGS)
    final, seen = run_plan(state, "ABCD")
    assert "B" not in final.placement.sites()
    for placement in seen:
        for shard in placement.shards:
            assert len(shard.replicas) >= SETTINGS.replication_factor


def test_databases_not_placed_yet_are_placed_beside_the_kept_ones() -> None:
    """A placement of `messages` alone (one pushed by hand, which a controller
    adopts) keeps its shards; the key-value databases get theirs in the next
    version."""
    state = placed()
    every = replace(SETTINGS, databases=("messages", "sessions", "retained"))
    reports = {}
    for name in "ABC":
        kept = site(name, placement=state.placement)
        shards = {**kept.shards, **{(db, number): ShardReport("none", 0, (0, 0), 0, 0)
                                    for db in ("sessions", "retained")
                                    for number in range(4)}}
        reports[name] = replace(kept, shards=shards)
    decision = decisions.decide(state, reports, 100.0, started=0.0, settings=every)
    placement = decision.state.placement
    assert placement.version == state.placement.version + 1
    assert placement.shards_of(DB) == state.placement.shards_of(DB)
    for db in ("sessions", "retained"):
        assert [shard.shard for shard in placement.shards_of(db)] == [0, 1, 2, 3]
        assert all(len(shard.replicas) == 3 for shard in placement.shards_of(db))


# --- a controller behind the sites -----------------------------------------------------

def test_a_controller_behind_the_sites_adopts_their_newest_placement() -> None:
    """Restored from an older copy of its folder: the sites keep version 7 (B the
    leader), the controller version 5 and a plan made from it."""
    own = one_shard("ABC", leader="A", epoch=1, version=5)
    newer = one_shard("ABCD", leader="B", epoch=2, version=7)
    older = one_shard("ABC", leader="B", epoch=2, version=6)
    sites = sites_of(*(site(name, 100.0, own) for name in "ABCD"))
    state = decisions.set_replicas(ClusterState(placement=own), DB, ["A", "B", "D"], sites,
                                   100.0, replace(SETTINGS, n_shards=1))
    assert state.plan is not None  # +D, then -C
    reports = sites_of(site("A", placement=newer), site("B", placement=older))
    assert decisions.behind(state, reports)
    decision = decisions.adopt(state, {"A": newer, "B": older, "C": newer})
    assert decision.state.placement == newer
    assert decision.state.plan is None and decision.state.catch_ups == ()
    assert decision.state.goals == {DB: ("A", "B", "C", "D")}
    assert "version 7, on A, C" in decision.notes[0]
    assert "pending plan dropped" in decision.notes[1]
    assert not decisions.behind(decision.state, reports)
    # nothing to adopt: the controller's own is the newest, or what the sites keep
    assert decisions.adopt(decision.state, {"A": newer, "B": older}).state \
        == decision.state
    ahead = replace(decision.state, placement=one_shard("ABCD", "A", 3, version=8))
    assert decisions.adopt(ahead, {"A": newer}) == decisions.Decision(ahead)
    assert decisions.adopt(state, {}) == decisions.Decision(state)


def test_another_document_under_the_same_version_is_adopted_from_the_sites() -> None:
    """The controller failed over from a stale placement to version 6, which the
    sites refused: they keep another version 6; the one most of them keep wins."""
    own = one_shard("ABC", leader="C", epoch=2, version=6)
    theirs = one_shard("ABC", leader="B", epoch=2, version=6)
    odd = one_shard("ABC", leader="A", epoch=2, version=6)
    state = ClusterState(placement=own, goals={DB: ("A", "B", "C")})
    decision = decisions.adopt(state, {"A": theirs, "B": odd, "C": theirs})
    assert decision.state.placement == theirs


def test_a_second_controller_cannot_lock_the_same_folder(tmp_path: Path) -> None:
    first = FolderLock(tmp_path)
    with pytest.raises(FolderLockedError, match=f"pid {os.getpid()} holds"):
        FolderLock(tmp_path)
    first.release()
    FolderLock(tmp_path).release()


def test_the_placement_a_site_keeps_is_checked() -> None:
    kept = one_shard("ABC", leader="A")
    document = {"placement": json.loads(kept.to_json()), "peers": {}, "forgotten": ["E"]}
    assert parse_held(document) == (kept, frozenset({"E"}))
    assert parse_held({"placement": None, "peers": {}, "forgotten": []}) is None
    broken_documents: list[Any] = [
        [], {**document, "forgotten": "E"}, {**document, "forgotten": ["a b"]},
        {**document, "placement": {"version": 1}}]
    for broken in broken_documents:
        with pytest.raises(BadReportError):
            parse_held(broken)


# --- membership changes gated (issue 22, defect 1) ---------------------------------------

ONE_SHARD = replace(SETTINGS, n_shards=1)


def reports(placement: Placement, now: float, ends: dict[str, int],
            committed: dict[str, int], leader_version: int | None = None
            ) -> dict[str, SiteState]:
    """Every site of `ends` reporting shard 0 with its log ending at `ends[site]` (all
    in epoch 1) and knowing `committed[site]` committed; each holds `placement`,
    except the leader, which holds `leader_version` when given."""
    shard = placement.shard(DB, 0)
    found = {}
    for name, end in ends.items():
        version = placement.version
        if name == shard.leader and leader_version is not None:
            version = leader_version
        role = "leader" if name == shard.leader else "follower"
        found[name] = SiteState(
            id=name, admin_url=f"http://{name}", last_seen=now, answered=True,
            peer=f"{name}:1", placement_version=version,
            shards={(DB, 0): ShardReport(role, 1, (1, end), committed[name],
                                         committed[name])})
    return found


def shrinking(replicas: str = "ABCDE", leader: str = "E") -> ClusterState:
    """One shard on `replicas`, and a plan to bring it to replication factor 3."""
    placement = one_shard(replicas, leader, version=5)
    state = ClusterState(placement=placement, goals={DB: tuple(replicas)})
    ends = dict.fromkeys(replicas, 0)
    state = decisions.set_replicas(state, DB, replicas, reports(placement, 100.0, ends, ends),
                                   100.0, ONE_SHARD)
    assert state.plan is not None
    assert [(step.action, step.site) for step in state.plan.transitions] \
        == [("remove", "A"), ("remove", "B")]
    return state


def test_a_removal_waits_until_a_majority_of_what_it_leaves_holds_the_commits() -> None:
    """The reproduction of defect 1 in the pure core: the leader E committed 20 with A
    and B, which the plan removes; C and D lag at 2."""
    state = shrinking()
    ends = {"A": 20, "B": 20, "C": 2, "D": 2, "E": 20}
    sites = reports(state.placement, 101.0, ends, ends)
    decision = decisions.decide(state, sites, 101.0, 0.0, ONE_SHARD)
    assert decision.state.placement == state.placement
    assert any(note.startswith("waiting: messages/0: -A") and "hold offset 20" in note
               for note in decision.notes), decision.notes
    # C holds the entries in its log (same epoch, past 20) but does not know them
    # committed yet: that counts, as does D knowing 20 committed.
    sites = reports(state.placement, 102.0, {**ends, "C": 25, "D": 20}, {**ends, "C": 2})
    after = decisions.decide(state, sites, 102.0, 0.0, ONE_SHARD).state
    assert after.placement.version == state.placement.version + 1
    assert after.placement.shard(DB, 0).replicas == ("B", "C", "D", "E")


def test_the_next_removal_waits_until_the_leader_has_taken_the_last_one() -> None:
    state = shrinking()
    ends = dict.fromkeys("ABCDE", 20)
    state = decisions.decide(state, reports(state.placement, 101.0, ends, ends), 101.0, 0.0,
                             ONE_SHARD).state
    removed_a = state.placement
    assert removed_a.shard(DB, 0).replicas == ("B", "C", "D", "E")
    old = removed_a.version - 1
    sites = reports(removed_a, 102.0, ends, ends, leader_version=old)
    decision = decisions.decide(state, sites, 102.0, 0.0, ONE_SHARD)
    assert decision.state.placement == removed_a
    assert any("has not taken placement version" in note for note in decision.notes), \
        decision.notes
    sites = reports(removed_a, 103.0, ends, ends)
    final = decisions.decide(state, sites, 103.0, 0.0, ONE_SHARD).state
    assert final.placement.shard(DB, 0).replicas == ("C", "D", "E")


def test_an_add_replaces_a_replica_that_is_down() -> None:
    """An add asks no majority of the set it makes: B is down and lags, C is new."""
    placement = one_shard("ABD", "A", version=5)
    state = ClusterState(placement=placement, goals={DB: ("A", "B", "D")})
    ends = {"A": 20, "B": 3, "C": 0, "D": 20}
    sites = reports(placement, 100.0, ends, ends)
    state = decisions.set_replicas(state, DB, "ACD", sites, 100.0, ONE_SHARD)
    assert state.plan is not None
    assert [(s.action, s.site) for s in state.plan.transitions] == [("add", "C"),
                                                                    ("remove", "B")]
    sites["B"] = replace(sites["B"], last_seen=0.0)  # gone
    added = decisions.decide(state, sites, 100.0, 0.0, ONE_SHARD).state
    assert added.placement.shard(DB, 0).replicas == ("A", "B", "C", "D")
    caught_up = {**ends, "C": 20}
    sites = reports(added.placement, 101.0, caught_up, caught_up)
    sites["B"] = replace(sites["B"], last_seen=0.0)
    final = decisions.decide(added, sites, 101.0, 0.0, ONE_SHARD).state
    assert final.placement.shard(DB, 0).replicas == ("A", "C", "D")


def test_an_add_restores_the_majority_of_a_shard_whose_leader_is_gone() -> None:
    """Replication factor 2 and the leader A gone: {A, B} has no majority left to fail
    over to. The add of C must go though no leader reports anything (it gives the
    shard a majority, B and C, which the failover then uses); the removal of A after
    it waits for C to catch up with the new leader."""
    RF2 = replace(ONE_SHARD, replication_factor=2)
    placement = one_shard("AB", "A", version=5)
    state = ClusterState(placement=placement, goals={DB: ("A", "B")})
    ends = {"A": 20, "B": 20, "C": 0}
    sites = reports(placement, 100.0, ends, ends)
    state = decisions.set_replicas(state, DB, "BC", sites, 100.0, RF2)
    assert state.plan is not None
    sites["A"] = replace(sites["A"], last_seen=0.0)  # gone
    added = decisions.decide(state, sites, 100.0, 0.0, RF2)
    assert added.state.placement.shard(DB, 0).replicas == ("A", "B", "C"), added.notes
    sites = reports(added.state.placement, 101.0, ends, ends)
    sites["A"] = replace(sites["A"], last_seen=0.0)
    failed_over = decisions.decide(added.state, sites, 101.0, 0.0, RF2).state
    assert failed_over.placement.shard(DB, 0).leader == "B"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sets(st.sampled_from("ABCD")), st.booleans()),
                min_size=1, max_size=30))
@example([(3, {"A", "B"}, False), (0, set(), False)])  # defect 1: two removals in a row
def test_whatever_lags_every_committed_entry_stays_on_enough_replicas(
        rounds: list[tuple[int, set[str], bool]]) -> None:
    """A simulated shard on A..E led by E, shrunk to 3 replicas while E commits: each
    round E appends some entries, ships its log to some followers of the replica set
    it holds, commits what a majority of that set holds, and perhaps takes the
    controller's newest placement. After every round, any majority of the controller's
    replica set (what a failover chooses among) includes a replica holding everything
    E committed."""
    state = shrinking()
    taken = state.placement  # the placement E commits by
    ends = dict.fromkeys("ABCDE", 0)
    committed = dict.fromkeys("ABCDE", 0)
    for number, (appended, reached, takes) in enumerate(rounds):
        now = 101.0 + number
        ends["E"] += appended
        for name in reached & set(taken.shard(DB, 0).replicas):
            ends[name] = ends["E"]
        voters = sorted((ends[name] for name in taken.shard(DB, 0).replicas), reverse=True)
        committed["E"] = max(committed["E"], voters[len(voters) // 2])
        for name in reached & set(taken.shard(DB, 0).replicas):
            committed[name] = min(committed["E"], ends[name])
        if takes:
            taken = state.placement
        sites = reports(state.placement, now, ends, committed, leader_version=taken.version)
        state = decisions.decide(state, sites, now, 0.0, ONE_SHARD).state
        replicas = state.placement.shard(DB, 0).replicas
        holders = [name for name in replicas if ends[name] >= committed["E"]]
        # every majority meets the holders: more holders than non-majority seats
        assert len(holders) > len(replicas) - (len(replicas) // 2 + 1), \
            (replicas, ends, committed, taken.version)


def test_a_plan_step_that_hands_leadership_over_goes_above_every_epoch_reported() -> None:
    """A plan removes the leader A: the step names a successor at a new epoch. The
    controller's placement says epoch 1, but B has seen epoch 7 (a placement the
    controller does not know: one adopted from part of the sites, or another
    controller's). The step's epoch was the placement's plus one, an epoch in use:
    a second leader at one epoch, or a successor refused by every replica that saw
    the newer one, with no failover to follow (found by reading). Like a failover's,
    it goes above what the sites report."""
    placement = one_shard("ABCD", "A", version=5)
    ends = dict.fromkeys("ABCD", 20)
    state = decisions.set_replicas(ClusterState(placement=placement, goals={DB: tuple("ABCD")}),
                                   DB, "BCD", reports(placement, 100.0, ends, ends), 100.0,
                                   ONE_SHARD)
    assert state.plan is not None
    assert [(step.action, step.site) for step in state.plan.transitions] == [("remove", "A")]
    sites = reports(state.placement, 101.0, ends, ends)
    sites["B"] = replace(sites["B"], shards={
        (DB, 0): replace(sites["B"].shards[(DB, 0)], epoch=7)})
    after = decisions.decide(state, sites, 101.0, 0.0, ONE_SHARD).state
    shard = after.placement.shard(DB, 0)
    assert "A" not in shard.replicas and shard.leader != "A", after.placement
    assert shard.epoch == 8
    # the plan's own arithmetic said epoch 2: it is planned again, and ends
    ends = dict.fromkeys("BCD", 20)
    done = decisions.decide(after, reports(after.placement, 102.0, ends, ends), 102.0, 0.0,
                            ONE_SHARD).state
    assert done.plan is None and done.placement == after.placement


def test_a_joiner_that_died_before_it_caught_up_can_be_made_to_leave() -> None:
    """D joins and dies before it has caught up: its catch-up holds every step of
    every shard (max_concurrent_moves), which is right while D may come back. The
    operator makes D leave: the new plan's removal of D was held by D's own catch-up
    too, and only a controller restart cleared it (found by reading). A step that
    removes the joiner ends its catch-up, so it goes."""
    state = placed("ABC")
    first = state.placement
    sites = sites_of(*(site(name, 100.0, first) for name in "ABCD"))
    state = decisions.join(state, DB, "D", sites, 100.0, SETTINGS)
    state = decisions.decide(state, sites, 100.0, 0.0, SETTINGS).state
    added = state.placement
    assert [catch_up.site for catch_up in state.catch_ups] == ["D"]
    now = 200.0  # D answered last at 100: gone
    sites = sites_of(*(site(name, now, added, committed=40, applied=40) for name in "ABC"),
                     site("D", 100.0, added))
    state = decisions.decide(state, sites, now, 0.0, SETTINGS).state
    assert state.placement == added  # waiting on D, which may come back
    state = decisions.leave(state, DB, "D", sites, now, SETTINGS)
    final = state
    for _ in range(5):
        final = decisions.decide(final, sites, now, 0.0, SETTINGS).state
    assert not any("D" in shard.replicas for shard in final.placement.shards), \
        final.placement
    assert final.plan is None and final.catch_ups == ()
