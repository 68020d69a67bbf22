"""What the subscribers of each site hold: this site's topic filters (shared ones as
`$share/group/filter`), when its membership of each shared group takes effect and,
for each group that went from here, where its members stopped settling messages;
and the peers' filters as they last told them (`InterestTable`). The dispatcher
sets this site's filters and asks which sites hold a shared group; the relay tells
this site's to the peers and takes theirs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from ..ds import now_us
from ..topic import SHARE_PREFIX
from .interest import JOIN_DELAY_US, InterestTable, ShareMember

INTEREST_INTERVAL = 1.0
# A site that has told nothing for this long is forgotten (a few missed tellings:
# one that is only slow tells again, is told the filters were not had, and reads
# what it missed from storage).
INTEREST_EXPIRY = 5 * INTEREST_INTERVAL


class SiteInterest:
    """`fed_through`: per shard, the last timestamp this site's commit feed handed
    on (`Database.fed_through`), where a group that leaves with nothing unsettled
    stopped."""

    def __init__(self, site: str, fed_through: Callable[[], list[int]]) -> None:
        self.site = site
        self._fed_through = fed_through
        self.filters: frozenset[str] = frozenset()
        self.peers = InterestTable(INTEREST_EXPIRY)
        # This site's memberships of shared groups: when each takes effect, and where
        # the members of each it left stopped (with when it left, time.monotonic()).
        self.joined: dict[str, int] = {}
        self.left: dict[str, tuple[list[int], float]] = {}
        # set when this site's filters change: the relay tells them soon
        self.changed = asyncio.Event()

    def set_here(self, filters: frozenset[str],
                 left_from: Mapping[str, Mapping[int, int]] | None = None) -> None:
        """The topic filters this site has subscribers for: what other sites' leaders
        push here. For a shared group that just went from here, `left_from` may say
        per shard where its members stopped settling messages (a backlog not read):
        another site takes the group's share on from there, or from what this site
        was fed."""
        if filters == self.filters:
            return
        for share_filter in self.filters - filters:
            if share_filter.startswith(SHARE_PREFIX):
                self.joined.pop(share_filter, None)
                stopped = self._stopped_at((left_from or {}).get(share_filter, {}))
                self.left[share_filter] = (stopped, time.monotonic())
        self.filters = filters
        for topic_filter in filters:
            if topic_filter.startswith(SHARE_PREFIX) and topic_filter not in self.joined:
                self.joined[topic_filter] = now_us() + JOIN_DELAY_US
        self.changed.set()

    def _stopped_at(self, unsettled: Mapping[int, int]) -> list[int]:
        """Per shard, where a shared group's members here stopped settling messages:
        the first one unsettled, or the first after what this site was fed."""
        return [min(unsettled.get(shard, fed + 1), fed + 1)
                for shard, fed in enumerate(self._fed_through())]

    def stop_positions(self, unsettled: Mapping[str, Mapping[int, int]]
                       ) -> dict[str, list[int]]:
        """For each `$share/...` filter held here, per shard, where its members here
        stopped settling messages, from where they stop being settled (`unsettled`,
        the dispatcher's `shared_unsettled`): told to the other sites all along, so
        that when this site dies they deliver its share from there."""
        return {topic_filter: self._stopped_at(unsettled.get(topic_filter, {}))
                for topic_filter in self.filters if topic_filter.startswith(SHARE_PREFIX)}

    def members_with(self, share_filter: str) -> list[ShareMember]:
        """The sites holding a `$share/...` filter, with when each joined, this one
        included when it does."""
        members = [member for member in self.peers.members_of(share_filter)
                   if member[0] != self.site]
        if share_filter in self.filters:
            members.append((self.site, self.joined.get(share_filter, 0)))
        return members

    def shared_joined_of(self) -> dict[str, dict[str, int]]:
        """For each site with members of shared groups (this one included), when its
        membership of each took effect."""
        joined = {site: self.peers.joined_of(site) for site, _f in self.peers.items()}
        joined[self.site] = {f: self.joined[f] for f in self.filters if f in self.joined}
        return {site: groups for site, groups in joined.items() if groups}

    def interest_of(self) -> dict[str, list[str]]:
        """Each peer's filters as this site knows them (for the admin view)."""
        return {site: sorted(filters.filters) for site, filters in self.peers.items()}
