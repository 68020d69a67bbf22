"""The JSON documents the admin API answers with, built from the running parts of
a site. Plain functions of their inputs: nothing here does I/O except reading
shard directory sizes."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from ..channel.channel import Channel as Connection
from ..ds import Database
from ..session.model import Subscription
from ..session.session import Session

Json = dict[str, Any]

_MQTT_VERSIONS = {3: "3.1", 4: "3.1.1", 5: "5.0"}


def rfc3339(seconds: float) -> str:
    """Wall-clock seconds as `2024-05-01T12:00:00.123Z`."""
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def client_view(connection: Connection) -> Json:
    session = connection.session
    return {
        "client_id": connection.client_id,
        "username": connection.username,
        "peer": connection.peer,
        "listener": connection.listener,
        "protocol_level": connection.level,
        "protocol_version": _MQTT_VERSIONS.get(connection.level, str(connection.level)),
        "keepalive": connection.keepalive,
        "connected_at": rfc3339(connection.connected_at),
        "durable": session.durable if session else False,
        "expiry_interval": session.expiry_interval if session else 0,
        "subscriptions": len(session.subscriptions) if session else 0,
        "in_flight": session.in_flight_count if session else 0,
        "queued": session.queued_count if session else 0,
    }


def subscription_view(session: Session, subscription: Subscription) -> Json:
    return {
        "client_id": session.client_id,
        "topic_filter": subscription.key,  # as the client wrote it, `$share/...` included
        "qos": subscription.qos,
        "share_group": subscription.share_group,
        "no_local": subscription.no_local,
        "rap": subscription.retain_as_published,
        "rh": subscription.retain_handling,
        "identifier": subscription.identifier,
        "connected": session.outlet is not None,
    }


def storage_summary(database: Database) -> Json:
    return {
        "name": database.name,
        "n_shards": database.options.n_shards,
        "layout": database.options.layout,
    }


def storage_view(database: Database, site_id: str) -> Json:
    """A database with every shard, its replicas and its generations. Reads the size
    of each shard's files (a directory listing per shard)."""
    options = database.options
    shards = []
    for shard in list(database.shards):
        generations = [{
            "id": info.id,
            "layout": info.layout,
            "layout_options": info.layout_options,
            "created_at": info.created_at,
            "since": info.since,
            "until": info.until,
            "current": info.is_current,
        } for info in (generation.info for _, generation in sorted(shard.generations.items()))]
        shards.append({
            "id": shard.shard_id,
            "replicas": [site_id],
            "leader": site_id,
            "disk_bytes": shard_disk_bytes(shard.disk_usage),
            "generations": generations,
        })
    return {
        **storage_summary(database),
        "layout_options": options.layout_options,
        "wildcard_thresholds": list(options.wildcard_thresholds),
        "sync_writes": options.sync_writes,
        "message_retention_period": options.message_retention_period,
        "timestamps": "microseconds since the epoch",
        "disk_bytes": sum(shard["disk_bytes"] for shard in shards),
        "shards": shards,
    }


def shard_disk_bytes(disk_usage: Callable[[], int], attempts: int = 3) -> int:
    """`Shard.disk_usage()`, retried when RocksDB removes a file between listing the
    directory and reading its size (compaction, a dropped generation)."""
    for _ in range(attempts - 1):
        try:
            return disk_usage()
        except FileNotFoundError:
            continue
    return disk_usage()


def site_view(site_id: str, databases: list[Database]) -> Json:
    """This site and the shards it holds. With one site it leads every shard."""
    return {
        "site": site_id,
        "up": True,
        "this_site": True,
        "shards": [{"storage": database.name, "id": shard.shard_id, "leader": site_id,
                    "role": "leader"}
                   for database in databases for shard in database.shards],
    }
