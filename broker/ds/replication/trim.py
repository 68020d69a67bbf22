"""How far a shard's log may be trimmed: pure.

An entry may go once every replica of the shard's current set holds it durably and
the leader has applied it: no replica will ask the leader for it again, and each
applies its own copy. A tail of `retain` entries is kept beyond that, so that a
follower that briefly falls behind (a restart, a slow disk) catches up from the log
rather than from a checkpoint. A follower never trims beyond what the leader told it
(it may lead next and serve the others) nor beyond what it applied itself."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def leader_trim_point(leader: str, replica_set: Collection[str], matched: Mapping[str, int],
                      leader_applied: int, retain: int) -> int:
    """The offset before which the leader's log may be trimmed (1: nothing may go).
    `matched`: per follower, the offset up to which its log is known to equal the
    leader's (a follower not in it holds nothing known, so nothing goes)."""
    held = min([leader_applied] + [matched.get(site, 0) for site in replica_set
                                   if site != leader])
    return max(1, held + 1 - retain)


def follower_trim_point(leader_says: int, applied: int) -> int:
    """The offset before which a follower's log may be trimmed."""
    return max(1, min(leader_says, applied + 1))
