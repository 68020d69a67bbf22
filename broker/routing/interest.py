"""Which messages a site wants: the topic filters its subscribers hold, as a trie
(what a shard leader matches a committed message against before pushing it to a
site without a replica), the table of what each peer told, and the one site that
delivers a message to a shared group. Pure: no I/O.

A site's membership of a shared group takes effect at a storage timestamp it
chooses when its first member subscribes (`JOIN_DELAY` ahead) and tells with its
filters: every site picks among the members effective at a message's timestamp, so
they agree on every message once the telling has reached them, however long it
took within the delay. The pick is a rendezvous hash: a site that joins or leaves
moves only the messages it is or was picked for, never one between the others."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..subscription_index import SubscriptionIndex
from ..topic import SHARE_PREFIX

# How far ahead of its first member's SUBSCRIBE a site's membership of a shared group
# takes effect: long enough for its telling to reach every other site (they tell
# once a second, and a telling that waits longer than INTEREST_TIMEOUT is dropped).
JOIN_DELAY_US = 3_000_000

# (site, the storage timestamp its membership of the group takes effect at)
ShareMember = tuple[str, int]


def plain_filter(topic_filter: str) -> str:
    """The filter a subscription matches topics with: `$share/group/a/+` -> `a/+`."""
    if topic_filter.startswith(SHARE_PREFIX):
        _share, _group, rest = topic_filter.split("/", 2)
        return rest
    return topic_filter


class FilterSet:
    """A set of topic filters that answers whether any of them matches a topic."""

    def __init__(self, filters: Iterable[str] = ()) -> None:
        self.filters = frozenset(filters)
        self._index: SubscriptionIndex[str] = SubscriptionIndex()
        for topic_filter in self.filters:
            self._index.add(plain_filter(topic_filter), topic_filter)

    def __bool__(self) -> bool:
        return bool(self.filters)

    def matches(self, topic: str) -> bool:
        return next(self._index.match(topic), None) is not None


@dataclass(frozen=True, slots=True)
class Forgotten:
    """A site the table forgot: the filters it had told, and when it last told them
    (the table's clock); for its shared groups, when it joined each and, per shard,
    where its members had stopped settling messages then."""

    site: str
    filters: frozenset[str]
    last_told: float
    joined: dict[str, int]
    unsettled: dict[str, list[int]]


@dataclass(slots=True)
class _Told:
    filters: FilterSet
    address: str
    at: float
    joined: dict[str, int]  # for each `$share/...` filter, when its membership began
    # for each `$share/...` filter, per shard, where its members stopped settling
    unsettled: dict[str, list[int]]


class InterestTable:
    """Each peer's filters and peer address, as it last told them. A peer that has
    not told them again for `expiry` seconds is forgotten (gone for good, or cut
    off): nothing more is pushed to it, and it is no longer a member of any shared
    group here. If it comes back, its next telling finds them not had, so it reads
    what it missed from storage."""

    def __init__(self, expiry: float) -> None:
        self.expiry = expiry
        self._told: dict[str, _Told] = {}

    def take(self, site: str, address: str, filters: frozenset[str], now: float,
             joined: dict[str, int], unsettled: dict[str, list[int]]) -> bool:
        """Record what `site` told at `now`: its peer address, its filters, when each
        of its `$share/...` filters took effect (`joined`; one it left while the
        telling was made has none: at once) and, per shard, where the members of each
        stopped settling messages (`unsettled`); whether these filters were had
        already."""
        joined = {topic_filter: joined.get(topic_filter, 0)
                  for topic_filter in filters if topic_filter.startswith(SHARE_PREFIX)}
        unsettled = {topic_filter: stopped for topic_filter, stopped in unsettled.items()
                     if topic_filter in joined}
        known = self._told.get(site)
        had = known is not None and known.filters.filters == filters
        if known is None:
            self._told[site] = _Told(FilterSet(filters), address, now, joined, unsettled)
            return False
        if not had:
            known.filters = FilterSet(filters)
        known.joined = joined
        known.unsettled = unsettled
        known.address = address
        known.at = now
        return had

    def joined_of(self, site: str) -> dict[str, int]:
        """When each of the site's memberships of shared groups took effect."""
        told = self._told.get(site)
        return {} if told is None else dict(told.joined)

    def members_of(self, share_filter: str) -> list[ShareMember]:
        """The sites holding a `$share/group/filter`, with when each joined."""
        return [(site, told.joined.get(share_filter, 0)) for site, told in self._told.items()
                if share_filter in told.filters.filters]

    def expire(self, now: float) -> list[Forgotten]:
        """Forget the sites that have told nothing for `expiry` seconds; them, sorted,
        with what they had told."""
        gone = sorted(site for site, told in self._told.items()
                      if now - told.at > self.expiry)
        return [Forgotten(site, told.filters.filters, told.at, told.joined, told.unsettled)
                for site in gone if (told := self._told.pop(site))]

    def filters_of(self, site: str) -> FilterSet:
        told = self._told.get(site)
        return FilterSet() if told is None else told.filters

    def address_of(self, site: str) -> str | None:
        told = self._told.get(site)
        return None if told is None else told.address

    def items(self) -> Iterator[tuple[str, FilterSet]]:
        return ((site, told.filters) for site, told in self._told.items())

    def __bool__(self) -> bool:
        return bool(self._told)


def shared_site(group_key: str, message_key: str, members: Iterable[ShareMember],
                timestamp: int) -> str | None:
    """The one site that delivers a message to a shared group, the same at every
    site that knows the same members: of the members effective at the message's
    `timestamp` (those that joined before it; when none has, the first to join),
    the one with the highest hash of (group, message, site). None without members."""
    known = list(members)
    if not known:
        return None
    effective = [site for site, joined in known if joined <= timestamp]
    if not effective:
        first = min(joined for _site, joined in known)
        effective = [site for site, joined in known if joined == first]
    prefix = f"{group_key}\x00{message_key}\x00".encode()
    # blake2b, not crc32: a CRC of the same prefix with different sites differs by a
    # constant, so the ranking of sites would hardly depend on the message
    return max(sorted(set(effective)),
               key=lambda site: hashlib.blake2b(prefix + site.encode(), digest_size=8).digest())
