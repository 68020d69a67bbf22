"""Durable sessions across generation rollovers: when a shard starts a new generation,
what a session has read of the closed one is never sent again. A connected and an
offline durable session each get every message exactly once at QoS 2; at QoS 1 a
message may come again only as a resend (DUP=1, after a reconnect), never as a new
PUBLISH (DUP=0, new packet identifier).

Rollovers are forced with a short `message_retention_period`: a shard adds a
generation once its current one is older than the period (see `plan_retention`);
the test waits for them on the admin API, and a closed generation outlives its close
by one period, longer than the test needs it."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.mqtt import (
    MQTT_5,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)
from tests.support.clients import (
    TIMEOUT,
    RawClient,
    generations,
    unique,
)

RETENTION = "4s"
ROUNDS = 3  # rollovers
PER_HALF = 20  # messages before and after each rollover
QUIET = 1.0  # several renew_streams_interval (200 ms in the harness)
# Packets one drain reads at most, and at most after the last expected one: a broker
# that repeats itself endlessly must still let the test end (and soon: the messages
# of a closed generation are only kept for one retention period).
MAX_PACKETS = 2000
MAX_EXTRA = 60


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with running_broker(tmp_path, {"durable_sessions":
                                   {"message_retention_period": RETENTION}}) as process:
        yield process


class Receiver:
    """The application side of one durable session: acknowledges everything, counts
    what reaches the application (a QoS 2 PUBLISH whose packet id awaits PUBREL is a
    resend, not a new delivery) and every PUBLISH sent as new (DUP=0)."""

    def __init__(self) -> None:
        self.delivered: collections.Counter[bytes] = collections.Counter()
        self.sent_as_new: collections.Counter[bytes] = collections.Counter()
        self._awaiting_pubrel: set[int] = set()

    def drain(self, client: RawClient, expected: list[bytes], quiet: float = 0.3) -> None:
        """Read and acknowledge until every expected payload has been delivered and
        then nothing comes for `quiet` seconds, or MAX_EXTRA packets came after it
        (a broker that repeats itself endlessly must not keep the test going)."""
        extra = 0
        for _ in range(MAX_PACKETS):
            complete = all(payload in self.delivered for payload in expected)
            if complete:
                extra += 1
                if extra > MAX_EXTRA:
                    return
            try:
                packet = client.recv(quiet if complete else TIMEOUT)
            except TimeoutError:
                return
            if packet is None:
                return
            if isinstance(packet, Publish):
                assert packet.packet_id is not None
                if not packet.dup:
                    self.sent_as_new[packet.payload] += 1
                if packet.qos == 1:
                    self.delivered[packet.payload] += 1
                    client.send(Puback(packet.packet_id))
                else:
                    if packet.packet_id not in self._awaiting_pubrel:
                        self.delivered[packet.payload] += 1
                    self._awaiting_pubrel.add(packet.packet_id)
                    client.send(Pubrec(packet.packet_id))
            elif isinstance(packet, Pubrel):
                self._awaiting_pubrel.discard(packet.packet_id)
                client.send(Pubcomp(packet.packet_id))


def connect(broker: BrokerProcess, client_id: str, resume: bool) -> RawClient:
    client = RawClient(broker.port, MQTT_5)
    connack = client.connect(client_id, clean_start=False,
                             properties=Properties(session_expiry_interval=3600))
    assert (connack.reason_code, connack.session_present) == (0, resume)
    return client


def current_generation(broker: BrokerProcess) -> int:
    return max(max(ids) for ids in generations(broker).values())


def wait_for_rollover(broker: BrokerProcess, after: int, reader: Receiver,
                      client: RawClient) -> None:
    """Until every shard has a generation newer than `after`; the connected session
    is served meanwhile."""
    deadline = time.monotonic() + 30
    while min(max(ids) for ids in generations(broker).values()) <= after:
        assert time.monotonic() < deadline, "no generation rollover"
        reader.drain(client, [], 0.1)


@pytest.mark.parametrize("qos", [1, 2])
def test_sessions_get_each_message_once_across_generation_rollovers(
        broker: BrokerProcess, qos: int) -> None:
    prefix = unique("gen")
    online_id, offline_id = unique("online"), unique("offline")
    online = connect(broker, online_id, resume=False)
    assert online.subscribe(f"{prefix}/#", qos).reason_codes == [qos]
    offline = connect(broker, offline_id, resume=False)
    assert offline.subscribe(f"{prefix}/#", qos).reason_codes == [qos]
    offline.disconnect()
    online_reader, offline_reader = Receiver(), Receiver()
    publisher = RawClient(broker.port, MQTT_5)
    publisher.connect(unique("pub"))
    published: list[bytes] = []
    packet_id = 0

    def publish_some(round_: int, half: str) -> None:
        nonlocal packet_id
        for number in range(PER_HALF):
            payload = b"%d-%s-%d" % (round_, half.encode(), number)
            packet_id = packet_id % 60_000 + 1
            ack = publisher.publish(f"{prefix}/{number % 3}", payload, qos,
                                    packet_id=packet_id)
            assert isinstance(ack, Puback | Pubcomp) and ack.reason_code == 0
            published.append(payload)

    for round_ in range(ROUNDS):
        before = current_generation(broker)
        publish_some(round_, "before")
        wait_for_rollover(broker, before, online_reader, online)
        publish_some(round_, "after")
        # the offline session comes back for what it missed, then goes away again
        offline = connect(broker, offline_id, resume=True)
        offline_reader.drain(offline, published)
        offline.disconnect()
        online_reader.drain(online, published)
    publisher.disconnect()
    # Long enough for stream discovery to run several times more.
    online_reader.drain(online, published, QUIET)
    offline = connect(broker, offline_id, resume=True)
    offline_reader.drain(offline, published, QUIET)
    offline.disconnect()
    online.disconnect()

    failures = []
    for name, reader in [("online", online_reader), ("offline", offline_reader)]:
        lost = [p for p in published if p not in reader.delivered]
        if lost:
            failures.append(f"{name}: {len(lost)} messages never delivered, e.g. {lost[:3]}")
        resent_as_new = {p: n for p, n in reader.sent_as_new.items() if n > 1}
        if resent_as_new:
            failures.append(
                f"{name}: {len(resent_as_new)} of {len(published)} messages sent again as "
                f"new PUBLISH (DUP=0), e.g. {sorted(resent_as_new.items())[:3]}")
        twice = {p: n for p, n in reader.delivered.items() if n > 1}
        if qos == 2 and twice:
            failures.append(f"{name}: {len(twice)} QoS 2 messages delivered more than once")
    assert not failures, "\n".join(failures)
