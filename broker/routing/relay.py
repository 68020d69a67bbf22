"""The relay: a shard leader's push of committed messages to the sites that hold no
replica of the shard and have subscribers for them (docs/replication.md, "Every site
sees every shard"); which sites and filters, the interest exchange says
(exchange.py).

- Addresses: pushes go to the address the controller gave for a site or, before it
  did (a site just added, not yet in any replica set), to the address the site told.
  A site the exchange forgets is no longer pushed to.
- Push: the leader of a shard matches each applied batch against each interested
  site's filters and queues what matches for that site, skipping the shard's
  replicas (their commit feed has them). One sender per site sends in order. The
  queue is bounded: what does not fit is dropped and the next push (or a push with
  no messages) says so, a gap.
- A new leader tells every site with interest and no replica of a gap once it leads
  (`began_leading`): what it took over from the old leader was not pushed.
- A gap sends the site's readers of that shard back to storage from their
  positions (timestamps per stream), so nothing is lost and nothing repeated; the
  site's commit feed hands each message on once, whichever way it came
  (`RemoteReads.feed_pushed`).

The relay runs beside storage replication on the peer port, with its interest
exchange: `SiteReplication` adds their routes, tells the relay of placements and
leaderships, and starts and closes both (a `PeerService`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from ..ds import CookedBatch, Database, Message, RemoteReads, SiteReplication
from ..errors import CorruptDataError
from ..supervise import supervise
from .exchange import InterestExchange, PeersOf, PlacementOf, SiteLost
from .relay_wire import Push, decode_push, encode_push
from .site_interest import SiteInterest

log = logging.getLogger(__name__)

# Messages queued for one site at most: beyond, pushes are dropped (a gap).
MAX_QUEUED_MESSAGES = 20_000
# Messages one push carries at most.
MAX_PUSH_MESSAGES = 1000
RETRY_INTERVAL = 0.5
# The push keeps its first name on the wire (this type, the `/feed` path, `fed`).
PUSH_CONTENT_TYPE = "application/vnd.stratamq.feed"

Leads = Callable[[int], bool]


@dataclass(slots=True)
class _Outbox:
    """What waits to be pushed to one site."""

    queue: deque[Push] = field(default_factory=deque)
    queued: int = 0  # messages in `queue`
    gaps: set[int] = field(default_factory=set)  # shards with dropped pushes
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Relay:
    """`messages`: the database pushed (its commit feed: what is applied here, and
    its feed gaps); `interest`: what this site's and the peers' subscribers hold,
    exchanged with the peers by an `InterestExchange` made with `unsettled` and
    `on_site_lost` (see there)."""

    def __init__(self, site: str, advertised: str, messages: Database, leads: Leads,
                 placement_of: PlacementOf, peers_of: PeersOf, remote: RemoteReads,
                 session: aiohttp.ClientSession, timeout: float, interest: SiteInterest,
                 unsettled: Callable[[], Mapping[str, Mapping[int, int]]],
                 on_site_lost: SiteLost) -> None:
        self.site = site
        self.advertised = advertised
        self._messages = messages
        self._leads = leads
        self._placement_of = placement_of
        self._peers_of = peers_of
        self._remote = remote
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.interest = interest
        self._told = interest.peers  # what each peer told
        self._outboxes: dict[str, _Outbox] = {}
        self._leaders = [placement_of(shard)[1] for shard in range(messages.shard_count)]
        self._replicas = [placement_of(shard)[0] for shard in range(messages.shard_count)]
        self.exchange = InterestExchange(site, advertised, messages, interest, placement_of,
                                         peers_of, session, unsettled, on_site_lost,
                                         self._forget)
        messages.add_commit_listener(self.on_commit, of_applied=True, wants=self.wants)

    @classmethod
    def of(cls, replication: SiteReplication, messages: Database, interest: SiteInterest,
           unsettled: Callable[[], Mapping[str, Mapping[int, int]]],
           on_site_lost: SiteLost) -> Relay:
        """The relay of `messages`, the first database `replication` replicates (whose
        streams subscribers read), over its peer port."""
        return cls(replication.site, replication.advertised, messages, replication.leads,
                   replication.messages.placement_of, lambda: replication.kept.peers,
                   replication.remote, replication.peer_session, replication.peer_timeout,
                   interest, unsettled, on_site_lost)

    def start(self) -> None:
        self.exchange.start()

    async def close(self) -> None:
        await self.exchange.close()
        tasks = [outbox.task for outbox in self._outboxes.values()]
        for task in tasks:
            if task is not None:
                task.cancel()
        for task in tasks:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def status(self) -> dict[str, Any]:
        """For the admin API's replication status."""
        # the topic filters each peer said its subscribers hold; when each site's
        # membership of each shared group takes effect (a storage timestamp, µs),
        # this site's own included
        return {"interest": self.interest.interest_of(),
                "shared_joined": self.interest.shared_joined_of()}

    # -- placement ----------------------------------------------------------------------

    def placement_changed(self) -> None:
        """A new leader of a shard held elsewhere does not know what the old one
        pushed here: its readers go back to storage. As a shard's leader: a site that
        left the shard's replica set got neither pushes nor (once it left) applied
        batches of what was committed before this site knew; it is told of a gap, so
        its readers read those from storage."""
        for shard_id in range(self._messages.shard_count):
            replicas, leader = self._placement_of(shard_id)
            if leader != self._leaders[shard_id]:
                self._leaders[shard_id] = leader
                self._messages.feed_gap(shard_id)
            left = set(self._replicas[shard_id]) - set(replicas)
            self._replicas[shard_id] = replicas
            # Named leader, not yet leading: a new leader takes over in the background
            # (`Takeover.take_over`), after this push.
            if leader == self.site:
                for site in sorted(left - {self.site}):
                    if self._told.filters_of(site):
                        self._tell_gap(site, shard_id)

    def began_leading(self, shard_id: int) -> None:
        """This site leads the shard now. What it took over from the old leader was
        applied here before it led, so not pushed, and a site without a replica may
        have read the shard here before that (its readers go back to storage at the
        leader change): every such site with subscribers is told of a gap, and its
        readers read again, now that this site holds every committed entry."""
        replicas, _leader = self._placement_of(shard_id)
        for site, filters in self._told.items():
            if site != self.site and site not in replicas and filters:
                self._tell_gap(site, shard_id)

    def _forget(self, site: str) -> None:
        """The exchange forgot `site`: nothing more is pushed to it."""
        outbox = self._outboxes.pop(site, None)
        if outbox is not None and outbox.task is not None:
            outbox.task.cancel()

    def _tell_gap(self, site: str, shard_id: int) -> None:
        """Send `site` a gap on the shard with its next push (one without messages
        when none is queued)."""
        outbox = self._outbox_of(site)
        outbox.gaps.add(shard_id)
        outbox.wake.set()

    # -- pushing, as a shard's leader ---------------------------------------------------

    def wants(self, shard: int) -> bool:
        """Whether a batch of the shard would be pushed anywhere now: this site leads
        it and another site reads here."""
        return bool(self._told) and self._leads(shard)

    def on_commit(self, cooked: CookedBatch) -> None:
        if not cooked.messages or not self.wants(cooked.shard):
            return
        replicas, _leader = self._placement_of(cooked.shard)
        for site, filters in self._told.items():
            if site == self.site or site in replicas or not filters:
                continue
            matching = [(cooked.generation, static, message)
                        for static, message in cooked.messages if filters.matches(message.topic)]
            if matching:
                self._queue(site, Push(cooked.shard, False, matching))

    def _outbox_of(self, site: str) -> _Outbox:
        outbox = self._outboxes.get(site)
        if outbox is None:
            made = self._outboxes[site] = _Outbox()
            made.task = asyncio.create_task(supervise(f"relay-{site}",
                                                      lambda: self._send_loop(site, made)),
                                            name=f"relay-{site}")
            outbox = made
        return outbox

    def _queue(self, site: str, push: Push) -> None:
        outbox = self._outbox_of(site)
        if outbox.queued + len(push.messages) > MAX_QUEUED_MESSAGES:
            outbox.gaps.add(push.shard)  # slow or unreachable: it reads from storage
        else:
            outbox.queue.append(push)
            outbox.queued += len(push.messages)
        outbox.wake.set()

    async def _send_loop(self, site: str, outbox: _Outbox) -> None:
        while True:
            if not outbox.queue and not outbox.gaps:
                outbox.wake.clear()
                await outbox.wake.wait()
                continue
            # with nothing queued, a push without messages tells of a gap
            push = self._take(outbox) if outbox.queue else Push(min(outbox.gaps), True, [])
            if push.shard in outbox.gaps:
                outbox.gaps.discard(push.shard)
                push = Push(push.shard, True, push.messages)
            address = self._address_of(site)
            if address is None:  # neither the controller nor the site gave one
                outbox.queue.clear()
                outbox.queued = 0
                outbox.gaps.clear()
                continue
            if await self._send(site, address, push):
                continue
            # Not taken: what is queued for the site is dropped, its readers of these
            # shards read from storage once it is back.
            outbox.gaps.add(push.shard)
            outbox.gaps.update(queued.shard for queued in outbox.queue)
            outbox.queue.clear()
            outbox.queued = 0
            await asyncio.sleep(RETRY_INTERVAL)

    def _address_of(self, site: str) -> str | None:
        return self._peers_of().get(site) or self._told.address_of(site)

    def _take(self, outbox: _Outbox) -> Push:
        """The first queued push, with the pushes of the same shard right behind it."""
        first = outbox.queue.popleft()
        messages = list(first.messages)
        while outbox.queue and outbox.queue[0].shard == first.shard \
                and len(messages) + len(outbox.queue[0].messages) <= MAX_PUSH_MESSAGES:
            messages += outbox.queue.popleft().messages
        outbox.queued -= len(messages)
        return Push(first.shard, first.gap, messages)

    async def _send(self, site: str, address: str, push: Push) -> bool:
        url = f"http://{address}/peer/v1/dbs/{self._messages.name}/{push.shard}/feed"
        try:
            async with self._session.post(url, data=encode_push(push), timeout=self._timeout,
                                          headers={"Content-Type": PUSH_CONTENT_TYPE}
                                          ) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("a push to %s failed: %r", site, exc)
            return False

    # -- the peer port ------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        self.exchange.add_routes(app)
        app.router.add_post("/peer/v1/dbs/{db}/{shard}/feed", self._take_push)

    async def _take_push(self, http: web.Request) -> web.Response:
        try:
            shard_id = int(http.match_info["shard"])
            push = decode_push(await http.read())
        except (ValueError, CorruptDataError) as exc:
            return web.json_response({"error": "bad_request", "message": str(exc)},
                                     status=400)
        if http.match_info["db"] != self._messages.name or push.shard != shard_id \
                or not 0 <= shard_id < self._messages.shard_count:
            return web.json_response({"error": "unknown_shard"}, status=404)
        if push.messages:
            self._remote.pushed(shard_id, push.messages[-1][2].timestamp)
        if not self._remote.is_remote(shard_id):
            # a replica here (the pusher's placement is older or newer): this site's
            # own apply hands the shard to its commit feed
            return web.json_response({"fed": 0})
        await self._remote.ensure_streams(shard_id, {(generation, static) for generation,
                                                     static, _message in push.messages})
        if push.gap:
            self._messages.feed_gap(shard_id)
        by_generation: dict[int, list[tuple[bytes, Message]]] = {}
        for generation, static, message in push.messages:
            by_generation.setdefault(generation, []).append((static, message))
        for generation, messages in sorted(by_generation.items()):
            self._remote.feed_pushed(shard_id, generation, messages)
        return web.json_response({"fed": len(push.messages)})
