"""`spark.read.format("stratamq")`: stored messages as a DataFrame, read from a
checkpoint (or a stopped site's database folder) through the storage's own code.

    spark.read.format("stratamq").option("topic_filter", "sensors/+/temp")
         .option("payload", "true").load("/checkpoints/messages-1")

A partition per shard's generations up to `split_bytes` of them, a generation that
holds more split into time slices of its own. Each partition reads the streams its filter needs with
the storage's iterators (`stratamq.broker.ds.ShardSnapshot`), so a narrow filter or
time range reads only what it asks for. What to read is said with options, once per
frame:

- `topic_filter` (an MQTT filter, default `#`; as in MQTT, `#` does not read `$`
  topics, a filter starting with `$` does); `all_topics=true` reads every stream, `$`
  topics too, and takes no `topic_filter`;
- the time range: `start_time` / `end_time` (µs, end exclusive);
- `shards` / `generations` (comma-separated ids) prune partitions.

Payloads are read only with the option `payload` (default false). With a schema of
only `shard`, `generation`, `stream`, `topic` and `timestamp`, stored messages are not
decoded at all (the topic is peeked, the timestamp is in the key).

A partition's rows go to Spark as Arrow record batches, built a column at a time from
each storage batch: yielded as tuples, each row cost a Python tuple here and a
per-value conversion in PySpark's worker. A record batch ends after the storage batch
that brings it to `BATCH_ROWS` rows or `BATCH_BYTES` of stored messages, so a
partition's memory stays bounded. (PySpark's read worker imports pyarrow whatever the
source yields: there is no tuple path to fall back to.)

The source pushes no `where` filter into the read (Spark applies them all): PySpark
4.1 to 4.3 keep the read a filter pushdown planned on the data source a frame was
loaded from, and reuse it for that frame's next query that has no filter to push, so
a reused frame or temporary view would answer with an earlier query's rows."""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

from stratamq.broker.ds import (
    EndOfStream,
    Message,
    ShardSnapshot,
    Snapshot,
    Stream,
    decode_message,
    peek_timestamp,
    peek_topic,
)
from stratamq.broker.topic import validate_filter

NAME = "stratamq"
DEFAULT_BATCH = 1000
DEFAULT_SPLIT_BYTES = 128 * 1024 * 1024
NO_END = 2**63 - 1
# Shards a Python worker keeps open between the partitions it reads: opening a shard
# opens every generation's column families, which at tens of generations cost more
# than reading a partition (issue 28: 96% of the read time).
OPEN_SHARDS = 8
# A record batch's rows and stored bytes (each at most one storage batch more): Spark's
# own batches of a tuple-yielding source hold 10,000 rows; the bytes keep batches of
# large payloads small (and under Arrow's 2 GiB per binary column).
BATCH_ROWS = 10_000
BATCH_BYTES = 64 * 1024 * 1024

PROPERTIES_TYPE = (
    "struct<payload_format_indicator: int, message_expiry_interval: bigint, "
    "content_type: string, response_topic: string, correlation_data: binary, "
    "user_properties: array<struct<name: string, value: string>>>")
BASE_COLUMNS = ("shard int, generation int, stream string, pattern string, topic string, "
                "timestamp bigint, publisher string, qos int, retain boolean, "
                "payload_size int")
# Columns that need no decoding of the stored message.
KEY_COLUMNS = frozenset({"shard", "generation", "stream", "pattern", "topic", "timestamp"})


def default_schema(payload: bool) -> str:
    return BASE_COLUMNS + (", payload binary" if payload else "") \
        + f", properties {PROPERTIES_TYPE}"


def _flag(options: dict[str, str], name: str) -> bool:
    value = options.get(name, "false").strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"option {name!r}: true or false, got {value!r}")
    return value == "true"


def _ids(options: dict[str, str], name: str) -> frozenset[int] | None:
    """A comma-separated list of shard or generation ids; None when not given."""
    value = options.get(name)
    if value is None:
        return None
    try:
        return frozenset(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"option {name!r}: comma-separated ids, got {value!r}") from None


