"""The words the operator writes into status: a DurableStorage's phase, its
conditions' types and reasons, a ReplicaTransition's phase and reason, and the reasons
of the Events it posts. Each is a StrEnum, so
a member is the very string the API server stores (and compares equal to what a
status read back holds); the CRDs' enums of phases are checked against these
(tests/unit/test_operator_phases.py)."""

from __future__ import annotations

from enum import StrEnum


class StoragePhase(StrEnum):
    """`status.phase` of a DurableStorage (status.py says when each holds)."""

    PENDING = "Pending"
    ROLLING = "Rolling"
    SCALING = "Scaling"
    READY = "Ready"
    REBALANCING = "Rebalancing"
    DEGRADED = "Degraded"
    FAILED = "Failed"  # a spec the broker would refuse


class ConditionType(StrEnum):
    READY = "Ready"
    DEGRADED = "Degraded"
    REBALANCING = "Rebalancing"


class Reason(StrEnum):
    """Why a storage is in its phase (the Ready and Degraded conditions' reason), and
    the Rebalancing condition's reasons."""

    ROLLING_OUT = "RollingOut"
    ROLLOUT_STUCK = "RolloutStuck"
    SCALING = "Scaling"
    NO_LEADER = "NoLeader"
    SITES_NOT_READY = "SitesNotReady"
    PLACING = "Placing"
    UNDER_REPLICATED = "UnderReplicated"
    NO_PLAN = "NoPlan"
    PLANNING = "Planning"
    PLAN_RUNNING = "PlanRunning"
    ALL_SITES_READY = "AllSitesReady"
    INVALID_CONFIG = "InvalidConfig"
    NOT_PLACED = "NotPlaced"
    BALANCED = "Balanced"


class TransitionPhase(StrEnum):
    """`status.phase` of a ReplicaTransition: a `+site` step goes Pending,
    (Bootstrapping,) CatchingUp, Joined, Done; a `-site` step Pending, Removing, Done;
    either may end Failed (its plan was made again)."""

    PENDING = "Pending"
    BOOTSTRAPPING = "Bootstrapping"
    CATCHING_UP = "CatchingUp"
    JOINED = "Joined"
    REMOVING = "Removing"
    DONE = "Done"
    FAILED = "Failed"


class TransitionReason(StrEnum):
    """`status.reason` of a ReplicaTransition that ended Failed."""

    REPLANNED = "Replanned"  # its plan was made again before it ended


class EventReason(StrEnum):
    """The reasons of the Events the operator posts on a storage, besides a new phase's
    (an Event whose reason is the StoragePhase) and a refused spec's
    (Reason.INVALID_CONFIG)."""

    RECONCILED = "Reconciled"  # its objects applied for a generation
    FAILOVER = "Failover"  # a shard's leader gone: another replica leads (Warning)
    LEADER_HANDOVER = "LeaderHandover"  # a stopping leader handed its shard over
    CONTROLLER_FENCED = "ControllerFenced"  # the sites hold another controller's newer term
    # a paused operator replica's controller gives way to the term another one kept
    CONTROLLER_HANDED_BACK = "ControllerHandedBack"
    PLACEMENT_REFUSED = "PlacementRefused"  # a site keeps a newer placement than pushed
    PLACEMENT_ADOPTED = "PlacementAdopted"  # the sites' placement taken over the kept one


# The order in which a step's phases follow each other.
ADD_PHASES = (TransitionPhase.PENDING, TransitionPhase.BOOTSTRAPPING,
              TransitionPhase.CATCHING_UP, TransitionPhase.JOINED, TransitionPhase.DONE)
REMOVE_PHASES = (TransitionPhase.PENDING, TransitionPhase.REMOVING, TransitionPhase.DONE)
# A step in one of these phases moves no more.
FINAL_PHASES = (TransitionPhase.DONE, TransitionPhase.FAILED)


class PlanTrigger(StrEnum):
    """Why the controller made a plan (`status.rebalance.trigger`, and an annotation
    on each of its ReplicaTransitions, so that a restarted operator still knows)."""

    SCALE = "Scale"  # spec.sites changed: the goal has more or fewer sites
    SITE_REPLACED = "SiteReplaced"  # as many sites, another one among them (a new volume)
    REPLICATION_FACTOR = "ReplicationFactor"  # spec.messages.replicationFactor changed
    FAILOVER = "Failover"  # the plan running was made again around a failover
    UNKNOWN = "Unknown"  # resumed, made by an operator that did not say why


class PlanResult(StrEnum):
    """`status.rebalance.result`: where the plan summarised stands."""

    RUNNING = "Running"
    DONE = "Done"
    REPLACED = "Replaced"  # made again before it ended (its steps left are Failed)
