"""The Kopf handlers of the operator: `kopf run -m stratamq.operator.handlers` loads
this module, and importing it registers them (see operator/README.md for the command
line). The handlers are sync functions on purpose: Kopf runs those in its thread pool,
and everything they call (the `kubernetes` client, the sites' admin API) blocks.

- create / update of the spec / resume (at operator start): apply the objects, then
  refresh the status;
- a timer per storage runs the replication controller's rounds (controller.py): the
  operator IS the controller, placing shards, failing over, running plans, and
  shrinking the StatefulSet once the departing pods hold no replica;
- a timer: refresh the status (pods come and go and become ready without any change
  to the DurableStorage itself); another re-applies the objects now and then, which
  repairs drift;
- delete: nothing to undo (owner references let the garbage collector remove the
  objects); an optional handler forgets the metrics' series. Kopf still adds its
  finalizer while the operator runs, because of the timers (Kopf requires one for
  timers and daemons, to stop them before the object goes); at the operator's exit a
  cleanup handler takes it off every storage of an index of those it serves, so a
  storage deleted with (or after) the operator goes at once (operator/README.md).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import kopf
from prometheus_client import REGISTRY

from stratamq.broker.http.guard import GuardedListener

from . import controller, kube, metrics, spark
from .config import config_problems
from .phases import EventReason, Reason, StoragePhase
from .resources import (
    API_VERSION,
    GROUP,
    INSTANCE_LABEL,
    KIND,
    MANAGED_BY,
    PLURAL,
    SITE_POD_LABELS,
    VERSION,
    Manifest,
    Owner,
    applied_spec_of,
    config_map_name,
    config_maps_named,
    desired_objects,
    held_pods,
    image,
    label_selector,
    pod_disruption_budget,
    selector,
    stale_config_maps,
)
from .sites import SiteUnreachableError, site_ids
from .spec import StorageSpec, parse_spec
from .status import Observed, compute_status, invalid_conditions, known_site_ids
from .times import timestamp

log = logging.getLogger(__name__)

# Seconds between status refreshes; pods becoming ready show up within this.
STATUS_INTERVAL = float(os.environ.get("STRATAMQ_OPERATOR_STATUS_INTERVAL", "10"))
METRICS_BIND = os.environ.get("STRATAMQ_OPERATOR_METRICS_BIND", "0.0.0.0:8081")
# Seconds between the controller's rounds (its heartbeat probe of every site); a site
# that misses three in a row is taken for gone and its shards fail over.
HEARTBEAT_INTERVAL = float(os.environ.get("STRATAMQ_OPERATOR_HEARTBEAT_INTERVAL", "2"))
# Seconds between re-applying every object, which repairs drift (an object deleted or
# edited by hand) without waiting for the next change of the spec.
REAPPLY_INTERVAL = float(os.environ.get("STRATAMQ_OPERATOR_REAPPLY_INTERVAL", "300"))
# "off" where the operator serves namespaces it is given (`--namespace`) with rights in
# those only: Kopf then neither lists namespaces nor watches CRDs, which it may not
# (it would retry, log errors and fall back to the same); the CRDs are read once at
# start.
SCANNING = os.environ.get("STRATAMQ_OPERATOR_SCANNING", "on")

@dataclass
class Applied:
    """In a storage's memo (Kopf's, one per object, shared by its handlers): the
    generation whose objects were last applied here, and its spec. The timers and the
    reconcile run concurrently (in threads), each with the body it was handed; a timer
    holding an older body must not write an older observedGeneration over a newer
    one, nor apply older objects over newer ones (`applying`: one apply at a time, see
    `apply_and_note`). `running`: the spec the sites' StatefulSet was last applied
    from (by this operator or one before it), read when there is nothing else to
    follow. `stale`: another operator acted on the storage meanwhile, so the objects
    are applied again at the next round (`control`)."""

    generation: int | None = None
    spec: dict[str, Any] | None = None
    running: dict[str, Any] | None = None
    stale: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    applying: threading.Lock = field(default_factory=threading.Lock)

    def note(self, generation: int, spec: dict[str, Any] | None = None) -> None:
        with self.lock:
            if self.generation is None or generation >= self.generation:
                self.generation = generation
                self.spec = spec
                self.stale = False

    def get(self) -> int | None:
        with self.lock:
            return self.generation

    def last(self) -> tuple[dict[str, Any], int] | None:
        """(the spec, its generation) last applied here, None before one was."""
        with self.lock:
            if self.spec is None or self.generation is None:
                return None
            return self.spec, self.generation

    def forget(self) -> None:
        """Nothing applied here as far as the next handler knows: another operator
        acted on the storage meanwhile (a Kopf peering hand-over); applied again at
        the next round."""
        with self.lock:
            self.generation = self.spec = self.running = None
            self.stale = True

    def is_stale(self) -> bool:
        with self.lock:
            return self.stale


@dataclass(frozen=True)
class Following:
    """The spec a controller's round follows, of metadata.`generation` (0: not
    known), and whether its objects are applied (`applied`: the StatefulSet may be
    scaled, and the disruption budget set, by it)."""

    spec: dict[str, Any]
    generation: int
    applied: bool


def spec_to_follow(current: dict[str, Any], generation: int, applied: Applied,
                   stateful_set: Callable[[], Mapping[str, Any] | None]) -> Following | None:
    """What the controller's round follows: the storage's `current` spec of
    `generation` (applied once the reconcile applied that generation here), or, while
    the broker would refuse it (the reconcile applies nothing of it, so the sites run
    the one applied before), the spec last applied here, else the one the sites'
    StatefulSet (read through `stateful_set`, once) was last applied from: failovers
    and the disruption budget go on as they were. None when there is none."""
    if not config_problems(current):
        return Following(current, generation, applied.get() == generation)
    last = applied.last()
    if last is not None:
        return Following(last[0], last[1], True)
    with applied.lock:
        running = applied.running
    if running is None:
        running = applied_spec_of(stateful_set())
        if running is None or config_problems(running):
            return None
        with applied.lock:
            applied.running = running
    return Following(running, 0, True)


def applied_of(memo: kopf.Memo) -> Applied:
    """The storage's Applied, made at its first use (dict.setdefault is atomic)."""
    found: Applied = memo.setdefault("applied", Applied())
    return found


