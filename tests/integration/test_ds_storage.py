"""The storage engine against real RocksDB in temporary directories."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratamq.broker.admin.http_errors import http_status
from stratamq.broker.ds import (
    END_OF_STREAM,
    Consistency,
    CookedBatch,
    DbOptions,
    DurableStorage,
    EndOfStream,
    Iterator,
    Message,
    MessageProperties,
)
from stratamq.broker.ds.shard import Shard
from stratamq.broker.errors import (
    ConfigError,
    GenerationError,
    InvalidIteratorError,
    InvalidMessageError,
    InvalidTopicError,
    InvalidTopicFilterError,
    PayloadTooLargeError,
    StratamqError,
    UnknownDatabaseError,
)
from stratamq.broker.mqtt.error_codes import mqtt_reason_code
from stratamq.broker.topic import topic_matches
from tests.support.storage import read_filter, run

FAST = DbOptions(n_shards=2, flush_interval=0.001, wildcard_thresholds=(3, 2))


async def open_storage(path: Path, options: DbOptions = FAST) -> DurableStorage:
    storage = DurableStorage(path)
    await storage.open_db("messages", options)
    return storage


def test_store_and_read_back_with_properties(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path)
        props = MessageProperties(payload_format_indicator=1, message_expiry_interval=60,
                                  content_type="text/plain", response_topic="r/t",
                                  correlation_data=b"\x00\x01",
                                  user_properties=(("k", "v"), ("k", "v2")))
        sent = Message("a/b", b"hello", client_id="c1", qos=2, retain=True, properties=props)
        await storage.store_batch("messages", [sent])
        (got,) = await read_filter(storage, "messages", "a/b")
        assert (got.topic, got.payload, got.client_id, got.qos, got.retain, got.properties) == \
            ("a/b", b"hello", "c1", 2, True, props)
        assert got.timestamp > 0
        await storage.close()
    run(scenario())


def test_timestamps_strictly_increase_per_shard_across_restarts(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        storage = await open_storage(tmp_path, DbOptions(n_shards=1, flush_interval=0.001))
        await storage.store_batch("messages", [Message("t", b"%d" % i) for i in range(50)])
        await storage.close()
        storage = await open_storage(tmp_path, DbOptions(n_shards=1, flush_interval=0.001))
        await storage.store_batch("messages", [Message("t", b"x")])
        found = await read_filter(storage, "messages", "t")
        await storage.close()
        return [m.timestamp for m in found]
    stamps = run(scenario())
    assert len(stamps) == 51
    assert all(a < b for a, b in itertools.pairwise(stamps))


def test_concurrent_writers_share_writes_and_keep_order(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, DbOptions(n_shards=4, flush_interval=0.002))

        async def publisher(n: int) -> None:
            for i in range(40):
                await storage.store_batch(
                    "messages", [Message(f"p/{n}/{i % 3}", b"%d" % i, client_id=f"c{n}")])
        await asyncio.gather(*(publisher(n) for n in range(25)))
        found = await read_filter(storage, "messages", "#")
        assert len(found) == 25 * 40
        per_topic: dict[str, list[int]] = defaultdict(list)
        for message in sorted(found, key=lambda m: m.timestamp):
            per_topic[message.topic].append(int(message.payload))
        assert all(values == sorted(values) for values in per_topic.values())
        # group commit: far fewer RocksDB writes than store_batch calls
        from prometheus_client import REGISTRY
        batches = sum(REGISTRY.get_sample_value("stratamq_ds_buffer_batches_total",
                                                {"db": "messages", "shard": str(s)}) or 0
                      for s in range(4))
        assert batches < 25 * 40
        await storage.close()
    run(scenario())


def test_iterator_serialized_halfway_resumes_with_the_remainder(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, DbOptions(n_shards=1, flush_interval=0.001))
        await storage.store_batch("messages", [Message("r/x", b"%d" % i) for i in range(100)])
        ((_rank, stream),) = storage.get_streams("messages", "r/+")
        iterator = storage.make_iterator("messages", stream, "r/+")
        result = await storage.next("messages", iterator, 40)
        assert not isinstance(result, EndOfStream)
        iterator, first = result
        saved = iterator.to_bytes()
        await storage.close()

        storage = await open_storage(tmp_path, DbOptions(n_shards=1, flush_interval=0.001))
        result = await storage.next("messages", Iterator.from_bytes(saved), 1000)
        assert not isinstance(result, EndOfStream)
        _iterator, rest = result
        payloads = [int(m.payload) for _k, m in first + rest]
        assert payloads == list(range(100))
        await storage.close()
    run(scenario())


def test_corrupt_iterator_bytes_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path)
        await storage.store_batch("messages", [Message("a", b"1")])
        ((_rank, stream), *_) = storage.get_streams("messages", "a")
        raw = storage.make_iterator("messages", stream, "a").to_bytes()
        for bad in (b"", b"garbage", raw[:-1], raw[:5] + bytes([raw[5] ^ 1]) + raw[6:]):
            with pytest.raises(InvalidIteratorError):
                Iterator.from_bytes(bad)
        foreign = Iterator(stream.__class__(99, 1, stream.static), "a", (), 0)
        with pytest.raises(InvalidIteratorError):
            await storage.next("messages", foreign, 10)
        await storage.close()
    run(scenario())


def test_bad_input_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, DbOptions(n_shards=2, flush_interval=0.001,
                                                         max_payload_bytes=10))
        good = Message("ok", b"1")
        cases: list[tuple[Message, type[StratamqError]]] = [
            (Message("", b"1"), InvalidTopicError),
            (Message("a/+", b"1"), InvalidTopicError),
            (Message("a/#", b"1"), InvalidTopicError),
            (Message("a\x00b", b"1"), InvalidTopicError),
            (Message("big", b"x" * 11), PayloadTooLargeError),
            (Message("q", b"1", qos=3), InvalidMessageError),
        ]
        for bad, error in cases:
            with pytest.raises(error) as raised:
                await storage.store_batch("messages", [good, bad])
            assert mqtt_reason_code(raised.value) in (0x90, 0x95, 0x81)
            assert not raised.value.recoverable
        assert await read_filter(storage, "messages", "#") == []
        for bad_filter in ("", "a/#/b", "a+", "#x"):
            with pytest.raises(InvalidTopicFilterError):
                storage.get_streams("messages", bad_filter)
        with pytest.raises(UnknownDatabaseError) as unknown:
            await storage.store_batch("nope", [good])
        assert http_status(unknown.value) == 404
        assert not unknown.value.recoverable
        await storage.close()
    run(scenario())


def test_n_shards_cannot_change_after_creation(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, DbOptions(n_shards=2))
        await storage.close()
        storage = DurableStorage(tmp_path)
        with pytest.raises(ConfigError, match="n_shards"):
            await storage.open_db("messages", DbOptions(n_shards=3))
        await storage.close()
    run(scenario())


def test_generations_rank_order_and_end_of_stream(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, DbOptions(n_shards=1, flush_interval=0.001))
        await storage.store_batch("messages", [Message("g/a", b"1")])
        await storage.add_generation("messages")
        await storage.store_batch("messages", [Message("g/a", b"2")])
        streams = storage.get_streams("messages", "g/a")
        assert [rank.y for rank, _ in streams] == [1, 2]
        old, new = (stream for _rank, stream in streams)
        old_result = await storage.next("messages", storage.make_iterator(
            "messages", old, "g/a"), 10)
        assert not isinstance(old_result, EndOfStream)
        old_iterator, batch = old_result
        assert [m.payload for _k, m in batch] == [b"1"]
        assert await storage.next("messages", old_iterator, 10) is END_OF_STREAM
        new_result = await storage.next("messages", storage.make_iterator(
            "messages", new, "g/a"), 10)
        assert not isinstance(new_result, EndOfStream)
        new_iterator, batch = new_result
        assert [m.payload for _k, m in batch] == [b"2"]
        # the current generation is never at its end: it may still take writes
        assert await storage.next("messages", new_iterator, 10) == (new_iterator, [])
        # start_time skips generations closed before it
        later = storage.list_generations("messages")[(0, 2)].since
        assert [rank.y for rank, _ in storage.get_streams("messages", "g/a", later)] == [2]
        with pytest.raises(GenerationError):
            await storage.drop_generation("messages", 0, 2)
        await storage.drop_generation("messages", 0, 1)
        assert list(storage.list_generations("messages")) == [(0, 2)]
        assert await storage.next("messages", old_iterator, 10) is END_OF_STREAM
        await storage.close()
        # the generation table survives a restart
        storage = await open_storage(tmp_path, DbOptions(n_shards=1))
        assert list(storage.list_generations("messages")) == [(0, 2)]
        await storage.close()
    run(scenario())


def test_retention_adds_and_drops_the_right_generations(tmp_path: Path) -> None:
    async def scenario() -> None:
        options = DbOptions(n_shards=2, flush_interval=0.001, message_retention_period=10.0)
        storage = await open_storage(tmp_path, options)
        database = storage.db("messages")
        since = database.list_generations()[(0, 1)].since
        second = 1_000_000
        assert await database.apply_retention(since + 5 * second) == (False, 0)
        assert await database.apply_retention(since + 11 * second) == (True, 0)
        assert sorted({g for _s, g in database.list_generations()}) == [1, 2]
        closed_at = max(info.until or 0 for (_s, g), info in database.list_generations().items()
                        if g == 1)
        # generation 1 is kept until retention has passed since it stopped taking writes
        assert await database.apply_retention(closed_at + 9 * second) == (False, 0)
        added, dropped = await database.apply_retention(closed_at + 10 * second)
        assert dropped == 2  # generation 1 of both shards
        assert added  # generation 2 is as old as the retention period by then, too
        assert sorted({g for _s, g in database.list_generations()}) == [2, 3]
        await storage.close()
    run(scenario())


def test_generations_roll_over_at_their_own_period(tmp_path: Path) -> None:
    """`generation_period` 2 s under a retention of a day: a new generation every 2 s,
    the closed ones kept for the day (issue 28: testing the GC took a shortened
    retention)."""
    async def scenario() -> None:
        options = DbOptions(n_shards=1, flush_interval=0.001,
                            message_retention_period=86_400.0, generation_period=2.0)
        storage = await open_storage(tmp_path, options)
        database = storage.db("messages")
        since = database.list_generations()[(0, 1)].since
        second = 1_000_000
        assert await database.apply_retention(since + 1 * second) == (False, 0)
        assert await database.apply_retention(since + 2 * second) == (True, 0)
        assert await database.apply_retention(since + 5 * second) == (True, 0)
        assert sorted(g for _s, g in database.list_generations()) == [1, 2, 3]
        await storage.close()
    run(scenario())


def test_retention_task_runs_on_its_own(tmp_path: Path) -> None:
    async def scenario() -> None:
        options = DbOptions(n_shards=1, flush_interval=0.001, message_retention_period=0.2)
        storage = await open_storage(tmp_path, options)
        await storage.store_batch("messages", [Message("old", b"1")])
        storage.start_retention(0.05)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if min(g for _s, g in storage.list_generations("messages")) > 1:
                break
        assert min(g for _s, g in storage.list_generations("messages")) > 1
        assert await read_filter(storage, "messages", "old") == []
        await storage.close()
    run(scenario())


def test_cooked_batch_travels_and_applies_idempotently(tmp_path: Path) -> None:
    leader = Shard(tmp_path / "leader", 0, "wildcard_optimized_v2", {}, (2,), False)
    replica = Shard(tmp_path / "replica", 0, "wildcard_optimized_v2", {}, (2,), False)
    cooked = leader.prepare([Message(f"x/{n}", b"%d" % n) for n in range(5)])
    leader.commit(cooked)
    shipped = CookedBatch.from_bytes(cooked.to_bytes())
    assert shipped == cooked
    replica.commit(shipped)
    replica.commit(shipped)  # a retried apply changes nothing
    for shard in (leader, replica):
        trie = shard.current.trie
        assert sorted(trie.edges(), key=repr) == sorted(leader.current.trie.edges(), key=repr)
        assert shard.last_timestamp == cooked.last_timestamp
    from stratamq.broker.ds.layouts import ReadStats
    reads = []
    for shard in (leader, replica):
        rows: list[tuple[bytes, bytes]] = []
        for match in shard.current.trie.match(["x", "+"]):
            rows += shard.read(1, match.static, match.pattern, ["x", "+"], 0, 100,
                               ReadStats()) or []
        reads.append(sorted(rows))
    assert reads[0] == reads[1] and len(reads[0]) == 5
    leader.close()
    replica.close()


topic_levels = st.sampled_from(["a", "b", "c", "dd", "e1", "e2", "e3", "e4", "e5", "$s"])
topics = st.lists(topic_levels, min_size=1, max_size=4).map("/".join)
filter_levels = st.sampled_from(["a", "b", "c", "e3", "e5", "+", "$s"])


@st.composite
def topic_filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(filter_levels, min_size=0, max_size=4))
    if draw(st.booleans()) or not levels:
        levels.append("#")
    return "/".join(levels)


async def read_streams_in_order(storage: DurableStorage, topic_filter: str) -> list[Message]:
    """`read_filter`, checking that each stream comes back in timestamp order: an
    iterator's position is the last timestamp it returned."""
    found: list[Message] = []
    for _rank, stream in storage.get_streams("messages", topic_filter):
        iterator = storage.make_iterator("messages", stream, topic_filter)
        stamps: list[int] = []
        while True:
            result = await storage.next("messages", iterator, 7)
            if isinstance(result, EndOfStream):
                break
            iterator, batch = result
            if not batch:
                break
            stamps += [message.timestamp for _key, message in batch]
            found += [message for _key, message in batch]
        assert stamps == sorted(set(stamps)), stream
    return found


