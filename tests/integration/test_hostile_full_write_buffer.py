"""Publishers wait while their shard's write buffer is full; they are not refused,
nothing they were acknowledged for is lost, and the buffer's memory stays bounded.

The buffer is made tiny (`max_bytes` 64 KiB, one shard, every write fsynced) and
many publishers send large QoS 1 payloads as fast as their Receive Maximum lets them,
so the buffer is full most of the time and every publisher keeps coming back to a
full buffer. Counted, not timed:
- every PUBLISH gets a PUBACK with reason 0 (none refused with 0x89 Server busy);
- the most the buffer ever held (`stratamq_ds_buffer_queued_bytes_peak`) stays under
  max_bytes plus one message: a publisher adds only once there is room;
- after SIGKILL and a restart, a durable subscriber made before the publishing gets
  every acknowledged message: a PUBACK goes out only once its message is stored."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import MQTT_5, Properties, Puback, Publish
from tests.support.clients import RawClient, metric_value, unique

MAX_BYTES = 64 * 1024
PAYLOAD = 16 * 1024
PUBLISHERS = 16
PER_PUBLISHER = 40
WINDOW = 8  # the broker's Receive Maximum: each publisher keeps this many unacknowledged
WAIT = 60.0  # per packet; generous (fsynced writes on a busy machine)

CONFIG: dict[str, Any] = {
    "mqtt": {"receive_maximum": WINDOW},
    "durable_storage": {"messages": {
        "n_shards": 1, "sync_writes": True,
        "local_write_buffer": {"max_bytes": MAX_BYTES, "max_items": 1000}}},
}


def publish_all(port: int, prefix: str, number: int, codes: list[int],
                failures: list[str]) -> None:
    """Publish PER_PUBLISHER QoS 1 messages, WINDOW unacknowledged at a time."""
    try:
        client = RawClient(port, MQTT_5)
        assert client.connect(unique(f"pub{number}")).reason_code == 0
        topic = f"{prefix}/{number}"
        sent = 0

        def send_next() -> None:
            nonlocal sent
            payload = f"{number}:{sent}:".encode().ljust(PAYLOAD, b".")
            client.send(Publish(topic, payload, 1, packet_id=sent + 1))
            sent += 1

        while sent < WINDOW:
            send_next()
        while len(codes) < PER_PUBLISHER:
            ack = client.recv(WAIT)
            assert isinstance(ack, Puback), f"expected a PUBACK, got {ack!r}"
            codes.append(ack.reason_code)
            if ack.reason_code == 0 and sent < PER_PUBLISHER:
                send_next()
            elif ack.reason_code != 0:
                return
        client.disconnect()
    except (AssertionError, OSError, TimeoutError) as error:
        failures.append(f"publisher {number}: {error!r}")


def in_threads(targets: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_publishers_wait_for_a_full_buffer_and_lose_nothing(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(CONFIG)
    prefix = unique("full")
    subscriber_id = unique("sub")
    properties = Properties(session_expiry_interval=3600)
    subscriber = RawClient(broker.port, MQTT_5)
    subscriber.connect(subscriber_id, clean_start=False, properties=properties)
    assert subscriber.subscribe(f"{prefix}/#", 1).reason_codes == [1]
    subscriber.disconnect()

    codes: list[list[int]] = [[] for _ in range(PUBLISHERS)]
    failures: list[str] = []
    in_threads([functools.partial(publish_all, broker.port, prefix, n, codes[n], failures)
                for n in range(PUBLISHERS)])
    assert failures == []
    refused = [code for per in codes for code in per if code != 0]
    assert refused == [], f"refused: {refused}"
    assert sum(map(len, codes)) == PUBLISHERS * PER_PUBLISHER
    peak = metric_value(broker, "stratamq_ds_buffer_queued_bytes_peak",
                        db="messages", shard="0")
    message_size = PAYLOAD + len(f"{prefix}/{PUBLISHERS}")
    assert peak >= MAX_BYTES, "the buffer never filled: the test shows nothing"
    assert peak < MAX_BYTES + message_size, f"{peak} bytes queued at most"

    broker.kill()  # SIGKILL: only what was stored before its PUBACK survives
    broker.start()
    subscriber = RawClient(broker.port, MQTT_5)
    assert subscriber.connect(subscriber_id, clean_start=False,
                              properties=properties).session_present
    received: set[bytes] = set()
    try:
        while len(received) < PUBLISHERS * PER_PUBLISHER:
            packet = subscriber.expect(Publish, WAIT)
            assert packet.packet_id is not None
            subscriber.send(Puback(packet.packet_id))
            received.add(packet.payload.split(b".", 1)[0])
    except TimeoutError:
        pass
    expected = {f"{n}:{i}:".encode() for n in range(PUBLISHERS) for i in range(PER_PUBLISHER)}
    assert received == expected, f"{len(expected - received)} acknowledged messages lost"
    subscriber.disconnect()