def _properties(message: Message) -> tuple[Any, ...] | None:
    props = message.properties
    if props.is_empty():
        return None
    return (props.payload_format_indicator, props.message_expiry_interval,
            props.content_type, props.response_topic, props.correlation_data,
            [(name, value) for name, value in props.user_properties])


# the columns read from the decoded message
_COLUMNS: dict[str, Callable[[Message], Any]] = {
    "publisher": lambda m: m.client_id,
    "qos": lambda m: m.qos,
    "retain": lambda m: m.retain,
    "payload_size": lambda m: len(m.payload),
    "payload": lambda m: m.payload,
    "properties": _properties,
}


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What the reader reads, as the options say."""

    path: str
    topic_filter: str = "#"
    all_topics: bool = False
    start_time: int = 0
    end_time: int = NO_END
    # None: every shard / generation
    shards: frozenset[int] | None = None
    generations: frozenset[int] | None = None
    batch_size: int = DEFAULT_BATCH
    split_bytes: int = DEFAULT_SPLIT_BYTES
    columns: tuple[str, ...] = field(default_factory=tuple)
    batch_rows: int = BATCH_ROWS
    batch_bytes: int = BATCH_BYTES


@dataclass(frozen=True, slots=True)
class Slice:
    """A (shard, generation), or a time slice of a large one; a partition reads one
    or several of one shard (`_packed`)."""

    shard: int
    generation: int
    start_time: int
    end_time: int


class StratamqDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return default_schema(_flag(dict(self.options), "payload"))

    def reader(self, schema: StructType) -> StratamqReader:
        options = dict(self.options)
        path = options.get("path")
        if not path:
            raise ValueError('give the checkpoint folder: .load("/path/to/checkpoint")')
        topic_filter = options.get("topic_filter", "#")
        validate_filter(topic_filter)
        all_topics = _flag(options, "all_topics")
        if all_topics and "topic_filter" in options:
            raise ValueError("option all_topics reads every topic and takes no topic_filter "
                             "(a topic_filter that starts with `$` reads `$` topics)")
        columns = tuple(schema.fieldNames())
        known = KEY_COLUMNS | set(_COLUMNS)
        unknown = [name for name in columns if name not in known]
        if unknown:
            raise ValueError(f"unknown columns {unknown}; the source has {sorted(known)}")
        return StratamqReader(schema, ReadPlan(
            path=path, topic_filter=topic_filter, all_topics=all_topics,
            start_time=int(options.get("start_time", 0)),
            end_time=int(options.get("end_time", NO_END)),
            batch_size=int(options.get("batch_size", DEFAULT_BATCH)),
            split_bytes=int(options.get("split_bytes", DEFAULT_SPLIT_BYTES)),
            shards=_ids(options, "shards"), generations=_ids(options, "generations"),
            columns=columns))


class StratamqReader(DataSourceReader):
    def __init__(self, schema: StructType, plan: ReadPlan) -> None:
        self.plan = plan
        # as PySpark's read worker expects the batches (it checks they are equal)
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")

    # -- planning (driver) -------------------------------------------------------------

    def partitions(self) -> Sequence[InputPartition]:
        plan = self.plan
        if plan.start_time >= plan.end_time:
            return [InputPartition(None)]
        with Snapshot(plan.path) as snapshot:
            manifest = snapshot.manifest()
        found: list[InputPartition] = []
        for shard in manifest["shards"]:
            if plan.shards is not None and shard["id"] not in plan.shards:
                continue
            sliced: list[tuple[list[Slice], int]] = []
            for generation in shard["generations"]:
                if plan.generations is not None and generation["id"] not in plan.generations:
                    continue
                until = generation["until"]
                # as `get_streams`: a generation closed at or before the start holds
                # nothing from then on
                if until is not None and until <= plan.start_time:
                    continue
                sliced.append((_slices(shard["id"], generation, until if until is not None
                                       else shard["committed_timestamp"] + 1, plan),
                               generation.get("bytes", 0)))
            found += [InputPartition(tuple(pack)) for pack in _packed(sliced, plan.split_bytes)]
        return found or [InputPartition(None)]

    # -- reading (executors) -----------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        pieces = partition.value
        if pieces is None:
            return
        shard = _opened_shard(self.plan.path, pieces[0].shard)
        chunks = (chunk for piece in pieces if piece.generation in shard.generations
                  for chunk in read_slice(shard, piece, self.plan))
        yield from record_batches(chunks, self.arrow_schema, self.plan.batch_rows,
                                  self.plan.batch_bytes)


# This worker's open shards, least recently read first; see OPEN_SHARDS.
_open_shards: OrderedDict[tuple[str, int, int, int], tuple[Snapshot, ShardSnapshot]] = \
    OrderedDict()


def _opened_shard(path: str, shard_id: int) -> ShardSnapshot:
    """The shard, opened once per worker. Keyed by the shard's RocksDB `CURRENT` file
    too, so a checkpoint made again at the same path is opened again."""
    current = os.stat(os.path.join(path, str(shard_id), "CURRENT"))
    key = (os.path.realpath(path), shard_id, current.st_ino, current.st_mtime_ns)
    found = _open_shards.get(key)
    if found is None:
        snapshot = Snapshot(path)
        found = _open_shards[key] = (snapshot, snapshot.shard(shard_id))
        while len(_open_shards) > OPEN_SHARDS:
            _key, (oldest, _shard) = _open_shards.popitem(last=False)
            oldest.close()
    _open_shards.move_to_end(key)
    return found[1]


@dataclass(frozen=True, slots=True)
class Chunk:
    """The columns (in the plan's order) of one storage batch's rows."""

    rows: int
    stored_bytes: int
    columns: list[list[Any]]


def read_slice(shard: ShardSnapshot, piece: Slice, plan: ReadPlan) -> Iterator[Chunk]:
    """The rows of one slice, a storage batch at a time: each stream the filter needs,
    in stream order, each read with the storage's iterators from the slice's start
    until its end."""
    columns = plan.columns
    decode = not KEY_COLUMNS.issuperset(columns)
    for stream, batches in _stream_batches(shard, piece, plan):
        constants = {"shard": piece.shard, "generation": piece.generation,
                     "stream": stream.static.hex(),
                     "pattern": shard.topic_pattern(stream) if "pattern" in columns else ""}
        for entries in batches:
            values = [value for _key, value in entries]
            messages = [decode_message(value) for value in values] if decode else []
            found: list[list[Any]] = []
            for name in columns:
                if name in constants:
                    found.append([constants[name]] * len(values))
                elif name == "timestamp":
                    found.append([peek_timestamp(value) for value in values])
                elif name == "topic":
                    found.append([message.topic for message in messages] if decode
                                 else [peek_topic(value) for value in values])
                else:
                    column = _COLUMNS[name]
                    found.append([column(message) for message in messages])
            yield Chunk(len(values), sum(map(len, values)), found)


def record_batches(chunks: Iterable[Chunk], schema: pa.Schema, max_rows: int,
                   max_bytes: int) -> Iterator[pa.RecordBatch]:
    """The chunks' rows in order as record batches of `schema`, each ending with the
    chunk that brings it to `max_rows` rows or `max_bytes` stored bytes."""
    pending: list[list[Any]] = [[] for _field in schema]
    rows = stored_bytes = 0
    for chunk in chunks:
        for column, values in zip(pending, chunk.columns, strict=True):
            column += values
        rows += chunk.rows
        stored_bytes += chunk.stored_bytes
        if rows >= max_rows or stored_bytes >= max_bytes:
            yield _record_batch(pending, schema)
            pending = [[] for _field in schema]
            rows = stored_bytes = 0
    if rows:
        yield _record_batch(pending, schema)


def _record_batch(columns: list[list[Any]], schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(values, type=column.type) for values, column in zip(columns, schema,
                                                                        strict=True)],
        schema=schema)


Batches = Iterator[list[tuple[bytes, bytes]]]


def _stream_batches(shard: ShardSnapshot, piece: Slice,
                    plan: ReadPlan) -> Iterator[tuple[Stream, Batches]]:
    """Each stream of the slice with its batches of (data key, stored message), cut
    at the slice's end."""
    if plan.all_topics:
        for stream, pattern in shard.all_streams(piece.generation):
            yield stream, _whole_stream(shard, stream, pattern, piece, plan.batch_size)
        return
    for stream in shard.get_streams(piece.generation, plan.topic_filter):
        yield stream, _filtered_stream(shard, stream, piece, plan)


def _filtered_stream(shard: ShardSnapshot, stream: Stream, piece: Slice,
                     plan: ReadPlan) -> Batches:
    iterator = shard.make_iterator(stream, plan.topic_filter, piece.start_time)
    while not isinstance(result := shard.next_raw(iterator, plan.batch_size), EndOfStream):
        iterator, entries = result
        kept = _before(shard, piece, entries)
        yield kept
        if len(kept) < len(entries) or iterator.last_timestamp >= piece.end_time - 1:
            return


def _whole_stream(shard: ShardSnapshot, stream: Stream, pattern: tuple[str, ...],
                  piece: Slice, batch_size: int) -> Batches:
    after = max(piece.start_time - 1, 0)
    while entries := shard.read_stream(stream, pattern, after, batch_size):
        kept = _before(shard, piece, entries)
        yield kept
        after = peek_timestamp(entries[-1][1])
        if len(kept) < len(entries) or after >= piece.end_time - 1:
            return


def _before(shard: ShardSnapshot, piece: Slice,
            entries: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The entries before the slice's end. Entries are in timestamp order, and most
    batches end before the slice does: only the one it cuts is searched."""
    if not entries or peek_timestamp(entries[-1][1]) < piece.end_time:
        return entries
    return entries[:bisect_left(entries, piece.end_time,
                                key=lambda entry: peek_timestamp(entry[1]))]


def _packed(sliced: list[tuple[list[Slice], int]], split_bytes: int) -> list[list[Slice]]:
    """One shard's slices as partitions: a sliced (large) generation's slices one
    each, whole generations in order together up to `split_bytes`. A partition per
    generation cost Spark a task each: at 50 generations per shard the tasks, not the
    rows, were the read's time."""
    packs: list[list[Slice]] = []
    pack: list[Slice] = []
    size = 0
    for pieces, generation_bytes in sliced:
        if len(pieces) > 1:
            packs += [[piece] for piece in pieces]
            continue
        if pack and size + generation_bytes > split_bytes:
            packs.append(pack)
            pack, size = [], 0
        pack += pieces
        size += generation_bytes
    if pack:
        packs.append(pack)
    return packs


def _slices(shard_id: int, generation: dict[str, Any], end: int,
            plan: ReadPlan) -> list[Slice]:
    """A generation's part of the plan's time range, cut into `bytes / split_bytes`
    slices of equal time. The first and last slices keep the plan's own bounds, so a
    message outside the generation's recorded range (a clock that went back) is
    still read by exactly one slice."""
    pieces = math.ceil(generation.get("bytes", 0) / plan.split_bytes)
    low = max(plan.start_time, generation["since"])
    high = min(plan.end_time, end)
    if pieces <= 1 or high - low < pieces:
        return [Slice(shard_id, generation["id"], plan.start_time, plan.end_time)]
    step = (high - low) // pieces
    bounds = [plan.start_time, *(low + step * k for k in range(1, pieces)), plan.end_time]
    return [Slice(shard_id, generation["id"], start, stop)
            for start, stop in pairwise(bounds)]
