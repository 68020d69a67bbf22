"""The operator's calls to the Kubernetes API (the `kubernetes` client's dynamic API,
plain dicts in and out; blocking: the
handlers that use it are sync functions, which Kopf runs in its thread pool, so the
event loop never waits on them)."""

from __future__ import annotations

import base64
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import (
    ConflictError,
    ForbiddenError,
    NotFoundError,
    ResourceNotFoundError,
)
from kubernetes.utils import parse_quantity

from .resources import (
    TOKEN_KEY,
    Manifest,
    Owner,
    admin_secret,
    admin_secret_name,
    selector,
    site_selector,
)

log = logging.getLogger(__name__)

FIELD_MANAGER = "stratamq-operator"

T = TypeVar("T")


# Each API request's (connect, read) timeout in seconds. The client waits for ever by
# default: one hung connection to the API server held the handler's thread, and with
# it every later round of that storage (Kopf starts a timer's next run only once the
# last one ended). urllib3 may retry an idempotent request a few times, so a call to a
# hung API server fails within a few times this.
API_TIMEOUT = (5.0, 30.0)


# What a call to the API server may fail with: its answer (an ApiException: refused,
# conflicting, gone) or no answer (a timeout, no connection).
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


# The answers that say "not now" rather than "no": too many requests, the API server
# or what is in front of it down or overloaded.
_TRY_LATER = frozenset({429, 500, 502, 503, 504})


def transient(error: BaseException) -> bool:
    """Whether a call that failed with `error` (one of API_ERRORS) may work if made
    again: it had no answer, or an answer that says to try later."""
    if isinstance(error, ApiException):
        return error.status in _TRY_LATER
    return isinstance(error, (urllib3.exceptions.HTTPError, OSError))


def until_deadline(call: Callable[[], T], deadline: float, what: str,
                   pause: float = 1.0) -> T:
    """`call()`, made again after a pause while it fails with a transient API error
    (an API server restarting, a read timed out) and the monotonic clock is before
    `deadline`; then its error is raised. For the chart's one-shot commands (the
    uninstall hook, `helm test`), where one timeout must not fail the whole run."""
    while True:
        try:
            return call()
        except API_ERRORS as error:
            if not transient(error) or time.monotonic() + pause >= deadline:
                raise
            log.warning("%s: the API server: %s; trying again", what, error_reason(error))
            time.sleep(pause)


def error_reason(error: BaseException) -> str:
    """One of API_ERRORS in a few words, for a log line or an error message."""
    if isinstance(error, ApiException):
        return f"{error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"


class BoundedApiClient(client.ApiClient):
    """The API client with a `timeout` on every request that gives none (discovery
    and the dynamic client's calls included): a hung API server fails the call
    (urllib3's HTTPError) instead of blocking its thread."""

    def __init__(self, configuration: client.Configuration | None = None,
                 timeout: float | tuple[float, float] = API_TIMEOUT) -> None:
        super().__init__(configuration)
        self.timeout = timeout

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["_request_timeout"] = kwargs.get("_request_timeout") or self.timeout
        return super().call_api(*args, **kwargs)


@functools.cache
def api_client() -> client.ApiClient:
    """In a pod: its ServiceAccount; elsewhere: the kubeconfig (KUBECONFIG)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return BoundedApiClient()


@functools.cache
def dynamic() -> DynamicClient:
    return DynamicClient(api_client())


# The client's discovery cache is not thread-safe: a miss (has_kind of a CRD that is
# not installed) rebuilds it while another handler's thread reads it, which fails with
# KeyError('resources'). Handlers run in Kopf's thread pool, so lookups take turns.
_discovery_lock = threading.Lock()


def resource_of(api_version: str, kind: str) -> Any:
    """The dynamic client's resource for (api_version, kind); ResourceNotFoundError
    when the API server does not serve it."""
    with _discovery_lock:
        return dynamic().resources.get(api_version=api_version, kind=kind)


def has_kind(api_version: str, kind: str) -> bool:
    """Whether the API server serves this kind (a CRD such as ServiceMonitor may be
    missing; discovery is asked again on a miss, so a CRD installed later is seen)."""
    try:
        resource_of(api_version, kind)
    except ResourceNotFoundError:
        return False
    return True


def apply(manifest: Manifest) -> None:
    """Server-side apply as the operator's field manager: creates or updates exactly
    the fields given, so applying the same manifest again changes nothing. Conflicts
    are forced: these objects are the operator's to keep as the spec says."""
    resource = resource_of(manifest["apiVersion"], manifest["kind"])
    dynamic().server_side_apply(resource, body=manifest,
                                namespace=manifest["metadata"]["namespace"],
                                field_manager=FIELD_MANAGER, force_conflicts=True)


