"""The operator as the replication controller of each DurableStorage (docs/replication.md,
"The controller": in Kubernetes the controller is the operator).

One `StorageController` per DurableStorage does what `stratamq cluster controller`
does on a plain machine, with the same pure decisions (`broker/controller/decisions.py`)
and the same site API: every round it asks each pod's `GET /api/v1/ds/replication`,
lets `decisions` choose (first placement, failover, the next step of a plan), keeps
the result in the DurableStorage's `status.controller` (kept_state.py) BEFORE it
pushes anything (so a restarted operator, or another replica of it, resumes from
there and never hands out an older placement), then pushes `PUT /api/v1/ds/placement`
with the peers map (the sites' client: sites.py).

What is Kubernetes' own here:
- the sites each database should live on (the goal) are those of the pods with an
  ordinal below spec.sites; the departing pods' replicas are planned away, and the
  StatefulSet keeps them (`kept_pods`) until they hold none;
- each step of a plan is a ReplicaTransition object whose phase follows the step
  (transitions.py);
- a site whose pod is gone and that holds nothing is forgotten: kept in
  status.controller and told to the sites with every push (they adopt the sessions it
  owned); found again (its pod back with its volume), it is not forgotten any more.
- the controller term (docs/replication.md, "The controller"): Kopf's peering and the
  conditional writes of status.controller already keep one operator acting, so the
  operator takes a term above every term the sites report on its first round, keeps
  it in status.controller.term and stamps its pushes with it, without the local
  controller's claim (`broker/controller/terms.py`: `TermKeeper` under
  `TermRule.FIRST_REPORTS`; the push's rules: `broker/controller/pushes.py`). A site
  that reports a newer term makes it read status.controller again: when the state
  holds that term (and none newer is reported), another replica of the operator took
  it while Kopf's peering paused this one (which acts again, so the other is paused
  or gone): this controller hands back (`handed_back`), and the handler makes a new
  one from what the API server holds now (`Controllers.hand_back`), which takes a
  term above it. At most `MAX_HAND_BACKS` in `HAND_BACK_WINDOW` seconds: more means
  two operators act on the storage at once (two releases watching one namespace),
  and the one fenced stays so for that window. Otherwise the term is another
  controller's (a `stratamq cluster controller` run against the same sites), and the
  operator steps aside: an error, a Warning event `ControllerFenced`, nothing pushed
  any more.
  A push refused for its placement (`accepted: false`: the site keeps a newer one) is a
  Warning event `PlacementRefused`, and the next round adopts what the sites keep
  (`decisions.adopt`), as the local controller does.

Shared with the local controller: the decisions, the term rule, the push's rules
(`broker/controller/pushes.py`), the probes of every site at once with a deadline
(`broker/controller/probing.py`, through `sites.probe_all`) and the port the state is
kept through (`broker/controller/store.py`; `KeptState` here). The round itself is
each one's own: `broker/controller/controller.py` says why one skeleton for both would
change what either does. The term and the pushes of a round: storage_pushes.py.

Blocking (urllib and the `kubernetes` client): the Kopf timer that runs a round is a
sync handler, run in Kopf's thread pool like every other handler of this operator.
Readers in other threads (the status refresh, the reconcile, /metrics) see the
controller's state through attributes that a round replaces whole, never mutates.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from stratamq.broker.controller import decisions, disruption
from stratamq.broker.controller.decisions import ClusterState, LeaderMove, Settings, is_gone
from stratamq.broker.controller.metrics import Snapshot
from stratamq.broker.controller.sites import (
    Refused,
    Report,
    SiteState,
)
from stratamq.broker.controller.store import KeepRefused
from stratamq.broker.controller.terms import TermKeeper, TermRule, newer_term
from stratamq.broker.ds.replication import Transition
from stratamq.broker.ds.replication.term import ControllerTerm
from stratamq.broker.errors import PlanError, StratamqError

from . import kube
from .kept_state import KeptState, StatusRecord, known_sites
from .phases import EventReason, PlanTrigger
from .rebalance import summary
from .resources import API_VERSION, KIND, Owner
from .sites import Bootstraps, probe_all
from .spec import DEFAULT_HISTORY_LIMIT, StorageSpec
from .status import ReplicationView
from .storage_pushes import StoragePushes
from .times import timestamp
from .transitions import (
    STORAGE_LABEL,
    TRANSITION_API,
    TRANSITION_KIND,
    Transitions,
)

log = logging.getLogger(__name__)

# Every replicated database of a site (docs/replication.md), placed alike: the same
# sites, shard count (messages.nShards) and replication factor.
DATABASES = decisions.REPLICATED_DATABASES
EVENT_COMPONENT = "stratamq-operator"
# A storage's controllers hand back (another replica of the operator took the term)
# at most this many times in this many seconds: more means two operators act at once.
MAX_HAND_BACKS = 3
HAND_BACK_WINDOW = 600.0


def ordinal(pod: str) -> int:
    """A StatefulSet pod's ordinal: `mq-3` -> 3."""
    return int(pod.rsplit("-", 1)[1])


