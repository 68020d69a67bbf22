"""A session's cursors: its position in each (subscription, stream) it reads, and
the table that holds them with what replay order needs answered in O(1).

Within a lane (one subscription's streams of one shard) generations replay in
order: a cursor waits while the lane has a cursor of an older generation that has
not ended. The table keeps, per lane and generation, its cursors and how many of
them have not ended, so that question costs the lane's generations (a handful),
not a scan of every cursor: a wildcard filter may have thousands of streams, and
a scan per cursor made a replay pass (and each SUBSCRIBE) quadratic."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Iterator as PyIterator
from dataclasses import dataclass, field

from ..ds import Iterator, Stream
from .model import CursorState, Subscription


@dataclass(slots=True, eq=False)
class Cursor:
    """A durable session's position in one stream for one subscription."""

    key: str
    subscription: Subscription
    stream: Stream
    iterator: Iterator  # the stream and filter; its position may lag `last_handed`
    state: CursorState  # what is done (persisted)
    in_flight: deque[int] = field(default_factory=deque)  # handed out, in order
    done_early: set[int] = field(default_factory=set)
    live: bool = False
    dirty: bool = False
    ended: bool = False
    last_handed: int = -1  # timestamp of the last message handed out (or skipped)

    def __post_init__(self) -> None:
        if self.last_handed < 0:
            self.last_handed = self.iterator.last_timestamp

    def handed_out(self, timestamp: int) -> None:
        # An int, not a new Iterator per message: the iterator is moved only when
        # reading resumes (see `reader`).
        self.in_flight.append(timestamp)
        self.last_handed = timestamp

    def reader(self) -> Iterator:
        """The iterator positioned after the last message handed out."""
        if self.iterator.last_timestamp != self.last_handed:
            self.iterator = self.iterator.advanced_to(self.last_handed)
        return self.iterator

    def done(self, timestamp: int) -> None:
        if self.in_flight and self.in_flight[0] == timestamp:
            self.in_flight.popleft()
            self.state.position = timestamp
            while self.in_flight and self.in_flight[0] in self.done_early:
                self.done_early.discard(self.in_flight[0])
                self.state.position = self.in_flight.popleft()
        else:
            self.done_early.add(timestamp)
        if self.done_early or self.state.done_above:
            above = self.state.position
            self.done_early = {t for t in self.done_early if t > above}
            self.state.done_above = sorted(self.done_early)


# A lane: one subscription's streams of one shard. The subscription by identity: a
# replaced subscription (SUBSCRIBE again) is another lane.
Lane = tuple[int, int]


def lane_of(cursor: Cursor) -> Lane:
    return id(cursor.subscription), cursor.stream.shard


class CursorTable:
    """The cursors of a session by key, indexed by lane and generation. Every change
    goes through `add`, `remove`, `clear` and `end`, which keep the index."""

    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_by_key", "_lanes", "_open")


    def __init__(self) -> None:
        self._by_key: dict[str, Cursor] = {}
        # lane -> generation -> cursors (by key) of that generation in the lane
        self._lanes: dict[Lane, dict[int, dict[str, Cursor]]] = {}
        # lane -> generation -> how many of its cursors have not ended (none: absent)
        self._open: dict[Lane, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __iter__(self) -> PyIterator[str]:
        return iter(self._by_key)

    def get(self, key: str) -> Cursor | None:
        return self._by_key.get(key)

    def values(self) -> Iterable[Cursor]:
        return self._by_key.values()

    def items(self) -> Iterable[tuple[str, Cursor]]:
        return self._by_key.items()

    def add(self, cursor: Cursor) -> None:
        self.remove(cursor.key)
        self._by_key[cursor.key] = cursor
        lane, generation = lane_of(cursor), cursor.stream.generation
        self._lanes.setdefault(lane, {}).setdefault(generation, {})[cursor.key] = cursor
        if not cursor.ended:
            self._count_open(lane, generation, 1)

    def remove(self, key: str) -> Cursor | None:
        cursor = self._by_key.pop(key, None)
        if cursor is None:
            return None
        lane, generation = lane_of(cursor), cursor.stream.generation
        generations = self._lanes[lane]
        del generations[generation][key]
        if not generations[generation]:
            del generations[generation]
            if not generations:
                del self._lanes[lane]
        if not cursor.ended:
            self._count_open(lane, generation, -1)
        return cursor

    def clear(self) -> None:
        self._by_key.clear()
        self._lanes.clear()
        self._open.clear()

    def end(self, cursor: Cursor) -> None:
        """The cursor has read its (closed) generation to the end."""
        if not cursor.ended:
            cursor.ended = True
            if self._by_key.get(cursor.key) is cursor:
                self._count_open(lane_of(cursor), cursor.stream.generation, -1)

    def _count_open(self, lane: Lane, generation: int, change: int) -> None:
        counts = self._open.setdefault(lane, {})
        left = counts.get(generation, 0) + change
        if left:
            counts[generation] = left
        else:
            counts.pop(generation, None)
            if not counts:
                del self._open[lane]

    def any_to_read(self) -> bool:
        """Whether some cursor reads from storage (not on the live feed, not ended):
        a replay with none has nothing to do."""
        return bool(self._by_key) and any(not cursor.live and not cursor.ended
                                          for cursor in self._by_key.values())

    def blocked(self, cursor: Cursor) -> bool:
        """Whether an older generation of the cursor's lane has a cursor not ended."""
        counts = self._open.get(lane_of(cursor))
        return counts is not None and min(counts) < cursor.stream.generation

    def retire_older(self, opened: Iterable[Cursor]) -> None:
        """Cursors were opened: a newer generation of a lane means its older ones are
        complete, so their cursors read to their end (not live) and generations
        replay in order. Costs the older cursors once, not once per cursor opened."""
        newest: dict[Lane, int] = {}
        for cursor in opened:
            lane = lane_of(cursor)
            newest[lane] = max(newest.get(lane, cursor.stream.generation),
                               cursor.stream.generation)
        for lane, generation in newest.items():
            for older, cursors in self._lanes.get(lane, {}).items():
                if older < generation:
                    for cursor in cursors.values():
                        cursor.live = False
