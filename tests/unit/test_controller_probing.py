"""The heartbeat probes of both controllers (`broker/controller/probing.py`): all at
once, so a round waits for the slowest site at most its deadline, not for the sum of
every site's time; the operator's in threads (`operator/sites.py`, `probe_all`), the
local controller's on its event loop (`SiteClient.probe`). Real HTTP servers on
loopback; the hung site takes the connection (the kernel does) and answers nothing, as
a frozen broker does."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp

from stratamq.broker.controller.probing import probe_concurrently
from stratamq.broker.controller.site_client import SiteClient
from stratamq.broker.controller.sites import REFUSED, Report
from stratamq.operator.sites import SiteUnreachableError, probe_all, site_ids
from tests.support.sockets import hung_listener as hung_site

TOKEN = "secret"


def report(site: str) -> bytes:
    return json.dumps({"site": site, "peer": f"{site}:18084", "placement_version": None,
                       "stopping": False, "heartbeat_interval": 2.0,
                       "controller_term": [0, ""], "shards": []}).encode()


@contextmanager
def answering_site(site: str) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (json.dumps({"data": [{"site": site}]}).encode()
                    if self.path == "/api/v1/ds/sites" else report(site))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_hung_site_costs_a_round_one_deadline_not_one_per_site() -> None:
    with answering_site("SITEA") as first, hung_site() as hung, hung_site() as hung_too, \
            answering_site("SITEB") as second:
        started = time.monotonic()
        found = probe_all([first, hung, hung_too, second], TOKEN, deadline=1.0)
        took = time.monotonic() - started
    # one after the other, the two hung sites alone took a socket timeout (2 s) each
    assert took < 1.9, took
    answered = [result[0].site if isinstance(result, tuple) else result for result in found]
    assert answered == ["SITEA", None, None, "SITEB"]


def test_no_sites_no_probes() -> None:
    assert probe_all([], TOKEN) == []
    assert site_ids([], TOKEN) == []


def test_the_status_refresh_asks_every_site_at_once() -> None:
    """Issue 23: the status refresh asked each pod for its site id one after another,
    5 s per hung pod (a socket timeout): a few hung pods held the status of every
    storage the operator serves."""
    with answering_site("SITEA") as first, hung_site() as hung, hung_site() as hung_too, \
            answering_site("SITEB") as second:
        started = time.monotonic()
        found = site_ids([first, hung, hung_too, second, closed_address()], TOKEN,
                         deadline=1.0)
        took = time.monotonic() - started
    # one after the other, the two hung sites alone took a socket timeout (5 s) each
    assert took < 4.0, took
    assert found[0] == "SITEA" and found[3] == "SITEB"
    assert all(isinstance(answer, SiteUnreachableError) for answer in found[1:3] + found[4:])
    assert "no answer within 1 s" in str(found[1])


def test_on_the_event_loop_a_hung_site_costs_one_deadline_too() -> None:
    """The deadline ends the round's wait even where the client's own timeout (5 s
    here) would wait longer."""
    async def probe(urls: list[str]) -> list[str | None]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            found = await probe_concurrently(urls, SiteClient(http, TOKEN).probe, deadline=1.0)
        return [report.site if isinstance(report, Report) else None for report in found]

    with answering_site("SITEA") as first, hung_site() as hung, hung_site() as hung_too, \
            answering_site("SITEB") as second:
        started = time.monotonic()
        answered = asyncio.run(probe([first, hung, hung_too, second]))
        took = time.monotonic() - started
    assert took < 1.9, took
    assert answered == ["SITEA", None, None, "SITEB"]
    assert asyncio.run(probe([])) == []


def closed_address() -> str:
    """An address on loopback where nothing listens (a site whose process is down)."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{unused.getsockname()[1]}"


def test_an_address_where_nothing_listens_is_refused_not_unanswered() -> None:
    """Both controllers tell a site whose process is down (its address refuses the
    connection: it fails over at once) from one that does not answer in time (a
    loaded or cut-off site: three missed heartbeats)."""

    async def on_the_loop(urls: list[str]) -> list[object]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            found = await probe_concurrently(urls, SiteClient(http, TOKEN).probe, deadline=1.0)
        return [report.site if isinstance(report, Report) else report for report in found]

    with answering_site("SITEA") as answering, hung_site() as hung:
        urls = [answering, hung, closed_address()]
        in_threads = [result[0].site if isinstance(result, tuple) else result
                      for result in probe_all(urls, TOKEN, deadline=1.0)]
        assert in_threads == ["SITEA", None, REFUSED]
        assert asyncio.run(on_the_loop(urls)) == ["SITEA", None, REFUSED]