def settings_of(spec: StorageSpec, heartbeat: float) -> Settings:
    return Settings(replication_factor=spec.replication_factor, n_shards=spec.n_shards,
                    heartbeat_interval=heartbeat, databases=DATABASES,
                    expected_sites=spec.sites,
                    max_concurrent_moves=spec.max_concurrent_moves)


def seen_on(known: SiteState, report: Report, pod: kube.PodView, now: float) -> SiteState:
    """The site as it answered the probe, in the zone of its pod's node. The operator
    reads the node's zone itself (`kube.site_pods`): the downward API cannot give a
    pod its node's labels, so the site cannot report it. What the site reports
    (`cluster.zone`, unset under the operator) counts only where the node has no
    zone."""
    seen = known.seen(report, now)
    return seen if pod.zone is None else replace(seen, zone=pod.zone)


def storage_event(owner: Owner, kind: str, reason: str, message: str, now: str
                  ) -> dict[str, Any]:
    """An Event of `kind` (Normal, Warning) on the storage, as the operator posts it
    itself (not through Kopf: from the controller's thread, outside Kopf's handlers)."""
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{owner.name}.", "namespace": owner.namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name,
                               "namespace": owner.namespace, "uid": owner.uid},
            "type": kind, "reason": reason, "message": message,
            "source": {"component": EVENT_COMPONENT},
            "reportingComponent": EVENT_COMPONENT, "reportingInstance": EVENT_COMPONENT,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1}


def leader_move_event(owner: Owner, move: LeaderMove, pods: Mapping[str, str], now: str
                      ) -> dict[str, Any]:
    """The Event on the storage for a failover (Warning) or a handover (Normal) the
    controller performed: the shard, the old and new leader with their pods, the new
    epoch."""
    def named(site: str) -> str:
        return f"{site} (pod {pods[site]})" if pods.get(site) else site
    database, shard = move.shard
    why = ("its leader is stopping" if move.handover
           else "its leader is gone or hears no majority of its replicas")
    return storage_event(
        owner, "Normal" if move.handover else "Warning",
        EventReason.LEADER_HANDOVER if move.handover else EventReason.FAILOVER,
        f"{database}/{shard}: {why}; leader {named(move.old_leader)} -> "
        f"{named(move.new_leader)} at epoch {move.epoch}", now)


