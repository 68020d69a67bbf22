"""Which site owns a client id, in a cluster: one site at a time, with an owner epoch
kept in the `sessions` database (`SessionStore.claim`, checked by the shard's
leader). A site that takes a client id over asks the site that held it to close the
client's connection and let go of the session (over the peer port), then claims the
next epoch, so the old owner's late writes are refused. A previous owner that does not
answer (down, cut off) does not stop the takeover: the epoch fences it.

The sessions of a site forgotten for good (`ctl ds forget`: it will not come back)
are adopted by the first site whose collector finds them (`may_collect`), so they
still expire and publish their wills."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from ..ds import FencedError
from ..errors import StorageBusyError, StratamqError
from ..session.store import SessionStore

log = logging.getLogger(__name__)

RELEASE = "release-client"
# Claims tried in a row when other sites claim the same client id meanwhile.
CLAIM_ATTEMPTS = 3

# (client id, username) -> whether this site let go of it (False: another user's)
Release = Callable[[str, str | None], Awaitable[bool]]


class Peers(Protocol):
    """The peer port, as `ds.SiteReplication` offers it."""

    @property
    def forgotten(self) -> frozenset[str]:
        """The sites the controller forgot for good."""

    def serve(self, name: str, handler: Callable[[web.Request],
                                                 Awaitable[web.StreamResponse]]) -> None: ...

    async def call(self, site: str, name: str, body: dict[str, Any],
                   within: float) -> dict[str, Any]: ...

    def peer_time(self, site: str, local: float) -> float:
        """This site's wall clock time `local` in `site`'s clock."""
        ...


class NotOwnerError(StratamqError):
    """The client id's session belongs to another user (the owning site said so)."""


class Ownership:
    def __init__(self, store: SessionStore, peers: Peers, within: float) -> None:
        assert store.fenced, "ownership needs a store whose writes are fenced"
        self._store = store
        self._peers = peers
        self._within = within
        self.site = store.owner

    def serve(self, release: Release) -> None:
        """Answer other sites' requests to let go of a client id with `release`."""
        async def handle(http: web.Request) -> web.StreamResponse:
            try:
                body = await http.json()
                client_id = body["client_id"]
                username = body.get("username")
                deadline = float(body["deadline"])
                if not isinstance(client_id, str) or not isinstance(username, str | None):
                    raise TypeError("client_id must be a string, username one or null")
            except (ValueError, KeyError, TypeError) as exc:
                return web.json_response({"error": "bad_request", "message": str(exc)},
                                         status=400)
            if time.time() > deadline:
                # the asking site has given up and taken the client id regardless: a
                # late request (held up while this site was cut off or stalled) must
                # not close a connection that came back here since
                return web.json_response({"error": "expired"}, status=503)
            return web.json_response({"released": await release(client_id, username)})
        self._peers.serve(RELEASE, handle)

    async def take(self, client_id: str, username: str | None,
                   held_here: int | None) -> int:
        """Make this site the owner of `client_id`; its owner epoch. `held_here`: the
        epoch of the session this site holds in memory, if any: when it is still the
        stored one, this site owns the client id already. NotOwnerError when the site
        that owns it says it is another user's; FencedError-free: a claim lost to a
        concurrent one is tried again, StorageBusyError after CLAIM_ATTEMPTS."""
        for _attempt in range(CLAIM_ATTEMPTS):
            epoch, owner = await self._store.owner_of(client_id)
            if owner == self.site and held_here == epoch:
                return epoch
            if owner and owner != self.site:
                await self._ask_release(owner, client_id, username)
            try:
                await self._store.claim(client_id, epoch + 1)
            except FencedError as exc:
                log.info("client %r: claimed elsewhere meanwhile (%s); trying again",
                         client_id, exc.message)
                continue
            log.info("client %r: owned here from epoch %d (was %s)", client_id, epoch + 1,
                     owner or "nobody's")
            return epoch + 1
        raise StorageBusyError(f"client {client_id!r} was claimed by other sites "
                               f"{CLAIM_ATTEMPTS} times in a row; try again")

    async def _ask_release(self, owner: str, client_id: str, username: str | None) -> None:
        try:
            answer = await self._peers.call(
                owner, RELEASE, {"client_id": client_id, "username": username,
                                 # in the owner's clock: its own may be off
                                 "deadline": self._peers.peer_time(
                                     owner, time.time() + self._within)}, self._within)
        except StratamqError as exc:
            # down or cut off: the claim goes ahead, and its epoch fences that site
            log.warning("client %r: site %s did not let go of it (%s); taking it over "
                        "regardless", client_id, owner, exc)
            return
        if answer.get("released") is False:
            raise NotOwnerError(f"client {client_id!r}: site {owner} holds it for "
                                f"another user")

    async def may_collect(self, client_id: str) -> int | None:
        """The owner epoch under which this site may expire the stored session of
        `client_id`: the one it owns it at, or a new one when it adopts the session of
        a site forgotten for good. None when another site owns it (or adopted it
        first), or nobody has claimed it."""
        epoch, owner = await self._store.owner_of(client_id)
        if owner == self.site:
            return epoch
        if not owner or owner not in self._peers.forgotten:
            return None
        try:
            await self._store.claim(client_id, epoch + 1)
        except FencedError:
            return None
        log.info("client %r: its session adopted from site %s, which was forgotten",
                 client_id, owner)
        return epoch + 1
