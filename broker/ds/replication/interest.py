"""Which messages a site wants: the topic filters its subscribers hold, as a trie
(what a shard leader matches a committed message against before pushing it to a
site without a replica), and the one site that delivers a message to a shared
group. Pure: no I/O."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

SHARE_PREFIX = "$share/"


@dataclass(slots=True)
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    terminal: bool = False


def plain_filter(topic_filter: str) -> str:
    """The filter a subscription matches topics with: `$share/group/a/+` -> `a/+`."""
    if topic_filter.startswith(SHARE_PREFIX):
        _share, _group, rest = topic_filter.split("/", 2)
        return rest
    return topic_filter


class FilterSet:
    """A set of topic filters that answers whether any of them matches a topic."""

    def __init__(self, filters: Iterable[str] = ()) -> None:
        self._root = _Node()
        self.filters = frozenset(filters)
        for topic_filter in self.filters:
            node = self._root
            for level in plain_filter(topic_filter).split("/"):
                node = node.children.setdefault(level, _Node())
            node.terminal = True

    def __bool__(self) -> bool:
        return bool(self.filters)

    def matches(self, topic: str) -> bool:
        levels = topic.split("/")
        # `+` and `#` at the first level never match `$` topics (MQTT 4.7.2)
        dollar = topic.startswith("$")
        stack = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            wildcards = not (dollar and depth == 0)
            if wildcards:
                hash_node = node.children.get("#")
                if hash_node is not None and hash_node.terminal:
                    return True
            if depth == len(levels):
                if node.terminal:
                    return True
                continue
            exact = node.children.get(levels[depth])
            if exact is not None:
                stack.append((exact, depth + 1))
            if wildcards:
                plus = node.children.get("+")
                if plus is not None:
                    stack.append((plus, depth + 1))
        return False


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
