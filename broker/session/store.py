"""Where sessions live in storage: the one owner of the key schemas of session
records (in the `sessions` database: the head `s/<client>`, and one part per
subscription, cursor and finished cursor, `sp/<len><client><kind><name>`), of the
positions a site keeps for its shared groups (`g/<len><group key><site>`, also in
`sessions`, with the group's shard) and of inbound QoS 2 records
(`qos2/<len><client><packet id>`, kept with the client's messages in the `messages`
database, each holding the incarnation of the session that stored it: see
`qos2_tag`). Nothing else reads or writes these keys.

On a replicated site (`owner` set: this site's id) a session record is written fenced
by its owner epoch (`ds.fence`): a site takes a client id with `claim`, which moves
the epoch on at the shard's leader, and the writes of the site that held it before
carry an older epoch and are refused (FencedError). The claim moves the epoch of the
client's inbound QoS 2 records on too (they are in another database, so they have a
fence of their own), before the new owner reads them: a write of the old owner is
either in what the new one reads or refused.

A save writes the head and only the parts that differ from those known to be stored
(`StoredParts`), with the deletes of the parts gone, in one atomic batch under the
head's fence: a SUBSCRIBE on a session of 1,000 subscriptions writes one part, not
1,000. Parts are absolute values, never increments, so writing one again (after a
write whose outcome is unknown) is harmless."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from ..ds import Consistency, Database, Fence, KvDatabase, Message
from .model import (
    CursorState,
    SessionRecord,
    StoredParts,
    Subscription,
    changed_names,
    cursor_from_json,
    cursor_to_json,
    subscription_from_json,
    subscription_to_json,
)

_SESSION_KEY = b"s/"
# Not under `s/`: a scan of the heads sees one entry per session.
_PART_KEY = b"sp/"
_SUBSCRIPTION_PART = b"s"
_CURSOR_PART = b"c"
_DONE_PART = b"d"


def _session_key(client_id: str) -> bytes:
    return _SESSION_KEY + client_id.encode()


def _length_prefixed(name: str) -> bytes:
    raw = name.encode("utf-8")
    return len(raw).to_bytes(2, "big") + raw


def _parts_prefix(client_id: str) -> bytes:
    # length-prefixed, so client "a" never sees the parts of client "a/b"
    return _PART_KEY + _length_prefixed(client_id)


def _part_key(prefix: bytes, kind: bytes, name: str) -> bytes:
    return prefix + kind + name.encode("utf-8")


def _changed_parts(client_id: str, stored: StoredParts, current: StoredParts
                   ) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The puts and deletes that turn the `stored` parts into the `current` ones."""
    prefix = _parts_prefix(client_id)
    puts: list[tuple[bytes, bytes]] = []
    deletes: list[bytes] = []
    changed, gone = changed_names(stored.subscriptions, current.subscriptions)
    puts += [(_part_key(prefix, _SUBSCRIPTION_PART, name),
              subscription_to_json(current.subscriptions[name])) for name in changed]
    deletes += [_part_key(prefix, _SUBSCRIPTION_PART, name) for name in gone]
    changed, gone = changed_names(stored.cursors, current.cursors)
    puts += [(_part_key(prefix, _CURSOR_PART, name), cursor_to_json(current.cursors[name]))
             for name in changed]
    deletes += [_part_key(prefix, _CURSOR_PART, name) for name in gone]
    changed, gone = changed_names(stored.done, current.done)
    puts += [(_part_key(prefix, _DONE_PART, name), b"") for name in changed]
    deletes += [_part_key(prefix, _DONE_PART, name) for name in gone]
    return puts, deletes


_GROUP_KEY = b"g/"


def _group_key(group_key: str, site: str) -> bytes:
    # length-prefixed, so the records of group "a" and of group "a/b" never mix
    return _GROUP_KEY + _length_prefixed(group_key) + site.encode("utf-8")