def plan_trigger(old_goals: list[tuple[str, ...]], goal: tuple[str, ...],
                 replica_counts: list[int], factor: int) -> tuple[str, str]:
    """Why `_follow_goal` plans: the databases' goals (`old_goals` of those that
    move) are not `goal` any more (more or fewer sites: a scale; as many: a site
    replaced), and/or shards have `replica_counts` other than the replication
    `factor`. (trigger, message)."""
    reasons: list[tuple[str, str]] = []
    if old_goals:
        old = old_goals[0]
        if len(old) != len(goal):
            reasons.append((PlanTrigger.SCALE, f"sites {len(old)} -> {len(goal)}"))
        else:
            reasons.append((PlanTrigger.SITE_REPLACED, f"site(s) "
                            f"{', '.join(sorted(set(old) - set(goal)))} replaced by "
                            f"{', '.join(sorted(set(goal) - set(old)))}"))
    if replica_counts:
        counts = "/".join(str(count) for count in sorted(set(replica_counts)))
        reasons.append((PlanTrigger.REPLICATION_FACTOR,
                        f"replication factor {counts} -> {factor}"))
    if not reasons:
        return PlanTrigger.UNKNOWN, ""
    return reasons[0][0], "; ".join(message for _, message in reasons)


# --- one storage's controller ----------------------------------------------------------

@dataclass(frozen=True)
class GoalFollowed:
    """What `follow_goal` found: the state (with the new plan and goals when it made
    one); whether the goal may still change (`unsettled`: then nothing else is said);
    why the goal has no plan ("": it has one, or needs none); and when it made a plan,
    why (trigger, message) and what the plan does (`planned`, for the log)."""

    state: ClusterState
    unsettled: bool = False
    no_plan: str = ""
    trigger: tuple[str, str] | None = None
    planned: str = ""


def follow_goal(state: ClusterState, storage: str, sites_asked: int,
                sites: Mapping[str, SiteState], site_pods: Mapping[str, str],
                settings: Settings) -> GoalFollowed:
    """A new plan when the sites of the pods below spec.sites (`sites_asked` pods of
    the StatefulSet `storage`) are not the goal any more (scaled up or down), or the
    shards' replica sets are not of spec.messages.replicationFactor (changed); only
    once each of those pods has a known site, so a scale-up makes one plan, not one per
    pod as they come. Every placed database is planned to the same sites, in one plan.
    `site_pods`: site -> its pod."""
    wanted_pods = {f"{storage}-{number}" for number in range(sites_asked)}
    by_pod = {pod: site for site, pod in site_pods.items() if site in sites}
    if not wanted_pods <= set(by_pod):
        return GoalFollowed(state, unsettled=True)
    goal = tuple(sorted(by_pod[pod] for pod in wanted_pods))
    placed = [database for database in DATABASES
              if database in state.placement.databases()]
    heading = state.placement if state.plan is None else state.plan.target
    factor = settings.replication_factor
    moved = [database for database in placed
             if tuple(decisions.goal_of(state, database)) != goal]
    refactored = [database for database in placed
                  if any(len(shard.replicas) != factor
                         for shard in heading.shards_of(database))]
    if not moved and not refactored:
        return GoalFollowed(state)
    try:
        new = decisions.plan_goals(state.placement, dict.fromkeys(placed, goal), sites,
                                   settings)
    except StratamqError as error:
        return GoalFollowed(state, no_plan=(f"no plan to {', '.join(goal)} at replication "
                                            f"factor {factor}: {error}"))
    trigger = plan_trigger(
        [decisions.goal_of(state, database) for database in moved], goal,
        [len(shard.replicas) for database in refactored
         for shard in heading.shards_of(database)], factor)
    planned = (f"{', '.join(placed)} to live on {', '.join(goal)} at replication factor "
               f"{factor}; plan: {'; '.join(new.describe()) or 'nothing to do'}")
    return GoalFollowed(replace(state, plan=new if new.transitions else None,
                                goals={**state.goals, **dict.fromkeys(placed, goal)}),
                        trigger=trigger, planned=planned)