def create(manifest: Manifest) -> bool:
    """Create the object unless one of its name exists; True when made now."""
    resource = resource_of(manifest["apiVersion"], manifest["kind"])
    try:
        dynamic().create(resource, body=manifest,
                         namespace=manifest["metadata"].get("namespace"))
    except ConflictError:
        return False
    return True


def replace(manifest: Manifest) -> bool:
    """Write the object whole, at the resourceVersion in `manifest`'s metadata; False
    when it changed since (nothing written)."""
    resource = resource_of(manifest["apiVersion"], manifest["kind"])
    try:
        dynamic().replace(resource, body=manifest,
                          namespace=manifest["metadata"].get("namespace"))
    except ConflictError:
        return False
    return True


def scale(kind: str, namespace: str, name: str, replicas: int) -> bool:
    """Set the replicas of an apps/v1 `kind` (StatefulSet, Deployment), unless it has
    that many or is missing; True when changed."""
    found = get("apps/v1", kind, namespace, name)
    if found is None or found["spec"].get("replicas") == replicas:
        return False
    resource = resource_of("apps/v1", kind)
    dynamic().patch(resource, name=name, namespace=namespace,
                    body={"spec": {"replicas": replicas}},
                    content_type="application/merge-patch+json", field_manager=FIELD_MANAGER)
    return True


def get(api_version: str, kind: str, namespace: str | None, name: str
        ) -> dict[str, Any] | None:
    """The object, or None when there is none; `namespace` None for a cluster-scoped
    kind."""
    resource = resource_of(api_version, kind)
    try:
        found: dict[str, Any] = dynamic().get(resource, name=name,
                                              namespace=namespace).to_dict()
    except NotFoundError:
        return None
    return found


def delete_owned(api_version: str, kind: str, owner: Owner, name: str) -> bool:
    """Delete the object if it exists and belongs to `owner` (never one a user made
    under the same name); True when one was deleted."""
    found = get(api_version, kind, owner.namespace, name)
    if found is None or not any(reference.get("uid") == owner.uid for reference in
                                found["metadata"].get("ownerReferences", [])):
        return False
    resource = resource_of(api_version, kind)
    try:
        dynamic().delete(resource, name=name, namespace=owner.namespace)
    except NotFoundError:
        return False
    return True


def delete(api_version: str, kind: str, namespace: str, name: str) -> bool:
    """Delete the object; False when it was gone already."""
    resource = resource_of(api_version, kind)
    try:
        dynamic().delete(resource, name=name, namespace=namespace)
    except NotFoundError:
        return False
    return True


def remove_finalizer(api_version: str, kind: str, namespace: str, name: str,
                     finalizer: str) -> bool:
    """Take `finalizer` off the object and leave the others; True when it was there.
    The write carries the resourceVersion read, so a finalizer added meanwhile by
    someone else is never dropped (409: read again and retry)."""
    resource = resource_of(api_version, kind)
    for _ in range(5):
        found = get(api_version, kind, namespace, name)
        if found is None:
            return False
        finalizers = found["metadata"].get("finalizers") or []
        if finalizer not in finalizers:
            return False
        try:
            dynamic().patch(resource, name=name, namespace=namespace, body={"metadata": {
                "resourceVersion": found["metadata"]["resourceVersion"],
                "finalizers": [other for other in finalizers if other != finalizer]}},
                content_type="application/merge-patch+json")
        except NotFoundError:
            return False
        except ConflictError:
            continue
        return True
    raise StaleWriteError(f"{kind} {namespace}/{name} kept changing; finalizer "
                          f"{finalizer} not removed")


