"""Overlapping subscriptions of one client (MQTT 5.0 section 3.3.4): a client
subscribed to `a/+` (identifier 1) and `a/b` (identifier 2) and a message on `a/b`.

The specification requires a copy at the highest QoS the matching subscriptions grant
(MQTT-3.3.4-2) and allows one further copy per other matching subscription, each with
its own identifier (MQTT-3.3.4-5); a single copy must carry all identifiers
(MQTT-3.3.4-4). Mosquitto 2.0 (the installed reference; `allow_duplicate_messages` is
deprecated and ignored there) sends one copy per subscription, as stratamq does today:
`test_overlap_follows_the_specification` checks both brokers on that common ground.

stratamq's requirement goes further: ONE copy, at the highest granted QoS (capped by
the message's), carrying both identifiers, so a client's handlers do not run twice
for one message (`test_one_copy_with_both_identifiers`, stratamq only)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from harness.processes import free_port, running_broker
from stratamq.broker.mqtt import (
    MQTT_5,
    Properties,
    Puback,
    Publish,
    Pubrec,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from tests.support.clients import RawClient, unique

MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin")


@pytest.fixture(scope="module")
def stratamq_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with running_broker(tmp_path_factory.mktemp("subids")) as process:
        yield process.port


@pytest.fixture(scope="module")
def mosquitto_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    # `make test` installs mosquitto; a run without it must fail, not pass by skipping
    assert MOSQUITTO is not None, "mosquitto is not installed (make install installs it)"
    folder = tmp_path_factory.mktemp("mosquitto")
    port = free_port()
    conf = folder / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n"
                    f"persistence false\n")
    process = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "mosquitto did not start"
                time.sleep(0.05)
        yield port
    finally:
        process.kill()
        process.wait()


@pytest.fixture(params=["mosquitto", "stratamq"])
def port(request: pytest.FixtureRequest) -> int:
    value: int = request.getfixturevalue(f"{request.param}_port")
    return value


def subscribed(port: int, root: str, qos_plus: int, qos_exact: int, *,
               durable: bool = False, client_id: str | None = None) -> RawClient:
    client = RawClient(port, MQTT_5)
    properties = Properties(session_expiry_interval=300) if durable else None
    assert client.connect(client_id or unique("overlap"),
                          properties=properties).reason_code == 0
    for packet_id, (topic_filter, qos, identifier) in enumerate(
            [(f"{root}/+", qos_plus, 1), (f"{root}/b", qos_exact, 2)], 1):
        client.send(Subscribe(packet_id, [(topic_filter, SubscriptionOptions(qos))],
                              Properties(subscription_identifiers=[identifier])))
        assert client.expect(Suback).reason_codes == [qos]
    return client


def copies(client: RawClient) -> list[Publish]:
    """Every PUBLISH that arrives until the client has been quiet a while; QoS 1 and 2
    are acknowledged so nothing waits on us."""
    got: list[Publish] = []
    while True:
        try:
            packet = client.recv(1.0)
        except TimeoutError:
            return got
        if packet is None:
            return got
        if isinstance(packet, Publish):
            got.append(packet)
            if packet.qos == 1:
                client.send(Puback(packet.packet_id or 0))
            elif packet.qos == 2:
                client.send(Pubrec(packet.packet_id or 0))


def publish(port: int, topic: str, qos: int) -> None:
    publisher = RawClient(port, MQTT_5)
    assert publisher.connect(unique("pub")).reason_code == 0
    publisher.publish(topic, b"overlap", qos, packet_id=1 if qos else None)
    publisher.disconnect()


CASES = [(1, 1, 1, 1), (0, 1, 1, 1), (1, 0, 1, 1), (2, 1, 2, 2), (2, 2, 1, 1)]


@pytest.mark.parametrize(("qos_plus", "qos_exact", "message_qos", "expected_qos"), CASES)
def test_overlap_follows_the_specification(port: int, qos_plus: int, qos_exact: int,
                                           message_qos: int, expected_qos: int) -> None:
    root = unique("ovs")
    client = subscribed(port, root, qos_plus, qos_exact)
    publish(port, f"{root}/b", message_qos)
    got = copies(client)
    client.close()
    assert 1 <= len(got) <= 2
    assert max(p.qos for p in got) == expected_qos  # MQTT-3.3.4-2
    if len(got) == 1:  # MQTT-3.3.4-4
        assert sorted(got[0].properties.subscription_identifiers) == [1, 2]
    else:  # MQTT-3.3.4-5
        assert sorted(i for p in got for i in p.properties.subscription_identifiers) == [1, 2]
        assert all(len(p.properties.subscription_identifiers) == 1 for p in got)


@pytest.mark.parametrize(("qos_plus", "qos_exact", "message_qos", "expected_qos"), CASES)
def test_one_copy_with_both_identifiers(stratamq_port: int, qos_plus: int, qos_exact: int,
                                        message_qos: int, expected_qos: int) -> None:
    root = unique("ov")
    client = subscribed(stratamq_port, root, qos_plus, qos_exact)
    publish(stratamq_port, f"{root}/b", message_qos)
    got = copies(client)
    client.close()
    summary = [(p.qos, sorted(p.properties.subscription_identifiers)) for p in got]
    assert summary == [(expected_qos, [1, 2])]


def test_one_copy_in_a_durable_session(stratamq_port: int) -> None:
    """The same through a durable session, which stratamq reads from storage with
    one cursor per (subscription, stream): both cursors meet the message."""
    root = unique("ovd")
    client = subscribed(stratamq_port, root, 1, 2, durable=True)
    publish(stratamq_port, f"{root}/b", 2)
    got = copies(client)
    client.close()
    summary = [(p.qos, sorted(p.properties.subscription_identifiers)) for p in got]
    assert summary == [(2, [1, 2])]


def test_a_topic_matching_one_subscription_carries_its_identifier(port: int) -> None:
    root = unique("ov1")
    client = subscribed(port, root, 1, 1)
    publish(port, f"{root}/c", 1)
    got = copies(client)
    client.close()
    assert [(p.qos, p.properties.subscription_identifiers) for p in got] == [(1, [1])]


def test_one_copy_after_resume(stratamq_port: int) -> None:
    """Messages stored while a durable session was away are replayed by both
    cursors after it resumes: still one copy, with both identifiers."""
    root = unique("ovr")
    client_id = unique("overlap")
    subscribed(stratamq_port, root, 1, 2, durable=True, client_id=client_id).disconnect()
    publish(stratamq_port, f"{root}/b", 2)
    publish(stratamq_port, f"{root}/c", 2)
    client = RawClient(stratamq_port, MQTT_5)
    assert client.connect(client_id, clean_start=False, properties=Properties(
        session_expiry_interval=300)).session_present
    got = copies(client)
    client.close()
    # (the two topics may be in different streams: no order between them)
    summary = sorted((p.topic, p.qos, sorted(p.properties.subscription_identifiers))
                     for p in got)
    assert summary == [(f"{root}/b", 2, [1, 2]), (f"{root}/c", 1, [1])]
