"""Subscriptions per session are capped (`mqtt.max_subscriptions`), and a large
SUBSCRIBE within the cap never stalls the site.

One SUBSCRIBE with 3,000 filters used to block the event loop for about a minute:
every other client of the site waited. Filters beyond the cap are refused in the
SUBACK with 0x97 Quota exceeded (MQTT 5) or 0x80 (3.1.1); the filters within it are
granted, and replacing an existing subscription does not count as a new one."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Pingreq,
    Pingresp,
    Properties,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
)
from tests.support.clients import RawClient, unique

CAP = 5
QUOTA_EXCEEDED = {MQTT_5: 0x97, MQTT_3_1_1: 0x80}
BIG = 3000


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path_factory.mktemp("subcap"),
                        {"mqtt": {"max_subscriptions": CAP}}) as process:
        yield process


def subscribe_many(client: RawClient, packet_id: int, filters: list[str]) -> list[int]:
    client.send(Subscribe(packet_id, [(f, SubscriptionOptions(1)) for f in filters]))
    return client.expect(Suback, timeout=30).reason_codes


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_subscriptions_beyond_the_cap_are_refused(capped: BrokerProcess, level: int) -> None:
    root = unique("cap")
    refused = QUOTA_EXCEEDED[level]
    client = RawClient(capped.port, level)
    assert client.connect(unique("capped")).reason_code == 0
    filters = [f"{root}/{i}" for i in range(CAP + 3)]
    assert subscribe_many(client, 1, filters) == [1] * CAP + [refused] * 3
    # replacing a subscription is not a new one; a new one is still over the cap
    assert subscribe_many(client, 2, [filters[0], f"{root}/new"]) == [1, refused]
    # a place freed by UNSUBSCRIBE can be taken
    client.send(Unsubscribe(3, [filters[1]]))
    client.expect(Unsuback)
    assert subscribe_many(client, 4, [f"{root}/new"]) == [1]
    # refused filters receive nothing; granted ones do
    publisher = RawClient(capped.port)
    assert publisher.connect(unique("pub")).reason_code == 0
    publisher.publish(filters[CAP], b"refused", 1, packet_id=1)
    publisher.publish(f"{root}/new", b"granted", 1, packet_id=2)
    publisher.disconnect()
    assert client.expect(Publish).payload == b"granted"
    client.quiet()
    client.close()


def test_the_cap_counts_the_session_not_the_connection(capped: BrokerProcess) -> None:
    """A durable session keeps its subscriptions: reconnecting does not reset the count."""
    root, client_id = unique("capd"), unique("capped-durable")
    durable = Properties(session_expiry_interval=300)
    client = RawClient(capped.port)
    assert client.connect(client_id, clean_start=False, properties=durable).reason_code == 0
    assert subscribe_many(client, 1, [f"{root}/{i}" for i in range(CAP)]) == [1] * CAP
    client.disconnect()
    client = RawClient(capped.port)
    connack = client.connect(client_id, clean_start=False, properties=durable)
    assert (connack.reason_code, connack.session_present) == (0, True)
    assert subscribe_many(client, 2, [f"{root}/more"]) == [0x97]
    client.disconnect()


@pytest.mark.parametrize("durable", [False, True])
def test_a_subscribe_with_3000_filters_does_not_stall_other_clients(
        tmp_path_factory: pytest.TempPathFactory, durable: bool) -> None:
    """A SUBSCRIBE of 3,000 filters (the cap set above it) is granted whole, and while
    the broker works on it every one of 20 other clients that connects gets its
    CONNACK and a PINGRESP. The 20 connect one after another, each given 5 s: the
    count of them served is what is asserted (the old behaviour served none of them
    before the SUBACK, about a minute later)."""
    workdir = tmp_path_factory.mktemp("bigsub")
    with running_broker(workdir, {"mqtt": {"max_subscriptions": BIG + 1000}}) as broker:
        root = unique("big")
        # some streams and retained messages for the filters to find
        seeder = RawClient(broker.port)
        assert seeder.connect(unique("seed")).reason_code == 0
        for i in range(0, BIG, 30):
            seeder.publish(f"{root}/{i}/v", b"seed", 0, retain=i % 300 == 0)
        seeder.publish(f"{root}/last", b"x", 1, packet_id=1)
        seeder.disconnect()

        heavy = RawClient(broker.port)
        properties = Properties(session_expiry_interval=300) if durable else None
        assert heavy.connect(unique("heavy"), clean_start=not durable,
                             properties=properties).reason_code == 0
        started = time.monotonic()
        heavy.send(Subscribe(1, [(f"{root}/{i}/+", SubscriptionOptions(1))
                                 for i in range(BIG)]))
        served = 0
        for _ in range(20):
            other = RawClient(broker.port)
            try:
                if other.connect(unique("other")).reason_code == 0:
                    other.send(Pingreq())
                    if isinstance(other.recv(5.0), Pingresp):
                        served += 1
            except (AssertionError, TimeoutError, OSError):
                pass
            finally:
                other.close()
        suback = heavy.expect(Suback, timeout=50)
        print(f"\n3,000-filter SUBACK after {time.monotonic() - started:.1f} s "
              f"(durable={durable}); other clients served meanwhile: {served}/20")
        assert suback.reason_codes == [1] * BIG
        assert served == 20
        heavy.close()
