"""Generation GC with per-topic retention, end to end on a real site: a durable
session reads part of a generation and goes offline; the generation is closed; a
checkpoint is planned by `stratamq spark gc --dry-run` (Spark, local) and the plan
applied with `stratamq ctl ds apply-gc`. Then the session gets every live message it
had not read and no expired one, live messages keep their keys (timestamps and
streams), the current generation is untouched, and the same plan is refused.

Expiry is decided against the plan's time (`--now`), set a fixed while after the
checkpoint, so no test outcome depends on how long anything took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.subscribeoptions import SubscribeOptions

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.ds import Snapshot, shard_of
from stratamq.spark.cli import plan_report, summary_line
from tests.support.checkpoints import (
    Published,
    admin_post,
    make_checkpoint,
    publish_all,
    snapshot_messages,
)
from tests.support.clients import ADMIN_TOKEN, PahoClient, generations, paho_properties

N_SHARDS = 4
# message_retention_period is the default rule, and the rollover period (4 s, so the
# test gets a closed generation soon); the rules keep what they name longer, and the
# site itself drops no generation before the longest rule (90 days) has passed.
RULES = {"sensors/#": "1h", "sensors/debug/#": "2s", "alerts/#": "90d"}
CONFIG = {"durable_storage": {"messages": {"n_shards": N_SHARDS}},
          "durable_sessions": {"message_retention_period": "4s", "retention_rules": RULES}}
# After the checkpoint by this much, every message older than 4 s at the checkpoint
# has expired under the default rule: all that was published before it.
PLAN_DELAY_US = 5_000_000


def client_in_shard(prefix: str, shard: int) -> str:
    return next(f"{prefix}-{i}" for i in range(1000)
                if shard_of(f"{prefix}-{i}", N_SHARDS) == shard)


LOGGER = client_in_shard("logger", 0)  # only default-rule topics: its generation goes
MIXED = client_in_shard("mixed", 1)  # sensors and logs: rewritten
ALERTER = client_in_shard("alerter", 2)  # alerts only: kept
DEBUGGER = client_in_shard("debugger", 3)  # sensors/debug (2 s) and sensors (1 h)


def batch(tag: str) -> list[Published]:
    messages = []
    for i in range(6):
        messages += [
            Published(LOGGER, f"logs/app{i % 2}", b"%s-log-%d" % (tag.encode(), i), 1),
            Published(MIXED, f"sensors/s{i % 3}/temp", b"%s-sens-%d" % (tag.encode(), i), 1),
            Published(MIXED, "logs/mixed", b"%s-mlog-%d" % (tag.encode(), i), 1),
            Published(ALERTER, f"alerts/a{i % 2}", b"%s-alert-%d" % (tag.encode(), i), 1),
            Published(DEBUGGER, f"sensors/debug/d{i % 2}", b"%s-dbg-%d" % (tag.encode(), i), 1),
            Published(DEBUGGER, "sensors/engine", b"%s-eng-%d" % (tag.encode(), i), 1)]
    return messages


def live_under_rules(message: Published) -> bool:
    """Live at the plan's time, for a message published before the checkpoint."""
    return message.topic.startswith(("alerts/", "sensors/")) \
        and not message.topic.startswith("sensors/debug/")


def stored(folder: Path) -> dict[tuple[str, bytes], tuple[int, int, str, int]]:
    """(topic, payload) -> (shard, generation, stream, timestamp) of every message."""
    with Snapshot(folder) as snapshot:
        return {(m.topic, m.payload): (shard_id, generation_id, stream.static.hex(), m.timestamp)
                for shard_id, generation_id, stream, m in snapshot_messages(snapshot)}


def ctl(broker: BrokerProcess, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stratamq.broker", "ctl", *arguments,
                           "--url", f"http://127.0.0.1:{broker.admin_port}"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "STRATAMQ_ADMIN_TOKEN": ADMIN_TOKEN})


