"""Which messages a site wants: the topic filters its subscribers hold, as a trie
(what a shard leader matches a committed message against before pushing it to a
site without a replica), and the one site that delivers a message to a shared
group. Pure: no I/O."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

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
