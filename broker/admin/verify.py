"""`stratamq ctl ds verify [DB]`: compare the replicas of every shard by the digest
of their content (`ds/digest.py`) and name any replica that differs.

It asks the cluster controller (`--url`, by default that of `stratamq cluster`) for
the sites' admin URLs and each shard's replicas, then asks every replica's site for
its digest of the shard, with the same credentials: the controller knows where the
replicas are, and each digest reads a whole shard, which is work for the sites, not
for the controller's loop. Replicas are compared at one log offset: a replica that
has applied less than another is asked again at the other's offset (it waits for it,
up to `--wait`); one whose offset keeps moving (writes under way) leaves the shard
"unsettled". The exit status is 1 when any shard differs, is unsettled or has a
replica that did not answer."""

from __future__ import annotations

import json
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .ctl import AdminClient, CtlError, table

# Rounds of asking the replicas that lag again at the offset of the furthest.
ROUNDS = 3

Status = Literal["same", "differ", "unsettled", "unreachable"]


@dataclass(frozen=True, slots=True)
class Answer:
    """One replica's digest of a shard (`error` when its site did not give one)."""

    applied: int = -1
    digest: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class Verdict:
    shard: str  # "db/id"
    status: Status
    offset: int  # the offset compared at (the furthest one when unsettled)
    digest: str  # the digest most replicas hold
    # the replicas that differ (or did not answer, or stand at another offset)
    odd: tuple[str, ...]
    answers: dict[str, Answer]


def judge(shard: str, answers: Mapping[str, Answer]) -> Verdict:
    """Compare the replicas' answers for one shard. Pure."""
    failed = tuple(sorted(site for site, answer in answers.items() if answer.error))
    fine = {site: answer for site, answer in answers.items() if not answer.error}
    offset = max((answer.applied for answer in fine.values()), default=-1)
    if failed:
        return Verdict(shard, "unreachable", offset, "", failed, dict(answers))
    behind = tuple(sorted(site for site, answer in fine.items() if answer.applied != offset))
    if behind:
        return Verdict(shard, "unsettled", offset, "", behind, dict(answers))
    counts = Counter(answer.digest for answer in fine.values()).most_common()
    digest, most = counts[0] if counts else ("", 0)
    if len(counts) <= 1:
        return Verdict(shard, "same", offset, digest, (), dict(answers))
    # no digest held by more replicas than any other: none is known good
    agreed = digest if most > counts[1][1] else ""
    odd = tuple(sorted(site for site, answer in fine.items() if answer.digest != agreed))
    return Verdict(shard, "differ", offset, agreed, odd, dict(answers))


Ask = Callable[[str, str, int, int | None], Answer]


def verify_shard(db: str, shard_id: int, replicas: list[str], ask: Ask) -> Verdict:
    """Ask every replica, then those behind again at the furthest offset."""
    name = f"{db}/{shard_id}"
    answers = {site: ask(site, db, shard_id, None) for site in replicas}
    verdict = judge(name, answers)
    for _ in range(ROUNDS):
        if verdict.status != "unsettled":
            break
        for site in verdict.odd:
            answers[site] = ask(site, db, shard_id, verdict.offset)
        verdict = judge(name, answers)
    return verdict


def site_asker(urls: Mapping[str, str], authorization: str | None, wait: float) -> Ask:
    """How `verify_shard` asks a site (by id) for its digest of a shard."""
    def ask(site: str, db: str, shard_id: int, offset: int | None) -> Answer:
        url = urls.get(site)
        if url is None:
            return Answer(error=f"the controller knows no admin URL of {site}")
        query = {"wait": str(wait)} if offset is None else {"offset": str(offset),
                                                             "wait": str(wait)}
        path = (f"/api/v1/ds/storages/{urllib.parse.quote(db, safe='')}/shards/{shard_id}"
                f"/digest?{urllib.parse.urlencode(query)}")
        try:
            found = AdminClient(url, authorization, timeout=wait + 30).get(path)
            return Answer(int(found["applied"]), str(found["digest"]))
        except CtlError as exc:
            return Answer(error=str(exc))
        except (KeyError, TypeError, ValueError) as exc:
            return Answer(error=f"{url}: not a digest: {exc!r}")
    return ask


def verify(controller: AdminClient, databases: list[str], wait: float) -> list[Verdict]:
    """Every shard of `databases` (all the controller knows when empty)."""
    sites = controller.get("/api/v1/ds/sites")["data"]
    urls = {str(site["site"]): str(site["admin_url"]) for site in sites
            if site.get("admin_url")}
    known = [str(db["name"]) for db in controller.get("/api/v1/ds/storages")["data"]]
    for name in databases:
        if name not in known:
            raise CtlError(f"no database {name!r} (the cluster has: {', '.join(known)})")
    ask = site_asker(urls, controller.authorization, wait)
    verdicts = []
    for db in databases or known:
        storage = controller.get("/api/v1/ds/storages/" + urllib.parse.quote(db, safe=""))
        verdicts += [verify_shard(db, int(shard["id"]), list(shard["replicas"]), ask)
                     for shard in storage["shards"]]
    return verdicts


def report(verdicts: list[Verdict], as_json: bool) -> tuple[str, bool]:
    """The output, and whether every shard's replicas are the same."""
    good = all(verdict.status == "same" for verdict in verdicts)
    if as_json:
        document: dict[str, Any] = {"same": good, "shards": [asdict(v) for v in verdicts]}
        return json.dumps(document, indent=2), good
    rows = [[v.shard, v.offset, v.status.upper() if v.status != "same" else "same",
             v.digest[:16] or "-", ",".join(v.odd) or "-",
             ",".join(sorted(v.answers))] for v in verdicts]
    lines = [table(["Shard", "Offset", "Status", "Digest", "Differing", "Replicas"], rows)]
    for verdict in verdicts:
        for site in verdict.odd:
            answer = verdict.answers[site]
            lines.append(f"{verdict.shard} on {site}: " + (
                answer.error or f"digest {answer.digest} at offset {answer.applied}"))
    bad = [verdict for verdict in verdicts if verdict.status != "same"]
    lines.append(f"all replicas of {len(verdicts)} shards are the same" if good else
                 f"{len(bad)} of {len(verdicts)} shards have replicas that are not the same")
    return "\n".join(lines), good
