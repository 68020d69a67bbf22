"""Deep topics cannot grow the learned topic structure without bound.

5,000 QoS 1 publishes of 120-level topics that each part from the others near
their start (the number written least significant digit first, then filler) used
to learn about 117 trie edges each: RSS grew by 262 MiB (about 52 KiB a publish) and
the trie was reloaded at every start (20 s instead of 1 s). The trie is bounded in
levels and bytes (`durable_storage.messages.learned_topics`): what goes past the
bound is folded into one varying level of the deepest state learned, counted in
`stratamq_ds_lts_folded_topics_total`. The messages still reach exact and wildcard
subscribers."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import Properties, Puback, Publish
from tests.support.clients import RawClient, metric_value, unique

TOPICS = 5000
LEVELS = 120
WINDOW = 50  # QoS 1 publishes in flight at once


def deep_topic(root: str, i: int) -> str:
    digits = list(str(i)[::-1])  # parts from its neighbours at the first levels
    return "/".join([root, *digits, *(["x"] * (LEVELS - 1 - len(digits)))])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def publish_all(port: int, topics: list[str]) -> None:
    """QoS 1, WINDOW at a time: every one acknowledged (stored)."""
    client = RawClient(port)
    assert client.connect(unique("deep-pub")).reason_code == 0
    for start in range(0, len(topics), WINDOW):
        window = topics[start:start + WINDOW]
        for packet_id, name in enumerate(window, 1):
            client.send(Publish(name, b"deep", 1, False, False, packet_id, Properties()))
        for _ in window:
            assert client.expect(Puback, timeout=60).reason_code == 0
    client.disconnect()


def received(client: RawClient, count: int) -> list[str]:
    topics: list[str] = []
    while len(topics) < count:
        publish = client.expect(Publish, timeout=30)
        if publish.packet_id is not None:
            client.send(Puback(publish.packet_id))
        topics.append(publish.topic)
    return topics


def timed_start(broker: BrokerProcess) -> float:
    started = time.monotonic()
    broker.start(timeout=120)
    return time.monotonic() - started


def test_deep_topics_grow_memory_and_start_time_boundedly(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    # 4 shards in tests: each gets 8 MiB, its share of the default 128 MiB of 16 shards
    broker = broker_factory({"durable_storage": {"messages": {
        "learned_topic_bytes": "32MiB"}}}, start=False)
    first_start = timed_start(broker)
    root = unique("deep")
    topics = [deep_topic(root, i) for i in range(TOPICS)]
    exact_topic = topics[1234]
    # a `+` far below the bound of learned levels: read from a folded stream
    deep_filter = "/".join([*exact_topic.split("/")[:LEVELS - 2], "+", "x"])
    subscribers = {}
    for name, topic_filter in (("all", f"{root}/#"), ("exact", exact_topic),
                               ("deep", deep_filter)):
        subscriber = RawClient(broker.port)
        assert subscriber.connect(unique(name), clean_start=False,
                                  properties=Properties(session_expiry_interval=600)
                                  ).reason_code == 0
        assert subscriber.subscribe(topic_filter, 1).reason_codes == [1]
        subscribers[name] = subscriber
    publish_all(broker.port, topics[:100])  # the site's own warm-up
    for name, count in (("all", 100), ("exact", 0), ("deep", 0)):
        received(subscribers[name], count)
    rss_before = rss_bytes(broker.pid)
    publish_all(broker.port, topics[100:])
    grown = rss_bytes(broker.pid) - rss_before
    assert sorted(received(subscribers["all"], TOPICS - 100)) == sorted(topics[100:])
    assert received(subscribers["exact"], 1) == [exact_topic]
    assert received(subscribers["deep"], 1) == [exact_topic]
    for subscriber in subscribers.values():
        subscriber.quiet(0.5)
        subscriber.close()
    folded = metric_value(broker, "stratamq_ds_lts_folded_topics_total", db="messages")

    assert broker.stop() == 0
    start_time = timed_start(broker)
    # after the restart the learned (and folded) streams are read again
    again = RawClient(broker.port)
    assert again.connect(unique("after"), clean_start=False).reason_code == 0
    assert again.subscribe(f"{root}/#", 1).reason_codes == [1]
    publish_all(broker.port, [exact_topic, topics[7]])
    assert sorted(received(again, 2)) == sorted([exact_topic, topics[7]])
    again.close()
    print(f"\n{TOPICS} {LEVELS}-level topics: RSS grew {grown / 2**20:.1f} MiB "
          f"({grown / (TOPICS - 100) / 1024:.1f} KiB a publish), restart took "
          f"{start_time:.1f} s (first start {first_start:.1f} s), {folded:.0f} topics folded")
    assert grown < 64 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB"
    assert start_time < first_start + 4  # before: 8.6 s after a first start of 1 s
    assert folded > 0
