"""The commit feed of one database on this site: every committed batch, in commit
order per shard, to the listeners that feed this site's readers (the broker's
dispatch), each message once whichever way it came (applied here, or pushed by a
shard's leader); and the feed gaps, when messages may have been missed."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .cooked import CookedBatch
from .message import Message
from .streams import StreamIndex

log = logging.getLogger(__name__)

CommitListener = Callable[[CookedBatch], None]
FeedGapListener = Callable[[int, int], None]


class CommitFeed:
    def __init__(self, db_name: str, n_shards: int, streams: StreamIndex) -> None:
        self._db_name = db_name
        self._streams = streams
        self._commit_listeners: list[CommitListener] = []
        self._applied_listeners: set[CommitListener] = set()
        # The last timestamp fed per shard: a message reaches the commit listeners
        # once, whether it came from this site's apply or a leader's push (timestamps
        # are strictly increasing per shard).
        self._last_fed = [0] * n_shards
        self._gap_listeners: list[FeedGapListener] = []

    def add_commit_listener(self, listener: CommitListener, *, of_applied: bool = False
                            ) -> None:
        """Call `listener` on the event loop with every committed batch, after it is
        durable and visible to readers, in commit order per shard. A listener that
        feeds this site's readers gets no batch this site applies to a shard it reads
        elsewhere (a replica still catching up): what was pushed to the site and what
        it applies need not meet, so its readers get that shard from storage once the
        replica has caught up (a feed gap). `of_applied` listeners (the commit feed's
        pushes, as the shard's leader) get every applied batch."""
        self._commit_listeners.append(listener)
        if of_applied:
            self._applied_listeners.add(listener)

    def committed(self, cooked: CookedBatch, read_elsewhere: bool = False) -> None:
        """A batch committed to this site's copy of its shard; `read_elsewhere`: one
        applied to a shard this site reads at another site (see
        `add_commit_listener`)."""
        if cooked.edges:
            self._streams.note(cooked.shard, cooked.generation, cooked.edges)
        if read_elsewhere:
            for listener in self._commit_listeners:
                if listener in self._applied_listeners:
                    listener(cooked)
            return
        last = self._last_fed[cooked.shard]
        if cooked.messages and cooked.messages[0][1].timestamp <= last:
            cooked.messages = [(static, message) for static, message in cooked.messages
                               if message.timestamp > last]
        if cooked.messages:
            self._last_fed[cooked.shard] = cooked.messages[-1][1].timestamp
        for listener in self._commit_listeners:
            listener(cooked)

    def pushed(self, shard_id: int, generation_id: int,
               messages: list[tuple[bytes, Message]]) -> None:
        """Committed messages of a shard this site reads elsewhere, pushed by its
        leader: fed like a batch committed here."""
        if messages:
            self.committed(CookedBatch(shard_id, generation_id, messages[-1][1].timestamp,
                                       len(messages), messages=messages))

    def add_feed_gap_listener(self, listener: FeedGapListener) -> None:
        """Call `listener(shard, since)` when this site may have missed committed
        messages of a shard in its commit feed (a leader dropped a push, a leader
        changed): readers of that shard go back to storage, from their positions or
        from `since`, the first timestamp after everything fed here."""
        self._gap_listeners.append(listener)

    def feed_gap(self, shard_id: int) -> None:
        since = self._last_fed[shard_id] + 1
        for listener in self._gap_listeners:
            try:
                listener(shard_id, since)
            except Exception:  # a listener's bug must not stop the feed
                log.exception("feed gap listener failed on %s/%d", self._db_name, shard_id)

    def fed_through(self) -> list[int]:
        """Per shard, the last timestamp fed to the commit listeners here."""
        return list(self._last_fed)
