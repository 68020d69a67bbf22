"""The commit feed to sessions: each committed message goes once to each session
with a subscription that matches it (the session merges overlapping subscriptions
into one delivery), and to one member of each matching shared group that the ACL
lets receive it. A shared group whose members have no room in their queues for a
message reads that stream from storage from the message on (a backlog, read by
`shared/backlog.py`), as a transient session does: no QoS 1/2 message is dropped
for a slow group. A group whose members are all away (disconnected, their sessions
kept) is kept as where they stopped settling messages, and reads from there when
one comes back: no QoS 1/2 message is dropped for an absent group either."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable

from ..ds import CookedBatch, Message, Stream
from ..metrics import MESSAGES_DROPPED
from ..session.model import Subscription
from ..session.outbox import Delivery
from ..session.session import Session
from ..shared.backlog import SharedBacklog
from ..shared.choice import SiteChoice
from ..shared.groups import AbsentGroup, Backlog, SharedGroup
from ..subscription_index import SubscriptionIndex

# A shard that fed this site nothing since it started: an absent group reads it from
# this long before its last member went (a message stored just before may be fed
# just after).
AWAY_FEED_LAG_US = 5_000_000


class Dispatcher:
    """`on_interest` is told the filters routed here whenever they change (other
    sites push what matches them), with, for each `$share/...` filter whose group just
    went from here, per shard the first timestamp its members did not settle. On a
    cluster: `choice` picks the one site that delivers a message to a shared group, and
    `fed_through` tells per shard the last timestamp fed here. All default to a site
    alone. `backlog` reads a group's share from storage when the live feed cannot
    deliver it (none: nothing is read, as in tests of the feed alone)."""

    def __init__(self, *, choice: SiteChoice | None = None,
                 backlog: SharedBacklog | None = None,
                 on_interest: Callable[[frozenset[str], dict[str, dict[int, int]]], None]
                 | None = None,
                 fed_through: Callable[[], list[int]] | None = None) -> None:
        self._index: SubscriptionIndex[tuple[Session, str] | SharedGroup] = SubscriptionIndex()
        self._groups: dict[str, SharedGroup] = {}
        # The filters routed here (shared ones as $share/group/filter), with how many
        # subscriptions hold each: other sites push what matches them.
        self._filters: Counter[str] = Counter()
        self._on_interest = on_interest
        self._choice = choice if choice is not None else SiteChoice()
        self._backlog = backlog
        # Groups whose members are all away, by key; when one comes back, it reads
        # from where per shard they stopped (`SharedBacklog.on_back`).
        self._absent: dict[str, AbsentGroup] = {}
        self._fed_through = fed_through

    def _hold(self, topic_filter: str, change: int,
              left_from: dict[int, int] | None = None) -> None:
        before = len(self._filters)
        self._filters[topic_filter] += change
        if self._filters[topic_filter] <= 0:
            del self._filters[topic_filter]
        if len(self._filters) != before and self._on_interest is not None:
            self._on_interest(frozenset(self._filters),
                             {} if left_from is None else {topic_filter: left_from})

    def wants(self, _shard: int) -> bool:
        """Whether a committed message could go to anyone here: some session or shared
        group of this site subscribes (a replica's batches are not decoded else)."""
        return len(self._index) > 0

    def on_commit(self, cooked: CookedBatch) -> None:
        for static, message in cooked.messages:
            stream = Stream(cooked.shard, cooked.generation, static)
            sessions: dict[Session, None] = {}  # each once, in match order
            for subscriber, _filter in list(self._index.match(message.topic)):
                if isinstance(subscriber, SharedGroup):
                    self._feed_shared(subscriber, stream, message)
                else:
                    sessions[subscriber[0]] = None
            for session in sessions:
                session.replay.on_feed(stream, message)

    def _feed_shared(self, group: SharedGroup, stream: Stream, message: Message) -> None:
        backlog = group.backlogs.get(stream)
        if backlog is not None:
            if not backlog.caught_up:
                backlog.dirty = True  # storage has it: the backlog reads it
                self._tell_backlog(group)
                return
            if message.timestamp <= backlog.read_to:
                return  # storage gave it (a push that came late)
            del group.backlogs[stream]
        if not self._choice.delivers_here(group, message):
            return
        if not group.deliver(message, stream, needs_room=message.qos > 0):
            group.backlogs[stream] = Backlog(message.timestamp)
            self._tell_backlog(group)

    def _tell_backlog(self, group: SharedGroup) -> None:
        if self._backlog is not None:
            self._backlog.start(group)

    def _tell_back(self, group: SharedGroup, since: dict[int, int]) -> None:
        if self._backlog is not None:
            self._backlog.on_back(group, since)

    def on_feed_gap(self, shard: int, since: int) -> None:
        """The site may have missed the shard's messages from `since` on (a database's
        feed gap listener): every group reads its streams of the shard from there."""
        if self._backlog is not None:
            for group in self.groups:
                self._backlog.on_feed_gap(group, shard, since)

    @property
    def groups(self) -> list[SharedGroup]:
        """The shared groups with members here."""
        return list(self._groups.values())

    def positions_to_keep(self, group_keys: Collection[str] | None = None
                          ) -> dict[str, AbsentGroup]:
        """What a restarted site needs to find its groups again: every absent group,
        and every group here as it would be absent if its members went now (those
        whose sessions outlive their connections keep it). A group that no member
        keeps is left out. With `group_keys`: those groups only."""
        groups: Iterable[tuple[str, SharedGroup]]
        if group_keys is None:
            kept = dict(self._absent)
            groups = self._groups.items()
        else:
            kept = {key: self._absent[key] for key in group_keys if key in self._absent}
            groups = [(key, self._groups[key]) for key in group_keys if key in self._groups]
        for key, group in groups:
            away = group.away | {session.client_id for session, _s in group.members
                                 if session.outlives_connection}
            if away:
                kept[key] = AbsentGroup(self._stopped_at(group.unsettled_from()), away)
        return kept

    def session_ended(self, client_id: str) -> None:
        """A stored session not held here ended (it expired while no site held it):
        the absent groups stop waiting for it."""
        for key in list(self._absent):
            self._stop_waiting(key, client_id)

    def _stop_waiting(self, group_key: str, client_id: str) -> None:
        """An absent group no longer waits for `client_id`; with nobody left, it goes."""
        absent = self._absent.get(group_key)
        if absent is not None:
            absent.away.discard(client_id)
            if not absent.away:
                del self._absent[group_key]

    def adopt_absent(self, groups: dict[str, AbsentGroup]) -> None:
        """Groups kept for members whose sessions are here now: kept by this site when
        it stopped, or taken along from the site a session moved from. Each is absent
        here until a member is back (with one kept here already: the earlier position
        per shard, and the members away of both); a group with members here already reads
        from there too (at least once)."""
        for key, absent in groups.items():
            group = self._groups.get(key)
            if group is not None:
                self._tell_back(group, absent.since)
                continue
            kept = self._absent.setdefault(key, AbsentGroup({}, set()))
            for shard, at in absent.since.items():
                kept.since[shard] = min(kept.since.get(shard, at), at)
            kept.away |= absent.away

    @property
    def absent(self) -> dict[str, AbsentGroup]:
        """The groups whose members are all away, by key (a copy)."""
        return dict(self._absent)

    def shared_unsettled(self) -> dict[str, dict[int, int]]:
        """For each `$share/group/filter` with members here, where per shard its
        messages stop being settled here (`SharedGroup.unsettled_from`)."""
        return {f"$share/{key}": group.unsettled_from() for key, group in self._groups.items()}

    def group_of(self, share_filter: str) -> SharedGroup | None:
        """The group of a `$share/group/filter` with members here."""
        return self._groups.get(share_filter.removeprefix("$share/"))

    def on_shared_loss(self, delivery: Delivery) -> None:
        """A member lost a shared delivery (it disconnected): another one with room
        gets it; with none connected or with room, the group holds it until one has
        (and if the group goes from here first, another site delivers it)."""
        group = self._groups.get(delivery.share_group or "")
        if group is None or delivery.qos == 0:
            MESSAGES_DROPPED.labels("shared_member_left").inc()
            return
        if not group.deliver(delivery.message, delivery.stream, needs_room=True):
            group.held.append(delivery)
            self._tell_backlog(group)

    def route(self, session: Session, subscription: Subscription) -> None:
        if subscription.share_group is None:
            if self._index.add(subscription.topic_filter, (session, subscription.key)):
                self._hold(subscription.topic_filter, 1)
            return
        group_key = subscription.group_key
        group = self._groups.get(group_key)
        if group is None:
            group = self._groups[group_key] = SharedGroup(subscription.share_group,
                                                          subscription.topic_filter)
            self._index.add(subscription.topic_filter, group)
            self._hold(f"$share/{group_key}", 1)
            absent = self._absent.pop(group_key, None)
            if absent is not None:
                group.away = absent.away
                self._tell_back(group, absent.since)
        group.away.discard(session.client_id)
        group.members = [m for m in group.members if m[0] is not session]
        group.members.append((session, subscription))

    def unroute(self, session: Session, subscription: Subscription, *,
                stays_subscribed: bool = False) -> None:
        """Take a subscription out of the feed. `stays_subscribed`: the session went
        away (disconnected) and keeps it, so a shared group waits for it."""
        if subscription.share_group is None:
            if self._index.remove(subscription.topic_filter, (session, subscription.key)):
                self._hold(subscription.topic_filter, -1)
            return
        group_key = subscription.group_key
        group = self._groups.get(group_key)
        if group is None:  # a member away ends (expiry, takeover elsewhere)
            if not stays_subscribed:
                self._stop_waiting(group_key, session.client_id)
            return
        group.members = [m for m in group.members if m[0] is not session]
        if stays_subscribed:
            group.away.add(session.client_id)
        else:
            group.away.discard(session.client_id)
        if not group.members:
            unsettled = group.unsettled_from()
            if group.away and len(self._choice.members_of(group)) <= 1:
                self._absent[group_key] = AbsentGroup(self._stopped_at(unsettled),
                                                      group.away)
            del self._groups[group_key]
            group.gone = True
            self._index.remove(subscription.topic_filter, group)
            self._hold(f"$share/{group_key}", -1, unsettled)

    def _stopped_at(self, unsettled: dict[int, int]) -> dict[int, int]:
        """Per shard, where a group whose members all went away reads from when one
        comes back: the first message not settled, else the first after what this
        site was fed."""
        fed = self._fed_through() if self._fed_through is not None else []
        lag = int(time.time() * 1_000_000) - AWAY_FEED_LAG_US
        since = {shard: last + 1 if last else lag for shard, last in enumerate(fed)}
        for shard, timestamp in unsettled.items():
            since[shard] = min(since.get(shard, timestamp), timestamp)
        return since
