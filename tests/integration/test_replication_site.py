"""Replicated writes in running sites: three real site processes with cluster.enable
on loopback, one placement pushed by hand (every shard led by site A, replicas A, B,
C), MQTT clients on every site, and sites killed with SIGKILL."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import waiting
from harness.processes import HOST, BrokerProcess, free_port
from stratamq.broker.config import merge_config
from stratamq.broker.ds import Snapshot, shard_of
from stratamq.broker.ds.replication import Placement, ShardPlacement
from tests.support.checkpoints import make_checkpoint, snapshot_messages
from tests.support.clients import PahoClient, metric_value, unique

pytestmark = pytest.mark.cluster

N_SHARDS = 2
# every site replicates these, with N_SHARDS shards each
DATABASES = ("messages", "sessions", "retained")
ALL_SHARDS = N_SHARDS * len(DATABASES)
WAIT = 30.0  # generous: three brokers share two cores with other tests

# these tests push placements by hand, with no controller running: term 0
NO_TERM_JSON = [0, ""]


def cluster_config(peer_port: int, write_timeout: str = "3s") -> dict[str, Any]:
    return {"cluster": {"enable": True, "peer_bind": f"{HOST}:{peer_port}",
                        "write_timeout": write_timeout},
            "durable_storage": {"messages": {"n_shards": N_SHARDS}},
            "durable_sessions": {"heartbeat_interval": "200ms"}}


def admin(site: BrokerProcess, method: str, path: str,
          body: Any = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{HOST}:{site.admin_port}{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {BrokerProcess.ADMIN_TOKEN}",
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def replication(site: BrokerProcess) -> dict[str, Any]:
    status, body = admin(site, "GET", "/api/v1/ds/replication")
    assert status == 200, body
    found: dict[str, Any] = body
    return found


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT) -> None:
    waiting.wait_for(what, check, timeout, every=0.1)


class Sites:
    def __init__(self, root: Path, extra: dict[str, Any] | None = None) -> None:
        self.peer_ports = [free_port() for _ in range(3)]
        self.sites = [BrokerProcess(root / name, merge_config(cluster_config(port), extra or {}))
                      for name, port in zip("abc", self.peer_ports, strict=True)]
        self.ids: list[str] = []

    def start(self) -> None:
        for site in self.sites:
            site.start()
        self.ids = [replication(site)["site"] for site in self.sites]

    def peers(self) -> dict[str, str]:
        return {site_id: f"{HOST}:{port}"
                for site_id, port in zip(self.ids, self.peer_ports, strict=True)}

    def placement(self, version: int = 1, epoch: int = 1, leader: int = 0) -> Placement:
        replicas = tuple(sorted(self.ids))
        return Placement(version, tuple(
            ShardPlacement(db, shard, replicas, self.ids[leader], epoch)
            for db in DATABASES for shard in range(N_SHARDS)))

    def push(self, site: BrokerProcess, placement: Placement) -> tuple[int, Any]:
        return admin(site, "PUT", "/api/v1/ds/placement",
                     {"placement": json.loads(placement.to_json()), "peers": self.peers()})

    def push_all(self, placement: Placement, to: list[BrokerProcess] | None = None) -> None:
        for site in self.sites if to is None else to:
            status, body = self.push(site, placement)
            assert status == 200 and body == {"accepted": True, "version": placement.version,
                                              "term": NO_TERM_JSON}

    def stop(self) -> None:
        for site in self.sites:
            site.kill()


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    found = Sites(tmp_path)
    try:
        found.start()
        yield found
    finally:
        found.stop()


def offsets(site: BrokerProcess) -> list[tuple[int, int, int]]:
    """(shard, committed, applied) per shard."""
    return [(shard["shard"], shard["committed"], shard["applied"])
            for shard in replication(site)["shards"]]


def caught_up(sites: list[BrokerProcess]) -> bool:
    """Every site shows the same committed and applied offsets, with nothing committed
    left to apply."""
    seen = [offsets(site) for site in sites]
    return all(view == seen[0] for view in seen) and all(
        committed == applied for _shard, committed, applied in seen[0])


def test_the_replication_endpoints_answer_before_and_after_a_placement(sites: Sites) -> None:
    a, b, _c = sites.sites
    before = replication(a)
    assert before["site"] == sites.ids[0]
    assert before["peer"] == f"{HOST}:{sites.peer_ports[0]}"
    assert before["placement_version"] is None
    assert [shard["role"] for shard in before["shards"]] == ["none"] * ALL_SHARDS
    assert before["shards"][0] == {"db": "messages", "shard": 0, "role": "none", "epoch": 0,
                                   "last": [0, 0], "committed": 0, "applied": 0,
                                   "state": "ok", "bootstrap": None, "bootstraps": 0,
                                   "log_start": 1, "quorum_age": None,
                                   "catching_up": False}
    assert before["heartbeat_interval"] == 0.2

    status, body = admin(a, "PUT", "/api/v1/ds/placement", {"placement": {"format": 1},
                                                            "peers": {}})
    assert status == 400 and body["error"] == "BAD_REQUEST"

    sites.push_all(sites.placement())
    # a repeated push: the site keeps that very document, so it is accepted (issue 22)
    assert sites.push(a, sites.placement()) == (200, {"accepted": True, "version": 1,
                                                          "term": NO_TERM_JSON})
    wait_for("roles taken", lambda: [s["role"] for s in replication(a)["shards"]] ==
             ["leader"] * ALL_SHARDS and [s["role"] for s in replication(b)["shards"]] ==
             ["follower"] * ALL_SHARDS)
    after = replication(b)
    assert after["placement_version"] == 1
    # the leaders hear their followers each heartbeat (200ms): far below the controller's
    # allowance of three; followers report no quorum age
    wait_for("the leaders hear their followers", lambda: all(
        shard["quorum_age"] is not None and shard["quorum_age"] < 0.6
        for shard in replication(a)["shards"]))
    assert all(shard["quorum_age"] is None for shard in after["shards"])
    status, storage = admin(b, "GET", "/api/v1/ds/storages/messages")
    assert status == 200
    assert [(shard["replicas"], shard["leader"]) for shard in storage["shards"]] == \
        [(sorted(sites.ids), sites.ids[0])] * N_SHARDS
    assert all(shard["epoch"] == 1 for shard in after["shards"])
    # each leader's first entry of its epoch, committed and applied everywhere
    wait_for("the first entries applied everywhere", lambda: caught_up(sites.sites)
             and all(applied >= 1 for _s, _c, applied in offsets(a)))


def stored_payloads(site: BrokerProcess, folder: Path, prefix: str) -> list[bytes]:
    """The payloads of every message under `prefix/#` that the site's storage holds,
    read from a checkpoint of it."""
    make_checkpoint(site, folder)
    with Snapshot(folder) as snapshot:
        return sorted(message.payload
                      for _shard, _generation, _stream, message in snapshot_messages(
                          snapshot, f"{prefix}/#"))


def publisher(site: BrokerProcess, name: str, client_id: str | None = None) -> PahoClient:
    client = PahoClient(site.port, client_id or unique(name))
    assert client.connect().reason_code == 0
    return client


def test_writes_commit_on_a_majority_and_every_replica_applies_them(
        sites: Sites, tmp_path: Path) -> None:
    a, b, c = sites.sites
    sites.push_all(sites.placement())
    wait_for("leaders ready", lambda: caught_up(sites.sites)
             and all(applied >= 1 for _s, _c, applied in offsets(a)))
    prefix = unique("repl")
    subscriber = PahoClient(c.port, unique("sub-c"))
    clients = [subscriber]
    try:
        assert subscriber.connect().reason_code == 0
        assert subscriber.subscribe(f"{prefix}/#", qos=1) == [1]
        # QoS 1 on the leader's site and on a follower's (forwarded to the leader):
        # acknowledged, and live on a third site, which got them from its own log
        for site, name in ((a, "pub-a"), (b, "pub-b")):
            client = publisher(site, name)
            clients.append(client)
            for number in range(5):
                assert client.publish(f"{prefix}/{name}", f"{name}-{number}".encode()) == 0
            # exactly once through the leader too: the packet id's record is written
            # in the leader's batch, with the message
            assert client.publish(f"{prefix}/{name}", f"{name}-qos2".encode(), qos=2) == 0
        got = subscriber.expect(12, timeout=WAIT)
        subscriber.quiet()
        assert sorted(m.payload for m in got) == sorted(
            f"{name}-{n}".encode() for name in ("pub-a", "pub-b") for n in [*range(5), "qos2"])
        wait_for("the same offsets on every site", lambda: caught_up(sites.sites))
        for shard in map(str, range(N_SHARDS)):
            labels = {"db": "messages", "shard": shard}
            assert metric_value(a, "stratamq_ds_replica_leader", **labels) == 1
            assert metric_value(b, "stratamq_ds_replica_leader", **labels) == 0
            assert metric_value(a, "stratamq_ds_leader_changes_total", **labels) == 1

        # one follower gone: a majority (A and B) still commits
        subscriber.stop()
        c.kill()
        client_id = unique("pub-a2")
        client = publisher(a, "pub-a2", client_id)
        clients.append(client)
        assert client.publish(f"{prefix}/a2", b"with-two") == 0
        wait_for("the leader reports C behind", lambda: metric_value(
            a, "stratamq_ds_under_replicated", db="messages",
            shard=str(shard_of(client_id, N_SHARDS))) == 1)

        # both followers gone: nothing commits, the write is not acknowledged and the
        # broker ends the connection once cluster.write_timeout has passed (connected
        # before: a connect writes its client id's owner to the `sessions` shard,
        # which commits nothing either now)
        lonely = publisher(a, "pub-alone")
        clients.append(lonely)
        b.kill()
        info = lonely.client.publish(f"{prefix}/alone", b"alone", qos=1)
        lonely.wait_disconnected(timeout=WAIT)
        assert not info.is_published()

        # the followers come back: writes are acknowledged again, and they catch up
        # (the unacknowledged entry commits too: it was in the leader's log)
        b.start()
        c.start()
        again = publisher(b, "pub-b2")
        clients.append(again)
        assert again.publish(f"{prefix}/b2", b"back") == 0
        wait_for("the restarted followers caught up", lambda: caught_up(sites.sites))
        expected = sorted([f"{name}-{n}".encode() for name in ("pub-a", "pub-b")
                           for n in [*range(5), "qos2"]] + [b"with-two", b"alone", b"back"])
        for site, name in zip(sites.sites, "abc", strict=True):
            assert stored_payloads(site, tmp_path / f"before-{name}", prefix) == expected

        # the leader restarts (SIGKILL) with the same placement: it resumes applying,
        # losing and duplicating nothing
        for client in clients:
            client.stop()
        clients = []
        a.kill()
        a.start()
        wait_for("the leader leads again", lambda: [s["role"] for s in replication(a)[
            "shards"]] == ["leader"] * ALL_SHARDS)
        after = publisher(c, "pub-c")
        clients.append(after)
        assert after.publish(f"{prefix}/c", b"after-restart") == 0
        wait_for("caught up after the leader's restart", lambda: caught_up(sites.sites))
        for site, name in zip(sites.sites, "abc", strict=True):
            assert stored_payloads(site, tmp_path / f"after-{name}", prefix) == sorted(
                [*expected, b"after-restart"])
    finally:
        for client in clients:
            client.stop()


def generations(site: BrokerProcess) -> list[list[tuple[Any, ...]]]:
    """Per shard: each generation's id, start, end and whether it is current."""
    status, body = admin(site, "GET", "/api/v1/ds/storages/messages")
    assert status == 200, body
    return [[(g["id"], g["created_at"], g["since"], g["until"], g["current"])
             for g in shard["generations"]] for shard in body["shards"]]