@dataclass
class AppliedBudget:
    """In a storage's memo: the maxUnavailable last written to its sites'
    PodDisruptionBudget. The reconcile and the controller's rounds both write it, in
    threads; one at a time, so the budget last written is the one last computed."""

    max_unavailable: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def budget_of(memo: kopf.Memo) -> AppliedBudget:
    found: AppliedBudget = memo.setdefault("disruption_budget", AppliedBudget())
    return found


def set_budget(owner: Owner, manifest: Manifest | None, applied: AppliedBudget,
               always: bool = False) -> None:
    """Write the sites' PodDisruptionBudget `manifest` (`pod_disruption_budget`; None:
    turned off) when its maxUnavailable changed (`always`: whatever it was, as the
    reconcile repairs drift)."""
    if manifest is None:
        return
    value = manifest["spec"]["maxUnavailable"]
    with applied.lock:
        if value == applied.max_unavailable and not always:
            return
        kube.apply(manifest)
        if value != applied.max_unavailable:
            log.info("%s/%s: disruption budget: %d site(s) may go down at once",
                     owner.namespace, owner.name, value)
        applied.max_unavailable = value


def applied_generation(memo: kopf.Memo, status: dict[str, Any]) -> int:
    """The generation last applied here, else the one the status last observed."""
    generation = applied_of(memo).get()
    return int(status.get("observedGeneration", 0)) if generation is None else generation


