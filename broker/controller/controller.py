"""The controller process (`stratamq cluster controller`): it owns the placement of
every shard (docs/replication.md, "The controller").

Every heartbeat interval it asks each site's `GET /api/v1/ds/replication` (the
heartbeat probe), hands what it learned to `decisions.decide` (first placement,
failover, the next step of a pending plan), keeps the result in its data folder
(`state.StateFiles`, locked by `state.FolderLock`), and pushes the placement with
`PUT /api/v1/ds/placement` to every site whenever it changes and to any site that
reports an older version. It calls the sites through `site_client.py` with the
bearer token of the cluster, and serves the cluster API of the admin CLI (`stratamq
ctl ds ...`, `api.py`) with the same token; what that API changes it applies here.

A controller is never ahead of the sites by construction, but it can be behind
(restored from an older copy of its folder): when a site reports a newer placement
version or refuses a push (`accepted: false`), the controller fetches what the sites
keep (`GET /api/v1/ds/placement`) and adopts the newest (`decisions.adopt`) before it
decides anything, so that it fails over from the placement the sites actually hold.

Two controllers on different folders are told apart by the controller term
(`broker/ds/replication/term.py`, `terms.py`): once a majority of the sites answered,
a starting controller takes a term above every term they report, claims it at the
sites (`PUT /api/v1/ds/controller-term`) and decides nothing until a majority holds
it, then adopts the newest placement those sites keep (`decisions.adopt`: what an
older controller pushed before they took the new term); it stamps every push with
its term (`term_holder.py`). A site refuses a lower term; a controller that
learns of a higher one (a site reports it or refuses with it) steps aside for good:
it logs an error once, says `fenced` on `/healthz` (503) and in
`stratamq_cluster_controller_fenced`, and decides and pushes nothing more.

All decisions and state changes happen on the event loop, one at a time under a
lock; files are written in an executor.

Shared with the operator (`operator/controller.py`): the decisions (`decisions.py`),
the term rule (`terms.py`), the push's rules (`pushes.py`), the probes of every site
at once with a deadline (`probing.py`) and the port the state is kept through
(`store.py`). The round that strings them together is each one's own: one skeleton
for both would change what either does, for these reasons.
- This round runs on the event loop and lets go of its lock before it pushes, so the
  API's changes (`change`, `forget`) come in between; the operator's round is
  blocking, in Kopf's timer thread, and holds its lock to the end of its pushes.
- Between taking its term and deciding, this one claims the term at the sites and
  waits for a majority to hold it (I/O inside the term step); the operator takes
  its term from its first reports and claims nothing (`TermRule`).
- This one keeps its state up to three times a round, each before the step that
  stands on it: the sites found, also while it does not hold its term; the term
  taken, before any site is asked to hold it (a restart then takes a higher one
  even when the sites that hold it do not answer); what it adopted (with the sites
  forgotten since), before it decides from it; what it decided, before it pushes.
  One keep at the end of the round would lose the first two to a crash, and the
  third to a round that fails after adopting. The operator keeps once, on condition
  (`KeptState`), and a refused keep drops its round; the files never refuse.
- The operator has steps of its own between adopting and deciding (sites whose pods
  are gone forgotten, the goal following spec.sites), says failovers as Events
  between keeping and pushing, pushes one site after another (a missed push sends
  the peers to every site again) and follows the ReplicaTransitions after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from ..ds.replication import Placement
from ..http.guard import GuardedListener
from ..net.address import listening, source_address, split_bind
from . import decisions
from .api import ControllerAPI
from .decisions import ClusterState, Settings
from .metrics import Snapshot
from .probing import probe_concurrently
from .pushes import Fenced, peers_of, push_answer, push_body, push_targets
from .site_client import SiteClient
from .sites import Refused, Report, SiteState
from .state import FolderLock, FolderRecord, SiteAddress, StateFiles
from .term_holder import TermHolder
from .terms import TermKeeper, TermRule

log = logging.getLogger(__name__)

# Every call to a site ends by the client's timeout, max(heartbeat, 0.5 s); a round
# waits for its probes that and this grace at most (`probing.py`): the timeout, not
# the deadline, ends a hung site's probe (which then says once that it does not
# answer), and the deadline bounds the round should the timeout fail to.
PROBE_GRACE = 1.0

@dataclass(frozen=True)
class ControllerConfig:
    data_dir: Path
    bind: str
    site_urls: tuple[str, ...]
    token: str
    settings: Settings


class Controller:
    """The process: its heartbeat rounds, the controller term, its pushes and the
    changes its API asks for share the state and one lock; what it decides is
    `decisions.py`, when it holds its term `terms.py` (`TermRule.MAJORITY_CLAIM`, at
    the sites through `term_holder.py`), whom it pushes what and what the answers mean
    `pushes.py`, how it calls the sites `site_client.py` (all at once: `probing.py`),
    where it keeps its state `state.py`, what it serves `api.py` (with `views.py` and
    `metrics.py`), what it parses `sites.py`."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.settings = config.settings
        self._folder_lock = FolderLock(config.data_dir)
        self.files = StateFiles(config.data_dir)
        kept = self.files.load()
        self.state = kept.state
        # the term taken (None until a majority of the sites answered), whether a
        # majority of the sites holds it (nothing is decided before), and the newer
        # term that fenced this controller (for good); this process's own id is the
        # tie-break of its term: a copy of the folder started beside this one is
        # another controller
        self.term_keeper = TermKeeper(TermRule.MAJORITY_CLAIM, secrets.token_hex(8),
                                      kept.term)
        self._adopt_now = False  # fetch and adopt what the sites keep this round
        self.started = time.monotonic()
        # Sites known from disk get the grace of one that answered just now.
        self.sites: dict[str, SiteState] = {
            site.id: SiteState(id=site.id, admin_url=site.admin_url, last_seen=self.started,
                               peer=site.peer) for site in kept.sites}
        self.urls: list[str] = sorted({*(url.rstrip("/") for url in config.site_urls),
                                       *(site.admin_url for site in kept.sites)})
        # sites forgotten for good: their reports are ignored, and the sites are told
        # (with every push) so that they collect the sessions those sites owned
        self.forgotten: set[str] = set(kept.forgotten)
        self._lock = asyncio.Lock()
        self._loop_task: asyncio.Task[None] | None = None
        self._last_notes: tuple[str, ...] = ()
        self.leader_changes = 0
        # times this controller took the sites' placement for its own
        self.adoptions = 0
        # sites that refused the last push (they keep another placement): the next
        # round adopts what the sites keep
        self._refused: set[str] = set()
        # requests to sites start from the controller's own address (when it binds one)
        self._timeout = max(self.settings.heartbeat_interval, 0.5)
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout),
            connector=aiohttp.TCPConnector(local_addr=source_address(config.bind)))
        self._site_client = SiteClient(self._http, config.token)
        self.term_holder = TermHolder(self.term_keeper, self._site_client)
        self._api = ControllerAPI(self, config.token)
        self._listener: GuardedListener | None = None
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        listener = self._api.listener()
        host, port = split_bind(self.config.bind)
        try:
            with listening("--bind", self.config.bind):
                await listener.start(host, port)
        except BaseException:
            await self._http.close()
            raise
        self._listener = listener
        self.port = listener.port
        log.info("controller API on http://%s:%d; sites %s; placement version %d%s", host,
                 self.port, ", ".join(self.urls) or "none", self.state.placement.version,
                 "" if self.state.plan is None else ", resuming a plan")
        self._loop_task = asyncio.create_task(self._run(), name="controller-rounds")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self._listener is not None:
            await self._listener.stop()
            self._listener = None
        await self._http.close()
        self._folder_lock.release()

    async def _run(self) -> None:
        interval = self.settings.heartbeat_interval
        while True:
            began = time.monotonic()
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:
                # One bad round (a file that cannot be written) must not end the
                # controller; the next round tries again.
                log.exception("controller round failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    # -- one round ------------------------------------------------------------------------

    async def round(self) -> None:
        """Probe every site, decide, keep, push."""
        urls = list(self.urls)
        reports: list[Report | Refused | None] = await probe_concurrently(
            urls, self._site_client.probe, self._timeout + PROBE_GRACE)
        now = time.monotonic()
        async with self._lock:
            sites_changed = self._take_reports(urls, reports, now)
            answered = {report.site for report in reports
                        if isinstance(report, Report) and report.site in self.sites}
            if not await self._hold_term(answered):
                if sites_changed:
                    await self._save(self.state)
                return
            if self._refused or self._adopt_now or decisions.behind(self.state, self.sites):
                await self._adopt_held()
            before = self.state
            decision = decisions.decide(self.state, self.sites, now, self.started,
                                        self.settings)
            if decision.notes != self._last_notes:
                for note in decision.notes:
                    log.info("%s", note)
                self._last_notes = decision.notes
            if decision.state != before or sites_changed:
                await self._save(decision.state)
            self.state = decision.state
        changed = self.state.placement != before.placement
        if changed:
            self.leader_changes += decisions.leader_changes(before.placement, self.state.placement)
        await self._push(self.state.placement, everyone=changed)

    def _take_reports(self, urls: list[str], reports: list[Report | Refused | None],
                      now: float) -> bool:
        """Record the answers; True when a site is new or moved (to keep on disk)."""
        changed = False
        for url, report in zip(urls, reports, strict=True):
            if isinstance(report, Refused):
                for site in list(self.sites.values()):
                    if site.admin_url == url:
                        self.sites[site.id] = replace(site, refused=True)
                continue
            if report is None or report.site in self.forgotten:
                continue
            known = self.sites.get(report.site)
            if known is None or known.admin_url != url or known.peer != report.peer:
                changed = True
                if known is None:
                    log.info("site %s found at %s (peer %s)", report.site, url, report.peer)
            if known is None or known.admin_url != url:
                known = SiteState(id=report.site, admin_url=url, last_seen=now)
            self.sites[report.site] = known.seen(report, now)
        return changed

    # -- the controller term ----------------------------------------------------------

    async def _hold_term(self, answered: set[str]) -> bool:
        """Whether this controller may decide and push this round (`TermHolder.hold`)."""
        step = await self.term_holder.hold(
            {site: self.sites[site].term for site in answered}, self.sites,
            self.state.placement, len(self.urls), lambda: self._save(self.state))
        if step.held_now:
            # what the previous controller pushed before these sites took this term,
            # even under a version this controller has too, is the starting point
            self._adopt_now = True
        return step.goes_on

    async def _adopt_held(self) -> None:
        """Fetch the placement every site that answered keeps and adopt the newest
        when it is not this controller's (`decisions.adopt`); kept on disk at once."""
        self._refused.clear()
        self._adopt_now = False
        answered = [site for site in self.sites.values()
                    if site.answered and site.placement_version is not None]
        fetched = await asyncio.gather(*(self._site_client.fetch_held(site) for site in answered))
        held = {site.id: found[0] for site, found in zip(answered, fetched, strict=True)
                if found is not None}
        forgotten = set().union(*(found[1] for found in fetched if found is not None))
        adoption = decisions.adopt(self.state, held)
        for note in adoption.notes:
            log.warning("%s", note)
        if adoption.state == self.state:
            return
        # sites forgotten after this controller's copy was made stay forgotten
        for site_id in sorted(forgotten - self.forgotten):
            gone = self.sites.pop(site_id, None)
            if gone is not None:
                self.urls = [url for url in self.urls if url != gone.admin_url]
            self.forgotten.add(site_id)
        await self._save(adoption.state)
        self.state = adoption.state
        self.adoptions += 1

    async def _save(self, state: ClusterState) -> None:
        """Keep `state` with the sites, the forgotten and the term as they are now
        (`StateFiles` never refuses: this controller holds the folder's lock)."""
        known = tuple(SiteAddress(id=site.id, admin_url=site.admin_url, peer=site.peer)
                      for site in self.sites.values())
        record = FolderRecord(state, known, frozenset(self.forgotten),
                              self.term_keeper.last_term)
        await asyncio.get_running_loop().run_in_executor(None, self.files.keep, record)

    async def _push(self, placement: Placement, everyone: bool) -> None:
        """Send `placement` to every site (`everyone`) or to those reporting an older
        version; a site that misses it reports the old version and gets it next round."""
        if placement.version == 0 or not self.term_keeper.in_charge:
            return
        own = self.term_keeper.term
        assert own is not None
        targets = push_targets(self.sites.values(), placement.version, everyone)
        if not targets:
            return
        body = push_body(placement, peers_of(self.sites.values()), self.forgotten, own)
        await asyncio.gather(*(self._push_to(site, body, placement.version)
                               for site in targets))

    async def _push_to(self, site: SiteState, body: Mapping[str, Any], version: int) -> None:
        own = self.term_keeper.term
        assert own is not None
        answer = push_answer(await self._site_client.push(site, body, version), own)
        if isinstance(answer, Fenced):
            self.term_holder.fence(answer.term)
        elif answer is not None:
            # it keeps a newer placement, or another under this version: this
            # controller's is stale; the next round adopts the sites'
            log.warning("%s", answer.note(site.id, version))
            self._refused.add(site.id)

    # -- what the API (`api.py`) asks ---------------------------------------------------

    def snapshot(self) -> Snapshot:
        keeper = self.term_keeper
        return Snapshot(self.state, dict(self.sites), self.leader_changes, self.adoptions,
                        0 if keeper.term is None else keeper.term.number,
                        keeper.fenced_by is not None)

    def add_site(self, url: str) -> None:
        """Probe the site at `url` from now on."""
        if url not in self.urls:
            self.urls.append(url)
            log.info("site at %s added: probed from now on", url)

    async def change(self, database: str,
                     change: Callable[[ClusterState, float], ClusterState]) -> None:
        """Apply an operator request: a new plan (or a refusal that changes nothing),
        kept on disk before it is answered; the rounds carry it out."""
        self.term_holder.check()
        async with self._lock:
            state = change(self.state, time.monotonic())
            if state != self.state:
                await self._save(state)
                self.state = state
                steps = [] if state.plan is None else state.plan.describe()
                log.info("%s: new goal %s; plan: %s", database,
                         ", ".join(decisions.goal_of(state, database)),
                         "; ".join(steps) or "nothing to do")

    async def forget(self, site: str) -> None:
        """Forget `site` for good; the sites are told at once (they adopt its sessions)."""
        self.term_holder.check()
        async with self._lock:
            state = decisions.forget(self.state, site, self.sites, time.monotonic(),
                                           self.settings)
            gone = self.sites.pop(site)
            self.forgotten.add(site)
            self.urls = [url for url in self.urls if url != gone.admin_url]
            await self._save(state)
            self.state = state
            await self._push(state.placement, everyone=True)  # the sites adopt its sessions
        log.info("site %s (%s) forgotten", site, gone.admin_url)


async def run_controller(config: ControllerConfig) -> None:
    controller = Controller(config)
    await controller.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("controller stopping")
    await controller.stop()
    log.info("controller stopped")
