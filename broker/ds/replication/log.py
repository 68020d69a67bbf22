"""The replicated log of one shard on one site: cooked batches at (epoch, offset).

The leader of a shard appends each cooked batch it makes at the next offset, under its
leader epoch; followers append what they fetch from it. An entry is applied to the
shard's data only once committed (held durably by a majority of the replica set, see
`commit.py`), so an entry that a new leader does not have can be cut off a follower's
log without anything to undo. Like Raft's log, minus elections: the controller picks
leaders and bumps epochs (docs/replication.md, "The shard log").

On disk: one raw-mode RocksDB per shard log, every write synced but the leader's own
appends, which it ships to its followers while it syncs them (`sync`; `durable` says
how far the log is on disk, and the leader counts itself towards a majority only that
far). Keys are the offsets
(8 bytes, big-endian, so RocksDB keeps them in order); values are the entry's epoch
(8 bytes) and the cooked batch's bytes. Offsets start at 1; offset 0 at epoch 0 is the
empty log's position. Entries below `first_offset` have been trimmed (every replica
applied them).

In memory: the newest entries written (`RECENT_ENTRIES`, `RECENT_BYTES` at most), so
that a leader ships an entry to followers right behind it, and applies it, without
reading it back from RocksDB on the executor (`read_in_memory`)."""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from rocksdict import Rdict, WriteBatch, WriteOptions

from ...errors import CorruptDataError, StorageError
from .. import metrics
from ..rocks import WalSync, as_bytes, raw_options

log = logging.getLogger(__name__)

_U64 = struct.Struct(">Q")
_POSITION = struct.Struct(">QQ")
_ENTRY_PREFIX = b"e"
_EPOCH_KEY = b"m:epoch"  # the highest leader epoch this log has seen
_FIRST_KEY = b"m:trimmed"  # the position of the last entry trimmed
_LAST_KEY = _ENTRY_PREFIX + b"\xff" * 8  # after every entry key
# The newest entries a log keeps in memory: a follower right behind its leader reads
# them from there. A few flushes' worth; every replica on a site holds its own.
RECENT_ENTRIES = 64
RECENT_BYTES = 256 * 1024


class Position(NamedTuple):
    """Where an entry sits: tuples order by epoch, then offset, which is how a
    failover compares the replicas' last positions."""

    epoch: int
    offset: int


START = Position(0, 0)


class StaleEpochError(StorageError):
    """An append from a leader of an older epoch than this log has seen: that leader
    has been replaced, and must stop (not recoverable for it)."""


class LogGapError(StorageError):
    """An append or read past what the log holds."""


class CommittedCutError(CorruptDataError):
    """A cut of entries this log knows committed (a new leader's log lacks them, or a
    truncate below the commit offset): refused, counted and logged, since applying
    the replacement would make this replica differ from the others silently."""


class BootstrapNeededError(StorageError):
    """A read of entries this log has trimmed: whoever needs them must start from a
    checkpoint of the shard (see `bootstrap.py`), then read the log from there."""

    recoverable = True

    def __init__(self, message: str, first_offset: int) -> None:
        super().__init__(message)
        self.first_offset = first_offset


@dataclass(frozen=True, slots=True)
class Entry:
    position: Position
    batch: bytes


@dataclass(frozen=True, slots=True)
class AppendResult:
    """A follower's answer to an append. When `accepted` is False the leader's
    `previous` position is not in this log: the leader retries from `retry_from`
    (the first offset whose entry may differ), sending entries from there."""

    accepted: bool
    # the offset up to which this log now equals the leader's (when accepted)
    matched: int
    last: Position
    retry_from: int = 0


class Recent(NamedTuple):
    """Entries held in memory, in order, following the entry at `previous`; `size`:
    the bytes of their batches."""

    previous: Position
    entries: tuple[Entry, ...]
    size: int = 0


def _entry_key(offset: int) -> bytes:
    return _ENTRY_PREFIX + _U64.pack(offset)


def _entry(key: bytes, value: bytes) -> Entry:
    """The entry stored under an entry key: its value is its epoch, then the batch."""
    (offset,) = _U64.unpack_from(key, len(_ENTRY_PREFIX))
    (epoch,) = _U64.unpack_from(value)
    return Entry(Position(epoch, offset), value[_U64.size:])


