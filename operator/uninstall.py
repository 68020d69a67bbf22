"""`python -m stratamq.operator.uninstall`: run by the chart's pre-delete hook, before
`helm uninstall` deletes anything.

Kopf puts its finalizer on every DurableStorage (its timers require one), and the
operator takes it off at its exit (handlers.release_storages). Helm deletes the
operator's Deployment, ServiceAccount and rights in one go, the storage of
`durableStorage.create` last: by the time the operator's pod gets its SIGTERM, its
token is refused, the finalizer stays, the storage stays Terminating with its pods
running, and `helm uninstall --wait` hangs (issue 21, defect 4, seen on real pods).

So the hook stops the operator first, while its account and rights still exist: the
Deployment is scaled to 0 and its pods are waited for, so the operator exits as usual
and takes its finalizer off. Then the hook takes off any finalizer still there (an
operator that was crash-looping never got that far). Run as the operator's own
ServiceAccount; the chart lets it change its own Deployment only."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

import kopf
from kubernetes.config import ConfigException

from . import kube
from .resources import API_VERSION, KIND, label_selector

log = logging.getLogger("stratamq.operator.uninstall")

# Far above an operator's exit (Kopf stops its timers, then the cleanup; the pod's
# grace period is 30 s), far below Helm's default --timeout of 5 minutes.
DEFAULT_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 1.0
# What taking the finalizers off may take, however long stopping the operator took.
RELEASE_TIMEOUT_S = 30.0


class OperatorStillRunningError(Exception):
    """The operator's pods outlived the wait (not an OSError, as TimeoutError is: that
    one says an API request timed out, which is tried again)."""


def stop_operator(namespace: str, deployment: str, timeout: float,
                  sleep: Callable[[float], None] = time.sleep) -> bool:
    """Scale the operator's Deployment to 0 and wait until none of its pods is left;
    False when there is no such Deployment. OperatorStillRunningError when pods
    outlive `timeout`."""
    found = kube.get("apps/v1", "Deployment", namespace, deployment)
    if found is None:
        return False
    kube.scale("Deployment", namespace, deployment, 0)
    labels: dict[str, str] = found["spec"]["selector"].get("matchLabels") or {}
    selector = label_selector(dict(sorted(labels.items())))
    deadline = time.monotonic() + timeout
    while True:
        pods = sorted(pod["metadata"]["name"]
                      for pod in kube.list_labeled("v1", "Pod", namespace, selector))
        if not pods:
            return True
        if time.monotonic() > deadline:
            raise OperatorStillRunningError(f"the operator's pods {', '.join(pods)} still run "
                               f"{timeout:.0f} s after {namespace}/{deployment} was "
                               f"scaled to 0")
        sleep(POLL_INTERVAL_S)


def release_storages(finalizer: str, namespaces: list[str], released: list[str]) -> None:
    """Take `finalizer` off every DurableStorage that still has it in `namespaces` (the
    operator's watched ones; empty: all namespaces, as it then watches them all),
    adding each storage it was taken off to `released` (namespace/name) as it goes:
    a call made again after a failure keeps what an earlier one released. None when
    the API server serves no DurableStorage (its CRD deleted first)."""
    if not kube.has_kind(API_VERSION, KIND):
        log.info("the API server serves no %s: no storage to release", KIND)
        return
    scopes: list[str | None] = list(namespaces) or [None]
    storages = [storage for namespace in scopes
                for storage in kube.list_labeled(API_VERSION, KIND, namespace)]
    for storage in storages:
        metadata = storage["metadata"]
        if finalizer in (metadata.get("finalizers") or []) and kube.remove_finalizer(
                API_VERSION, KIND, metadata["namespace"], metadata["name"], finalizer):
            released.append(f"{metadata['namespace']}/{metadata['name']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stratamq.operator.uninstall",
        description="Stop the stratamq operator and take its finalizer off every "
                    "DurableStorage (the chart's pre-delete hook).")
    parser.add_argument("--namespace", required=True,
                        help="the namespace of the operator's Deployment")
    parser.add_argument("--deployment", required=True,
                        help="the operator's Deployment (<release>-stratamq-operator)")
    parser.add_argument("--watch-namespace", action="append", default=[],
                        metavar="NAMESPACE",
                        help="a namespace the operator serves (its operator.watchNamespaces;"
                             " repeat for each); none: it serves every namespace")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds to wait for the operator's pods to go, and for "
                             "an API server that does not answer "
                             f"(default {DEFAULT_TIMEOUT_S:.0f})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Kopf's own default, which the operator keeps (handlers.configure).
    finalizer = kopf.OperatorSettings().persistence.finalizer
    # Each step may be made again (scaling to 0, taking a finalizer off): one that
    # failed for want of an answer from the API server is, until the deadline (a
    # request under way then may take its own timeout past it: kube.API_TIMEOUT).
    started = time.monotonic()
    deadline = started + args.timeout
    try:
        if kube.until_deadline(
                lambda: stop_operator(args.namespace, args.deployment,
                                      deadline - time.monotonic()),
                deadline, f"stopping the operator {args.namespace}/{args.deployment}"):
            log.info("operator %s/%s stopped in %.1f s", args.namespace, args.deployment,
                     time.monotonic() - started)
        else:
            log.info("no operator Deployment %s/%s", args.namespace, args.deployment)
        released: list[str] = []
        kube.until_deadline(
            lambda: release_storages(finalizer, args.watch_namespace, released),
            max(deadline, time.monotonic() + RELEASE_TIMEOUT_S), "taking the finalizers off")
    except (*kube.API_ERRORS, ConfigException, OperatorStillRunningError,
            kube.StaleWriteError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for storage in released:
        log.info("%s: finalizer %s removed", storage, finalizer)
    if not released:
        log.info("no DurableStorage kept the finalizer %s", finalizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
