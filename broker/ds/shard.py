"""One shard of one database on this site: a RocksDB instance with a column-family
pair (data, trie) per generation and a metadata family for the generation table.

Methods that touch RocksDB block and are called from the storage's executor; the
in-memory state (tries, next timestamp) is only changed on the event loop, by
`prepare` and `apply`."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rocksdict import Checkpoint, Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from ..errors import CorruptDataError, GenerationError
from ..metrics import Tally
from .cooked import CookedBatch
from .generation import GenerationInfo
from .layouts import Layout, ReadStats, make_layout
from .lts import DEFAULT_TOPIC_CACHE_BYTES, UNBOUNDED, Edge, Trie, TrieBounds, seed_edges
from .message import Message, decode_message, encode_message
from .rocks import WalSync, after_prefix, as_bytes, raw_options

GENERATION_PREFIX = b"gen/"
_LAST_TIMESTAMP_KEY = b"last_timestamp"
# The seed structure (stream patterns) new generations start their trie with.
_TOPIC_SEED_KEY = b"topic_seed"
# The offset of the last shard log entry applied here (replicated sites only), kept in
# the same RocksDB write as what the entry changed, so a restart resumes after it.
_APPLIED_KEY = b"replication_applied"
# Records written with cooked batches live under this prefix of the metadata family.
RECORD_PREFIX = b"rec/"
_U64 = struct.Struct(">Q")


def now_us() -> int:
    return time.time_ns() // 1000


def _generation_key(generation_id: int) -> bytes:
    return GENERATION_PREFIX + b"%010d" % generation_id


def _stream_of(trie: Trie, topic: str) -> bytes | None:
    key = trie.lookup(topic.split("/"))
    return None if key is None else key.static


def _edge_key(edge: Edge) -> bytes:
    return edge.parent + edge.label.encode("utf-8")


def read_generation_table(db: Rdict) -> list[GenerationInfo]:
    """The generations a shard's RocksDB records, in id order. Blocking. Shared with
    the read-only snapshots of checkpoints (`snapshot.py`)."""
    found = []
    for key, raw in db.items(from_key=GENERATION_PREFIX):
        if not as_bytes(key).startswith(GENERATION_PREFIX):
            break
        found.append(GenerationInfo.from_json(as_bytes(raw)))
    return found


def read_trie(db: Rdict, info: GenerationInfo, thresholds: Sequence[int],
              cache_bytes: int = DEFAULT_TOPIC_CACHE_BYTES, bounds: TrieBounds = UNBOUNDED,
              folds: Tally | None = None) -> Trie:
    """The learned topic structure of one generation, from its trie family. Blocking."""
    trie = Trie(thresholds, cache_bytes, bounds, folds)
    for key, child in db.get_column_family(info.trie_column_family()).items():
        raw_key = as_bytes(key)
        trie.add_edge(Edge(raw_key[:8], raw_key[8:].decode("utf-8"), as_bytes(child)))
    return trie


def read_last_timestamp(db: Rdict) -> int:
    """The last timestamp a shard committed (0 before the first batch). Blocking."""
    stored = db.get(_LAST_TIMESTAMP_KEY)
    return int(_U64.unpack(stored)[0]) if stored is not None else 0


@dataclass(slots=True)
class Generation:
    info: GenerationInfo
    layout: Layout
    trie: Trie
    data: Rdict


def generation_bytes(db: Rdict, info: GenerationInfo, data: Rdict) -> int:
    """Bytes a generation holds in a shard's RocksDB `db`: table files and memtables of
    its data and trie families. Blocking."""
    total = 0
    for family in (data, db.get_column_family(info.trie_column_family())):
        for name in ("rocksdb.total-sst-files-size", "rocksdb.cur-size-all-mem-tables"):
            total += family.property_int_value(name) or 0
    return total


class Shard:
    """One shard's RocksDB instance and the state held beside it in memory (the
    generations with their tries, the next timestamp, the applied offset). Past ~300
    lines as one unit: every method reads or writes that instance with that state,
    often in one write batch (a generation made or dropped, a batch applied, each
    with the applied offset it records); a split would hand the handle and the
    state between classes that each own half of them."""

    def __init__(self, path: Path, shard_id: int, layout: str, layout_options: dict[str, object],
                 thresholds: Sequence[int], sync_writes: bool,
                 topic_cache_bytes: int = 2 * DEFAULT_TOPIC_CACHE_BYTES,
                 trie_bounds: TrieBounds = UNBOUNDED, folds: Tally | None = None,
                 replicated: bool = False) -> None:
        """Open (or create) the shard at `path`. Blocking. `topic_cache_bytes`
        bounds the topic caches of the current generation (half for the trie, half
        for the layout); `trie_bounds` what each generation's trie learns, `folds`
        counts the topics folded past them. `replicated`: batches are applied in the
        leader's log order, possibly long after they were cooked (see
        `settled_before`)."""
        self.path = path
        self.shard_id = shard_id
        self.thresholds = tuple(thresholds)
        self._cache_bytes = topic_cache_bytes // 2
        self._trie_bounds = trie_bounds
        self._folds = folds
        self._new_layout = (layout, dict(layout_options))
        make_layout(layout, dict(layout_options))  # fail early on a bad configuration
        path.mkdir(parents=True, exist_ok=True)
        existing = Rdict.list_cf(str(path), Options(raw_mode=True)) \
            if (path / "CURRENT").exists() else ["default"]
        self._db = Rdict(str(path), raw_options(create_missing_column_families=True),
                         column_families={name: Options(raw_mode=True) for name in existing
                                          if name != "default"})
        self.sync_writes = sync_writes
        # No write is `sync=True`: a durable one is synced after it (`WalSync`).
        self._write_options = WriteOptions()
        # For writes on the event loop: RocksDB refuses (rather than waits) when the
        # write would stall behind compaction, and the caller retries off the loop.
        self._no_stall_options = WriteOptions()
        self._no_stall_options.no_slowdown = True
        self._wal = WalSync()
        self.generations: dict[int, Generation] = {}
        self._load_generations(existing)
        self.last_timestamp = read_last_timestamp(self._db)
        stored_seed = self._db.get(_TOPIC_SEED_KEY)
        self.topic_seed: tuple[str, ...] = tuple(json.loads(as_bytes(stored_seed))) \
            if stored_seed is not None else ()
        self._next_timestamp = self.last_timestamp + 1
        # first timestamp of a batch cooked but not yet written and applied
        self._unsettled_from: int | None = None
        stored_applied = self._db.get(_APPLIED_KEY)
        self.applied_offset = int(_U64.unpack(as_bytes(stored_applied))[0]) \
            if stored_applied is not None else 0
        self.replicated = replicated
        if not self.generations:
            self._create_generation(previous=None)

    # -- generations --------------------------------------------------------------

    def _load_generations(self, column_families: list[str]) -> None:
        for info in read_generation_table(self._db):
            self.generations[info.id] = self._open_generation(info)
        known = {name for g in self.generations.values()
                 for name in (g.info.data_column_family(), g.info.trie_column_family())}
        # Families left behind by a crash between creating them and recording the
        # generation (or between forgetting it and dropping them).
        for name in column_families:
            if name != "default" and name not in known:
                self._db.drop_column_family(name)

    def _open_generation(self, info: GenerationInfo) -> Generation:
        trie = read_trie(self._db, info, self.thresholds, self._cache_bytes,
                         self._trie_bounds, self._folds)
        return Generation(info, make_layout(info.layout, dict(info.layout_options),
                                            self._cache_bytes), trie,
                          self._db.get_column_family(info.data_column_family()))

    @property
    def current(self) -> Generation:
        return self.generations[max(self.generations)]

    def _create_generation(self, previous: Generation | None, at: int | None = None,
                           seed: Sequence[str] | None = None,
                           applied: int | None = None) -> GenerationInfo:
        if at is None:
            at = max(now_us(), self.last_timestamp + 1)
        new_id = previous.info.id + 1 if previous else 1
        layout, layout_options = self._new_layout
        # every option recorded, defaults included: a later default must not change
        # how this generation's keys are read
        recorded = make_layout(layout, layout_options).options()
        info = GenerationInfo(new_id, layout, recorded, created_at=at, since=at)
        for name in (info.data_column_family(), info.trie_column_family()):
            self._db.create_column_family(name, Options(raw_mode=True))
        inherited = previous.trie.wildcard_paths() if previous else []
        inherited += seed_edges(self.topic_seed if seed is None else tuple(seed))
        batch = WriteBatch(raw_mode=True)
        trie_family = self._db.get_column_family_handle(info.trie_column_family())
        for edge in inherited:
            batch.put(_edge_key(edge), edge.child, trie_family)
        if previous is not None:
            previous.info = previous.info.closed(at)
            previous.trie.clear_cache()
            previous.layout.clear_cache()
            batch.put(_generation_key(previous.info.id), previous.info.to_json())
        batch.put(_generation_key(info.id), info.to_json())
        if applied is not None:
            batch.put(_APPLIED_KEY, _U64.pack(applied))
        self._write(batch, self.sync_writes)
        generation = self._open_generation(info)
        self.generations[info.id] = generation
        # after the generation is in the table: a reader on another thread that sees
        # the entry applied sees the generation too
        if applied is not None:
            self.applied_offset = applied
        return info

    def set_topic_seed(self, patterns: Sequence[str], applied: int | None = None) -> None:
        """Keep a seed structure for the generations created from now on (see
        `lts.seed_edges`); an empty one ends seeding. Blocking. A replica applying a
        log entry gives its offset to record as applied."""
        batch = WriteBatch(raw_mode=True)
        batch.put(_TOPIC_SEED_KEY, json.dumps(list(patterns)).encode())
        if applied is not None:
            batch.put(_APPLIED_KEY, _U64.pack(applied))
        self._write(batch, durable=True)
        # kept once written, and before the entry is known as applied
        self.topic_seed = tuple(patterns)
        if applied is not None:
            self.applied_offset = applied

    def add_generation(self, at: int | None = None, seed: Sequence[str] | None = None,
                       applied: int | None = None) -> GenerationInfo:
        """Close the current generation and start a new one. Blocking. A replica
        applying a log entry gives the leader's start time and topic seed, and the
        entry's offset to record as applied."""
        return self._create_generation(self.current, at, seed, applied)

    def detach_generation(self, generation_id: int) -> Generation:
        """Take a closed generation out of the table, so no new read starts on it.
        The caller waits for reads in flight, then calls `destroy_generation`."""
        generation = self.generations.get(generation_id)
        if generation is None:
            raise GenerationError(f"shard {self.shard_id} has no generation {generation_id}")
        if generation.info.is_current:
            raise GenerationError(
                f"generation {generation_id} of shard {self.shard_id} is current; "
                "add a generation before dropping it")
        del self.generations[generation_id]
        return generation

    def destroy_generation(self, generation: Generation, applied: int | None = None) -> None:
        """Forget a detached generation on disk and drop its data. Blocking."""
        # Synced whatever `sync_writes` says: if power failed after the families were
        # dropped but before an unsynced delete reached the disk, the generation
        # would come back without its data.
        batch = WriteBatch(raw_mode=True)
        batch.delete(_generation_key(generation.info.id))
        self._write_applied(batch, applied, durable=True)
        generation.data.close()
        for name in (generation.info.data_column_family(), generation.info.trie_column_family()):
            self._db.drop_column_family(name)

    def drop_generation(self, generation_id: int) -> None:
        """Detach and destroy at once, for callers with no concurrent readers."""
        self.destroy_generation(self.detach_generation(generation_id))

    # -- writing ------------------------------------------------------------------

    def prepare(self, messages: Sequence[Message],
                record_puts: Sequence[tuple[bytes, bytes]] = (),
                record_deletes: Sequence[bytes] = ()) -> CookedBatch:
        """Cook a batch: timestamps, learned topic structure, encoded keys. Changes
        only memory; `write` makes it durable. Call `forget` if the write fails."""
        generation = self.current
        layout = generation.layout
        trie = generation.trie
        learned: list[Edge] = []
        entries: list[tuple[bytes, bytes]] = []
        cooked_messages: list[tuple[bytes, Message]] = []
        # Unsettled before the clock is read: a reader's thread may ask `settled_before`
        # between two lines here, and the batch's timestamps are at least this one.
        if self._unsettled_from is None:
            self._unsettled_from = self._next_timestamp
        timestamp = max(now_us(), self._next_timestamp)
        payload_bytes = 0
        for message in messages:
            # topics were validated when the batch was submitted
            key = trie.key_of_topic(message.topic, learned)
            message.timestamp = timestamp
            entries += layout.encode(message.topic, key, timestamp, encode_message(message))
            cooked_messages.append((key.static, message))
            payload_bytes += len(message.payload)
            timestamp += 1
        self._next_timestamp = timestamp
        return CookedBatch(self.shard_id, generation.info.id, timestamp - 1, len(messages),
                           payload_bytes, entries, learned,
                           [(RECORD_PREFIX + key, value) for key, value in record_puts],
                           [RECORD_PREFIX + key for key in record_deletes], cooked_messages)

    def forget(self, cooked: CookedBatch) -> None:
        """Undo what `prepare` learned, after its write failed (or its log entry was
        cut). Topics may map to other keys without those edges: the layout's
        per-topic cache goes with the trie's."""
        self._unsettled_from = None
        generation = self.generations.get(cooked.generation)
        if generation is not None and cooked.edges:
            generation.trie.remove_edges(cooked.edges)
            generation.layout.clear_cache()

    def write(self, cooked: CookedBatch, *, no_stall: bool = False,
              applied: int | None = None) -> None:
        """Write a cooked batch, data and trie in one atomic RocksDB batch. Blocking.
        Writing the same cooked batch again is harmless. With `no_stall`, a write that
        RocksDB would delay (write stall) raises instead of waiting. `applied`: the
        shard log offset of the batch (replicated sites), recorded in the same write;
        the shard is known to have applied it once `apply` brought its memory in line
        too (`apply(cooked, applied)`): a reader that waits for the offset reads the
        batch's streams then, which a replica learns from its edges there."""
        generation = self.generations.get(cooked.generation)
        if generation is None:
            raise GenerationError(
                f"shard {self.shard_id} has no generation {cooked.generation} to write to")
        batch = WriteBatch(raw_mode=True)
        data_family = self._db.get_column_family_handle(generation.info.data_column_family())
        for key, value in cooked.entries:
            batch.put(key, value, data_family)
        if cooked.edges:
            trie_family = self._db.get_column_family_handle(generation.info.trie_column_family())
            for edge in cooked.edges:
                batch.put(_edge_key(edge), edge.child, trie_family)
        for key, value in cooked.record_puts:
            batch.put(key, value)
        for key in cooked.record_deletes:
            batch.delete(key)
        batch.put(_LAST_TIMESTAMP_KEY,
                  _U64.pack(max(self.last_timestamp, cooked.last_timestamp)))
        if applied is not None:
            batch.put(_APPLIED_KEY, _U64.pack(applied))
        self._write(batch, self.sync_writes, no_stall)

    def record_applied(self, applied: int) -> None:
        """Record a log entry that changes no data (a no-op) as applied. Blocking."""
        batch = WriteBatch(raw_mode=True)
        self._write_applied(batch, applied, self.sync_writes)

    def sync_applied(self) -> int:
        """The applied offset, made durable first: without `sync_writes` the writes
        that recorded it may still sit unsynced in RocksDB's log, and a power loss
        would take them back. Blocking (one fdatasync of the log)."""
        applied = self.applied_offset  # set only once its write returned: in the log
        if not self.sync_writes:
            self._sync_wal()
        return applied

    def _write_applied(self, batch: WriteBatch, applied: int | None, durable: bool,
                       no_stall: bool = False) -> None:
        """Write `batch`, with the log offset it applies (a replica applying an entry)
        recorded in it, and known as applied only once written. Blocking."""
        if applied is not None:
            batch.put(_APPLIED_KEY, _U64.pack(applied))
        self._write(batch, durable, no_stall)
        if applied is not None:
            self.applied_offset = applied

    def _write(self, batch: WriteBatch, durable: bool, no_stall: bool = False) -> None:
        """Write `batch`; `durable`: on disk before this returns (what is written is
        readable a moment before it is synced, as with RocksDB's SyncWAL, which no
        reader takes for durable). `no_stall`: refused rather than delayed by a write
        stall. Blocking."""
        self._db.write(batch, self._no_stall_options if no_stall else self._write_options)
        if durable:
            self._sync_wal()

    def _sync_wal(self) -> None:
        self._wal.sync(self._db)

    def messages_of(self, cooked: CookedBatch) -> list[tuple[bytes, Message]]:
        """The messages of an applied batch with the static index of each one's stream:
        what a replica feeds its subscribers (the leader's cooked batch carries them,
        a replica's decoded one does not). Entries with no value are index entries of
        layouts that keep them."""
        generation = self.generations.get(cooked.generation)
        if generation is None:
            return []
        found = []
        for _key, value in cooked.entries:
            if not value:
                continue
            message = decode_message(value)
            static = _stream_of(generation.trie, message.topic)
            if static is not None:
                found.append((static, message))
        return found

    def apply(self, cooked: CookedBatch, applied: int | None = None) -> None:
        """Bring memory in line with a written cooked batch (a replica learns the
        leader's edges here; on the leader they are already known); `applied`: the log
        offset `write` recorded with it, known as applied from now on."""
        generation = self.generations.get(cooked.generation)
        if generation is not None:
            for edge in cooked.edges:
                generation.trie.add_edge(edge)
        self.last_timestamp = max(self.last_timestamp, cooked.last_timestamp)
        self._next_timestamp = max(self._next_timestamp, self.last_timestamp + 1)
        self._unsettled_from = None
        if applied is not None:
            self.applied_offset = applied

    def commit(self, cooked: CookedBatch) -> None:
        """Write and apply: what a replica does with a batch the leader cooked."""
        self.write(cooked)
        self.apply(cooked)

    # -- reading ------------------------------------------------------------------

    def read(self, generation_id: int, static: bytes, pattern: tuple[str, ...],
             filter_levels: list[str], after: int, batch_size: int,
             stats: ReadStats) -> list[tuple[bytes, bytes]] | None:
        """Read one stream; None when the generation no longer exists. Blocking."""
        generation = self.generations.get(generation_id)
        if generation is None:
            return None
        horizon = self.settled_before() if generation.info.is_current else None
        return generation.layout.read(generation.data, static, pattern, filter_levels, after,
                                      batch_size, stats, horizon,
                                      partial(_stream_of, generation.trie))

    def settled_before(self) -> int:
        """Every message of this shard with a timestamp below this one is written and
        visible to a read started now, or will never exist: later batches take
        timestamps from the clock and past the last one, and the batch being written
        (the buffer writes one at a time) starts at `_unsettled_from`. A replica
        applying a leader's batches needs the leader's order instead: with
        `replicated`, batches are applied in log order, so everything up to the last
        timestamp applied is there, and nothing before it can come later."""
        if self.replicated:
            return self.last_timestamp + 1
        now = now_us()
        return now if self._unsettled_from is None else min(now, self._unsettled_from)

    def get_record(self, key: bytes) -> bytes | None:
        """One record (see CookedBatch.record_puts). Blocking."""
        value = self._db.get(RECORD_PREFIX + key)
        return None if value is None else as_bytes(value)

    def get_records(self, keys: list[bytes]) -> list[bytes | None]:
        """Several records in one call (None where there is none). Blocking."""
        if not keys:
            return []
        values = self._db.get([RECORD_PREFIX + key for key in keys])
        if not isinstance(values, list):  # rocksdict answers a list of keys with a list
            raise CorruptDataError(f"multi-get returned {type(values)}")
        return [None if value is None else as_bytes(value) for value in values]

    def scan_records(self, prefix: bytes, limit: int = 1_000_000,
                     after: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """Up to `limit` records whose key starts with `prefix` (and comes after
        `after`, for the next page), without the internal prefix, in key order.
        Blocking."""
        start = RECORD_PREFIX + prefix
        read_options = ReadOptions()
        upper = after_prefix(start)
        if upper is not None:
            read_options.set_iterate_upper_bound(upper)
        from_key = start if after is None else max(start, RECORD_PREFIX + after)
        found: list[tuple[bytes, bytes]] = []
        for key, value in self._db.items(from_key=from_key, read_opt=read_options):
            if len(found) >= limit:
                break
            record_key = as_bytes(key)[len(RECORD_PREFIX):]
            if after is not None and record_key <= after:
                continue
            found.append((record_key, as_bytes(value)))
        return found

    def generation_bytes(self, generation: Generation) -> int:
        """Bytes a generation holds: table files and memtables of its families.
        Blocking."""
        return generation_bytes(self._db, generation.info, generation.data)

    def gc_write(self, generation_id: int, deletes: Sequence[bytes],
                 record_puts: Sequence[tuple[bytes, bytes]] = (),
                 applied: int | None = None) -> None:
        """Delete data entries of a closed generation and put records, in one atomic,
        synced batch (generation GC); records alone need no generation. Blocking; the
        caller holds the shard's lock. A replica applying a log entry gives its offset
        to record as applied."""
        batch = WriteBatch(raw_mode=True)
        if deletes:
            generation = self.generations.get(generation_id)
            if generation is None:
                raise GenerationError(f"shard {self.shard_id} has no generation "
                                      f"{generation_id}")
            if generation.info.is_current:
                raise GenerationError(f"generation {generation_id} of shard {self.shard_id} "
                                      "is current; GC never rewrites the current generation")
            family = self._db.get_column_family_handle(generation.info.data_column_family())
            for key in deletes:
                batch.delete(key, family)
        for key, value in record_puts:
            batch.put(RECORD_PREFIX + key, value)
        self._write_applied(batch, applied, durable=True)

    def compact_generation(self, generation_id: int) -> None:
        """Flush and compact a generation's data, so deleted entries free their space.
        Blocking."""
        generation = self.generations.get(generation_id)
        if generation is not None:
            generation.data.flush()
            generation.data.compact_range(None, None)

    def checkpoint(self, path: Path) -> None:
        """A consistent copy of this shard's RocksDB at `path` (which must not exist):
        hard links to its table files and a flushed memtable. Blocking; the caller
        holds the shard's lock so no batch or generation change lands halfway."""
        Checkpoint(self._db).create_checkpoint(str(path))

    def disk_usage(self) -> int:
        total = 0
        for entry in os.scandir(self.path):
            # compaction deletes files while we look: a vanished file counts as 0
            with contextlib.suppress(FileNotFoundError):
                if entry.is_file():
                    total += entry.stat().st_size
        return total

    def close(self) -> None:
        for generation in self.generations.values():
            generation.data.close()
        self.generations.clear()
        self._wal.close(self._db)

