"""The `stratamq` Spark data source against the storage's own replay: a real site
takes a workload over MQTT across two generations, the admin API makes a checkpoint,
and for random topic filters and time ranges the DataFrame holds exactly what
`get_streams` / `make_iterator` / `next` of a `DurableStorage` opened on a copy of
that checkpoint return."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.ds import DbOptions, DurableStorage, EndOfStream, Message, MessageProperties
from stratamq.spark.source import StratamqDataSource
from tests.support.checkpoints import Published, make_checkpoint, publish_all
from tests.support.clients import generations

REGIONS = ["north", "south", "east", "west", "center"]
VEHICLES = [f"v{i}" for i in range(6)]
SENSORS = ["temp", "speed"]
# Below the root, a level becomes `+` after 4 distinct values: the workload has
# wildcard streams (read by zig-zagging the level indexes) and exact ones.
THRESHOLDS = [100, 4]
N_SHARDS = 4
Row = tuple[int, int, str, str, int, str, int, bytes]


def workload(phase: int) -> list[Published]:
    messages = []
    for i in range(160):
        topic = f"fleet/{REGIONS[i % 5]}/{VEHICLES[(i // 5) % 6]}/{SENSORS[i % 2]}"
        if i % 9 == 0:
            topic = f"alerts/{REGIONS[i % 5]}"
        elif i % 17 == 0:
            topic = "misc/one" if i % 2 else "misc/two"
        messages.append(Published(f"car-{i % 7}", topic, b"%d-%d" % (phase, i), 1 + i % 2))
    return messages


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A checkpoint of a site whose shards each hold a closed and a current
    generation (rolled over by a short retention period)."""
    workdir = tmp_path_factory.mktemp("source")
    config = {"durable_storage": {"messages": {"n_shards": N_SHARDS, "layout": {
                  "wildcard_thresholds": THRESHOLDS}}},
              "durable_sessions": {"message_retention_period": "4s"}}
    with running_broker(workdir / "site", config) as broker:
        publish_all(broker, workload(1))
        wait_for_rollover(broker)
        publish_all(broker, workload(2))
        folder = workdir / "checkpoint"
        make_checkpoint(broker, folder)
    yield folder


def wait_for_rollover(broker: BrokerProcess) -> None:
    deadline = time.monotonic() + 60
    while not all(len(ids) >= 2 for ids in generations(broker).values()):
        assert time.monotonic() < deadline, "no generation rollover"
        time.sleep(0.2)


class Replay:
    """The storage's own replay: a DurableStorage opened on a copy of the checkpoint
    (opening writes to it: the checkpoint itself stays untouched)."""

    def __init__(self, checkpoint: Path, workdir: Path) -> None:
        shutil.copytree(checkpoint, workdir / "messages")
        self.loop = asyncio.new_event_loop()
        self.storage = DurableStorage(workdir)
        self.loop.run_until_complete(self.storage.open_db(
            "messages", DbOptions(n_shards=N_SHARDS, wildcard_thresholds=tuple(THRESHOLDS))))

    def rows(self, topic_filter: str, start: int, end: int) -> list[Row]:
        return self.loop.run_until_complete(self._rows(topic_filter, start, end))

    async def _rows(self, topic_filter: str, start: int, end: int) -> list[Row]:
        found: list[Row] = []
        for _rank, stream in self.storage.get_streams("messages", topic_filter, start):
            iterator = self.storage.make_iterator("messages", stream, topic_filter, start)
            while True:
                result = await self.storage.next("messages", iterator, 64)
                if isinstance(result, EndOfStream):
                    break
                moved, batch = result
                if moved.last_timestamp == iterator.last_timestamp:
                    break  # the current generation, read to its end
                iterator = moved
                found += [(stream.shard, stream.generation, stream.static.hex(), m.topic,
                           m.timestamp, m.client_id, m.qos, m.payload)
                          for _key, m in batch if m.timestamp < end]
        return found

    def close(self) -> None:
        self.loop.run_until_complete(self.storage.close())
        self.loop.close()


