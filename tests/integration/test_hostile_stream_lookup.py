"""A durable wildcard SUBSCRIBE over thousands of streams never stalls the site.

3,000 topics that each become a stream of their own (no level reaches the learned
wildcard threshold), then a durable session subscribes `prefix/#`: starting an
iterator used to match the filter against the whole trie once per stream
(quadratic, on the event loop), so every other client waited about 13 s, and again
at every reconnect of that session. Another client's PINGREQ and QoS 1 round trips
are measured meanwhile; the durable subscriber still gets what it should."""

from __future__ import annotations

import threading
import time

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import (
    MQTT_5,
    Connack,
    Connect,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from tests.support.clients import RawClient, unique

STREAMS = 3000
# Every level has at most 10 distinct values: below the threshold of every depth
# (100 at the root, 10 deeper), so each topic is a stream of its own.
DIGITS = 4
# a round trip this long means the loop was blocked (before: 10+ s)
BOUND = 2.0


def topic(root: str, i: int) -> str:
    return "/".join([root, *f"{i:0{DIGITS}d}"])


class RoundTrips:
    """Another client's PINGREQ then QoS 1 PUBLISH round trips, back to back, in a
    thread, until stopped: the slowest one is what the attack cost it."""

    def __init__(self, port: int) -> None:
        self.client = RawClient(port)
        assert self.client.connect(unique("probe")).reason_code == 0
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        packet_id = 0
        while not self._stop.is_set():
            started = time.monotonic()
            self.client.send(Pingreq())
            assert isinstance(self.client.recv(60), Pingresp)
            packet_id = packet_id % 60000 + 1
            self.client.send(Publish(unique("probe-topic"), b"p", 1, False, False, packet_id,
                                     Properties()))
            assert isinstance(self.client.recv(60), Puback)
            self.times.append(time.monotonic() - started)
            time.sleep(0.05)

    def __enter__(self) -> RoundTrips:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(90)
        self.client.close()


def receive(client: RawClient, count: int) -> set[str]:
    topics: set[str] = set()
    while len(topics) < count:
        publish = client.expect(Publish, timeout=30)
        if publish.packet_id is not None:
            client.send(Puback(publish.packet_id))
        topics.add(publish.topic)
    return topics


def test_a_durable_wildcard_subscribe_over_3000_streams_stalls_no_one(
        broker: BrokerProcess) -> None:
    root = unique("streams")
    seeder = RawClient(broker.port)
    assert seeder.connect(unique("seeder")).reason_code == 0
    for i in range(STREAMS):
        seeder.publish(topic(root, i), b"seed", 0)
    seeder.publish(topic(root, 0), b"seed", 1, packet_id=1)  # all of them stored
    client_id = unique("durable")
    durable = Properties(session_expiry_interval=600)
    subscriber = RawClient(broker.port)
    assert subscriber.connect(client_id, clean_start=False,
                              properties=durable).reason_code == 0
    with RoundTrips(broker.port) as probe:
        time.sleep(0.3)
        started = time.monotonic()
        subscriber.send(Subscribe(1, [(f"{root}/#", SubscriptionOptions(1))]))
        assert subscriber.expect(Suback, timeout=120).reason_codes == [1]
        suback_after = time.monotonic() - started
        # new messages on streams old and new reach the subscriber
        sent = {topic(root, i) for i in range(0, STREAMS, 600)} | {f"{root}/new/one"}
        for packet_id, name in enumerate(sorted(sent), 1):
            seeder.publish(name, b"after", 1, packet_id=packet_id)
        assert receive(subscriber, len(sent)) == sent
        subscriber.close()
        # while it is away, more; at its reconnect, its streams are found again
        missed = {topic(root, i) for i in range(7, STREAMS, 500)}
        for packet_id, name in enumerate(sorted(missed), 1):
            seeder.publish(name, b"missed", 1, packet_id=packet_id)
        subscriber = RawClient(broker.port)
        started = time.monotonic()
        subscriber.send(Connect(client_id, MQTT_5, False, 60, None, None, None, durable))
        connack = subscriber.expect(Connack, timeout=120)
        connack_after = time.monotonic() - started
        assert connack.session_present
        assert receive(subscriber, len(missed)) == missed
        time.sleep(1.0)  # a few renewals of its streams
    subscriber.close()
    seeder.disconnect()
    slowest = max(probe.times)
    print(f"\n{STREAMS} streams: SUBACK after {suback_after:.2f} s, "
          f"CONNACK at reconnect after {connack_after:.2f} s; slowest of "
          f"{len(probe.times)} round trips of another client {slowest:.2f} s")
    assert len(probe.times) >= 5
    assert slowest < BOUND, f"another client waited {slowest:.1f} s"

