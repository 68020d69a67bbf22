"""The chart's `helm test` (`python -m stratamq.operator.helm_test`): the storage the
chart made is Ready, and an MQTT message goes round through its sites.

It waits for the DurableStorage's phase Ready, then connects a subscriber to one ready
site and a publisher to another (the same one when there is one site), each by its
pod's address (as the operator reaches the sites: no Service routing or cluster DNS
is assumed), publishes one QoS 1 message and waits for it. Run as the operator's
account, which may read the storage and list its pods. A storage that refuses
anonymous clients (`accessControl.allowAnonymous: false`) is said to be so: this test
has no credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

import aiomqtt
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from . import kube
from .resources import API_VERSION, KIND, Owner

POLL_INTERVAL_S = 2.0
DEFAULT_TIMEOUT_S = 300.0
# How long the message may take once both clients are connected.
ROUND_TRIP_TIMEOUT_S = 15.0
DEFAULT_MQTT_PORT = 1883


class HelmTestError(Exception):
    """Why the test failed, in words for `helm test`'s log."""


def wait_ready(namespace: str, name: str, timeout: float) -> dict[str, Any]:
    """The storage once its phase is Ready; HelmTestError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    phase = None
    while True:
        storage = kube.get(API_VERSION, KIND, namespace, name)
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


async def round_trip(subscriber_host: str, publisher_host: str, port: int) -> float:
    """Seconds from the publish to the message's arrival."""
    topic = f"stratamq-helm-test/{uuid.uuid4().hex}"
    payload = b"stratamq helm test"
    async with aiomqtt.Client(subscriber_host, port, identifier=f"helm-test-sub-{topic[-8:]}",
                              timeout=ROUND_TRIP_TIMEOUT_S) as subscriber, \
            aiomqtt.Client(publisher_host, port, identifier=f"helm-test-pub-{topic[-8:]}",
                           timeout=ROUND_TRIP_TIMEOUT_S) as publisher:
        await subscriber.subscribe(topic, qos=1)
        started = time.monotonic()
        await publisher.publish(topic, payload, qos=1)
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
            async for message in subscriber.messages:
                if message.payload == payload:
                    return time.monotonic() - started
    raise HelmTestError("the subscriber's connection ended before the message came")


def run(namespace: str, name: str, timeout: float) -> str:
    """The test; what it saw, in one line."""
    storage = wait_ready(namespace, name, timeout)
    spec = storage.get("spec") or {}
    if not (spec.get("accessControl") or {}).get("allowAnonymous", True):
        raise HelmTestError(f"DurableStorage {namespace}/{name} is Ready but refuses "
                            "anonymous clients (accessControl.allowAnonymous: false): "
                            "this test has no credentials to connect with")
    port = int((spec.get("listeners") or {}).get("tcp", {}).get("port", DEFAULT_MQTT_PORT))
    sites = site_addresses(storage)
    if not sites:
        raise HelmTestError(f"DurableStorage {namespace}/{name} is Ready but no site pod "
                            "is ready")
    (first, first_address), (last, last_address) = sites[0], sites[-1]
    try:
        took = asyncio.run(round_trip(first_address, last_address, port))
    except (aiomqtt.MqttError, TimeoutError, OSError) as error:
        raise HelmTestError(f"no MQTT round trip from {last} ({last_address}:{port}) to "
                            f"{first} ({first_address}:{port}): "
                            f"{error or type(error).__name__}") from error
    return (f"DurableStorage {namespace}/{name} Ready; a QoS 1 message published at {last} "
            f"reached a subscriber at {first} in {took * 1000:.0f} ms")


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
        print(run(args.namespace, args.storage, args.timeout))
    except HelmTestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ApiException, ConfigException, urllib3.exceptions.HTTPError) as error:
        print(f"error: the API server: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
