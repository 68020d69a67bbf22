"""The replication planner: pure functions from (sites, databases, current placement)
to a target placement and the ordered steps that reach it, and the choice of a new
leader when one is lost (docs/replication.md). No I/O: the local cluster
supervisor and the Kubernetes operator both call it and execute its answer.

Planning, per database:

- Shards with too few replicas get them first (redundancy before balance), from the
  emptiest sites; shards with too many give them up, from draining sites and then
  the fullest ones. Both keep every site within the balanced counts (floor or
  ceiling of `n_shards * replication_factor / sites`) as far as the shards allow,
  using augmenting paths, so that an early choice never forces a later move.
- Then each site that is not draining gets a quota, the quotas differing by at most
  1; the sites that hold the most get the larger ones (fewer moves), ties going to
  the sites holding the fewest replicas of the other databases (so the cluster stays
  balanced as a whole). Draining sites get 0. Replicas move one at a time from a
  site over its quota to one under it: `+to` immediately followed by `-from`, so no
  step takes a shard below the replication factor. Draining sites' replicas are
  matched to sites under quota all at once (augmenting paths again). A site that is
  not draining always has a shard to give to any site under quota, so the moves are
  the sites' surplus and no more; only a draining site's replica that no site under
  quota can take needs a detour (see `_DatabasePlanner.next_move`).
- A leader changes only when its site leaves the shard; the successor is one of the
  remaining replicas. Moves prefer to carry leaderships away from sites that lead
  more than their share, and at the end the successors are chosen again to spread
  leaders as evenly as those handovers allow. Leaders are not moved just to even
  the spread: a handover interrupts writes to the shard.

- Zones (`zones.ZoneRule`): where sites carry zones and the balanced plan would leave
  more of a shard's replicas in one zone than the rule allows, the database is
  planned again by `_ZonedPlanner`, the zone rule first and balance as far as the
  rule allows. Where the rule holds of any placement (no zones known, or none with
  more sites than the cap) or of none (too few zones), plans are the ones without
  zones.

Sites are compared by id wherever a choice is otherwise even, so the same input
always gives the same plan.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ...errors import (
    LastReplicaError,
    NoMajorityError,
    NotEnoughSitesError,
    PlacementError,
    PlanError,
    UnknownSiteError,
)
from .placement import (
    FORMAT,
    Placement,
    ShardId,
    ShardPlacement,
    Transition,
    apply_transitions,
    check_database,
    check_site_id,
)
from .zones import ZoneKey, ZoneRule

# Epoch of a shard's first leader; log entries carry epochs >= 1, so (0, 0) is the
# position of a replica with an empty log.
FIRST_EPOCH = 1


@dataclass(frozen=True)
class PlannedSite:
    """A site as the planner takes it: one it may place replicas on. A draining site
    gets no new replicas and loses the ones it has (it is about to leave the cluster
    or the database). `zone`: the failure zone the site runs in (its node's
    `topology.kubernetes.io/zone`), None when not known; the planner keeps a shard's
    replicas in distinct zones as far as the zones allow (`zones.ZoneRule`)."""

    id: str
    draining: bool = False
    zone: str | None = None

    def __post_init__(self) -> None:
        check_site_id(self.id)


@dataclass(frozen=True)
class Plan:
    """`transitions` applied in order to `start` give `target` (`apply_transitions`).
    `start` is the current placement, plus an initial placement for any database it
    did not have yet (one version newer then); it is what the sites must be given
    before the first step."""

    start: Placement
    target: Placement
    transitions: tuple[Transition, ...]

    def describe(self) -> list[str]:
        """The steps as people read them: `messages/3: +B`, `messages/3: -A (leader -> C)`."""
        return [str(transition) for transition in self.transitions]

    def remaining(self, placement: Placement) -> tuple[Transition, ...]:
        """The steps still to do when the sites have `placement`: each step gives the
        placement one more version, so its version says how far the plan has come. A
        placement that is not one the plan passes through (a failover changed it)
        raises `PlanError`: plan again from it."""
        done = placement.version - self.start.version
        if (0 <= done <= len(self.transitions)
                and apply_transitions(self.start, self.transitions[:done]) == placement):
            return self.transitions[done:]
        raise PlanError(f"placement version {placement.version} is not a step of the plan "
                        f"from version {self.start.version} to {self.target.version}; "
                        f"plan again from it")

    def to_json(self) -> str:
        """The plan as a controller keeps it, to go on after a restart: the start
        placement and the steps, one line each (the target follows from them)."""
        start = self.start.to_json().rstrip("\n").replace("\n", "\n  ")
        steps = ",\n".join(f"    {json.dumps(step.to_dict())}" for step in self.transitions)
        return (f'{{\n  "format": {FORMAT},\n  "start": {start},\n  "transitions": ['
                + (f"\n{steps}\n  ]" if steps else "]") + "\n}\n")

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """Parse and check a kept plan: its steps must apply to its start, in order."""
        try:
            document = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PlacementError(f"plan: not JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise PlacementError(f"plan: expected an object, got {type(document).__name__}")
        if sorted(document) != ["format", "start", "transitions"]:
            raise PlacementError(f"plan: expected the keys format, start, transitions; got "
                                 f"{', '.join(sorted(document)) or 'none'}")
        if document["format"] != FORMAT or isinstance(document["format"], bool):
            raise PlacementError(f"plan: format {document['format']!r} is not {FORMAT}")
        start = Placement.from_dict(document["start"])
        steps = document["transitions"]
        if not isinstance(steps, list):
            raise PlacementError(f"plan: transitions: expected a list, got "
                                 f"{type(steps).__name__}")
        transitions = tuple(Transition.from_dict(step, f"plan: transitions[{number}]")
                            for number, step in enumerate(steps))
        return cls(start=start, target=apply_transitions(start, transitions),
                   transitions=transitions)


def plan(sites: Collection[PlannedSite], databases: Sequence[str], n_shards: int,
         replication_factor: int, current: Placement | None = None) -> Plan:
    """A balanced placement of `databases` (each with `n_shards` shards of
    `replication_factor` replicas) on `sites`, and the steps from `current` to it;
    where the sites' zones ask for it, a shard's replicas in distinct zones first and
    balance as far as that allows (`_ZonedPlanner`).

    Databases of `current` not named in `databases` are kept as they are (their
    replicas count when spreading load), so one database can be planned on its own
    set of sites. Raises `NotEnoughSitesError` when fewer sites than the replication
    factor may hold replicas, `LastReplicaError` when every site of a database is
    draining, `UnknownSiteError` when `current` places a replica of a planned
    database on a site not in `sites` (drain a site before leaving it out), and
    `PlanError` for other requests no plan can satisfy."""
    site_list = _check_sites(sites)
    names = _check_databases(databases)
    _check_positive(n_shards, "n_shards")
    _check_positive(replication_factor, "replication_factor")
    current = Placement.empty() if current is None else current
    known = {site.id for site in site_list}
    active = sorted(site.id for site in site_list if not site.draining)
    draining = frozenset(site.id for site in site_list if site.draining)
    for name in names:
        _check_database_fits(current, name, n_shards, known)
    if len(active) < replication_factor:
        planned = [shard for name in names for shard in current.shards_of(name)]
        if not active and planned:
            raise LastReplicaError(
                f"every site of {', '.join(names)} is draining ({', '.join(sorted(draining))})"
                f": that would remove the last replica of each shard")
        raise NotEnoughSitesError(
            f"replication factor {replication_factor} needs {replication_factor} sites "
            f"that may hold replicas; there are {len(active)}"
            + (f" ({len(draining)} more draining)" if draining else ""))

    # Load of the databases not (yet) planned, so that each database's ties go to the
    # sites that are emptiest over all.
    other_replicas: Counter[str] = Counter()
    other_leaders: Counter[str] = Counter()
    for shard in current.shards:
        if shard.database not in names:
            other_replicas.update(shard.replicas)
            other_leaders[shard.leader] += 1

    start_shards: list[ShardPlacement] = []
    target_shards: list[ShardPlacement] = []
    transitions: list[Transition] = []
    rule = ZoneRule.for_sites({site.id: site.zone for site in site_list}, active,
                              replication_factor)
    for name in names:
        existing = current.shards_of(name)
        if existing:
            planner = _DatabasePlanner(name, existing, active, draining, replication_factor,
                                       other_replicas, other_leaders)
            steps = planner.run()
            final = planner.result()
            if rule is not None and not _meets(rule, final):
                planner = _ZonedPlanner(name, existing, active, draining, replication_factor,
                                        other_replicas, other_leaders, rule=rule)
                steps = planner.run()
                final = planner.result()
            transitions.extend(steps)
        else:
            final = _initial(name, n_shards, replication_factor, active,
                             other_replicas, other_leaders)
            if rule is not None and not _meets(rule, final):
                final = _zoned_initial(final, active, draining, rule,
                                       other_replicas, other_leaders)
            start_shards.extend(final)
        target_shards.extend(final)
        for shard in final:
            other_replicas.update(shard.replicas)
            other_leaders[shard.leader] += 1

    start = current.replace_shards(start_shards) if start_shards else current
    target = _with_shards(start, target_shards, version=start.version + len(transitions))
    return Plan(start=start, target=target, transitions=tuple(transitions))


def breaks_zone_rule(sites: Collection[PlannedSite], placement: Placement, database: str,
                     replication_factor: int) -> bool:
    """Whether some shard of `database` has more replicas in one zone than the zone
    rule (`zones.ZoneRule`) allows on `sites`, where the rule can be met: a plan to
    the same sites then moves them apart. False where the rule asks nothing (no zones
    known, or too few), and where a replica is on a site not given (nothing to say)."""
    site_list = _check_sites(sites)
    active = [site.id for site in site_list if not site.draining]
    rule = ZoneRule.for_sites({site.id: site.zone for site in site_list}, active,
                              replication_factor)
    shards = placement.shards_of(database)
    if rule is None or not {site for shard in shards for site in shard.replicas} <= set(
            rule.zone_of):
        return False
    return not _meets(rule, shards)


def _with_shards(placement: Placement, shards: Sequence[ShardPlacement],
                version: int) -> Placement:
    by_id = {shard.id: shard for shard in placement.shards}
    by_id.update((shard.id, shard) for shard in shards)
    return Placement(version=version, shards=tuple(by_id.values()))


def failover(placement: Placement, shard: ShardId, alive_sites: Collection[str],
             positions: Mapping[str, tuple[int, int]], above: int = 0) -> Placement:
    """The placement, one version newer, with a new leader for `shard` and its epoch
    bumped past every epoch seen: the alive replica whose log ends at the highest
    (epoch, offset). `positions` are the replicas' log ends as they report them;
    only replicas that are alive and reported count, and they must be a majority of
    the replica set, since only a majority is sure to hold every committed batch
    (`NoMajorityError` otherwise). Ties go to the current leader, then to the replica
    that leads the fewest shards, then by site id.

    The epoch is bumped even when the current leader is chosen again: a leader that
    the controller gave up on must not go on appending in its old epoch. `above`: an
    epoch some replica reports having seen (the new epoch is above it too), so that a
    controller whose placement lags the sites' never hands out an epoch already used."""
    database, number = shard
    current = placement.shard(database, number)
    for site, position in positions.items():
        _check_position(site, position)
    voters = sorted(site for site in current.replicas
                    if site in alive_sites and site in positions)
    majority = len(current.replicas) // 2 + 1
    if len(voters) < majority:
        missing = sorted(set(current.replicas) - set(voters))
        raise NoMajorityError(
            f"{database}/{number}: {len(voters)} of its {len(current.replicas)} replicas "
            f"are alive and reported a position ({', '.join(voters) or 'none'}); a new "
            f"leader needs {majority}. Waiting on {', '.join(missing)}")
    leads: Counter[str] = Counter(other.leader for other in placement.shards
                                  if other.id != current.id)
    best = min(voters, key=lambda site: (
        _negated(positions[site]), site != current.leader, leads[site], site))
    epoch = max(current.epoch, above, *(positions[site][0] for site in voters)) + 1
    return placement.replace_shards([replace(current, leader=best, epoch=epoch)])