@pytest.fixture(scope="module")
def replay(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replay]:
    opened = Replay(checkpoint, tmp_path_factory.mktemp("replay"))
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def timestamps(replay: Replay) -> list[int]:
    return sorted(row[4] for row in replay.rows("#", 0, 2**63 - 1))


def spark_rows(frame: DataFrame) -> list[Row]:
    return [(r.shard, r.generation, r.stream, r.topic, r.timestamp, r.publisher, r.qos,
             bytes(r.payload)) for r in frame.collect()]


def source(spark: SparkSession, checkpoint: Path, **options: Any) -> DataFrame:
    reader = spark.read.format("stratamq").option("payload", "true")
    for name, value in options.items():
        reader = reader.option(name, str(value))
    return reader.load(str(checkpoint))




def fleet_filter(region: str, vehicle: str, sensor: str, depth: int) -> str:
    """`fleet/...` with the first `depth` levels and `#`, or all three levels."""
    levels = [region, vehicle, sensor]
    return "/".join(["fleet", *levels[:depth], "#"]) if depth < 3 else "/".join(["fleet", *levels])


fleet_filters = st.builds(fleet_filter, st.sampled_from([*REGIONS, "+"]),
                          st.sampled_from([*VEHICLES, "+"]), st.sampled_from([*SENSORS, "+"]),
                          st.integers(0, 3))
topic_filters = st.one_of(
    fleet_filters,
    st.sampled_from(["#", "+/+", "+/+/+/+", "alerts/#", "alerts/+", "misc/one", "+/north",
                     "fleet/+/v1/+", "nothing/here"]))


def test_workload_covers_generations_and_wildcard_streams(checkpoint: Path,
                                                          replay: Replay) -> None:
    every = replay.rows("#", 0, 2**63 - 1)
    assert len(every) == 320
    assert {row[1] for row in every} >= {1, 2}  # both generations hold messages
    assert {row[0] for row in every} == set(range(N_SHARDS))


# Spark local on a shared 2-core machine: each example is a Spark job.
@pytest.mark.timeout(900)
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(topic_filter=topic_filters, data=st.data())
def test_source_returns_what_next_returns(spark: SparkSession, checkpoint: Path,
                                          replay: Replay, timestamps: list[int],
                                          topic_filter: str, data: st.DataObject) -> None:
    moment = st.one_of(st.sampled_from(timestamps),
                       st.integers(timestamps[0] - 5, timestamps[-1] + 5))
    start, end = sorted((data.draw(moment), data.draw(moment)))
    expected = replay.rows(topic_filter, start, end)
    frame = source(spark, checkpoint, topic_filter=topic_filter).where(
        (F.col("timestamp") >= start) & (F.col("timestamp") < end))
    assert sorted(spark_rows(frame)) == sorted(expected)


def test_options_prune_partitions_and_narrow_the_read(spark: SparkSession, checkpoint: Path,
                                                     replay: Replay) -> None:
    every = source(spark, checkpoint)
    # a partition per shard: its two small generations together
    assert every.rdd.getNumPartitions() == N_SHARDS
    shard_two = source(spark, checkpoint, shards="2")
    assert shard_two.rdd.getNumPartitions() == 1
    assert {row.shard for row in shard_two.collect()} == {2}
    first = source(spark, checkpoint, shards="1,3", generations="1").collect()
    assert {(row.shard, row.generation) for row in first} == {(1, 1), (3, 1)}
    # a range starting when the last closed generation closed: the current ones
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    current_from = max(g["until"] for shard in manifest["shards"]
                       for g in shard["generations"] if not g["current"])
    assert sorted(spark_rows(source(spark, checkpoint, start_time=current_from))) \
        == sorted(replay.rows("#", current_from, 2**63 - 1))
    # an exact topic as the filter reads just that topic, as a `where` does
    exact = source(spark, checkpoint, topic_filter="fleet/east/v2/temp")
    assert sorted(spark_rows(exact)) == sorted(replay.rows("fleet/east/v2/temp", 0, 2**63 - 1))
    assert sorted(spark_rows(every.where("topic = 'fleet/east/v2/temp'"))) \
        == sorted(spark_rows(exact))
    by_options = source(spark, checkpoint, topic_filter="fleet/+/+/speed",
                        start_time=current_from, end_time=2**62)
    assert sorted(spark_rows(by_options)) == sorted(
        replay.rows("fleet/+/+/speed", current_from, 2**62))
    # slices of large generations (here: every 2 KiB) change partitions, not rows
    sliced = source(spark, checkpoint, split_bytes=2048)
    assert sliced.rdd.getNumPartitions() > every.rdd.getNumPartitions()
    assert sorted(spark_rows(sliced)) == sorted(spark_rows(every))
    with pytest.raises(Exception, match="comma-separated ids"):
        source(spark, checkpoint, shards="one").count()


