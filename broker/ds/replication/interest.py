"""Which messages a site wants: the topic filters its subscribers hold, as a trie
(what a shard leader matches a committed message against before pushing it to a
site without a replica), the table of what each peer told, and the one site that
delivers a message to a shared group. Pure: no I/O."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ...subscription_index import SubscriptionIndex

SHARE_PREFIX = "$share/"


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
    (the table's clock)."""

    site: str
    filters: frozenset[str]
    last_told: float


@dataclass(slots=True)
class _Told:
    filters: FilterSet
    address: str | None
    at: float


class InterestTable:
    """Each peer's filters and peer address, as it last told them. A peer that has
    not told them again for `expiry` seconds is forgotten (gone for good, or cut
    off): nothing more is pushed to it, and it is no longer a member of any shared
    group here. If it comes back, its next telling finds them not had, so it reads
    what it missed from storage."""

    def __init__(self, expiry: float) -> None:
        self.expiry = expiry
        self._told: dict[str, _Told] = {}

    def take(self, site: str, address: str | None, filters: frozenset[str],
             now: float) -> bool:
        """Record what `site` told at `now` (`address` None: it told none, so the last
        one it told stays); whether these filters were had already."""
        known = self._told.get(site)
        had = known is not None and known.filters.filters == filters
        if known is None:
            self._told[site] = _Told(FilterSet(filters), address, now)
            return False
        if not had:
            known.filters = FilterSet(filters)
        if address is not None:
            known.address = address
        known.at = now
        return had

    def expire(self, now: float) -> list[Forgotten]:
        """Forget the sites that have told nothing for `expiry` seconds; them, sorted,
        with what they had told."""
        gone = sorted(site for site, told in self._told.items()
                      if now - told.at > self.expiry)
        return [Forgotten(site, told.filters.filters, told.at)
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


def shared_site(group_key: str, message_key: str, sites: Iterable[str]) -> str | None:
    """The one site that delivers a message to a shared group: chosen from the sorted
    sites that have members of the group, by a hash of the message (its publisher
    and timestamp), so every site picks the same one without asking. None when no
    site has a member."""
    ordered = sorted(set(sites))
    if not ordered:
        return None
    index = zlib.crc32(f"{group_key}\x00{message_key}".encode()) % len(ordered)
    return ordered[index]