def plan_of(checkpoint: Path, now: int, config: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "stratamq.broker", "spark", "gc", "--checkpoint", str(checkpoint),
         "--config", str(config), "--now", str(now), "--dry-run", "--json", "--master",
         "local[2]"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan: dict[str, Any] = json.loads(done.stdout)
    # and a person reads what it does per rule and in a line, not 1,800 lines of JSON
    # (beside --json: on stderr), with little else: no progress bars, none of Spark's
    # start-up notices and warnings (42 lines before); the JVM's own line on its
    # incubator module stays
    for noise in ("[Stage", " WARN ", "log4j", "Setting default log level"):
        assert noise not in done.stderr, done.stderr[-3000:]
    report = plan_report(plan)
    assert report in done.stderr, done.stderr[-3000:]
    rest = done.stderr.replace(report, "").splitlines()
    assert summary_line(plan, None) in rest, done.stderr[-3000:]
    assert len([line for line in rest if line]) <= 2, done.stderr[-3000:]
    return plan


@pytest.mark.timeout(900)  # JVMs of Spark local on a shared 2-core machine
def test_gc_plan_applied_keeps_live_messages_for_a_durable_session(tmp_path: Path) -> None:
    with running_broker(tmp_path / "site", CONFIG) as broker:
        reader = PahoClient(broker.port, "gc-reader")
        reader.connect(properties=paho_properties(PacketTypes.CONNECT,
                                                  SessionExpiryInterval=600))
        assert reader.subscribe([(topic_filter, SubscribeOptions(qos=1)) for topic_filter
                                 in ("sensors/#", "alerts/#", "logs/#")]) == [1, 1, 1]
        first, second = batch("a1"), batch("a2")
        publish_all(broker, first)
        got = reader.expect(len(first), timeout=30)
        assert sorted((m.topic, m.payload) for m in got) == sorted(
            (m.topic, m.payload) for m in first)
        reader.quiet(0.5)  # every delivery acknowledged: nothing left in flight
        reader.stop()
        publish_all(broker, second)  # read by nobody yet: the session is mid-generation
        wait_for_rollover(broker)
        current = batch("b")
        publish_all(broker, current)

        before = tmp_path / "before"
        manifest = make_checkpoint(broker, before)
        plan = plan_of(before, manifest["created_at"] + PLAN_DELAY_US, broker.config_path)
        check_plan(plan, manifest)
        plan_file = tmp_path / "plan.json"
        plan_file.write_text(json.dumps(plan))

        applied = ctl(broker, "ds", "apply-gc", str(plan_file), "--json")
        assert applied.returncode == 0, applied.stderr
        report = json.loads(applied.stdout)
        statuses = {(g["shard"], g["generation"]): g["status"] for g in report["generations"]}
        assert statuses == {(0, 1): "dropped", (1, 1): "rewritten", (3, 1): "rewritten"}
        # of the two batches in generation 1: the logs in shard 0 (6 each), logs/mixed
        # in shard 1, sensors/debug in shard 3
        assert report["deleted_messages"] == 12 + 12 + 12
        assert report["bytes_freed"] > 0

        # The session comes back: the live rest of the generation it was in, then
        # the current generation; nothing expired.
        back = PahoClient(broker.port, "gc-reader")
        assert back.connect(clean_start=False).session_present
        wanted = [m for m in second if live_under_rules(m)] + current
        got = back.expect(len(wanted), timeout=30)
        assert sorted((m.topic, m.payload) for m in got) == sorted(
            (m.topic, m.payload) for m in wanted)
        back.quiet(1.0)
        back.stop()

        after = tmp_path / "after"
        make_checkpoint(broker, after)
        old, new = stored(before), stored(after)
        live = {key: place for key, place in old.items()
                if place[1] != 1 or live_under_rules(Published("", key[0], key[1], 1))}
        assert new == live  # same shard, generation, stream and timestamp; nothing else
        assert not any(place[0] == 0 and place[1] == 1 for place in new.values())

        # The same plan again, or any plan from a checkpoint before it: older than
        # the data, refused as a whole.
        status, answer = admin_post(broker, "/api/v1/ds/storages/messages/gc-plan", plan)
        assert status == 409 and "older than the data" in answer["message"], answer
        again = ctl(broker, "ds", "apply-gc", str(plan_file))
        assert again.returncode == 1 and "409" in again.stderr, again.stderr
        assert stored(after) == new
        # dropped by the plan; the alerts' generation 1 is still there: the site drops a
        # generation whole only after the longest rule (90 days), not after 4 s
        assert 1 not in generations(broker)[0] and 1 in generations(broker)[2]


def wait_for_rollover(broker: BrokerProcess) -> None:
    deadline = time.monotonic() + 60
    while not all(len(ids) >= 2 for ids in generations(broker).values()):
        assert time.monotonic() < deadline, "no generation rollover"
        time.sleep(0.2)


def check_plan(plan: dict[str, Any], manifest: dict[str, Any]) -> None:
    assert plan["kind"] == "stratamq-gc-plan" and plan["site"] == manifest["site"]
    assert plan["checkpoint"]["created_at"] == manifest["created_at"]
    by_place = {(g["shard"], g["generation"]): g for g in plan["generations"]}
    assert {place: g["action"] for place, g in by_place.items() if place[1] == 1} == {
        (0, 1): "drop", (1, 1): "rewrite", (2, 1): "keep", (3, 1): "rewrite"}
    for (_shard, generation), entry in by_place.items():
        if generation != 1:
            assert entry["action"] == "keep" and "current" in entry["reason"]
    debug = by_place[(3, 1)]["by_rule"]
    assert debug["sensors/debug/#"]["expired_messages"] == 12  # the most specific rule
    assert debug["sensors/#"]["expired_messages"] == 0
    assert by_place[(1, 1)]["by_rule"]["(default)"] == {
        "messages": 12, "expired_messages": 12,
        "payload_bytes": by_place[(1, 1)]["by_rule"]["(default)"]["payload_bytes"],
        "expired_payload_bytes": by_place[(1, 1)]["by_rule"]["(default)"]["payload_bytes"]}
    assert plan["summary"]["drop_generations"] == 1
