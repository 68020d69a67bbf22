"""Safety of the replicated shard log under leader changes, checked on real shard logs
(RocksDB in a temporary folder) driven by a model of the protocol: leaders append and
ship entries to followers while they sync their own copies (a leader counts itself
towards a majority once synced), sites lose power (what they had not synced is
gone, and they forget what they knew committed), commit by the commit rule, and the
controller's failover
fences a majority with a new epoch and picks among it the highest (epoch, offset),
or names any site, which fences a majority itself and first appends the tail of
the most advanced of them (a leader chosen on positions gone stale: the takeover of
`ShardReplica`).
Old leaders keep trying (as one cut off from the others would). Whatever happens, no
committed (acknowledged) entry is ever lost or changed: every later leader holds it,
and once every site has caught up, every log holds it."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratamq.broker.ds.replication import (
    Leadership,
    Position,
    ShardLog,
    StaleEpochError,
    majority,
    tail_for,
)
from tests.support.shard_log import check_memory_matches_disk

SITES = ["s0", "s1", "s2", "s3", "s4"]


class Cluster:
    def __init__(self, folder: Path) -> None:
        self.logs = {site: ShardLog(folder / site) for site in SITES}
        self.leaders: dict[str, Leadership] = {}
        self.acknowledged: dict[int, tuple[int, bytes]] = {}
        self.writes = 0
        self.epoch = 0
        self.failover(set(SITES))

    def close(self) -> None:
        for log in self.logs.values():
            log.close()

    def leader(self, rank: int) -> str:
        """The leader of the `rank`-th newest epoch among sites that think they lead
        (0: the newest)."""
        newest_first = sorted(self.leaders, key=lambda site: -self.leaders[site].epoch)
        return newest_first[rank % len(newest_first)]

    def leadership(self, site: str) -> Leadership | None:
        """The site's leadership, while its own log has seen no newer epoch: a site
        that learns of a newer leader (fenced, or sent entries by it) steps down."""
        leadership = self.leaders.get(site)
        if leadership is not None and not leadership.current:
            del self.leaders[site]
            return None
        return leadership

    def write(self, site: str, synced: bool = True) -> None:
        """A leader's append; `synced=False`: written, synced later (`sync`), as a
        leader with followers does (it ships the entry meanwhile)."""
        leadership = self.leadership(site)
        if leadership is None:
            return
        self.writes += 1
        self.acknowledge(leadership, lambda: leadership.append([b"w%d" % self.writes],
                                                               sync=synced))

    def sync(self, site: str) -> None:
        """A leader's sync of its own appends ends."""
        leadership = self.leadership(site)
        if leadership is None:
            return
        def synced() -> None:
            leadership.log.sync()
            leadership.advance()
        self.acknowledge(leadership, synced)

    def power_loss(self, site: str) -> None:
        """The site's machine stops: its log comes back with what was on disk only,
        and the site remembers no leadership or commit offset."""
        log = self.logs[site]
        durable = log.durable
        log.close()
        self.logs[site] = log = ShardLog(log.path)
        log.truncate_after(durable)
        self.leaders.pop(site, None)

    def replicate(self, site: str, follower: str) -> None:
        leadership = self.leadership(site)
        if leadership is None or follower == site:
            return
        request = leadership.request_for(follower, max_entries=3)
        # what a leader's sender sends a follower right behind, without the executor
        in_memory = leadership.request_from_memory(follower, max_entries=3)
        assert in_memory is None or in_memory == request
        try:
            result = self.logs[follower].append_from_leader(
                request.epoch, request.previous, request.entries, request.committed)
        except StaleEpochError:
            del self.leaders[site]  # the follower knows a newer leader
            return
        self.acknowledge(leadership, lambda: leadership.on_result(follower, result))

    def acknowledge(self, leadership: Leadership, step: Callable[[], object]) -> None:
        """Run a leader's step; what it newly commits is acknowledged to writers."""
        before = leadership.committed
        step()
        if leadership.committed == before:
            return
        for entry in leadership.log.read(before + 1, leadership.committed - before):
            known = self.acknowledged.setdefault(entry.position.offset,
                                                 (entry.position.epoch, entry.batch))
            assert known == (entry.position.epoch, entry.batch), (
                f"offset {entry.position.offset} committed twice, differently")

    def failover(self, voters: set[str]) -> str:
        """Fence the voters with a new epoch, then make the most advanced one leader."""
        assert len(voters) >= majority(len(SITES))
        self.epoch += 1
        for voter in sorted(voters):
            self.logs[voter].observe_epoch(self.epoch)
        leader = max(sorted(voters), key=lambda voter: self.logs[voter].last)
        self.leaders[leader] = Leadership.begin(leader, self.epoch, self.logs[leader],
                                                tuple(SITES))
        self.check_holds_everything_acknowledged(leader)
        return leader

    def take_over(self, chosen: str, voters: set[str]) -> str:
        """The controller names `chosen` from positions that may be stale by now (a
        planned handover checks them a round before; the old leader may still commit
        meanwhile): the new leader fences a majority itself, then appends the tail of
        the most advanced of them (`tail_for`) before anything of its own."""
        fenced = voters | {chosen}
        assert len(fenced) >= majority(len(SITES))
        self.epoch += 1
        for voter in sorted(fenced):
            self.logs[voter].observe_epoch(self.epoch)
        best = max(sorted(fenced), key=lambda voter: self.logs[voter].last)
        own, theirs = self.logs[chosen], self.logs[best]
        start = own.last.offset + 1
        while own.last < theirs.last:
            request = tail_for(theirs, start, max_entries=2)
            result = own.append_from_leader(self.epoch, request.previous, request.entries,
                                            request.committed)
            start = result.matched + 1 if result.accepted else result.retry_from
        self.leaders[chosen] = Leadership.begin(chosen, self.epoch, own, tuple(SITES))
        self.check_holds_everything_acknowledged(chosen)
        return chosen

    def laggards(self) -> set[str]:
        """A majority of the sites whose logs are the least advanced."""
        ranked = sorted(SITES, key=lambda site: (self.logs[site].last, site))
        return set(ranked[:majority(len(SITES))])

    def check_applies_only_acknowledged(self) -> None:
        """What any site may apply (its log up to `committed`) was acknowledged, as
        it is: no replica's data ever holds an entry that could be cut off."""
        for site, log in self.logs.items():
            for entry in log.read(log.first_offset, max(log.committed, 1)):
                if entry.position.offset > log.committed:
                    break
                assert self.acknowledged.get(entry.position.offset) == (
                    entry.position.epoch, entry.batch), (
                        f"{site} may apply offset {entry.position.offset}, not acknowledged")

    def check_memory_matches_disk(self) -> None:
        """Every site's newest entries in memory are those on disk, at their offsets."""
        for site, log in self.logs.items():
            check_memory_matches_disk(log, site)

    def check_holds_everything_acknowledged(self, site: str) -> None:
        log = self.logs[site]
        for offset, (epoch, batch) in self.acknowledged.items():
            entries = log.read(offset, max_entries=1)
            assert entries and entries[0].position == Position(epoch, offset) \
                and entries[0].batch == batch, (
                    f"{site} leads epoch {self.epoch} without acknowledged entry {offset}")


