"""The interest exchange (docs/replication.md, "Every site sees every shard"): each
site tells every peer the topic filters its subscribers hold, and its own peer
address, on change (debounced) and again every `INTEREST_INTERVAL`, so a restarted
peer learns them within one interval; with them, for its shared groups, when its
membership of each takes effect and where their members stopped settling messages.
A peer that did not have the filters just sent (they changed, or it restarted) may
have left messages unpushed: the sender declares a commit feed gap on the shards
that peer leads. A site that tells nothing for `INTEREST_EXPIRY` is forgotten
(`InterestTable`): a site gone for good is no longer relayed to, nor picked for
shared groups, and its share of their messages is delivered by the sites left
(`on_site_lost`), as is the share of a group a site left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp
from aiohttp import web

from ..ds import Database, now_us
from ..supervise import supervise
from ..topic import SHARE_PREFIX
from .site_interest import INTEREST_EXPIRY, INTEREST_INTERVAL, SiteInterest

log = logging.getLogger(__name__)

# A telling waits this long at most: a peer that does not answer (stopped, cut off)
# must not hold up the round that tells the others for longer than their expiry.
INTEREST_TIMEOUT = 2 * INTEREST_INTERVAL
# A change of filters is told after this pause, so a burst of SUBSCRIBEs is one push.
INTEREST_DEBOUNCE = 0.05
# A site tells, with its filters, where the members of each of its shared groups
# stopped settling messages; a forgotten site's share is delivered again from there,
# and so is the share of a group it left, from where it told its members stopped. A
# site restarted before the others forgot it tells nothing of the groups it held
# before (that was in its memory): their share is delivered again from this long
# before the telling that shows they went (how far its feed and its members' queues
# may lag under load; 2 s lost one message in 19k once on a loaded machine).
SHARED_FEED_LAG = 5 * INTEREST_INTERVAL
# A site tells the others where its members of a shared group stopped, for this
# long after the group went from it: one telling is enough, the rest are for one
# that was lost.
LEFT_TOLD_FOR = 2 * INTEREST_EXPIRY
PlacementOf = Callable[[int], tuple[tuple[str, ...], str]]
PeersOf = Callable[[], dict[str, str]]
# (site, the `$share/...` filters it left, when it had joined each, and per shard:
# since, until, storage timestamps, µs): the share of its groups' messages that
# reached no member in that span
SiteLost = Callable[[str, frozenset[str], Mapping[str, int], Sequence[int], Sequence[int]],
                    None]
_INTEREST_TIMEOUT = aiohttp.ClientTimeout(total=INTEREST_TIMEOUT)


class InterestExchange:
    """`messages`: the database whose shards the relay pushes; `interest`: this
    site's and the peers' (`SiteInterest`); `unsettled`: for each
    shared group with members here, per shard where its messages stop being settled
    here (the dispatcher's `shared_unsettled`), told to the peers; a site that left a
    shared group, or was forgotten, is told to `on_site_lost`, and a forgotten one to
    `on_forgotten` (the relay)."""

    def __init__(self, site: str, advertised: str, messages: Database,
                 interest: SiteInterest, placement_of: PlacementOf, peers_of: PeersOf,
                 session: aiohttp.ClientSession,
                 unsettled: Callable[[], Mapping[str, Mapping[int, int]]],
                 on_site_lost: SiteLost, on_forgotten: Callable[[str], None]) -> None:
        self.site = site
        self.advertised = advertised
        self._messages = messages
        self.interest = interest
        self._told = interest.peers  # what each peer told
        self._placement_of = placement_of
        self._peers_of = peers_of
        self._session = session
        self._unsettled = unsettled
        self._on_site_lost = on_site_lost
        self._on_forgotten = on_forgotten
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(supervise("interest-exchange", self._interest_loop),
                                         name="interest-exchange")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def add_routes(self, app: web.Application) -> None:
        app.router.add_put("/peer/v1/interest", self._take_interest)

    # -- telling peers this site's interest ------------------------------------------

    async def _interest_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.interest.changed.wait(), INTEREST_INTERVAL)
            if self.interest.changed.is_set():
                await asyncio.sleep(INTEREST_DEBOUNCE)
                self.interest.changed.clear()
            self._forget_silent_sites()
            filters = self.interest.filters
            unsettled = self.interest.stop_positions(self._unsettled())
            peers = {site: address for site, address in self._peers_of().items()
                     if site != self.site}
            await asyncio.gather(*(self._tell(site, address, filters, unsettled)
                                   for site, address in peers.items()))

    def _forget_silent_sites(self) -> None:
        now = time.monotonic()
        for gone in self._told.expire(now):
            log.info("%s told this site nothing for %.0fs: its interest is forgotten, "
                     "nothing more is pushed to it", gone.site, INTEREST_EXPIRY)
            self._on_forgotten(gone.site)
            until = [now_us()] * self._messages.shard_count
            for share_filter in sorted(gone.filters):
                if not share_filter.startswith(SHARE_PREFIX):
                    continue
                # every telling gives these (`_take_interest` checks it)
                self._on_site_lost(
                    gone.site, frozenset({share_filter}),
                    {share_filter: gone.joined[share_filter]},
                    gone.unsettled[share_filter], until)

    async def _tell(self, site: str, address: str, filters: frozenset[str],
                    unsettled: dict[str, list[int]]) -> None:
        url = f"http://{address}/peer/v1/interest"
        recently = time.monotonic() - LEFT_TOLD_FOR
        body = json.dumps({
            "site": self.site, "peer": self.advertised, "filters": sorted(filters),
            "joined": {f: self.interest.joined[f] for f in filters if f in self.interest.joined},
            "left": {f: stopped for f, (stopped, at) in self.interest.left.items()
                     if at > recently},
            "unsettled": unsettled,
        })
        try:
            async with self._session.put(url, data=body, timeout=_INTEREST_TIMEOUT,
                                         headers={"Content-Type": "application/json"}
                                         ) as response:
                answer = await response.read()
                if response.status != 200:
                    log.debug("%s refused this site's interest (%d): %r", site,
                              response.status, answer[:200])
                    return
                had = bool(json.loads(answer).get("had"))
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            log.debug("%s did not take this site's interest: %r", site, exc)
            return
        if not had and filters:
            # messages it committed before it knew these filters were not pushed
            for shard_id in range(self._messages.shard_count):
                if self._placement_of(shard_id)[1] == site:
                    self._messages.feed_gap(shard_id)

    # -- taking the peers' ------------------------------------------------------------

    async def _take_interest(self, http: web.Request) -> web.Response:
        try:
            document = json.loads(await http.read())
            site = document["site"]
            peer = document["peer"]
            filters = frozenset(document["filters"])
            joined = document["joined"]
            left = document["left"]
            unsettled = document["unsettled"]
            if not isinstance(site, str) or not isinstance(peer, str) \
                    or not all(isinstance(f, str) for f in filters):
                raise TypeError("site, peer and filters are strings")
            if not isinstance(joined, dict) or not all(
                    isinstance(at, int) for at in joined.values()):
                raise TypeError("joined maps filters to timestamps")
            shards = self._messages.shard_count
            for name, positions in (("left", left), ("unsettled", unsettled)):
                if not isinstance(positions, dict) or not all(
                        isinstance(stopped, list) and len(stopped) == shards
                        and all(isinstance(at, int) for at in stopped)
                        for stopped in positions.values()):
                    raise TypeError(f"{name} maps filters to a timestamp per shard "
                                    f"({shards} shards)")
            if any(f.startswith(SHARE_PREFIX) and f not in unsettled for f in filters):
                raise TypeError("unsettled names every shared filter told")
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": "bad_request", "message": str(exc)},
                                     status=400)
        before = self._told.joined_of(site)
        had = self._told.take(site, peer, filters, time.monotonic(), joined, unsettled)
        after = self._told.joined_of(site)
        for share_filter, at in sorted(before.items()):
            if after.get(share_filter) != at:  # it left (and maybe joined again since)
                self._site_left(site, share_filter, at, left.get(share_filter))
        return web.json_response({"had": had})

    def _site_left(self, site: str, share_filter: str, joined: int,
                   stopped: list[int] | None) -> None:
        """`site` has no members of a shared group any more: the messages it was
        chosen for from where its members stopped (per shard, as the site told in
        `left`; when it told nothing, restarted since it joined, SHARED_FEED_LAG
        before now) up to what this site was fed of each shard are read from storage
        and delivered by the sites left (later ones pick among them)."""
        until = self._messages.fed_through()
        if stopped is None:
            stopped = [now_us() - int(SHARED_FEED_LAG * 1_000_000)] * len(until)
        self._on_site_lost(site, frozenset({share_filter}), {share_filter: joined}, stopped,
                           until)