# Layouts of the generations a property test writes, one after the other (the
# storage is reopened with the next layout and a generation added, as a changed
# configuration does). `narrow` makes level hashes (2 bits) and topic indexes
# (1 byte) collide on purpose; 2**10 µs epochs keep wildcard readers' waits short.
LayoutChoice = tuple[str, dict[str, int]]
V2: LayoutChoice = ("wildcard_optimized_v2", {})
BITFIELD: LayoutChoice = ("wildcard_optimized", {"epoch_bits": 10})
NARROW: LayoutChoice = ("wildcard_optimized", {"topic_index_bytes": 1,
                                               "bits_per_topic_level": 2, "epoch_bits": 8})
GENERATION_PLANS = {"v2": [V2], "bitfield": [BITFIELD], "narrow": [NARROW],
                    "mixed": [V2, BITFIELD, NARROW], "mixed-back": [BITFIELD, V2, BITFIELD]}


def plan_options(layout: LayoutChoice) -> DbOptions:
    return DbOptions(n_shards=2, flush_interval=0.0005, wildcard_thresholds=(3, 2),
                     layout=layout[0], layout_options=layout[1])


@pytest.mark.parametrize("plan", GENERATION_PLANS)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(topics, st.sampled_from(["c1", "c2", "c3"])), min_size=1,
                max_size=60),
       st.lists(topic_filters(), min_size=1, max_size=5), st.integers(1, 20))