def list_labeled(api_version: str, kind: str, namespace: str | None,
                 label_selector: str = "") -> list[dict[str, Any]]:
    """The objects of `kind` in `namespace` (None: in every namespace) whose labels
    match `label_selector` (empty: all)."""
    resource = resource_of(api_version, kind)
    found: list[dict[str, Any]] = dynamic().get(
        resource, namespace=namespace, label_selector=label_selector).to_dict()["items"]
    return found


def ensure_admin_secret(owner: Owner) -> bool:
    """Make the admin token Secret unless it exists; True when made now."""
    resource = resource_of("v1", "Secret")
    try:
        dynamic().create(resource, body=admin_secret(owner, secrets.token_urlsafe(32)),
                         namespace=owner.namespace)
    except ConflictError:  # made before: keep its token, the sites use it
        return False
    return True


def admin_token(owner: Owner) -> str | None:
    secret = get("v1", "Secret", owner.namespace, admin_secret_name(owner.name))
    encoded = None if secret is None else (secret.get("data") or {}).get(TOKEN_KEY)
    return None if encoded is None else base64.b64decode(encoded).decode()


@dataclass(frozen=True, slots=True)
class PodView:
    """What the status and the replication controller need of one site's pod. `zone`:
    the zone of the node it runs on (`NodeZones`), None when not known."""

    name: str
    ip: str | None
    ready: bool
    terminating: bool
    zone: str | None = None
    # When it last stopped being ready, or was made (epoch seconds); None while ready.
    not_ready_since: float | None = None


@dataclass(frozen=True, slots=True)
class SitePod:
    """One site's pod as the operator's index of them keeps it (handlers.site_pod_index,
    fed by a watch of the sites' pods, so that a round lists none): a PodView without
    its zone, and the node it runs on."""

    name: str
    ip: str | None
    ready: bool
    terminating: bool
    node: str | None
    not_ready_since: float | None = None


def epoch_seconds(stamp: object) -> float | None:
    """An RFC 3339 time as the API server writes it (`2026-11-29T02:37:57Z`), in
    seconds since the epoch; None when it is not one."""
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def site_pod(pod: Mapping[str, Any]) -> SitePod:
    """What the operator keeps of a pod (a body as the API server gives it)."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    condition: Mapping[str, Any] = next(
        (condition for condition in status.get("conditions") or []
         if condition.get("type") == "Ready"), {})
    ready = condition.get("status") == "True"
    since = None if ready else (epoch_seconds(condition.get("lastTransitionTime"))
                                or epoch_seconds(metadata.get("creationTimestamp")))
    return SitePod(name=metadata["name"], ip=status.get("podIP"), ready=ready,
                   terminating=bool(metadata.get("deletionTimestamp")),
                   node=(pod.get("spec") or {}).get("nodeName"), not_ready_since=since)


def pod_views(pods: Iterable[SitePod], zones: NodeZones | None) -> list[PodView]:
    """The pods in name order, each in the zone of its node (read through `zones`;
    None: zones not asked for)."""
    return sorted((PodView(name=pod.name, ip=pod.ip, ready=pod.ready,
                           terminating=pod.terminating,
                           zone=zones.of(pod.node) if pod.node and zones else None,
                           not_ready_since=pod.not_ready_since)
                   for pod in pods), key=lambda pod: pod.name)


def site_pods(owner: Owner, zones: NodeZones | None) -> list[PodView]:
    """The storage's site pods listed now, each in the zone of its node: for those
    that run outside the operator (`helm test`); the operator's rounds read its index."""
    return pod_views((site_pod(pod) for pod in list_labeled(
        "v1", "Pod", owner.namespace, site_selector(owner.name))), zones)


ZONE_LABEL = "topology.kubernetes.io/zone"

NO_ZONE_RECHECK_SECONDS = 60.0


def zone_of_node(node: dict[str, Any] | None) -> str | None:
    """A Node's `topology.kubernetes.io/zone` label; None when it has none."""
    labels = ((node or {}).get("metadata") or {}).get("labels") or {}
    zone = labels.get(ZONE_LABEL)
    return zone if isinstance(zone, str) and zone else None


