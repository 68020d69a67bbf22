"""Several shards moved at once (`stratamq cluster controller --max-concurrent-moves`,
the operator's `spec.maxConcurrentMoves`; docs/replication.md, "The controller"), with
real processes.

Three sites at replication factor 3, four shards, a publisher per shard on site 0 and
a subscriber on site 1 all the while. A fourth site joins with three moves at once
allowed: the controller takes the three `+site` steps in one round (its log lists
them one after the other, and the placement version goes up by three at once), each
removal after its own shard's joiner has caught up. At the end the plan is done,
every shard's replicas hold the same content at the same offset, and the history
check finds nothing lost, duplicated or out of order."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from harness.cluster import DB, Cluster, SiteProcess, ctl_ds, http_json, poll
from tests.support.history import History
from tests.support.recorder import (
    RecordingPublisher,
    RecordingSubscriber,
    all_connected,
    describe_clients,
    wait_delivered,
)
from tests.support.shards import client_id_on_shard

pytestmark = pytest.mark.cluster

N_SHARDS = 4
HEARTBEAT = 0.5
MOVES = 3
STEP_LINE = re.compile(r"step messages/(\d+): ([+-])([0-9A-F]{16}).*\(placement version (\d+)\)")


def test_a_join_moves_three_shards_at_once_and_loses_nothing(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, 3, n_shards=N_SHARDS, heartbeat_interval=HEARTBEAT,
                      max_concurrent_moves=MOVES)
    history = History()
    subscriber = RecordingSubscriber(history, "pm-sub", cluster.sites[1].host,
                                     cluster.sites[1].port, "pm/#", qos=1)
    publishers = [RecordingPublisher(history, client_id_on_shard(f"pm-pub{shard}", shard,
                                                                 N_SHARDS),
                                     cluster.sites[0].host, cluster.sites[0].port,
                                     [f"pm/{shard}"], (1, 2), pace=0.01)
                  for shard in range(N_SHARDS)]
    jumps: list[int] = []
    try:
        cluster.start()
        subscriber.start()
        assert subscriber.subscribed.wait(30), "no SUBACK"
        for publisher in publishers:
            publisher.start()
        assert all_connected([*publishers, subscriber], 30), \
            describe_clients([*publishers, subscriber])
        new = SiteProcess(tmp_path / "site-3", 3, "127.0.0.4", n_shards=N_SHARDS,
                          heartbeat_interval=HEARTBEAT)
        cluster.sites.append(new)
        new.start()
        new_id = new.replication()["site"]
        cluster.site_ids.append(new_id)
        assert http_json("POST", f"{cluster.controller.url}/api/v1/ds/sites",
                         {"admin_url": new.admin_url})["probed"]
        time.sleep(1.0)  # something in every shard for the joiner to catch up on
        before = cluster.controller.storage()["placement_version"]
        planned = ctl_ds(cluster, "join", DB, new_id)
        print(f"\n{planned}")
        seen = [before]

        def done() -> bool:
            storage = cluster.controller.storage()
            if storage["placement_version"] != seen[-1]:
                jumps.append(storage["placement_version"] - seen[-1])
                seen.append(storage["placement_version"])
            assert all(len(shard["replicas"]) >= 3 for shard in storage["shards"]), storage
            return not storage["plan"] and not any(shard["transitions"]
                                                   for shard in storage["shards"])

        assert poll(done, 120, 0.02), f"the join did not finish:\n{cluster.describe()}"
        assert cluster.wait_ready(60), f"roles not taken:\n{cluster.describe()}"
        for publisher in publishers:
            publisher.stop_publishing()
        drained = poll(lambda: all(p.unacked() == 0 for p in publishers), 60, 0.2)
        delivered = wait_delivered(history)
        same = poll(lambda: cluster.same_content(DB), 30, 0.5)
        held = sum(new_id in shard["replicas"]
                   for shard in cluster.controller.storage()["shards"])
        steps = [match.groups() for match in STEP_LINE.finditer(cluster.controller.log())]
        final_state = cluster.describe()
    finally:
        client_state = describe_clients([*publishers, subscriber])
        subscriber.close()
        for publisher in publishers:
            publisher.close()
        tracebacks = cluster.tracebacks() if cluster.site_ids else {}
        cluster.close()
    print(f"placement versions seen after the join: {seen} (jumps {jumps})\n"
          f"steps: {steps}\n{history.summary()}\nclients: {client_state}")
    assert not any(tracebacks.values()), tracebacks
    assert held == N_SHARDS * 3 // 4
    # The first three steps are the three joins, one per shard, at three versions in a
    # row (taken in one round: laid out in a wave, and the version went up by three
    # between two looks 20 ms apart, where one step a round takes a heartbeat each).
    joins = steps[:MOVES]
    assert [(sign, site) for _shard, sign, site, _version in joins] == [("+", new_id)] * MOVES
    assert len({shard for shard, *_ in joins}) == MOVES
    assert [int(version) for *_, version in joins] == [before + 1, before + 2, before + 3]
    assert max(jumps) >= 2, jumps
    assert drained, history.summary()
    assert delivered, history.summary()
    assert same, final_state
    problems = history.problems_by_kind()
    assert not problems, problems
