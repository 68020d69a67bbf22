"""Properties of the replication planner over random clusters (hypothesis): plans
reach their target, never take a shard below the replication factor, end balanced,
move no more than they must, keep leaders where they are unless their site leaves,
and are deterministic."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from stratamq.broker.ds.replication import (
    Placement,
    Plan,
    PlannedSite,
    ShardPlacement,
    apply_transition,
    apply_transitions,
    failover,
    plan,
)
from stratamq.broker.ds.replication.waves import in_waves, moves_of
from stratamq.broker.errors import NoMajorityError

PROPERTIES = settings(max_examples=300, deadline=None)
SITE_NAMES = [f"site{n:02d}" for n in range(9)]
DATABASES = ["messages", "retained", "sessions"]


@st.composite
def clusters(draw: st.DrawFn, min_sites: int = 1) -> tuple[list[str], list[str], int, int]:
    """(site ids, databases, n_shards, replication_factor), always plannable."""
    n_sites = draw(st.integers(min_sites, len(SITE_NAMES)))
    site_ids = draw(st.permutations(SITE_NAMES).map(lambda names: names[:n_sites]))
    databases = draw(st.lists(st.sampled_from(DATABASES), min_size=1, max_size=3,
                              unique=True))
    n_shards = draw(st.integers(1, 12))
    factor = draw(st.integers(1, min(4, n_sites)))
    return site_ids, databases, n_shards, factor


@st.composite
def random_placements(draw: st.DrawFn) -> tuple[list[PlannedSite], list[str], int, int, Placement]:
    """A plannable request and a current placement that is anything valid: replica
    sets of any size on any of the sites, leaders and epochs anywhere; some sites
    draining. The request's replication factor need not be the placement's."""
    site_ids, databases, n_shards, factor = draw(clusters())
    shards = []
    for database in databases:
        for number in range(n_shards):
            replicas = draw(st.lists(st.sampled_from(site_ids), min_size=1,
                                     max_size=len(site_ids), unique=True))
            shards.append(ShardPlacement(database=database, shard=number,
                                         replicas=tuple(replicas),
                                         leader=draw(st.sampled_from(replicas)),
                                         epoch=draw(st.integers(1, 5))))
    n_draining = draw(st.integers(0, len(site_ids) - factor))
    draining = set(draw(st.permutations(site_ids))[:n_draining])
    sites = [PlannedSite(site, draining=site in draining) for site in site_ids]
    version = draw(st.integers(1, 100))
    return sites, databases, n_shards, factor, Placement(version=version, shards=tuple(shards))


def per_site(placement: Placement, database: str) -> Counter[str]:
    return Counter(site for shard in placement.shards_of(database) for site in shard.replicas)


def leaders(placement: Placement, database: str) -> Counter[str]:
    return Counter(shard.leader for shard in placement.shards_of(database))


def spread(counts: Counter[str], sites: list[str]) -> int:
    values = [counts[site] for site in sites]
    return max(values) - min(values)


def check_plan(result: Plan, sites: list[PlannedSite], databases: list[str], factor: int,
               balanced: bool = True) -> None:
    """What every plan must satisfy, whatever it started from (and, unless zones keep
    it from being `balanced`, an even spread of replicas)."""
    active = [site.id for site in sites if not site.draining]
    # The steps, applied in order, reach the target, one version each.
    assert apply_transitions(result.start, result.transitions) == result.target
    assert result.target.version == result.start.version + len(result.transitions)
    # No step takes a shard below the replication factor (or below what it had, for a
    # shard that starts short), and each move adds before it removes.
    placement = result.start
    for step in result.transitions:
        before = len(placement.shard(step.database, step.shard).replicas)
        placement = apply_transition(placement, step)
        if step.action == "remove":
            assert before > factor, step
    assert placement == result.target
    # A controller can keep the plan and tell from the sites' placement how far it is.
    assert Plan.from_json(result.to_json()) == result
    middle = len(result.transitions) // 2
    halfway = apply_transitions(result.start, result.transitions[:middle])
    assert result.remaining(halfway) == result.transitions[middle:]
    # The target is balanced: every shard has the replication factor on distinct
    # active sites, and active sites differ by at most one replica per database.
    for database in databases:
        shards = result.target.shards_of(database)
        assert all(len(shard.replicas) == factor for shard in shards)
        assert all(set(shard.replicas) <= set(active) for shard in shards)
        if balanced:
            assert spread(per_site(result.target, database), active) <= 1
    # A leader changes only when its site leaves the shard, with a new epoch.
    for shard in result.target:
        if shard.database not in databases:
            continue
        first = result.start.shard(shard.database, shard.shard)
        removed = {step.site for step in result.transitions
                   if step.shard_id == shard.id and step.action == "remove"}
        if shard.leader != first.leader:
            assert first.leader in removed
            assert shard.epoch > first.epoch
        handovers = sum(1 for step in result.transitions
                        if step.shard_id == shard.id and step.leader is not None)
        assert shard.epoch == first.epoch + handovers


@PROPERTIES
@given(clusters())
def test_first_placement_is_balanced_replicas_and_leaders(
        cluster: tuple[list[str], list[str], int, int]) -> None:
    site_ids, databases, n_shards, factor = cluster
    sites = [PlannedSite(site) for site in site_ids]
    result = plan(sites, databases, n_shards, factor)
    assert result.transitions == ()
    check_plan(result, sites, databases, factor)
    placement = result.target
    for database in databases:
        assert spread(leaders(placement, database), site_ids) <= 1
    overall = Counter(site for shard in placement for site in shard.replicas)
    assert spread(overall, site_ids) <= 1


@PROPERTIES
@given(random_placements())
def test_any_placement_plans_to_a_balanced_target_never_below_the_factor(
        request: tuple[list[PlannedSite], list[str], int, int, Placement]) -> None:
    sites, databases, n_shards, factor, current = request
    result = plan(sites, databases, n_shards, factor, current)
    assert result.start == current
    check_plan(result, sites, databases, factor)
    # The target needs no further step: planning again is a fixed point.
    again = plan(sites, databases, n_shards, factor, result.target)
    assert again.transitions == ()
    assert again.target == result.target


@PROPERTIES
@given(random_placements(), st.randoms(use_true_random=False))
def test_plans_are_deterministic_whatever_the_order_of_the_input(
        request: tuple[list[PlannedSite], list[str], int, int, Placement],
        shuffler: st.SearchStrategy[object]) -> None:
    sites, databases, n_shards, factor, current = request
    first = plan(sites, databases, n_shards, factor, current)
    shuffled_sites, shuffled_databases = list(sites), list(databases)
    shuffler.shuffle(shuffled_sites)  # type: ignore[attr-defined]
    shuffler.shuffle(shuffled_databases)  # type: ignore[attr-defined]
    assert plan(shuffled_sites, shuffled_databases, n_shards, factor, current) == first
    assert plan(sites, databases, n_shards, factor, current) == first


@PROPERTIES
@given(clusters(), st.integers(1, 3))
def test_adding_sites_moves_only_their_share(
        cluster: tuple[list[str], list[str], int, int], added: int) -> None:
    site_ids, databases, n_shards, factor = cluster
    site_ids = site_ids[:max(factor, len(site_ids) - added)]
    new = [site for site in SITE_NAMES if site not in site_ids][:added]
    first = plan([PlannedSite(site) for site in site_ids], databases, n_shards, factor).target
    sites = [PlannedSite(site) for site in site_ids + new]
    result = plan(sites, databases, n_shards, factor, first)
    check_plan(result, sites, databases, factor)
    total = n_shards * factor
    for database in databases:
        steps = [step for step in result.transitions if step.database == database]
        # Only the new sites receive, and they receive no more than their share.
        assert {step.site for step in steps if step.action == "add"} <= set(new)
        moved = sum(1 for step in steps if step.action == "remove")
        assert moved == sum(per_site(result.target, database)[site] for site in new)
        assert moved <= added * math.ceil(total / len(sites))


@PROPERTIES
@given(clusters(min_sites=2), st.data())
def test_draining_a_site_moves_each_of_its_replicas_once(
        cluster: tuple[list[str], list[str], int, int], data: st.DataObject) -> None:
    site_ids, databases, n_shards, factor = cluster
    if factor == len(site_ids):
        factor -= 1
    first = plan([PlannedSite(site) for site in site_ids], databases, n_shards, factor).target
    leaving = data.draw(st.sampled_from(site_ids))
    sites = [PlannedSite(site, draining=site == leaving) for site in site_ids]
    result = plan(sites, databases, n_shards, factor, first)
    check_plan(result, sites, databases, factor)
    for database in databases:
        removals = [step for step in result.transitions
                    if step.database == database and step.action == "remove"]
        leaving_removals = sum(1 for step in removals if step.site == leaving)
        assert leaving_removals == per_site(first, database)[leaving]
        assert len(removals) <= 2 * leaving_removals


@PROPERTIES
@given(clusters(), st.integers(1, 3), st.booleans())
def test_leaders_stay_spread_when_sites_come_and_go(
        cluster: tuple[list[str], list[str], int, int], added: int, drain: bool) -> None:
    """Leaders only change where a leader's site leaves, so a new site leads only the
    shards it takes over a leader of, and leaders cannot always be within one of
    each other; moves choose those handovers so that they stay within two."""
    site_ids, databases, n_shards, factor = cluster
    if drain and factor < len(site_ids):
        first = plan([PlannedSite(site) for site in site_ids], databases, n_shards, factor).target
        sites = [PlannedSite(site, draining=site == site_ids[0]) for site in site_ids]
    else:
        site_ids = site_ids[:max(factor, len(site_ids) - added)]
        first = plan([PlannedSite(site) for site in site_ids], databases, n_shards, factor).target
        site_ids += [site for site in SITE_NAMES if site not in site_ids][:added]
        sites = [PlannedSite(site) for site in site_ids]
    result = plan(sites, databases, n_shards, factor, first)
    active = [site.id for site in sites if not site.draining]
    for database in databases:
        assert spread(leaders(result.target, database), active) <= 2


@PROPERTIES
@given(clusters(), st.integers(1, 4))
def test_changing_the_replication_factor_adds_or_removes_the_difference(
        cluster: tuple[list[str], list[str], int, int], new_factor: int) -> None:
    site_ids, databases, n_shards, factor = cluster
    new_factor = min(new_factor, len(site_ids))
    sites = [PlannedSite(site) for site in site_ids]
    first = plan(sites, databases, n_shards, factor).target
    result = plan(sites, databases, n_shards, new_factor, first)
    check_plan(result, sites, databases, new_factor)
    for database in databases:
        actions = Counter(step.action for step in result.transitions
                          if step.database == database)
        change = n_shards * (new_factor - factor)
        assert actions["add"] - actions["remove"] == change
        # Mostly only the difference is added or removed, but a move can be forced:
        # 3 shards x 4 replicas on 8 sites lowered to 3 replicas must take one from a
        # shard on sites 4-7, each of which holds one replica and must keep one.
        assert min(actions["add"], actions["remove"]) <= 1


@PROPERTIES
@given(random_placements(), st.data())
def test_failover_chooses_the_furthest_of_a_majority(
        request: tuple[list[PlannedSite], list[str], int, int, Placement],
        data: st.DataObject) -> None:
    current = request[4]
    shard = data.draw(st.sampled_from(current.shards))
    alive = set(data.draw(st.lists(st.sampled_from(sorted(shard.replicas)), unique=True)))
    positions = {site: (data.draw(st.integers(0, 6)), data.draw(st.integers(0, 3)))
                 for site in data.draw(st.lists(st.sampled_from(sorted(shard.replicas)),
                                                unique=True))}
    voters = alive & positions.keys()
    if len(voters) * 2 <= len(shard.replicas):
        try:
            failover(current, shard.id, alive, positions)
        except NoMajorityError:
            return
        raise AssertionError("no majority, yet a leader was chosen")
    after = failover(current, shard.id, alive, positions)
    chosen = after.shard(*shard.id)
    assert chosen.leader in voters
    assert positions[chosen.leader] == max(positions[site] for site in voters)
    assert chosen.epoch > max(shard.epoch, *(positions[site][0] for site in voters))
    assert chosen.replicas == shard.replicas
    assert after.version == current.version + 1
    assert [s for s in after if s.id != shard.id] == [s for s in current if s.id != shard.id]


# --- zones -------------------------------------------------------------------------------

ZONE_NAMES = ["zone-a", "zone-b", "zone-c", "zone-d"]


def zone_cap(sites: list[PlannedSite], factor: int) -> tuple[int, Counter[str]]:
    """The zone rule's cap for these sites, and each active site's zone as the rule
    counts it (a site with no zone is a zone of its own)."""
    zones = Counter(site.zone or f"own:{site.id}" for site in sites if not site.draining)
    return math.ceil(factor / len(zones)), zones


def zone_rule_can_be_met(sites: list[PlannedSite], factor: int) -> bool:
    cap, zones = zone_cap(sites, factor)
    return sum(min(size, cap) for size in zones.values()) >= factor


def meets_zone_rule(placement: Placement, sites: list[PlannedSite], databases: list[str],
                    factor: int) -> bool:
    cap, _ = zone_cap(sites, factor)
    zone_of = {site.id: site.zone or f"own:{site.id}" for site in sites}
    return all(max(Counter(zone_of[site] for site in shard.replicas).values()) <= cap
               for database in databases for shard in placement.shards_of(database))


@st.composite
def zoned(draw: st.DrawFn, request: tuple[list[PlannedSite], list[str], int, int, Placement],
          unknown: bool = True) -> tuple[list[PlannedSite], list[str], int, int, Placement]:
    """The request with each site in one of a few zones, or (if `unknown`) in none."""
    sites, databases, n_shards, factor, current = request
    n_zones = draw(st.integers(1 if unknown else 2, len(ZONE_NAMES)))
    zones = st.sampled_from([*([None] if unknown else []), *ZONE_NAMES[:n_zones]])
    return ([PlannedSite(site.id, draining=site.draining, zone=draw(zones)) for site in sites],
            databases, n_shards, factor, current)


@PROPERTIES
@given(random_placements().flatmap(zoned), st.booleans())
def test_with_zones_every_target_meets_the_zone_rule_when_it_can_be_met(
        request: tuple[list[PlannedSite], list[str], int, int, Placement], first: bool) -> None:
    """From any placement (or none: a first placement), the plan keeps every rule of
    a plan but balance, which zones may forbid; its target has at most the cap of a
    shard's replicas in one zone whenever that can be met, and is a fixed point."""
    sites, databases, n_shards, factor, current = request
    result = plan(sites, databases, n_shards, factor, None if first else current)
    check_plan(result, sites, databases, factor, balanced=False)
    if zone_rule_can_be_met(sites, factor):
        assert meets_zone_rule(result.target, sites, databases, factor)
    again = plan(sites, databases, n_shards, factor, result.target)
    assert again.transitions == ()
    assert again.target == result.target


