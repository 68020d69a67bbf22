"""A shared group (`$share/{group}/{filter}`) with members on this site: its members,
those away, its backlogs (the streams whose share it reads from storage, see
backlog.py) and the deliveries it holds; and a group whose members are all away."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from ..ds import Iterator, Message, Stream
from ..metrics import MESSAGES_DROPPED
from ..session.model import Subscription
from ..session.outbox import Delivery
from ..session.session import Session


@dataclass(slots=True, eq=False)
class Backlog:
    """A group's share of one stream, read from storage instead of the live feed, from
    `since` on: what its members had no room for, or what a feed gap may have lost."""

    since: int
    iterator: Iterator | None = None  # made on the first read
    # The feed offered a message of the stream since the last read began: an empty
    # read then does not mean caught up, the message may be newer than what it saw.
    dirty: bool = True
    # Read to the stream's end with nothing fed meanwhile: the live feed delivers
    # again, passing over what storage gave already (up to `read_to`); the backlog
    # goes at the first message after it.
    caught_up: bool = False

    @property
    def read_to(self) -> int:
        return self.iterator.last_timestamp if self.iterator is not None else self.since - 1


@dataclass(slots=True, eq=False)
class SharedGroup:
    """`$share/{group}/{filter}`: each message goes to one member, round robin among
    those with room in their queue (any member when none has)."""

    name: str
    topic_filter: str
    members: list[tuple[Session, Subscription]] = field(default_factory=list)
    # The client ids of members that disconnected and keep their session (and so
    # their subscription): the group stays theirs while they are away.
    away: set[str] = field(default_factory=set)
    backlogs: dict[Stream, Backlog] = field(default_factory=dict)
    # Deliveries a member lost (it left) that no other member had room for yet:
    # at most what the members that left had queued and in flight.
    held: deque[Delivery] = field(default_factory=deque)
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    # The group went from this site (its last member here left): whoever reads its
    # backlog stops (a group of the same key that comes back is a new one).
    gone: bool = False

    @property
    def key(self) -> str:
        return f"{self.name}/{self.topic_filter}"

    def pick(self, message: Message) -> tuple[Session, Subscription] | None:
        candidates = [(session, subscription) for session, subscription in self.members
                      if session.may_receive(subscription, message)]
        if not candidates:
            return None
        with_room = [candidate for candidate in candidates if candidate[0].outbox.has_room]
        choice = with_room or candidates
        return choice[next(self._turn) % len(choice)]

    def deliver(self, message: Message, stream: Stream | None, *,
                needs_room: bool = False) -> bool:
        """Offer the message to one member. With `needs_room`, only to one with room
        in its queue: False when none has, or no member is connected (nothing
        offered)."""
        if needs_room and not self.connected():
            return False
        picked = self.pick(message)
        if picked is None:
            MESSAGES_DROPPED.labels("no_shared_member").inc()
            return True
        session, subscription = picked
        if needs_room and not session.outbox.has_room:
            return False  # picked first when it has room: no member has
        delivery = Delivery(message, min(message.qos, subscription.qos), False,
                            (subscription.identifier,) if subscription.identifier else (),
                            share_group=self.key, stream=stream)
        session.offer(delivery)
        return True

    def connected(self) -> bool:
        return any(session.outlet is not None for session, _ in self.members)

    def unsettled_from(self) -> dict[int, int]:
        """Per shard, the first timestamp of a message not settled here (held, in a
        backlog not read yet, or with a member: queued or not acknowledged): where
        another site takes the group's share on from when it goes from here, or when
        this site dies."""
        unsettled = [(stream.shard, backlog.read_to + 1)
                     for stream, backlog in self.backlogs.items() if not backlog.caught_up]
        unsettled += [(delivery.stream.shard, delivery.message.timestamp)
                      for delivery in self.held if delivery.stream is not None]
        unsettled += [item for session, _subscription in self.members
                      for item in session.shared_unsettled(self.key).items()]
        first: dict[int, int] = {}
        for shard, timestamp in unsettled:
            first[shard] = min(first.get(shard, timestamp), timestamp)
        return first


@dataclass(slots=True)
class AbsentGroup:
    """A group whose last member here went away (keeping its session) while no other
    site had members of it: per shard, the first timestamp its members had not
    settled (or the first after what this site was fed), and who keeps it."""

    since: dict[int, int]
    away: set[str]
