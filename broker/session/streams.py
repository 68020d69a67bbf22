"""A session's streams: the cursors it reads them with, the progress of those it is
not reading now (offline, or restored), the ones it has read to the end of a closed
generation, and what retention's dropping a generation takes from it.

A durable subscription reads every stream of its filter that storage has; new
streams come with new generations and new topics, found by `renew` (all of them, at
a connect and a SUBSCRIBE) and `renew_new` (only those storage learned since the
last look, periodically)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from ..ds import EndOfStream, Stream
from ..errors import InvalidIteratorError
from ..metrics import SESSION_MESSAGES_EXPIRED
from .cursors import Cursor, CursorTable
from .model import CursorState, Subscription, cursor_key, parse_cursor_key
from .outbox import Outbox
from .reader import MessageReader

log = logging.getLogger(__name__)

# Messages one read takes when counting what a dropped generation takes with it.
_COUNT_BATCH = 1000


class Streams:
    """`wake` is called whenever there may be something new to read (it wakes the
    replay, `Replay.wake`); `request_save` asks for the session to be written soon."""

    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_client_id", "_db", "_done", "_durable", "_going", "_outbox", "_parked",
                 "_request_save", "_storage", "_stream_version", "_subscriptions", "_wake",
                 "cursors")


    def __init__(self, client_id: str, *, storage: MessageReader, messages_db: str,
                 outbox: Outbox, subscriptions: Callable[[], Mapping[str, Subscription]],
                 durable: Callable[[], bool], request_save: Callable[[], None],
                 wake: Callable[[], None]) -> None:
        self._client_id = client_id
        self._storage = storage
        self._db = messages_db
        self._outbox = outbox
        self._subscriptions = subscriptions
        self._durable = durable
        self._request_save = request_save
        self._wake = wake
        self.cursors = CursorTable()
        # cursor progress of streams not being read right now (offline, or restored)
        self._parked: dict[str, CursorState] = {}
        # cursors complete in their closed generation (see `forget_if_complete`); this
        # and `_going` are dicts used as sets: an idle session holds them empty, and an
        # empty dict holds no table where an empty set holds 216 bytes (issue 25)
        self._done: dict[str, None] = {}
        # the storage's stream version at the last look for streams (see renew_*)
        self._stream_version = 0
        # (shard, generation)s retention is about to drop, their loss already counted:
        # nothing more of them is read or sent (see `before_generation_drop`)
        self._going: dict[tuple[int, int], None] = {}

    # -- the saved form --------------------------------------------------------------

    def states(self) -> dict[str, CursorState]:
        """The progress of every stream read, copies (the cursors move on)."""
        return {**{key: CursorState(state.position, list(state.done_above))
                   for key, state in self._parked.items()},
                **{key: CursorState(c.state.position, list(c.state.done_above))
                   for key, c in self.cursors.items()}}

    def done_keys(self) -> list[str]:
        return sorted(self._done)

    def restore(self, states: Mapping[str, CursorState], done: Iterable[str]) -> None:
        # copies: the cursors move on from them, and the record's are the stored parts
        self._parked = {key: CursorState(state.position, list(state.done_above))
                        for key, state in states.items()}
        self._done = dict.fromkeys(done)

    def park(self) -> None:
        """Stop reading: reading resumes after the last done message of each cursor."""
        for key, cursor in list(self.cursors.items()):
            self._parked[key] = cursor.state
        self.cursors.clear()

    # -- finding streams ---------------------------------------------------------------

    def renew(self, subscriptions: Iterable[Subscription] | None = None) -> None:
        """Look for streams the durable subscriptions do not read yet: those of
        `subscriptions` only (the new ones of a SUBSCRIBE), or of all."""
        if not self._durable():
            return
        if subscriptions is None:
            subscriptions = self._subscriptions().values()
            self._stream_version = self._storage.db(self._db).stream_version
        opened: list[Cursor] = []
        for subscription in subscriptions:
            if subscription.share_group is not None:
                continue
            for _rank, stream in self._storage.get_streams(self._db, subscription.topic_filter,
                                                           subscription.since):
                self.cursor_for(subscription, stream, opened)
        self.cursors.retire_older(opened)
        self._wake()

    def renew_new(self, version: int) -> None:
        """Look only at the streams the storage learned since the last look (the
        periodic look: nothing to do while no stream is new); `version`: the
        storage's stream version now (read once for every session)."""
        if not self._durable():
            return
        # A replay with a cursor off the live feed is woken on every look, new streams
        # or not, as before this look became incremental: a crash test
        # (test_broker_crash) then lost a stream's tail now and then without it, so
        # some wake-up is missed somewhere. One whose cursors are all on the live feed
        # (or ended) has nothing to read: woken every second, every idle durable
        # connection of a site cost a pass (issue 25).
        if self.cursors.any_to_read():
            self._wake()
        if version == self._stream_version:
            return
        database = self._storage.db(self._db)
        opened: list[Cursor] = []
        for subscription in self._subscriptions().values():
            if subscription.share_group is not None:
                continue
            version, found = database.get_streams_since(subscription.topic_filter,
                                                        self._stream_version)
            for _rank, stream in found:
                self.cursor_for(subscription, stream, opened)
        self.cursors.retire_older(opened)
        self._stream_version = version
        self._wake()

    def cursor_for(self, subscription: Subscription, stream: Stream,
                   opened: list[Cursor]) -> Cursor | None:
        """The subscription's cursor on the stream, opened if need be (then appended
        to `opened`: the caller hands those to `CursorTable.retire_older`); None for
        a stream done or going."""
        key = cursor_key(subscription.topic_filter, stream)
        cursor = self.cursors.get(key)
        if cursor is not None:
            return cursor
        if key in self._done or self.going(stream):
            return None  # read to its end already, or about to be dropped
        state = self._parked.get(key) or CursorState(max(subscription.since - 1, 0))
        try:
            iterator = self._storage.make_iterator(self._db, stream, subscription.topic_filter,
                                                   state.position + 1)
        except InvalidIteratorError:  # dropped since: the next attach prunes its state
            return None
        self._parked.pop(key, None)
        cursor = Cursor(key, subscription, stream, iterator, state,
                        done_early=set(state.done_above))
        self.cursors.add(cursor)
        opened.append(cursor)
        return cursor

    def going(self, stream: Stream) -> bool:
        """Whether retention is about to drop the stream's generation."""
        return (stream.shard, stream.generation) in self._going

    # -- forgetting ----------------------------------------------------------------------

    def forget_if_complete(self, cursor: Cursor) -> None:
        if cursor.ended and not cursor.in_flight and self.cursors.get(cursor.key) is cursor:
            # A closed generation's streams keep coming back from get_streams: the
            # mark stops a later look from reading this one again from the start.
            self._done[cursor.key] = None
            self.cursors.remove(cursor.key)
            self._request_save()
            self._wake()

    def forget_subscription(self, topic_filter: str) -> None:
        self.forget(lambda key: parse_cursor_key(key)[0] == topic_filter)

    def forget(self, doomed: Callable[[str], bool]) -> tuple[int, int]:
        """Drop every trace of the cursors whose key is `doomed`: the cursor, its saved
        progress, its done mark and its resends (their packet identifiers are free
        again). Returns (cursor states and marks forgotten, resends forgotten): the
        resends are messages that will not be sent again."""
        states = [k for k in self.cursors if doomed(k)]
        for key in states:
            self.cursors.remove(key)
        parked = [k for k in self._parked if doomed(k)]
        for key in parked:
            del self._parked[key]
        done = [k for k in self._done if doomed(k)]
        for key in done:
            del self._done[key]
        resends = self._outbox.resends.forget(doomed)
        return len(states) + len(parked) + len(done), resends

    # -- retention -----------------------------------------------------------------------

    async def before_generation_drop(self, shard: int, generation: int) -> None:
        """Retention is about to drop a generation: count (and log) the messages of it
        this session has not finished, none of which it can deliver afterwards. From
        now on it reads and resends nothing more of it, so what is counted is what is
        lost. Sent messages awaiting an acknowledgement are not counted: the client
        has them (should they be resent later, the resend counts its loss)."""
        self._going[shard, generation] = None
        if not self._durable():
            return
        resends: dict[str, set[int]] = {}
        for key, timestamp in self._outbox.resends.in_order():
            if _in_generation(key, shard, generation):
                resends.setdefault(key, set()).add(timestamp)
        lost = sum(len(timestamps) for timestamps in resends.values())
        for subscription in list(self._subscriptions().values()):
            if subscription.share_group is not None:
                continue
            for rank, stream in self._storage.get_streams(self._db, subscription.topic_filter,
                                                          subscription.since):
                key = cursor_key(subscription.topic_filter, stream)
                if (rank.x, rank.y) != (shard, generation) or key in self._done:
                    continue
                unread = await self._unread(subscription, stream, key)
                lost += len(unread - resends.get(key, set()))
        self.report_loss(lost, f"{shard}/{generation}")

    async def _unread(self, subscription: Subscription, stream: Stream, key: str) -> set[int]:
        """Timestamps of the messages of a stream this session has not handed out."""
        cursor = self.cursors.get(key)
        if cursor is not None:
            position, done = cursor.last_handed, set(cursor.done_early)
        else:
            state = self._parked.get(key) or CursorState(max(subscription.since - 1, 0))
            position, done = state.position, set(state.done_above)
        try:
            iterator = self._storage.make_iterator(self._db, stream, subscription.topic_filter,
                                                   position + 1)
        except InvalidIteratorError:
            return set()
        unread: set[int] = set()
        while True:
            result = await self._storage.next(self._db, iterator, _COUNT_BATCH)
            if isinstance(result, EndOfStream):
                return unread
            iterator, batch = result
            if not batch:  # not closed: cannot happen for a generation retention drops
                return unread
            unread.update(message.timestamp for _key, message in batch
                          if message.timestamp not in done and not (
                              subscription.no_local and message.client_id == self._client_id))

    def after_generation_drop(self, shard: int, generation: int) -> None:
        """A generation is gone: forget every trace of it, and look for streams
        again (newer generations may have waited on cursors into it)."""
        counted = (shard, generation) in self._going
        self._going.pop((shard, generation), None)
        states, resends = self.forget(lambda key: _in_generation(key, shard, generation))
        if not counted:  # this session came into memory after the count
            self.report_loss(resends, f"{shard}/{generation}")
        if self._outbox.outlet is not None:
            if states or resends:
                self._request_save()
            self.renew()
        self._wake()

    def prune_dropped_generations(self) -> None:
        """Forget cursors, done marks and resends into generations that no longer
        exist (dropped while this session was not in memory). The unacknowledged
        resends are counted as lost; unread messages of them cannot be counted any
        more, but the loss is logged."""
        existing = self._storage.list_generations(self._db)
        gone = {(stream.shard, stream.generation)
                for stream in (parse_cursor_key(key)[1] for key in
                               [*self._parked, *self._done,
                                *(key for key, _timestamp in self._outbox.resends.in_order())])
                if (stream.shard, stream.generation) not in existing
                and self._storage.generations_known(self._db, stream.shard)}
        if not gone:
            return
        _states, resends = self.forget(lambda key: _generation_of(key) in gone)
        names = ", ".join(f"{shard}/{generation}" for shard, generation in sorted(gone))
        if resends:
            self.report_loss(resends, names)
        else:
            log.warning("session %s: generation(s) %s (shard/generation) dropped by "
                        "retention while it was away; any unread messages in them are lost",
                        self._client_id, names)
        self._request_save()

    def report_loss(self, lost: int, generations: str) -> None:
        if lost <= 0:
            return
        SESSION_MESSAGES_EXPIRED.labels("retention").inc(lost)
        # Not saved here: a write of an offline session would move its expiry.
        log.warning("session %s lost %d messages to retention: generation(s) %s "
                    "(shard/generation) dropped before it delivered them", self._client_id,
                    lost, generations)


def _generation_of(key: str) -> tuple[int, int]:
    stream = parse_cursor_key(key)[1]
    return stream.shard, stream.generation


def _in_generation(key: str, shard: int, generation: int) -> bool:
    return _generation_of(key) == (shard, generation)