def plain(value: Any) -> Any:
    """Kopf's views of the body as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {key: plain(child) for key, child in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Kopf's own bookkeeping in annotations: the CRD's status schema has no room for
    # it (the API server would prune it).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.scanning.disabled = SCANNING == "off"
    # The sites' pods are watched for an index (site_pod_index) with a selector the API
    # server applies: the operator is sent no other pod of the cluster.
    settings.watching.label_selectors[SITE_PODS] = SITE_POD_SELECTOR
    # Peering (--peering): the operator with the highest priority acts and the others
    # pause; replicas with equal priorities would all pause, so each replica that was
    # not given a --priority draws its own.
    if settings.peering.priority == 0:
        settings.peering.priority = random.randint(1, 2**31 - 1)
    # Shared by every storage's handlers (Kopf copies this memo into each storage's).
    memo.controllers = controller.Controllers()
    # The zones of the nodes the sites run on, read once (kube.NodeZones says when again).
    memo.node_zones = kube.NodeZones()
    # One writer of status.spark at a time: events of two Jobs of one CronJob run in
    # different threads, and the one that listed first must not write last.
    memo.spark_runs_lock = threading.Lock()
    try:
        # /metrics on Kopf's loop until the operator's exit (stop_metrics)
        memo.metrics_listener = await metrics.serve(METRICS_BIND)
    except (OSError, ValueError) as error:  # a busy port, a bad address
        raise kopf.PermanentError(f"cannot serve metrics on {METRICS_BIND}: {error}") from error
    # a controller whose rounds stopped (its replica paused) for a minute exports
    # nothing (a round may take seconds: probes, API calls on a busy API server)
    memo.collector = metrics.OperatorCollector(memo.controllers,
                                               max(60.0, 5 * HEARTBEAT_INTERVAL))
    REGISTRY.register(memo.collector)
    log.info("metrics on http://%s/metrics; peering priority %d", METRICS_BIND,
             settings.peering.priority)


@kopf.on.cleanup()
async def stop_metrics(memo: kopf.Memo, **_: Any) -> None:
    collector: metrics.OperatorCollector | None = memo.pop("collector", None)
    if collector is not None:
        REGISTRY.unregister(collector)
    listener: GuardedListener | None = memo.pop("metrics_listener", None)
    if listener is not None:
        await listener.stop()


# --- the sites' pods ------------------------------------------------------------------

# Every storage's site pods (the index key carries the storage's name).
SITE_PODS = ("", "v1", "pods")
SITE_POD_SELECTOR = label_selector(SITE_POD_LABELS)
SitePods = kopf.Index[tuple[str, str], kube.SitePod]


@kopf.index(*SITE_PODS, labels=SITE_POD_LABELS)
def site_pod_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                   **_: Any) -> dict[tuple[str, str], kube.SitePod]:
    """The sites' pods by (namespace, storage), kept up to date by a watch: the
    controller's rounds (every 2 s per storage) and the status refreshes read them here
    instead of listing the pods each time."""
    storage = labels.get(INSTANCE_LABEL)
    if not storage:
        return {}
    return {(namespace or "", storage): kube.site_pod(plain(body))}


def site_pods_of(index: SitePods | None, owner: Owner, memo: kopf.Memo) -> list[kube.PodView]:
    """The storage's pods as the index has them (none before the index has any), each
    in its node's zone."""
    found = [] if index is None else list(index.get((owner.namespace, owner.name), []))
    return kube.pod_views(found, node_zones_of(memo))


# --- reconcile --------------------------------------------------------------------------

def controllers_of(memo: kopf.Memo) -> controller.Controllers:
    found: controller.Controllers = memo.controllers
    return found


def node_zones_of(memo: kopf.Memo) -> kube.NodeZones:
    found: kube.NodeZones = memo.node_zones
    return found


def kept_pods(owner: Owner, spec: StorageSpec, controllers: controller.Controllers) -> int:
    """spec.sites, or more while the pods above still hold replicas."""
    found = controllers.of(owner, spec, HEARTBEAT_INTERVAL)
    return spec.sites if found is None else found.kept_pods(spec.sites)


class ObjectsNotAppliedError(Exception):
    """Some of a storage's objects were not applied (the others were): Kopf tries the
    reconcile again with its back-off."""


