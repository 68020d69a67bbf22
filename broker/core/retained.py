"""Retained messages: the `retained` database, one record per topic (its key), and an
in-memory index of the topics that have one, so a SUBSCRIBE reads only the retained
messages its filter matches.

On a replicated site (a cluster) other sites set and delete retained messages too, and
no index here would see them: a filter with wildcards scans the database (every
shard, wherever its replicas are, a page at a time), a topic name reads its one key."""

from __future__ import annotations

import asyncio
import time

from ..ds import KvDatabase, Message, decode_message, encode_message
from ..session.expiry import is_expired
from ..topic import levels_match, validate_filter
from .topic_index import TopicIndex

# Retained messages read and decoded per step of a lookup: a filter matching a great
# many yields to the event loop between steps instead of holding it.
_READ_BATCH = 500


class RetainedStore:
    def __init__(self, db: KvDatabase) -> None:
        self._db = db
        self._lock = asyncio.Lock()
        self._index = TopicIndex()
        self._indexed = not db.database.replicated

    async def load(self) -> None:
        """Index the topics stored (at start, before any SUBSCRIBE), a page at a time."""
        if not self._indexed:
            return
        async for page in self._db.scan_pages():
            for key, _value in page:
                self._index.add(key.decode("utf-8"))

    async def store(self, message: Message) -> None:
        """Keep the message as its topic's retained one; an empty payload deletes it."""
        async with self._lock:  # keeps retained updates in publish order
            key = message.topic.encode("utf-8")
            if message.payload:
                await self._db.write(message.topic, puts=[(key, encode_message(message))])
                self._index.add(message.topic)
            else:
                await self._db.write(message.topic, deletes=[key])
                self._index.remove(message.topic)

    async def matching(self, topic_filter: str) -> list[Message]:
        if not self._indexed:
            return await self._read_matching(topic_filter)
        topics = list(self._index.matching(validate_filter(topic_filter)))
        found = []
        now_us = time.time_ns() // 1000
        for first in range(0, len(topics), _READ_BATCH):
            batch = topics[first:first + _READ_BATCH]
            values = await self._db.get_many([(topic, topic.encode("utf-8"))
                                              for topic in batch])
            for raw in values:
                if raw is None:  # deleted since the index was read
                    continue
                message = decode_message(raw)
                if not is_expired(message, now_us):
                    found.append(message)
        return found

    async def _read_matching(self, topic_filter: str) -> list[Message]:
        levels = validate_filter(topic_filter)
        now_us = time.time_ns() // 1000
        if "+" not in levels and "#" not in levels:
            raw = await self._db.get(topic_filter, topic_filter.encode("utf-8"))
            message = None if raw is None else decode_message(raw)
            return [] if message is None or is_expired(message, now_us) else [message]
        found = []
        async for page in self._db.scan_pages():
            for key, raw in page:
                if levels_match(levels, key.decode("utf-8").split("/")):
                    message = decode_message(raw)
                    if not is_expired(message, now_us):
                        found.append(message)
        return found