def test_key_columns_alone_and_no_payload_by_default(spark: SparkSession, checkpoint: Path,
                                                     replay: Replay) -> None:
    default = spark.read.format("stratamq").load(str(checkpoint))
    assert "payload" not in default.columns and "payload_size" in default.columns
    keys = spark.read.format("stratamq").schema("topic string, timestamp bigint") \
        .option("topic_filter", "alerts/+").load(str(checkpoint))
    assert sorted((r.topic, r.timestamp) for r in keys.collect()) == sorted(
        (row[3], row[4]) for row in replay.rows("alerts/+", 0, 2**63 - 1))
    # every stream (`$` topics too, none here): the same rows as `#`
    every = spark.read.format("stratamq").option("all_topics", "true").load(str(checkpoint))
    assert sorted(every.collect()) == sorted(default.collect())
    sizes = default.where("topic = 'misc/one'").select("payload_size").collect()
    assert sorted(r.payload_size for r in sizes) == sorted(
        len(row[7]) for row in replay.rows("misc/one", 0, 2**63 - 1))


def test_partitions_are_read_as_bounded_arrow_batches(spark: SparkSession, checkpoint: Path,
                                                     replay: Replay) -> None:
    """A partition's rows go to Spark as record batches of the frame's schema, each
    ending with the storage batch that brings it to its rows or stored bytes, every
    stream's rows in the storage's order."""
    frame = source(spark, checkpoint)
    data_source = StratamqDataSource({"path": str(checkpoint), "payload": "true"})
    by_rows = dataclasses.replace(data_source.reader(frame.schema).plan, batch_size=16,
                                  batch_rows=40)
    for bounds, most in ((by_rows, 40 + 15), (dataclasses.replace(by_rows, batch_bytes=1), 16)):
        reader = data_source.reader(frame.schema)
        reader.plan = bounds
        batches = [batch for partition in reader.partitions() for batch in reader.read(partition)]
        assert all(isinstance(batch, pa.RecordBatch) and batch.schema.names == frame.columns
                   and 0 < batch.num_rows <= most for batch in batches)
        read = [(r["shard"], r["generation"], r["stream"], r["topic"], r["timestamp"],
                 r["publisher"], r["qos"], r["payload"])
                for batch in batches for r in batch.to_pylist()]
        assert per_stream(read) == per_stream(replay.rows("#", 0, 2**63 - 1))
    keys = spark.read.format("stratamq").schema("topic string, timestamp bigint").load(
        str(checkpoint))
    reader = StratamqDataSource({"path": str(checkpoint)}).reader(keys.schema)
    assert sorted((r["topic"], r["timestamp"]) for partition in reader.partitions()
                  for batch in reader.read(partition) for r in batch.to_pylist()) \
        == sorted((row[3], row[4]) for row in replay.rows("#", 0, 2**63 - 1))