class NodeZones:
    """The zone of each Node, as read from the API server and kept: a node's zone label
    is set when it registers and stays, so a node with one is read once; a node
    without one (most clusters outside a cloud) is read again once a minute (it may be
    labelled later), not at every round of every storage. One lives in the operator's
    memo, shared by every storage's handlers (in threads); `clock`: seconds, as
    time.monotonic counts them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._known: dict[str, tuple[str | None, float]] = {}  # node -> (zone, read when)
        self._lock = threading.Lock()
        self._warned_forbidden = threading.Event()

    def of(self, name: str) -> str | None:
        """The zone of the Node `name`; None when it has none, is gone, or the operator
        may not read Nodes (the rights of a chart older than zones: the sites are then
        planned as if their zones were unknown, and the operator says so once)."""
        now = self._clock()
        with self._lock:
            known = self._known.get(name)
        if known is not None and (known[0] is not None
                                  or now - known[1] < NO_ZONE_RECHECK_SECONDS):
            return known[0]
        try:
            zone = zone_of_node(get("v1", "Node", None, name))
        except ForbiddenError:
            zone = None
            if not self._warned_forbidden.is_set():
                self._warned_forbidden.set()
                log.warning("getting Nodes is forbidden to the operator (its ClusterRole "
                            "is older than zones): the sites' zones are not known, "
                            "replicas are placed without them")
        with self._lock:
            self._known[name] = (zone, now)
        return zone


def stateful_set_status(owner: Owner) -> dict[str, Any] | None:
    """The StatefulSet's metadata.generation and status, or None when it is missing."""
    found = get("apps/v1", "StatefulSet", owner.namespace, owner.name)
    if found is None:
        return None
    status: dict[str, Any] = dict(found.get("status") or {})
    status["generation"] = found["metadata"].get("generation", 0)
    return status


def expand_volumes(owner: Owner, size: str) -> list[str]:
    """Ask for `size` on each site's volume claim that is smaller (a StatefulSet's claim
    template is immutable, so a grown spec.storage.size reaches the claims here; the
    CRD refuses a shrink). Returns the claims patched."""
    wanted = parse_quantity(size)
    resource = resource_of("v1", "PersistentVolumeClaim")
    patched = []
    for claim in list_labeled("v1", "PersistentVolumeClaim", owner.namespace, selector(owner.name)):
        requests = claim["spec"].get("resources", {}).get("requests", {})
        if "storage" not in requests or parse_quantity(requests["storage"]) < wanted:
            name: str = claim["metadata"]["name"]
            dynamic().patch(resource, name=name, namespace=owner.namespace,
                            body={"spec": {"resources": {"requests": {"storage": size}}}},
                            content_type="application/merge-patch+json")
            patched.append(name)
    return patched


def patch_status(api_version: str, kind: str, namespace: str, name: str,
                 status: dict[str, Any]) -> bool:
    """Merge `status` into the object's status subresource; False when it is gone."""
    resource = resource_of(api_version, kind)
    try:
        dynamic().patch(resource.subresources["status"], name=name, namespace=namespace,
                        body={"status": status}, content_type="application/merge-patch+json")
    except NotFoundError:
        return False
    return True


class StaleWriteError(Exception):
    """A conditional write refused (409): the object changed since it was read."""


def patch_status_at(api_version: str, kind: str, namespace: str, name: str,
                    status: dict[str, Any], resource_version: str) -> str | None:
    """Merge `status` into the object's status subresource only if the object is still
    at `resource_version` (the API server compares it: optimistic concurrency); the new
    resourceVersion, None when the object is gone, StaleWriteError when it moved."""
    resource = resource_of(api_version, kind)
    try:
        written = dynamic().patch(
            resource.subresources["status"], name=name, namespace=namespace,
            body={"metadata": {"resourceVersion": resource_version}, "status": status},
            content_type="application/merge-patch+json")
    except NotFoundError:
        return None
    except ConflictError as error:
        raise StaleWriteError(f"{kind} {namespace}/{name} is no longer at "
                              f"{resource_version}") from error
    version: str = written.to_dict()["metadata"]["resourceVersion"]
    return version
