"""Layout `wildcard_optimized`: the bit-field layout of EMQX's configuration
(`emqx_ds_storage_bitfield_lts`, read for its shape).

One RocksDB entry per message. Its key is the stream's topic index, then one bit
field of `64 + varying levels x bits_per_topic_level` bits, padded with zero bits at
the end to whole bytes:

    topic index | epoch | hash of varying level 1 | ... | level n | time within epoch

The timestamp (64 bits, µs) is split in two: its low `epoch_bits` bits are the time
within the epoch, the rest is the epoch. Each varying level adds the top
`bits_per_topic_level` bits of its 8-byte blake2b hash. `topic_index_bytes` keeps
that many leading bytes of the 8-byte static index: fewer bytes make keys shorter,
but streams may then share a key prefix, so every entry read is checked to belong
to the stream (counted as a hash collision when it does not).

Within one epoch a stream's messages are grouped by their level hashes, so a filter
with concrete values at varying levels seeks to its groups and skips the others;
across groups the keys are not in timestamp order. Positions are timestamps, so a
read that spans groups (a wildcard read: `+` at a varying level) returns an epoch's
messages sorted by timestamp, and only once the epoch is closed: a closed epoch never
changes, so it is read and sorted once (the sorted remainder of a read cut short by
its batch size is kept for the next read), where an open one would be read and
sorted again at every poll as it grows. Wildcard readers of the current generation
therefore lag by up to one epoch, 2**epoch_bits µs (20 bits: ~1.05 s). A read of one
group (every varying level concrete, or none) is in timestamp order already and
reads up to the present."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter
from typing import Any

from rocksdict import ReadOptions

from ...topic import levels_match
from ..cache import BytesBoundedCache
from ..lts import DEFAULT_TOPIC_CACHE_BYTES, PLUS, STATIC_INDEX_BYTES, StaticIndex, TopicKey
from ..message import peek_timestamp, peek_topic
from ..rocks import after_prefix
from .base import KeyValueReader, ReadStats, StreamOf
from .wildcard_optimized_v2 import HASH_BYTES, level_hash

NAME = "wildcard_optimized"

TIMESTAMP_BITS = 64
DEFAULT_TOPIC_INDEX_BYTES = STATIC_INDEX_BYTES
DEFAULT_BITS_PER_TOPIC_LEVEL = HASH_BYTES * 8
DEFAULT_EPOCH_BITS = 20
# A key holds at most the whole of a stream's topic index and of a level's hash.
MAX_TOPIC_INDEX_BYTES = STATIC_INDEX_BYTES
MAX_BITS_PER_TOPIC_LEVEL = HASH_BYTES * 8
# 2**40 µs is ~12.7 days: wildcard readers would wait that long for an epoch to close.
MAX_EPOCH_BITS = 40

_Entry = tuple[int, bytes, bytes]  # (timestamp, key, stored message)
_BY_TIMESTAMP = itemgetter(0)


def topic_index_bytes_problem(value: int) -> str | None:
    if 1 <= value <= MAX_TOPIC_INDEX_BYTES:
        return None
    return (f"topic_index_bytes is {value}: a stream's topic index is {STATIC_INDEX_BYTES} "
            f"bytes, so a key holds 1 to {MAX_TOPIC_INDEX_BYTES} of them")


def bits_per_topic_level_problem(value: int) -> str | None:
    if 1 <= value <= MAX_BITS_PER_TOPIC_LEVEL:
        return None
    return (f"bits_per_topic_level is {value}: a level's hash is {HASH_BYTES * 8} bits, so "
            f"a key holds 1 to {MAX_BITS_PER_TOPIC_LEVEL} of them")


def epoch_bits_problem(value: int) -> str | None:
    if 1 <= value <= MAX_EPOCH_BITS:
        return None
    return (f"epoch_bits is {value}: the time within an epoch takes 1 to {MAX_EPOCH_BITS} "
            f"of the timestamp's {TIMESTAMP_BITS} bits (an epoch of 2**{MAX_EPOCH_BITS} µs "
            "is ~12.7 days, and wildcard readers wait for epochs to close)")


def option_problems(topic_index_bytes: int, bits_per_topic_level: int,
                    epoch_bits: int) -> list[str]:
    """What makes these sizes unable to hold a key, one sentence each (empty: fine)."""
    found = (topic_index_bytes_problem(topic_index_bytes),
             bits_per_topic_level_problem(bits_per_topic_level),
             epoch_bits_problem(epoch_bits))
    return [problem for problem in found if problem is not None]


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """The keys of the streams with `varying` varying levels. The bit field `f` is an
    int of `width` bits; its key bytes are `prefix + (f << pad)` in `size` bytes."""

    topic_index_bytes: int
    bits_per_level: int
    epoch_bits: int
    varying: int

    @property
    def hash_bits(self) -> int:
        return self.varying * self.bits_per_level

    @property
    def width(self) -> int:
        return TIMESTAMP_BITS + self.hash_bits

    @property
    def size(self) -> int:
        return (self.width + 7) // 8

    @property
    def pad(self) -> int:
        return self.size * 8 - self.width

    @property
    def epoch_shift(self) -> int:
        return self.hash_bits + self.epoch_bits

    @property
    def offset_mask(self) -> int:
        return (1 << self.epoch_bits) - 1

    def level_bits(self, level: str) -> int:
        return int.from_bytes(level_hash(level), "big") >> (HASH_BYTES * 8 - self.bits_per_level)

    def hashes(self, levels: tuple[str, ...]) -> int:
        """The hash part of the field for these varying levels, in place."""
        field = 0
        for level in levels:
            field = (field << self.bits_per_level) | self.level_bits(level)
        return field << self.epoch_bits

    def field(self, timestamp: int, hashes: int) -> int:
        return ((timestamp >> self.epoch_bits) << self.epoch_shift) | hashes \
            | (timestamp & self.offset_mask)

    def key(self, static: StaticIndex, field: int) -> bytes:
        return static[:self.topic_index_bytes] + (field << self.pad).to_bytes(self.size, "big")

    def field_of(self, key: bytes) -> int:
        return int.from_bytes(key[self.topic_index_bytes:], "big") >> self.pad

    def timestamp_of(self, field: int) -> int:
        return ((field >> self.epoch_shift) << self.epoch_bits) | (field & self.offset_mask)

    def mask(self, pattern: tuple[str, ...]) -> tuple[int, int]:
        """(mask, value) of the field bits a pattern fixes: its concrete levels."""
        mask = value = 0
        level_mask = (1 << self.bits_per_level) - 1
        for number, level in enumerate(pattern):
            if level != PLUS:
                shift = self.epoch_bits + (self.varying - 1 - number) * self.bits_per_level
                mask |= level_mask << shift
                value |= self.level_bits(level) << shift
        return mask, value


def encode_key(static: StaticIndex, varying: tuple[str, ...], timestamp: int, *,
               topic_index_bytes: int = DEFAULT_TOPIC_INDEX_BYTES,
               bits_per_topic_level: int = DEFAULT_BITS_PER_TOPIC_LEVEL,
               epoch_bits: int = DEFAULT_EPOCH_BITS) -> bytes:
    """The key of a message (pure; the layout caches the per-topic part)."""
    scheme = KeyScheme(topic_index_bytes, bits_per_topic_level, epoch_bits, len(varying))
    return scheme.key(static, scheme.field(timestamp, scheme.hashes(varying)))


def decode_key(key: bytes, varying: int, *,
               topic_index_bytes: int = DEFAULT_TOPIC_INDEX_BYTES,
               bits_per_topic_level: int = DEFAULT_BITS_PER_TOPIC_LEVEL,
               epoch_bits: int = DEFAULT_EPOCH_BITS) -> tuple[bytes, int, int, list[int]]:
    """(topic index, epoch, timestamp, level hash bits) of a key of a stream with
    `varying` varying levels."""
    scheme = KeyScheme(topic_index_bytes, bits_per_topic_level, epoch_bits, varying)
    field = scheme.field_of(key)
    level_mask = (1 << bits_per_topic_level) - 1
    hashes = [(field >> (epoch_bits + (varying - 1 - n) * bits_per_topic_level)) & level_mask
              for n in range(varying)]
    return (key[:topic_index_bytes], field >> scheme.epoch_shift, scheme.timestamp_of(field),
            hashes)


def next_matching(at_least: int, mask: int, value: int, width: int) -> int | None:
    """The smallest field >= `at_least` whose `mask` bits equal `value`, or None when
    there is none in `width` bits. The bits above the highest one that differs already
    match; raising that bit (or the free bits above it) gives the next candidate."""
    if at_least >> width:
        return None
    diff = (at_least ^ value) & mask
    if not diff:
        return at_least
    bit = diff.bit_length() - 1
    low = (1 << (bit + 1)) - 1
    if (value >> bit) & 1:  # a 0 where a 1 is wanted: set it, the free bits below to 0
        return (at_least & ~low) | (value & low)
    # a 1 where a 0 is wanted: count up in the free bits above it (the fixed bits set
    # to 1 so that the carry runs through them), then put the fixed bits back
    high_mask = mask >> (bit + 1)
    high = (((at_least >> (bit + 1)) | high_mask) + 1) & ~high_mask
    if high >> (width - bit - 1):
        return None
    return ((high | (value >> (bit + 1))) << (bit + 1)) | (value & low)


class WildcardOptimized:
    name = NAME

    def __init__(self, cache_bytes: int = DEFAULT_TOPIC_CACHE_BYTES, *,
                 topic_index_bytes: int = DEFAULT_TOPIC_INDEX_BYTES,
                 bits_per_topic_level: int = DEFAULT_BITS_PER_TOPIC_LEVEL,
                 epoch_bits: int = DEFAULT_EPOCH_BITS) -> None:
        problems = option_problems(topic_index_bytes, bits_per_topic_level, epoch_bits)
        if problems:
            raise ValueError("; ".join(problems))
        self.topic_index_bytes = topic_index_bytes
        self.bits_per_topic_level = bits_per_topic_level
        self.epoch_bits = epoch_bits
        # per topic name: its scheme and the hash part of its field, shifted for `pad`
        self._topic_parts: BytesBoundedCache[str, tuple[KeyScheme, int]] = \
            BytesBoundedCache(cache_bytes)
        # The sorted rest of a closed epoch a read did not return (empty when the read
        # ended with the epoch: the next one starts after it), with the epoch, under
        # (stream, pattern, filter, last timestamp returned). Reads may run on several
        # executor threads at once, hence the lock.
        self._tails: BytesBoundedCache[tuple[bytes, tuple[str, ...], str, int],
                                       tuple[int, list[_Entry]]] = BytesBoundedCache(cache_bytes)
        self._tails_lock = threading.Lock()
        self._schemes: dict[int, KeyScheme] = {}

    def scheme(self, varying: int) -> KeyScheme:
        scheme = self._schemes.get(varying)
        if scheme is None:
            scheme = self._schemes[varying] = KeyScheme(
                self.topic_index_bytes, self.bits_per_topic_level, self.epoch_bits, varying)
        return scheme

    def options(self) -> dict[str, Any]:
        return {"topic_index_bytes": self.topic_index_bytes,
                "bits_per_topic_level": self.bits_per_topic_level,
                "epoch_bits": self.epoch_bits}

    @property
    def epoch_us(self) -> int:
        """The length of an epoch: the most a wildcard reader lags the writers."""
        return 1 << self.epoch_bits

    def clear_cache(self) -> None:
        self._topic_parts.clear()

    # -- writing ------------------------------------------------------------------

    def encode(self, topic: str, key: TopicKey, timestamp: int,
               value: bytes) -> list[tuple[bytes, bytes]]:
        parts = self._topic_parts.get(topic)
        if parts is None:
            scheme = self.scheme(len(key.varying))
            parts = (scheme, scheme.hashes(key.varying) << scheme.pad)
            # the scheme is shared; the int is 8 bytes a level plus its header
            self._topic_parts.put(topic, parts, 40 + 36 + 8 * len(key.varying))
        scheme, hashes = parts
        pad = scheme.pad
        field = ((timestamp >> scheme.epoch_bits) << (scheme.epoch_shift + pad)) | hashes \
            | ((timestamp & scheme.offset_mask) << pad)
        return [(key.static[:self.topic_index_bytes] + field.to_bytes(scheme.size, "big"),
                 value)]

    # -- reading ------------------------------------------------------------------

    def read_one(self, data: KeyValueReader, static: StaticIndex,
                 timestamp: int) -> bytes | None:
        """Without the topic the level hashes are unknown: walk the stream's epoch of
        `timestamp` (every stream's field starts with the same 64 bits, epoch first)."""
        prefix = static[:self.topic_index_bytes]
        epoch = timestamp >> self.epoch_bits
        read_options = ReadOptions()
        read_options.set_iterate_upper_bound(
            prefix + ((epoch + 1) << self.epoch_bits).to_bytes(8, "big"))
        start = prefix + (epoch << self.epoch_bits).to_bytes(8, "big")
        for _key, value in data.items(from_key=start, read_opt=read_options):
            if isinstance(value, bytes) and peek_timestamp(value) == timestamp:
                return value
        return None

    def read(self, data: KeyValueReader, static: StaticIndex, pattern: tuple[str, ...],
             filter_levels: list[str], after: int, batch_size: int, stats: ReadStats,
             horizon: int | None = None,
             stream_of: StreamOf | None = None) -> list[tuple[bytes, bytes]]:
        scheme = self.scheme(len(pattern))
        mask, value = scheme.mask(pattern)
        wildcard = PLUS in pattern
        check = _Check(filter_levels, static,
                       stream_of if self.topic_index_bytes < STATIC_INDEX_BYTES else None,
                       checks_topic=mask != 0, stats=stats)
        if not pattern:
            return self._scan(data, static, scheme, after, batch_size, check)
        tail_key = (static, pattern, "/".join(filter_levels))
        found: list[_Entry] = []
        read_out: int | None = None  # an epoch the tail shows was returned to its end
        if wildcard:
            found, read_out = self._take_tail(tail_key, after, batch_size)
        if found:
            after = found[-1][0]
            stats.nexts += len(found)
        prefix = static[:self.topic_index_bytes]
        read_options = ReadOptions()
        upper = after_prefix(prefix)
        if upper is not None:
            read_options.set_iterate_upper_bound(upper)
        iterator = data.iter(read_options)
        # An epoch read to its end is not read again: with `+` levels each topic is a
        # group, and skipping a group's old entries takes a seek.
        next_epoch = (after + 1) >> self.epoch_bits if read_out is None else read_out + 1
        at_next = False
        while len(found) < batch_size:
            epoch = self._first_epoch(iterator, scheme, prefix, next_epoch, stats,
                                      seek=not at_next)
            if epoch is None:
                break
            room = batch_size - len(found)
            if wildcard and horizon is not None and (epoch + 1) << self.epoch_bits > horizon:
                if not found:
                    stats.wait_until = self._open_epoch_end(iterator, scheme, prefix, epoch,
                                                            mask, value, after, check)
                break
            entries, at_next = self._epoch(iterator, scheme, prefix, epoch, mask, value, after,
                                           room, wildcard, check)
            if wildcard and entries:
                entries.sort(key=_BY_TIMESTAMP)
                if len(entries) > room:  # the rest, for the next read
                    self._keep_tail(tail_key, entries[room - 1][0], epoch, entries[room:])
                    del entries[room:]
                    read_out = None
                else:
                    read_out = epoch
            found += entries
            next_epoch = epoch + 1
        if read_out is not None and found:
            # the last entry ends its epoch: the next read starts after it
            self._keep_tail(tail_key, found[-1][0], read_out, [])
        return [(key, stored) for _timestamp, key, stored in found]

    def _open_epoch_end(self, iterator: Any, scheme: KeyScheme, prefix: bytes, epoch: int,
                        mask: int, value: int, after: int, check: _Check) -> int | None:
        """When the reader must wait: the end of the first epoch from `epoch` (open)
        on that holds something for it; None when none does (the reader has caught
        up). Epochs past the open one exist only when timestamps ran ahead of the
        clock (a clash becomes last + 1)."""
        current: int | None = epoch
        while current is not None:
            found, at_next = self._epoch(iterator, scheme, prefix, current, mask, value, after,
                                         1, False, check)
            if found:
                return (current + 1) << self.epoch_bits
            current = self._first_epoch(iterator, scheme, prefix, current + 1, check.stats,
                                        seek=not at_next)
        return None

    def _scan(self, data: KeyValueReader, static: StaticIndex, scheme: KeyScheme, after: int,
              batch_size: int, check: _Check) -> list[tuple[bytes, bytes]]:
        """A stream without varying levels: its keys are `prefix | timestamp`, a range
        in timestamp order."""
        prefix = static[:self.topic_index_bytes]
        read_options = ReadOptions()
        upper = after_prefix(prefix)
        if upper is not None:
            read_options.set_iterate_upper_bound(upper)
        check.stats.seeks += 1
        items = data.items(from_key=prefix + (after + 1).to_bytes(8, "big"),
                           read_opt=read_options)
        if check.stream_of is None:  # the prefix is the whole static index: all ours
            found: list[tuple[bytes, bytes]] = list(islice(items, batch_size))
            check.stats.nexts += len(found)
            return found
        found = []
        size = len(prefix) + scheme.size
        for key, stored in items:
            check.stats.nexts += 1
            if len(key) == size and check.accepts(stored):
                found.append((key, stored))
                if len(found) >= batch_size:
                    break
        return found

    def _first_epoch(self, iterator: Any, scheme: KeyScheme, prefix: bytes, epoch: int,
                     stats: ReadStats, *, seek: bool = True) -> int | None:
        """The first epoch at or after `epoch` with a key of the stream (epochs with
        nothing are skipped in one seek). Without `seek`, the iterator already stands
        at or before that key, past everything earlier."""
        if seek:
            iterator.seek(prefix + (epoch << self.epoch_bits).to_bytes(8, "big"))
            stats.seeks += 1
        size = len(prefix) + scheme.size
        while iterator.valid():
            key = iterator.key()
            if len(key) == size:
                return int(int.from_bytes(key[len(prefix):len(prefix) + 8], "big")
                           >> self.epoch_bits)
            iterator.next()  # a stream sharing the topic index prefix, with other levels
            stats.nexts += 1
        return None

    def _epoch(self, iterator: Any, scheme: KeyScheme, prefix: bytes, epoch: int, mask: int,
               value: int, after: int, limit: int, read_all: bool,
               check: _Check) -> tuple[list[_Entry], bool]:
        """The entries of one epoch whose field matches (mask, value), with a
        timestamp after `after`, in key order; all of them with `read_all`, else up
        to `limit`. The iterator stands where `_first_epoch` left it. Also whether
        the iterator ends at the first key after the epoch (or the end), so the next
        epoch needs no seek: a `#` read of sparse streams would seek once an epoch."""
        stats = check.stats
        found: list[_Entry] = []
        size = len(prefix) + scheme.size
        width = scheme.width
        shift = scheme.epoch_shift
        offset_mask = scheme.offset_mask
        epoch_start = epoch << self.epoch_bits
        # a group's entries up to `after` are skipped by seeking to its `after + 1`
        skip_to = (after + 1) & offset_mask if (after + 1) >> self.epoch_bits == epoch else None
        target = next_matching(epoch << shift, mask, value, width)
        if target is None or target >> shift != epoch:
            return found, False
        if target != epoch << shift:  # else the iterator is there (see _first_epoch)
            iterator.seek(scheme.key(prefix, target))
            stats.seeks += 1
        while iterator.valid():
            key = iterator.key()
            if len(key) != size:  # another stream sharing the topic index prefix
                iterator.next()
                stats.nexts += 1
                continue
            field = int.from_bytes(key[len(prefix):], "big") >> scheme.pad
            if field >> shift != epoch:
                return found, True
            timestamp = epoch_start | (field & offset_mask)
            if field & mask != value or timestamp <= after:
                if field & mask != value:
                    target = next_matching(field, mask, value, width)
                elif skip_to is not None:
                    target = (field & ~offset_mask) | skip_to
                else:  # cannot happen: a whole epoch at or before `after` is not read
                    target = next_matching(field + 1, mask, value, width)
                if target is None or target >> shift != epoch:
                    return found, False
                iterator.seek(scheme.key(prefix, target))
                stats.seeks += 1
                continue
            stored = iterator.value()
            if check.accepts(stored):
                found.append((timestamp, key, stored))
                if not read_all and len(found) >= limit:
                    return found, False
            iterator.next()
            stats.nexts += 1
        return found, True

    def _take_tail(self, tail_key: tuple[bytes, tuple[str, ...], str], after: int,
                   batch_size: int) -> tuple[list[_Entry], int | None]:
        """Up to `batch_size` entries of the kept rest of an epoch after `after`, and
        that epoch when they are all of it (it is read out)."""
        with self._tails_lock:
            kept = self._tails.pop((*tail_key, after))
        if kept is None:
            return [], None
        epoch, tail = kept
        if len(tail) > batch_size:
            self._keep_tail(tail_key, tail[batch_size - 1][0], epoch, tail[batch_size:])
            return tail[:batch_size], None
        return tail, epoch

    def _keep_tail(self, tail_key: tuple[bytes, tuple[str, ...], str], last: int, epoch: int,
                   tail: list[_Entry]) -> None:
        # tuples and ints, plus the keys and messages (shared with nothing else now)
        size = 64 + sum(len(key) + len(stored) + 160 for _timestamp, key, stored in tail)
        with self._tails_lock:
            self._tails.put((*tail_key, last), (epoch, tail), size)


class _Check:
    """Whether an entry read is one the reader wants: its topic matches the filter
    (level hashes may collide) and, where streams share a key prefix, belongs to the
    stream. Each refusal is counted as a hash collision."""

    __slots__ = ("checks_topic", "filter_levels", "static", "stats", "stream_of")

    def __init__(self, filter_levels: list[str], static: StaticIndex,
                 stream_of: StreamOf | None, *, checks_topic: bool, stats: ReadStats) -> None:
        self.filter_levels = filter_levels
        self.static = static
        self.stream_of = stream_of
        self.checks_topic = checks_topic
        self.stats = stats

    def accepts(self, stored: bytes) -> bool:
        if not self.checks_topic and self.stream_of is None:
            return True
        topic = peek_topic(stored)
        if (self.checks_topic and not levels_match(self.filter_levels, topic.split("/"))) \
                or (self.stream_of is not None and self.stream_of(topic) != self.static):
            self.stats.hash_collisions += 1
            return False
        return True
