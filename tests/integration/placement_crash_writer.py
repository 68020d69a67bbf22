"""A process that keeps pushing newer placements into a PlacementStore until it is
killed; prints `kept <version>` once `offer` has returned, so the crash test knows
which version the store promised to keep."""

from __future__ import annotations

import sys
from pathlib import Path

from stratamq.broker.ds.replication import Placement, PlannedSite, plan
from stratamq.broker.ds.replication.store import PlacementStore

SITES = [PlannedSite(f"site{number}") for number in range(5)]


def main(data_dir: str) -> None:
    store = PlacementStore(Path(data_dir))
    # A large document (3 x 256 shards), so a kill often lands inside a write.
    shards = plan(SITES, ["messages", "retained", "sessions"], 256, 3).target.shards
    print("ready", flush=True)
    while True:
        version = store.current.version + 1 if store.current is not None else 1
        newer = Placement(version=version, shards=shards)
        store.offer(newer)
        print(f"kept {newer.version}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