@PROPERTIES
@given(random_placements(), st.data())
def test_zones_that_ask_nothing_change_no_plan(
        request: tuple[list[PlannedSite], list[str], int, int, Placement],
        data: st.DataObject) -> None:
    """Sites with no zone, each in a zone of its own, or in zones no bigger than the
    cap (so the rule holds of any placement) get the plans they get without zones."""
    sites, databases, n_shards, factor, current = request
    without = plan(sites, databases, n_shards, factor, current)
    cap, _ = zone_cap(sites, factor)  # fewer zones than sites only raise it
    active = [site.id for site in sites if not site.draining]
    kind = data.draw(st.sampled_from(["none", "own", "cap"]))
    zone = {site.id: None if kind == "none" else site.id for site in sites}
    if kind == "cap":
        # Active sites dealt over as many zones as they need, `cap` at most in each,
        # the draining ones anywhere.
        n_zones = math.ceil(len(active) / cap)
        zone = {site: f"zone-{position % n_zones}" for position, site in enumerate(active)}
        zone.update((site.id, data.draw(st.sampled_from(ZONE_NAMES)))
                    for site in sites if site.draining)
    with_zones = [PlannedSite(site.id, draining=site.draining, zone=zone[site.id])
                  for site in sites]
    assert plan(with_zones, databases, n_shards, factor, current) == without


