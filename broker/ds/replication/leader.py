"""A shard leader's bookkeeping: what to send each follower next, what each is known
to hold, and what is committed. No I/O of its own beyond the leader's `ShardLog`:
the peer transport carries `AppendRequest`s to followers (which answer with
`ShardLog.append_from_leader`) and brings their `AppendResult`s back here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .commit import commit_offset, majority
from .log import (
    AppendResult,
    BootstrapNeededError,
    Entry,
    Position,
    ShardLog,
    StaleEpochError,
)


@dataclass(frozen=True, slots=True)
class AppendRequest:
    """Entries for one follower: they follow the leader's entry at `previous`.
    `committed` is the leader's commit offset: the follower may apply its entries up
    to it, where they are the leader's. `trim_before`: the follower may forget its
    log's entries before that offset (see `trim.py`)."""

    epoch: int
    previous: Position
    entries: list[Entry]
    committed: int = 0
    trim_before: int = 0


@dataclass(slots=True)
class Leadership:
    site: str
    epoch: int
    log: ShardLog
    replica_set: tuple[str, ...]
    # per follower: the offset to send from next, and the offset up to which its log
    # is known to equal ours
    next_offset: dict[str, int] = field(default_factory=dict)
    matched: dict[str, int] = field(default_factory=dict)
    committed: int = 0
    # what followers may trim (entries before it), told with each append
    trim_before: int = 0
    # per follower: when it last answered this leader (the caller's monotonic clock),
    # and when this leadership began (a follower not heard from yet counts from then)
    heard: dict[str, float] = field(default_factory=dict)
    began: float = 0.0
    # per follower: when the newest request it answered at this epoch was sent (the
    # same clock): it had not seen a newer leader then (a read index, `confirmed_since`)
    confirmed: dict[str, float] = field(default_factory=dict)

    @classmethod
    def begin(cls, site: str, epoch: int, log: ShardLog, replica_set: tuple[str, ...],
              committed: int = 0, now: float = 0.0) -> Leadership:
        """Take the lead of a shard at `epoch` (the controller's choice): fence the
        own log, then start sending each follower from the end of ours (a follower
        that lacks something says where to resend from). `now`: the caller's
        monotonic clock, which `heard_from` and `quorum_age` are given too."""
        if site not in replica_set:
            raise ValueError(f"site {site} leads a shard it is no replica of")
        log.observe_epoch(epoch)
        start = log.last.offset + 1
        return cls(site, epoch, log, replica_set,
                   {follower: start for follower in replica_set if follower != site},
                   {}, committed, began=now)

    @property
    def current(self) -> bool:
        """False once this site's log has seen a newer epoch: it must step down."""
        return self.log.epoch == self.epoch

    def append(self, batches: list[bytes], sync: bool = True) -> list[Position]:
        """Append cooked batches; they are committed once `committed` reaches them.
        `sync=False`: this copy counts once synced (`ShardLog.sync`, then `advance`)."""
        if not self.current:
            raise StaleEpochError(f"leader of epoch {self.epoch} was replaced "
                                  f"(epoch {self.log.epoch} seen)")
        positions = self.log.append_as_leader(self.epoch, batches, sync)
        self._advance()  # a replica set of one commits at once
        return positions

    def advance(self) -> int:
        """Recount the commit offset after this site appended to, or synced, its own
        log outside `append` (a site writes off the event loop, then counts on it);
        returns it."""
        return self._advance()

    def request_for(self, follower: str, max_entries: int = 1000,
                    max_bytes: int = 4 * 1024 * 1024) -> AppendRequest:
        """What to send `follower` now (no entries: a heartbeat that still checks
        where its log ends)."""
        try:
            tail = tail_for(self.log, self.next_offset[follower], max_entries, max_bytes)
        except BootstrapNeededError as exc:  # trimmed: the follower needs a checkpoint
            raise BootstrapNeededError(f"follower {follower}: {exc.message}: bootstrap it "
                                       f"from a checkpoint", exc.first_offset) from None
        return replace(tail, epoch=self.epoch, committed=self.committed,
                       trim_before=self.trim_before)

    def request_from_memory(self, follower: str, max_entries: int = 1000,
                            max_bytes: int = 4 * 1024 * 1024) -> AppendRequest | None:
        """`request_for`, when what `follower` lacks is among the newest entries the
        log keeps in memory (a follower right behind): safe on the event loop. None
        when it must be read from disk (`request_for`, on the executor)."""
        start = min(self.next_offset[follower], self.log.last.offset + 1)
        recent = self.log.read_in_memory(start, max_entries, max_bytes)
        if recent is None:
            return None
        return AppendRequest(self.epoch, recent.previous, list(recent.entries),
                             self.committed, self.trim_before)

    def on_result(self, follower: str, result: AppendResult) -> int:
        """Take a follower's answer; returns the commit offset after it."""
        if result.accepted:
            self.matched[follower] = max(self.matched.get(follower, 0), result.matched)
            self.next_offset[follower] = result.matched + 1
        else:
            self.next_offset[follower] = result.retry_from
            # It lacks what comes from there (its copy was replaced by an empty one,
            # say): counted as holding it, it would stand in for a copy nobody has.
            self.matched[follower] = min(self.matched.get(follower, 0),
                                         result.retry_from - 1)
        return self._advance()

    def heard_from(self, follower: str, at: float) -> None:
        """`follower` answered an append or heartbeat (accepted or not) at `at`."""
        self.heard[follower] = max(self.heard.get(follower, at), at)

    def confirmed_by(self, follower: str, sent: float) -> None:
        """`follower` answered, at this leader's epoch, a request sent at `sent`."""
        self.confirmed[follower] = max(self.confirmed.get(follower, sent), sent)

    def confirmed_since(self, at: float) -> bool:
        """Whether a majority of the replica set, this leader included, answered at
        its epoch requests sent at `at` or later: then no newer leader had fenced a
        majority by `at` (it would have fenced one of them, which would have refused),
        so nothing was committed without this leader by then, and a read of what it
        holds once it applied its log as of `at` misses no write acknowledged before.
        Raft's read index, with the controller's failover in place of an election."""
        needed = majority(len(self.replica_set)) - 1  # this leader counts itself
        return sum(1 for follower in self.replica_set if follower != self.site
                   and self.confirmed.get(follower, -1.0) >= at) >= needed

    def quorum_age(self, now: float) -> float:
        """Seconds since a majority of the replica set, this leader included, last
        answered it: how long this leader has been unable to commit for want of
        replicas. Idle, it still hears every follower each heartbeat interval (an
        empty append), so a healthy shard's age stays below that interval plus a
        round trip. 0 when this leader alone is a majority."""
        needed = majority(len(self.replica_set)) - 1  # this leader counts itself
        if needed <= 0:
            return 0.0
        latest = sorted((self.heard.get(follower, self.began) for follower in self.replica_set
                         if follower != self.site), reverse=True)
        return max(0.0, now - latest[needed - 1])

    def _advance(self) -> int:
        # this leader counts itself as far as its own copy is on disk: it ships an
        # entry to its followers while it syncs it (`ShardLog.sync`)
        matched = {**self.matched, self.site: self.log.durable}
        self.committed = commit_offset(self.epoch, self.replica_set, matched,
                                       self.log.epoch_at, self.committed)
        self.log.commit_to(self.committed)
        return self.committed


def tail_for(log: ShardLog, start: int, max_entries: int = 1000,
             max_bytes: int = 4 * 1024 * 1024) -> AppendRequest:
    """This log's entries from `start` on (no further than its end), after its entry
    just before them, as an append of this log's epoch and commit offset (a leader's
    `request_for` puts its own). What a replica fenced by a new leader sends it, for
    the new leader to append as a follower would (`ShardLog.append_from_leader`): a
    new leader pulls the tail of the most advanced of a fenced majority this way
    before it appends anything of its own, and every committed entry is in that tail.
    BootstrapNeededError when `start` is trimmed here."""
    start = min(start, log.last.offset + 1)
    previous_epoch = log.epoch_at(start - 1)
    if previous_epoch is None:
        raise BootstrapNeededError(
            f"needs entries from {start}, trimmed from this log (it starts at "
            f"{log.first_offset})", log.first_offset)
    return AppendRequest(log.epoch, Position(previous_epoch, start - 1),
                         log.read(start, max_entries, max_bytes), log.committed)
