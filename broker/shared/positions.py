"""Where this site's shared groups stopped settling messages, kept in storage (a
record per group and site in the `sessions` database, `SessionStore.save_group`)
every `SAVE_INTERVAL` when they moved, at a clean stop, and before the SUBACK of a
member whose session outlives its connection (`save_joined`):

- a restarted site finds its groups again: each is absent (`AbsentGroup` in
  dispatch.py) until a member is back, and then reads from where its members
  stopped, at least once. After a `kill -9`, messages settled in the last interval
  come again.
- on a cluster, a member whose session moves to another site takes the group's
  positions along (`kept_for`): the new site reads the old one's record before it
  takes the client id over, so the group's messages published while its members
  were away reach it there too, also when the old site is down. The `sessions`
  database is replicated, so the record outlives the site's disk.

Until the first load has succeeded nothing is written (a write would replace what
is still to be read): a member's SUBSCRIBE loads first, so its SUBACK never goes out
with its group unstored; if the load fails or takes longer than `load_wait`, so does
the SUBSCRIBE (its connection ends, the client tries again).

A record older than `keep_for` (the longest retention: storage holds nothing older to
read) is not used."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection
from typing import Any, Protocol

from ..errors import CorruptDataError, StorageTimeoutError, StratamqError
from ..session.store import SessionStore
from ..supervise import RESTART_PAUSE, supervise
from .groups import AbsentGroup

log = logging.getLogger(__name__)

FORMAT = 1
SAVE_INTERVAL = 1.0


def _group(entry: Any) -> AbsentGroup:
    """A group as encoded in a record (raises on a bad entry)."""
    return AbsentGroup({int(shard): int(at) for shard, at in entry["since"].items()},
                       {str(client) for client in entry["away"]})


def encode(group: AbsentGroup, saved_at: float) -> bytes:
    return json.dumps({"format": FORMAT, "saved_at": saved_at,
                       "since": {str(shard): at for shard, at in sorted(group.since.items())},
                       "away": sorted(group.away)}).encode()


def decode(raw: bytes) -> tuple[AbsentGroup, float]:
    """The group and when it was saved (s since the epoch); CorruptDataError when the
    bytes are not such a record."""
    try:
        found: Any = json.loads(raw)
        if found.get("format") != FORMAT:
            raise ValueError(f"unknown format {found.get('format')!r}")
        return _group(found), float(found["saved_at"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptDataError(f"shared group record: {exc}") from exc


class GroupsHere(Protocol):
    """What the positions need of the shared groups of this site (the dispatcher)."""

    def positions_to_keep(self, group_keys: Collection[str] | None = None
                          ) -> dict[str, AbsentGroup]: ...

    def adopt_absent(self, groups: dict[str, AbsentGroup]) -> None: ...


class SharedPositions:
    def __init__(self, dispatcher: GroupsHere, store: SessionStore, site: str,
                 keep_for: float, load_wait: float) -> None:
        self._dispatcher = dispatcher
        self._store = store
        self._site = site
        self._keep_for = keep_for
        self._load_wait = load_wait
        self._saver: asyncio.Task[None] | None = None
        # per group key: what is stored (without its time; "" for a record found at
        # start and not written since) and when it was written
        self._stored: dict[str, tuple[str, float]] = {}
        self._loaded = False
        # the load under way (one at a time, shared by whoever waits for it)
        self._loading: asyncio.Task[None] | None = None
        # one save at a time: a record written late must not undo a newer one
        self._saving = asyncio.Lock()

    async def load(self) -> None:
        """Give the dispatcher the groups this site kept when it stopped. A damaged
        record is logged and left out (its group starts from the live feed), never
        fatal; so is a client whose session another site owns now."""
        groups: dict[str, AbsentGroup] = {}
        for group_key, raw in (await self._store.groups_kept_by(self._site)).items():
            self._stored[group_key] = ("", 0.0)  # rewritten, or deleted, at the first save
            try:
                group, saved_at = decode(raw)
            except CorruptDataError as exc:
                log.error("shared group %s starts from the live feed: %s", group_key,
                          exc.message)
                continue
            if time.time() - saved_at <= self._keep_for:
                groups[group_key] = group
        for group in groups.values():
            group.away = {client for client in group.away if await self._owned_here(client)}
        groups = {key: group for key, group in groups.items() if group.away}
        self._dispatcher.adopt_absent(groups)
        self._loaded = True
        if groups:
            log.info("shared groups kept for their members: %s", ", ".join(sorted(groups)))

    async def _owned_here(self, client_id: str) -> bool:
        if not self._store.fenced:
            return True
        _epoch, owner = await self._store.owner_of(client_id)
        return owner in ("", self._site)

    async def kept_for(self, client_id: str, site: str,
                       group_keys: Collection[str]) -> dict[str, AbsentGroup]:
        """The groups among `group_keys` that `site` keeps for `client_id` (stored
        there, saved within `keep_for`), each as absent for that client alone: its
        session moves here, and the groups go along."""
        found: dict[str, AbsentGroup] = {}
        for group_key, raw in (await self._store.groups_kept_by(site, group_keys)).items():
            try:
                group, saved_at = decode(raw)
            except CorruptDataError as exc:
                log.error("shared group %s of site %s not taken along: %s", group_key,
                          site, exc.message)
                continue
            if client_id in group.away and time.time() - saved_at <= self._keep_for:
                found[group_key] = AbsentGroup(group.since, {client_id})
        return found

    def start(self) -> None:
        """Load, then save every `SAVE_INTERVAL`, in the background: on a cluster the
        `sessions` database may not be readable yet when a site starts (a member back
        before then reads from the positions once they are loaded)."""
        self._saver = asyncio.create_task(supervise("shared-positions", self._run),
                                          name="shared-positions")

    async def close(self) -> None:
        """Stop saving; a last save (the connections are closed: every group whose
        members keep their sessions is absent now)."""
        for task in (self._saver, self._loading):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not self._loaded:  # a save now would write over what is still to be read
            return
        try:
            await self.save(force=True)
        except StratamqError as exc:  # storage unwritable: the last save's positions stay
            log.warning("shared groups' positions not saved at the stop: %s", exc)

    async def _load_once(self) -> None:
        """The load, unless done: the attempt under way if there is one (its error
        too), else a new one. Attempts never overlap."""
        if self._loaded:
            return
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self.load())
            # its callers see its error; none may be left to, once they are cancelled
            self._loading.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.shield(self._loading)

    async def _run(self) -> None:
        while not self._loaded:
            try:
                await self._load_once()
            except StratamqError as exc:
                log.info("shared groups' positions not read yet (%s); trying again",
                         exc.message)
                await asyncio.sleep(RESTART_PAUSE)
        while True:
            await asyncio.sleep(SAVE_INTERVAL)
            await self.save()

    @property
    def saved(self) -> dict[str, list[str]]:
        """Per group key, the members away that this site's stored record names."""
        return {key: json.loads(text)["away"] for key, (text, _at) in self._stored.items()
                if text}

    async def save(self, force: bool = False) -> None:
        """Write the records of the groups whose positions moved (or whose time would
        soon make them look too old to use), or all with `force`; delete those of
        groups no longer kept."""
        async with self._saving:
            kept = self._dispatcher.positions_to_keep()
            now = time.time()
            writes = [self._write(group_key, group, text, now)
                      for group_key, group, text in self._changed(kept, now, force)]
            writes += [self._delete(group_key) for group_key in self._stored
                       if group_key not in kept]
            await asyncio.gather(*writes)

    async def save_joined(self, group_keys: Collection[str]) -> None:
        """Write the records of these groups now where they changed: a member whose
        session outlives its connection joined them (SUBSCRIBE). Its SUBACK waits for
        this, so the member can go at once, even to another site or with this site
        killed, and its group's messages published meanwhile still reach it. Before
        the load is done it loads first (a write would replace what is still to be
        read); when that fails or takes more than `load_wait`, it raises (a
        StratamqError, nothing written): the SUBSCRIBE fails, never answered."""
        if not self._loaded:
            try:
                await asyncio.wait_for(self._load_once(), self._load_wait)
            except TimeoutError:
                raise StorageTimeoutError(f"shared groups' positions not read within "
                                          f"{self._load_wait}s") from None
        async with self._saving:
            now = time.time()
            kept = self._dispatcher.positions_to_keep(group_keys)
            await asyncio.gather(*[self._write(group_key, group, text, now)
                                   for group_key, group, text in self._changed(kept, now)])

    def _changed(self, kept: dict[str, AbsentGroup], now: float, force: bool = False
                 ) -> list[tuple[str, AbsentGroup, str]]:
        """The groups of `kept` whose records must be written, each with its text."""
        changed = []
        for group_key, group in kept.items():
            text = encode(group, 0.0).decode()
            stored, at = self._stored.get(group_key, ("", 0.0))
            if force or text != stored or now - at >= self._keep_for / 2:
                changed.append((group_key, group, text))
        return changed

    async def _write(self, group_key: str, group: AbsentGroup, text: str, now: float) -> None:
        await self._store.save_group(group_key, self._site, encode(group, now))
        self._stored[group_key] = (text, now)

    async def _delete(self, group_key: str) -> None:
        await self._store.delete_group(group_key, self._site)
        del self._stored[group_key]
