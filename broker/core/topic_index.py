"""A set of topics kept as a trie of their levels, so the topics a filter matches are
found by walking only the branches the filter can reach, not by testing every topic."""

from __future__ import annotations

from collections.abc import Iterator


class _Node:
    __slots__ = ("children", "present")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.present = False


class TopicIndex:
    def __init__(self) -> None:
        self._root = _Node()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, topic: str) -> None:
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        if not node.present:
            node.present = True
            self._size += 1

    def remove(self, topic: str) -> None:
        path = [self._root]
        levels = topic.split("/")
        for level in levels:
            child = path[-1].children.get(level)
            if child is None:
                return
            path.append(child)
        if not path[-1].present:
            return
        path[-1].present = False
        self._size -= 1
        # Drop the branch's nodes that now lead nowhere, so the trie shrinks back.
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.present or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]

    def __contains__(self, topic: str) -> bool:
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                return False
            node = child
        return node.present

    def matching(self, filter_levels: list[str]) -> Iterator[str]:
        """The topics the filter (a valid one, as levels) matches, with the `$` rule:
        a filter starting with a wildcard matches no topic starting with `$`.

        The walk is lazy and may be consumed across awaits while topics are added and
        removed: each node's children are copied when it is reached, so it yields
        the topics present in a branch when it reached it (one removed since may
        still come, one added since may not)."""
        yield from self._walk(self._root, filter_levels, 0, [])

    def _walk(self, node: _Node, filter_levels: list[str], depth: int,
              prefix: list[str]) -> Iterator[str]:
        if depth == len(filter_levels):
            if node.present:
                yield "/".join(prefix)
            return
        want = filter_levels[depth]
        if want == "#":
            if node.present and depth > 0:  # "a/#" matches "a" too
                yield "/".join(prefix)
            yield from self._all_below(node, prefix, skip_dollar=depth == 0)
            return
        if want == "+":
            for level, child in tuple(node.children.items()):
                if depth == 0 and level.startswith("$"):
                    continue
                yield from self._walk(child, filter_levels, depth + 1, [*prefix, level])
            return
        exact = node.children.get(want)
        if exact is not None:
            yield from self._walk(exact, filter_levels, depth + 1, [*prefix, want])

    def _all_below(self, node: _Node, prefix: list[str], skip_dollar: bool) -> Iterator[str]:
        # Iterative: topics may have up to the configured maximum of levels.
        stack = [(child, [*prefix, level]) for level, child in tuple(node.children.items())
                 if not (skip_dollar and level.startswith("$"))]
        while stack:
            current, levels = stack.pop()
            if current.present:
                yield "/".join(levels)
            stack.extend((child, [*levels, level])
                         for level, child in tuple(current.children.items()))