def test_generations_change_only_through_the_leaders_log(tmp_path: Path) -> None:
    # retention adds a generation every 2 s and drops closed ones: on the leader, as
    # log entries that every replica applies, so their generations stay the same
    sites = Sites(tmp_path, {"durable_sessions": {"message_retention_period": "2s"}})
    try:
        sites.start()
        a, _b, c = sites.sites
        sites.push_all(sites.placement())
        prefix = unique("gens")
        subscriber = PahoClient(c.port, unique("sub"))
        writer = publisher(a, "pub")
        try:
            assert subscriber.connect().reason_code == 0
            assert subscriber.subscribe(f"{prefix}/#", qos=1) == [1]
            wait_for("a third generation started and an old one dropped", lambda: all(
                shard[-1][0] >= 3 and shard[0][0] >= 2 for shard in generations(a)))
            for number in range(3):
                assert writer.publish(f"{prefix}/t", b"%d" % number) == 0
            assert sorted(m.payload for m in subscriber.expect(3, timeout=WAIT)) == \
                [b"0", b"1", b"2"]
            # what the leader holds at one moment, every replica holds once caught up
            def same_everywhere() -> bool:
                views = [generations(site) for site in sites.sites]
                return caught_up(sites.sites) and views[1:] == views[:1] * 2
            wait_for("the same generations on every site", same_everywhere)
        finally:
            subscriber.stop()
            writer.stop()
    finally:
        sites.stop()


