"""Read-only access to a database folder that no site is writing: a checkpoint
(`checkpoint.py`) or the data folder of a stopped site. Synchronous and blocking, for
batch jobs (the Spark data source) that run outside any event loop.

It reads with the storage's own parts: the generation table, the learned topic tries,
the layouts, iterators and the message decoder. `ShardSnapshot.next` follows
`Database.next`: the same streams, the same order, the same filter checks."""

from __future__ import annotations

import errno
import fcntl
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rocksdict import AccessType, Options, Rdict

from ..errors import (
    CorruptDataError,
    FolderInUseError,
    InvalidIteratorError,
    UnknownDatabaseError,
)
from ..topic import levels_match, validate_filter
from .generation import GenerationInfo
from .iterator import END_OF_STREAM, EndOfStream, Iterator, Rank, Stream
from .layouts import Layout, ReadStats, make_layout
from .lts import END, PLUS, REST, StaticIndex, Trie
from .message import Message, decode_message, peek_timestamp, peek_topic
from .shard import generation_bytes, read_generation_table, read_last_timestamp, read_trie
from .site_id import SITE_ID_FILE

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
DB_META_FILE = "db.json"  # as `database.META_FILE`; repeated to keep imports one-way
# Only learning depends on the thresholds; a snapshot never learns.
_READ_THRESHOLDS = (100, 10)

RawEntries = list[tuple[bytes, bytes]]


def stream_paths(trie: Trie) -> dict[StaticIndex, tuple[str, ...]]:
    """Every stream of a generation with the labels from the root to it: its topic
    pattern, literal levels and `+` where topics vary (`fleet/+/+/temp`)."""
    parents = {edge.child: edge for edge in trie.edges()}
    found = {}
    for edge in trie.edges():
        if edge.label != END:
            continue
        labels: list[str] = []
        state = edge.parent
        while state in parents:
            above = parents[state]
            labels.append(above.label)
            state = above.parent
        found[edge.child] = tuple(reversed(labels))
    return found


def stream_patterns(trie: Trie) -> dict[StaticIndex, tuple[str, ...]]:
    """Every stream of a generation with its all-`+` pattern (one `+` per varying
    level): what an iterator reading the whole stream uses."""
    return {static: tuple(PLUS for label in labels if label in (PLUS, REST))
            for static, labels in stream_paths(trie).items()}


@dataclass(slots=True)
class SnapshotGeneration:
    info: GenerationInfo
    layout: Layout
    data: Rdict
    trie: Trie | None = None  # read on first use: a reader of one generation pays for one
    paths: dict[StaticIndex, str] | None = None  # topic patterns, made on first use


