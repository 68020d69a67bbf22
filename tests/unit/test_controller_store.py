"""The state port of both controllers (`broker/controller/store.py`): the local
controller's files (`StateFiles`) keep any record and give it back, its pending plan
resumed; the operator's record goes into status.controller and comes back whole, and
a record already kept is not written again. The operator's store against a real API
server, refusals included: tests/kube/test_operator_fence.py."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from stratamq.broker.controller.decisions import ClusterState, resumed_catch_ups
from stratamq.broker.controller.state import FolderRecord, SiteAddress, StateFiles
from stratamq.broker.controller.store import Kept
from stratamq.broker.ds.replication import Placement, PlannedSite, plan
from stratamq.broker.ds.replication.term import NO_TERM, ControllerTerm
from stratamq.operator.kept_state import KeptState, StatusRecord, kept_document, record_of
from stratamq.operator.resources import Owner
from tests.support.state_store import check_keeps_and_loads

SITES = ["A", "B", "C", "D", "E"]
site_ids = st.lists(st.sampled_from(SITES), unique=True)


@st.composite
def states(draw: st.DrawFn, version: int) -> ClusterState:
    """No placement (`version` 0), or one of `version` on 3 sites, with or without a
    plan to others (a restart waits on the replica that joined last: the catch-up is
    what a load resumes)."""
    if version == 0:
        return ClusterState()
    on = draw(st.lists(st.sampled_from(SITES), min_size=3, max_size=3, unique=True))
    placement = replace(plan([PlannedSite(site) for site in on], ["messages"], 2, 3,
                             Placement.empty()).start, version=version)
    goal = draw(st.lists(st.sampled_from(SITES), min_size=3, max_size=4, unique=True))
    if not draw(st.booleans()) or set(goal) == set(on):
        return ClusterState(placement=placement, goals={"messages": tuple(sorted(on))})
    leaving = [PlannedSite(site, draining=True) for site in on if site not in goal]
    moving = plan([*(PlannedSite(site) for site in goal), *leaving], ["messages"], 2, 3, placement)
    return ClusterState(placement=placement, plan=moving,
                        goals={"messages": tuple(sorted(goal))},
                        catch_ups=resumed_catch_ups(moving, placement))


terms = st.one_of(st.just(NO_TERM), st.builds(ControllerTerm, st.integers(1, 10),
                                              st.sampled_from(["c0", "c1"])))


@st.composite
def folder_records(draw: st.DrawFn) -> list[FolderRecord]:
    """Records as one controller keeps them: its placement never goes back (the files
    refuse an older version: `PlacementStore`)."""
    first, count = draw(st.integers(0, 1)), draw(st.integers(1, 3))
    records = []
    for version in range(first, first + count):
        known = tuple(SiteAddress(site, f"http://{site.lower()}:8080",
                                draw(st.sampled_from([None, f"{site.lower()}:18084"])))
                      for site in sorted(draw(site_ids)))
        records.append(FolderRecord(draw(states(version)), known,
                                    frozenset(draw(site_ids)), draw(terms)))
    return records


@st.composite
def status_records(draw: st.DrawFn) -> StatusRecord:
    known = sorted(draw(site_ids))
    return StatusRecord(
        draw(states(draw(st.integers(0, 3)))),
        {site: draw(st.sampled_from([None, f"10.0.0.{n}:18084"]))
         for n, site in enumerate(known)},
        {site: f"mq-{n}" for n, site in enumerate(known) if draw(st.booleans())},
        frozenset(draw(site_ids)), draw(terms))


@settings(max_examples=25, deadline=None)
@given(folder_records())
def test_the_files_keep_every_record_and_give_the_last_back(
        records: list[FolderRecord]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        check_keeps_and_loads(lambda: StateFiles(Path(folder)), records)


@settings(max_examples=50, deadline=None)
@given(status_records())
def test_status_controller_gives_the_record_back_whole(record: StatusRecord) -> None:
    assert record_of(kept_document(record)) == record


@given(status_records())
def test_a_record_kept_already_is_not_written_again(record: StatusRecord) -> None:
    # No API server here: a write would fail.
    store = KeptState(Owner(name="mq", namespace="brokers", uid="u-1"), kept_document(record))
    assert store.load() == record
    assert store.keep(record) == Kept()