# Leaders are named by rank (0: the newest, 1: the one before, ...): most operations
# then do something, and old leaders still act, as one cut off from the others would.
operation = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("replicate"), st.integers(0, 2), st.sampled_from(SITES)),
    st.tuples(st.just("sync"), st.integers(0, 2)),
    st.tuples(st.just("power_loss"), st.sampled_from(SITES)),
    st.tuples(st.just("failover"), st.sets(st.sampled_from(SITES), min_size=3)),
    # the hardest majority: the least advanced sites (the others are cut off)
    st.tuples(st.just("failover"), st.just("laggards")),
    # a leader named on stale positions (any site), taking over by itself
    st.tuples(st.just("take_over"), st.sampled_from(SITES),
              st.sets(st.sampled_from(SITES), min_size=3)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, max_size=80))
def test_no_acknowledged_entry_is_ever_lost(operations: list[tuple]) -> None:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as folder:
        cluster = Cluster(Path(folder))
        try:
            for kind, *args in operations:
                if not cluster.leaders and kind not in ("failover", "take_over",
                                                        "power_loss"):
                    continue  # every leader learnt it was replaced: wait for a failover
                if kind == "power_loss":
                    cluster.power_loss(args[0])
                elif kind == "sync":
                    cluster.sync(cluster.leader(args[0]))
                elif kind == "take_over":
                    cluster.take_over(args[0], set(args[1]))
                elif kind == "write":
                    cluster.write(cluster.leader(args[0]), synced=args[1])
                elif kind == "replicate":
                    cluster.replicate(cluster.leader(args[0]), args[1])
                elif args[0] == "laggards":
                    cluster.failover(cluster.laggards())
                else:
                    cluster.failover(set(args[0]))
                cluster.check_applies_only_acknowledged()
                cluster.check_memory_matches_disk()
            # heal: every site votes, the new leader brings everyone up to date
            leader = cluster.failover(set(SITES))
            cluster.write(leader)
            for _ in range(40):
                for follower in SITES:
                    cluster.replicate(leader, follower)
            log = cluster.logs[leader]
            assert cluster.leaders[leader].committed == log.last.offset
            expected = [(entry.position, entry.batch) for entry in log.read(1, 10_000)]
            for site in SITES:
                assert [(entry.position, entry.batch) for entry in
                        cluster.logs[site].read(1, 10_000)] == expected, site
                cluster.check_holds_everything_acknowledged(site)
                # the last round told every follower the final commit offset
                assert cluster.logs[site].committed == log.last.offset, site
            cluster.check_applies_only_acknowledged()
        finally:
            cluster.close()