# --- checks ------------------------------------------------------------------------------

def _meets(rule: ZoneRule, shards: Sequence[ShardPlacement]) -> bool:
    return all(rule.met(shard.replicas) for shard in shards)


def _check_sites(sites: Collection[PlannedSite]) -> list[PlannedSite]:
    seen: set[str] = set()
    for site in sites:
        if not isinstance(site, PlannedSite):
            raise PlanError(f"sites: {site!r} is not a PlannedSite")
        if site.id in seen:
            raise PlanError(f"sites: {site.id} is given twice")
        seen.add(site.id)
    return sorted(sites, key=lambda site: site.id)


def _check_databases(databases: Sequence[str]) -> list[str]:
    if isinstance(databases, str):
        # A single name would otherwise be read as a list of one-letter databases.
        raise PlanError(f"databases: expected a list of names, got the string {databases!r}")
    if not databases:
        raise PlanError("databases: at least one database is needed")
    names = [check_database(name, "databases") for name in databases]
    duplicates = sorted(name for name, times in Counter(names).items() if times > 1)
    if duplicates:
        raise PlanError(f"databases: {', '.join(duplicates)} given more than once")
    return sorted(names)


def _check_positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}: {value!r} is not a whole number >= 1")


def _check_database_fits(current: Placement, name: str, n_shards: int,
                         known: set[str]) -> None:
    existing = current.shards_of(name)
    if existing and len(existing) != n_shards:
        raise PlanError(f"{name} has {len(existing)} shards, {n_shards} asked for: the "
                        f"number of shards is fixed when a database is created")
    unknown = sorted({site for shard in existing for site in shard.replicas} - known)
    if unknown:
        raise UnknownSiteError(
            f"{name} has replicas on {', '.join(unknown)}, not among the sites given "
            f"({', '.join(sorted(known))}); a site leaves by draining it first")


