"""The admin HTTP API and `stratamq ctl` against real broker processes: credentials
on every `/api/v1` route, open probes and metrics, what the API shows of a connected
client and of the storage, the generated token, and the ctl tables."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from email.message import Message
from pathlib import Path
from typing import Any

import aiohttp
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions
from prometheus_client.parser import text_string_to_metric_families

from harness.processes import BrokerProcess, free_port
from harness.waiting import wait_until
from stratamq.broker.admin import AdminServer
from stratamq.broker.admin.credentials import Credentials

TOKEN = "test-token-0123456789"  # what BrokerProcess configures
ADMIN_USER = "admin"
ADMIN_PASSWORD = "admin-password-1"

API_ROUTES = ["/api/v1/clients", "/api/v1/clients/nobody", "/api/v1/subscriptions",
              "/api/v1/shared_groups", "/api/v1/ds/storages", "/api/v1/ds/storages/messages",
              "/api/v1/ds/sites"]
OPEN_ROUTES = ["/metrics", "/healthz", "/readyz"]


# -- helpers ---------------------------------------------------------------------------

def http(url: str, headers: dict[str, str] | None = None,
         method: str = "GET") -> tuple[int, Message, bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def basic(username: str, password: str) -> dict[str, str]:
    pair = base64.b64encode(f"{username}:{password}".encode()).decode()
    return {"Authorization": f"Basic {pair}"}


def api(broker: BrokerProcess, path: str, token: str = TOKEN) -> Any:
    status, _headers, body = http(f"http://127.0.0.1:{broker.admin_port}{path}", bearer(token))
    assert status == 200, body
    return json.loads(body)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    assert wait_until(predicate, timeout), "condition not reached in time"


def ctl(*arguments: str, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stratamq.broker", "ctl", *arguments],
                          capture_output=True, text=True, timeout=30, cwd=cwd,
                          env={**os.environ, **(env or {})})


# One site for the read-only checks: configured token and basic credentials.
BROKER_CONFIG = {"admin": {"username": ADMIN_USER, "password": ADMIN_PASSWORD}}


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[mqtt.Client]:
    """A connected MQTT 5 client with a durable session and three subscriptions."""
    connected = threading.Event()
    subscribed = threading.Event()
    paho = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="admin-probe",
                       protocol=mqtt.MQTTv5)
    paho.username_pw_set("alice")
    paho.on_connect = lambda *_args: connected.set()
    acks: list[int] = []

    def on_subscribe(*_args: Any) -> None:
        acks.append(1)
        if len(acks) == 2:
            subscribed.set()

    paho.on_subscribe = on_subscribe
    properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    properties.SessionExpiryInterval = 300
    paho.connect("127.0.0.1", broker.port, keepalive=42, clean_start=True,
                 properties=properties)
    paho.loop_start()
    assert connected.wait(5)
    with_id = Properties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]
    with_id.SubscriptionIdentifier = 7
    paho.subscribe("probe/+/temp", options=SubscribeOptions(
        qos=1, noLocal=True, retainAsPublished=True, retainHandling=1), properties=with_id)
    paho.subscribe([("$share/grp/jobs/#", SubscribeOptions(qos=2)),
                    ("plain/topic", SubscribeOptions(qos=0))])
    assert subscribed.wait(5)
    yield paho
    paho.disconnect()
    paho.loop_stop()


# -- credentials -----------------------------------------------------------------------

@pytest.mark.parametrize("path", API_ROUTES)
def test_api_routes_refuse_missing_or_wrong_credentials(broker: BrokerProcess,
                                                        path: str) -> None:
    url = f"http://127.0.0.1:{broker.admin_port}{path}"
    for headers in [{}, bearer("wrong-token-0123456789"), bearer(""),
                    basic(ADMIN_USER, "wrong-password"), basic("root", ADMIN_PASSWORD),
                    {"Authorization": "Basic !!!not-base64"}, {"Authorization": TOKEN}]:
        status, response_headers, body = http(url, headers)
        assert status == 401, (headers, body)
        assert json.loads(body)["error"] == "UNAUTHORIZED"
        challenges = response_headers.get_all("WWW-Authenticate") or []
        assert any(c.startswith("Bearer") for c in challenges), challenges
        assert any(c.startswith("Basic") for c in challenges), challenges


@pytest.mark.parametrize("path", API_ROUTES)
def test_api_routes_accept_token_and_basic_credentials(broker: BrokerProcess,
                                                       path: str) -> None:
    url = f"http://127.0.0.1:{broker.admin_port}{path}"
    expected = 404 if path.endswith("/nobody") else 200
    for headers in [bearer(TOKEN), basic(ADMIN_USER, ADMIN_PASSWORD)]:
        status, response_headers, body = http(url, headers)
        assert status == expected, body
        assert response_headers["Content-Type"].startswith("application/json")
        json.loads(body)


def test_probes_and_metrics_need_no_credentials(broker: BrokerProcess) -> None:
    base = f"http://127.0.0.1:{broker.admin_port}"
    for path in OPEN_ROUTES:
        status, _headers, body = http(base + path)
        assert status == 200, (path, body)
    assert json.loads(http(base + "/healthz")[2]) == {"status": "ok"}
    assert json.loads(http(base + "/readyz")[2]) == {
        "status": "ready", "checks": {"storage": "ok", "listeners": "ok", "running": "ok",
                                      "replicas": "ok"}}


def test_not_ready_until_the_site_is_attached() -> None:
    """Between the admin server's start and the site's (storage opening), and again
    while the site stops: alive, not ready, and the API answers 503."""

    async def scenario() -> None:
        server = AdminServer(Credentials(token=TOKEN))
        await server.start("127.0.0.1:0")
        base = f"http://127.0.0.1:{server.port}"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(base + "/healthz") as response:
                    assert response.status == 200
                async with session.get(base + "/readyz") as response:
                    assert response.status == 503
                    assert (await response.json())["status"] == "not_ready"
                async with session.get(base + "/api/v1/clients") as response:
                    assert response.status == 401
                async with session.get(base + "/api/v1/clients",
                                       headers=bearer(TOKEN)) as response:
                    assert response.status == 503
                    assert (await response.json())["error"] == "SERVICE_UNAVAILABLE"
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_errors_are_json_with_the_right_status(broker: BrokerProcess) -> None:
    base = f"http://127.0.0.1:{broker.admin_port}"
    # An unknown path is not a way around authentication.
    assert http(base + "/api/v1/nothing")[0] == 401
    assert http(base + "/nothing")[0] == 401
    cases = [("GET", "/api/v1/nothing", 404, "NOT_FOUND"),
             ("GET", "/api/v1/clients/nobody", 404, "NOT_FOUND"),
             ("GET", "/api/v1/ds/storages/nodb", 404, "NOT_FOUND"),
             ("GET", "/api/v1/ds/sites/0000000000000000", 404, "NOT_FOUND"),
             ("POST", "/api/v1/clients", 405, "METHOD_NOT_ALLOWED"),
             ("DELETE", "/api/v1/ds/storages/messages", 405, "METHOD_NOT_ALLOWED")]
    for method, path, status, code in cases:
        got, headers, body = http(base + path, bearer(TOKEN), method)
        assert got == status, (method, path, body)
        error = json.loads(body)
        assert error["error"] == code and error["message"], error
        if status == 405:
            assert "GET" in headers["Allow"]
    assert "nobody" in json.loads(http(base + "/api/v1/clients/nobody", bearer(TOKEN))[2])[
        "message"]


# -- what the API shows ----------------------------------------------------------------

def test_clients_and_subscriptions_show_a_connected_client(broker: BrokerProcess,
                                                           client: mqtt.Client) -> None:
    clients = api(broker, "/api/v1/clients")
    assert clients["meta"]["count"] == len(clients["data"]) == 1
    shown = clients["data"][0]
    assert shown == api(broker, "/api/v1/clients/admin-probe")
    assert {key: shown[key] for key in (
        "client_id", "username", "listener", "protocol_level", "protocol_version",
        "keepalive", "durable", "expiry_interval", "subscriptions", "in_flight",
        "queued")} == {
        "client_id": "admin-probe", "username": "alice", "listener": "tcp",
        "protocol_level": 5, "protocol_version": "5.0", "keepalive": 42, "durable": True,
        "expiry_interval": 300, "subscriptions": 3, "in_flight": 0, "queued": 0}
    assert "127.0.0.1" in shown["peer"]
    connected_at = datetime.fromisoformat(shown["connected_at"])
    assert abs(connected_at.timestamp() - time.time()) < 60

    subscriptions = api(broker, "/api/v1/subscriptions")["data"]
    by_filter = {s["topic_filter"]: s for s in subscriptions}
    assert by_filter == {
        "probe/+/temp": {"client_id": "admin-probe", "topic_filter": "probe/+/temp",
                         "qos": 1, "share_group": None, "no_local": True, "rap": True,
                         "rh": 1, "identifier": 7, "connected": True},
        "$share/grp/jobs/#": {"client_id": "admin-probe", "topic_filter": "$share/grp/jobs/#",
                              "qos": 2, "share_group": "grp", "no_local": False,
                              "rap": False, "rh": 0, "identifier": None, "connected": True},
        "plain/topic": {"client_id": "admin-probe", "topic_filter": "plain/topic", "qos": 0,
                        "share_group": None, "no_local": False, "rap": False, "rh": 0,
                        "identifier": None, "connected": True},
    }

    group = {"share_group": "grp", "topic_filter": "jobs/#", "members": ["admin-probe"],
             "away": [], "absent": False, "saved_away": ["admin-probe"]}
    # its session outlives the connection: the site stores the group for it
    wait_for(lambda: api(broker, "/api/v1/shared_groups")["data"] == [group])

    client.disconnect()
    wait_for(lambda: api(broker, "/api/v1/clients")["data"] == [])
    assert http(f"http://127.0.0.1:{broker.admin_port}/api/v1/clients/admin-probe",
                bearer(TOKEN))[0] == 404
    assert api(broker, "/api/v1/shared_groups")["data"] == [
        {**group, "members": [], "away": ["admin-probe"], "absent": True}]


def test_storages_and_sites(broker: BrokerProcess) -> None:
    site_id = (broker.workdir / "data" / "site-id").read_text().strip()
    assert len(site_id) == 16 and int(site_id, 16) >= 0

    storages = api(broker, "/api/v1/ds/storages")["data"]
    assert storages == [{"name": "messages", "n_shards": 4,
                         "layout": "wildcard_optimized_v2"}]
    messages = api(broker, "/api/v1/ds/storages/messages")
    assert messages["n_shards"] == 4 and messages["layout"] == "wildcard_optimized_v2"
    assert [shard["id"] for shard in messages["shards"]] == [0, 1, 2, 3]
    for shard in messages["shards"]:
        assert shard["replicas"] == [site_id] and shard["leader"] == site_id
        assert shard["disk_bytes"] > 0
        assert shard["committed_timestamp"] >= 0
        assert all(generation["bytes"] >= 0 for generation in shard["generations"])
        current = shard["generations"][-1]
        assert current["until"] is None and current["current"] is True
        assert current["layout"] == "wildcard_optimized_v2"
        assert 0 < current["created_at"] <= time.time() * 1_000_000
        assert 0 < current["since"] <= time.time() * 1_000_000
    assert messages["disk_bytes"] == sum(s["disk_bytes"] for s in messages["shards"])

    sites = api(broker, "/api/v1/ds/sites")["data"]
    assert len(sites) == 1
    assert sites[0]["site"] == site_id and sites[0]["up"] is True
    assert sites[0]["shards"] == [{"storage": "messages", "id": n, "leader": site_id,
                                   "role": "leader"} for n in range(4)]
    assert api(broker, f"/api/v1/ds/sites/{site_id}") == sites[0]


def test_metrics_serve_broker_and_storage_metrics(broker: BrokerProcess) -> None:
    publisher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="admin-metrics")
    publisher.connect("127.0.0.1", broker.port)
    publisher.loop_start()
    for number in range(3):
        publisher.publish("metrics/t", b"%d" % number, qos=1).wait_for_publish(5)
    publisher.disconnect()
    publisher.loop_stop()

    status, headers, body = http(f"http://127.0.0.1:{broker.admin_port}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    families = {family.name: family for family in
                text_string_to_metric_families(body.decode())}
    received = sum(sample.value for sample in families["stratamq_messages_received"].samples
                   if sample.name == "stratamq_messages_received_total")
    assert received >= 3
    assert "stratamq_ds_buffer_messages" in families  # storage metrics too
    assert "stratamq_connections" in families


# -- the generated token ---------------------------------------------------------------

def test_token_is_generated_once_stored_0600_and_reused(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path, {"admin": {"token": None}}).start()
    try:
        token_file = tmp_path / "data" / "admin-token"
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert f"admin API token generated and stored in {token_file}" in broker.log()
        assert token not in broker.log()
        assert "WARNING" in next(line for line in broker.log().splitlines()
                                 if "admin API token generated" in line)
        assert api(broker, "/api/v1/clients", token)["data"] == []
        assert http(f"http://127.0.0.1:{broker.admin_port}/api/v1/clients",
                    bearer(TOKEN))[0] == 401
        site_id = (tmp_path / "data" / "site-id").read_text()

        # ctl finds the token in data/admin-token when run from the site's directory.
        listed = ctl("clients", "--url", f"http://127.0.0.1:{broker.admin_port}", cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert "no connected clients" in listed.stdout

        assert broker.stop() == 0
        broker.start()
        assert token_file.read_text().strip() == token
        assert (tmp_path / "data" / "site-id").read_text() == site_id
        assert broker.log().count("admin API token generated") == 1
        assert api(broker, "/api/v1/ds/sites", token)["data"][0]["site"] == site_id.strip()
    finally:
        broker.kill()


# -- stratamq ctl ----------------------------------------------------------------------

def test_ctl_clients_and_ds_info(broker: BrokerProcess, client: mqtt.Client) -> None:
    url = f"http://127.0.0.1:{broker.admin_port}"
    listed = ctl("clients", "--url", url, "--token", TOKEN)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["CLIENT", "ID", "USERNAME", "PEER", "LISTENER", "MQTT",
                              "KEEPALIVE", "CONNECTED", "AT", "DURABLE", "EXPIRY", "SUBS",
                              "IN-FLIGHT", "QUEUED"]
    fields = row.split()
    assert fields[:2] == ["admin-probe", "alice"]
    assert fields[-9:] == ["tcp", "5.0", "42", fields[-6], "yes", "300", "3", "0", "0"]
    datetime.fromisoformat(fields[-6])

    shown = ctl("clients", "show", "admin-probe", "--url", url,
                env={"STRATAMQ_ADMIN_TOKEN": TOKEN})
    assert shown.returncode == 0, shown.stderr
    assert "client_id: admin-probe" in shown.stdout and "keepalive: 42" in shown.stdout

    info = ctl("ds", "info", "--url", url, "--user", f"{ADMIN_USER}:{ADMIN_PASSWORD}")
    assert info.returncode == 0, info.stderr
    site_id = (broker.workdir / "data" / "site-id").read_text().strip()
    lines = info.stdout.splitlines()
    for section in ("SITES:", "DATABASES:", "SHARDS:", "GENERATIONS:"):
        assert section in lines
    assert f"{site_id}  up      4" in lines
    assert any(line.split()[:3] == ["messages", "4", "wildcard_optimized_v2"]
               for line in lines)
    for shard in range(4):
        assert any(line.split()[:4] == [f"messages/{shard}", site_id, site_id, "1"]
                   for line in lines), info.stdout
        assert any(line.split()[:3] == [f"messages/{shard}", "1", "wildcard_optimized_v2"]
                   and line.split()[-1] == "current" for line in lines), info.stdout


def test_ctl_reports_refused_credentials_and_unreachable_api(broker: BrokerProcess,
                                                              tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{broker.admin_port}"
    refused = ctl("clients", "--url", url, "--token", "wrong-token-0123456789",
                  cwd=tmp_path)
    assert refused.returncode == 1
    assert "401 Unauthorized: credentials were refused" in refused.stderr
    missing = ctl("ds", "info", "--url", url, cwd=tmp_path)  # no token anywhere
    assert missing.returncode == 1
    assert "401 Unauthorized: credentials are missing" in missing.stderr

    closed = free_port()  # nobody listens there
    unreachable = ctl("clients", "--url", f"http://127.0.0.1:{closed}", "--token", TOKEN)
    assert unreachable.returncode == 1
    assert "cannot reach the admin API" in unreachable.stderr
    assert "Connection refused" in unreachable.stderr

    usage = ctl("ds", "--url", url)
    assert usage.returncode == 2
