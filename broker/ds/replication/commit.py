"""When a shard's leader may call an entry committed, and so answer its writers: pure.

An entry is committed once a majority of the shard's replica set holds it durably
(the leader counts itself). Like Raft, a leader only counts replicas for entries of
its own epoch; an older entry it inherited is committed with the first entry of its
epoch after it. Otherwise an entry held by a majority under an old epoch could still
be cut off by a later leader that never had it (Raft paper, figure 8)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping


def majority(replicas: int) -> int:
    """How many replicas make a majority of `replicas`."""
    return replicas // 2 + 1


def commit_offset(leader_epoch: int, replica_set: Collection[str],
                  matched: Mapping[str, int], epoch_at: Callable[[int], int | None],
                  committed: int) -> int:
    """The leader's new commit offset. `matched` is, per site of the replica set (the
    leader included), the offset up to which its log is known to equal the leader's;
    `epoch_at` reads the leader's log; `committed` is the offset committed so far,
    which never goes back."""
    if not replica_set:
        raise ValueError("a shard has at least one replica")
    offsets = sorted((matched.get(site, 0) for site in replica_set), reverse=True)
    candidate = offsets[majority(len(replica_set)) - 1]
    if candidate <= committed or epoch_at(candidate) != leader_epoch:
        return committed
    return candidate
