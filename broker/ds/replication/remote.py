"""Reads of the shards this site holds no replica of (docs/replication.md,
"Every site sees every shard": iterators are portable bytes; a session reads a stream
here when this site holds a replica, else at a site that does, the leader first).

Stream discovery (`get_streams`, `make_iterator`) stays synchronous: it walks a
mirror of a replica's learned tries, refreshed in the background and whenever a
pushed message names a stream the mirror does not know. `next` and `read_message`
go over the peer port. Errors are recoverable `PeerError`s: a session retries the
read later from the same position, it never skips."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from ...errors import CorruptDataError, StorageError
from ...supervise import supervise
from ..generation import GenerationInfo
from ..iterator import EndOfStream, Iterator, Stream
from ..lts import END, Trie
from ..message import Message, decode_message
from ..shard_set import NextResult, ShardSet
from ..streams import GenerationView
from .peer import PeerError
from .remote_service import MAX_REMOTE_BATCH, RemoteReadService
from .remote_wire import decode_generations, decode_next

log = logging.getLogger(__name__)

# How often the mirrors of remote shards are brought up to date.
REFRESH_INTERVAL = 1.0
# How long a shard's leader waits for the sites without a replica to count what
# their sessions lose to a generation it drops (they read the rest of it remotely).
PRE_DROP_TIMEOUT = 30.0

PlacementOf = Callable[[int], tuple[tuple[str, ...], str]]
PeersOf = Callable[[], dict[str, str]]
# Returns once this site's replica of a shard has applied what its leader had when
# asked; a recoverable StorageError when that does not happen in time.
Barrier = Callable[[int], Awaitable[None]]


@dataclass(slots=True)
class MirroredGeneration:
    info: GenerationInfo
    trie: Trie
    statics: set[bytes]  # the streams it knows


class RemoteReads:
    """The reads of one database's shards held elsewhere, for its
    `ReplicatedBackend` (its `service` serves the same reads to other sites from the
    shards this site holds)."""

    def __init__(self, site: str, shard_set: ShardSet, placement_of: PlacementOf,
                 peers_of: PeersOf, barrier: Barrier, session: aiohttp.ClientSession,
                 timeout: float) -> None:
        self.site = site
        self._barrier = barrier
        self.shard_set = shard_set
        self._placement_of = placement_of
        self._peers_of = peers_of
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._mirrors: dict[int, dict[int, MirroredGeneration]] = {}
        self._locks = [asyncio.Lock() for _ in shard_set.shards]
        # where each shard was read last: a change empties the stream cache
        self._remote_now = [False] * len(shard_set.shards)
        # Per shard, the last timestamp its leader pushed here, taken or not (a push
        # that comes while this site still reads the shard here is not fed): a
        # replica asked for a read must have applied that far.
        self._pushed_through = [0] * len(shard_set.shards)
        # Whether this site's replica of each shard has passed a read barrier since it
        # was placed here (or since this site started): until then the shard is read
        # elsewhere. A replica catching up, bootstrapping from a checkpoint or restarted
        # behind its leader holds a stale copy; its readers must not take that for the
        # end of the stream, and what a checkpoint install brings is fed to no one.
        self._caught_up = [False] * len(shard_set.shards)
        self._catching_up: dict[int, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # the same reads, served to other sites from the shards this site holds
        self.service = RemoteReadService(shard_set, self.is_remote, self.generations)

    def start(self) -> None:
        self._task = asyncio.create_task(supervise("ds-remote-mirror", self._refresh_loop),
                                         name="ds-remote-mirror")

    async def close(self) -> None:
        for task in [self._task, *self._catching_up.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # -- for ReplicatedBackend -------------------------------------------------------

    def is_remote(self, shard_id: int) -> bool:
        replicas, _leader = self._placement_of(shard_id)
        return bool(replicas) and (self.site not in replicas or not self._caught_up[shard_id])

    def pushed(self, shard_id: int, timestamp: int) -> None:
        """The shard's leader pushed messages through `timestamp` here."""
        self._pushed_through[shard_id] = max(self._pushed_through[shard_id], timestamp)

    def feed_pushed(self, shard_id: int, generation_id: int,
                    messages: list[tuple[bytes, Message]]) -> None:
        """Committed messages of a shard this site holds no replica of, pushed by its
        leader: fed to the commit listeners like a batch applied here (each message
        once per site, whichever way it came first). A push of a shard this site reads
        here (its placement here is newer or older than the leader's) is not fed: the
        site's applied batches feed it, or, once it reads the shard elsewhere, storage
        after the feed gap that switch declares."""
        if self.is_remote(shard_id):
            self.shard_set.feed.pushed(shard_id, generation_id, messages)

    def _is_placed_here(self, shard_id: int) -> bool:
        replicas, _leader = self._placement_of(shard_id)
        return self.site in replicas

    def generations(self, shard_id: int) -> Mapping[int, GenerationView]:
        return self._mirrors.get(shard_id, {})

    def loaded(self, shard_id: int) -> bool:
        return shard_id in self._mirrors

    async def next(self, iterator: Iterator, batch_size: int) -> NextResult | EndOfStream:
        """The next batch, from a replica that has applied every message of the shard
        fed or pushed here: a reader fed a message while it read goes live once a read
        comes back empty, so an answer from a copy without it would lose it."""
        shard = iterator.stream.shard
        fed = max(self.shard_set.feed.fed_through()[shard], self._pushed_through[shard])
        answer = await self._ask(shard, "next", method="POST", data=iterator.to_bytes(),
                                 params={"batch": str(min(batch_size, MAX_REMOTE_BATCH)),
                                         "applied": str(fed)})
        try:
            return decode_next(answer)
        except CorruptDataError as exc:
            raise PeerError(f"{self.shard_set.name}/{shard}: {exc.message}") from exc

    async def read_message(self, stream: Stream, timestamp: int) -> Message | None:
        answer = await self._ask(stream.shard, "message", method="GET",
                                 params={"generation": str(stream.generation),
                                         "static": stream.static.hex(),
                                         "timestamp": str(timestamp),
                                         "applied": str(timestamp)})
        if not answer:
            return None
        try:
            return decode_message(answer)
        except CorruptDataError as exc:
            raise PeerError(f"{self.shard_set.name}/{stream.shard}: {exc.message}") from exc

    # -- the mirrors ----------------------------------------------------------------

    def placement_changed(self) -> None:
        """The placement changed: shards may have moved to or from this site."""
        self._wake.set()
        self.check_moves()

    def check_moves(self) -> None:
        changed = False
        for shard_id in range(len(self.shard_set.shards)):
            if not self._is_placed_here(shard_id):
                self._caught_up[shard_id] = False
                if shard_id in self._catching_up:
                    self._catching_up.pop(shard_id).cancel()
            elif not self._caught_up[shard_id] and shard_id not in self._catching_up:
                self._catching_up[shard_id] = asyncio.create_task(
                    self._catch_up(shard_id), name=f"ds-catch-up-{shard_id}")
            remote = self.is_remote(shard_id)
            if remote != self._remote_now[shard_id]:
                self._remote_now[shard_id] = remote
                changed = True
                # readers of the shard go back to storage, now read elsewhere
                self.shard_set.feed.feed_gap(shard_id)
        if changed:
            self.shard_set.streams.forget_cached()

    async def _catch_up(self, shard_id: int) -> None:
        """Read the shard here once this site's new replica of it has caught up."""
        while True:
            try:
                await self._barrier(shard_id)
                break
            except StorageError as exc:
                log.info("%s/%d: the new replica here is still catching up: %s",
                         self.shard_set.name, shard_id, exc.message)
                await asyncio.sleep(REFRESH_INTERVAL)
        self._catching_up.pop(shard_id, None)
        self._caught_up[shard_id] = True
        self.check_moves()

    async def ensure_streams(self, shard_id: int, streams: set[tuple[int, bytes]]) -> None:
        """Make sure the mirror of a remote shard knows these (generation, static
        index) streams, refreshing it once if not."""
        mirror = self._mirrors.get(shard_id, {})
        if all(generation in mirror and static in mirror[generation].statics
               for generation, static in streams):
            return
        with contextlib.suppress(StorageError):
            await self.refresh(shard_id)

    async def _refresh_loop(self) -> None:
        while True:
            self.check_moves()
            for shard_id in range(len(self.shard_set.shards)):
                if self.is_remote(shard_id):
                    try:
                        await self.refresh(shard_id)
                    except StorageError as exc:
                        log.debug("%s/%d: mirror not refreshed: %s", self.shard_set.name,
                                  shard_id, exc.message)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), REFRESH_INTERVAL)

    async def refresh(self, shard_id: int) -> None:
        """Bring the mirror of a shard up to date from a replica."""
        async with self._locks[shard_id]:
            document = decode_generations(await self._ask(shard_id, "generations",
                                                          method="GET"))
            old = self._mirrors.get(shard_id, {})
            new: dict[int, MirroredGeneration] = {}
            structure_changed = set(old) != set(document)
            for generation_id, (info, edges) in document.items():
                kept = old.get(generation_id)
                mirrored = kept if kept is not None else MirroredGeneration(
                    info, Trie(self.shard_set.options.wildcard_thresholds, 0), set())
                learned = [edge for edge in edges if mirrored.trie.add_edge(edge)]
                mirrored.statics.update(edge.child for edge in learned if edge.label == END)
                new[generation_id] = MirroredGeneration(info, mirrored.trie, mirrored.statics)
                if kept is not None and kept.info != info:
                    structure_changed = True
                if learned:
                    self.shard_set.streams.note(shard_id, generation_id, learned)
            self._mirrors[shard_id] = new
            if structure_changed:
                self.shard_set.streams.forget_cached()
            newest = max(document, default=-1)
            for generation_id in sorted(old.keys() - document.keys()):
                if generation_id < newest:  # dropped there (not a replica behind)
                    self.shard_set.after_drop(shard_id, generation_id)

    # -- retention ---------------------------------------------------------------------

    async def before_drop(self, shard_id: int, generation_id: int) -> None:
        """As the shard's leader, about to drop a generation: ask every other site
        that holds no replica of the shard to run its pre-drop listeners first (their
        sessions count what they had not read of it, reading it here; the replicas
        run theirs as they apply the drop). A site that does not answer within
        PRE_DROP_TIMEOUT is not waited for: its loss is then logged, not counted."""
        replicas, _leader = self._placement_of(shard_id)
        asked = {site: address for site, address in self._peers_of().items()
                 if site != self.site and site not in replicas}
        if not asked:
            return
        name = self.shard_set.name
        timeout = aiohttp.ClientTimeout(total=PRE_DROP_TIMEOUT)

        async def tell(site: str, address: str) -> None:
            url = f"http://{address}/peer/v1/dbs/{name}/{shard_id}/pre-drop"
            try:
                async with self._session.post(url, params={"generation": str(generation_id)},
                                              timeout=timeout) as response:
                    if response.status != 200:
                        body = await response.read()
                        log.warning("%s/%d: site %s did not count its sessions' loss to "
                                    "the drop of generation %d: %d %s", name, shard_id, site,
                                    generation_id, response.status,
                                    body[:200].decode("utf-8", "replace"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("%s/%d: site %s did not count its sessions' loss to the drop "
                            "of generation %d: %r", name, shard_id, site, generation_id, exc)

        await asyncio.gather(*(tell(site, address) for site, address in asked.items()))

    # -- asking a replica -------------------------------------------------------------

    def _replicas_in_order(self, shard_id: int) -> list[str]:
        replicas, leader = self._placement_of(shard_id)
        ordered = [leader] if leader in replicas else []
        return ordered + [site for site in replicas if site != leader and site != self.site]

    async def _ask(self, shard_id: int, what: str, method: str, data: bytes | None = None,
                   params: dict[str, str] | None = None) -> bytes:
        """The body of a 200 answer from the first replica of the shard (leader first)
        that gives one; PeerError when none does."""
        peers = self._peers_of()
        name = self.shard_set.name
        errors = []
        for site in self._replicas_in_order(shard_id):
            address = peers.get(site)
            if address is None or site == self.site:
                continue
            url = f"http://{address}/peer/v1/dbs/{name}/{shard_id}/{what}"
            try:
                async with self._session.request(method, url, data=data, params=params,
                                                 timeout=self._timeout) as response:
                    body = await response.read()
                    if response.status == 200:
                        return body
                    errors.append(f"{site}: {response.status} "
                                  f"{body[:200].decode('utf-8', 'replace')}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(f"{site}: {exc!r}")
        raise PeerError(f"{name}/{shard_id}: no replica answered {what} "
                        f"({'; '.join(errors) or 'no replica known'})")
