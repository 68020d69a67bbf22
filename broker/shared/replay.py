"""The share of a shared group's messages that a site which left the group, or was
forgotten, was chosen for and did not deliver.

Each message of a `$share` group goes to one site with members of the group, chosen
alike by every site (`SiteChoice.delivers_here`). A site whose last member of a group
goes tells the others, with its interest, where per shard its members stopped; a site
that goes silent (killed, cut off) stays chosen until the others forget it
(`INTEREST_EXPIRY` after it last told them its filters). Either way the messages it
was chosen for from then on reached no member: each site left with members of the
group reads them from storage, from where the site stopped (for a silent one: a
little before it last spoke, its feed lags its tellings) up to what this site was
fed when it learned (later messages it picks among the sites left as they come),
and delivers those the lost site was chosen for and this site is chosen for now.
The choice is a rendezvous hash, so every site left computes the same one and no
message moves between them: each such message goes to exactly one. For a silent
site that is at least once: what it did deliver after it last spoke comes again.
QoS 0 messages are not delivered again (at most once)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from ..ds import DurableStorage, EndOfStream, Message, Stream
from ..errors import InvalidIteratorError, StorageError
from ..routing.interest import ShareMember
from ..supervise import RESTART_PAUSE
from .backlog import BATCH, deliver_when_room
from .choice import SiteChoice
from .groups import SharedGroup

log = logging.getLogger(__name__)

# A read that fails (a shard's replicas out of reach) is tried again this many times.
READ_TRIES = 10


class SharedReplay:
    """`group_of`: the group of a `$share/group/filter` with members here (the
    dispatcher's); `choice` says which of its lost share this site delivers."""

    def __init__(self, storage: DurableStorage, db: str,
                 group_of: Callable[[str], SharedGroup | None], choice: SiteChoice) -> None:
        self._storage = storage
        self._db = db
        self._group_of = group_of
        self._choice = choice
        self._tasks: set[asyncio.Task[None]] = set()

    def on_site_lost(self, site: str, share_filters: frozenset[str],
                     joined: Mapping[str, int], since: Sequence[int],
                     until: Sequence[int]) -> None:
        """`site` held these `$share/group/filter`s (joined at `joined`) and left them
        or was forgotten: per shard, its share from `since` to `until` (storage
        timestamps, µs) reached no member."""
        for share_filter in sorted(share_filters):
            group = self._group_of(share_filter)
            if group is None:
                continue  # no member here
            lost = (site, joined.get(share_filter, 0))
            task = asyncio.create_task(self._replay(group, lost, since, until),
                                       name=f"shared-replay-{group.key}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _replay(self, group: SharedGroup, lost: ShareMember, since: Sequence[int],
                      until: Sequence[int]) -> None:
        delivered = 0
        for _rank, stream in self._storage.get_streams(self._db, group.topic_filter,
                                                       min(since)):
            shard = stream.shard
            async for batch in self._read(group, stream, since[shard], until[shard]):
                for message in batch:
                    if not self._choice.takes_lost_share(group, message, lost):
                        continue
                    if not await deliver_when_room(group, message, stream):
                        return  # its last member here went: it is told on
                    delivered += 1
        log.info("shared group %s: %d messages chosen for %s, gone from it, delivered "
                 "here", group.key, delivered, lost[0])

    async def _read(self, group: SharedGroup, stream: Stream, since_us: int,
                    until_us: int) -> AsyncIterator[list[Message]]:
        """The QoS 1 and 2 messages of a stream from `since_us` to `until_us`, a
        batch at a time."""
        try:
            iterator = self._storage.make_iterator(self._db, stream, group.topic_filter,
                                                   since_us)
        except InvalidIteratorError:  # dropped by retention meanwhile
            return
        failures = 0
        while True:
            try:
                result = await self._storage.next(self._db, iterator, BATCH)
            except StorageError as exc:
                failures += 1
                if not exc.recoverable or failures >= READ_TRIES:
                    log.warning("shared group %s: the lost share of %s not read further: "
                                "%s", group.key, stream, exc.message)
                    return
                await asyncio.sleep(RESTART_PAUSE)
                continue
            if isinstance(result, EndOfStream):
                return
            iterator, batch = result
            if not batch:
                return  # the stream's end so far: newer messages came live
            within = [message for _key, message in batch if message.timestamp <= until_us]
            yield [message for message in within if message.qos > 0]
            if len(within) < len(batch):
                return