@PROPERTIES
@given(clusters(min_sites=2), st.data())
def test_zones_of_equal_size_keep_the_placement_balanced(
        cluster: tuple[list[str], list[str], int, int], data: st.DataObject) -> None:
    """Sites dealt evenly over zones: first placements and the plans after adding a
    zone's worth of sites or draining one meet the zone rule and stay balanced."""
    site_ids, databases, n_shards, factor = cluster
    n_zones = data.draw(st.integers(2, min(4, len(site_ids))))
    site_ids = site_ids[:len(site_ids) - len(site_ids) % n_zones]
    factor = min(factor, len(site_ids))
    sites = [PlannedSite(site, zone=ZONE_NAMES[position % n_zones])
             for position, site in enumerate(site_ids)]
    first = plan(sites, databases, n_shards, factor)
    check_plan(first, sites, databases, factor)
    assert meets_zone_rule(first.target, sites, databases, factor)
    change = data.draw(st.sampled_from(["add", "drain"]))
    if change == "add":
        extra = [site for site in SITE_NAMES if site not in site_ids][:n_zones]
        if len(extra) < n_zones:
            return
        sites += [PlannedSite(site, zone=ZONE_NAMES[position])
                  for position, site in enumerate(extra)]
    else:
        if len(site_ids) - n_zones < max(factor, n_zones):
            return
        leaving = set(site_ids[-n_zones:])
        sites = [replace(site, draining=site.id in leaving) for site in sites]
    result = plan(sites, databases, n_shards, factor, first.target)
    check_plan(result, sites, databases, factor)
    assert meets_zone_rule(result.target, sites, databases, factor)


