"""A session's inbound QoS 2 packet identifiers: which messages the client sent at
QoS 2 are stored and wait for their PUBREL, so a resend (DUP) is not stored twice.

An identifier counts as received once its message's store succeeds, whatever becomes
of the connection; the ids are recorded with the messages in storage
(`SessionStore.submit_qos2`) and loaded from there when a session is restored."""

from __future__ import annotations

import asyncio
from typing import Any


class InboundQos2:
    def __init__(self) -> None:
        # stored, awaiting PUBREL
        self._received: set[int] = set()
        # whose store is under way: a resend (DUP) waits for it, on this connection or
        # a later one, instead of storing the message a second time
        self._storing: dict[int, asyncio.Future[Any]] = {}
        # whose store failed: it may have been committed all the same (a leader that
        # stepped down or timed out after the entry reached a majority), so a resend
        # asks the storage instead of storing again
        self._unknown: set[int] = set()
        # whose release (a PUBREL's durable delete of the id) is under way
        self._releasing: dict[int, asyncio.Future[Any]] = {}

    def load(self, packet_ids: set[int]) -> None:
        self._received = packet_ids
        self._unknown.clear()

    def pending(self, packet_id: int) -> bool:
        """Stored and not released yet."""
        return packet_id in self._received

    def storing(self, packet_id: int, store: asyncio.Future[Any]) -> None:
        """The message with this packet id is being stored by `store`."""
        self._storing[packet_id] = store
        store.add_done_callback(lambda done: self._stored(packet_id, done))

    def _stored(self, packet_id: int, store: asyncio.Future[Any]) -> None:
        if self._storing.get(packet_id) is store:
            del self._storing[packet_id]
        if not store.cancelled() and store.exception() is None:
            self._received.add(packet_id)
        elif packet_id not in self._received:
            self._unknown.add(packet_id)

    def unknown(self, packet_id: int) -> bool:
        """Whether a store of this packet id failed with an outcome not known yet."""
        return packet_id in self._unknown

    def known(self, packet_id: int, stored: bool) -> None:
        """The storage told whether the message with this packet id is stored."""
        self._unknown.discard(packet_id)
        if stored:
            self._received.add(packet_id)

    def store_under_way(self, packet_id: int) -> asyncio.Future[Any] | None:
        """The store under way of the message with this packet id, if any."""
        return self._storing.get(packet_id)

    async def settled(self) -> None:
        """Wait until no store is under way (failed ones included)."""
        while self._storing:
            await asyncio.wait(list(self._storing.values()))

    def to_release(self, packet_id: int) -> bool:
        """Whether a PUBREL of this packet id forgets it (durably, then PUBCOMP): it
        is stored, or its store's or release's outcome is not known, or a release is
        under way (a PUBREL resent on a new connection meanwhile releases it again,
        and is answered once that release is done). Else the PUBREL is answered at
        once: the exchange ended before."""
        return packet_id in self._received or packet_id in self._unknown \
            or packet_id in self._releasing

    def releasing(self, packet_id: int, release: asyncio.Future[Any]) -> None:
        """A PUBREL: `release` forgets the packet id durably. The id is free once it
        succeeds. If it fails, the id's record may still be stored (to be loaded
        with the session again, a new message with the id taken for a resend): the
        id is unknown, and a resent PUBREL releases it again; the client reuses it
        only after a PUBCOMP."""
        self._received.discard(packet_id)
        self._unknown.discard(packet_id)
        self._releasing[packet_id] = release
        release.add_done_callback(lambda done: self._released(packet_id, done))

    def _released(self, packet_id: int, release: asyncio.Future[Any]) -> None:
        if self._releasing.get(packet_id) is release:
            del self._releasing[packet_id]
        if (release.cancelled() or release.exception() is not None) \
                and packet_id not in self._releasing and packet_id not in self._received:
            self._unknown.add(packet_id)
