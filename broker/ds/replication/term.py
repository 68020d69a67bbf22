"""The controller term: a fencing token that lets the sites themselves refuse a second
or a stale controller (docs/replication.md, "The controller").

A term is a pair (number, controller id), ordered as a pair. A controller takes a
term when it starts, above every term the sites it reaches report, stamps every
placement it pushes with it, and claims it at the sites before it decides anything.
A site keeps the highest term it has seen (`TermStore`, durably, next to the
placement) and refuses a push or a claim of a lower one, answering with the term it
holds; a controller that learns of a higher term steps aside for good. The id breaks
the tie between two controllers started at once that both took number N + 1: every
site ends up holding the pair with the higher id, so exactly one of them goes on,
and neither takes another term (no bump loop). A site no controller has reached
holds term 0, `NO_TERM`, below every term taken; so is a placement pushed without a
term (by hand, where no controller runs: refused once a controller took one).

`TermStore` is blocking file I/O on a small file; async callers run it in an
executor.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ...errors import CorruptDataError, PlacementError
from ...files import write_atomically
from .placement import check_site_id

log = logging.getLogger(__name__)

TERM_FILE = "controller_term.json"
FORMAT = 1


@dataclass(frozen=True, order=True)
class ControllerTerm:
    """A controller term: `number`, then the `controller` id that took it (the
    tie-break). Term 0 has no controller."""

    number: int
    controller: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.number, bool) or not isinstance(self.number, int) \
                or self.number < 0:
            raise PlacementError(f"term: {self.number!r} is not a whole number >= 0")
        if self.number == 0:
            if self.controller:
                raise PlacementError("term: term 0 names no controller")
        else:
            check_site_id(self.controller, "term: controller")

    def to_json(self) -> list[int | str]:
        return [self.number, self.controller]

    def __str__(self) -> str:
        return f"{self.number}/{self.controller}" if self.number else "0"


NO_TERM = ControllerTerm(0)


def parse_term(value: object, where: str = "term") -> ControllerTerm:
    """`[number, "controller id"]`; None (no term: a placement pushed by hand, or an
    operator that has taken none yet) is term 0. Anything else is a `PlacementError`
    naming `where`."""
    if value is None:
        return NO_TERM
    if not isinstance(value, list) or len(value) != 2:
        raise PlacementError(f"{where}: {value!r} is not [number, \"controller id\"]")
    number, controller = value
    try:
        return ControllerTerm(number, controller)
    except PlacementError as exc:
        raise PlacementError(f"{where}: {exc.message}") from exc


def next_term(own: ControllerTerm, reported: Iterable[ControllerTerm],
              controller: str) -> ControllerTerm:
    """The term a starting controller takes: a number above its own last one and
    above every term the sites report, with its own id."""
    return ControllerTerm(max([own.number, *(term.number for term in reported)]) + 1,
                          controller)


def admits(kept: ControllerTerm, offered: ControllerTerm) -> bool:
    """A site's rule: a push or claim of `offered` may go on when it is not below the
    term the site keeps (equal: the controller that holds it; higher: a newer
    controller, which the site keeps from then on)."""
    return offered >= kept


class TermStore:
    """The highest controller term a site has seen, in `<data_dir>/controller_term.json`
    (written atomically; a damaged file stops the site with a `CorruptDataError`,
    never silently replaced: the site would forget which controllers it fenced)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / TERM_FILE
        self._lock = threading.Lock()
        self._current = self._load()

    @property
    def current(self) -> ControllerTerm:
        return self._current

    def offer(self, term: ControllerTerm) -> bool:
        """True when `term` may act here (`admits`), kept from now on when it is
        higher; False, changing nothing, when it is below the term kept."""
        with self._lock:
            kept = self._current
            if not admits(kept, term):
                return False
            if term != kept:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    write_atomically(self.path, json.dumps(
                        {"format": FORMAT, "term": term.to_json()}) + "\n")
                except OSError as exc:
                    raise PlacementError(f"{self.path}: cannot store controller term "
                                         f"{term}: {exc}") from exc
                self._current = term
                log.info("controller term %s kept (was %s)", term, kept)
            return True

    def _load(self) -> ControllerTerm:
        if self.path.parent.is_dir():  # a crash before the rename leaves its temp file
            for leftover in self.path.parent.glob(f".{TERM_FILE}.*.tmp"):
                leftover.unlink(missing_ok=True)
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return NO_TERM
        except OSError as exc:
            raise CorruptDataError(f"{self.path}: cannot read the controller term: "
                                   f"{exc}") from exc
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or document.get("format") != FORMAT:
                raise PlacementError(f"expected an object of format {FORMAT}")
            return parse_term(document.get("term"))
        except (ValueError, UnicodeDecodeError, PlacementError) as exc:
            raise CorruptDataError(
                f"{self.path}: the stored controller term is damaged ({exc}). Restore the "
                f"file, or write the highest term any site holds into it") from exc