def roles(site: BrokerProcess) -> list[str]:
    return [shard["role"] for shard in replication(site)["shards"]]


def test_a_new_leader_takes_over_and_the_old_one_follows_it_when_back(
        sites: Sites, tmp_path: Path) -> None:
    # the site side of a failover: the controller's newer placement names B leader at
    # epoch 2; A, killed, comes back with epoch 1 on disk, is refused by the others,
    # then takes the newer placement and follows B
    a, b, c = sites.sites
    sites.push_all(sites.placement())
    wait_for("A leads", lambda: roles(a) == ["leader"] * ALL_SHARDS)
    prefix = unique("failover")
    clients: list[PahoClient] = []
    try:
        first = publisher(a, "pub-a")
        clients.append(first)
        for number in range(3):
            assert first.publish(f"{prefix}/a", b"a-%d" % number) == 0
        a.kill()
        sites.push_all(sites.placement(version=2, epoch=2, leader=1), to=[b, c])
        wait_for("B leads at epoch 2", lambda: roles(b) == ["leader"] * ALL_SHARDS)
        subscriber = PahoClient(c.port, unique("sub-c"))
        clients.append(subscriber)
        assert subscriber.connect().reason_code == 0
        assert subscriber.subscribe(f"{prefix}/#", qos=1) == [1]
        for site, name in ((b, "pub-b"), (c, "pub-c")):
            client = publisher(site, name)
            clients.append(client)
            for number in range(3):
                assert client.publish(f"{prefix}/{name}", f"{name}-{number}".encode()) == 0
        assert len(subscriber.expect(6, timeout=WAIT)) == 6

        a.start()  # placement version 1 on its disk: it leads epoch 1 until refused
        wait_for("A stops leading epoch 1", lambda: roles(a) == ["follower"] * ALL_SHARDS)
        status, body = sites.push(a, sites.placement(version=2, epoch=2, leader=1))
        assert status == 200 and body == {"accepted": True, "version": 2, "term": NO_TERM_JSON}
        wait_for("A caught up with B", lambda: caught_up(sites.sites))
        assert all(shard["epoch"] == 2 for shard in replication(a)["shards"])
        expected = sorted([b"a-%d" % n for n in range(3)] + [
            f"{name}-{n}".encode() for name in ("pub-b", "pub-c") for n in range(3)])
        for site, name in zip(sites.sites, "abc", strict=True):
            assert stored_payloads(site, tmp_path / f"checkpoint-{name}", prefix) == expected
    finally:
        for client in clients:
            client.stop()