def balance_fits_zones(sites: list[PlannedSite], factor: int, n_shards: int) -> bool:
    """Whether each zone's share of a balanced placement (its sites' part of every
    replica) lies between the fewest replicas of each shard the zone must hold (what
    the other zones cannot) and the most it may (the cap, or its number of sites)."""
    cap, zones = zone_cap(sites, factor)
    n_active = sum(zones.values())
    for zone, size in zones.items():
        most = min(cap, size)
        fewest = factor - sum(min(cap, other) for name, other in zones.items() if name != zone)
        share = size * n_shards * factor / n_active
        if not n_shards * max(0, fewest) <= share <= n_shards * most:
            return False
    return True


@PROPERTIES
@given(random_placements().flatmap(lambda request: zoned(request, unknown=False)),
       st.booleans())
def test_with_zones_the_target_is_balanced_where_the_zones_leave_room(
        request: tuple[list[PlannedSite], list[str], int, int, Placement], first: bool) -> None:
    sites, databases, n_shards, factor, current = request
    room = zone_rule_can_be_met(sites, factor) and balance_fits_zones(sites, factor, n_shards)
    cap, zones = zone_cap(sites, factor)
    event(f"room for balance: {room}, zones with more sites than the cap: "
          f"{max(zones.values()) > cap}")
    if not room:
        return
    result = plan(sites, databases, n_shards, factor, None if first else current)
    check_plan(result, sites, databases, factor)
    assert meets_zone_rule(result.target, sites, databases, factor)


