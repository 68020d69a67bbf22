"""The controller's decisions as pure functions of what it knows (docs/replication.md,
"The controller"): which sites are gone, which shards fail over, the first placement,
the next step of a pending plan, and the plans that operator requests ask for. No
I/O and no clock: `controller.py` gathers the inputs (heartbeats, requests) and
carries the answers out (files, pushes).

Every new placement is one version newer than the last: `planner.failover`,
`planner.plan` and `apply_transition` each bump it, and nothing else makes one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..ds.replication import (
    Placement,
    Plan,
    PlannedSite,
    ShardId,
    ShardPlacement,
    Transition,
    apply_transition,
    breaks_zone_rule,
    failover,
    plan,
)
from ..ds.replication.waves import in_waves
from ..errors import (
    ClusterNotReadyError,
    NoMajorityError,
    PlacementError,
    PlanError,
    SiteStateError,
    UnknownDatabaseError,
    UnknownSiteError,
)
from .sites import ShardReport, SiteState

# A site that has not answered for this many heartbeat intervals is taken for gone.
MISSED_HEARTBEATS = 3
# Without every expected site up, the first placement waits this many heartbeat
# intervals for the late ones, then goes ahead with those up (if enough).
STARTUP_GRACE_HEARTBEATS = 10


# Every database of a site is replicated: the messages, the sessions (with their
# owner epochs) and the retained messages.
REPLICATED_DATABASES = ("messages", "sessions", "retained")


@dataclass(frozen=True)
class Settings:
    """The cluster's fixed parameters. `expected_sites`: how many sites the controller
    was told of at start; the first placement waits a little for all of them."""

    replication_factor: int
    n_shards: int
    heartbeat_interval: float
    databases: tuple[str, ...] = REPLICATED_DATABASES
    missed_heartbeats: int = MISSED_HEARTBEATS
    expected_sites: int = 0
    # How many shards a plan moves at once: the steps taken in one round plus the
    # replicas still catching up (each joiner bootstraps from a checkpoint of its
    # leader, so more at once means more copying at once).
    max_concurrent_moves: int = 1

    @property
    def gone_after(self) -> float:
        return self.missed_heartbeats * self.heartbeat_interval


@dataclass(frozen=True)
class CatchUp:
    """A replica that joined `shard` in placement `version` and must apply up to
    `target` (the leader's committed offset as of when it joined, None until that is
    known) before the plan takes its next step."""

    shard: ShardId
    site: str
    version: int
    target: int | None = None

    def __str__(self) -> str:
        target = "?" if self.target is None else str(self.target)
        return f"{self.shard[0]}/{self.shard[1]}: +{self.site} catching up to {target}"


@dataclass(frozen=True)
class ClusterState:
    """What the controller decides on and keeps: the placement (empty before the first
    one), the pending plan, the sites each database should live on (`goals`), and the
    replicas that joined and are still catching up (at most one per shard)."""

    placement: Placement = field(default_factory=Placement.empty)
    plan: Plan | None = None
    goals: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    catch_ups: tuple[CatchUp, ...] = ()


@dataclass(frozen=True)
class LeaderMove:
    """A shard's leadership moved by a failover (its leader gone, or cut off from a
    majority of its replicas) or a handover (its leader stopping: `handover`)."""

    shard: ShardId
    old_leader: str
    new_leader: str
    epoch: int
    handover: bool


@dataclass(frozen=True)
class Decision:
    state: ClusterState
    notes: tuple[str, ...] = ()
    # The failovers and handovers this round decided (the operator posts an Event
    # for each).
    leader_moves: tuple[LeaderMove, ...] = ()


# --- sites ------------------------------------------------------------------------------

def is_gone(site: SiteState, now: float, settings: Settings) -> bool:
    """Missed `missed_heartbeats` heartbeats in a row, or found down at once: its
    address refused the last probe after it had answered since the controller started
    (one not up yet at the controller's start keeps the grace of `last_seen`)."""
    return (site.refused and site.answered) or now - site.last_seen > settings.gone_after


def alive_sites(sites: Mapping[str, SiteState], now: float, settings: Settings) -> set[str]:
    return {site.id for site in sites.values() if not is_gone(site, now, settings)}


def up_sites(sites: Mapping[str, SiteState], now: float, settings: Settings) -> list[str]:
    """Alive sites that have answered since the controller started."""
    return sorted(site.id for site in sites.values()
                  if site.answered and not is_gone(site, now, settings))


# --- one round ------------------------------------------------------------------------

def decide(state: ClusterState, sites: Mapping[str, SiteState], now: float, started: float,
           settings: Settings) -> Decision:
    """The state after one heartbeat round: the first placement once enough sites are
    up; else failovers of shards whose leader is gone or stopping (and the plan redone
    around them); else the next step of the pending plan."""
    placed = set(state.placement.databases())
    if not set(settings.databases) <= placed:
        return _first_placement(state, sites, now, started, settings)
    notes: list[str] = []
    placement = failovers(state.placement, sites, now, settings, notes)
    placement = handovers(placement, sites, now, settings, notes)
    if placement != state.placement:
        # No plan step in the same round: sites take their new leaders first.
        new_plan = _replan(state, placement, sites, settings, notes)
        return Decision(replace(state, placement=placement, plan=new_plan), tuple(notes),
                        moved_leaders(state.placement, placement, sites, now, settings))
    if state.plan is None:
        return Decision(replace(state, plan=_zone_plan(state, sites, now, settings, notes)),
                        tuple(notes))
    current = state
    try:
        state.plan.remaining(state.placement)
    except PlanError:
        # A failover in a round the plan was saved in, or a restart between the two
        # files: plan again from where the sites are.
        current = replace(state, plan=_replan(state, placement, sites, settings, notes))
        if current.plan is None:
            return Decision(current, tuple(notes))
    return Decision(advance(current, sites, now, settings, notes), tuple(notes))


def _first_placement(state: ClusterState, sites: Mapping[str, SiteState], now: float,
                     started: float, settings: Settings) -> Decision:
    up = up_sites(sites, now, settings)
    holding = sorted(f"{site} (version {sites[site].placement_version})" for site in up
                     if sites[site].placement_version is not None)
    if holding and state.placement.version == 0:
        # Their logs carry epochs a fresh placement would not know: starting over
        # would have them refuse it, or worse. The controller adopts theirs
        # (`adopt`, once it has fetched them) instead.
        return Decision(state, (f"sites hold a placement but this controller has none: "
                                f"{', '.join(holding)}; waiting to adopt the newest they "
                                f"hold instead of placing shards anew",))
    mismatched = sorted(
        f"{site} has {count} shards of {database}"
        for site in up for database in settings.databases
        if (count := sum(1 for shard in sites[site].shards if shard[0] == database))
        != settings.n_shards)
    if mismatched:
        return Decision(state, (f"the controller places {settings.n_shards} shards per "
                                f"database but {'; '.join(mismatched)}: give the controller "
                                f"the sites' n_shards",))
    waited = now - started >= STARTUP_GRACE_HEARTBEATS * settings.heartbeat_interval
    if len(up) < settings.replication_factor or (
            len(up) < settings.expected_sites and not waited):
        return Decision(state, (f"waiting for sites: {len(up)} up, replication factor "
                                f"{settings.replication_factor}, {settings.expected_sites} "
                                f"expected",))
    # Only the databases not placed yet: all of them, unless the placement was
    # adopted from sites that were given one by hand without some database; its
    # shards are kept (planning them too would check their replicas against the
    # sites up now), and the missing database's are placed beside them.
    missing = [database for database in settings.databases
               if database not in set(state.placement.databases())]
    first = plan([PlannedSite(site, zone=sites[site].zone) for site in up], missing,
                 settings.n_shards, settings.replication_factor, state.placement)
    goals = {**state.goals, **{database: tuple(up) for database in missing}}
    return Decision(replace(state, placement=first.start, goals=goals),
                    (f"first placement (version {first.start.version}) of "
                     f"{', '.join(missing)} on {', '.join(up)}",))


def failovers(placement: Placement, sites: Mapping[str, SiteState], now: float,
              settings: Settings, notes: list[str]) -> Placement:
    """`placement` with a new leader (and epoch) for every shard whose leader is gone,
    or reports it has heard from no majority of the shard's replicas for longer than a
    site takes to be taken for gone (`lost_quorum`: cut off from its peers, not from
    the controller), chosen by `planner.failover` among the log ends that alive
    replicas reported in this round (`now`), the lost leader left out. A shard with
    no majority of such replicas keeps its leader (and is noted) until a later round
    has one."""
    alive = alive_sites(sites, now, settings)
    # Only positions reported in this round count: an older report may understate a
    # replica's log, and the choice must not pass over one that holds more.
    fresh = {site.id for site in sites.values()
             if site.id in alive and now - site.last_seen <= settings.heartbeat_interval / 2}
    for shard in placement.shards:
        lost = lost_quorum(shard, sites[shard.leader], settings) \
            if shard.leader in alive else None
        if shard.leader in alive and lost is None:
            continue
        # A leader without its majority would win again on its log end (it may hold
        # an uncommitted tail) and reach no majority again; the others, if a majority,
        # hold every committed entry between them.
        voters = alive - {shard.leader} if lost is not None else alive
        positions = {}
        for site in shard.replicas:
            report = sites[site].shards.get(shard.id) if site in fresh else None
            if report is not None:
                positions[site] = report.last
        try:
            placement = failover(placement, shard.id, voters, positions,
                                 above=reported_epoch(sites, shard.id))
        except NoMajorityError as exc:
            notes.append(exc.message if lost is None else
                         f"{shard.database}/{shard.shard}: {lost}; {exc.message}")
            continue
        new = placement.shard(*shard.id)
        why = f"leader {shard.leader} is gone" if lost is None else lost
        notes.append(f"{shard.database}/{shard.shard}: {why}; {new.leader} leads from "
                     f"epoch {new.epoch}")
    return placement


def lost_quorum(shard: ShardPlacement, leader: SiteState, settings: Settings) -> str | None:
    """Why `shard`'s leader, which the controller reaches, is to be replaced: it
    reports (at the shard's epoch) no answer from a majority of its replicas for
    longer than a site may miss heartbeats, its own heartbeats to its followers
    counted too (they set how often an idle leader hears them); else None. Such a
    leader commits nothing, while the controller's probe alone sees nothing wrong."""
    report = leader.shards.get(shard.id)
    if report is None or report.quorum_age is None or report.epoch != shard.epoch:
        return None
    allowed = max(settings.gone_after,
                  settings.missed_heartbeats * (leader.heartbeat_interval or 0.0))
    if report.quorum_age <= allowed:
        return None
    return (f"leader {shard.leader} has heard from no majority of its replicas for "
            f"{report.quorum_age:.1f}s (allowed {allowed:.1f}s)")


def handovers(placement: Placement, sites: Mapping[str, SiteState], now: float,
              settings: Settings, notes: list[str]) -> Placement:
    """`placement` with a new leader (and epoch) for every shard led by a site that
    reports it is stopping (a graceful stop: it waits for this before it goes),
    chosen by `planner.failover` among the shard's other replicas alive that reported
    in this round. The stopping site serves until it takes the new placement and the
    new leader takes the committed tail over (`Takeover.take_over`), so writes
    wait for that alone, not for the site to be taken for gone first. A shard
    without a majority of such replicas keeps its leader (noted): it fails over once
    the site is gone and a majority is back."""
    alive = alive_sites(sites, now, settings)
    stopping = {site for site in alive if sites[site].stopping}
    if not stopping:
        return placement
    fresh = {site.id for site in sites.values() if site.id in alive - stopping
             and now - site.last_seen <= settings.heartbeat_interval / 2}
    for shard in placement.shards:
        if shard.leader not in stopping:
            continue
        positions = {site: report.last for site in shard.replicas if site in fresh
                     and (report := sites[site].shards.get(shard.id)) is not None}
        try:
            placement = failover(placement, shard.id, alive - stopping, positions,
                                 above=reported_epoch(sites, shard.id))
        except NoMajorityError as exc:
            notes.append(f"{shard.database}/{shard.shard}: leader {shard.leader} is "
                         f"stopping and keeps it for now: {exc.message}")
            continue
        new = placement.shard(*shard.id)
        notes.append(f"{shard.database}/{shard.shard}: leader {shard.leader} is stopping; "
                     f"{new.leader} leads from epoch {new.epoch}")
    return placement


def moved_leaders(before: Placement, after: Placement, sites: Mapping[str, SiteState],
                  now: float, settings: Settings) -> tuple[LeaderMove, ...]:
    """The shards of `before` whose leader is another in `after` (`failovers` and
    `handovers` change nothing else of a shard), each a handover where its old leader
    is alive and stopping."""
    alive = alive_sites(sites, now, settings)
    moves = []
    for shard in before.shards:
        new = after.shard(*shard.id)
        if new.leader != shard.leader:
            old = sites.get(shard.leader)
            moves.append(LeaderMove(shard.id, shard.leader, new.leader, new.epoch,
                                    handover=old is not None and old.stopping
                                    and shard.leader in alive))
    return tuple(moves)


def reported_epoch(sites: Mapping[str, SiteState], shard: ShardId) -> int:
    """The highest epoch any site reports for `shard` (seen, or of its last entry);
    0 when none does. A new leader's epoch goes above it."""
    return max((max(report.epoch, report.last[0]) for site in sites.values()
                if (report := site.shards.get(shard)) is not None), default=0)


def _replan(state: ClusterState, placement: Placement, sites: Mapping[str, SiteState],
            settings: Settings, notes: list[str]) -> Plan | None:
    """The pending plan again, from `placement`, to the same goals; None when there
    was none, when nothing is left to do, or when no plan reaches them now."""
    if state.plan is None:
        return None
    try:
        new = plan_goals(placement, state.goals, sites, settings)
    except PlanError as exc:
        notes.append(f"pending plan dropped: {exc.message}")
        return None
    return new if new.transitions else None


def _zone_plan(state: ClusterState, sites: Mapping[str, SiteState], now: float,
               settings: Settings, notes: list[str]) -> Plan | None:
    """A plan to the same goals for the databases with a shard whose replicas the
    sites' zones show too close (`planner.breaks_zone_rule`): zones learnt after the
    placement was made (sites that report them since, an operator that could not read
    the nodes before). Only while every site of the goal is up and not stopping, so
    that every zone is known and the plan adds to no site that is down; None when no
    database needs one."""
    up = set(up_sites(sites, now, settings))
    close = []
    for database, goal in sorted(state.goals.items()):
        holders = {site for shard in state.placement.shards_of(database)
                   for site in shard.replicas}
        if not set(goal) <= up or any(sites[site].stopping for site in goal) \
                or not holders <= set(sites):
            continue
        chosen = [PlannedSite(site, draining=site not in goal, zone=sites[site].zone)
                  for site in sorted(set(goal) | holders)]
        if breaks_zone_rule(chosen, state.placement, database, settings.replication_factor):
            close.append(database)
    if not close:
        return None
    try:
        new = plan_goals(state.placement, {database: state.goals[database]
                                           for database in close}, sites, settings)
    except PlanError as exc:
        notes.append(f"replicas of {', '.join(close)} share zones, but no plan moves them "
                     f"apart: {exc.message}")
        return None
    notes.append(f"replicas of {', '.join(close)} share zones: planned apart "
                 f"({len(new.transitions)} steps)")
    return new if new.transitions else None


def plan_goals(placement: Placement, goals: Mapping[str, Sequence[str]],
               sites: Mapping[str, SiteState], settings: Settings) -> Plan:
    """The plan that puts each database of `goals` on its sites: those sites may hold
    replicas, any other site holding some is drained. Databases are planned one after
    the other, each on its own set of sites, which the planner keeps a shard's
    replicas in distinct zones of (each site's `zone`) as far as they allow."""
    result = Plan(start=placement, target=placement, transitions=())
    for database in sorted(goals):
        wanted = set(goals[database])
        holders = {site for shard in placement.shards_of(database) for site in shard.replicas}
        unknown = sorted((wanted | holders) - set(sites))
        if unknown:
            raise UnknownSiteError(f"unknown site(s) {', '.join(unknown)}")
        chosen = [PlannedSite(site, draining=site not in wanted, zone=sites[site].zone)
                  for site in sorted(wanted | holders)]
        step = plan(chosen, [database], settings.n_shards, settings.replication_factor,
                    result.target)
        result = Plan(start=result.start, target=step.target,
                      transitions=result.transitions + step.transitions)
    return replace(result, transitions=in_waves(result.transitions,
                                                settings.max_concurrent_moves))


# --- a controller behind the sites --------------------------------------------------

def behind(state: ClusterState, sites: Mapping[str, SiteState]) -> bool:
    """Some site that answered keeps a newer placement than the controller's: its data
    folder went back to an older copy (or was lost), or another controller pushed."""
    return any(site.answered and site.placement_version is not None
               and site.placement_version > state.placement.version
               for site in sites.values())


def adopt(state: ClusterState, held: Mapping[str, Placement]) -> Decision:
    """The state once the controller knows the placement each site keeps (`held`:
    site -> placement). When the newest of them is newer than the controller's, or
    another document under the same version (the sites refused the controller's), the
    controller takes it for its own: decisions made from a placement the sites do not
    hold would be refused, and leave shards without a leader. The pending plan goes
    (it was made from a placement the sites never had; the operator asks again), and
    each database's goal becomes the sites it is on. Otherwise the state is unchanged.
    Of several documents under the newest version, the one most sites keep wins."""
    if not held:
        return Decision(state)
    newest = max(placement.version for placement in held.values())
    kept_by = Counter(placement.to_json() for placement in held.values()
                      if placement.version == newest)
    chosen_json = max(kept_by, key=lambda document: (kept_by[document], document))
    chosen = next(placement for placement in held.values()
                  if placement.to_json() == chosen_json)
    own = state.placement
    if chosen.version < own.version or chosen == own:
        return Decision(state)
    holders = sorted(site for site, placement in held.items() if placement == chosen)
    goals = {database: tuple(sorted({site for shard in chosen.shards_of(database)
                                     for site in shard.replicas}))
             for database in chosen.databases()}
    notes = [f"this controller's placement (version {own.version}) is not the one the "
             f"sites keep (version {chosen.version}, on {', '.join(holders)}): adopted "
             f"theirs"]
    if state.plan is not None:
        notes.append("pending plan dropped: it was made from a placement the sites do not "
                     "hold; ask for the change again")
    return Decision(ClusterState(placement=chosen, plan=None, goals=goals, catch_ups=()),
                    tuple(notes))


# --- the pending plan ------------------------------------------------------------------

def advance(state: ClusterState, sites: Mapping[str, SiteState], now: float,
            settings: Settings, notes: list[str]) -> ClusterState:
    """Take the next steps of the pending plan that may go: in plan order, each on a
    shard of its own this round and with no replica of it still catching up, as many
    as `max_concurrent_moves` leaves room for beside the replicas catching up; the
    first that may not go (`_blocked`: a new leader must have what its predecessor
    committed, a joining site must be up) stops the round's steps. A replica that
    joined holds its shard's next step until it has caught up."""
    assert state.plan is not None
    catch_ups = []
    for catch_up in state.catch_ups:
        still = check_catch_up(catch_up, state.placement, sites, now, settings)
        if still is not None:
            notes.append(f"waiting: {still}")
            catch_ups.append(still)
    remaining = state.plan.remaining(state.placement)
    if not remaining:
        if catch_ups:
            return replace(state, catch_ups=tuple(catch_ups))
        notes.append(f"plan done at placement version {state.placement.version}")
        return replace(state, plan=None, catch_ups=())
    # Each step is checked against the placement the sites were given before this
    # round: the steps of one round are on distinct shards, so none depends on another.
    given = state.placement.version
    placement = state.placement
    moving = {catch_up.shard for catch_up in catch_ups}
    joining = {(catch_up.shard, catch_up.site) for catch_up in catch_ups}
    for step in remaining:
        # A step that takes a joiner off again ends its catch-up rather than waits
        # for it: a joiner that died before it caught up would hold every step of
        # every shard, the plan that makes it leave included.
        ends_catch_up = step.action == "remove" and (step.shard_id, step.site) in joining
        if not ends_catch_up and (len(moving) >= settings.max_concurrent_moves
                                  or step.shard_id in moving):
            break
        waiting = _blocked(step, placement, sites, now, settings, given)
        if waiting is not None:
            notes.append(f"waiting: {step}: {waiting}")
            break
        placement = apply_transition(placement, step,
                                     above=reported_epoch(sites, step.shard_id))
        moving.add(step.shard_id)
        notes.append(f"step {step} (placement version {placement.version})")
        if step.action == "add":
            catch_ups.append(CatchUp(shard=step.shard_id, site=step.site,
                                     version=placement.version))
    return replace(state, placement=placement, catch_ups=tuple(catch_ups))


def check_catch_up(catch_up: CatchUp, placement: Placement, sites: Mapping[str, SiteState],
                   now: float, settings: Settings) -> CatchUp | None:
    """None once the joined replica has applied up to the leader's committed offset as
    of when it joined (or has left the shard meanwhile); else the catch-up, with its
    target set once the joiner holds the placement that added it."""
    shard = placement.shard(*catch_up.shard)
    if catch_up.site not in shard.replicas:
        return None
    joiner, leader = sites.get(catch_up.site), sites.get(shard.leader)
    if joiner is None or leader is None or not joiner.answered or not leader.answered:
        return catch_up
    if is_gone(joiner, now, settings) or is_gone(leader, now, settings):
        return catch_up
    if joiner.placement_version is None or joiner.placement_version < catch_up.version:
        return catch_up
    leader_report = leader.shards.get(catch_up.shard)
    joiner_report = joiner.shards.get(catch_up.shard)
    if leader_report is None or joiner_report is None:
        return catch_up
    if catch_up.target is None:
        catch_up = replace(catch_up, target=leader_report.committed)
    assert catch_up.target is not None
    return None if joiner_report.applied >= catch_up.target else catch_up


def _blocked(step: Transition, placement: Placement, sites: Mapping[str, SiteState],
             now: float, settings: Settings, given: int) -> str | None:
    """Why `step` may not go now, or None. Every step waits until the shard's leader
    has taken placement version `given`, the last the sites were given
    (`_leader_behind`); a step that takes a replica away waits until a majority of the
    replicas it leaves hold what the leader committed (`_short_of_majority`)."""
    shard = placement.shard(step.database, step.shard)
    if step.action == "add":
        joiner = sites.get(step.site)
        if joiner is None or not joiner.answered or is_gone(joiner, now, settings):
            return f"{step.site} is down"
        # No majority asked of the set it makes: the joiner holds nothing yet, and an
        # add must be able to replace a replica that is down. One site more keeps every
        # majority of the new set overlapping every majority of the old one; the
        # catch-up then holds the next step until the joiner has what was committed.
        leader = sites.get(shard.leader)
        if leader is None or not leader.answered or is_gone(leader, now, settings):
            # A shard whose leader is gone with no majority left to fail over to (two
            # replicas, one of them dead) gets one back by this add; a leader that is
            # gone commits nothing meanwhile that the new set could outvote.
            return None
        return _leader_behind(shard, given, sites, now, settings)
    if step.leader is not None:
        # A handover: the successor must hold what the leader committed, or the new
        # epoch would start without acknowledged writes.
        leader, successor = sites.get(shard.leader), sites.get(step.leader)
        if successor is None or not successor.answered or is_gone(successor, now, settings):
            return f"the next leader {step.leader} is down"
        if leader is None or is_gone(leader, now, settings):
            return None  # failover's business: the successor's log is the best there is
        leader_report = leader.shards.get(step.shard_id)
        successor_report = successor.shards.get(step.shard_id)
        if leader_report is None or successor_report is None:
            return "positions not reported yet"
        if successor_report.applied < leader_report.committed:
            return (f"{step.leader} has applied {successor_report.applied} of "
                    f"{leader_report.committed} committed")
    behind = _leader_behind(shard, given, sites, now, settings)
    if behind is not None:
        return behind
    remaining = tuple(site for site in shard.replicas if site != step.site)
    return _short_of_majority(shard, remaining, sites, now, settings)


def _leader_behind(shard: ShardPlacement, version: int, sites: Mapping[str, SiteState],
                   now: float, settings: Settings) -> str | None:
    """Why the shard's leader is not known to commit with the replica set of placement
    `version` yet, or None. Until it reports that version it may still count the
    replicas the last step took away, and a second change on top of the first could
    leave what it committed on a minority (issue 22, defect 1)."""
    leader = sites.get(shard.leader)
    if leader is None or not leader.answered or is_gone(leader, now, settings):
        return f"the leader {shard.leader} is down"
    if leader.placement_version is None or leader.placement_version < version:
        return (f"the leader {shard.leader} has not taken placement version {version} "
                f"yet (it reports {leader.placement_version})")
    if leader.shards.get(shard.id) is None:
        return f"the leader {shard.leader} has not reported the shard yet"
    return None


def holds_committed(report: ShardReport, leader_report: ShardReport) -> bool:
    """Whether a replica reporting `report` holds every entry up to the offset the
    leader reporting `leader_report` knows committed: it knows that offset committed
    itself, or its log ends in the leader's last epoch at or past it (entries of one
    epoch come from that epoch's one leader, so the two logs agree up to there)."""
    target = leader_report.committed
    return report.committed >= target or (
        report.last[0] == leader_report.last[0] and report.last[1] >= target)


def _short_of_majority(shard: ShardPlacement, remaining: Sequence[str],
                       sites: Mapping[str, SiteState], now: float,
                       settings: Settings) -> str | None:
    """Why the replica set `remaining` (what a step leaves of `shard`) may not be the
    shard's yet, or None: fewer than a majority of it hold what the leader committed,
    so a failover among it could pick a replica without acknowledged writes."""
    leader = sites[shard.leader]
    leader_report = leader.shards[shard.id]
    holding = []
    for name in remaining:
        found = sites.get(name)
        if found is None or not found.answered or is_gone(found, now, settings):
            continue
        report = found.shards.get(shard.id)
        if report is not None and holds_committed(report, leader_report):
            holding.append(name)
    needed = len(remaining) // 2 + 1
    if len(holding) >= needed:
        return None
    return (f"{len(holding)} of the {len(remaining)} replicas it leaves "
            f"({', '.join(holding) or 'none'}) hold offset {leader_report.committed}, "
            f"committed by {shard.leader}; {needed} must")


def resumed_catch_ups(plan_: Plan, placement: Placement) -> tuple[CatchUp, ...]:
    """After a restart: the replicas that may still be catching up, seen again (their
    target: the leader's committed offset now, which is no less than when they
    joined). Which of them had caught up before the restart is not kept, so every
    `+site` taken whose shard has a step left, and the last step taken if it is a
    `+site`, is watched again: one that has caught up passes in a round."""
    try:
        remaining = plan_.remaining(placement)
    except PlanError:
        return ()
    done = len(plan_.transitions) - len(remaining)
    if done <= 0:
        return ()
    left = {step.shard_id for step in remaining}
    latest: dict[ShardId, CatchUp | None] = {}
    for number, step in enumerate(plan_.transitions[:done]):
        joined = step.action == "add" and (step.shard_id in left or number == done - 1)
        latest[step.shard_id] = (CatchUp(shard=step.shard_id, site=step.site,
                                         version=placement.version) if joined else None)
    return tuple(catch_up for catch_up in latest.values() if catch_up is not None)


# --- requests ----------------------------------------------------------------------------

def _check_ready(state: ClusterState, database: str, settings: Settings) -> None:
    if database not in settings.databases:
        raise UnknownDatabaseError(f"no database {database!r} (the cluster has: "
                                   f"{', '.join(settings.databases)})")
    if database not in state.placement.databases():
        raise ClusterNotReadyError(f"{database} has no placement yet: too few sites have "
                                   f"answered so far")


def goal_of(state: ClusterState, database: str) -> tuple[str, ...]:
    """The sites `database` should live on: the last goal set, else where it is."""
    found = state.goals.get(database)
    if found is not None:
        return tuple(found)
    return tuple(sorted({site for shard in state.placement.shards_of(database)
                         for site in shard.replicas}))


def set_replicas(state: ClusterState, database: str, wanted: Collection[str],
                 sites: Mapping[str, SiteState], now: float,
                 settings: Settings) -> ClusterState:
    """The state with `database` to be moved onto exactly the sites `wanted`: a new
    plan from the current placement (replacing any pending one). Raises, changing
    nothing, for an unknown database or site, a site that would join while down,
    fewer sites than the replication factor, or no replica left."""
    _check_ready(state, database, settings)
    goal = tuple(sorted(set(wanted)))
    unknown = sorted(set(goal) - set(sites))
    if unknown:
        raise UnknownSiteError(f"unknown site(s) {', '.join(unknown)} (known: "
                               f"{', '.join(sorted(sites)) or 'none'})")
    holders = {site for shard in state.placement.shards_of(database) for site in shard.replicas}
    down = sorted(site for site in set(goal) - holders
                  if not sites[site].answered or is_gone(sites[site], now, settings))
    if down:
        raise SiteStateError(f"site(s) {', '.join(down)} are down: a replica cannot be "
                             f"placed there now")
    goals = {**state.goals, database: goal}
    new = plan_goals(state.placement, {database: goal}, sites, settings)
    return replace(state, plan=new if new.transitions else None, goals=goals)


def join(state: ClusterState, database: str, site: str, sites: Mapping[str, SiteState],
         now: float, settings: Settings) -> ClusterState:
    _check_ready(state, database, settings)
    return set_replicas(state, database, {*goal_of(state, database), site}, sites, now,
                        settings)


def leave(state: ClusterState, database: str, site: str, sites: Mapping[str, SiteState],
          now: float, settings: Settings) -> ClusterState:
    _check_ready(state, database, settings)
    if site not in sites:
        raise UnknownSiteError(f"unknown site {site} (known: {', '.join(sorted(sites))})")
    return set_replicas(state, database, set(goal_of(state, database)) - {site}, sites, now,
                        settings)


def forget(state: ClusterState, site: str, sites: Mapping[str, SiteState], now: float,
                 settings: Settings) -> ClusterState:
    """The state without `site` in any goal. Only a site that is down and holds no
    replica (now, or in the pending plan's target) may be forgotten."""
    found = sites.get(site)
    if found is None:
        raise UnknownSiteError(f"unknown site {site} (known: {', '.join(sorted(sites))})")
    if found.answered and not is_gone(found, now, settings):
        raise SiteStateError(f"site {site} is up: stop it before forgetting it")
    held = [str(shard.id) for shard in state.placement.shards if site in shard.replicas]
    if state.plan is not None and site in state.plan.target.sites():
        held.append("the pending plan's target")
    if held:
        raise SiteStateError(f"site {site} still holds replicas ({len(held)} shards): "
                             f"move them off first (`ctl ds leave DB {site}`)")
    goals = {database: tuple(other for other in wanted if other != site)
             for database, wanted in state.goals.items()}
    return replace(state, goals=goals)


def leader_changes(before: Placement, after: Placement) -> int:
    """Shards of `before` whose leader is another in `after`."""
    changed = 0
    for shard in before.shards:
        try:
            changed += int(after.shard(*shard.id).leader != shard.leader)
        except PlacementError:
            continue
    return changed