def _split_group_key(key: bytes) -> tuple[str, str]:
    """(group key, site) of a group record's key."""
    length = int.from_bytes(key[len(_GROUP_KEY):len(_GROUP_KEY) + 2], "big")
    start = len(_GROUP_KEY) + 2
    return (key[start:start + length].decode("utf-8", "replace"),
            key[start + length:].decode("utf-8", "replace"))


def _qos2_prefix(client_id: str) -> bytes:
    # length-prefixed, so client "a" never sees the records of client "a/b"
    return b"qos2/" + _length_prefixed(client_id)


def _qos2_key(client_id: str, packet_id: int) -> bytes:
    return _qos2_prefix(client_id) + packet_id.to_bytes(2, "big")


def _will_key(client_id: str) -> bytes:
    # one per client id: each will published overwrites the one before
    return b"will/" + _length_prefixed(client_id)


def qos2_tag(incarnation: int) -> bytes:
    """What an inbound QoS 2 record holds: the incarnation of the session that stored
    it (`Session.incarnation`; empty for 0, a session stored before incarnations). A
    session loads and recognises only its own: the ids a session that ended left
    behind (its forget failed: no majority in reach, say) are not taken, by a later
    session of that client id, for messages it stored, so a new message with such an
    id is stored, not answered as a resend and lost."""
    return b"" if incarnation == 0 else incarnation.to_bytes(8, "big")


def _owned_by(tag: bytes, incarnation: int) -> bool:
    """Whether a QoS 2 record holding `tag` is session `incarnation`'s. A session of
    incarnation 0 (stored before incarnations, or by an older site in a rolling
    upgrade, which kept none) takes every record, as before them: a record another
    site of this version tagged for it is its own."""
    return incarnation == 0 or tag == qos2_tag(incarnation)


def _qos2_fence(client_id: str, owner_epoch: int, claim: bool = False) -> Fence:
    return Fence(_qos2_prefix(client_id), owner_epoch, claim=claim)