def _check_position(site: str, position: tuple[int, int]) -> None:
    if (not isinstance(position, tuple) or len(position) != 2
            or any(isinstance(part, bool) or not isinstance(part, int) or part < 0
                   for part in position)):
        raise PlacementError(f"position of {site}: {position!r} is not (epoch, offset), "
                             f"two whole numbers >= 0")


def _negated(position: tuple[int, int]) -> tuple[int, int]:
    return (-position[0], -position[1])


# --- quotas and leaders ----------------------------------------------------------------

def _quotas(total: int, order: Sequence[str]) -> dict[str, int]:
    """`total` spread over the sites of `order`; the first ones get one more."""
    base, extra = divmod(total, len(order))
    return {site: base + (1 if position < extra else 0) for position, site in enumerate(order)}


def _spread_leaders(candidates: Mapping[int, Sequence[str]], choice: dict[int, str],
                    load: Counter[str], elsewhere: Counter[str]) -> None:
    """Improve `choice` (the leader of each free shard, one of its `candidates`) in
    place, `load` counting the leaders of every shard of this database and
    `elsewhere` those of the other databases. Each round moves one leadership along
    a chain of free shards, from a site to one that leads at least 2 fewer shards of
    this database, or exactly 1 fewer (the spread of this database stays the same)
    and at least 2 fewer over all databases. Every round makes the sum of squared
    loads smaller (this database's first, then the total), so it ends."""
    led_by: dict[str, list[int]] = {}
    for shard, leader in sorted(choice.items()):
        led_by.setdefault(leader, []).append(shard)
    while True:
        path = None
        for source in sorted(led_by, key=lambda site: (
                -load[site], -(load[site] + elsewhere[site]), site)):
            path = _improving_path(source, candidates, led_by, load, elsewhere)
            if path is not None:
                break
        if path is None:
            return
        for shard, old, new in path:
            choice[shard] = new
            led_by[old].remove(shard)
            led_by.setdefault(new, []).append(shard)
            led_by[new].sort()
        load[path[0][1]] -= 1
        load[path[-1][2]] += 1



