"""The publish path: store a message and its retained copy; delivery follows from
the commit feed (see dispatch.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from ..ds import Database, Message, shard_of
from ..errors import InvalidTopicError, StratamqError
from ..metrics import MESSAGES_DROPPED
from ..session.store import SessionStore
from ..topic import check_topic
from .retained import RetainedStore

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, messages: Database, store: SessionStore,
                 retained: RetainedStore) -> None:
        self._messages = messages
        self._store = store
        self._retained = retained

    def publish_will(self, message: Message, will_id: int = 0
                     ) -> list[asyncio.Future[None]]:
        """Publish a will message; the futures resolve once it is stored. Its topic
        came in a CONNECT and was stored with the session: it is checked here, and a
        will on a topic no client could publish to is dropped and counted. With a
        `will_id` (`WillRecord.will_id`), stored with it: see `publish_will_once`."""
        try:
            check_topic(message.topic)
        except InvalidTopicError:
            log.warning("will of %r on invalid topic %r dropped", message.client_id,
                        message.topic)
            MESSAGES_DROPPED.labels("invalid_will_topic").inc()
            return []
        if not will_id:
            return self.publish(message, wait=True)
        return self._with_retained(message, self._store.submit_will(message, will_id),
                                   wait=True)

    async def forget_will(self, client_id: str) -> None:
        """The client's will is stored and no record of its session holds it: its will
        record goes (`SessionStore.forget_will`); a failure is only said (the end of
        the client id's next session deletes it, `SessionStore.forget_qos2`)."""
        try:
            await self._store.forget_will(client_id)
        except StratamqError as exc:
            log.warning("will record of %r not deleted: %s", client_id, exc.message)

    async def publish_will_once(self, message: Message, will_id: int, retried: bool) -> None:
        """Publish a will and wait until it is stored, once: when this is a retry
        (`retried`: an earlier try failed, its outcome not known, or another pass may
        have published it) the will found stored (`SessionStore.will_stored`) is not
        stored again, only its retained copy, which may be what failed. Raises what the
        storage raised. A will stored before wills had ids (`will_id` 0) is published
        again on every try, as before."""
        if retried and will_id and await self._store.will_stored(message.client_id, will_id):
            if message.retain:
                await self.store_retained(message)
            return
        await all_stored(self.publish_will(message, will_id))

    def publish(self, message: Message, wait: bool) -> list[asyncio.Future[None]]:
        """Store a QoS 0 or 1 message (and its retained copy) whose topic name the
        caller has validated (the channel does, for a PUBLISH). With `wait`, the
        futures resolve once everything is durable. (A resend after a failure writes
        both again.)"""
        # the channel validated the topic name (and a will's, at CONNECT)
        waits = self._messages.submit([message], wait, topics_checked=True)
        return self._with_retained(message, waits, wait)

    def publish_qos2(self, message: Message, packet_id: int, owner_epoch: int,
                     incarnation: int) -> list[asyncio.Future[None]]:
        """Store an inbound QoS 2 message (topic validated by the caller); the futures
        resolve once it is durable. Its packet id is recorded in the same atomic write
        as the message, so a PUBLISH resent after a failure is recognised, never stored
        twice (exactly once), while `owner_epoch` is the client id's (in a cluster;
        else FencedError); the record is session `incarnation`'s.

        Its retained copy is not written here: the caller stores it first
        (`store_retained`), since a resend found recorded is not stored again, so a
        retained copy written beside the message that failed alone would never be
        written, the client told PUBREC all the same."""
        return self._store.submit_qos2(message, True, packet_id, owner_epoch, incarnation)

    async def store_retained(self, message: Message) -> None:
        """Store a RETAIN message's retained copy (an empty payload deletes the
        topic's) and return once it is durable; raises what the storage raised.

        A task, as `_with_retained` starts one for a QoS 0/1 message: tasks start in
        the order they were made, so this copy is written after those of the messages
        published before it (the store's lock then keeps that order), and a topic
        keeps the last one published. Called directly, it took the free lock before
        a task made earlier had started."""
        await asyncio.ensure_future(self._retained.store(self._retained_copy(message)))

    def _with_retained(self, message: Message, waits: list[asyncio.Future[None]],
                       wait: bool) -> list[asyncio.Future[None]]:
        """`waits` (the message's write), and the write of its retained copy when it
        has the RETAIN flag (waited for too with `wait`)."""
        if message.retain:
            task = asyncio.ensure_future(self._retained.store(self._retained_copy(message)))
            if wait:
                waits.append(task)
        return waits

    @staticmethod
    def _retained_copy(message: Message) -> Message:
        # The stored message gets its timestamp when its batch is cooked, later; the
        # retained copy needs one now: its expiry interval counts from it.
        return dataclasses.replace(message, timestamp=time.time_ns() // 1000)

    def has_room(self, client_id: str) -> bool:
        """Whether the write buffer that takes `client_id`'s messages has room now (the
        hot path asks this, and awaits `wait_for_room` only when it has not)."""
        return self._messages.has_room(shard_of(client_id, self._messages.options.n_shards))

    async def wait_for_room(self, client_id: str) -> None:
        """Return once the write buffer that takes `client_id`'s messages has room
        (at once when it has)."""
        await self._messages.wait_for_room(client_id)

    async def qos2_stored(self, client_id: str, packet_id: int, incarnation: int) -> bool:
        """Whether session `incarnation` of `client_id` stored an inbound QoS 2 message
        with this packet id (read past a barrier: see SessionStore)."""
        return await self._store.qos2_stored(client_id, packet_id, incarnation)

    def release_qos2(self, client_id: str, packet_id: int,
                     owner_epoch: int = 0) -> list[asyncio.Future[None]]:
        """PUBREL: forget the packet id, durably, before PUBCOMP lets the client
        reuse it."""
        return self._store.release_qos2(client_id, packet_id, owner_epoch)


def all_stored(waits: list[asyncio.Future[None]]) -> asyncio.Future[None]:
    """One future for a message's writes (the message, its retained copy): done once
    every one is, failed with the first failure. Not `asyncio.gather`, which fails
    at the first failure while the others still run: a QoS 2 message marked unknown
    then, its write still under way, was stored a second time by its resend."""
    if len(waits) == 1:
        return waits[0]
    combined: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gathered = asyncio.gather(*waits, return_exceptions=True)

    def settle(done: asyncio.Future[list[BaseException | None]]) -> None:
        if combined.done():
            return
        if done.cancelled():
            combined.cancel()
            return
        failures = [outcome for outcome in done.result() if isinstance(outcome, BaseException)]
        if failures:
            combined.set_exception(failures[0])
        else:
            combined.set_result(None)
    gathered.add_done_callback(settle)
    return combined
