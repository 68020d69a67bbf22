"""Retained messages: the `retained` database, one record per topic."""

from __future__ import annotations

import asyncio
import time

from ..ds import KvDatabase, Message, decode_message, encode_message
from ..session.expiry import is_expired
from ..topic import topic_matches


class RetainedStore:
    def __init__(self, db: KvDatabase) -> None:
        self._db = db
        self._lock = asyncio.Lock()

    async def store(self, message: Message) -> None:
        """Keep the message as its topic's retained one; an empty payload deletes it."""
        async with self._lock:  # keeps retained updates in publish order
            key = message.topic.encode("utf-8")
            if message.payload:
                await self._db.write(message.topic, puts=[(key, encode_message(message))])
            else:
                await self._db.write(message.topic, deletes=[key])

    async def matching(self, topic_filter: str) -> list[Message]:
        found = []
        now_us = time.time_ns() // 1000
        for _key, raw in await self._db.scan():
            message = decode_message(raw)
            if is_expired(message, now_us):
                continue
            if topic_matches(topic_filter, message.topic):
                found.append(message)
        return found
