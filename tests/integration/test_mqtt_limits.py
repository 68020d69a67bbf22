"""Protocol limits with their configuration keys, and the last protocol rules on
PUBLISH: each against a real broker process."""

from __future__ import annotations

import socket
import time

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import Disconnect, Properties, Publish, Suback, Subscribe
from stratamq.broker.mqtt.packets import SubscriptionOptions
from tests.support.clients import RawClient, unique

BROKER_CONFIG = {"mqtt": {"max_connections": 3, "connect_timeout": "300ms", "max_topic_levels": 3}}


def closing_reasons(client: RawClient) -> list[int]:
    return [p.reason_code for p in client.wait_closed() if isinstance(p, Disconnect)]


def test_connections_over_the_maximum_are_refused(broker: BrokerProcess) -> None:
    clients = [RawClient(broker.port) for _ in range(3)]
    for client in clients:
        client.connect(unique("many"))
    extra = RawClient(broker.port)
    extra.send_bytes(b"")  # no CONNECT needed: closed before a byte is read
    assert extra.wait_closed() == []
    for client in clients:
        client.close()
    # a place is free again once the server has seen them go
    deadline = time.monotonic() + 10
    while True:
        later = RawClient(broker.port)
        try:
            later.connect(unique("later"))
            break
        except (AssertionError, OSError):
            later.close()
            assert time.monotonic() < deadline, "no place freed after the clients left"
            time.sleep(0.1)
    later.close()


def test_a_connection_that_never_sends_connect_is_closed(broker: BrokerProcess) -> None:
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as silent:
        silent.settimeout(10)
        assert silent.recv(16) == b""  # closed by the server after connect_timeout


def test_topic_levels_over_the_maximum(broker: BrokerProcess) -> None:
    subscriber = RawClient(broker.port)
    subscriber.connect(unique("levels"))
    subscriber.send(Subscribe(1, [("a/b/c/d", SubscriptionOptions(1)),
                                  ("a/b/c", SubscriptionOptions(1))]))
    assert subscriber.expect(Suback).reason_codes == [0x8F, 1]
    subscriber.close()
    publisher = RawClient(broker.port)
    publisher.connect(unique("levels"))
    publisher.send(Publish("a/b/c/d", b"x", 1, packet_id=1))
    assert closing_reasons(publisher) == [0x90]


def test_subscription_identifier_from_a_client_is_a_protocol_error(
        broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("subid"))
    client.send(Publish("a", b"x", 1, packet_id=1,
                        properties=Properties(subscription_identifiers=[5])))
    assert closing_reasons(client) == [0x82]


def test_empty_topic_without_alias_is_a_protocol_error(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    client.connect(unique("empty"))
    client.send(Publish("", b"x", 0))
    assert closing_reasons(client) == [0x82]
