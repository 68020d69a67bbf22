"""A site: one broker process's storage identity and the parts it runs. Assembles
the configuration into running components (the imperative shell)."""

from __future__ import annotations

import logging
from pathlib import Path

from .config import Config, MessagesDbConfig
from .ds import DbOptions, DurableStorage

log = logging.getLogger(__name__)

MESSAGES_DB = "messages"


def messages_db_options(messages: MessagesDbConfig, retention_period: float) -> DbOptions:
    buffer = messages.local_write_buffer
    return DbOptions(
        n_shards=messages.n_shards,
        layout=messages.layout.type,
        wildcard_thresholds=tuple(messages.layout.wildcard_thresholds),
        max_items=buffer.max_items,
        flush_interval=buffer.flush_interval,
        max_bytes=buffer.max_bytes,
        sync_writes=messages.sync_writes,
        max_payload_bytes=messages.max_payload_bytes,
        message_retention_period=retention_period,
    )


def retention_check_interval(retention_period: float) -> float:
    """Check often enough that a generation outlives its period by at most a tenth of
    it, but not more than once a second nor less than once a minute."""
    return min(60.0, max(1.0, retention_period / 10))


async def open_storage(config: Config) -> DurableStorage:
    messages = config.durable_storage.messages
    retention = config.durable_sessions.message_retention_period
    storage = DurableStorage(Path(messages.data_dir))
    await storage.open_db(MESSAGES_DB, messages_db_options(messages, retention))
    storage.start_retention(retention_check_interval(retention))
    log.info("storage open in %s: %s with %d shards", messages.data_dir, MESSAGES_DB,
             messages.n_shards)
    return storage
