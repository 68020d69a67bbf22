"""A site: one broker process's storage identity and the parts it runs. Assembles
the configuration into running components (the imperative shell)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .admin import AdminServer, start_admin
from .auth import AccessControl
from .channel.channel import Channel, ChannelLimits
from .config import Config, MessagesDbConfig
from .core.broker import RETAINED_DB, SESSIONS_DB, Broker
from .core.registry import SessionLimits
from .deadlines import Deadlines
from .ds import (
    BackendOf,
    DbOptions,
    DurableStorage,
    LocalBackend,
    ReplicaSettings,
    SiteReplication,
    kv_options,
)
from .errors import ConfigError
from .net.listeners import (
    ListenerSet,
    start_stream_listener,
    start_websocket_listener,
    tls_context,
)
from .net.transport import Transport

log = logging.getLogger(__name__)

MESSAGES_DB = "messages"


def messages_db_options(messages: MessagesDbConfig, retention_period: float,
                        longest_retention_period: float | None = None) -> DbOptions:
    buffer = messages.local_write_buffer
    return DbOptions(
        n_shards=messages.n_shards,
        layout=messages.layout.type,
        layout_options=messages.layout.layout_options(),
        wildcard_thresholds=tuple(messages.layout.wildcard_thresholds),
        max_items=buffer.max_items,
        flush_interval=buffer.flush_interval,
        max_bytes=buffer.max_bytes,
        sync_writes=messages.sync_writes,
        max_payload_bytes=messages.max_payload_bytes,
        message_retention_period=retention_period,
        longest_retention_period=longest_retention_period,
        generation_period=messages.generation_period,
        topic_cache_bytes=messages.topic_cache_bytes,
        learned_topic_max_levels=messages.learned_topic_max_levels,
        learned_topic_bytes=messages.learned_topic_bytes,
    )


def retention_check_interval(retention_period: float) -> float:
    """Check often enough that a generation outlives its period by at most a tenth of
    it, but not more than once a second nor less than once a minute."""
    return min(60.0, max(1.0, retention_period / 10))


def configured_messages_options(config: Config) -> DbOptions:
    messages = config.durable_storage.messages
    rules = config.durable_sessions.retention_rules
    return messages_db_options(messages, config.durable_sessions.message_retention_period,
                               max(rules.values()) if rules else None)


async def open_storage(config: Config, storage: DurableStorage,
                       replication: SiteReplication | None = None) -> None:
    """Open `messages` with its backend and start retention; on a replicated site
    also `sessions` and `retained`, each with the backend `replication` built over
    this site's copy of it."""
    messages = config.durable_storage.messages
    retention = config.durable_sessions.message_retention_period
    backend: BackendOf = LocalBackend if replication is None else replication.backend
    await storage.open_db(MESSAGES_DB, configured_messages_options(config), backend)
    if replication is not None:
        for name in (SESSIONS_DB, RETAINED_DB):
            await storage.open_kv_db(name, messages.n_shards, messages.sync_writes, backend)
    storage.start_retention(retention_check_interval(
        min(retention, messages.generation_period or retention)))
    log.info("storage open in %s: %s with %d shards", messages.data_dir, MESSAGES_DB,
             messages.n_shards)


@dataclass
class RunningSite:
    storage: DurableStorage
    broker: Broker
    listeners: ListenerSet
    admin: AdminServer | None = None
    # when cluster.enable; closed with the storage (after the write buffers flush)
    replication: SiteReplication | None = None
    handover_timeout: float = 0.0
    # its password hashing threads stop with the listeners
    access: AccessControl | None = None

    async def stop(self, hand_over: bool = False) -> None:
        """With `hand_over`, in a cluster: have the shards this site leads handed
        over to other replicas (at most `handover_timeout`; reported not ready
        meanwhile). Then stop accepting, close connections (persisting their
        sessions), flush the write buffers and close RocksDB; the admin API (not
        ready) goes last."""
        if hand_over and self.replication is not None and self.handover_timeout > 0:
            if self.admin is not None:
                self.admin.stopping()
            await self.replication.hand_over(self.handover_timeout)
        log.info("stopping: closing connections, persisting sessions, flushing storage")
        if self.admin is not None:
            self.admin.detach()
        await self.listeners.close()
        if self.access is not None:
            self.access.close()
        await self.broker.stop()
        await self.storage.close()
        if self.admin is not None:
            await self.admin.stop()


def connection_limits(config: Config) -> ChannelLimits:
    mqtt = config.mqtt
    return ChannelLimits(
        max_packet_size=mqtt.max_packet_size, max_topic_levels=mqtt.max_topic_levels,
        max_subscriptions=mqtt.max_subscriptions,
        max_inflight=mqtt.max_inflight, receive_maximum=mqtt.receive_maximum,
        topic_alias_maximum=mqtt.topic_alias_maximum, connect_timeout=mqtt.connect_timeout,
        max_connect_packet_size=mqtt.max_connect_packet_size,
        max_keepalive=mqtt.max_keepalive)


