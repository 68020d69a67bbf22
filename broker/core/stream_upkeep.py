"""The upkeep of the streams of the sessions in memory: the periodic look for new
streams, and what retention and the commit feed tell them (a generation dropped,
a feed gap)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from ..session.session import Session


class StreamUpkeep:
    """`sessions`: the registry's table of the sessions in memory, by client id;
    `stream_version`: the messages database's (`Database.stream_version`)."""

    def __init__(self, sessions: Mapping[str, Session], renew_interval: float,
                 stream_version: Callable[[], int]) -> None:
        self._sessions = sessions
        self._renew_interval = renew_interval
        self._stream_version = stream_version

    async def renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self._renew_interval)
            # Cheap per session: it looks only at streams learned since its last look
            # (and wakes its replay if a cursor reads storage, see Streams.renew_new).
            version = self._stream_version()
            for session in list(self._sessions.values()):
                if session.durable and session.outlet is not None:
                    session.streams.renew_new(version)

    async def before_generation_drop(self, shard: int, generation: int) -> None:
        """Retention is about to drop a generation of the messages: each session in
        memory counts what it loses with it."""
        for session in list(self._sessions.values()):
            await session.streams.before_generation_drop(shard, generation)

    def on_feed_gap(self, shard: int, since: int) -> None:
        """The commit feed of a shard may have missed messages here (see
        `Database.add_feed_gap_listener`)."""
        for session in list(self._sessions.values()):
            session.replay.on_feed_gap(shard, since)

    def after_generation_drop(self, shard: int, generation: int) -> None:
        for session in list(self._sessions.values()):
            session.streams.after_generation_drop(shard, generation)
