"""The sites' admin API, as the operator calls it (blocking; called from Kopf's
thread pool): which site a pod's broker is (for the status), and what the replication
controller (controller.py) asks and tells every round: each site's report with its
checkpoint bootstraps, the placement it keeps, the placement pushed."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stratamq.broker.controller.probing import probe_in_threads
from stratamq.broker.controller.sites import (
    PLACEMENT_PATH,
    REFUSAL_RECHECK,
    REFUSED,
    REPLICATION_PATH,
    BadReportError,
    Refused,
    Report,
    parse_held,
    parse_report,
)
from stratamq.broker.ds.replication import Placement, ShardId

log = logging.getLogger(__name__)

# A site answers from memory; a slow answer means a stuck site, which must not hold
# up the status of the others for long.
TIMEOUT_SECONDS = 5.0
# The controller's heartbeat probe and push wait less: a round must not outlast them.
PROBE_TIMEOUT = 2.0
# Sites probed at once by one storage's round (see probe_all).
MAX_PARALLEL_PROBES = 32


class SiteUnreachableError(Exception):
    """The pod's admin API did not answer with its site."""


def site_id(url: str, token: str) -> str:
    """The id of the site whose admin API is at `url` (`GET /api/v1/ds/sites`: a site
    lists itself)."""
    request = urllib.request.Request(f"{url}/api/v1/ds/sites",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            body = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise SiteUnreachableError(f"{url}: {error}") from error
    try:
        found: str = body["data"][0]["site"]
    except (KeyError, IndexError, TypeError) as error:
        raise SiteUnreachableError(f"{url}: unexpected answer {body!r}") from error
    return found


def site_ids(urls: Sequence[str], token: str, deadline: float = TIMEOUT_SECONDS
             ) -> list[str | SiteUnreachableError]:
    """`site_id` of every site at once, in threads, as the rounds probe them: a status
    refresh waits for the slowest at most `deadline` seconds, not for the sum of every
    hung site's timeout. Each answer is the id, or why there is none."""
    def asked(url: str) -> str | SiteUnreachableError:
        try:
            return site_id(url, token)
        except SiteUnreachableError as error:
            return error

    return [SiteUnreachableError(f"{url}: no answer within {deadline:.0f} s")
            if answer is None else answer
            for url, answer in zip(urls, probe_in_threads(urls, asked, deadline,
                                                          MAX_PARALLEL_PROBES), strict=True)]


def _call(method: str, url: str, token: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT) as response:
        return json.load(response)


@dataclass(frozen=True)
class Bootstraps:
    """What a site says of its checkpoint bootstraps, per shard: the shards it is
    bootstrapping now, and how many checkpoints it installed per shard since it
    started (a bootstrap done between two rounds shows only there)."""

    running: frozenset[ShardId] = frozenset()
    installed: Mapping[ShardId, int] = field(default_factory=dict)


def bootstraps_of(document: Mapping[str, Any]) -> Bootstraps:
    """From a checked report (`parse_report` accepted it): the bootstrap fields of its
    shards (`state`, `bootstraps`; a site that has none says nothing)."""
    running, installed = set(), {}
    for entry in document.get("shards") or []:
        shard_id = (str(entry["db"]), int(entry["shard"]))
        if entry.get("state") == "bootstrapping":
            running.add(shard_id)
        count = entry.get("bootstraps")
        if isinstance(count, int) and not isinstance(count, bool):
            installed[shard_id] = count
    return Bootstraps(frozenset(running), installed)


def probe(url: str, token: str) -> tuple[Report, Bootstraps] | Refused | None:
    """The site's report; REFUSED when nothing listens at `url` (twice,
    `REFUSAL_RECHECK` apart: its process is down); None when it does not answer as it
    should."""
    for attempt in range(2):
        try:
            document = _call("GET", url + REPLICATION_PATH, token)
            return parse_report(document), bootstraps_of(document)
        except urllib.error.URLError as error:
            if not isinstance(error.reason, ConnectionRefusedError):
                log.debug("site at %s does not answer: %s", url, error)
                return None
            if attempt == 0:
                time.sleep(REFUSAL_RECHECK)
        except ConnectionRefusedError:
            if attempt == 0:
                time.sleep(REFUSAL_RECHECK)
        except (OSError, ValueError, BadReportError) as error:
            log.debug("site at %s does not answer: %s", url, error)
            return None
    log.debug("site at %s refuses connections", url)
    return REFUSED


def probe_all(urls: Sequence[str], token: str, deadline: float = PROBE_TIMEOUT
              ) -> list[tuple[Report, Bootstraps] | Refused | None]:
    """`probe` of every site at once, in threads: a round waits at most `deadline`
    seconds (broker/controller/probing.py)."""
    return probe_in_threads(urls, lambda url: probe(url, token), deadline,
                            MAX_PARALLEL_PROBES)


def push(url: str, token: str, body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The site's answer (`accepted`, the `version` and `term` it keeps); None when it
    did not answer (it reports its version next round, and gets it again)."""
    try:
        found = _call("PUT", url + PLACEMENT_PATH, token, body)
    except (urllib.error.URLError, OSError, ValueError) as error:
        log.debug("push to %s failed: %s", url, error)
        return None
    return found if isinstance(found, dict) else None


def held_placement(url: str, token: str) -> Placement | None:
    """The placement a site keeps (`GET /api/v1/ds/placement`); None when it keeps
    none or does not answer as it should."""
    try:
        found = parse_held(_call("GET", url + PLACEMENT_PATH, token))
    except (urllib.error.URLError, OSError, ValueError, BadReportError) as error:
        log.warning("cannot read the placement the site at %s keeps: %s", url, error)
        return None
    return None if found is None else found[0]
