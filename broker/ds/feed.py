"""The commit feed of one database on this site: every committed batch, in commit
order per shard, to the listeners that feed this site's readers (the broker's
dispatch), each message once whichever way it came (applied here, or pushed by a
shard's leader); and the feed gaps, when messages may have been missed."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .cooked import CookedBatch
from .lts import StaticIndex
from .message import Message
from .streams import StreamIndex

log = logging.getLogger(__name__)

CommitListener = Callable[[CookedBatch], None]
FeedGapListener = Callable[[int, int], None]
# Whether a listener would use a shard's messages now (takes the shard)
Interest = Callable[[int], bool]
# The messages of a batch this site applied but did not cook (a follower's)
Decode = Callable[[CookedBatch], list[tuple[StaticIndex, Message]]]


class CommitFeed:
    """`decode` reads the messages of a batch cooked elsewhere, which carries only
    their keys and values: done when a listener wants them, not for every batch a
    replica applies (a site with no subscriber would decode every message of every
    shard it holds a replica of, for nobody)."""

    def __init__(self, db_name: str, n_shards: int, streams: StreamIndex,
                 decode: Decode) -> None:
        self._db_name = db_name
        self._streams = streams
        self._decode = decode
        self._commit_listeners: list[CommitListener] = []
        self._applied_listeners: set[CommitListener] = set()
        self._interests: dict[CommitListener, Interest] = {}
        # The last timestamp fed per shard: a message reaches the commit listeners
        # once, whether it came from this site's apply or a leader's push (timestamps
        # are strictly increasing per shard).
        self._last_fed = [0] * n_shards
        self._gap_listeners: list[FeedGapListener] = []

    def add_commit_listener(self, listener: CommitListener, *, of_applied: bool = False,
                            wants: Interest | None = None) -> None:
        """Call `listener` on the event loop with every committed batch, after it is
        durable and visible to readers, in commit order per shard. A listener that
        feeds this site's readers gets no batch this site applies to a shard it reads
        elsewhere (a replica still catching up): what was pushed to the site and what
        it applies need not meet, so its readers get that shard from storage once the
        replica has caught up (a feed gap). `of_applied` listeners (the commit feed's
        pushes, as the shard's leader) get every applied batch. `wants(shard)`:
        whether the listener would do anything with the shard's messages now (without
        it: always); a batch cooked elsewhere whose messages no listener wants is
        neither decoded nor fed, and counts as fed (`fed_through`)."""
        self._commit_listeners.append(listener)
        if wants is not None:
            self._interests[listener] = wants
        if of_applied:
            self._applied_listeners.add(listener)

    def committed(self, cooked: CookedBatch, read_elsewhere: bool = False) -> None:
        """A batch committed to this site's copy of its shard; `read_elsewhere`: one
        applied to a shard this site reads at another site (see
        `add_commit_listener`)."""
        if cooked.edges:
            self._streams.note(cooked.shard, cooked.generation, cooked.edges)
        listeners = [listener for listener in self._commit_listeners
                     if not read_elsewhere or listener in self._applied_listeners]
        if not cooked.messages and cooked.message_count:
            if not any(self._wants(listener, cooked.shard) for listener in listeners):
                if not read_elsewhere:  # passed over as if fed: its last message's time
                    self._last_fed[cooked.shard] = max(self._last_fed[cooked.shard],
                                                       cooked.last_timestamp)
                return
            try:
                cooked.messages = self._decode(cooked)
            except Exception:  # applied, but unfed: the readers read it from storage
                log.exception("decoding a batch of %s/%d for the commit feed failed",
                              self._db_name, cooked.shard)
                self.feed_gap(cooked.shard)
                return
        if read_elsewhere:
            for listener in listeners:
                listener(cooked)
            return
        last = self._last_fed[cooked.shard]
        if cooked.messages and cooked.messages[0][1].timestamp <= last:
            cooked.messages = [(static, message) for static, message in cooked.messages
                               if message.timestamp > last]
        if cooked.messages:
            self._last_fed[cooked.shard] = cooked.messages[-1][1].timestamp
        for listener in listeners:
            listener(cooked)

    def _wants(self, listener: CommitListener, shard: int) -> bool:
        interest = self._interests.get(listener)
        return interest is None or interest(shard)

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
