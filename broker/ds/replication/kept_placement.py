"""What the controller pushed, as a site keeps it: the placement
(`PlacementStore`), the highest controller term seen (`TermStore`), the peers'
peer-port addresses and the sites forgotten for good; the controller's pushes and
claims that change them. Kept on disk, so that a restarted site takes its roles
again before the controller speaks."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

from ...errors import CorruptDataError, PlacementError, StalePlacementError
from ...files import write_atomically
from .placement import Placement, check_site_id
from .store import PlacementStore
from .term import ControllerTerm, TermStore, parse_term

log = logging.getLogger(__name__)


PEERS_FILE = "peers.json"
FORGOTTEN_FILE = "forgotten.json"
REPLICATION_DIR = "replication"

T = TypeVar("T")

def parse_peers(value: object) -> dict[str, str]:
    """The `peers` of a placement push: site id -> host:port of its peer port."""
    if not isinstance(value, dict):
        raise PlacementError(f"peers: expected an object of site id -> host:port, got "
                             f"{type(value).__name__}")
    peers: dict[str, str] = {}
    for site, address in value.items():
        check_site_id(site, "peers")
        if not isinstance(address, str) or not address.rpartition(":")[2].isdigit():
            raise PlacementError(f"peers.{site}: {address!r} is not host:port")
        peers[site] = address
    return peers


def parse_forgotten(value: object) -> frozenset[str]:
    """The `forgotten` of a placement push: the ids of the sites gone for good."""
    if not isinstance(value, list):
        raise PlacementError(f"forgotten: expected a list of site ids, got "
                             f"{type(value).__name__}")
    return frozenset(check_site_id(site, "forgotten") for site in value)


class KeptPlacement:
    """The controller's last word as this site keeps it, and the pushes and claims
    that change it; each placement taken is handed to `take` (under the same lock as
    the push, so that placements are taken in the order kept)."""

    def __init__(self, site: str, data_dir: Path, executor: Executor,
                 store: PlacementStore, terms: TermStore, peers: dict[str, str],
                 forgotten: frozenset[str],
                 take: Callable[[Placement], Awaitable[None]]) -> None:
        self.site = site
        self._data_dir = data_dir
        self.executor = executor
        self.store = store
        # the highest controller term seen: pushes of lower terms are refused
        self.terms = terms
        self.peers = peers
        # sites the controller forgot for good: this site may adopt their sessions
        self.forgotten = forgotten
        self._take = take
        self._take_lock = asyncio.Lock()


    def held(self) -> dict[str, Any]:
        """The placement this site keeps (None before the first push), with the peers'
        addresses and the sites forgotten as last pushed: what a controller whose own
        copy is older than the sites' adopts (`decisions.adopt`)."""
        current = self.store.current
        return {"placement": None if current is None else json.loads(current.to_json()),
                "peers": dict(self.peers), "forgotten": sorted(self.forgotten),
                "term": self.terms.current.to_json()}

    async def claim(self, term_value: object) -> tuple[bool, ControllerTerm]:
        """A controller's claim of its term before it decides anything: (admitted, the
        term this site holds now). Admitted: not below the term kept (`term.admits`),
        and kept from now on when higher. PlacementError when it does not parse."""
        term = parse_term(term_value)
        async with self._take_lock:
            admitted = await self._admit(term)
        return admitted, self.terms.current

    async def _admit(self, term: ControllerTerm) -> bool:
        kept = self.terms.current
        admitted = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.terms.offer, term)
        if not admitted:
            log.info("controller term %s refused: this site holds term %s (a newer "
                     "controller)", term, kept)
        return admitted

    async def offer(self, document: object, peers_value: object,
                    forgotten_value: object = None, term_value: object = None
                    ) -> tuple[bool, int, ControllerTerm]:
        """A placement pushed by the controller: (accepted, the version kept, the
        controller term held), where accepted means this site now keeps that very
        document (also when it already did); False: the push is of a controller term
        below the one held (a fenced controller: nothing changes), or the site keeps
        another placement, newer or different under the same version, and the
        controller must adopt it rather than believe its own. A higher term is kept
        even when its placement is refused. PlacementError when it does not parse.
        `forgotten_value`: the sites forgotten for good (None: not told, as in a
        placement pushed by hand: the sites kept as forgotten stay so); `term_value`:
        the pushing controller's term (None: term 0, a placement pushed by hand where
        no controller runs; refused once a controller has taken a term)."""
        placement = Placement.from_dict(document)
        peers = parse_peers(peers_value)
        forgotten = None if forgotten_value is None else parse_forgotten(forgotten_value)
        term = parse_term(term_value)
        loop = asyncio.get_running_loop()
        async with self._take_lock:
            if not await self._admit(term):
                kept = self.store.current
                return (False, placement.version if kept is None else kept.version,
                        self.terms.current)
            if forgotten is not None and forgotten != self.forgotten:
                await loop.run_in_executor(self.executor, _store_kept, self._data_dir,
                                           FORGOTTEN_FILE, sorted(forgotten))
                self.forgotten = forgotten
            try:
                accepted = await loop.run_in_executor(self.executor, self.store.offer,
                                                      placement)
            except StalePlacementError as exc:
                log.info("placement version %d not taken: %s", placement.version, exc.message)
                accepted = False
            kept = self.store.current
            if accepted or (kept == placement and peers != self.peers):
                if peers != self.peers:
                    self.peers = peers
                    await loop.run_in_executor(self.executor, _store_kept,
                                               self._data_dir, PEERS_FILE, peers)
                assert kept is not None
                await self._take(kept)
        return (kept == placement, kept.version if kept is not None else placement.version,
                self.terms.current)


def load_kept(data_dir: Path, name: str, parse: Callable[[object], T], absent: T) -> T:
    """What the controller's last push said (the peers' addresses, the forgotten
    sites), as this site kept it."""
    path = data_dir / REPLICATION_DIR / name
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        return absent
    except (ValueError, PlacementError) as exc:
        raise CorruptDataError(f"{path}: does not parse ({exc}); remove the file to "
                               f"wait for the controller's next push") from exc


def _store_kept(data_dir: Path, name: str, value: object) -> None:
    folder = data_dir / REPLICATION_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / name, json.dumps(value, sort_keys=True, indent=1))
