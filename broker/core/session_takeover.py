"""Taking a client id's session over from the site that owns it (a cluster): who may
(the session's own user), this site's owner epoch of it, and the shared groups the
other site keeps for the client, which move here with its session."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Mapping

from ..session.model import SessionRecord
from ..session.session import Session
from ..session.store import SessionStore
from ..shared.groups import AbsentGroup
from .client_locks import ClientLocks
from .ownership import NotOwnerError, Ownership


class NotSessionOwner(Exception):
    """The session of this client id belongs to another user."""


def resumable(record: SessionRecord) -> bool:
    # Expiry 0 in a record: its connection was cut by a crash, and with it the
    # session ended.
    return not record.expired(time.time()) and record.expiry_interval > 0


class SessionTakeover:
    """`sessions` and `locks`: the registry's table of the sessions in memory and its
    lock per client id; `forget_here`: drops this site's stale copy of a session
    another site owned meanwhile. `groups_kept_for`: (client id, site, group keys) ->
    the shared groups that site keeps for the client (`shared/positions.py`)."""

    def __init__(self, store: SessionStore, ownership: Ownership, locks: ClientLocks,
                 sessions: Mapping[str, Session], forget_here: Callable[[Session], None],
                 groups_kept_for: Callable[[str, str, Collection[str]],
                                           Awaitable[dict[str, AbsentGroup]]] | None
                 ) -> None:
        self._store = store
        self._ownership = ownership
        self._locks = locks
        self._sessions = sessions
        self._forget_here = forget_here
        self._groups_kept_for = groups_kept_for

    async def take(self, client_id: str, username: str | None
                   ) -> tuple[int, dict[str, AbsentGroup]]:
        """This site's owner epoch of the client id, and the shared groups the site
        that owned it keeps for it (read before that site is told to let go: it
        forgets them then)."""
        async with self._locks.hold(client_id):
            held = self._sessions.get(client_id)
            subscriptions = [] if held is None else list(held.subscriptions.values())
            if held is None:
                # a stored session of another user is refused before its owner site
                # is told to let go of it
                record = await self._store.load(client_id)
                if record is not None and resumable(record):
                    if record.username != username:
                        raise NotSessionOwner(client_id)
                    subscriptions = record.subscriptions
            elif held.username != username:
                raise NotSessionOwner(client_id)
        groups_along = await self._groups_kept_elsewhere(
            client_id, {subscription.group_key for subscription in subscriptions
                        if subscription.share_group is not None})
        try:
            epoch = await self._ownership.take(
                client_id, username, None if held is None else held.owner_epoch)
        except NotOwnerError as exc:
            raise NotSessionOwner(client_id) from exc
        async with self._locks.hold(client_id):
            stale = self._sessions.get(client_id)
            if stale is not None and stale.owner_epoch != epoch and stale.outlet is None:
                # a copy from before another site owned it: the store has the session
                self._forget_here(stale)
        return epoch, groups_along

    async def _groups_kept_elsewhere(self, client_id: str, group_keys: set[str]
                                     ) -> dict[str, AbsentGroup]:
        """The groups among `group_keys` that the site owning `client_id` keeps for
        it, when that is another site (a storage error fails the connect, as the
        session's own read does: the client tries again)."""
        if not group_keys or self._groups_kept_for is None:
            return {}
        _epoch, owner = await self._store.owner_of(client_id)
        if not owner or owner == self._store.owner:
            return {}
        return await self._groups_kept_for(client_id, owner, group_keys)
