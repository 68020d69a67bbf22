"""A SUBSCRIBE on a durable session writes what it changed, not the whole session.

A durable session's state was one record, rewritten whole on every change: at 1,000
subscriptions each 20-byte SUBSCRIBE wrote the session's whole record (172 KB)
through the shard log and cost the site 12-20 ms of CPU, so four clients at about
1 KB/s kept a site 70-90% busy. Now: 181 B and under 1 ms, at 10 subscriptions or
1,000. The bytes written to the `sessions` database per
SUBSCRIBE (`stratamq_ds_buffer_record_bytes`) must not grow with the number of
subscriptions, and neither must the site's CPU per SUBSCRIBE."""

from __future__ import annotations

import urllib.request

from harness.processes import HOST, BrokerProcess, process_cpu_seconds
from stratamq.broker.mqtt import Properties, Suback, Subscribe, SubscriptionOptions
from tests.support.clients import TIMEOUT, RawClient, unique

MANY = 1000  # mqtt.max_subscriptions, the default cap
FEW = 10
MEASURED = 40  # SUBSCRIBEs measured at each size
DURABLE = Properties(session_expiry_interval=300)


def sessions_bytes_written(broker: BrokerProcess) -> float:
    """`stratamq_ds_buffer_record_bytes` of the `sessions` database, all shards."""
    with urllib.request.urlopen(f"http://{HOST}:{broker.admin_port}/metrics",
                                timeout=TIMEOUT) as response:
        text = response.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith('stratamq_ds_buffer_record_bytes_total{db="sessions"'))


def subscribe(client: RawClient, packet_id: int, filters: list[str]) -> None:
    client.send(Subscribe(packet_id, [(f, SubscriptionOptions(1)) for f in filters]))
    assert client.expect(Suback, timeout=30).reason_codes == [1] * len(filters)


def cost_per_subscribe(broker: BrokerProcess, count: int) -> tuple[float, float]:
    """(bytes written to `sessions`, CPU seconds of the site) per SUBSCRIBE of one
    filter, on a durable session that holds `count` subscriptions."""
    root = unique("sw")
    client = RawClient(broker.port)
    assert client.connect(unique("sw-durable"), clean_start=False,
                          properties=DURABLE).reason_code == 0
    filters = [f"{root}/{i}" for i in range(count)]
    for packet_id, start in enumerate(range(0, count, 100), start=1):
        subscribe(client, packet_id, filters[start:start + 100])
    written, cpu = sessions_bytes_written(broker), process_cpu_seconds(broker.pid)
    for n in range(MEASURED):  # each replaces one subscription: the count stays
        subscribe(client, 100 + n, [filters[n % count]])
    cost = ((sessions_bytes_written(broker) - written) / MEASURED,
            (process_cpu_seconds(broker.pid) - cpu) / MEASURED)
    client.disconnect()
    client.close()
    return cost


def test_a_subscribe_writes_what_changed_whatever_the_number_of_subscriptions(
        broker: BrokerProcess) -> None:
    few_bytes, few_cpu = cost_per_subscribe(broker, FEW)
    many_bytes, many_cpu = cost_per_subscribe(broker, MANY)
    print(f"per SUBSCRIBE at {FEW} subscriptions: {few_bytes:.0f} B, {few_cpu * 1000:.1f} ms"
          f" CPU; at {MANY}: {many_bytes:.0f} B, {many_cpu * 1000:.1f} ms CPU")
    assert few_bytes > 0  # it is counted
    assert many_bytes < few_bytes * 2 + 200, (few_bytes, many_bytes)
    assert many_bytes < 2000, many_bytes
    # wide: the CPU of the whole site (its background loops too), on a shared machine
    assert many_cpu < 0.006, many_cpu
