"""The sites' admin API as the controller (`controller.py`) calls it, with the bearer
token of the cluster (docs/peer-protocol.md): the heartbeat probe, the placement a
site keeps, the claim of the controller term and the push of a placement. It says
once, not every round, that a site does not answer or keeps a placement it cannot
read; what an answer means for the term and the placement is the controller's."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..ds.replication import Placement
from ..ds.replication.term import ControllerTerm
from .sites import (
    PLACEMENT_PATH,
    REFUSAL_RECHECK,
    REFUSED,
    REPLICATION_PATH,
    TERM_PATH,
    BadReportError,
    Refused,
    Report,
    SiteState,
    parse_held,
    parse_report,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TermAnswer:
    """A site's answer to a claim of the controller term: the term it holds, as it
    sent it (None when the answer named none), and whether it took the claimed one."""

    term: object
    accepted: bool


class SiteClient:
    """Calls the sites over `http` (owned by the caller, which closes it)."""

    def __init__(self, http: aiohttp.ClientSession, token: str) -> None:
        self._http = http
        self._headers = {"Authorization": f"Bearer {token}"}
        self._unreachable: dict[str, str] = {}
        self._unreadable: set[str] = set()  # sites whose kept placement could not be read

    async def probe(self, url: str) -> Report | Refused | None:
        """The heartbeat report of the site at `url`; REFUSED when nothing listens
        there (twice, `REFUSAL_RECHECK` apart); None when it does not answer as it
        should."""
        for attempt in range(2):
            try:
                return await self._probe(url)
            except aiohttp.ClientConnectorError as exc:
                if not isinstance(exc.os_error, ConnectionRefusedError):
                    self._no_answer(url, exc)
                    return None
                if attempt == 0:
                    await asyncio.sleep(REFUSAL_RECHECK)
                    continue
                self._no_answer(url, exc)
            except (aiohttp.ClientError, OSError, ValueError, BadReportError) as exc:
                self._no_answer(url, exc)
                return None
        return REFUSED

    async def _probe(self, url: str) -> Report:
        async with self._http.get(url + REPLICATION_PATH, headers=self._headers) as answer:
            if answer.status != 200:
                raise BadReportError(f"HTTP {answer.status}: {await answer.text()}")
            report = parse_report(await answer.json())
        if self._unreachable.pop(url, None) is not None:
            log.info("site at %s answers", url)
        return report

    def _no_answer(self, url: str, exc: Exception) -> None:
        """Said once, not every round, until it answers again."""
        problem = str(exc) or type(exc).__name__
        if self._unreachable.get(url) is None:
            log.warning("site at %s does not answer: %s", url, problem)
        self._unreachable[url] = problem

    async def fetch_held(self, site: SiteState) -> tuple[Placement, frozenset[str]] | None:
        """The placement `site` keeps and the sites it was told are forgotten; None
        when it keeps none or does not answer as it should."""
        try:
            async with self._http.get(site.admin_url + PLACEMENT_PATH,
                                      headers=self._headers) as answer:
                if answer.status != 200:
                    raise BadReportError(f"HTTP {answer.status}: {await answer.text()}")
                document = await answer.json()
            found = parse_held(document)
        except (aiohttp.ClientError, OSError, ValueError, BadReportError) as exc:
            if site.id not in self._unreadable:  # once, not every round
                log.warning("cannot read the placement site %s keeps: %s", site.id,
                            str(exc) or type(exc).__name__)
            self._unreadable.add(site.id)
            return None
        self._unreadable.discard(site.id)
        return found

    async def claim(self, site: SiteState, term: ControllerTerm) -> TermAnswer | None:
        """Claim `term` at `site`: what it answered, None when it did not answer 200."""
        try:
            async with self._http.put(site.admin_url + TERM_PATH,
                                      json={"term": term.to_json()},
                                      headers=self._headers) as answer:
                if answer.status != 200:
                    return None
                found = await answer.json()
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("claim of controller term %s at %s failed: %s", term, site.id, exc)
            return None
        if not isinstance(found, dict):
            return TermAnswer(term=None, accepted=False)
        return TermAnswer(term=found.get("term"), accepted=found.get("accepted") is True)

    async def push(self, site: SiteState, body: Mapping[str, Any],
                   version: int) -> Mapping[str, Any] | None:
        """Push placement `version` (`body`) to `site`: its answer when it refused it
        (`accepted: false`, with the term or the version it keeps), else None."""
        try:
            async with self._http.put(site.admin_url + PLACEMENT_PATH, json=body,
                                      headers=self._headers) as answer:
                found = await answer.json() if answer.status == 200 else None
                if answer.status == 503:  # starting or stopping: the next round retries
                    log.debug("site %s not ready for placement version %d", site.id, version)
                elif found is None:
                    log.warning("site %s refused placement version %d: HTTP %d %s", site.id,
                                version, answer.status, await answer.text())
                elif found.get("accepted") is False:
                    return dict(found)
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("push of placement version %d to %s failed: %s", version, site.id, exc)
        return None


def site_url(address: str) -> str:
    """`host:port` or a URL -> the base URL of a site's admin API."""
    if "://" not in address:
        address = "http://" + address
    parsed = urllib.parse.urlsplit(address)
    if not parsed.hostname or parsed.port is None:
        raise ValueError(f"{address!r} is not host:port or http://host:port")
    return address.rstrip("/")
