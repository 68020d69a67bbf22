"""Before a closed generation is dropped, pre-drop listeners are awaited while it can
still be read (so the broker can count what sessions lose with it); a current
generation, which cannot be dropped, does not call them."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.broker.ds import DbOptions, DurableStorage, Message
from stratamq.broker.errors import GenerationError
from tests.support.storage import read_filter, run

FAST = DbOptions(n_shards=1, flush_interval=0.001)


def test_pre_drop_listeners_read_the_generation_before_it_goes(tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        database = await storage.open_db("messages", FAST)
        await storage.store_batch("messages", [Message(f"t/{n}", b"x", client_id="c")
                                               for n in range(3)])
        seen: list[tuple[int, int, int]] = []
        dropped: list[tuple[int, int]] = []

        async def before(shard: int, generation: int) -> None:
            assert (shard, generation) not in dropped
            seen.append((shard, generation, len(await read_filter(storage, "messages",
                                                                  "t/#"))))

        database.add_generation_pre_drop_listener(before)
        database.add_generation_drop_listener(lambda s, g: dropped.append((s, g)))
        with pytest.raises(GenerationError):  # the current one cannot go
            await storage.drop_generation("messages", 0, 1)
        assert seen == []
        await storage.add_generation("messages")
        await storage.drop_generation("messages", 0, 1)
        assert seen == [(0, 1, 3)]
        assert dropped == [(0, 1)]
        assert await read_filter(storage, "messages", "t/#") == []
        await storage.close()
    run(scenario())