class Attempts:
    """A reconcile's applies, each tried whatever the ones before it did (but the
    StatefulSet, see `apply_objects`): a StatefulSet the API server refuses (a quota,
    an admission policy) must not keep the disruption budget, the network policy,
    the pruning and the Spark objects from being applied. Each failure is logged and
    counted by kind (`stratamq_operator_apply_errors_total`); `check` raises them
    together."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.failed: list[str] = []

    def attempt(self, kind: str, what: str, action: Callable[[], object]) -> None:
        try:
            action()
        except kube.API_ERRORS as error:  # skipped; the others are applied
            metrics.APPLY_ERRORS.labels(kind).inc()
            reason = kube.error_reason(error)
            log.warning("%s/%s: %s not applied: %s", self.owner.namespace, self.owner.name,
                        what, reason)
            self.failed.append(f"{what} ({reason})")

    def check(self) -> None:
        if self.failed:
            raise ObjectsNotAppliedError("not applied (the rest were): "
                                         + "; ".join(self.failed))


def apply_objects(owner: Owner, spec: dict[str, Any], parsed: StorageSpec,
                  controllers: controller.Controllers, budget: AppliedBudget) -> None:
    """Make or update every object of the storage (`spec`, as `parsed`); idempotent.
    Each is tried whatever the others did, but the StatefulSet, which is applied only
    once every object before it is (what its pods mount: a new config's ConfigMap, the
    admin Secret; its Services): a pod template naming a ConfigMap that is not there
    would roll a site into a pod that cannot start. ObjectsNotAppliedError names
    those that were not applied."""
    attempts = Attempts(owner)

    def ensure_secret() -> None:
        if kube.ensure_admin_secret(owner):
            log.info("%s/%s: admin token Secret made", owner.namespace, owner.name)
    attempts.attempt("Secret", "the admin token Secret", ensure_secret)
    monitors = kube.has_kind("monitoring.coreos.com/v1", "ServiceMonitor")
    running = controllers.existing(owner.uid)
    tolerated = None if running is None else running.tolerated_disruptions()
    for manifest in desired_objects(owner, spec, service_monitors=monitors,
                                    replicas=kept_pods(owner, parsed, controllers),
                                    tolerated=tolerated):
        kind = manifest["kind"]
        what = f"{kind} {manifest['metadata']['name']}"
        if kind == "PodDisruptionBudget":
            attempts.attempt(kind, what, partial(set_budget, owner, manifest, budget,
                                                 always=True))
        elif kind == "StatefulSet":
            if attempts.failed:
                metrics.APPLY_ERRORS.labels(kind).inc()
                log.warning("%s/%s: %s not applied: what its pods need was not",
                            owner.namespace, owner.name, what)
                attempts.failed.append(f"{what} (held: what its pods need was not applied)")
            else:
                attempts.attempt(kind, what, partial(apply_stateful_set, owner, manifest))
        else:
            attempts.attempt(kind, what, partial(kube.apply, manifest))
    if not parsed.disruption_budget:
        attempts.attempt("PodDisruptionBudget", "the PodDisruptionBudget's deletion",
                         lambda: kube.delete_owned("policy/v1", "PodDisruptionBudget",
                                                   owner, owner.name))
    if not parsed.network_policy:
        attempts.attempt("NetworkPolicy", "the NetworkPolicy's deletion",
                         lambda: kube.delete_owned("networking.k8s.io/v1", "NetworkPolicy",
                                                   owner, owner.name))
    attempts.attempt("ConfigMap", "the pruning of old ConfigMaps",
                     lambda: prune_config_maps(owner, config_map_name(owner.name, spec)))

    def expand_volumes() -> None:
        patched = kube.expand_volumes(owner, parsed.storage_size)
        if patched:
            log.info("%s/%s: volume claims expanded: %s", owner.namespace, owner.name,
                     ", ".join(patched))
    attempts.attempt("PersistentVolumeClaim", "the volume claims' expansion", expand_volumes)
    attempts.attempt("Spark", "the Spark jobs' objects", lambda: apply_spark(owner, spec))
    attempts.check()


def apply_stateful_set(owner: Owner, manifest: Manifest) -> None:
    """Apply the sites' StatefulSet: claim templates are immutable, so those of the
    one that exists are kept (a grown volume size goes to the claims)."""
    existing = kube.get("apps/v1", "StatefulSet", owner.namespace, owner.name)
    if existing is not None:
        manifest["spec"]["volumeClaimTemplates"] = existing["spec"]["volumeClaimTemplates"]
    kube.apply(manifest)


def prune_config_maps(owner: Owner, current: str) -> None:
    """Delete the storage's config ConfigMaps that nothing needs any more: neither its
    template now (`current`) nor any revision of its StatefulSet names them. The
    StatefulSet controller keeps every revision a pod runs (besides the current and
    the update one), and a pod the roll holds back is recreated from its revision, so
    the revisions name every config a pod may run."""
    found = [item["metadata"]["name"] for item in kube.list_labeled(
        "v1", "ConfigMap", owner.namespace, selector(owner.name))
        if any(reference.get("uid") == owner.uid
               for reference in item["metadata"].get("ownerReferences") or [])]
    revisions = kube.list_labeled("apps/v1", "ControllerRevision", owner.namespace,
                                  selector(owner.name))
    named = config_maps_named(
        [((revision.get("data") or {}).get("spec") or {}).get("template", {}).get("spec")
         or {} for revision in revisions])
    for name in stale_config_maps(owner.name, found, named, current):
        if kube.delete("v1", "ConfigMap", owner.namespace, name):
            log.info("%s/%s: ConfigMap %s deleted: no revision names it any more",
                     owner.namespace, owner.name, name)


def spark_operator_served() -> bool:
    """Whether the Spark operator's CRDs are served: what it runs on a schedule, and
    what it makes for each run (whose status is the last run's)."""
    return (kube.has_kind(spark.SPARK_OPERATOR_API, "ScheduledSparkApplication")
            and kube.has_kind(spark.SPARK_OPERATOR_API, "SparkApplication"))


def apply_spark(owner: Owner, spec: dict[str, Any]) -> None:
    """A scheduler object per enabled Spark job; those of disabled jobs (and of the
    other kind, when the Spark operator came or went) are deleted."""
    served = spark_operator_served()
    for manifest in spark.spark_objects(owner, spec, spark_operator=served):
        kube.apply(manifest)
    enabled = spark.enabled_jobs(spec)
    kinds = [("batch/v1", "CronJob", not served)]
    if served:
        kinds.append((spark.SPARK_OPERATOR_API, "ScheduledSparkApplication", True))
    for api_version, kind, in_use in kinds:
        for job in spark.JOBS.values():
            if not (in_use and job in enabled) and kube.delete_owned(
                    api_version, kind, owner, spark.name_of(owner.name, job)):
                log.info("%s/%s: %s of Spark job %s deleted", owner.namespace, owner.name,
                         kind, job)
    if not enabled or served:  # the executors' pod template is the CronJobs' alone
        kube.delete_owned("v1", "ConfigMap", owner, spark.pod_template_name(owner.name))
    if not enabled:
        name = spark.service_account_name(owner.name)
        kube.delete_owned("rbac.authorization.k8s.io/v1", "RoleBinding", owner, name)
        kube.delete_owned("v1", "ServiceAccount", owner, name)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(name: str, namespace: str | None, uid: str, spec: kopf.Spec, meta: kopf.Meta,
              status: kopf.Status, body: kopf.Body, patch: kopf.Patch, reason: str,
              memo: kopf.Memo, site_pod_index: SitePods | None = None, **_: Any) -> None:
    assert namespace is not None  # DurableStorage is namespaced
    owner = Owner(name=name, namespace=namespace, uid=uid)
    problems = config_problems(plain(spec))
    if problems:
        # Nothing is applied: running sites keep the config they have.
        message = "the broker would refuse this spec: " + "; ".join(problems)
        kopf.warn(body, reason=Reason.INVALID_CONFIG, message=message)
        patch["status"] = {"phase": StoragePhase.FAILED, "conditions": invalid_conditions(
            plain(status).get("conditions", []), message, int(meta.get("generation", 0)),
            timestamp(time.time()))}
        metrics.RECONCILES.labels("invalid").inc()
        metrics.set_phase(namespace, name, StoragePhase.FAILED)
        raise kopf.PermanentError(message)
    current_spec = plain(spec)
    parsed = parse_spec(current_spec)
    generation = int(meta.get("generation", 0))
    # raises: Kopf retries with back-off and logs it
    apply_and_note(owner, current_spec, generation, memo)
    if reason != "resume":
        kopf.info(body, reason=EventReason.RECONCILED,
                  message=f"objects applied for generation {generation} ({reason})")
    current = plain(status)
    refresh(owner, current_spec, parsed, applied_generation(memo, current), current, body,
            patch, controllers_of(memo),
            site_pods_of(site_pod_index, owner, memo))


@kopf.timer(GROUP, VERSION, PLURAL, interval=REAPPLY_INTERVAL, initial_delay=REAPPLY_INTERVAL)
def reapply(name: str, namespace: str | None, uid: str, spec: kopf.Spec, meta: kopf.Meta,
            memo: kopf.Memo, **_: Any) -> None:
    assert namespace is not None
    current = plain(spec)
    if config_problems(current):
        return  # the reconcile refused it (phase Failed): the running config stays
    apply_and_note(Owner(name=name, namespace=namespace, uid=uid), current,
                   int(meta.get("generation", 0)), memo)


def apply_and_note(owner: Owner, spec: dict[str, Any], generation: int,
                   memo: kopf.Memo) -> bool:
    """Apply the storage's objects for `spec` (of `generation`, one the broker
    accepts) and note it applied, counted as a reconcile; one apply of a storage at a
    time, and none of a generation older than one applied (a timer's older body):
    False then. Raises what `apply_objects` raised."""
    applied = applied_of(memo)
    started = time.monotonic()
    with applied.applying:
        noted = applied.get()
        if noted is not None and noted > generation:
            return False
        try:
            apply_objects(owner, spec, parse_spec(spec), controllers_of(memo),
                          budget_of(memo))
        except Exception:
            metrics.RECONCILES.labels("error").inc()
            raise
        applied.note(generation, spec)
    metrics.RECONCILES.labels("ok").inc()
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    return True


# --- status ---------------------------------------------------------------------------

def ask_sites(owner: Owner, port: int, pods: list[kube.PodView]) -> dict[str, str]:
    """Pod name -> site id, from the admin API (at `port`) of each ready pod that
    answers, all asked at once (a hung pod costs the refresh one timeout, not one
    each)."""
    token = kube.admin_token(owner)
    if token is None:
        return {}
    asked = [pod for pod in pods if pod.ready and not pod.terminating and pod.ip]
    found = {}
    for pod, answer in zip(asked, site_ids([f"http://{pod.ip}:{port}" for pod in asked],
                                           token), strict=True):
        if isinstance(answer, SiteUnreachableError):
            log.warning("%s/%s: site of pod %s unknown: %s", owner.namespace, owner.name,
                        pod.name, answer)
        else:
            found[pod.name] = answer
    return found


def refresh(owner: Owner, spec: dict[str, Any], parsed: StorageSpec, generation: int,
            status: dict[str, Any], body: kopf.Body, patch: kopf.Patch,
            controllers: controller.Controllers, pods: list[kube.PodView]) -> None:
    """`spec`, as `parsed`; `generation`: the one whose objects were last applied
    (observedGeneration); `pods`: the site pods, each in its node's zone."""
    running = controllers.existing(owner.uid)
    sites = parsed.sites
    kept = sites if running is None else running.kept_pods(sites)
    observed = Observed(
        name=owner.name, generation=generation, sites=sites, pods=pods,
        stateful_set=kube.stateful_set_status(owner),
        site_ids=known_site_ids(status.get("sites", []),
                                ask_sites(owner, parsed.admin_port, pods)),
        replication=None if running is None else running.view(), kept=kept,
        spec_generation=int(body.get("metadata", {}).get("generation", 0)),
        held=held_pods(spec, kept), image=image(spec), now=time.time(),
        progress_deadline=parsed.progress_deadline)
    new = compute_status(observed, status.get("conditions", []), timestamp(time.time()))
    patch["status"] = new
    metrics.SITES.labels(owner.namespace, owner.name).set(new["replicas"])
    metrics.SITES_READY.labels(owner.namespace, owner.name).set(len(
        [site for site in new["sites"] if site["ready"]]))
    metrics.set_phase(owner.namespace, owner.name, new["phase"])
    if new["phase"] != status.get("phase"):
        message = new["conditions"][0]["message"]
        if new["phase"] == StoragePhase.DEGRADED:
            kopf.warn(body, reason=StoragePhase.DEGRADED, message=message)
        else:
            kopf.info(body, reason=new["phase"], message=message)


@kopf.timer(GROUP, VERSION, PLURAL, interval=STATUS_INTERVAL)
def refresh_status(name: str, namespace: str | None, uid: str, spec: kopf.Spec,
                   status: kopf.Status, body: kopf.Body, patch: kopf.Patch,
                   memo: kopf.Memo, site_pod_index: SitePods | None = None,
                   **_: Any) -> None:
    assert namespace is not None
    current = plain(status)
    current_spec = plain(spec)
    if config_problems(current_spec):
        return  # the reconcile reported it (phase Failed), which stays until it is fixed
    try:
        # The generation the objects were last applied for: a spec change the
        # reconcile has not handled yet is not "observed".
        owner = Owner(name=name, namespace=namespace, uid=uid)
        refresh(owner, current_spec, parse_spec(current_spec),
                applied_generation(memo, current), current, body, patch, controllers_of(memo),
                site_pods_of(site_pod_index, owner, memo))
    except Exception:
        metrics.STATUS_REFRESHES.labels("error").inc()
        raise
    metrics.STATUS_REFRESHES.labels("ok").inc()


# --- the replication controller --------------------------------------------------------

@kopf.timer(GROUP, VERSION, PLURAL, interval=HEARTBEAT_INTERVAL)
def control(name: str, namespace: str | None, uid: str, spec: kopf.Spec, meta: kopf.Meta,
            body: kopf.Body, memo: kopf.Memo, site_pod_index: SitePods | None = None,
            **_: Any) -> None:
    """One round of the storage's controller, then the StatefulSet shrunk to the pods
    that must stay (the departing ones go once they hold no replica) and the
    disruption budget set, by the spec whose objects are applied. Raises nothing for
    an apply that fails here: Kopf would hold the next round back a minute."""
    assert namespace is not None
    owner = Owner(name=name, namespace=namespace, uid=uid)
    applied = applied_of(memo)
    following = spec_to_follow(plain(spec), int(meta.get("generation", 0)), applied,
                               partial(kube.get, "apps/v1", "StatefulSet", namespace, name))
    if following is None:
        return  # a spec the broker would refuse, and none applied before it
    parsed = parse_spec(following.spec)
    token = kube.admin_token(owner)
    controllers = controllers_of(memo)
    running = controllers.of(owner, parsed, HEARTBEAT_INTERVAL)
    if token is None or running is None:
        return
    pods = site_pods_of(site_pod_index, owner, memo)
    running.round(parsed, following.generation, pods, token)
    for reason, message in running.pushes.take_warnings():
        kopf.warn(body, reason=reason, message=message)
    if running.others_acted or running.handed_back:
        # Another operator acted on the storage meanwhile: what this one applied and
        # the budget it wrote are not known to be there any more.
        running.others_acted = False
        if running.handed_back:
            if not controllers.hand_back(running, time.monotonic()):
                return
            running.post_event(
                "Normal", EventReason.CONTROLLER_HANDED_BACK,
                f"the sites hold controller term {running.handed_back_to}, which another "
                "replica of the operator took and kept in status.controller (a Kopf "
                "peering hand-over): going on from the state kept, above that term")
            # the controller made in its place from what the API server holds runs
            # now: the status and metrics do not go without one for a round
            running = controllers.of(owner, parsed, HEARTBEAT_INTERVAL)
            if running is None:
                return
            running.round(parsed, following.generation, pods, token)
            for reason, message in running.pushes.take_warnings():
                kopf.warn(body, reason=reason, message=message)
        applied.forget()
        budget = budget_of(memo)
        with budget.lock:
            budget.max_unavailable = None
    if applied.is_stale() and following.generation > 0 \
            and not config_problems(following.spec):
        try:
            apply_and_note(owner, following.spec, following.generation, memo)
        except (ObjectsNotAppliedError, *kube.API_ERRORS) as error:
            log.warning("%s/%s: objects not applied again after another operator acted "
                        "(tried again next round): %s", namespace, name, error)
            return
    # Only by the spec the objects were applied for, and while it still is (a timer's
    # older body must not shrink what the reconcile just grew), and only in charge (a
    # fenced controller's state is another's to act on).
    if not running.in_charge or not still_applied(following, applied):
        return
    kept = running.kept_pods(parsed.sites)
    if kube.scale("StatefulSet", namespace, name, kept):
        log.info("%s/%s: StatefulSet set to %d pods", namespace, name, kept)
    # as replicas catch up or fall behind (a PDB alone counts Ready pods)
    set_budget(owner, pod_disruption_budget(owner, following.spec,
                                            running.tolerated_disruptions()),
               budget_of(memo))


def still_applied(following: Following, applied: Applied) -> bool:
    """Whether the objects of the spec `following` names are still the ones applied
    (the spec the StatefulSet runs, generation 0: while nothing was applied here)."""
    noted = applied.get()
    return noted is None if following.generation == 0 else noted == following.generation


# --- the Spark jobs' last runs -------------------------------------------------------------

def record_last_run(namespace: str, storage: str, job: str, api_version: str, kind: str,
                    lock: threading.Lock) -> None:
    """Write the newest run of `job` (its Jobs or SparkApplications, by labels) into
    the storage's status.spark, unless it is there already."""
    if job not in spark.SPEC_KEY:
        return
    with lock:  # one writer of status.spark at a time (see `configure`)
        newest = spark.last_run(kube.list_labeled(api_version, kind, namespace,
                                                  spark.runs_selector(storage, job)))
        found = kube.get(API_VERSION, KIND, namespace, storage)
        if found is None:
            return
        key = spark.SPEC_KEY[job]
        recorded = (found.get("status") or {}).get("spark", {}).get(key)
        if newest is None or not spark.replaces(newest, recorded):
            return  # the runs went with their CronJob: the last one stays reported
        if kind == "Job":
            run = spark.job_run(newest)
            if run["result"] == "Failed":
                run = spark.with_pod_failure(run, kube.list_labeled(
                    "v1", "Pod", namespace,
                    f"{spark.JOB_NAME_LABEL}={newest['metadata']['name']}"))
        else:
            run = spark.spark_application_run(newest)
        if recorded == run:
            return
        if kube.patch_status(API_VERSION, KIND, namespace, storage,
                             {"spark": {key: spark.status_patch(run)}}):
            log.info("%s/%s: Spark job %s: %s %s", namespace, storage, job, run["job"],
                     run["result"])


@kopf.on.event("batch", "v1", "jobs", labels={
    "app.kubernetes.io/managed-by": MANAGED_BY, spark.STORAGE_LABEL: kopf.PRESENT,
    spark.JOB_LABEL: kopf.PRESENT})
def spark_job_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo,
                      **_: Any) -> None:
    assert namespace is not None
    record_last_run(namespace, labels[spark.STORAGE_LABEL], labels[spark.JOB_LABEL],
                    "batch/v1", "Job", memo.spark_runs_lock)


