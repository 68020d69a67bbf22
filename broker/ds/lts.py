"""Learned topic structure (LTS): a trie learned from the topics a shard sees.

Each trie state has an id. Edges are labelled with a topic level, with `+` (the
learned wildcard) or with END (end of topic). While a state has fewer exact edges
than the threshold for its depth, a new level becomes a new exact edge; once it has
reached the threshold, the state grows a `+` edge and every later unknown level goes
through it and becomes a *varying* level. A topic maps to `(static index, varying
levels)`: the id of the END state its walk reaches, and the levels taken through
`+` edges. The static index names a stream.

Ids are derived from the parent id and the edge label, so two replicas that learn
the same topics in the same order build identical tries, and re-adding an edge is
harmless. After the algorithm of EMQX's `emqx_ds_lts` (read, not copied).

The trie is bounded (`TrieBounds`): no exact or `+` edge is learned at a depth of
`max_levels` or more, nor once the edges' estimated bytes reach `max_bytes`. A topic
that would need one is *folded*: the rest of it, from that level on, goes through a
REST edge of the state reached and is one varying level (`a/b/c/d` folded at depth 2:
varying `c/d`). A state has at most one REST edge (and one END under it), and once
it has one it learns no more edges, so a topic keeps its stream; REST and END edges
are not refused by the bound (at most one of each per state), so the bound holds to
within three edges per learned state. A stream with a folded level matches a filter
that reaches its state with levels left; every message read is checked against the
filter anyway (see `ShardSet.next`)."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..metrics import Tally
from .cache import BytesBoundedCache

StaticIndex = bytes
STATIC_INDEX_BYTES = 8

PLUS = "+"
# U+0000 can never appear in an MQTT topic level, so it cannot clash with one.
END = "\x00"
# A topic name has no `#`: the label of the edge that folds the rest of a topic.
REST = "#"

# Bytes the topic-to-key cache of one trie may hold (the shard passes its share of
# the database's `topic_cache_bytes`).
DEFAULT_TOPIC_CACHE_BYTES = 8 * 1024 * 1024


# Estimated memory of one learned edge besides its label (two dict entries, the child
# id, the state's own dicts, the Edge persisted and kept): 5,000 120-level topics
# grew a site by about 450 bytes an edge.
EDGE_BYTES = 450


def edge_bytes(label: str) -> int:
    return EDGE_BYTES + len(label)


@dataclass(frozen=True, slots=True)
class TrieBounds:
    """How far a trie learns (see the module's docstring); the defaults bound
    nothing."""

    max_levels: int = 65535
    max_bytes: int = 1 << 62

    def __post_init__(self) -> None:
        if self.max_levels < 1 or self.max_bytes < 0:
            raise ValueError(f"trie bounds must be positive: {self!r}")


UNBOUNDED = TrieBounds()


def child_id(parent: StaticIndex, label: str) -> StaticIndex:
    return hashlib.blake2b(parent + label.encode("utf-8"), digest_size=STATIC_INDEX_BYTES).digest()


# `$`-topics live under their own root so that `+` and `#` at the first level never
# reach them (MQTT 5.0 section 4.7.2).
ROOT = child_id(b"", "root")
DOLLAR_ROOT = child_id(b"", "$root")


@dataclass(frozen=True, slots=True)
class Edge:
    parent: StaticIndex
    label: str
    child: StaticIndex


@dataclass(frozen=True, slots=True)
class TopicKey:
    static: StaticIndex
    varying: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StreamMatch:
    """A stream a filter needs: its static index, and for each varying level either
    the concrete level the filter asks for or `+` for any."""

    static: StaticIndex
    pattern: tuple[str, ...]


# Object sizes (CPython, 64-bit) for bounding a cached TopicKey without measuring
# each part: the key object, its static bytes and varying tuple; then per varying
# level a str header and a tuple slot.
_KEY_OVERHEAD = 48 + 33 + 40
_LEVEL_OVERHEAD = 80 + 8


def _key_bytes(key: TopicKey, topic_bytes: int) -> int:
    """At least what `key` holds: its varying levels are pieces of the topic, whose
    own size is `topic_bytes`, and no piece is stored wider than the whole (~10
    getsizeof calls a miss cost more than the lookup with many topics)."""
    return _KEY_OVERHEAD + len(key.static) + topic_bytes + _LEVEL_OVERHEAD * len(key.varying)


def root_for(first_level: str) -> StaticIndex:
    return DOLLAR_ROOT if first_level.startswith("$") else ROOT


class Trie:
    """The learned structure of one generation of one shard. Pure: persistence is
    the caller's, through `edges()` and `add_edge`."""

    def __init__(self, thresholds: Sequence[int],
                 cache_bytes: int = DEFAULT_TOPIC_CACHE_BYTES,
                 bounds: TrieBounds = UNBOUNDED, folds: Tally | None = None) -> None:
        """`folds` counts the topics mapped through a fold (each time one is mapped
        without the topic cache)."""
        if not thresholds or any(t < 1 for t in thresholds):
            raise ValueError(f"wildcard thresholds must be positive integers: {thresholds!r}")
        self.thresholds = tuple(thresholds)
        self.bounds = bounds
        self._folds = folds
        # estimated bytes of the edges (see `edge_bytes`)
        self.bytes = 0
        self._children: dict[StaticIndex, dict[str, StaticIndex]] = {}
        # exact edges per state, kept apart so the threshold test is O(1)
        self._exact_count: dict[StaticIndex, int] = {}
        # child -> (parent, label): walks a stream's path without searching the trie
        self._parents: dict[StaticIndex, tuple[StaticIndex, str]] = {}
        self._topic_cache: BytesBoundedCache[str, TopicKey] = BytesBoundedCache(cache_bytes)

    # -- building -----------------------------------------------------------------

    def threshold(self, depth: int) -> int:
        return self.thresholds[min(depth, len(self.thresholds) - 1)]

    def add_edge(self, edge: Edge) -> bool:
        """Add an edge; returns False when it was already there."""
        children = self._children.setdefault(edge.parent, {})
        if edge.label in children:
            return False
        children[edge.label] = edge.child
        self._parents[edge.child] = (edge.parent, edge.label)
        self.bytes += edge_bytes(edge.label)
        if edge.label not in (PLUS, END):
            self._exact_count[edge.parent] = self._exact_count.get(edge.parent, 0) + 1
        return True

    def remove_edges(self, edges: Iterable[Edge]) -> None:
        """Undo edges learned by a batch whose commit failed."""
        for edge in edges:
            children = self._children.get(edge.parent)
            if children is not None and children.pop(edge.label, None) is not None:
                self._parents.pop(edge.child, None)
                self.bytes -= edge_bytes(edge.label)
                if edge.label not in (PLUS, END):
                    self._exact_count[edge.parent] -= 1
        self._topic_cache.clear()

    def edges(self) -> Iterator[Edge]:
        for parent, children in self._children.items():
            for label, child in children.items():
                yield Edge(parent, label, child)

    def __len__(self) -> int:
        return sum(len(children) for children in self._children.values())

    def _learn(self, parent: StaticIndex, label: str, learned: list[Edge]) -> StaticIndex:
        edge = Edge(parent, label, child_id(parent, label))
        self.add_edge(edge)
        learned.append(edge)
        return edge.child

    def topic_key(self, levels: Sequence[str], learned: list[Edge]) -> TopicKey:
        """Map a topic to its key, learning as needed; new edges are appended to
        `learned` so the caller can persist them with the data that needs them."""
        return self.key_of_topic("/".join(levels), learned)

    def key_of_topic(self, topic: str, learned: list[Edge]) -> TopicKey:
        """`topic_key` for a topic name as a string (the hot path: cached)."""
        cached = self._topic_cache.get(topic)
        if cached is not None:
            return cached
        levels = topic.split("/")
        state = root_for(levels[0])
        varying: list[str] = []
        for depth, level in enumerate(levels):
            children = self._children.get(state)
            if children is not None and level in children:
                state = children[level]
            elif children is not None and PLUS in children:
                state = children[PLUS]
                varying.append(level)
            else:
                label = level if self._exact_count.get(state, 0) < self.threshold(depth) \
                    else PLUS
                if (children is not None and REST in children) \
                        or not self._may_learn(depth, label):
                    state = children[REST] if children is not None and REST in children \
                        else self._learn(state, REST, learned)
                    varying.append("/".join(levels[depth:]))
                    if self._folds is not None:
                        self._folds.inc()
                    break
                state = self._learn(state, label, learned)
                if label == PLUS:
                    varying.append(level)
        children = self._children.get(state)
        if children is not None and END in children:
            static = children[END]
        else:
            static = self._learn(state, END, learned)
        key = TopicKey(static, tuple(varying))
        self._topic_cache.put(topic, key, _key_bytes(key, sys.getsizeof(topic)))
        return key

    def _may_learn(self, depth: int, label: str) -> bool:
        return depth < self.bounds.max_levels \
            and self.bytes + edge_bytes(label) <= self.bounds.max_bytes

    def clear_cache(self) -> None:
        """Forget cached topic keys (a closed generation maps no more topics)."""
        self._topic_cache.clear()

    def lookup(self, levels: Sequence[str]) -> TopicKey | None:
        """The key of a topic without learning; None if the trie has never seen it."""
        state = root_for(levels[0])
        varying: list[str] = []
        for depth, level in enumerate(levels):
            children = self._children.get(state)
            if children is None:
                return None
            if level in children:
                state = children[level]
            elif PLUS in children:
                state = children[PLUS]
                varying.append(level)
            elif REST in children:
                state = children[REST]
                varying.append("/".join(levels[depth:]))
                break
            else:
                return None
        static = self._children.get(state, {}).get(END)
        return None if static is None else TopicKey(static, tuple(varying))

    # -- matching -----------------------------------------------------------------

    def match(self, filter_levels: Sequence[str]) -> list[StreamMatch]:
        """The streams whose topics may match a (validated) topic filter."""
        found: list[StreamMatch] = []
        first = filter_levels[0]
        root = ROOT if first in (PLUS, "#") else root_for(first)
        # Iterative walk: a filter may have up to 65535 levels, more than Python's stack.
        stack: list[tuple[StaticIndex, int, tuple[str, ...]]] = [(root, 0, ())]
        while stack:
            state, depth, pattern = stack.pop()
            children = self._children.get(state)
            if children is None:
                continue
            if depth == len(filter_levels):
                if END in children:
                    found.append(StreamMatch(children[END], pattern))
                continue
            level = filter_levels[depth]
            if level == "#":
                self._collect_all(state, pattern, found)
                continue
            if REST in children:  # its topics have the filter's levels left, or more
                end = self._children.get(children[REST], {}).get(END)
                if end is not None:
                    found.append(StreamMatch(
                        end, (*pattern, folded_pattern(filter_levels[depth:]))))
            if level == PLUS:
                for label, child in children.items():
                    if label == PLUS:
                        stack.append((child, depth + 1, (*pattern, PLUS)))
                    elif label not in (END, REST):
                        stack.append((child, depth + 1, pattern))
            elif level in children:
                # An exact edge, once it exists, takes every topic with this level:
                # `+` edges are only grown after exact ones stop being added.
                stack.append((children[level], depth + 1, pattern))
            elif PLUS in children:
                stack.append((children[PLUS], depth + 1, (*pattern, level)))
        return found

    def match_static(self, filter_levels: Sequence[str],
                     static: StaticIndex) -> StreamMatch | None:
        """`match` for one stream: its match if the filter reads it, else None. Walks
        the stream's path only (O(levels)), with the rules of `match`."""
        path: list[tuple[StaticIndex, str]] = []
        state = static
        while state in self._parents:
            state, label = self._parents[state]
            path.append((state, label))
        path.reverse()
        first = filter_levels[0]
        if not path or path[-1][1] != END \
                or state != (ROOT if first in (PLUS, "#") else root_for(first)):
            return None
        pattern: list[str] = []
        for depth, (parent, label) in enumerate(path):
            level = filter_levels[depth] if depth < len(filter_levels) else None
            if label == END:
                return StreamMatch(static, tuple(pattern)) \
                    if level is None or level == "#" else None
            if level is None:
                return None
            if level == "#":
                pattern += [PLUS for _parent, later in path[depth:] if later in (PLUS, REST)]
                return StreamMatch(static, tuple(pattern))
            if label == REST:
                return StreamMatch(static, (*pattern, folded_pattern(filter_levels[depth:])))
            if level == PLUS:
                if label == PLUS:
                    pattern.append(PLUS)
            elif label == PLUS and level not in self._children.get(parent, {}):
                pattern.append(level)
            elif label != level:
                return None
        return None

    def _collect_all(self, state: StaticIndex, pattern: tuple[str, ...],
                     found: list[StreamMatch]) -> None:
        stack = [(state, pattern)]
        while stack:
            current, current_pattern = stack.pop()
            for label, child in self._children.get(current, {}).items():
                if label == END:
                    found.append(StreamMatch(child, current_pattern))
                elif label in (PLUS, REST):
                    stack.append((child, (*current_pattern, PLUS)))
                else:
                    stack.append((child, current_pattern))

    # -- generations --------------------------------------------------------------

    def wildcard_paths(self) -> list[Edge]:
        """The edges on paths that lead through a `+` edge: what a new generation
        inherits, so streams learned as wildcards stay wildcards."""
        keep: dict[Edge, None] = {}
        stack: list[tuple[StaticIndex, tuple[Edge, ...], bool]] = [
            (ROOT, (), False), (DOLLAR_ROOT, (), False)]
        while stack:
            state, path, through_plus = stack.pop()
            for label, child in self._children.get(state, {}).items():
                edge = Edge(state, label, child)
                if label == REST:
                    continue  # a fold is this generation's bound, not a structure
                if label != END:
                    stack.append((child, (*path, edge), through_plus or label == PLUS))
                elif through_plus:
                    keep.update(dict.fromkeys((*path, edge)))
        return list(keep)

    def static_path(self, static: StaticIndex) -> list[str] | None:
        """The labels from a root to a static index (for diagnostics and tests)."""
        parents = {child: (parent, label) for parent, children in self._children.items()
                   for label, child in children.items()}
        labels: list[str] = []
        state = static
        while state in parents:
            state, label = parents[state]
            labels.append(label)
        return list(reversed(labels)) if state in (ROOT, DOLLAR_ROOT) else None


def folded_pattern(filter_levels: Sequence[str]) -> str:
    """The pattern of a folded level for the filter's levels from its depth on: the
    rest itself when they are all concrete, else `+` (any; the read checks)."""
    if any(level in (PLUS, "#") for level in filter_levels):
        return PLUS
    return "/".join(filter_levels)


def seed_edges(patterns: Iterable[str]) -> list[Edge]:
    """The edges of a seed structure: stream patterns (`fleet/north/+/temp`), each a
    path of literal and `+` levels ending in a stream, with the ids learning them
    would give. A trie that starts with them sends a level through `+` where the
    seed says so, and keeps the seed's literal levels literal."""
    found: dict[Edge, None] = {}
    for pattern in patterns:
        levels = pattern.split("/")
        state = root_for(levels[0])
        for label in [*levels, END]:
            edge = Edge(state, label, child_id(state, label))
            found[edge] = None
            state = edge.child
    return list(found)
