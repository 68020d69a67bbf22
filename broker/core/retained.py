"""Retained messages: the `retained` database, one record per topic (its key), and an
in-memory index of the topics that have one, so a SUBSCRIBE reads only the retained
messages its filter matches.

On a replicated site (a cluster) other sites set and delete retained messages too, and
no index here would see them: a filter with wildcards scans the database (every
shard, wherever its replicas are, a page at a time), a topic name reads its one key.
A message carries the wall clock of the site that set it: one set on a site whose
clock runs ahead carries a later time than this site's SUBSCRIBE though it came
first, so a SUBSCRIBE takes those up to `clock_lead` seconds past its time (the
furthest a peer's clock is known to run ahead): a message set just after it may then
come twice (live and retained), none is left out."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Callable

from ..ds import KvDatabase, Message, decode_message, encode_message
from ..session.expiry import is_expired
from ..topic import levels_match, validate_filter
from .topic_index import TopicIndex

# Retained messages read and decoded per page of a lookup: a filter matching a great
# many yields to the event loop between pages instead of holding it, and its reader
# holds one page at a time.
_READ_BATCH = 500


def _no_lead() -> float:
    return 0.0


class RetainedStore:
    def __init__(self, db: KvDatabase, clock_lead: Callable[[], float] = _no_lead) -> None:
        self._db = db
        self._clock_lead = clock_lead
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

    async def pages(self, topic_filter: str, before_us: int
                    ) -> AsyncGenerator[list[Message], None]:
        """The retained messages the filter matches, a page of at most `_READ_BATCH`
        at a time, so a caller holds one page and not the whole set. Left out: the
        expired ones, and those set at or after `before_us` (microseconds, the time
        of the SUBSCRIBE, plus `clock_lead`): the subscription had them live
        already. The set may change while it is read: each topic is read as it is
        when its page is."""
        levels = validate_filter(topic_filter)
        before_us += int(self._clock_lead() * 1_000_000)
        if self._indexed:
            topics = self._index.matching(levels)
            while batch := list(itertools.islice(topics, _READ_BATCH)):
                values = await self._db.get_many([(topic, topic.encode("utf-8"))
                                                  for topic in batch])
                # None: deleted since the index was read
                yield _current([decode_message(raw) for raw in values if raw is not None],
                               before_us)
        elif "+" not in levels and "#" not in levels:
            raw = await self._db.get(topic_filter, topic_filter.encode("utf-8"))
            yield [] if raw is None else _current([decode_message(raw)], before_us)
        else:
            async for page in self._db.scan_pages():
                yield _current([decode_message(raw) for key, raw in page
                                if levels_match(levels, key.decode("utf-8").split("/"))],
                               before_us)


def _current(messages: list[Message], before_us: int) -> list[Message]:
    now_us = time.time_ns() // 1000
    return [message for message in messages
            if message.timestamp < before_us and not is_expired(message, now_us)]
