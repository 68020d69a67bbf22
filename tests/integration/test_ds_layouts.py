"""Layouts per generation, against real RocksDB: `wildcard_optimized` next to
`wildcard_optimized_v2` (the brute-force property test over both is in
test_ds_storage.py)."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

from prometheus_client import REGISTRY

from stratamq.broker.ds import DbOptions, DurableStorage, EndOfStream, Iterator, Message
from stratamq.broker.ds.layouts import ReadStats
from stratamq.broker.ds.layouts.wildcard_optimized import WildcardOptimized
from stratamq.broker.ds.message import peek_timestamp
from stratamq.broker.ds.shard import Shard, now_us
from stratamq.broker.ds.shard_set import ShardSet
from tests.support.storage import open_with_shards, read_filter, run

V2 = DbOptions(n_shards=1, flush_interval=0.0005, wildcard_thresholds=(3, 2))
# thresholds of 1: the first value of a level is exact, all later ones go through `+`
BITFIELD = DbOptions(n_shards=1, flush_interval=0.0005, wildcard_thresholds=(1, 1),
                     layout="wildcard_optimized", layout_options={"epoch_bits": 12})


async def open_storage(path: Path, options: DbOptions) -> DurableStorage:
    return (await open_storage_with_shards(path, options))[0]


async def open_storage_with_shards(path: Path, options: DbOptions
                                   ) -> tuple[DurableStorage, ShardSet]:
    """The storage and the copy of `messages` in it, for a test that looks into a shard."""
    storage = DurableStorage(path)
    _database, shard_set = await open_with_shards(storage, "messages", options)
    return storage, shard_set


async def wildcard_stream(storage: DurableStorage, level: str, last: str) -> Iterator:
    """An iterator on the `+` stream of `level/+/last`: a first topic takes the
    exact edge, a second one makes the `+` stream (both with payload `seed`)."""
    await storage.store_batch("messages", [Message(f"{level}/seed/{last}", b"seed"),
                                           Message(f"{level}/seed2/{last}", b"seed")])
    for _rank, stream in storage.get_streams("messages", f"{level}/+/{last}"):
        iterator = storage.make_iterator("messages", stream, f"{level}/+/{last}")
        if iterator.pattern == ("+",):
            return iterator
    raise AssertionError("no wildcard stream")


def counter(name: str, layout: str) -> float:
    return REGISTRY.get_sample_value(f"stratamq_ds_layout_{name}_total",
                                     {"db": "messages", "layout": layout}) or 0.0


def test_layout_change_takes_effect_at_the_next_generation(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, V2)
        await storage.store_batch("messages", [Message("t/1", b"v2")])
        await storage.close()
        # a new configuration: the current generation keeps its layout
        storage = await open_storage(tmp_path, BITFIELD)
        assert storage.list_generations("messages")[(0, 1)].layout == "wildcard_optimized_v2"
        await storage.store_batch("messages", [Message("t/1", b"v2 again")])
        await storage.add_generation("messages")
        second = storage.list_generations("messages")[(0, 2)]
        # every option is recorded, the defaults too
        assert (second.layout, second.layout_options) == (
            "wildcard_optimized", {"topic_index_bytes": 8, "bits_per_topic_level": 64,
                                   "epoch_bits": 12})
        await storage.store_batch("messages", [Message("t/1", b"bitfield")])
        await storage.close()
        # back to v2: generation 2 stays bit-field and readable; generation 3 is v2
        storage = await open_storage(tmp_path, V2)
        await storage.add_generation("messages")
        await storage.store_batch("messages", [Message("t/1", b"v2 last")])
        assert [info.layout for info in storage.list_generations("messages").values()] == [
            "wildcard_optimized_v2", "wildcard_optimized", "wildcard_optimized_v2"]
        assert [m.payload for m in await read_filter(storage, "messages", "t/+")] == [
            b"v2", b"v2 again", b"bitfield", b"v2 last"]
        await storage.close()
    run(scenario())


def test_wildcard_reads_stop_at_the_open_epoch_and_exact_reads_do_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        # epochs of 2**30 µs (~18 minutes): the epoch being written stays open
        options = DbOptions(n_shards=1, flush_interval=0.0005, wildcard_thresholds=(1, 1),
                            layout="wildcard_optimized", layout_options={"epoch_bits": 30})
        storage, shard_set = await open_storage_with_shards(tmp_path, options)
        await storage.store_batch("messages", [Message(f"s/{n}/t", b"%d" % n) for n in range(5)])
        shard = shard_set.shards[0]
        generation = shard.current
        assert isinstance(generation.layout, WildcardOptimized)
        # thresholds of 1: the first second level is exact, the others go through `+`
        (match,) = [m for m in generation.trie.match(["s", "+", "t"]) if m.pattern == ("+",)]
        horizon = shard.settled_before()

        def read(pattern: tuple[str, ...], filter_levels: list[str]) -> tuple[int, ReadStats]:
            stats = ReadStats()
            found = generation.layout.read(generation.data, match.static, pattern,
                                           filter_levels, 0, 100, stats, horizon)
            return len(found), stats

        found, stats = read(("+",), ["s", "+", "t"])
        assert found == 0 and stats.wait_until == ((horizon >> 30) + 1) << 30
        found, stats = read(("3",), ["s", "3", "t"])
        assert found == 1 and stats.wait_until is None
        # a closed generation has no open epoch
        assert len(generation.layout.read(generation.data, match.static, ("+",),
                                          ["s", "+", "t"], 0, 100, ReadStats(), None)) == 4
        # an open epoch with nothing for the reader is no reason to wait
        stats = ReadStats()
        assert generation.layout.read(generation.data, match.static, ("+",), ["s", "+", "t"],
                                      now_us(), 100, stats, horizon) == []
        assert stats.wait_until is None
        await storage.close()
    run(scenario())


def test_a_wildcard_reader_gets_the_open_epoch_once_it_closes(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, BITFIELD)  # epochs of ~4 ms
        iterator = await wildcard_stream(storage, "w", "x")
        sent = [Message(f"w/{n}/x", b"%d" % n) for n in range(40)]
        await storage.store_batch("messages", sent)
        # straight after the write its epoch is (almost always) open: next waits
        # for it to close rather than answer "caught up" with nothing
        got: list[bytes] = []
        while len(got) < len(sent):
            result = await storage.next("messages", iterator, 100)
            assert not isinstance(result, EndOfStream)
            iterator, batch = result
            assert batch, f"an empty answer after {len(got)} of {len(sent)} messages"
            got += [m.payload for _k, m in batch if m.payload != b"seed"]
        assert got == [m.payload for m in sent]
        await storage.close()
    run(scenario())


def test_streams_sharing_a_topic_index_byte_never_mix(tmp_path: Path) -> None:
    async def scenario() -> None:
        # 1 byte of topic index, 2 bits a level: with 120 streams many share a key
        # prefix, and levels share hashes
        options = DbOptions(n_shards=1, flush_interval=0.0005, wildcard_thresholds=(200, 4),
                            layout="wildcard_optimized",
                            layout_options={"topic_index_bytes": 1, "bits_per_topic_level": 2,
                                            "epoch_bits": 10})
        storage, shard_set = await open_storage_with_shards(tmp_path, options)
        sent = [Message(f"{a}/{b}", b"%d" % n)
                for n, (a, b) in enumerate((f"s{a}", f"d{b}") for a in range(120)
                                           for b in range(6))]
        await storage.store_batch("messages", sent)
        generation = shard_set.shards[0].current
        prefixes = Counter(match.static[:1] for match in generation.trie.match(["#"]))
        assert max(prefixes.values()) > 1  # the case under test happens
        collisions = counter("hash_collisions", "wildcard_optimized")
        for topic_filter in ("#", "+/+", "s7/+", "s7/d5", "+/d1"):
            got = [m.payload for m in await read_filter(storage, "messages", topic_filter)]
            expected = [m.payload for m in sent if _matches(topic_filter, m.topic)]
            assert sorted(got) == sorted(expected), topic_filter
        assert counter("hash_collisions", "wildcard_optimized") > collisions
        await storage.close()
    run(scenario())


def _matches(topic_filter: str, topic: str) -> bool:
    from stratamq.broker.topic import topic_matches
    return topic_matches(topic_filter, topic)


def test_read_message_finds_a_message_by_timestamp(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = await open_storage(tmp_path, BITFIELD)
        stream = (await wildcard_stream(storage, "r", "q")).stream
        await storage.store_batch("messages", [Message(f"r/{n}/q", b"%d" % n)
                                               for n in range(12)])
        stored = [m for m in await read_filter(storage, "messages", "r/+/q")
                  if m.payload != b"seed"]
        assert len(stored) == 12
        for message in stored:
            found = await storage.read_message("messages", stream, message.timestamp)
            assert found is not None and found.payload == message.payload
        assert await storage.read_message("messages", stream, stored[-1].timestamp + 1) is None
        await storage.close()
    run(scenario())


def test_both_layouts_count_seeks_and_nexts(tmp_path: Path) -> None:
    async def scenario() -> None:
        before = {(name, layout): counter(name, layout) for name in ("seek", "next")
                  for layout in ("wildcard_optimized", "wildcard_optimized_v2")}
        storage = await open_storage(tmp_path, V2)
        await storage.store_batch("messages", [Message(f"c/{n}/z", b"") for n in range(20)])
        await storage.close()
        storage = await open_storage(tmp_path, BITFIELD)
        await storage.add_generation("messages")
        await storage.store_batch("messages", [Message(f"c/{n}/z", b"") for n in range(20)])
        assert len(await read_filter(storage, "messages", "c/+/z")) == 40
        assert len(await read_filter(storage, "messages", "c/4/z")) == 2
        assert len(await read_filter(storage, "messages", "c/#")) == 40
        for key, value in before.items():
            assert counter(*key) > value, key
        await storage.close()
    run(scenario())


def test_a_reader_waits_for_messages_past_the_open_epoch(tmp_path: Path) -> None:
    """Timestamps may run ahead of the clock (a clash becomes last + 1): messages in
    epochs after the open one still make a wildcard reader wait, not end."""
    async def scenario() -> None:
        # epochs of 2**12 µs
        storage, shard_set = await open_storage_with_shards(tmp_path, BITFIELD)
        iterator = await wildcard_stream(storage, "p", "q")
        await storage.store_batch("messages", [Message("p/a/q", b"a")])
        generation = shard_set.shards[0].current
        stored = generation.layout.read(generation.data, iterator.stream.static, ("+",),
                                        ["p", "+", "q"], 0, 100, ReadStats(), None)
        last = max(peek_timestamp(value) for _key, value in stored)
        # the next message in a later epoch: sleep past the end of `last`'s
        await asyncio.sleep(max((((last >> 12) + 1) << 12) - now_us(), 0) / 1e6 + 0.001)
        await storage.store_batch("messages", [Message("p/b/q", b"b")])
        # a reader past everything of `last`'s epoch, with the clock (horizon) still
        # in that epoch: the later message is beyond the open epoch
        stats = ReadStats()
        assert generation.layout.read(generation.data, iterator.stream.static, ("+",),
                                      ["p", "+", "q"], last, 100, stats, last) == []
        assert stats.wait_until is not None and stats.wait_until > ((last >> 12) + 1) << 12
        await storage.close()
    run(scenario())


def test_the_horizon_never_passes_a_batch_being_cooked(tmp_path: Path) -> None:
    """Readers take `settled_before()` in the executor's threads while the loop cooks
    a batch (`Shard.prepare`): at every line of the cooking it must stay at most the
    first timestamp the batch takes, or a reader's horizon passes messages not yet
    written (and a wildcard reader of the epoch layout takes their epoch as read to
    its end, never to read it again). It passed them between the clock read and the
    mark of the batch as unsettled: a thread switch there gave a horizon of `now`."""
    async def scenario() -> None:
        storage, shard_set = await open_storage_with_shards(tmp_path, BITFIELD)
        await storage.store_batch("messages", [Message("s/a/t", b"first")])
        shard = shard_set.shards[0]
        horizons: list[int] = []

        def every_line(frame: FrameType, event: str, _arg: object) -> Any:
            if event == "line":
                horizons.append(shard.settled_before())  # as a reader's thread would
            return every_line

        def trace(frame: FrameType, event: str, _arg: object) -> Any:
            return every_line if frame.f_code is Shard.prepare.__code__ else None

        sys.settrace(trace)
        try:
            cooked = shard.prepare([Message("s/b/t", b"second"), Message("s/c/t", b"third")])
        finally:
            sys.settrace(None)
        first = cooked.last_timestamp - 1  # the batch's two timestamps end there
        assert horizons and max(horizons) <= first, (max(horizons), first)
        shard.forget(cooked)
        await storage.close()
    run(scenario())
