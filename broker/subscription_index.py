"""The site's subscription index: which subscribers want a topic.

A trie over filter levels, so matching a topic costs its depth, not the number of
subscriptions. Pure: the broker's dispatcher calls it from the commit feed, and a
shard leader (`routing/interest.py`) with the filters each site said it
holds."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Subscriber = TypeVar("Subscriber", bound=Hashable)


@dataclass(slots=True)
class _Node(Generic[Subscriber]):
    children: dict[str, _Node[Subscriber]] = field(default_factory=dict)
    # subscriber -> the filter as subscribed (several sessions may share a node)
    subscribers: dict[Subscriber, str] = field(default_factory=dict)


class SubscriptionIndex(Generic[Subscriber]):
    def __init__(self) -> None:
        self._root: _Node[Subscriber] = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, topic_filter: str, subscriber: Subscriber) -> bool:
        """Add a subscription; True when it was not there."""
        node = self._root
        for level in topic_filter.split("/"):
            node = node.children.setdefault(level, _Node())
        added = subscriber not in node.subscribers
        if added:
            self._count += 1
        node.subscribers[subscriber] = topic_filter
        return added

    def remove(self, topic_filter: str, subscriber: Subscriber) -> bool:
        path = [self._root]
        levels = topic_filter.split("/")
        for level in levels:
            child = path[-1].children.get(level)
            if child is None:
                return False
            path.append(child)
        if path[-1].subscribers.pop(subscriber, None) is None:
            return False
        self._count -= 1
        # prune empty branches so churn does not grow the trie forever
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.subscribers or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]
        return True

    def match(self, topic: str) -> Iterator[tuple[Subscriber, str]]:
        """(subscriber, filter) for every subscription matching the topic name."""
        levels = topic.split("/")
        dollar = topic.startswith("$")
        stack: list[tuple[_Node[Subscriber], int]] = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            # `+` and `#` at the first level never match `$` topics (MQTT 4.7.2)
            wildcards_allowed = not (dollar and depth == 0)
            if wildcards_allowed:
                hash_node = node.children.get("#")
                if hash_node is not None:
                    yield from hash_node.subscribers.items()
            if depth == len(levels):
                yield from node.subscribers.items()
                continue
            exact = node.children.get(levels[depth])
            if exact is not None:
                stack.append((exact, depth + 1))
            if wildcards_allowed:
                plus = node.children.get("+")
                if plus is not None:
                    stack.append((plus, depth + 1))