def pods_to_keep(state: ClusterState, site_pods: Mapping[str, str], sites_asked: int) -> int:
    """Pods the StatefulSet must keep: spec.sites (`sites_asked`), and more while a pod
    above holds replicas (now or in the pending plan's target): the highest ordinals
    go last, once their replicas have moved. `site_pods`: site -> its pod."""
    held = set(state.placement.sites())
    if state.plan is not None:
        held |= state.plan.target.sites()
    keep = sites_asked
    for site in held:
        pod = site_pods.get(site)
        if pod is not None:
            keep = max(keep, ordinal(pod) + 1)
    return keep


def departed(state: ClusterState, sites: Mapping[str, SiteState],
             site_pods: Mapping[str, str], pod_names: Collection[str], now: float,
             settings: Settings) -> dict[str, str | None]:
    """The sites to forget (site -> its pod, None when it has none): their pod is gone
    (scaled away: not among `pod_names`), they hold nothing (now or in the pending
    plan's target), and they do not answer, or are gone."""
    held = set(state.placement.sites())
    if state.plan is not None:
        held |= state.plan.target.sites()
    found: dict[str, str | None] = {}
    for site in sites:
        pod = site_pods.get(site)
        gone = pod is None or pod not in pod_names
        if gone and site not in held and (not sites[site].answered
                                           or is_gone(sites[site], now, settings)):
            found[site] = pod
    return found


def replication_view(state: ClusterState, up: set[str], factor: int, *, rebalancing: bool,
                     generation: int, no_plan: str, waiting: str,
                     rebalance: dict[str, Any] | None) -> ReplicationView:
    """What the status shows of replication at `state`, with the sites `up` (those that
    answer and are not gone) and the replication `factor`; `rebalancing`: the goal may
    still change (a plan is coming), the rest as ReplicationView has them."""
    remaining: tuple[Transition, ...] = ()
    if state.plan is not None:
        try:
            remaining = state.plan.remaining(state.placement)
        except PlanError:
            remaining = state.plan.transitions
    databases, total_under, leaderless = [], 0, 0
    for database in state.placement.databases():
        shards, under = [], 0
        for shard in state.placement.shards_of(database):
            short = len([site for site in shard.replicas if site in up]) < factor
            under += int(short)
            leaderless += int(shard.leader not in up)
            shards.append({"shard": shard.shard, "leader": shard.leader,
                           "leaderEpoch": shard.epoch, "replicas": sorted(shard.replicas),
                           "underReplicated": short})
        pending = len([step for step in remaining if step.database == database])
        databases.append({"name": database, "placementVersion": state.placement.version,
                          "underReplicatedShards": under, "pendingTransitions": pending,
                          "shards": shards})
        total_under += under
    return ReplicationView(
        placed=set(DATABASES) <= set(state.placement.databases()), databases=databases,
        under_replicated=total_under, leaderless=leaderless, pending=len(remaining),
        rebalancing=state.plan is not None or rebalancing, generation=generation,
        no_plan=no_plan, waiting=waiting, rebalance=rebalance)


