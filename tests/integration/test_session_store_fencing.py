"""A client id's owner epoch fences more than its session record: the ids of its
inbound QoS 2 messages (kept with its messages, in another database) too. A site
that has lost the client id to another must not store, release or forget them: a
late store the new owner did not see when it loaded the ids lets a resend be
stored twice, and a late forget lets the new owner take a resend for a new message.
Two sites' stores on one real storage (their fenced writes are checked where they
are cooked, as on a shard's leader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamq.broker.core.broker import SESSIONS_DB
from stratamq.broker.ds import DbOptions, DurableStorage, FencedError, Message
from stratamq.broker.session.store import SessionStore
from tests.support.storage import run

CLIENT = "sensor-7"


def test_a_site_that_lost_the_client_id_can_no_longer_touch_its_qos2_ids(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        try:
            messages = await storage.open_db("messages", DbOptions(n_shards=2))
            sessions_db = await storage.open_kv_db(SESSIONS_DB, 2, False)
            old = SessionStore(sessions_db, messages, owner="site-a")
            new = SessionStore(sessions_db, messages, owner="site-b")

            def published(n: int) -> Message:
                return Message("t/qos2", f"m{n}".encode(), CLIENT, 2)

            await old.claim(CLIENT, 1)
            for packet_id in (5, 6):
                for done in old.submit_qos2(published(packet_id), True, packet_id, 1):
                    await done
            await new.claim(CLIENT, 2)
            assert await new.inbound_qos2_ids(CLIENT) == {5, 6}

            with pytest.raises(FencedError):  # a PUBLISH the old site read late
                for done in old.submit_qos2(published(7), True, 7, 1):
                    await done
            with pytest.raises(FencedError):  # its PUBREL
                for done in old.release_qos2(CLIENT, 5, 1):
                    await done
            with pytest.raises(FencedError):  # the old site ending its copy
                await old.forget_qos2(CLIENT, 1)
            assert await new.inbound_qos2_ids(CLIENT) == {5, 6}

            # the owner's own writes go on
            for done in new.release_qos2(CLIENT, 5, 2):
                await done
            for done in new.submit_qos2(published(8), True, 8, 2):
                await done
            assert await new.inbound_qos2_ids(CLIENT) == {6, 8}
            await new.forget_qos2(CLIENT, 2)
            assert await new.inbound_qos2_ids(CLIENT) == set()
        finally:
            await storage.close()
    run(scenario())


def test_a_session_takes_only_its_own_qos2_ids_not_those_an_ended_one_left(
        tmp_path: Path) -> None:
    """A session that ended forgets its inbound QoS 2 ids; when that forget failed (no
    majority in reach, say: it was only logged), the ids stayed, and a later session of
    the client id loaded them as its own when it was restored: a new message with such
    an id was answered as a resend, acknowledged and never stored. Each record holds
    the incarnation of the session that stored it; a session loads and recognises only
    its own (a session stored before incarnations, 0, only the untagged ones)."""
    async def scenario() -> None:
        storage = DurableStorage(tmp_path)
        try:
            messages = await storage.open_db("messages", DbOptions(n_shards=2))
            store = SessionStore(await storage.open_kv_db(SESSIONS_DB, 2, False), messages)

            def published(n: int) -> Message:
                return Message("t/qos2", f"m{n}".encode(), CLIENT, 2)

            ended, later = 0x1234, 0x5678
            for packet_id in (5, 7):  # left by the session that ended
                for done in store.submit_qos2(published(packet_id), True, packet_id,
                                              incarnation=ended):
                    await done
            assert await store.inbound_qos2_ids(CLIENT, later) == set()
            assert not await store.qos2_stored(CLIENT, 7, later)
            for done in store.submit_qos2(published(8), True, 8, incarnation=later):
                await done
            assert await store.inbound_qos2_ids(CLIENT, later) == {8}
            assert await store.qos2_stored(CLIENT, 8, later)
            # id 7 again, by the later session: its own from now on
            for done in store.submit_qos2(published(7), True, 7, incarnation=later):
                await done
            assert await store.inbound_qos2_ids(CLIENT, later) == {7, 8}
            assert await store.inbound_qos2_ids(CLIENT, ended) == {5}
            # a session stored before incarnations (or restored from an older site's
            # record in a rolling upgrade, which dropped its incarnation) takes them
            # all, as before them; an untagged record is no tagged session's
            for done in store.submit_qos2(published(9), True, 9):
                await done
            assert await store.inbound_qos2_ids(CLIENT) == {5, 7, 8, 9}
            assert await store.qos2_stored(CLIENT, 9, 0)
            assert not await store.qos2_stored(CLIENT, 9, later)
        finally:
            await storage.close()
    run(scenario())
