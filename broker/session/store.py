"""Where sessions live in storage: the one owner of the key schemas of session
records (`s/<client>` in the `sessions` database), of the positions a site keeps for
its shared groups (`g/<len><group key><site>`, also in `sessions`, with the group's
shard) and of inbound QoS 2 records (`qos2/<len><client><packet id>`, kept with the
client's messages in the `messages` database). Nothing else reads or writes these
keys.

On a replicated site (`owner` set: this site's id) a session record is written fenced
by its owner epoch (`ds.fence`): a site takes a client id with `claim`, which moves
the epoch on at the shard's leader, and the writes of the site that held it before
carry an older epoch and are refused (FencedError). The claim moves the epoch of the
client's inbound QoS 2 records on too (they are in another database, so they have a
fence of their own), before the new owner reads them: a write of the old owner is
either in what the new one reads or refused."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from ..ds import Database, Fence, KvDatabase, Message
from .model import SessionRecord

_SESSION_KEY = b"s/"


def _session_key(client_id: str) -> bytes:
    return _SESSION_KEY + client_id.encode()


def _length_prefixed(name: str) -> bytes:
    raw = name.encode("utf-8")
    return len(raw).to_bytes(2, "big") + raw


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
        raw = await self._sessions_db.get(client_id, _session_key(client_id))
        return None if raw is None else SessionRecord.from_json(raw)

    async def save(self, record: SessionRecord) -> None:
        puts = [(_session_key(record.client_id), record.to_json())]
        if self.fenced:
            await self._sessions_db.write_fenced(
                record.client_id, Fence(_session_key(record.client_id), record.owner_epoch),
                puts=puts)
        else:
            await self._sessions_db.write(record.client_id, puts=puts)

    async def delete(self, client_id: str, owner_epoch: int = 0) -> None:
        deletes = [_session_key(client_id)]
        if self.fenced:
            await self._sessions_db.write_fenced(
                client_id, Fence(_session_key(client_id), owner_epoch), deletes=deletes)
        else:
            await self._sessions_db.write(client_id, deletes=deletes)

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

    async def scan(self) -> list[SessionRecord]:
        return [SessionRecord.from_json(raw)
                for _key, raw in await self._sessions_db.scan(_SESSION_KEY)]

    # -- shared groups' positions (core/shared_positions.py) -----------------------
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
                    owner_epoch: int = 0) -> list[asyncio.Future[None]]:
        """Store an inbound QoS 2 message with its packet id in one atomic write, so a
        PUBLISH resent after a crash is recognised, never stored twice. On a fenced
        store, only while `owner_epoch` is the client id's (else FencedError)."""
        return self._messages.submit(
            [message], wait, records_of=message.client_id,
            record_puts=[(_qos2_key(message.client_id, packet_id), b"")],
            fence=self._fence(message.client_id, owner_epoch))

    def release_qos2(self, client_id: str, packet_id: int,
                     owner_epoch: int = 0) -> list[asyncio.Future[None]]:
        return self._messages.submit([], True, records_of=client_id,
                                     record_deletes=[_qos2_key(client_id, packet_id)],
                                     fence=self._fence(client_id, owner_epoch))

    def _fence(self, client_id: str, owner_epoch: int) -> Fence | None:
        return _qos2_fence(client_id, owner_epoch) if self.fenced else None

    # Reads that decide whether a QoS 2 packet id is known see every committed write
    # (Database.read_records): this site's replica may not have applied what its
    # shard's leader committed, and a guess either way breaks exactly once (a resend
    # stored twice) or loses a message (a new PUBLISH taken for a resend).

    async def inbound_qos2_ids(self, client_id: str) -> set[int]:
        records = await self._messages.read_records(client_id, _qos2_prefix(client_id))
        return {int.from_bytes(key[-2:], "big") for key, _value in records}

    async def qos2_stored(self, client_id: str, packet_id: int) -> bool:
        """Whether an inbound QoS 2 message with this packet id is stored and awaits
        its PUBREL (asked when a store of it failed without a known outcome)."""
        key = _qos2_key(client_id, packet_id)
        # the keys of one client's QoS 2 records all have the same length
        return any(found == key for found, _value
                   in await self._messages.read_records(client_id, key))

    async def forget_qos2(self, client_id: str, owner_epoch: int = 0) -> None:
        records = await self._messages.read_records(client_id, _qos2_prefix(client_id))
        if records:
            await asyncio.gather(*self._messages.submit(
                [], True, records_of=client_id, record_deletes=[key for key, _ in records],
                fence=self._fence(client_id, owner_epoch)))
