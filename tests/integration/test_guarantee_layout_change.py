"""Durable sessions across a layout change: the broker restarts with another
`layout.type` (v2 -> wildcard_optimized -> v2); each change takes effect at the next
generation, and a session replays across generations of both layouts without gap or
duplicate (QoS 2: each message exactly once; a PUBLISH sent again is a resend).

Rollovers come from a short `message_retention_period` as in
test_guarantee_generation_rollover; topics have more distinct second levels than the
learning threshold, so the subscription `prefix/#` reads a `+` stream: the bit-field
layout's wildcard readers wait for epochs to close (short ones here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import MQTT_5, Pubcomp
from tests.integration.test_guarantee_generation_rollover import (
    Receiver,
    connect,
    current_generation,
    wait_for_rollover,
)
from tests.support.clients import RawClient, admin_get, unique

RETENTION = "6s"
LEVELS = 14  # distinct second levels: above the learning threshold of 10
PER_HALF = 28


def config(layout: str) -> dict[str, Any]:
    return {"durable_sessions": {"message_retention_period": RETENTION},
            "durable_storage": {"messages": {"layout": {"type": layout, "epoch_bits": 14}}}}


def layouts_of(broker: BrokerProcess) -> list[str]:
    """The layout of each generation of shard 0, oldest first."""
    view = admin_get(broker, "/api/v1/ds/storages/messages")
    shard = next(s for s in view["shards"] if s["id"] == 0)
    return [g["layout"] for g in sorted(shard["generations"], key=lambda g: g["id"])]


def test_sessions_replay_across_generations_of_both_layouts(tmp_path: Path) -> None:
    prefix = unique("layout")
    online_id, offline_id = unique("online"), unique("offline")
    online_reader, offline_reader = Receiver(), Receiver()
    published: list[bytes] = []
    broker = BrokerProcess(tmp_path, config("wildcard_optimized_v2")).start()
    try:
        online = connect(broker, online_id, resume=False)
        assert online.subscribe(f"{prefix}/#", 2).reason_codes == [2]
        offline = connect(broker, offline_id, resume=False)
        assert offline.subscribe(f"{prefix}/#", 2).reason_codes == [2]
        offline.disconnect()
        packet_id = 0

        def publish_some(label: str) -> None:
            nonlocal packet_id
            publisher = RawClient(broker.port, MQTT_5)
            publisher.connect(unique("pub"))
            for number in range(PER_HALF):
                payload = b"%s-%d" % (label.encode(), number)
                packet_id = packet_id % 60_000 + 1
                ack = publisher.publish(f"{prefix}/{number % LEVELS}", payload, 2,
                                        packet_id=packet_id)
                assert isinstance(ack, Pubcomp) and ack.reason_code == 0
                published.append(payload)
            publisher.disconnect()

        for round_, layout in enumerate(["wildcard_optimized", "wildcard_optimized_v2"]):
            publish_some(f"{round_}-before-restart")
            online_reader.drain(online, published)
            online.disconnect()
            assert broker.stop() == 0, broker.log_tail()
            broker = BrokerProcess(tmp_path, config(layout)).start()
            online = connect(broker, online_id, resume=True)
            # the current generation keeps its layout until the next one starts
            assert layouts_of(broker)[-1] != layout
            publish_some(f"{round_}-before")
            before = current_generation(broker)
            wait_for_rollover(broker, before, online_reader, online)
            assert layouts_of(broker)[-1] == layout
            publish_some(f"{round_}-after")
            # the offline session replays across the two layouts in one go
            offline = connect(broker, offline_id, resume=True)
            offline_reader.drain(offline, published)
            offline.disconnect()
            online_reader.drain(online, published)
        online_reader.drain(online, published, 1.0)
        online.disconnect()
        offline = connect(broker, offline_id, resume=True)
        offline_reader.drain(offline, published, 1.0)
        offline.disconnect()
        assert "Traceback" not in broker.log(), broker.log_tail()
    finally:
        broker.kill()

    for name, reader in [("online", online_reader), ("offline", offline_reader)]:
        lost = [p for p in published if p not in reader.delivered]
        assert not lost, f"{name}: {len(lost)} messages never delivered, e.g. {lost[:3]}"
        twice = {p: n for p, n in reader.delivered.items() if n > 1}
        assert not twice, f"{name}: delivered more than once: {sorted(twice.items())[:3]}"
        again = {p: n for p, n in reader.sent_as_new.items() if n > 1}
        assert not again, f"{name}: sent again as new PUBLISH: {sorted(again.items())[:3]}"