def test_engine_returns_exactly_what_a_brute_force_scan_does(
        tmp_path_factory: pytest.TempPathFactory, plan: str,
        published: list[tuple[str, str]], filters: list[str], per_call: int) -> None:
    """`per_call` messages a store_batch call: one batch has consecutive timestamps,
    so bigger calls put many topics into one epoch of `wildcard_optimized`."""
    path = tmp_path_factory.mktemp("prop")
    layouts = GENERATION_PLANS[plan]

    async def scenario() -> None:
        sent: list[Message] = []
        storage = await open_storage(path, plan_options(layouts[0]))
        part = -(-len(published) // len(layouts))
        for generation, layout in enumerate(layouts):
            if generation:
                await storage.close()
                storage = await open_storage(path, plan_options(layout))
                await storage.add_generation("messages")
            numbers = range(generation * part, min((generation + 1) * part, len(published)))
            for first in range(numbers.start, numbers.stop, per_call):
                call = [Message(published[number][0], b"%d" % number,
                                client_id=published[number][1])
                        for number in range(first, min(first + per_call, numbers.stop))]
                sent += call
                await storage.store_batch("messages", call)
        recorded = storage.list_generations("messages")
        assert [recorded[(0, g)].layout for g in range(1, len(layouts) + 1)] == \
            [name for name, _options in layouts]
        for topic_filter in filters:
            got = await read_streams_in_order(storage, topic_filter)
            expected = [m for m in sent if topic_matches(topic_filter, m.topic)]
            assert sorted(m.payload for m in got) == sorted(m.payload for m in expected), \
                topic_filter
            # per topic, in timestamp (= publish) order
            by_topic: dict[str, list[int]] = defaultdict(list)
            for message in got:
                by_topic[message.topic].append(message.timestamp)
            assert all(v == sorted(v) for v in by_topic.values())
        await storage.close()
    run(scenario())


def test_records_are_written_with_the_messages_and_survive_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path)
        database = storage.db("messages")
        await asyncio.gather(*database.submit(
            [Message("q/2", b"x", client_id="pub")], records_of="pub",
            record_puts=[(b"qos2/pub/7", b"1"), (b"qos2/pub/8", b"1")]))
        await asyncio.gather(*database.submit([], records_of="pub",
                                              record_deletes=[b"qos2/pub/8"]))
        await storage.close()
        storage = await open_storage(tmp_path)
        database = storage.db("messages")
        assert await database.read_records(database.shard_of("pub"), b"qos2/pub/",
                                           Consistency.LOCAL) == [(b"qos2/pub/7", b"1")]
        assert [m.payload for m in await read_filter(storage, "messages", "q/2")] == [b"x"]
        await storage.close()
    run(scenario())