def test_a_leaders_copy_counts_towards_a_majority_only_once_on_disk(
        tmp_path: Path) -> None:
    """The leader ships w1 before it syncs it: held by s1 and s2 (on disk) and by the
    leader (not yet), w1 is not committed. Counted, it would be lost: the leader loses
    power, and the next leader is chosen among sites that never had it."""
    cluster = Cluster(tmp_path)  # epoch 1: s0 leads
    try:
        cluster.write("s0", synced=False)
        for follower in ("s1", "s2"):
            cluster.replicate("s0", follower)
        assert cluster.acknowledged == {}
        cluster.power_loss("s0")
        assert cluster.failover({"s0", "s3", "s4"}) in ("s0", "s3", "s4")
        # and synced, the same copies commit it
        leader = cluster.leader(0)
        cluster.write(leader, synced=False)
        for follower in sorted(set(SITES) - {leader})[:2]:
            cluster.replicate(leader, follower)
        cluster.sync(leader)
        assert list(cluster.acknowledged) == [1]
    finally:
        cluster.close()


def test_an_old_epochs_entry_on_a_majority_is_not_committed_by_counting(
        tmp_path: Path) -> None:
    """Raft's figure 8, in this protocol: an entry of epoch 1 reaches a majority only
    under the leader of epoch 3. Counted as committed then, it would be lost when the
    leader of epoch 2's entry wins the next failover."""
    cluster = Cluster(tmp_path)  # epoch 1: s0 leads
    try:
        cluster.write("s0")
        for follower in SITES[1:]:
            cluster.replicate("s0", follower)
        assert cluster.acknowledged == {1: (1, b"w1")}
        cluster.write("s0")  # (1, 2) reaches s1 only
        cluster.replicate("s0", "s1")
        assert cluster.failover({"s2", "s3", "s4"}) == "s2"  # epoch 2
        cluster.write("s2")  # (2, 2) stays on s2
        assert cluster.failover({"s0", "s1", "s3"}) == "s0"  # epoch 3
        for follower in ("s1", "s3", "s3"):  # the first try at s3 finds where it ends
            cluster.replicate("s0", follower)
        assert cluster.leaders["s0"].matched == {"s1": 2, "s3": 2}  # (1, 2): a majority
        assert 2 not in cluster.acknowledged  # ...but not of epoch 3: not committed
        assert cluster.failover({"s2", "s3", "s4"}) == "s2"  # epoch 4: (2, 2) wins
        assert [entry.position for entry in cluster.logs["s2"].read(1)] == [
            Position(1, 1), Position(2, 2)]
    finally:
        cluster.close()


def test_a_leader_named_on_stale_positions_takes_the_committed_tail_over(
        tmp_path: Path) -> None:
    """s0 commits w2 on s0, s1, s2 after the controller last saw the positions, when
    s3 (which lacks w2) looked as good as any: named leader, s3 fences s1 and s4 and
    appends s1's tail before its own first entry; w2 is not lost, and the old
    leader's further appends are refused."""
    cluster = Cluster(tmp_path)  # epoch 1: s0 leads
    try:
        cluster.write("s0")
        for follower in SITES[1:]:
            cluster.replicate("s0", follower)
        cluster.write("s0")
        for follower in ("s1", "s2"):
            cluster.replicate("s0", follower)
        assert cluster.acknowledged == {1: (1, b"w1"), 2: (1, b"w2")}
        assert cluster.take_over("s3", {"s1", "s4"}) == "s3"  # epoch 2
        assert [entry.position for entry in cluster.logs["s3"].read(1)] == [
            Position(1, 1), Position(1, 2)]
        cluster.write("s0")
        cluster.replicate("s0", "s1")  # fenced: s0 learns it was replaced
        assert "s0" not in cluster.leaders
        cluster.write("s3")
        for follower in ("s0", "s1", "s2", "s4"):
            cluster.replicate("s3", follower)
        assert cluster.acknowledged[3] == (2, b"w4")
    finally:
        cluster.close()