def moves_back(came_from: Mapping[str, tuple[int, str] | None],
               end: str) -> list[tuple[int, str, str]]:
    """The moves (shard, from site, to site) of a breadth-first search's path to `end`,
    from the last back to the first (`came_from`: each site reached, with the shard
    and site it was reached from; None at the start)."""
    moves: list[tuple[int, str, str]] = []
    site = end
    while (step := came_from[site]) is not None:
        shard, previous = step
        moves.append((shard, previous, site))
        site = previous
    return moves

def _improving_path(source: str, candidates: Mapping[int, Sequence[str]],
                    led_by: Mapping[str, list[int]], load: Counter[str],
                    elsewhere: Counter[str]) -> list[tuple[int, str, str]] | None:
    """Breadth-first from `source` over free shards: the (shard, old leader, new
    leader) steps to the least loaded site reachable, if moving one leadership there
    improves the spread (see `_spread_leaders`)."""
    came_from: dict[str, tuple[int, str] | None] = {source: None}
    queue = deque([source])
    while queue:
        site = queue.popleft()
        for shard in led_by.get(site, []):
            for other in candidates[shard]:
                if other not in came_from:
                    came_from[other] = (shard, site)
                    queue.append(other)
    end = min(came_from, key=lambda site: (load[site], load[site] + elsewhere[site], site))
    gap = load[source] - load[end]
    total_gap = load[source] + elsewhere[source] - load[end] - elsewhere[end]
    if not (gap >= 2 or (gap == 1 and total_gap >= 2)):
        return None
    return list(reversed(moves_back(came_from, end)))


def _match(needs: Mapping[int, int], options: Mapping[int, Sequence[str]],
           capacity: Mapping[str, int]) -> dict[int, list[str]]:
    """For each shard, up to `needs[shard]` distinct sites from `options[shard]` (in
    order of preference), using each site at most `capacity[site]` times over all
    shards: as many as the capacities allow, found with augmenting paths (a shard may
    take a site from another shard that can take a different one instead), so a
    greedy early choice never blocks a later shard."""
    picks: dict[int, list[str]] = {shard: [] for shard in needs}
    holders: dict[str, list[int]] = {}
    for shard in sorted(needs):
        for _ in range(needs[shard]):
            path = _augmenting_path(shard, options, capacity, picks, holders)
            if path is None:
                break
            for taker, site, giver in path:
                picks[taker].append(site)
                holders.setdefault(site, []).append(taker)
                if giver is not None:
                    picks[giver].remove(site)
                    holders[site].remove(giver)
    return picks


