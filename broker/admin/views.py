"""The JSON documents the admin API answers with, built from the running parts of
a site. Plain functions of their inputs: nothing here does I/O; storage is seen
through `Database.describe`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ..channel.channel import Channel as Connection
from ..core.dispatch import Dispatcher
from ..ds import DbDescription
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
        "in_flight": session.outbox.in_flight_count if session else 0,
        "queued": session.outbox.queued_count if session else 0,
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


def shared_group_views(dispatcher: Dispatcher, saved: dict[str, list[str]]) -> list[Json]:
    """This site's shared groups: with members here, or absent (every member away,
    see `AbsentGroup`); `saved_away`: the members away its stored record names (None:
    no record)."""
    live = {group.key: group for group in dispatcher.groups}
    absent = dispatcher.absent
    views = []
    for key in sorted(live.keys() | absent.keys()):
        name, _, topic_filter = key.partition("/")
        group = live.get(key)
        views.append({
            "share_group": name,
            "topic_filter": topic_filter,
            "members": [] if group is None
            else sorted(session.client_id for session, _s in group.members),
            "away": sorted(group.away if group is not None else absent[key].away),
            "absent": group is None,
            "saved_away": saved.get(key),
        })
    return views


def storage_summary(database: DbDescription) -> Json:
    return {
        "name": database.name,
        "n_shards": database.n_shards,
        "layout": database.layout,
    }


def storage_view(database: DbDescription) -> Json:
    """A database with every shard, its replicas, leader, committed position and
    generations, as storage describes it."""
    shards = [{
        "id": shard.id,
        "replicas": list(shard.replicas),
        "leader": shard.leader,
        "committed_timestamp": shard.committed_timestamp,
        "disk_bytes": shard.disk_bytes,
        "generations": [{
            "id": generation.id,
            "layout": generation.layout,
            "layout_options": generation.layout_options,
            "created_at": generation.created_at,
            "since": generation.since,
            "until": generation.until,
            "current": generation.current,
            "bytes": generation.bytes,
        } for generation in shard.generations],
    } for shard in database.shards]
    return {
        **storage_summary(database),
        "layout_options": database.layout_options,
        "wildcard_thresholds": list(database.wildcard_thresholds),
        "sync_writes": database.sync_writes,
        "message_retention_period": database.message_retention_period,
        "timestamps": "microseconds since the epoch",
        "disk_bytes": database.disk_bytes,
        "shards": shards,
    }


def site_view(site_id: str, databases: list[DbDescription]) -> Json:
    """This site and the shards it holds, with its role in each."""
    return {
        "site": site_id,
        "up": True,
        "this_site": True,
        "shards": [{"storage": database.name, "id": shard.id, "leader": shard.leader,
                    "role": "leader" if shard.leader == site_id else "follower"}
                   for database in databases for shard in database.shards
                   if site_id in shard.replicas],
    }
