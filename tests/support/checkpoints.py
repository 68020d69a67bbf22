"""Checkpoints of a real site for the data pipeline's tests: publish a workload over
MQTT, then ask the admin API for a checkpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.processes import HOST, BrokerProcess
from stratamq.broker.ds import EndOfStream, Message, Snapshot, Stream
from tests.support.clients import ADMIN_TOKEN, TIMEOUT, PahoClient


@dataclass(frozen=True, slots=True)
class Published:
    client_id: str
    topic: str
    payload: bytes
    qos: int


def admin_post(broker: BrokerProcess, path: str, body: Any) -> tuple[int, Any]:
    """POST JSON to an admin API route; (status, answer) also for errors."""
    request = urllib.request.Request(
        f"http://{HOST}:{broker.admin_port}{path}", data=json.dumps(body).encode(),
        method="POST", headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def publish_all(broker: BrokerProcess, messages: list[Published]) -> None:
    """Publish every message with its client (one connection per client id, QoS 1/2
    acknowledged before this returns), in list order per client."""
    by_client: dict[str, list[Published]] = defaultdict(list)
    for message in messages:
        by_client[message.client_id].append(message)
    for client_id, batch in by_client.items():
        client = PahoClient(broker.port, client_id)
        client.connect()
        try:
            infos = [client.client.publish(m.topic, m.payload, m.qos) for m in batch]
            for info in infos:
                info.wait_for_publish(TIMEOUT * 4)
                assert info.is_published()
        finally:
            client.stop()


def make_checkpoint(broker: BrokerProcess, folder: Path, db: str = "messages") -> dict[str, Any]:
    """A checkpoint of `db` in `folder` (new); returns its manifest."""
    status, answer = admin_post(broker, f"/api/v1/ds/storages/{db}/checkpoints",
                                {"dir": str(folder)})
    assert status == 201, answer
    manifest: dict[str, Any] = answer["manifest"]
    return manifest


def snapshot_messages(snapshot: Snapshot, topic_filter: str = "#",
                      generations: dict[int, list[int]] | None = None,
                      batch_size: int = 100) -> Iterator[tuple[int, int, Stream, Message]]:
    """(shard, generation, stream, message) of every message the filter reads, shard
    by shard, generation by generation (all, or those picked per shard), stream by
    stream, through the snapshot's own iterators."""
    picked = generations if generations is not None else {
        shard_id: list(snapshot.shard(shard_id).generations)
        for shard_id in snapshot.shard_ids}
    for shard_id, generation_ids in picked.items():
        shard = snapshot.shard(shard_id)
        for generation_id in generation_ids:
            for stream in shard.get_streams(generation_id, topic_filter):
                iterator = shard.make_iterator(stream, topic_filter)
                while not isinstance(result := shard.next(iterator, batch_size),
                                     EndOfStream):
                    iterator, batch = result
                    for _key, message in batch:
                        yield shard_id, generation_id, stream, message
