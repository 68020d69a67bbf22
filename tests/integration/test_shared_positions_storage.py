"""Where a site keeps its shared groups' positions: a record per group and site in the
`sessions` database (shared/positions.py), real storage. A site finds its own
records again (not too old ones, not damaged ones, not others'); a group's record
follows its positions and goes with the group; a client whose session another site
owns now is not waited for; the site its session moved to takes the group along."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from stratamq.broker.core.broker import SESSIONS_DB
from stratamq.broker.core.dispatch import Dispatcher
from stratamq.broker.ds import DbOptions, DurableStorage
from stratamq.broker.session.store import SessionStore
from stratamq.broker.shared.groups import AbsentGroup
from stratamq.broker.shared.positions import (
    SharedPositions,
    decode,
    encode,
)
from tests.support.storage import run

KEEP_FOR = 3600.0


async def open_stores(storage: DurableStorage, *owners: str) -> list[SessionStore]:
    """A store per site (owner) on the one storage."""
    messages = await storage.open_db("messages", DbOptions(n_shards=2))
    sessions_db = await storage.open_kv_db(SESSIONS_DB, 2, False)
    return [SessionStore(sessions_db, messages, owner) for owner in owners]


async def open_store(storage: DurableStorage) -> SessionStore:
    return (await open_stores(storage, ""))[0]


def positions(dispatcher: Dispatcher, store: SessionStore, site: str) -> SharedPositions:
    return SharedPositions(dispatcher, store, site, KEEP_FOR, load_wait=5.0)


@contextlib.asynccontextmanager
async def site_a(storage_dir: Path
                 ) -> AsyncIterator[tuple[SessionStore, Dispatcher, SharedPositions]]:
    """Site a's store, dispatcher and positions (not loaded yet) on a fresh storage."""
    storage = DurableStorage(storage_dir)
    try:
        store = await open_store(storage)
        dispatcher = Dispatcher()
        yield store, dispatcher, positions(dispatcher, store, "a")
    finally:
        await storage.close()


def test_a_site_finds_the_groups_it_kept_and_only_those(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with site_a(tmp_path) as (store, dispatcher, kept):
            now = time.time()
            await store.save_group("g/t/#", "a", encode(AbsentGroup({0: 5}, {"x"}), now))
            await store.save_group("g/t/#/more", "a",
                                   encode(AbsentGroup({1: 6}, {"y"}), now))
            await store.save_group("old/t", "a", encode(AbsentGroup({0: 1}, {"z"}),
                                                        now - 2 * KEEP_FOR))
            await store.save_group("bad/t", "a", b"{not json")
            await store.save_group("g/t/#", "b", encode(AbsentGroup({0: 1}, {"w"}), now))
            await kept.load()
            assert dispatcher.absent == {"g/t/#": AbsentGroup({0: 5}, {"x"}),
                                         "g/t/#/more": AbsentGroup({1: 6}, {"y"})}
            # the first save writes what is kept, and deletes what is not
            await kept.save()
            assert sorted(await store.groups_kept_by("a")) == ["g/t/#", "g/t/#/more"]
            assert kept.saved == {"g/t/#": ["x"], "g/t/#/more": ["y"]}
            # another site's record is its own
            assert sorted(await store.groups_kept_by("b")) == ["g/t/#"]
            # the last member away ends: the record goes at the next save
            dispatcher.session_ended("y")
            await kept.save()
            assert sorted(await store.groups_kept_by("a")) == ["g/t/#"]
    run(scenario())


def test_a_record_is_written_when_its_group_moved_and_not_otherwise(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with site_a(tmp_path) as (store, dispatcher, kept):
            await kept.load()
            dispatcher.adopt_absent({"g/t": AbsentGroup({0: 5}, {"x"})})
            await kept.save()
            first = (await store.groups_kept_by("a", ["g/t"])).get("g/t")
            assert first is not None
            await asyncio.sleep(0.01)
            await kept.save()  # nothing moved: not written again
            assert (await store.groups_kept_by("a", ["g/t"])).get("g/t") == first
            dispatcher.adopt_absent({"g/t": AbsentGroup({0: 3}, {"v"})})
            await kept.save()
            moved = (await store.groups_kept_by("a", ["g/t"])).get("g/t")
            assert moved is not None
            assert decode(moved)[0] == AbsentGroup({0: 3}, {"v", "x"})
    run(scenario())


def test_groups_joined_are_written_at_once_and_only_those(tmp_path: Path) -> None:
    """`save_joined` (before a SUBACK) writes the groups named, when they changed. Before
    the site's load it loads first (a write would replace what is still to be read);
    it wrote nothing then, and the SUBACK went out with the group unstored."""
    async def scenario() -> None:
        async with site_a(tmp_path) as (store, dispatcher, kept):
            earlier = encode(AbsentGroup({2: 4}, {"w"}), time.time())
            await store.save_group("g/t", "a", earlier)  # kept before a restart
            dispatcher.adopt_absent({"g/t": AbsentGroup({0: 5}, {"x"}),
                                     "h/t": AbsentGroup({1: 6}, {"y"})})
            await kept.save_joined(["g/t", "not/kept"])  # the load not done yet
            stored = await store.groups_kept_by("a")
            assert sorted(stored) == ["g/t"]
            assert decode(stored["g/t"])[0] == AbsentGroup({0: 5, 2: 4}, {"w", "x"})
            assert kept.saved == {"g/t": ["w", "x"]}
            await asyncio.sleep(0.01)
            await kept.save_joined(["g/t"])  # nothing changed: not written again
            assert (await store.groups_kept_by("a"))["g/t"] == stored["g/t"]
            await kept.load()  # the background load, later: done already, harmless
            assert sorted(await store.groups_kept_by("a")) == ["g/t"]
    run(scenario())


def test_a_session_that_moved_takes_its_groups_along(tmp_path: Path) -> None:
    """Site a kept group g for clients x and y; x's session is site b's now. Site b
    reads the group from a's record, for x alone; a, restarted, waits for y only."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        try:
            site_a, site_b = await open_stores(storage, "a", "b")
            for client in ("x", "y"):
                await site_a.claim(client, 1)
            await site_a.save_group("g/t", "a", encode(AbsentGroup({0: 5, 1: 7}, {"x", "y"}),
                                                       time.time()))
            await site_b.claim("x", 2)
            at_b = positions(Dispatcher(), site_b, "b")
            assert await at_b.kept_for("x", "a", ["g/t", "h/t"]) == {
                "g/t": AbsentGroup({0: 5, 1: 7}, {"x"})}
            assert await at_b.kept_for("q", "a", ["g/t"]) == {}  # not waited for
            dispatcher = Dispatcher()
            await positions(dispatcher, site_a, "a").load()
            assert dispatcher.absent == {"g/t": AbsentGroup({0: 5, 1: 7}, {"y"})}
        finally:
            await storage.close()
    run(scenario())

