"""The chart's `helm test` (`python -m stratamq.operator.helm_test`): the storage the
chart made is Ready, and an MQTT message goes round through its sites.

It waits for the DurableStorage's phase Ready, then connects a subscriber to one ready
site and a publisher to another (the same one when there is one site), each by its
pod's address (as the operator reaches the sites: no Service routing or cluster DNS
is assumed), publishes one QoS 1 message and waits for it. Run as the operator's
account, which may read the storage and list its pods.

Both clients connect with the user name and password in STRATAMQ_HELM_TEST_USERNAME and
STRATAMQ_HELM_TEST_PASSWORD when they are set (the chart sets them from the Secret
`durableStorage.testCredentialsSecret` names), anonymously otherwise. A storage that
refuses anonymous clients (`accessControl.allowAnonymous: false`) with no credentials
given fails the test at once, saying so. The user must be in the storage's password
file (`accessControl.passwordSecret`) and, where an ACL applies, may publish and
subscribe to `stratamq-helm-test/#`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiomqtt
from kubernetes.config.config_exception import ConfigException
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from . import kube
from .resources import API_VERSION, KIND, Owner

POLL_INTERVAL_S = 2.0
DEFAULT_TIMEOUT_S = 300.0
# How long the message may take once both clients are connected.
ROUND_TRIP_TIMEOUT_S = 15.0
DEFAULT_MQTT_PORT = 1883
# Where the credentials come from: the environment (from a Secret, in the chart's pod),
# not the command line, which `ps` and the pod's spec show.
USERNAME_ENV = "STRATAMQ_HELM_TEST_USERNAME"
PASSWORD_ENV = "STRATAMQ_HELM_TEST_PASSWORD"


class HelmTestError(Exception):
    """Why the test failed, in words for `helm test`'s log."""


@dataclass(frozen=True)
class Credentials:
    """The user the test's clients connect as."""

    username: str
    password: str


def credentials_from(environ: Mapping[str, str]) -> Credentials | None:
    """The credentials in the environment; None when neither variable is set."""
    username, password = environ.get(USERNAME_ENV), environ.get(PASSWORD_ENV)
    if username is None and password is None:
        return None
    if not username or password is None:
        raise HelmTestError(f"{USERNAME_ENV} and {PASSWORD_ENV} go together, and the user "
                            "name must not be empty")
    return Credentials(username, password)


def wait_ready(namespace: str, name: str, deadline: float) -> dict[str, Any]:
    """The storage once its phase is Ready; HelmTestError once the monotonic clock is
    past `deadline`. A transient API error is tried again until then."""
    timeout = max(0.0, deadline - time.monotonic())
    phase = None
    while True:
        storage = kube.until_deadline(lambda: kube.get(API_VERSION, KIND, namespace, name),
                                      deadline, f"reading DurableStorage {namespace}/{name}")
        if storage is None:
            raise HelmTestError(f"no DurableStorage {namespace}/{name}")
        status = storage.get("status") or {}
        phase = status.get("phase")
        if phase == "Ready":
            return storage
        if time.monotonic() >= deadline:
            raise HelmTestError(f"DurableStorage {namespace}/{name} not Ready after "
                                f"{timeout:.0f} s (phase {phase}: "
                                f"{status.get('message') or 'no message'})")
        time.sleep(POLL_INTERVAL_S)


def site_addresses(storage: dict[str, Any]) -> list[tuple[str, str]]:
    """(pod, address) of each ready site of `storage`, by pod name."""
    metadata = storage["metadata"]
    owner = Owner(name=metadata["name"], namespace=metadata["namespace"], uid=metadata["uid"])
    return [(pod.name, pod.ip) for pod in kube.site_pods(owner, None)
            if pod.ready and pod.ip and not pod.terminating]