class SessionStore:
    def __init__(self, sessions_db: KvDatabase, messages: Database, owner: str = "") -> None:
        self._sessions_db = sessions_db
        self._messages = messages
        self.owner = owner  # this site's id when writes are fenced, else ""

    @property
    def fenced(self) -> bool:
        return bool(self.owner)

    # -- session records ----------------------------------------------------------

    async def load(self, client_id: str) -> SessionRecord | None:
        """The stored session (its head and parts), or None.

        Two reads, the head and then the parts: no write of the session may come
        between them. Callers read a session no connection here holds, and on a
        replicated site after their claim (a write of the site that held it before
        is refused then), or only to check its user (in the head)."""
        raw = await self._sessions_db.get(client_id, _session_key(client_id))
        if raw is None:
            return None
        record = SessionRecord.head_from_json(raw)
        parts = await self._read_parts(client_id)
        record.subscriptions = list(parts.subscriptions.values())
        record.cursors = parts.cursors
        record.done = list(parts.done)
        return record

    async def _read_parts(self, client_id: str) -> StoredParts:
        prefix = _parts_prefix(client_id)
        subscriptions: dict[str, Subscription] = {}
        cursors: dict[str, CursorState] = {}
        done: dict[str, bool] = {}
        async for page in self._sessions_db.scan_pages(
                prefix, self._sessions_db.shard_of(client_id)):
            for key, value in page:
                kind = key[len(prefix):len(prefix) + 1]
                name = key[len(prefix) + 1:].decode("utf-8")
                if kind == _SUBSCRIPTION_PART:
                    subscriptions[name] = subscription_from_json(value)
                elif kind == _CURSOR_PART:
                    cursors[name] = cursor_from_json(value)
                elif kind == _DONE_PART:
                    done[name] = True
        return StoredParts(subscriptions, cursors, done)

    async def save(self, record: SessionRecord, stored: StoredParts | None = None
                   ) -> StoredParts:
        """Write `record`: its head, and of its parts those that differ from the
        `stored` ones (None when they are not known, after a write whose outcome is
        not: they are read then). Returns the parts stored now, the record's own
        objects: it must not change afterwards."""
        client_id = record.client_id
        if stored is None:
            stored = await self._read_parts(client_id)
        current = record.as_parts()
        puts, deletes = _changed_parts(client_id, stored, current)
        puts.append((_session_key(client_id), record.head_to_json()))
        await self._write(client_id, record.owner_epoch, puts, deletes)
        return current

    async def delete(self, client_id: str, owner_epoch: int = 0) -> None:
        """Delete the session's head and every part of it."""
        deletes = [_session_key(client_id)]
        async for page in self._sessions_db.scan_pages(
                _parts_prefix(client_id), self._sessions_db.shard_of(client_id)):
            deletes += [key for key, _value in page]
        await self._write(client_id, owner_epoch, [], deletes)

    async def _write(self, client_id: str, owner_epoch: int,
                     puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        """One atomic batch in the client's shard, fenced by its owner epoch on a
        replicated site."""
        if self.fenced:
            await self._sessions_db.write_fenced(
                client_id, Fence(_session_key(client_id), owner_epoch),
                puts=puts, deletes=deletes)
        else:
            await self._sessions_db.write(client_id, puts=puts, deletes=deletes)

    # -- ownership (fenced sites only) --------------------------------------------------

    async def owner_of(self, client_id: str) -> tuple[int, str]:
        """The owner epoch of a client id and the site that claimed it (0 and "" while
        nobody has)."""
        epoch, owner = await self._sessions_db.fence_of(client_id, _session_key(client_id))
        return epoch, owner.decode("utf-8", "replace")

    async def claim(self, client_id: str, epoch: int) -> None:
        """Make this site the owner of `client_id` at `epoch` (the stored one plus 1):
        FencedError when another claim of that epoch or a newer one got there first."""
        await self._sessions_db.write_fenced(
            client_id, Fence(_session_key(client_id), epoch, claim=True,
                             owner=self.owner.encode()))
        await asyncio.gather(*self._messages.submit(
            [], True, records_of=client_id, fence=_qos2_fence(client_id, epoch, claim=True)))

    async def client_ids(self) -> list[str]:
        """The client ids of every stored session."""
        return [key[len(_SESSION_KEY):].decode("utf-8", "replace")
                for key, _raw in await self._sessions_db.scan(_SESSION_KEY)]

    # -- shared groups' positions (shared/positions.py) -----------------------
    # Not fenced: each site writes its own record of a group, and only its own.

    async def save_group(self, group_key: str, site: str, value: bytes) -> None:
        await self._sessions_db.write(group_key, puts=[(_group_key(group_key, site), value)])

    async def delete_group(self, group_key: str, site: str) -> None:
        await self._sessions_db.write(group_key, deletes=[_group_key(group_key, site)])

    async def groups_kept_by(self, site: str, group_keys: Collection[str] | None = None
                             ) -> dict[str, bytes]:
        """The records `site` keeps, by group key: of `group_keys` (one storage read
        per shard), or of every group."""
        if group_keys is not None:
            keys = list(group_keys)
            values = await self._sessions_db.get_many(
                [(group_key, _group_key(group_key, site)) for group_key in keys])
            return {group_key: value for group_key, value in zip(keys, values, strict=True)
                    if value is not None}
        found: dict[str, bytes] = {}
        async for page in self._sessions_db.scan_pages(_GROUP_KEY):
            for key, value in page:
                group_key, keeper = _split_group_key(key)
                if keeper == site:
                    found[group_key] = value
        return found

    # -- inbound QoS 2 records ----------------------------------------------------

    def submit_qos2(self, message: Message, wait: bool, packet_id: int,
                    owner_epoch: int = 0, incarnation: int = 0
                    ) -> list[asyncio.Future[None]]:
        """Store an inbound QoS 2 message with its packet id in one atomic write, so a
        PUBLISH resent after a crash is recognised, never stored twice; the record is
        the session `incarnation`'s (`qos2_tag`). On a fenced store, only while
        `owner_epoch` is the client id's (else FencedError)."""
        return self._messages.submit(
            [message], wait, records_of=message.client_id,
            record_puts=[(_qos2_key(message.client_id, packet_id), qos2_tag(incarnation))],
            fence=self._fence(message.client_id, owner_epoch))

    def submit_will(self, message: Message, will_id: int) -> list[asyncio.Future[None]]:
        """Store a will message with its `will_id` in one atomic write (the record
        `will/<len><client>`, one per client id), so a publication retried after a
        failure whose outcome is not known can tell whether it was stored
        (`will_stored`) rather than store it twice."""
        return self._messages.submit([message], True, records_of=message.client_id,
                                     record_puts=[(_will_key(message.client_id),
                                                   will_id.to_bytes(8, "big"))])

    async def forget_will(self, client_id: str) -> None:
        """Delete the client's will record (`submit_will`)."""
        await asyncio.gather(*self._messages.submit(
            [], True, records_of=client_id, record_deletes=[_will_key(client_id)]))

    async def will_stored(self, client_id: str, will_id: int) -> bool:
        """Whether the will `will_id` of `client_id` is stored (read past a barrier)."""
        key = _will_key(client_id)
        return any(found == key and value == will_id.to_bytes(8, "big") for found, value
                   in await self._committed_records(client_id, key))

    def release_qos2(self, client_id: str, packet_id: int,
                     owner_epoch: int = 0) -> list[asyncio.Future[None]]:
        return self._messages.submit([], True, records_of=client_id,
                                     record_deletes=[_qos2_key(client_id, packet_id)],
                                     fence=self._fence(client_id, owner_epoch))

    def _fence(self, client_id: str, owner_epoch: int) -> Fence | None:
        return _qos2_fence(client_id, owner_epoch) if self.fenced else None

    # Reads that decide whether a QoS 2 packet id is known see every committed write
    # (Consistency.COMMITTED): this site's replica may not have applied what its
    # shard's leader committed, and a guess either way breaks exactly once (a resend
    # stored twice) or loses a message (a new PUBLISH taken for a resend).

    async def _committed_records(self, client_id: str,
                                 prefix: bytes) -> list[tuple[bytes, bytes]]:
        return await self._messages.read_records(self._messages.shard_of(client_id), prefix,
                                                 Consistency.COMMITTED)

    async def inbound_qos2_ids(self, client_id: str, incarnation: int = 0) -> set[int]:
        """The packet ids of the inbound QoS 2 messages session `incarnation` of
        `client_id` stored and has not released (those of other sessions of the
        client id are not its own: `qos2_tag`)."""
        records = await self._committed_records(client_id, _qos2_prefix(client_id))
        return {int.from_bytes(key[-2:], "big") for key, value in records
                if _owned_by(value, incarnation)}

    async def qos2_stored(self, client_id: str, packet_id: int, incarnation: int = 0
                          ) -> bool:
        """Whether session `incarnation` stored an inbound QoS 2 message with this
        packet id that awaits its PUBREL (asked when a store of it failed without a
        known outcome)."""
        key = _qos2_key(client_id, packet_id)
        # the keys of one client's QoS 2 records all have the same length
        return any(found == key and _owned_by(value, incarnation) for found, value
                   in await self._committed_records(client_id, key))

    async def forget_qos2(self, client_id: str, owner_epoch: int = 0) -> None:
        """Forget the ids of the client's inbound QoS 2 messages, and its will record
        (`submit_will`): its session ended, and a will of it no longer waits to be
        tried again. Without this, a record per client id that ever had a will."""
        records = await self._committed_records(client_id, _qos2_prefix(client_id))
        await asyncio.gather(*self._messages.submit(
            [], True, records_of=client_id,
            record_deletes=[key for key, _ in records] + [_will_key(client_id)],
            fence=self._fence(client_id, owner_epoch)))
