"""What a session reads of the durable storage: its streams, their messages, and the
generations that exist. `DurableStorage` is one; the session's tests use an in-memory
one. Nothing here writes: a session's own record goes through `SessionStore`."""

from __future__ import annotations

from typing import Protocol

from ..ds import EndOfStream, GenerationInfo, Iterator, Message, NextResult, Rank, Stream


class StreamCatalog(Protocol):
    """A database's streams as a site learns them, incrementally."""

    @property
    def stream_version(self) -> int:
        """Grows whenever the site learns a stream."""
        ...

    def get_streams_since(self, topic_filter: str,
                          version: int) -> tuple[int, list[tuple[Rank, Stream]]]:
        """The streams learned after `version` the filter reads, and the version to
        ask with next time."""
        ...


class MessageReader(Protocol):
    def db(self, name: str) -> StreamCatalog: ...

    def get_streams(self, db: str, topic_filter: str,
                    start_time: int = 0) -> list[tuple[Rank, Stream]]: ...

    def make_iterator(self, db: str, stream: Stream, topic_filter: str,
                      start_time: int = 0) -> Iterator: ...

    async def next(self, db: str, iterator: Iterator,
                   batch_size: int) -> NextResult | EndOfStream: ...

    async def read_message(self, db: str, stream: Stream, timestamp: int) -> Message | None:
        """The message of a stream at a timestamp; None when it is not there."""
        ...

    def list_generations(self, db: str) -> dict[tuple[int, int], GenerationInfo]: ...

    def generations_known(self, db: str, shard: int) -> bool:
        """Whether `list_generations` tells the generations of a shard."""
        ...