class ShardSnapshot:
    """One shard's RocksDB opened read-only. A generation's learned topic trie is read
    when the generation is first read: a job that reads one generation of many (a
    Spark partition) does not read them all."""

    def __init__(self, path: Path, shard_id: int) -> None:
        if not (path / "CURRENT").exists():
            raise UnknownDatabaseError(f"{path} holds no RocksDB database (no CURRENT file)")
        self.shard_id = shard_id
        families = Rdict.list_cf(str(path), Options(raw_mode=True))
        self._db = Rdict(str(path), Options(raw_mode=True),
                         column_families={name: Options(raw_mode=True) for name in families
                                          if name != "default"},
                         access_type=AccessType.read_only())
        self.last_timestamp = read_last_timestamp(self._db)
        self.generations: dict[int, SnapshotGeneration] = {}
        for info in read_generation_table(self._db):
            self.generations[info.id] = SnapshotGeneration(
                info, make_layout(info.layout, dict(info.layout_options)),
                self._db.get_column_family(info.data_column_family()))

    def generation(self, generation_id: int) -> SnapshotGeneration:
        found = self.generations.get(generation_id)
        if found is None:
            raise InvalidIteratorError(
                f"shard {self.shard_id} has no generation {generation_id} in this snapshot")
        return found

    def trie(self, generation_id: int) -> Trie:
        """The generation's learned topic trie, read on first use."""
        generation = self.generation(generation_id)
        if generation.trie is None:
            generation.trie = read_trie(self._db, generation.info, _READ_THRESHOLDS)
        return generation.trie

    def get_streams(self, generation_id: int, topic_filter: str) -> list[Stream]:
        """The streams of one generation that the filter reads, by static index."""
        levels = validate_filter(topic_filter)
        trie = self.trie(generation_id)
        return [Stream(self.shard_id, generation_id, static)
                for static in sorted(match.static for match in trie.match(levels))]

    def all_streams(self, generation_id: int) -> list[tuple[Stream, tuple[str, ...]]]:
        """Every stream of a generation (`$` topics too, which no wildcard filter
        reads), each with the all-`+` pattern that reads the whole stream."""
        patterns = stream_patterns(self.trie(generation_id))
        return [(Stream(self.shard_id, generation_id, static), patterns[static])
                for static in sorted(patterns)]

    def topic_pattern(self, stream: Stream) -> str:
        """The stream's topic pattern (`fleet/+/+/temp`, see `stream_paths`)."""
        generation = self.generation(stream.generation)
        if generation.paths is None:
            generation.paths = {static: "/".join(labels)
                                for static, labels
                                in stream_paths(self.trie(stream.generation)).items()}
        return generation.paths.get(stream.static, "")

    def read_stream(self, stream: Stream, pattern: tuple[str, ...], after: int,
                    batch_size: int) -> RawEntries:
        """Up to `batch_size` (data key, stored message) of a whole stream after the
        timestamp `after`, every topic (see `all_streams`)."""
        generation = self.generation(stream.generation)
        return generation.layout.read(generation.data, stream.static, pattern, ["#"], after,
                                      batch_size, ReadStats())

    def make_iterator(self, stream: Stream, topic_filter: str, start_time: int = 0) -> Iterator:
        return Iterator.start(self.trie(stream.generation), stream, topic_filter, start_time)

    def next_raw(self, iterator: Iterator, batch_size: int,
                 stats: ReadStats | None = None) -> tuple[Iterator, RawEntries] | EndOfStream:
        """`Database.next` without decoding: (data key, stored message) pairs whose
        topic matches the iterator's filter; END_OF_STREAM once the stream is read out
        (nothing writes a snapshot, so every generation in it ends)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        stream = iterator.stream
        generation = self.generations.get(stream.generation)
        if generation is None:
            return END_OF_STREAM
        filter_levels = iterator.topic_filter.split("/")
        entries = generation.layout.read(generation.data, stream.static, iterator.pattern,
                                         filter_levels, iterator.last_timestamp, batch_size,
                                         stats or ReadStats())
        if not entries:
            return END_OF_STREAM
        matching = []
        matched = None  # runs of one topic are the rule in a stream: check each run once
        for key, value in entries:
            topic = peek_topic(value)
            if topic != matched:
                if not levels_match(filter_levels, topic.split("/")):
                    continue
                matched = topic
            matching.append((key, value))
        return iterator.advanced_to(peek_timestamp(entries[-1][1])), matching

    def next(self, iterator: Iterator,
             batch_size: int) -> tuple[Iterator, list[tuple[bytes, Message]]] | EndOfStream:
        """As `Database.next`, decoded."""
        result = self.next_raw(iterator, batch_size)
        if isinstance(result, EndOfStream):
            return result
        moved, entries = result
        return moved, [(key, decode_message(value)) for key, value in entries]

    def generation_bytes(self, generation_id: int) -> int:
        """Bytes of a generation's table files and memtables (its data and trie)."""
        generation = self.generation(generation_id)
        return generation_bytes(self._db, generation.info, generation.data)

    def close(self) -> None:
        for generation in self.generations.values():
            generation.data.close()
        self.generations.clear()
        self._db.close()

    def __enter__(self) -> ShardSnapshot:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class Snapshot:
    """A database folder: `db.json` and one RocksDB per shard (`0/`, `1/`, ...), plus
    `manifest.json` when it is a checkpoint. Shards open on first use."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_path = self.path / DB_META_FILE
        if not meta_path.is_file():
            # a site's data folder (`data_dir`) holds its databases' folders
            databases = sorted(meta.parent.name for meta in self.path.glob(f"*/{DB_META_FILE}"))
            hint = ""
            if databases:
                example = "messages" if "messages" in databases else databases[0]
                hint = (f": a site's data folder: give a database's, such as "
                        f"{self.path / example} ({', '.join(databases)} here)")
            raise UnknownDatabaseError(
                f"{self.path} is not a stratamq database folder or checkpoint (no "
                f"{DB_META_FILE}){hint}")
        meta = json.loads(meta_path.read_text())
        self.n_shards = int(meta["n_shards"])
        self.key_value = bool(meta.get("key_value", False))
        self._shards: dict[int, ShardSnapshot] = {}
        if not self.is_checkpoint:
            self._refuse_if_in_use()

    def _refuse_if_in_use(self) -> None:
        """A running site's folder changes under a reader (generations come and go:
        Spark failed on a missing column family minutes in): refused at once, by the
        lock RocksDB holds on each open shard's LOCK file."""
        for shard_id in range(self.n_shards):
            lock_path = self.path / str(shard_id) / "LOCK"
            if not lock_path.is_file():
                continue
            # Shared: readers in parallel (Spark's workers, each a process) do not
            # refuse each other; RocksDB's own lock is exclusive.
            with lock_path.open("rb") as lock_file:
                try:
                    fcntl.lockf(lock_file, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        raise
                    raise FolderInUseError(
                        f"{self.path} is the folder of a running site (shard {shard_id} "
                        f"is open): read a checkpoint of it instead (stratamq ctl ds "
                        f"checkpoint {self.path.name} DIR), or stop the site") from None
                fcntl.lockf(lock_file, fcntl.LOCK_UN)

    @property
    def is_checkpoint(self) -> bool:
        return (self.path / MANIFEST_FILE).is_file()

    @property
    def shard_ids(self) -> list[int]:
        """The shards the folder has: every one of a site's folder; a checkpoint may
        hold some only (`create_checkpoint`'s `shards`)."""
        return [shard_id for shard_id in range(self.n_shards)
                if (self.path / str(shard_id)).is_dir()]

    def shard(self, shard_id: int) -> ShardSnapshot:
        opened = self._shards.get(shard_id)
        if opened is None:
            # (a checkpoint may hold some shards only)
            if not 0 <= shard_id < self.n_shards or not (self.path / str(shard_id)).is_dir():
                raise InvalidIteratorError(f"{self.path} has no shard {shard_id}")
            opened = self._shards[shard_id] = ShardSnapshot(self.path / str(shard_id), shard_id)
        return opened

    def manifest(self) -> dict[str, Any]:
        """The checkpoint's manifest; for a stopped site's folder, the same document
        made by reading it (site from the data folder above, `created_at` None)."""
        if self.is_checkpoint:
            manifest: dict[str, Any] = json.loads((self.path / MANIFEST_FILE).read_text())
            if manifest.get("format") != MANIFEST_FORMAT:
                raise CorruptDataError(f"{self.path / MANIFEST_FILE}: unknown format "
                                       f"{manifest.get('format')!r}")
            return manifest
        site_file = self.path.parent / SITE_ID_FILE
        site = site_file.read_text().strip() if site_file.is_file() else None
        return describe_snapshot(self, site, self.path.name, None)

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def describe_snapshot(snapshot: Snapshot, site: str | None, db: str,
                      created_at: int | None) -> dict[str, Any]:
    """The manifest document of a database folder, read from its shards."""
    shards = []
    for shard_id in snapshot.shard_ids:
        shard = snapshot.shard(shard_id)
        shards.append({
            "id": shard_id,
            "path": str(shard_id),
            "committed_timestamp": shard.last_timestamp,
            "generations": [{
                "id": info.id,
                "layout": info.layout,
                "layout_options": info.layout_options,
                "created_at": info.created_at,
                "since": info.since,
                "until": info.until,
                "current": info.is_current,
                "bytes": shard.generation_bytes(info.id),
            } for info in (g.info for _id, g in sorted(shard.generations.items()))],
        })
    return {"format": MANIFEST_FORMAT, "site": site, "db": db, "created_at": created_at,
            "n_shards": snapshot.n_shards, "key_value": snapshot.key_value,
            "timestamps": "microseconds since the epoch", "shards": shards}


def ranks(manifest: dict[str, Any]) -> list[Rank]:
    """Every (shard, generation) of a manifest, in rank order."""
    return sorted(Rank(shard["id"], generation["id"]) for shard in manifest["shards"]
                  for generation in shard["generations"])