class ShardLog:
    def __init__(self, path: Path, labels: tuple[str, str] = ("", "")) -> None:
        """`labels`: the database and shard, for the metrics."""
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._cuts_refused = metrics.LOG_CUTS_REFUSED.labels(*labels)
        self._db = Rdict(str(path), raw_options())
        self._unsynced = WriteOptions()
        # An append on the event loop: refused (rather than delayed) by a write stall
        self._unsynced_no_stall = WriteOptions()
        self._unsynced_no_stall.no_slowdown = True
        self._epoch = self._read_u64(_EPOCH_KEY)
        # The epoch this log knew when this process opened it: a site named leader of
        # it or an older one led it before it (re)started (an epoch has one leader),
        # and may have lost appends of it that its followers hold (`Takeover`).
        self.epoch_at_open = self._epoch
        trimmed = self._db.get(_FIRST_KEY)
        # the first offset held, and the position of the trimmed entry just before it
        self._before_first = START if trimmed is None else Position(
            *_POSITION.unpack(as_bytes(trimmed)))
        self._last = self._find_last()
        # The newest entries, ending at `_last`. Replaced whole on every change (never
        # changed in place): a reader on the event loop takes it once and sees one
        # state, while the executor writes the log. Writers set it before `_last`, and
        # readers read `_last` first (`Leadership.request_from_memory`), so a reader
        # never pairs a newer end with older entries.
        self._recent = Recent(self._last, ())
        # The offset up to which this log is on disk: its end, but for a leader's
        # appends written unsynced and not synced yet.
        self._durable = self._last.offset
        self._wal = WalSync()
        # Known committed, so safe to apply to the shard's data. Learnt again from the
        # leader after a restart (what was applied is the shard's to remember).
        self._committed = self._before_first.offset
        # What the shard's leader last said may be trimmed (entries before it): a
        # follower trims no further, so that it can serve them if it leads next.
        self.leader_trims_before = 0
        # Whether a leader's append has brought this log, since it was opened, up to
        # what that leader had committed when it sent: a restarted follower is not
        # ready (its site's /readyz) until then, so that a roll stops no next site
        # while this one still lacks entries a majority needs (issue 21).
        self.caught_up = False

    # -- reading ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The highest leader epoch this log has seen; appends of older ones are refused."""
        return self._epoch

    @property
    def last(self) -> Position:
        return self._last

    @property
    def durable(self) -> int:
        """The offset up to which this log's entries are on disk (synced)."""
        return self._durable

    @property
    def committed(self) -> int:
        """The offset up to which this log's entries are known to be committed: what
        a replica may apply to the shard's data."""
        return self._committed

    def commit_to(self, offset: int) -> None:
        """The leader's own commit offset (see `Leadership`)."""
        self._committed = max(self._committed, min(offset, self._last.offset))

    @property
    def first_offset(self) -> int:
        """The first offset still held (entries before it are trimmed)."""
        return self._before_first.offset + 1

    def epoch_at(self, offset: int) -> int | None:
        """The epoch of the entry at `offset`; 0 for offset 0; None when not held
        (beyond the end, or trimmed)."""
        if offset == 0:
            return 0
        if offset == self._before_first.offset:
            return self._before_first.epoch
        if offset == self._last.offset:
            return self._last.epoch
        recent = self._recent
        index = offset - recent.previous.offset - 1
        if 0 <= index < len(recent.entries):
            return recent.entries[index].position.epoch
        raw = self._db.get(_entry_key(offset))
        return None if raw is None else _U64.unpack_from(as_bytes(raw))[0]

    def read(self, from_offset: int, max_entries: int = 1000,
             max_bytes: int = 4 * 1024 * 1024) -> list[Entry]:
        """Entries from `from_offset` on, at most `max_entries` and about `max_bytes`
        (always at least one when there is one)."""
        recent = self.read_in_memory(from_offset, max_entries, max_bytes)
        if recent is not None:
            return list(recent.entries)
        return self.read_stored(from_offset, max_entries, max_bytes)

    def read_stored(self, from_offset: int, max_entries: int = 1000,
                    max_bytes: int = 4 * 1024 * 1024) -> list[Entry]:
        """`read` from RocksDB, not from the newest entries in memory."""
        if from_offset < self.first_offset:
            raise BootstrapNeededError(
                f"{self.path}: entries before offset {self.first_offset} are trimmed (asked "
                f"from {from_offset}): bootstrap from a checkpoint", self.first_offset)
        entries: list[Entry] = []
        size = 0
        iterator = self._db.iter()
        iterator.seek(_entry_key(from_offset))
        while iterator.valid() and len(entries) < max_entries and (not entries or
                                                                    size < max_bytes):
            key = as_bytes(iterator.key())
            if not key.startswith(_ENTRY_PREFIX):
                break
            entry = _entry(key, as_bytes(iterator.value()))
            entries.append(entry)
            size += _U64.size + len(entry.batch)
            iterator.next()
        del iterator
        return entries

    def read_in_memory(self, from_offset: int, max_entries: int = 1000,
                       max_bytes: int = 4 * 1024 * 1024) -> Recent | None:
        """What `read` returns, with the position of the entry before it, when this
        log holds that entry and those after it in memory (the newest entries: see
        RECENT_ENTRIES); None when it must be read from disk (`read`, on the
        executor). Safe on the event loop while the executor writes the log: it
        reads the newest entries as of one moment."""
        recent = self._recent
        index = from_offset - recent.previous.offset - 1
        if index < 0:
            return None
        if index == 0:
            previous = recent.previous
        elif index <= len(recent.entries):
            previous = recent.entries[index - 1].position
        else:  # past the end (rare): as on disk
            return None
        entries: list[Entry] = []
        size = 0  # of the batches, as `Recent.size`; `max_bytes` counts epochs too, as `read`
        for entry in recent.entries[index:]:
            if len(entries) >= max_entries or (
                    entries and size + _U64.size * len(entries) >= max_bytes):
                break
            entries.append(entry)
            size += len(entry.batch)
        return Recent(previous, tuple(entries), size)

    def _remember(self, written: list[Entry]) -> None:
        """`written` follow the newest entries kept in memory (at the log's end): the
        oldest kept go past RECENT_ENTRIES and RECENT_BYTES."""
        recent = self._recent
        kept = recent.entries + tuple(written)
        size = recent.size + sum(len(entry.batch) for entry in written)
        previous, drop = recent.previous, 0
        while drop < len(kept) and (len(kept) - drop > RECENT_ENTRIES
                                    or size > RECENT_BYTES):
            size -= len(kept[drop].batch)
            previous = kept[drop].position
            drop += 1
        self._recent = Recent(previous, kept[drop:], size)

    def _forget_after(self, last: Position) -> None:
        """The log now ends at `last` (a cut): entries after it leave memory."""
        recent = self._recent
        if recent.previous.offset >= last.offset:
            self._recent = Recent(last, ())
            return
        kept = tuple(entry for entry in recent.entries if entry.position.offset <= last.offset)
        self._recent = Recent(recent.previous, kept, sum(len(entry.batch) for entry in kept))

    def _forget_before(self, before: Position) -> None:
        """Entries up to `before` are trimmed: they leave memory too."""
        recent = self._recent
        if recent.previous.offset >= before.offset:
            return
        kept = tuple(entry for entry in recent.entries if entry.position.offset > before.offset)
        self._recent = Recent(before, kept, sum(len(entry.batch) for entry in kept))

    # -- writing ------------------------------------------------------------------

    def observe_epoch(self, epoch: int) -> None:
        """Remember that a leader of `epoch` exists (pushed by the controller, or seen
        in an append): from now on older leaders are refused."""
        if epoch < self._epoch:
            raise StaleEpochError(f"epoch {epoch} is older than this log's {self._epoch}")
        if epoch > self._epoch:
            self._db.put(_EPOCH_KEY, _U64.pack(epoch), self._unsynced)
            self._sync_wal()
            self._epoch = epoch
            self._synced_to_end()

    def append_as_leader(self, epoch: int, batches: list[bytes], sync: bool = True,
                         no_stall: bool = False) -> list[Position]:
        """The leader's own append: each batch at the next offset, under `epoch`.
        `sync=False`: written, not yet on disk (`durable` stays) until `sync`.
        `no_stall` (unsynced, on the event loop): an append RocksDB would delay raises
        instead, with nothing written."""
        self.observe_epoch(epoch)
        if self._last.epoch > epoch:
            raise StaleEpochError(f"the log ends at epoch {self._last.epoch}, "
                                  f"after leader epoch {epoch}")
        write = WriteBatch(raw_mode=True)
        positions = []
        offset = self._last.offset
        for batch in batches:
            offset += 1
            write.put(_entry_key(offset), _U64.pack(epoch) + batch)
            positions.append(Position(epoch, offset))
        self._db.write(write, self._unsynced_no_stall if no_stall else self._unsynced)
        if sync:
            self._sync_wal()
        if positions:
            self._remember([Entry(position, batch) for position, batch in zip(positions, batches,
                                                                         strict=True)])
            self._last = positions[-1]
        if sync:
            self._synced_to_end()
        return positions

    def sync(self) -> None:
        """Put every entry written so far on disk (`durable` then reaches them). Like
        every write of the log, under its lock (`PeerServer.lock`). Nothing once
        closed (a leader's sync that its site's stop overtook)."""
        self._sync_wal()
        self._synced_to_end()

    def _write_durably(self, write: WriteBatch) -> None:
        """Write `write` and put it on disk, not as one write with `sync=True`
        (`WalSync`: a follower's appends held the GIL about half its busy time that
        way). What is written is in the log a moment before it is on disk (RocksDB's
        SyncWAL), which nobody reads as durable: `durable` moves after."""
        self._db.write(write, self._unsynced)
        self._sync_wal()

    def _sync_wal(self) -> None:
        self._wal.sync(self._db)

    def _synced_to_end(self) -> None:
        """A synced write is done: it put everything written before it on disk."""
        self._durable = self._last.offset

    def append_from_leader(self, epoch: int, previous: Position, entries: list[Entry],
                           committed: int = 0) -> AppendResult:
        """A follower's append of what the leader of `epoch` sent: `entries` follow
        the leader's entry at `previous`, offset by offset. Entries this log already
        holds are kept; at the first that differs (same offset, other epoch) this
        log's tail is cut and the leader's entries are written in its place.
        `committed` is the leader's commit offset: this log's `committed` follows it
        as far as the entries are known to be the leader's."""
        self.observe_epoch(epoch)
        if not self._holds(previous):
            return AppendResult(False, previous.offset, self._last,
                                self._retry_from(previous.offset))
        expected = previous.offset + 1
        for entry in entries:
            if entry.position.offset != expected:
                raise LogGapError(f"leader sent offset {entry.position.offset}, "
                                  f"expected {expected}")
            if entry.position.epoch > epoch:
                raise CorruptDataError(f"entry of epoch {entry.position.epoch} from a "
                                       f"leader of epoch {epoch}")
            expected += 1
        matched = previous.offset + len(entries)
        held = [entry for entry in entries if entry.position.offset >= self.first_offset]
        # every entry from the first that differs on: after the tail is cut there, one
        # that happens to match (two leaders at one epoch) must be written again too
        differs = next((number for number, entry in enumerate(held)
                        if self.epoch_at(entry.position.offset) != entry.position.epoch),
                       len(held))
        new = held[differs:]
        if new:
            cut = new[0].position.offset <= self._last.offset
            if cut:
                self._refuse_cut_below_committed(new[0].position.offset - 1,
                                                 f"the leader of epoch {epoch}")
            write = WriteBatch(raw_mode=True)
            if cut:
                # a divergent tail (written under an older leader, never committed)
                write.delete_range(_entry_key(new[0].position.offset), _LAST_KEY)
            for entry in new:
                write.put(_entry_key(entry.position.offset),
                          _U64.pack(entry.position.epoch) + entry.batch)
            self._write_durably(write)
            if cut:  # the entry before the first new one is kept, and held still
                keep_to = new[0].position.offset - 1
                self._forget_after(Position(self.epoch_at(keep_to) or 0, keep_to))
            self._remember(new)
            self._last = new[-1].position
            self._synced_to_end()
        if matched > self._durable:
            # held already, but written as this site's own append when it led and
            # not synced yet: the leader counts the answer as on disk
            self.sync()
        self._committed = max(self._committed, min(committed, matched))
        if matched >= committed:
            self.caught_up = True
        return AppendResult(True, matched, self._last)

    def truncate_after(self, offset: int) -> None:
        """Cut every entry after `offset` (a new leader's log ends there)."""
        if offset >= self._last.offset:
            return
        self._refuse_cut_below_committed(offset, "a truncate")
        if offset < self._before_first.offset:
            raise LogGapError(f"cannot truncate to {offset}: entries before "
                              f"{self.first_offset} are trimmed")
        epoch = self.epoch_at(offset)
        assert epoch is not None  # held: offset is between first - 1 and last
        write = WriteBatch(raw_mode=True)
        write.delete_range(_entry_key(offset + 1), _LAST_KEY)
        self._write_durably(write)
        self._forget_after(Position(epoch, offset))
        self._last = Position(epoch, offset)
        self._synced_to_end()

    def trim_before(self, offset: int, max_entries: int | None = None) -> None:
        """Forget entries before `offset`: every replica has applied them. With
        `max_entries`, forget at most that many (a bounded delete per call)."""
        offset = min(offset, self._last.offset + 1)
        if max_entries is not None:
            offset = min(offset, self.first_offset + max_entries)
        if offset <= self.first_offset:
            return
        before = Position(self.epoch_at(offset - 1) or 0, offset - 1)
        write = WriteBatch(raw_mode=True)
        write.delete_range(_entry_key(0), _entry_key(offset))
        write.put(_FIRST_KEY, _POSITION.pack(*before))
        self._write_durably(write)
        self._forget_before(before)
        self._before_first = before
        self._synced_to_end()

    def reset_to(self, position: Position) -> None:
        """Forget every entry: this log now starts after `position`, where a
        checkpoint installed in place of the shard's data was taken (its applied
        offset and epoch). Idempotent: a crash during an install does it again."""
        write = WriteBatch(raw_mode=True)
        write.delete_range(_entry_key(0), _LAST_KEY)
        write.put(_FIRST_KEY, _POSITION.pack(*position))
        if position.epoch > self._epoch:
            write.put(_EPOCH_KEY, _U64.pack(position.epoch))
        self._write_durably(write)
        self._epoch = max(self._epoch, position.epoch)
        self._before_first = position
        self._recent = Recent(position, ())
        self._last = position
        self._synced_to_end()
        self._committed = position.offset

    def close(self) -> None:
        self._wal.close(self._db)

    # -- helpers ------------------------------------------------------------------

    def _refuse_cut_below_committed(self, keep_to: int, who: str) -> None:
        """Raise CommittedCutError (counted, logged) when cutting every entry after
        `keep_to` would cut one known committed (so maybe applied)."""
        if keep_to >= self._committed:
            return
        self._cuts_refused.inc()
        message = (f"shard log {self.path}: {who} would cut entries after offset {keep_to}, "
                   f"below the committed offset {self._committed}: refused")
        log.error("%s", message)
        raise CommittedCutError(message)

    def _read_u64(self, key: bytes) -> int:
        raw = self._db.get(key)
        return 0 if raw is None else _U64.unpack(as_bytes(raw))[0]

    def _find_last(self) -> Position:
        iterator = self._db.iter()
        iterator.seek_for_prev(_LAST_KEY)
        found = START
        if iterator.valid():
            key = as_bytes(iterator.key())
            if key.startswith(_ENTRY_PREFIX):
                found = _entry(key, as_bytes(iterator.value())).position
        del iterator
        if 0 < found.offset < self._before_first.offset:
            raise CorruptDataError(f"shard log {self.path}: trimmed to "
                                   f"{self._before_first.offset} but ends at {found.offset}")
        return found if found.offset else self._before_first

    def _holds(self, position: Position) -> bool:
        """Whether this log has the leader's entry at `position`. Trimmed entries
        were applied by every replica, so committed, so equal to every leader's."""
        if position.offset < self._before_first.offset:
            return True
        return self.epoch_at(position.offset) == position.epoch

    def _retry_from(self, offset: int) -> int:
        """Where the leader should resend from, when its entry at `offset` is not
        here: after our end, or at the start of our epoch that holds `offset` (that
        whole epoch's tail may differ), so a divergent tail costs one round trip per
        epoch, not per entry."""
        if offset > self._last.offset:
            return self._last.offset + 1
        epoch = self.epoch_at(offset)
        probe = offset
        while probe > self.first_offset and self.epoch_at(probe - 1) == epoch:
            probe -= 1
        return probe
