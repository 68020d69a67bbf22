"""The zone rule of replica placement (docs/replication.md, "Zones"): for every shard,
at most `cap` of its replicas in any one zone, `cap` being the replication factor
over the number of distinct zones among the sites that may hold replicas, rounded
up; so no two replicas of a shard share a zone while there are as many zones as
replicas. A site whose zone is not known counts as a zone of its own.

This module only says what the rule allows; the planner (`planner`) decides where
replicas go. It is apart from the planner because the rule is a question of its own
(which sites count as one zone, when the rule can be met at all) that the planner
asks at every move. Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass

# A zone as the rule sees it: ("zone", name) for a known zone, ("site", id) for a site
# whose zone is unknown, so that such a site never shares a zone with another.
ZoneKey = tuple[str, str]


def zone_key(site: str, zone: str | None) -> ZoneKey:
    return ("site", site) if zone is None else ("zone", zone)


@dataclass(frozen=True)
class ZoneRule:
    """The rule for one set of sites: `zone_of` every site (draining ones too, whose
    replicas count in their zone until they leave), at most `cap` replicas of a shard
    in one zone."""

    zone_of: Mapping[str, ZoneKey]
    cap: int

    @classmethod
    def for_sites(cls, zones: Mapping[str, str | None], active: Collection[str],
                  replication_factor: int) -> ZoneRule | None:
        """The rule for sites with these `zones` (site -> zone or None), of which
        `active` may hold replicas; None where the rule asks nothing of the planner:
        every placement meets it (no zone has more sites that may hold replicas than
        `cap`, as when no zone is known) or none can (the zones are too few or too
        small: `cap` per zone, or all of a smaller zone's sites, leave a shard short of
        `replication_factor` replicas), in which case the planner places replicas as
        if there were no zones."""
        zone_of = {site: zone_key(site, zone) for site, zone in zones.items()}
        sizes = Counter(zone_of[site] for site in active)
        if not sizes:
            return None
        cap = -(-replication_factor // len(sizes))
        if max(sizes.values()) <= cap:
            return None
        if sum(min(size, cap) for size in sizes.values()) < replication_factor:
            return None
        return cls(zone_of=zone_of, cap=cap)

    def counts(self, replicas: Collection[str]) -> Counter[ZoneKey]:
        return Counter(self.zone_of[site] for site in replicas)

    def met(self, replicas: Collection[str]) -> bool:
        return all(count <= self.cap for count in self.counts(replicas).values())

    def crowded(self, replicas: Collection[str]) -> list[ZoneKey]:
        """The zones holding more than `cap` of these replicas, in a fixed order."""
        return sorted(zone for zone, count in self.counts(replicas).items()
                      if count > self.cap)

    def allows(self, replicas: Collection[str], taker: str, giver: str | None = None) -> bool:
        """Whether a shard with `replicas` may take one on `taker` (while `giver`, if
        named, gives one up) and have at most `cap` of them in the taker's zone."""
        zone = self.zone_of[taker]
        after = sum(1 for site in replicas if site != giver and self.zone_of[site] == zone)
        return after + 1 <= self.cap
