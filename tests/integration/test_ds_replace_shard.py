"""A copy of a shard that is not (yet) what its leader holds: a shard folder swapped in
(a checkpoint install, or the empty shard a site keeps once it left a replica set)
brings data no reader here was fed, so readers of that shard get a feed gap and read
it from storage; and a copy behind the one a stream came from reads a generation it
has not made yet as empty, never as the end of that stream."""

from __future__ import annotations

from pathlib import Path

from stratamq.broker.ds import END_OF_STREAM, DbOptions, DurableStorage, Message
from stratamq.broker.ds.replication.bootstrap import stage_empty_shard
from tests.support.storage import open_with_shards, run

OPTIONS = DbOptions(n_shards=2, flush_interval=0.001)


def test_a_swapped_in_shard_tells_its_readers_of_a_gap(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database, shard_set = await open_with_shards(storage, "messages", OPTIONS)
        await storage.store_batch("messages", [Message(f"t/{n}", b"x", client_id="c")
                                               for n in range(4)])
        gaps: list[int] = []
        database.add_feed_gap_listener(lambda shard, _since: gaps.append(shard))
        stage_empty_shard(shard_set.shards[1].path)
        await shard_set.replace_shard(1)
        assert gaps == [1]
        await storage.close()
    run(scenario())


def test_a_generation_not_made_here_yet_reads_empty_and_a_dropped_one_ends(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        ahead = DurableStorage(tmp_path / "ahead")
        behind = DurableStorage(tmp_path / "behind")
        await ahead.open_db("messages", OPTIONS)
        _behind_db, behind_copy = await open_with_shards(behind, "messages", OPTIONS)
        await ahead.add_generation("messages")
        await ahead.store_batch("messages", [Message("t/1", b"x", client_id="c")])
        (_rank, stream), = [found for found in ahead.get_streams("messages", "t/#")
                            if found[1].generation == 2]
        iterator = ahead.make_iterator("messages", stream, "t/#")
        assert await behind_copy.next(iterator, 10) == (iterator, [])
        # once the copy is past that generation and it is gone: its end
        await behind.add_generation("messages")
        await behind.add_generation("messages")
        await behind.drop_generation("messages", stream.shard, 2)
        assert await behind_copy.next(iterator, 10) is END_OF_STREAM
        await ahead.close()
        await behind.close()
    run(scenario())