@kopf.on.event("sparkoperator.k8s.io", "v1beta2", "sparkapplications", labels={
    "app.kubernetes.io/managed-by": MANAGED_BY, spark.STORAGE_LABEL: kopf.PRESENT,
    spark.JOB_LABEL: kopf.PRESENT})
def spark_application_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo,
                              **_: Any) -> None:
    assert namespace is not None
    record_last_run(namespace, labels[spark.STORAGE_LABEL], labels[spark.JOB_LABEL],
                    spark.SPARK_OPERATOR_API, "SparkApplication", memo.spark_runs_lock)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(name: str, namespace: str | None, uid: str, memo: kopf.Memo, **_: Any) -> None:
    """Optional: the owned objects go by garbage collection. Seen while this operator
    runs (its finalizer holds the storage until its timers stopped)."""
    metrics.forget(namespace or "", name)
    controllers_of(memo).forget(uid)


# --- the finalizer lives no longer than the operator ---------------------------------------

@kopf.index(GROUP, VERSION, PLURAL)
def storages(namespace: str | None, name: str, **_: Any) -> dict[tuple[str, str], None]:
    """The storages this operator serves (its namespace, or all): those whose finalizer
    it takes off at its exit. An index needs no finalizer."""
    return {(namespace or "", name): None}


@kopf.on.cleanup()
def release_storages(*, settings: kopf.OperatorSettings,
                     storages: kopf.Index[tuple[str, str], None] | None = None,
                     **_: Any) -> None:
    """Kopf puts its finalizer on every storage because of the timers (Kopf requires
    it for timers and daemons, so it can stop them before the object goes; there is no
    opt-out). Nothing else needs it, and once this operator exits (its timers are
    stopped by then: cleanup runs after every other task ended) it only keeps a deleted
    storage Terminating until an operator comes back, which after `helm uninstall`
    never happens (issue 21, defect 4). So it goes at the exit; the next operator's
    Kopf puts it back when it lists the storages."""
    finalizer = settings.persistence.finalizer
    for namespace, name in list((storages or {}).keys()):
        try:
            if kube.remove_finalizer(API_VERSION, KIND, namespace, name, finalizer):
                log.info("%s/%s: finalizer %s removed at the operator's exit", namespace,
                         name, finalizer)
        except Exception as error:  # the others are still worth trying
            log.warning("%s/%s: finalizer %s not removed at the operator's exit: %s",
                        namespace, name, finalizer, error)