class StorageController:
    """One DurableStorage's replication controller: its rounds (probe, decide, keep,
    push), and what the handlers and /metrics read of it: a round's steps read and
    replace one set of attributes (the state, the sites, their pods and URLs) that
    `view`, `kept_pods` and `tolerated_disruptions` read from other threads under one
    lock. What it decides is elsewhere and pure (`broker/controller/decisions.py`,
    `terms.py`, `pushes.py`, `follow_goal`, `departed`, `pods_to_keep`,
    `replication_view`); its collaborators do the rest: `store` (a `StateStore`:
    `KeptState`, status.controller and its conditional writes), and, built here,
    `pushes` (`StoragePushes`: the term, the pushes and their answers) and
    `Transitions` (the ReplicaTransitions and status.rebalance)."""

    def __init__(self, owner: Owner, settings: Settings, store: KeptState,
                 history_limit: int = DEFAULT_HISTORY_LIMIT) -> None:
        self.owner = owner
        self.settings = settings
        self.started = time.monotonic()
        # When its last round ran (monotonic; None before one): a replica of the
        # operator that Kopf's peering paused runs none, and what it knows is stale.
        self.last_round_at: float | None = None
        self.store = store
        kept = store.load()
        self.state, self.pods = kept.state, dict(kept.pods)
        self.sites = known_sites(kept, self.started)
        self.forgotten = set(kept.forgotten)
        # the sites as of the round before (what tolerated_disruptions measures against)
        self.earlier_sites: Mapping[str, SiteState] = {}
        self.urls: dict[str, str] = {}  # site -> admin URL (the pod's IP: it changes)
        self.leader_changes = 0
        self.notes: tuple[str, ...] = ()
        # The pods below spec.sites are not (all) known sites yet, so the goal may
        # still change: counted as rebalancing, so that no status says Ready between
        # a scale and its plan.
        self.goal_unsettled = False
        self._unsettled = False
        # The storage's metadata.generation whose spec the last published round followed:
        # a status read from a newer spec (a scale) is not Ready on this round's word.
        self.round_generation = 0
        self._no_plan = ""  # why the goal has no plan (said once)
        self.no_plan = ""  # ... as of the last published round
        self._publish_lock = threading.Lock()
        self._round_lock = threading.Lock()
        # the controller term: taken on the first round with reports (above the kept one
        # and every one reported), kept in status.controller, stamped on every push
        self.term_keeper = TermKeeper(TermRule.FIRST_REPORTS,
                                       f"operator-{secrets.token_hex(4)}", kept.term)
        self.pushes = StoragePushes(owner, self.term_keeper)
        # Another replica of the operator kept a newer term while this one was paused:
        # this controller is done, the handler makes a new one (`Controllers.hand_back`).
        self.handed_back = False
        # the term it gave way to (with `handed_back`), for the Event said of it
        self.handed_back_to: ControllerTerm | None = None
        # Until when handing back is refused (two operators acting at once): fenced
        # like by any other controller meanwhile.
        self.yield_refused_until = 0.0
        # Another operator kept its state since this one's last round (loaded): what
        # this one applied is not known to be there any more (the handler's to say).
        self.others_acted = False
        # Why this round's _follow_goal made a plan: (trigger, message).
        self._round_trigger: tuple[str, str] | None = None
        self.transitions = Transitions(owner, self.state.plan, history_limit)
        if self.state.plan is not None:
            log.info("%s/%s: resuming a plan at placement version %d", owner.namespace,
                     owner.name, self.state.placement.version)

    # -- one round ------------------------------------------------------------------------

    def round(self, spec: StorageSpec, generation: int, pods: list[kube.PodView],
              token: str) -> None:
        """One round, following `spec` (of the storage's metadata.`generation`)."""
        with self._round_lock:
            if not self.handed_back:
                self._round(spec, generation, pods, token)

    def _round(self, spec: StorageSpec, generation: int, pods: list[kube.PodView],
               token: str) -> None:
        self.last_round_at = time.monotonic()
        self.settings = settings_of(spec, self.settings.heartbeat_interval)
        self._round_trigger = None
        port = spec.admin_port
        # Terminating pods too: a site that got its SIGTERM reports `stopping` and
        # serves on until its leaderships are handed over (cluster.handover_timeout).
        # Skipping them made every pod deletion and every roll a failover.
        reachable = [pod for pod in pods if pod.ip]
        reports = list(zip(reachable, probe_all(
            [f"http://{pod.ip}:{port}" for pod in reachable], token), strict=True))
        now = time.monotonic()
        sites, site_pods, urls = dict(self.sites), dict(self.pods), dict(self.urls)
        forgotten = set(self.forgotten)
        boots: dict[str, Bootstraps] = {}
        for pod, probed in reports:
            if isinstance(probed, Refused):
                # nothing listens at the pod's address: its site is down now
                for site, name in site_pods.items():
                    if name == pod.name and site in sites:
                        sites[site] = replace(sites[site], refused=True)
                continue
            if probed is None:
                continue
            report, boots[report.site] = probed
            known = sites.get(report.site) or SiteState(id=report.site, admin_url="",
                                                        last_seen=now)
            if report.site not in self.sites:
                log.info("%s/%s: site %s found on pod %s (peer %s)", self.owner.namespace,
                         self.owner.name, report.site, pod.name, report.peer)
            forgotten.discard(report.site)  # back, if it was (a pod with its volume)
            sites[report.site] = seen_on(known, report, pod, now)
            site_pods[report.site] = pod.name
            urls[report.site] = f"http://{pod.ip}:{port}"
        reported = {site: sites[site].term for site in boots}
        if self._yields_to_kept_term(reported):
            return  # the handler makes a new controller from the kept state
        if not self.pushes.hold_term(reported, self.state.placement):
            return
        state = self.state
        if self.pushes.refused or decisions.behind(state, sites):
            state = self.pushes.adopt_held(state, sites, urls, token)
        for site, gone_pod in departed(state, sites, site_pods,
                                       {pod.name for pod in pods}, now, self.settings).items():
            del sites[site]
            site_pods.pop(site, None)
            forgotten.add(site)
            log.info("%s/%s: site %s (pod %s) is gone and holds nothing: forgotten",
                     self.owner.namespace, self.owner.name, site, gone_pod)
        state = self._follow_goal(state, spec, sites, site_pods)
        decision = decisions.decide(state, sites, now, self.started, self.settings)
        notes = decision.notes
        if notes != self.notes:
            for note in notes:
                log.info("%s/%s: %s", self.owner.namespace, self.owner.name, note)
        before = self.state.placement
        # Kept before anything is pushed: a site must never hold a placement that a
        # restarted operator does not know. Refused: the storage is gone, or another
        # operator wrote its state since (loaded instead of this round's).
        kept = self.store.keep(StatusRecord(
            decision.state, {site: sites[site].peer for site in sites}, site_pods,
            frozenset(forgotten), self.term_keeper.last_term))
        if isinstance(kept, KeepRefused):
            if kept.theirs is not None:
                self._adopt(kept.theirs)
            return
        # Kept: the failovers are this operator's; said before the status can show them.
        for move in decision.leader_moves:
            self._post(leader_move_event(self.owner, move, site_pods,
                                         timestamp(time.time())))
        with self._publish_lock:  # what view() reads, all of one round
            self.earlier_sites = self.sites
            self.sites, self.pods, self.urls = sites, site_pods, urls
            self.forgotten = forgotten
            self.state, self.notes = decision.state, notes
            self.goal_unsettled = self._unsettled
            self.round_generation = generation
            self.no_plan = self._no_plan
        if decision.state.placement != before:
            self.leader_changes += decisions.leader_changes(before, decision.state.placement)
        self.pushes.push(self.state.placement, self.sites, self.urls, self.forgotten, token)
        versions = {site.id: site.placement_version for site in self.sites.values()
                    if site.answered and not is_gone(site, time.monotonic(), self.settings)}
        self.transitions.follow(self.state, self.pods, boots, versions, self._round_trigger,
                                spec.history_limit)

    def post_event(self, kind: str, reason: str, message: str) -> None:
        """Post an Event of `kind` on the storage (see `_post`)."""
        self._post(storage_event(self.owner, kind, reason, message, timestamp(time.time())))

    def _post(self, event: dict[str, Any]) -> None:
        """Post an Event; one the API server refuses is logged, not the round's end."""
        try:
            kube.create(event)
        except kube.API_ERRORS as error:
            log.warning("%s/%s: event %s not posted: %s", self.owner.namespace,
                        self.owner.name, event["reason"], kube.error_reason(error))

    def _yields_to_kept_term(self, reported: Mapping[str, ControllerTerm | None]) -> bool:
        """When a site reports a term newer than this operator's (or one fenced it),
        read status.controller again: if it holds that term, another replica of the
        operator took it while this one was paused by Kopf's peering
        (`TermKeeper.yields_to`); this controller hands back (`handed_back`: nothing
        more of it is to be used) and True."""
        keeper = self.term_keeper
        if time.monotonic() < self.yield_refused_until or (keeper.fenced_by is None and (
                keeper.term is None or newer_term(keeper.term, reported.values()) is None)):
            return False
        record = self.store.reload()
        if record is None or not keeper.yields_to(record.term, reported.values()):
            return False
        log.warning("%s/%s: the sites hold controller term %s, which another replica of "
                    "the operator took and kept in status.controller (a Kopf peering "
                    "hand-over): handing back, to go on from the state kept",
                    self.owner.namespace, self.owner.name, record.term)
        self.handed_back = True
        self.handed_back_to = record.term
        return True

    def _adopt(self, theirs: StatusRecord) -> None:
        """Take the state another operator kept (this one's round is dropped)."""
        log.warning("%s/%s: another operator wrote the controller's state since this one "
                    "read it: loaded, nothing pushed this round", self.owner.namespace,
                    self.owner.name)
        self._load(theirs)
        self.others_acted = True

    def _load(self, theirs: StatusRecord) -> None:
        """Go on from `theirs`, the state another operator kept (its term a floor of
        the next this one keeps: never written back below it)."""
        self.term_keeper.last_term = max(self.term_keeper.last_term, theirs.term)
        sites = known_sites(theirs, time.monotonic())
        with self._publish_lock:
            self.state, self.sites = theirs.state, sites
            self.pods, self.forgotten = dict(theirs.pods), set(theirs.forgotten)
        self.pushes.tell_again()

    def _follow_goal(self, state: ClusterState, spec: StorageSpec,
                     sites: Mapping[str, SiteState], site_pods: Mapping[str, str]
                     ) -> ClusterState:
        """`follow_goal`, and what it says logged (why there is no plan: once)."""
        followed = follow_goal(state, self.owner.name, spec.sites, sites, site_pods,
                               self.settings)
        self._unsettled = followed.unsettled
        if followed.unsettled:
            return state
        if followed.no_plan and followed.no_plan != self._no_plan:  # said once, not every round
            log.warning("%s/%s: %s", self.owner.namespace, self.owner.name, followed.no_plan)
        self._no_plan = followed.no_plan
        self._round_trigger = followed.trigger
        if followed.planned:
            log.info("%s/%s: %s", self.owner.namespace, self.owner.name, followed.planned)
        return followed.state

    # -- what others read -----------------------------------------------------------------

    @property
    def in_charge(self) -> bool:
        """Whether this controller acts for the storage: it holds its term, fenced by
        no newer one."""
        return self.term_keeper.in_charge

    def kept_pods(self, sites_asked: int) -> int:
        """Pods the StatefulSet must keep (see `pods_to_keep`)."""
        with self._publish_lock:
            state, site_pods = self.state, self.pods
        return pods_to_keep(state, site_pods, sites_asked)

    def view(self) -> ReplicationView:
        with self._publish_lock:
            state, sites, unsettled = self.state, self.sites, self.goal_unsettled
            generation, no_plan = self.round_generation, self.no_plan
            waiting = "; ".join(self.notes) if state.placement.version == 0 else ""
            rebalance = self.transitions.rebalance
        now = time.monotonic()
        up = {site.id for site in sites.values()
              if site.answered and not is_gone(site, now, self.settings)}
        return replication_view(
            state, up, self.settings.replication_factor, rebalancing=unsettled,
            generation=generation, no_plan=no_plan, waiting=waiting,
            rebalance=None if rebalance is None else summary(*rebalance[:2], time.time(),
                                                             rebalance[2]))

    def tolerated_disruptions(self) -> int | None:
        """How many sites may go down at once now (broker/controller/disruption.py);
        None before the first placement."""
        with self._publish_lock:
            placement, sites, earlier = self.state.placement, self.sites, self.earlier_sites
        return disruption.tolerated_disruptions(placement, sites, earlier, time.monotonic(),
                                                self.settings)

    def snapshot(self) -> Snapshot:
        keeper = self.term_keeper
        return Snapshot(self.state, dict(self.sites), self.leader_changes,
                        term=0 if keeper.term is None else keeper.term.number,
                        fenced=keeper.fenced_by is not None)