def test_cooked_batch_with_records_round_trips(tmp_path: Path) -> None:
    shard = Shard(tmp_path / "s", 0, "wildcard_optimized_v2", {}, (2,), False)
    cooked = shard.prepare([Message("a", b"1")], [(b"k", b"v")], [b"gone"])
    assert CookedBatch.from_bytes(cooked.to_bytes()) == cooked
    shard.close()


@pytest.mark.parametrize("layout", ["wildcard_optimized", "wildcard_optimized_v2"])
def test_a_topic_cooked_again_after_its_learnt_edge_was_forgotten_is_read(
        tmp_path: Path, layout: str) -> None:
    """A leader cooks s/r (an exact edge learnt), its entry is cut (`forget`), and
    a newer leader's batches, which it applies, make the level a `+`. Cooked again,
    s/r goes through the `+` edge: the layout's per-topic cache still held the
    exact edge's key parts (no varying level), and a read of s/r found nothing on
    any copy (found by reading: `Shard.forget` cleared the trie's cache only)."""
    from stratamq.broker.ds.layouts import ReadStats
    leader = Shard(tmp_path / "leader", 0, layout, {}, (2,), False)
    newer = Shard(tmp_path / "newer", 0, layout, {}, (2,), False)
    leader.forget(leader.prepare([Message("s/r", b"cut")]))
    shipped = newer.prepare([Message(f"s/{level}", b"newer") for level in ("a", "b", "c")])
    newer.commit(shipped)
    leader.commit(CookedBatch.from_bytes(shipped.to_bytes()))
    again = leader.prepare([Message("s/r", b"again")])
    leader.commit(again)
    newer.commit(CookedBatch.from_bytes(again.to_bytes()))
    for shard in (leader, newer):
        rows: list[tuple[bytes, bytes]] = []
        for match in shard.current.trie.match(["s", "r"]):
            rows += shard.read(1, match.static, match.pattern, ["s", "r"], 0, 100,
                               ReadStats()) or []
        assert [b"again" in value for _key, value in rows] == [True], (shard.path, rows)
    leader.close()
    newer.close()