async def start_site(config: Config) -> RunningSite:
    # The admin API first: /healthz answers (and /readyz says not ready) while the
    # storage opens.
    admin = None
    if config.admin.enable:
        admin = await start_admin(config.admin, Path(config.durable_storage.messages.data_dir))
    try:
        site = await _start_parts(config)
    except BaseException:
        if admin is not None:
            await admin.stop()
        raise
    if admin is not None:
        site.admin = admin
        admin.attach(site.storage, site.broker, site.listeners, site.replication)
    return site


async def open_replication(config: Config, storage: DurableStorage) -> SiteReplication:
    """This site's copies of `messages`, `sessions` and `retained`, and over them a
    shard log per shard: the databases' backends (`SiteReplication.backend`), through
    which their writes are committed by a majority of each shard's replicas. The peer
    port listens once the broker's relay is added (`SiteReplication.listen`)."""
    cluster = config.cluster
    # the key-value databases have the shards of `messages`: a client's session and
    # its messages share a shard number
    n_shards = config.durable_storage.messages.n_shards
    sync_writes = config.durable_storage.messages.sync_writes
    shard_sets = [await storage.open_shards(MESSAGES_DB, configured_messages_options(config),
                                            replicated=True)]
    shard_sets += [await storage.open_shards(name, kv_options(name, n_shards, sync_writes),
                                             replicated=True)
                   for name in (SESSIONS_DB, RETAINED_DB)]
    settings = ReplicaSettings(storage.site_id, cluster.write_timeout,
                               config.durable_sessions.heartbeat_interval,
                               cluster.log_retain_entries, cluster.checkpoint_rate,
                               cluster.zone)
    return await SiteReplication.open(shard_sets, storage.data_dir, storage.site_id,
                                       cluster.peer_bind, cluster.advertised_peer(), settings)


async def _start_parts(config: Config) -> RunningSite:
    # This site's copies of the databases, then their backends (on a replicated site
    # the replication, built over the copies), then the databases over both.
    storage = DurableStorage(Path(config.durable_storage.messages.data_dir))
    replication = None
    try:
        if config.cluster.enable:
            replication = await open_replication(config, storage)
        await open_storage(config, storage, replication)
    except BaseException:
        await storage.close()
        raise
    messages = storage.db(MESSAGES_DB)
    sessions = config.durable_sessions
    broker = await Broker.assemble(
        storage, messages, config.durable_storage.messages.n_shards,
        config.durable_storage.messages.sync_writes,
        SessionLimits(max_queued=config.mqtt.max_queued_messages, batch_size=sessions.batch_size,
                     idle_poll_interval=sessions.idle_poll_interval,
                     renew_streams_interval=sessions.renew_streams_interval,
                     session_gc_interval=sessions.session_gc_interval,
                     durable_sessions=sessions.enable),
        replication, config.cluster.write_timeout)
    if replication is not None:
        if broker.relay is not None:
            replication.add_service(broker.relay)
        try:
            await replication.listen()
        except BaseException:
            await storage.close()
            raise
    await broker.start()
    access = AccessControl.from_config(config.access_control)
    limits = connection_limits(config)
    connections: set[Channel] = set()
    deadlines = Deadlines()

    def make(transport: Transport, listener: str, peer: str) -> Channel:
        return Channel(broker, access, transport, limits, listener, peer, deadlines)

    listeners = config.listeners
    max_connections = config.mqtt.max_connections
    servers = []
    runners = []
    ports: dict[str, int] = {}
    try:
        if listeners.tcp.enable:
            server = await start_stream_listener("tcp", listeners.tcp.bind, make, connections,
                                                 max_connections, backlog=listeners.backlog)
            servers.append(server)
            ports["tcp"] = server.sockets[0].getsockname()[1]
        if listeners.tls.enable:
            if not listeners.tls.certfile or not listeners.tls.keyfile:
                raise ConfigError("listeners.tls: certfile and keyfile are required when "
                                  "enable is true")
            context = tls_context(listeners.tls.certfile, listeners.tls.keyfile,
                                  listeners.tls.cafile, listeners.tls.verify_peer)
            server = await start_stream_listener("tls", listeners.tls.bind, make, connections,
                                                 max_connections, context,
                                                 backlog=listeners.backlog)
            servers.append(server)
            ports["tls"] = server.sockets[0].getsockname()[1]
        if listeners.ws.enable:
            runners.append(await start_websocket_listener(
                listeners.ws.bind, listeners.ws.path, make, connections, max_connections,
                limits.max_packet_size, backlog=listeners.backlog))
    except BaseException:
        for server in servers:
            server.close()
        await broker.stop()
        await storage.close()
        raise
    return RunningSite(storage, broker, ListenerSet(servers, runners, connections, ports),
                       replication=replication,
                       handover_timeout=config.cluster.handover_timeout, access=access)