# --- every storage's controller ----------------------------------------------------------

class Controllers:
    """Every storage's controller in this operator, by the storage's uid. One lives in
    the operator's memo, which Kopf copies (shallowly) into each storage's: the
    handlers of all storages and the metrics collector share it."""

    def __init__(self) -> None:
        self._by_uid: dict[str, StorageController] = {}
        self._lock = threading.Lock()  # handlers run in threads
        self._hand_backs: dict[str, list[float]] = {}  # uid -> when its controllers did
        self._refusing: set[str] = set()  # uids whose hand-backs are refused (said once)

    def of(self, owner: Owner, spec: StorageSpec, heartbeat: float
           ) -> StorageController | None:
        """The storage's controller, made on first use from the status the API server
        has now (not a handler's body, which may be older than the last round's write);
        None when the storage is gone."""
        with self._lock:
            found = self._by_uid.get(owner.uid)
            if found is not None:
                return found
            current = kube.get(API_VERSION, KIND, owner.namespace, owner.name)
            if current is None:
                return None
            document = (current.get("status") or {}).get("controller") or {}
            store = KeptState(owner, document, current["metadata"]["resourceVersion"])
            made = StorageController(owner, settings_of(spec, heartbeat), store,
                                     spec.history_limit)
            made.transitions.start(kube.list_labeled(
                TRANSITION_API, TRANSITION_KIND, owner.namespace,
                f"{STORAGE_LABEL}={owner.name}"), made.pods)
            self._by_uid[owner.uid] = made
            return made

    def existing(self, uid: str) -> StorageController | None:
        with self._lock:
            return self._by_uid.get(uid)

    def forget(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)
            self._hand_backs.pop(uid, None)
            self._refusing.discard(uid)

    def hand_back(self, running: StorageController, now: float) -> bool:
        """`running` handed back (`StorageController.handed_back`): forget it, so the
        next round makes a new controller from what the API server holds now; True.
        More than MAX_HAND_BACKS in HAND_BACK_WINDOW seconds mean two operators act on
        the storage at once (their terms would climb over each other's for ever):
        refused for a window (said once), `running` stays, fenced meanwhile; False."""
        uid = running.owner.uid
        with self._lock:
            times = [when for when in self._hand_backs.get(uid, [])
                     if now - when < HAND_BACK_WINDOW]
            if len(times) < MAX_HAND_BACKS:
                self._refusing.discard(uid)
                self._hand_backs[uid] = [*times, now]
                if self._by_uid.get(uid) is running:
                    del self._by_uid[uid]
                return True
            if uid not in self._refusing:  # (its fenced pushes post ControllerFenced)
                self._refusing.add(uid)
                log.error("%s/%s: the controller term changed hands %d times in %.0f s: "
                          "another operator acts on this storage at once (two releases "
                          "watching one namespace?); this one stays fenced",
                          running.owner.namespace, running.owner.name, len(times),
                          HAND_BACK_WINDOW)
            running.handed_back = False
            running.yield_refused_until = now + HAND_BACK_WINDOW
            self._hand_backs[uid] = times
        return False

    def all(self) -> list[StorageController]:
        with self._lock:
            return list(self._by_uid.values())

    def acting(self, now: float, within: float) -> list[StorageController]:
        """The controllers that ran a round in the last `within` seconds: a replica of
        the operator that Kopf's peering paused runs none, and its metrics would stand
        beside those of the one that acts, stale (their sums counted twice)."""
        return [running for running in self.all() if running.last_round_at is not None
                and now - running.last_round_at <= within]