def test_every_column_of_stored_messages(spark: SparkSession, tmp_path: Path) -> None:
    """Every column through Spark, MQTT 5 properties too (the test site publishes
    none): a message with each property, one with none."""
    properties = MessageProperties(1, 60, "text/plain", "replies/1", b"\x00id",
                                   (("a", "1"), ("é", "")))
    stored = [Message("logs/é", b"\x00\xff", "dev-1", 1, True, properties),
              Message("logs/plain", b"", "dev-2", 2)]

    async def checkpoint() -> None:
        storage = DurableStorage(tmp_path / "data")
        await storage.open_db("messages", DbOptions(n_shards=1))
        await storage.store_batch("messages", stored)
        await storage.db("messages").checkpoint(tmp_path / "checkpoint")
        await storage.close()

    asyncio.run(checkpoint())
    rows = source(spark, tmp_path / "checkpoint").orderBy("topic").collect()
    assert [(r.shard, r.generation, r.topic, r.publisher, r.qos, r.retain, r.payload_size,
             bytes(r.payload)) for r in rows] == [
        (0, 1, "logs/plain", "dev-2", 2, False, 0, b""),
        (0, 1, "logs/é", "dev-1", 1, True, 2, b"\x00\xff")]
    assert rows[0].properties is None
    found = rows[1].properties
    assert (found.payload_format_indicator, found.message_expiry_interval, found.content_type,
            found.response_topic, bytes(found.correlation_data),
            [(p.name, p.value) for p in found.user_properties]) \
        == (1, 60, "text/plain", "replies/1", b"\x00id", [("a", "1"), ("é", "")])
    assert all(r.stream and r.timestamp > 0 for r in rows)


def per_stream(rows: list[Row]) -> dict[tuple[int, int, str], list[Row]]:
    """The rows of each (shard, generation, stream), in the order read."""
    found: dict[tuple[int, int, str], list[Row]] = defaultdict(list)
    for row in rows:
        found[row[:3]].append(row)
    return dict(found)


def test_a_reused_frame_or_view_answers_each_query_for_itself(spark: SparkSession,
                                                              checkpoint: Path) -> None:
    """PySpark 4.1 to 4.3 keep the read a pushdown planned on the data source a frame
    was loaded from and reuse it for the frame's next query without a pushable
    filter: pushing filters into the read would answer that query with an earlier
    one's rows (issue 28, point 1). The source takes its narrowing from options."""
    frame = source(spark, checkpoint)
    every = frame.count()
    one_topic = frame.where("topic = 'fleet/east/v2/temp'").count()
    assert 0 < one_topic < every
    assert frame.count() == every
    assert frame.where("timestamp < 0").count() == 0
    assert frame.count() == every
    assert frame.where("shard = 2").count() < every
    assert frame.count() == every
    frame.createOrReplaceTempView("reused")
    assert spark.sql("select * from reused where topic = 'fleet/east/v2/temp'"
                     ).count() == one_topic
    assert spark.sql("select * from reused").count() == every


def test_all_topics_reads_dollar_topics_and_refuses_a_topic_filter(
        spark: SparkSession, tmp_path: Path) -> None:
    """`all_topics` reads `$` topics too, and an equality on one of them finds its
    rows; a `topic_filter` beside it is refused, not silently ignored (issue 28,
    point 2)."""
    with running_broker(tmp_path / "site") as broker:
        publish_all(broker, [Published("p", "$internal/audit", b"a", 1),
                             Published("p", "$internal/audit", b"b", 1),
                             Published("p", "sensors/one", b"c", 1),
                             Published("p", "other/two", b"d", 1)])
        make_checkpoint(broker, tmp_path / "checkpoint")
    every = source(spark, tmp_path / "checkpoint", all_topics="true")
    assert every.count() == 4
    assert every.where("topic = '$internal/audit'").count() == 2
    assert source(spark, tmp_path / "checkpoint").count() == 2  # `#` leaves `$` topics out
    assert source(spark, tmp_path / "checkpoint",
                  topic_filter="$internal/#").count() == 2
    with pytest.raises(Exception, match="all_topics"):
        source(spark, tmp_path / "checkpoint", all_topics="true",
               topic_filter="sensors/#").count()
