"""Retained messages at scale: with 100,000 retained messages stored, a SUBSCRIBE to
one exact topic gets that topic's retained message (and only it). Today every
SUBSCRIBE scans and decodes every retained message on the event loop, per filter;
the SUBACK latency is printed (not asserted: timings never decide pass/fail), the
figure to compare before and after the fix. `RETAINED_COUNT` overrides the count."""

from __future__ import annotations

import os
import time
from pathlib import Path

from harness.processes import running_broker
from stratamq.broker.mqtt import (
    MQTT_5,
    Puback,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    encode,
)
from tests.support.clients import RawClient, unique

COUNT = int(os.environ.get("RETAINED_COUNT", "100000"))
CHUNK = 5000


def test_exact_subscribe_among_100k_retained_messages(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        root = unique("ret")
        publisher = RawClient(broker.port, MQTT_5)
        assert publisher.connect(unique("retainer")).reason_code == 0
        started = time.monotonic()
        for first in range(0, COUNT, CHUNK):
            publisher.send_bytes(b"".join(
                encode(Publish(f"{root}/{i // 1000}/{i}", f"v{i}".encode(), 0, True), MQTT_5)
                for i in range(first, min(first + CHUNK, COUNT))))
        # retained updates are applied in publish order: once this one is stored (its
        # PUBACK), every one before it is
        publisher.send(Publish(f"{root}/done", b"done", 1, True, packet_id=1))
        assert publisher.expect(Puback, timeout=55).reason_code == 0
        print(f"\n{COUNT} retained messages stored in {time.monotonic() - started:.1f} s")

        target = COUNT // 2
        subscriber = RawClient(broker.port, MQTT_5)
        assert subscriber.connect(unique("reader")).reason_code == 0
        asked = time.monotonic()
        subscriber.send(Subscribe(1, [(f"{root}/{target // 1000}/{target}",
                                       SubscriptionOptions(1))]))
        suback = subscriber.expect(Suback, timeout=30)
        latency = time.monotonic() - asked
        message = subscriber.expect(Publish, timeout=30)
        print(f"SUBACK for one exact filter among {COUNT} retained messages: "
              f"{latency * 1000:.0f} ms")
        assert suback.reason_codes == [1]
        assert (message.topic, message.payload, message.retain) == (
            f"{root}/{target // 1000}/{target}", f"v{target}".encode(), True)
        subscriber.quiet()

        # a wildcard filter over one block of 1,000: all of them, no other
        block = (COUNT - 1) // 1000
        asked = time.monotonic()
        subscriber.send(Subscribe(2, [(f"{root}/{block}/+", SubscriptionOptions(0))]))
        assert subscriber.expect(Suback, timeout=30).reason_codes == [0]
        print(f"SUBACK for {root}/{block}/+: {(time.monotonic() - asked) * 1000:.0f} ms")
        expected = {f"{root}/{block}/{i}" for i in range(block * 1000, COUNT)}
        got = [subscriber.expect(Publish, timeout=30).topic for _ in expected]
        assert sorted(got) == sorted(expected)
        subscriber.quiet()
        subscriber.disconnect()
        publisher.disconnect()