def test_a_follower_killed_and_restarted_under_load_loses_and_duplicates_nothing(
        sites: Sites, tmp_path: Path) -> None:
    a, b, c = sites.sites
    sites.push_all(sites.placement())
    wait_for("A leads", lambda: roles(a) == ["leader"] * ALL_SHARDS)
    prefix = unique("load")
    writers = [publisher(a, "pub-a"), publisher(b, "pub-b")]
    try:
        sent = []
        for round_ in range(3):
            infos = []
            for number in range(100):
                for writer, name in zip(writers, "ab", strict=True):
                    payload = f"{name}-{round_}-{number}".encode()
                    infos.append(writer.client.publish(f"{prefix}/{name}", payload, qos=1))
                    sent.append(payload)
                if round_ == 1 and number == 50:
                    c.kill()  # while writes are in flight
            for info in infos:
                info.wait_for_publish(WAIT)
                assert info.is_published()
        c.start()
        wait_for("C caught up", lambda: caught_up(sites.sites))
        for site, name in zip(sites.sites, "abc", strict=True):
            assert stored_payloads(site, tmp_path / f"checkpoint-{name}", prefix) == \
                sorted(sent)
    finally:
        for writer in writers:
            writer.stop()


def test_a_site_whose_shard_log_is_gone_refuses_to_start(tmp_path: Path) -> None:
    # a replica set of one commits at once; a log removed under applied data would
    # make the site skip new entries, so it does not start
    site = BrokerProcess(tmp_path / "only", cluster_config(free_port()))
    try:
        site.start()
        site_id = replication(site)["site"]
        placement = Placement(1, tuple(ShardPlacement(db, shard, (site_id,), site_id, 1)
                                       for db in DATABASES for shard in range(N_SHARDS)))
        status, body = admin(site, "PUT", "/api/v1/ds/placement",
                             {"placement": json.loads(placement.to_json()),
                              "peers": {site_id: f"{HOST}:1"}})
        assert status == 200 and body["accepted"]
        writer = publisher(site, "pub")
        try:
            assert writer.publish("alone/t", b"x") == 0
        finally:
            writer.stop()
        assert all(applied >= 1 for _s, _c, applied in offsets(site))
        site.stop()
        shutil.rmtree(site.workdir / "data" / "replication" / "messages" / "0")
        with pytest.raises(RuntimeError, match="the log was removed or replaced"):
            site.start()
    finally:
        site.kill()