def _augmenting_path(start: int, options: Mapping[int, Sequence[str]],
                     capacity: Mapping[str, int], picks: Mapping[int, list[str]],
                     holders: Mapping[str, list[int]]
                     ) -> list[tuple[int, str, int | None]] | None:
    """(shard, site it takes, shard that gives the site up or None) steps that give
    `start` one more site, or None when no chain of exchanges can."""
    came_from: dict[int, tuple[int, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        shard = queue.popleft()
        free = [site for site in options[shard] if site not in picks[shard]]
        for site in free:
            if len(holders.get(site, ())) < capacity.get(site, 0):
                path: list[tuple[int, str, int | None]] = [(shard, site, None)]
                while (step := came_from[shard]) is not None:
                    previous, given = step
                    path.append((previous, given, shard))
                    shard = previous
                return path
        for site in free:
            for holder in holders.get(site, ()):
                if holder not in came_from:
                    came_from[holder] = (shard, site)
                    queue.append(holder)
    return None


def _initial(database: str, n_shards: int, replication_factor: int, active: Sequence[str],
             other_replicas: Counter[str], other_leaders: Counter[str]) -> list[ShardPlacement]:
    """A new database: replica slots dealt round-robin over the sites (emptiest first,
    so they get the extra slot when the slots do not divide evenly), which keeps each
    shard on distinct sites and every two sites within one replica of each other."""
    order = sorted(active, key=lambda site: (other_replicas[site], site))
    replicas = [sorted(order[(shard * replication_factor + slot) % len(order)]
                       for slot in range(replication_factor)) for shard in range(n_shards)]
    return _first_leaders(database, replicas, other_leaders)


def _zoned_initial(shards: Sequence[ShardPlacement], active: Sequence[str],
                   draining: frozenset[str], rule: ZoneRule, other_replicas: Counter[str],
                   other_leaders: Counter[str]) -> list[ShardPlacement]:
    """A new database whose round-robin placement (`_initial`) breaks the zone rule:
    the replica sets that `_ZonedPlanner` reaches from it (its steps are not kept: a
    new database starts where they end), leaders chosen as for any new database."""
    planner = _ZonedPlanner(shards[0].database, shards, active, draining,
                            len(shards[0].replicas), other_replicas, other_leaders, rule=rule)
    planner.run()
    return _first_leaders(shards[0].database,
                          [sorted(replicas) for replicas in planner.replicas], other_leaders)


def _first_leaders(database: str, replicas: Sequence[list[str]],
                   other_leaders: Counter[str]) -> list[ShardPlacement]:
    """The shards of a new database on these replica sets, leaders spread evenly."""
    n_shards = len(replicas)
    load: Counter[str] = Counter()
    choice: dict[int, str] = {}
    for shard in range(n_shards):
        leader = min(replicas[shard], key=lambda site: (load[site], other_leaders[site], site))
        choice[shard] = leader
        load[leader] += 1
    _spread_leaders(dict(enumerate(replicas)), choice, load, other_leaders)
    return [ShardPlacement(database=database, shard=shard, replicas=tuple(replicas[shard]),
                           leader=choice[shard], epoch=FIRST_EPOCH)
            for shard in range(n_shards)]


# --- rebalancing one database -----------------------------------------------------------

@dataclass
class _Handover:
    """A leader that left its shard at step `step`, succeeded by a remaining replica."""

    step: int
    shard: int
    successor: str


@dataclass
class _DatabasePlanner:
    """Working state while planning the moves of one existing database."""

    database: str
    existing: Sequence[ShardPlacement]
    active: Sequence[str]
    draining: frozenset[str]
    replication_factor: int
    other_replicas: Counter[str]
    other_leaders: Counter[str]
    replicas: list[set[str]] = field(init=False)
    leaders: list[str] = field(init=False)
    epochs: list[int] = field(init=False)
    count: Counter[str] = field(init=False)
    led: Counter[str] = field(init=False)
    shards_of: dict[str, set[int]] = field(init=False)
    quota: dict[str, int] = field(init=False)
    leader_quota: dict[str, int] = field(init=False)
    steps: list[Transition] = field(init=False, default_factory=list)
    handovers: list[_Handover] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.replicas = [set(shard.replicas) for shard in self.existing]
        self.leaders = [shard.leader for shard in self.existing]
        self.epochs = [shard.epoch for shard in self.existing]
        self.count = Counter(site for replicas in self.replicas for site in replicas)
        self.led = Counter(self.leaders)
        self.shards_of = {}
        for shard, replicas in enumerate(self.replicas):
            for site in replicas:
                self.shards_of.setdefault(site, set()).add(shard)
        # Replica quotas are set once shards have the replication factor (`run`); until
        # then every site's is the floor, so that the emptiest sites look neediest.
        floor = len(self.existing) * self.replication_factor // len(self.active)
        self.quota = {site: floor for site in self.active}
        self.leader_quota = _quotas(len(self.existing), sorted(self.active, key=lambda site: (
            -self.led[site], self.other_leaders[site], site)))

    def surplus(self, site: str) -> int:
        return self.count[site] - self.quota.get(site, 0)

    def leader_surplus(self, site: str) -> int:
        return self.led[site] - self.leader_quota.get(site, 0)

    def run(self) -> list[Transition]:
        factor = self.replication_factor
        total = len(self.existing) * factor
        low, high = total // len(self.active), -(-total // len(self.active))
        # Shards short of replicas take them from the emptiest sites, shards with too
        # many give them up from the fullest ones, each site kept within the balanced
        # counts as far as the shards allow (first the floor, then the ceiling).
        for limit in (low, high, None):
            short = {shard: factor - len(replicas)
                     for shard, replicas in enumerate(self.replicas) if len(replicas) < factor}
            options = {shard: sorted((site for site in self.active
                                      if site not in self.replicas[shard]),
                                     key=self.receiver_order) for shard in short}
            room = {site: len(self.existing) if limit is None else max(0, limit - self.count[site])
                    for site in self.active}
            picks = _match(short, options, room)
            for shard in sorted(short):
                for site in picks[shard]:
                    self.add(shard, site)
        for limit in (high, low, 0):
            extra = {shard: len(replicas) - factor
                     for shard, replicas in enumerate(self.replicas) if len(replicas) > factor}
            options = {shard: self.givers_of(shard) for shard in extra}
            spare = {site: self.count[site] if site in self.draining
                     else max(0, self.count[site] - limit) for site in self.count}
            picks = _match(extra, options, spare)
            for shard in sorted(extra):
                for site in picks[shard]:
                    self.remove(shard, site)
        # Quotas now, from the counts after growing and shrinking: the larger quotas go
        # to the sites that hold the most (fewer moves).
        self.quota = _quotas(total, sorted(self.active, key=lambda site: (
            -self.count[site], self.other_replicas[site], site)))
        self.drain()
        # Each move lowers the total surplus by one, except a detour through a full
        # site (see `next_move`), which the following move pays back.
        limit = 2 * sum(max(0, self.surplus(site)) for site in self.count) + 1
        for _ in range(limit):
            move = self.next_move()
            if move is None:
                break
            shard, giver, receiver = move
            self.add(shard, receiver)
            self.remove(shard, giver)
        else:
            raise AssertionError(f"{self.database}: the planner did not converge")
        self.spread_successors()
        return self.steps

    def result(self) -> list[ShardPlacement]:
        return [ShardPlacement(database=self.database, shard=shard,
                               replicas=tuple(sorted(replicas)), leader=self.leaders[shard],
                               epoch=self.epochs[shard])
                for shard, replicas in enumerate(self.replicas)]

    def receiver_order(self, site: str) -> tuple[int, int, str]:
        return (self.surplus(site), self.other_replicas[site], site)

    def giver_order(self, shard: int, site: str) -> tuple[bool, int, bool, str]:
        return (site not in self.draining, -self.surplus(site),
                site == self.leaders[shard], site)

    def givers_of(self, shard: int) -> list[str]:
        return sorted(self.replicas[shard], key=lambda site: self.giver_order(shard, site))

    def best_receiver(self, shard: int) -> str:
        return min((site for site in self.active if site not in self.replicas[shard]),
                   key=self.receiver_order)

    def successor(self, shard: int, leaving: str, joining: str | None = None) -> str:
        remaining = (self.replicas[shard] - {leaving}) | ({joining} if joining else set())
        return min(remaining, key=lambda site: (
            site in self.draining, self.leader_surplus(site), self.other_leaders[site], site))

    def next_move(self) -> tuple[int, str, str] | None:
        """(shard, from, to) of the next move, or None when every site is at quota."""
        givers = sorted((site for site in self.count if self.surplus(site) > 0),
                        key=lambda site: (site not in self.draining, -self.surplus(site), site))
        if not givers:
            return None
        takers = sorted((site for site in self.active if self.surplus(site) < 0),
                        key=self.receiver_order)
        for giver in givers:
            move = self.best_move(giver, takers)
            if move is not None:
                return move
        # Only a draining site can be stuck like this: a site that is not draining
        # holds more replicas than any site below its quota (quotas differ by at most
        # one), so some shard has it and not the other. A draining site's shards may
        # all hold every site below quota already.
        giver = givers[0]
        shard = min(self.shards_of[giver],
                    key=lambda shard: (self.leaders[shard] == giver, shard))
        swapped = self.swap_quota(shard, takers)
        if swapped is not None:
            return shard, giver, swapped
        # No quota to trade: the replica goes to a full site first, which gives one of
        # its own to a site below quota on the next move.
        return shard, giver, self.best_receiver(shard)

    def best_move(self, giver: str, takers: Sequence[str]) -> tuple[int, str, str] | None:
        """The move off `giver` to one of `takers` (most needy first) that spreads
        leaders best: one that carries a leadership from a site leading too many
        shards to one leading too few, else a follower's, else a leader's. Off a
        draining site, the shard that the fewest takers can take goes first, so that
        its last shards do not find every taker holding them already."""
        draining = giver in self.draining
        rank = {taker: position for position, taker in enumerate(takers)}
        best: tuple[tuple[int, int, int, int], int, str] | None = None
        for shard in self.shards_of[giver]:
            able = (taker for taker in takers if shard not in self.shards_of.get(taker, ()))
            if draining or self.leaders[shard] == giver:
                options = list(able)
            else:
                # A follower's move is as good to every taker: the neediest gets it.
                first = next(able, None)
                options = [] if first is None else [first]
            if not options:
                continue
            kind, position, taker = min((self.move_kind(shard, giver, taker), rank[taker], taker)
                                        for taker in options)
            key = (len(options) if draining else 0, kind, position, shard)
            if best is None or key < best[0]:
                best = (key, shard, taker)
        return None if best is None else (best[1], giver, best[2])

    def swap_quota(self, shard: int, takers: Sequence[str]) -> str | None:
        """A full site that can take `shard` if a site below quota hands it the one
        extra replica of its quota (when quotas do not divide evenly, which sites get
        the extra one is a free choice); the site after the trade, or None."""
        top = max(self.quota.values())
        for taker in takers:
            if self.quota[taker] != top or self.count[taker] >= top:
                continue
            for site in sorted(self.active, key=self.receiver_order):
                if (site not in self.replicas[shard] and self.surplus(site) == 0
                        and self.quota[site] == top - 1):
                    self.quota[taker] -= 1
                    self.quota[site] += 1
                    return site
        return None

    def drain(self) -> None:
        """Move the replicas off draining sites to sites below quota, matched all at
        once (a greedy order can leave the last shards of a draining site where
        every site with room holds them already)."""
        leaving = {shard: sorted(self.replicas[shard] & self.draining)
                   for shard in range(len(self.replicas)) if self.replicas[shard] & self.draining}
        rank = {site: position for position, site in enumerate(
            sorted(self.active, key=self.receiver_order))}
        options = {shard: self.takers_of(shard, givers, rank) for shard, givers in leaving.items()}
        picks = _match({shard: len(sites) for shard, sites in leaving.items()}, options,
                       {site: max(0, -self.surplus(site)) for site in self.active})
        for shard in sorted(picks):
            for taker, giver in zip(picks[shard], leaving[shard], strict=False):
                self.add(shard, taker)
                self.remove(shard, giver)

    def takers_of(self, shard: int, givers: Sequence[str],
                  rank: Mapping[str, int]) -> list[str]:
        """Sites that may take a replica of `shard` from one of `givers`, best first."""
        def order(site: str) -> tuple[int, int]:
            return (min(self.move_kind(shard, giver, site) for giver in givers), rank[site])

        return sorted((site for site in self.active if site not in self.replicas[shard]),
                      key=order)

    def move_kind(self, shard: int, giver: str, taker: str) -> int:
        """0: the move hands a leadership from a site leading more than its share to
        one leading less; 1: it moves a follower; 2: it moves a leader to no gain."""
        if self.leaders[shard] != giver:
            return 1
        successor = self.successor(shard, giver, taker)
        helps = self.leader_surplus(giver) > 0 and self.leader_surplus(successor) < 0
        return 0 if helps else 2

    def add(self, shard: int, site: str) -> None:
        self.replicas[shard].add(site)
        self.count[site] += 1
        self.shards_of.setdefault(site, set()).add(shard)
        self.steps.append(Transition(self.database, shard, "add", site))

    def remove(self, shard: int, site: str) -> None:
        successor = None
        if site == self.leaders[shard]:
            successor = self.successor(shard, site)
            self.led[site] -= 1
            self.led[successor] += 1
            self.leaders[shard] = successor
            self.epochs[shard] += 1
            self.handovers.append(_Handover(len(self.steps), shard, successor))
        self.replicas[shard].discard(site)
        self.count[site] -= 1
        self.shards_of[site].discard(shard)
        self.steps.append(Transition(self.database, shard, "remove", site, successor))

    def spread_successors(self) -> None:
        """Choose again, all handovers known, the successors of shards whose leader
        changes once: any replica that joined before the handover and stays to the
        end may take over, and the choice spreads leaders as evenly as those allow."""
        times = Counter(handover.shard for handover in self.handovers)
        candidates: dict[int, list[str]] = {}
        step_of: dict[int, int] = {}
        for handover in self.handovers:
            if times[handover.shard] != 1:
                continue
            stays = set(self.replicas[handover.shard])
            joined_after = {step.site for step in self.steps[handover.step:]
                            if step.shard == handover.shard and step.action == "add"}
            candidates[handover.shard] = sorted(stays - joined_after)
            step_of[handover.shard] = handover.step
        choice = {shard: self.leaders[shard] for shard in candidates}
        _spread_leaders(candidates, choice, self.led, self.other_leaders)
        for shard, leader in choice.items():
            self.leaders[shard] = leader
            step = self.steps[step_of[shard]]
            self.steps[step_of[shard]] = replace(step, leader=leader)


@dataclass
class _ZonedPlanner(_DatabasePlanner):
    """The moves of one database where the balanced plan (`_DatabasePlanner`) would
    leave a shard with more replicas in one zone than `rule` allows. The zone rule
    comes first here and balance second: every replica that is added goes to the
    emptiest site the rule allows, and a last pass evens the sites out with the moves
    the rule allows (a replica from a site to one holding at least 2 fewer, directly
    or along a chain of sites that each give one and take one, so each chain makes
    the counts more even and the pass ends). Where the zones are uneven a balanced
    placement may not exist (2 zones, one of them a single site: that site holds a
    replica of every shard), and the pass stops where no chain is allowed.

    Steps keep the rules of every plan: a shard short of replicas gets them first, a
    shard with too many gives them up (draining sites first, then crowded zones), and
    every move adds the new replica before it removes the old one. Whichever site
    gives up a shard, the rule guarantees some other site may take it: a shard short
    of its zones' share (`cap` per zone, at most the zone's sites) has a zone with
    room and a site in it that does not hold the shard."""

    rule: ZoneRule = field(kw_only=True)

    def run(self) -> list[Transition]:
        factor = self.replication_factor
        for shard in range(len(self.replicas)):
            while len(self.replicas[shard]) < factor:
                self.add(shard, self.zoned_receiver(shard))
            while len(self.replicas[shard]) > factor:
                self.remove(shard, self.spare_replica(shard))
        for shard in range(len(self.replicas)):
            for giver in sorted(self.replicas[shard] & self.draining):
                self.move(shard, giver)
        for shard in range(len(self.replicas)):
            while crowded := self.rule.crowded(self.replicas[shard]):
                self.move(shard, self.crowding_replica(shard, crowded[0]))
        while (moves := self.balancing_moves()) is not None:
            for shard, giver, receiver in moves:
                self.add(shard, receiver)
                self.remove(shard, giver)
        self.spread_successors()
        return self.steps

    def spare_replica(self, shard: int) -> str:
        """The replica a shard with too many gives up: on a draining site, else in a
        crowded zone, else on the fullest site, a follower's before the leader's."""
        crowded = self.rule.crowded(self.replicas[shard])
        return min(self.replicas[shard], key=lambda site: (
            site not in self.draining, self.rule.zone_of[site] not in crowded,
            -self.count[site], site == self.leaders[shard], site))

    def crowding_replica(self, shard: int, zone: ZoneKey) -> str:
        """The replica of `shard` in a crowded `zone` to move out: a follower's before
        the leader's (a handover interrupts writes), from the fullest site."""
        return min((site for site in self.replicas[shard] if self.rule.zone_of[site] == zone),
                   key=lambda site: (site == self.leaders[shard], -self.count[site], site))

    def zoned_receiver(self, shard: int, giver: str | None = None) -> str:
        """The emptiest site that may take a replica of `shard` (from `giver`)."""
        return min((site for site in self.active if site not in self.replicas[shard]
                    and self.rule.allows(self.replicas[shard], site, giver)),
                   key=lambda site: (self.count[site], self.other_replicas[site], site))

    def move(self, shard: int, giver: str) -> None:
        self.add(shard, self.zoned_receiver(shard, giver))
        self.remove(shard, giver)

    def balancing_moves(self) -> list[tuple[int, str, str]] | None:
        """(shard, from, to) moves that take one replica off the fullest site it can
        come off and, through sites that each give one and take one, onto the
        emptiest site it can reach, the two at least 2 replicas apart; or None. A
        chain because the rule may forbid the direct move (every shard of the full
        site has a replica in the empty site's zone) where a detour is allowed.
        Breadth-first (the chain to each site as short as any), followers' moves
        before leaders'."""
        emptiest = min(self.count[site] for site in self.active)
        for giver in sorted(self.active, key=lambda site: (-self.count[site], site)):
            if self.count[giver] - emptiest < 2:
                break
            came_from: dict[str, tuple[int, str] | None] = {giver: None}
            queue = deque([giver])
            while queue:
                site = queue.popleft()
                for shard in sorted(self.shards_of.get(site, ()),
                                    key=lambda shard: (self.leaders[shard] == site, shard)):
                    for other in self.active:
                        if (other not in came_from and other not in self.replicas[shard]
                                and self.rule.allows(self.replicas[shard], other, site)):
                            came_from[other] = (shard, site)
                            queue.append(other)
            receiver = min(came_from, key=lambda site: (
                self.count[site], self.other_replicas[site], site))
            if self.count[giver] - self.count[receiver] < 2:
                continue
            moves = moves_back(came_from, receiver)
            # Each move was found allowed on the replica sets as they are; the chain
            # holds as a whole only if no two of its moves change one shard.
            if len({shard for shard, _, _ in moves}) == len(moves):
                return moves
        return None
