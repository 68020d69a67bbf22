"""A session's subscriptions, and which of them a message reaches: per topic, the
subscriptions (not shared) that match it, those the ACL of the connection refuses
left out. Decisions are remembered for the connection they were made for (another
one, maybe of another user, has everything decided again) and for a bounded number
of topics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from ..ds import Message
from ..topic import topic_matches
from .model import Subscription
from .outbox import Delivery, Outlet

_T = TypeVar("_T")
# Topics whose routes and ACL decisions a session remembers (oldest forgotten first).
ROUTE_CACHE_SIZE = 256


class Routes:
    # one per connection (or session): no __dict__ each (issue 25)
    __slots__ = ("_client_id", "_decided_for", "_filter_allowed", "_routes", "_subscriptions",
                 "_topic_allowed")

    def __init__(self, client_id: str) -> None:
        self._client_id = client_id
        self._subscriptions: dict[str, Subscription] = {}
        # Per topic, the subscriptions a message on it goes through (ACL applied);
        # valid for one outlet and one set of subscriptions.
        self._routes: dict[str, list[Subscription]] = {}
        self._topic_allowed: dict[str, bool] = {}
        self._filter_allowed: dict[str, bool] = {}
        self._decided_for: Outlet | None = None

    # -- the subscriptions ----------------------------------------------------------

    @property
    def subscriptions(self) -> Mapping[str, Subscription]:
        """By key (the filter as the client wrote it)."""
        return self._subscriptions

    def replace_all(self, subscriptions: Iterable[Subscription]) -> None:
        self._routes.clear()
        self._subscriptions = {subscription.key: subscription for subscription in subscriptions}

    def add(self, subscription: Subscription) -> bool:
        """Add or replace a subscription (a replaced one keeps its start); True when
        it is new."""
        self._routes.clear()
        held = self._subscriptions.get(subscription.key)
        if held is not None:
            subscription.since = held.since
        self._subscriptions[subscription.key] = subscription
        return held is None

    def remove(self, key: str) -> Subscription | None:
        self._routes.clear()
        return self._subscriptions.pop(key, None)

    # -- what a message reaches ---------------------------------------------------------

    def reaching(self, topic: str, outlet: Outlet | None) -> list[Subscription]:
        """The subscriptions (not shared) a message on the topic reaches through
        `outlet`, in key order, those its ACL refuses left out. Without a connection
        no ACL can be asked: the matches, not cached."""
        if outlet is None:
            return self._matching(topic)
        self._decide_for(outlet)
        routes = self._routes.get(topic)
        if routes is None:
            routes = [subscription for subscription in self._matching(topic)
                      if self._may_hold(subscription, outlet)] \
                if self._may_see(topic, outlet) else []
            _remember(self._routes, topic, routes)
        return routes

    def receivers(self, message: Message, outlet: Outlet | None) -> list[Subscription]:
        """The subscriptions a message read from storage is delivered through: those
        it reaches, made before it, without no local excluding it."""
        return [subscription for subscription in self.reaching(message.topic, outlet)
                if subscription.since <= message.timestamp
                and not (subscription.no_local and message.client_id == self._client_id)]

    def may_see(self, topic: str, outlet: Outlet) -> bool:
        """Whether the ACL lets a message on the topic reach the connection."""
        self._decide_for(outlet)
        return self._may_see(topic, outlet)

    def may_receive(self, subscription: Subscription, topic: str, outlet: Outlet) -> bool:
        """Whether the ACL lets the connection receive a message on the topic through
        the subscription (a shared one included)."""
        self._decide_for(outlet)
        return self._may_hold(subscription, outlet) and self._may_see(topic, outlet)

    def forget_decisions(self) -> None:
        self._routes.clear()
        self._topic_allowed.clear()
        self._filter_allowed.clear()
        self._decided_for = None  # and the connection they were made for

    def _decide_for(self, outlet: Outlet) -> None:
        if self._decided_for is not outlet:
            self.forget_decisions()
            self._decided_for = outlet

    def _matching(self, topic: str) -> list[Subscription]:
        return sorted((subscription for subscription in self._subscriptions.values()
                       if subscription.share_group is None
                       and topic_matches(subscription.topic_filter, topic)),
                      key=lambda subscription: subscription.key)

    def _may_hold(self, subscription: Subscription, outlet: Outlet) -> bool:
        """The subscription is checked again on delivery: a resumed one was granted
        on an earlier connection, maybe under other rules."""
        allowed = self._filter_allowed.get(subscription.key)
        if allowed is None:
            allowed = self._filter_allowed[subscription.key] = \
                outlet.may_subscribe(subscription.key)
        return allowed

    def _may_see(self, topic: str, outlet: Outlet) -> bool:
        allowed = self._topic_allowed.get(topic)
        if allowed is None:
            allowed = outlet.may_receive(topic)
            _remember(self._topic_allowed, topic, allowed)
        return allowed


def delivery_for(receivers: Sequence[Subscription], message: Message) -> Delivery:
    """One copy for all the subscriptions: at the highest QoS they grant, with all
    their identifiers (MQTT-3.3.4-2, 3.3.4-4)."""
    if len(receivers) == 1:  # the common case, without three generator passes
        only = receivers[0]
        return Delivery(message, min(message.qos, only.qos),
                        message.retain and only.retain_as_published,
                        (only.identifier,) if only.identifier else ())
    return Delivery(message, max(min(message.qos, s.qos) for s in receivers),
                    message.retain and any(s.retain_as_published for s in receivers),
                    tuple(s.identifier for s in receivers if s.identifier))


def _remember(cache: dict[str, _T], topic: str, value: _T) -> None:
    if len(cache) >= ROUTE_CACHE_SIZE:
        del cache[next(iter(cache))]  # the oldest
    cache[topic] = value
