"""The controller's state on disk, in its data folder, so that a restarted controller
goes on where it stopped: `placement.json` (the newest placement, `PlacementStore`),
`plan.json` (the pending plan, `Plan.to_json`; absent when none) and `cluster.json`
(the sites it knows, with their admin URLs and peer addresses, the sites each
database should live on, the sites forgotten for good, and the last controller term
it took). Every file is written
atomically. `controller.lock` is held (`FolderLock`) by the one controller that
uses the folder, so `StateFiles` is a `store.StateStore` that never refuses a keep.

Blocking file I/O on small files; the controller calls it in an executor.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..ds.replication import Placement, PlacementStore, Plan
from ..ds.replication.placement import check_database, check_site_id
from ..ds.replication.term import NO_TERM, ControllerTerm, parse_term
from ..errors import CorruptDataError, PlacementError, StratamqError
from ..files import write_atomically
from .decisions import ClusterState, resumed_catch_ups
from .store import Kept

PLAN_FILE = "plan.json"
CLUSTER_FILE = "cluster.json"
LOCK_FILE = "controller.lock"
FORMAT = 1


class FolderLockedError(StratamqError):
    """Another controller holds the data folder's lock."""


class FolderLock:
    """An exclusive `flock` on `controller.lock` in a controller's data folder, held
    until `release` (or the process ends, even by SIGKILL). Two controllers on one
    folder would each decide from a copy of the placement the other overwrites, so
    the second one refuses to start (`FolderLockedError`, naming the holder's pid)."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
            os.close(descriptor)
            raise FolderLockedError(
                f"{data_dir}: another controller uses this data folder (pid "
                f"{holder or 'unknown'} holds {path}); stop it first or give this one "
                f"another --data-dir") from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        self._descriptor: int | None = descriptor

    def release(self) -> None:
        if self._descriptor is not None:
            with contextlib.suppress(OSError):
                os.close(self._descriptor)  # closing the only descriptor drops the lock
            self._descriptor = None


@dataclass(frozen=True)
class SiteAddress:
    """Where a site is reached, as `cluster.json` keeps it: its admin API (by the
    controller) and its peer port (by the other sites)."""

    id: str
    admin_url: str
    peer: str | None


@dataclass(frozen=True)
class FolderRecord:
    """What the folder keeps: the state, the sites known, the sites forgotten for good
    and the last controller term taken."""

    state: ClusterState
    sites: tuple[SiteAddress, ...] = ()
    forgotten: frozenset[str] = frozenset()
    term: ControllerTerm = NO_TERM


class StateFiles:
    """The three files of one controller data folder: a `store.StateStore` of
    `FolderRecord`s that never refuses (the folder has one writer, `FolderLock`)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.placements = PlacementStore(data_dir)
        self.plan_path = data_dir / PLAN_FILE
        self.cluster_path = data_dir / CLUSTER_FILE

    def load(self) -> FolderRecord:
        """What the folder keeps; a pending plan that the kept placement is a step of
        resumes (waiting on the replicas that joined last)."""
        placement = self.placements.current or Placement.empty()
        plan = self._load_plan()
        sites, goals, forgotten, term = self._load_cluster()
        catch_ups = () if plan is None else resumed_catch_ups(plan, placement)
        return FolderRecord(ClusterState(placement=placement, plan=plan, goals=goals,
                                         catch_ups=catch_ups), tuple(sites), forgotten, term)

    def keep(self, record: FolderRecord) -> Kept:
        """Write `record`. The placement goes first: it is the one document sites may
        already hold, and a restart must never go back to an older version."""
        state = record.state
        if state.placement.version > 0:
            self.placements.offer(state.placement)
        if state.plan is None:
            self.plan_path.unlink(missing_ok=True)
        else:
            write_atomically(self.plan_path, state.plan.to_json())
        document = {
            "format": FORMAT,
            "sites": [{"id": site.id, "admin_url": site.admin_url, "peer": site.peer}
                      for site in sorted(record.sites, key=lambda site: site.id)],
            "goals": {database: list(goal) for database, goal in sorted(state.goals.items())},
            "forgotten": sorted(record.forgotten),
            "term": record.term.to_json(),
        }
        write_atomically(self.cluster_path, json.dumps(document, indent=2) + "\n")
        return Kept()

    def _load_plan(self) -> Plan | None:
        try:
            text = self.plan_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return Plan.from_json(text)
        except PlacementError as exc:
            raise CorruptDataError(f"{self.plan_path}: the kept plan is damaged "
                                   f"({exc.message}); remove it to drop the plan") from exc

    def _load_cluster(self) -> tuple[list[SiteAddress], dict[str, tuple[str, ...]],
                                     frozenset[str], ControllerTerm]:
        try:
            document: Any = json.loads(self.cluster_path.read_bytes())
        except FileNotFoundError:
            return [], {}, frozenset(), NO_TERM
        except ValueError as exc:
            raise CorruptDataError(f"{self.cluster_path}: not JSON: {exc}") from exc
        try:
            if not isinstance(document, dict) or document.get("format") != FORMAT:
                raise PlacementError(f"expected an object of format {FORMAT}")
            sites = [SiteAddress(id=check_site_id(entry["id"]), admin_url=str(entry["admin_url"]),
                               peer=None if entry.get("peer") is None else str(entry["peer"]))
                     for entry in document["sites"]]
            goals = {check_database(database): tuple(check_site_id(site) for site in goal)
                     for database, goal in document["goals"].items()}
            forgotten = frozenset(check_site_id(site) for site in document["forgotten"])
            term = parse_term(document["term"])
        except (PlacementError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptDataError(f"{self.cluster_path}: damaged ({exc})") from exc
        return sites, goals, forgotten, term