async def round_trip(subscriber_host: str, publisher_host: str, port: int,
                     credentials: Credentials | None) -> float:
    """Seconds from the publish to the message's arrival."""
    topic = f"stratamq-helm-test/{uuid.uuid4().hex}"
    payload = b"stratamq helm test"
    username = credentials.username if credentials else None
    password = credentials.password if credentials else None
    async with aiomqtt.Client(subscriber_host, port, identifier=f"helm-test-sub-{topic[-8:]}",
                              username=username, password=password,
                              timeout=ROUND_TRIP_TIMEOUT_S) as subscriber, \
            aiomqtt.Client(publisher_host, port, identifier=f"helm-test-pub-{topic[-8:]}",
                           username=username, password=password,
                           timeout=ROUND_TRIP_TIMEOUT_S) as publisher:
        await subscriber.subscribe(topic, qos=1)
        started = time.monotonic()
        await publisher.publish(topic, payload, qos=1)
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
            async for message in subscriber.messages:
                if message.payload == payload:
                    return time.monotonic() - started
    raise HelmTestError("the subscriber's connection ended before the message came")


def check_can_connect(storage: dict[str, Any], credentials: Credentials | None) -> None:
    """HelmTestError when the storage refuses anonymous clients and there are no
    credentials: no point in waiting for it to be Ready."""
    spec = storage.get("spec") or {}
    if credentials is None and not (spec.get("accessControl") or {}).get(
            "allowAnonymous", True):
        metadata = storage["metadata"]
        raise HelmTestError(
            f"DurableStorage {metadata['namespace']}/{metadata['name']} refuses anonymous "
            "clients (accessControl.allowAnonymous: false) and this test has no credentials "
            f"({USERNAME_ENV}, {PASSWORD_ENV}): give it a user of the storage's password "
            "file in a Secret with keys username and password, named by the chart's "
            "durableStorage.testCredentialsSecret")


def run(namespace: str, name: str, timeout: float, credentials: Credentials | None) -> str:
    """The test; what it saw, in one line."""
    deadline = time.monotonic() + timeout
    found = kube.until_deadline(lambda: kube.get(API_VERSION, KIND, namespace, name),
                                deadline, f"reading DurableStorage {namespace}/{name}")
    if found is not None:
        check_can_connect(found, credentials)
    storage = wait_ready(namespace, name, deadline)
    check_can_connect(storage, credentials)  # (its spec may have changed meanwhile)
    spec = storage.get("spec") or {}
    port = int((spec.get("listeners") or {}).get("tcp", {}).get("port", DEFAULT_MQTT_PORT))
    # (Ready was seen before the deadline: the pods are listed however long that took.)
    sites = kube.until_deadline(lambda: site_addresses(storage),
                                max(deadline, time.monotonic() + ROUND_TRIP_TIMEOUT_S),
                                f"listing the pods of {namespace}/{name}")
    if not sites:
        raise HelmTestError(f"DurableStorage {namespace}/{name} is Ready but no site pod "
                            "is ready")
    (first, first_address), (last, last_address) = sites[0], sites[-1]
    try:
        took = asyncio.run(round_trip(first_address, last_address, port, credentials))
    except (aiomqtt.MqttError, TimeoutError, OSError) as error:
        raise HelmTestError(f"no MQTT round trip from {last} ({last_address}:{port}) to "
                            f"{first} ({first_address}:{port}): "
                            f"{error or type(error).__name__}") from error
    who = f"user {credentials.username}" if credentials else "anonymous clients"
    return (f"DurableStorage {namespace}/{name} Ready; a QoS 1 message published at {last} "
            f"reached a subscriber at {first} in {took * 1000:.0f} ms ({who})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stratamq.operator.helm_test",
        description="The chart's `helm test`: the DurableStorage is Ready and an MQTT "
                    "message goes round through its sites.")
    parser.add_argument("--namespace", required=True, help="the storage's namespace")
    parser.add_argument("--storage", required=True, help="the DurableStorage's name")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds to wait for Ready (default {DEFAULT_TIMEOUT_S:.0f})")
    args = parser.parse_args(argv)
    try:
        print(run(args.namespace, args.storage, args.timeout, credentials_from(os.environ)))
    except HelmTestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (*kube.API_ERRORS, ConfigException) as error:
        print(f"error: the API server: {error}", file=sys.stderr)
        return 1
    except ResourceNotFoundError as error:
        print(f"error: the API server serves no {KIND} ({error}): are the chart's CRDs "
              "installed?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