@PROPERTIES
@given(random_placements(), st.integers(1, 6))
def test_plans_laid_out_in_waves_keep_every_rule_and_reach_the_same_target(
        request: tuple[list[PlannedSite], list[str], int, int, Placement], width: int) -> None:
    """`in_waves` (several shards moving at once) reorders a plan's steps only across
    shards: the same steps, each shard's in its order, the same target, every rule of
    a plan kept; its head holds the first steps of up to `width` distinct shards."""
    sites, databases, n_shards, factor, current = request
    result = plan(sites, databases, n_shards, factor, current)
    steps = in_waves(result.transitions, width)
    assert Counter(steps) == Counter(result.transitions)
    for shard in {step.shard_id for step in steps}:
        assert [step for step in steps if step.shard_id == shard] \
            == [step for step in result.transitions if step.shard_id == shard]
    check_plan(Plan(start=result.start, target=result.target, transitions=steps),
               sites, databases, factor)
    if width == 1:
        assert steps == result.transitions
    leading: list[tuple[str, int]] = []
    for move in moves_of(result.transitions):
        if len(leading) == width or move[0].shard_id in leading:
            break
        leading.append(move[0].shard_id)
    assert [step.shard_id for step in steps[:len(leading)]] == leading
    event(f"{len(leading)} shards at once")
