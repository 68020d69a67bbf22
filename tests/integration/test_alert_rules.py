"""The chart's alert rules (charts/stratamq/rules) with the real `promtool`: they
load, and each alert fires on the condition it names, with the labels its message
uses, and stays quiet on a healthy site."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from harness.processes import REPO
from tests.support.prometheus import PROMTOOL

RULES = REPO / "charts" / "stratamq" / "rules" / "stratamq.rules.yaml"
SITE = 'instance="site-0:18083", job="stratamq"'
HEALTHY = 'instance="site-1:18083", job="stratamq"'
GiB = 2**30
# The job of the operator's metrics: the chart's ServiceMonitor takes it from a label of
# the operator's Service (its jobLabel), whatever the chart's objects are called
# (tests/kube/test_chart.py checks the rendered chart against this).
OPERATOR_JOB = "stratamq-operator"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is not installed: `make test` installs prometheus"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_rules_load() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 18 rules found" in result.stdout


def described(name: str) -> str:
    """The description of an alert whose description has no template in it."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rule = next(rule for group in groups for rule in group["rules"] if rule["alert"] == name)
    description: str = rule["annotations"]["description"]
    assert "{{" not in description
    return description


def alert(name: str, summary: str, description: str | None = None, /,
          **labels: str) -> dict[str, Any]:
    return {"exp_labels": {"alertname": name, "severity": labels.pop("severity"), **labels},
            "exp_annotations": {"summary": summary,
                                "description": description or described(name)}}


def test_each_alert_fires_on_its_condition_only(tmp_path: Path) -> None:
    # Series one sample per minute; site-0 goes wrong in every way, site-1 stays healthy.
    series = [
        # free space: 50 GiB of 100, down to 5 GiB (5%) from minute 10, 2 GiB from 30
        (f"stratamq_ds_filesystem_size_bytes{{{SITE}}}", f"{100 * GiB}+0x60"),
        (f"stratamq_ds_filesystem_free_bytes{{{SITE}}}",
         f"{50 * GiB}+0x9 {5 * GiB}+0x19 {2 * GiB}+0x30"),
        (f"stratamq_ds_filesystem_size_bytes{{{HEALTHY}}}", f"{100 * GiB}+0x60"),
        (f"stratamq_ds_filesystem_free_bytes{{{HEALTHY}}}", f"{60 * GiB}+0x60"),
        # failed flushes from minute 20; healthy: none
        (f'stratamq_ds_buffer_batches_failed_total{{{SITE}, db="messages", shard="3"}}',
         "0+0x19 1+1x40"),
        (f'stratamq_ds_buffer_batches_failed_total{{{HEALTHY}, db="messages", shard="3"}}',
         "0+0x60"),
        # commits: every observation under 1 s on the healthy site; on site-0, from
        # minute 20 every observation takes over 1 s
        *[(f'stratamq_ds_commit_latency_seconds_bucket{{{SITE}, db="messages", '
           f'shard="0", le="{le}"}}', "0+100x19 2000+0x40")
          for le in ("0.01", "1.0")],
        (f'stratamq_ds_commit_latency_seconds_bucket{{{SITE}, db="messages", shard="0", '
         f'le="+Inf"}}', "0+100x60"),
        *[(f'stratamq_ds_commit_latency_seconds_bucket{{{HEALTHY}, db="messages", '
           f'shard="0", le="{le}"}}', "0+100x60") for le in ("0.01", "1.0", "+Inf")],
        # QoS 0 dropped on site-0 from minute 20
        (f'stratamq_messages_dropped_total{{{SITE}, reason="queue_full"}}', "0+0x19 0+7x40"),
        (f'stratamq_messages_dropped_total{{{HEALTHY}, reason="queue_full"}}', "3+0x60"),
        (f'stratamq_session_messages_expired_total{{{SITE}, reason="retention"}}',
         "0+0x19 0+5x40"),
        (f'stratamq_background_failures_total{{{SITE}, loop="renew_streams"}}',
         "0+0x19 1+0x40"),
    ]
    site = "stratamq site site-0:18083"
    at_25m = [
        alert("StratamqDiskNearlyFull", f"{site}: data disk 5% free", severity="warning",
              instance="site-0:18083", job="stratamq"),
        alert("StratamqStorageWritesFailing", f"{site}: writes to messages fail",
              severity="critical", instance="site-0:18083", db="messages"),
        alert("StratamqMessagesDropped", f"{site}: messages dropped (queue_full)",
              "35 messages were not delivered in the last 5 minutes for reason queue_full.",
              severity="warning", instance="site-0:18083", reason="queue_full"),
        alert("StratamqSessionMessagesLost",
              f"{site}: durable sessions lost messages to retention",
              "Generations were dropped before durable sessions delivered their messages "
              "(25 in 15 minutes). Lengthen retention or look for stuck clients.",
              severity="warning", instance="site-0:18083", reason="retention"),
        alert("StratamqBackgroundFailures", f"{site}: background loop renew_streams failed",
              severity="warning", instance="site-0:18083", loop="renew_streams"),
    ]
    names = ["StratamqDiskNearlyFull", "StratamqDiskFull", "StratamqStorageWritesFailing",
             "StratamqSlowCommits", "StratamqMessagesDropped", "StratamqSessionMessagesLost",
             "StratamqBackgroundFailures"]
    expected_at: dict[str, dict[str, list[dict[str, Any]]]] = {
        # minute 8: all well (disk still at 50%, nothing failed or dropped yet)
        "8m": {name: [] for name in names},
        "25m": {name: [item for item in at_25m if item["exp_labels"]["alertname"] == name]
                for name in names},
        "35m": {"StratamqDiskFull": [alert("StratamqDiskFull", f"{site}: data disk 2% free",
                                           severity="critical", instance="site-0:18083",
                                           job="stratamq")],
                "StratamqSlowCommits": [alert("StratamqSlowCommits",
                                              f"{site}: p99 PUBACK latency 1s",
                                              severity="warning", instance="site-0:18083")]},
    }
    run_promtool_test(tmp_path, series, expected_at)


def test_each_replication_alert_fires_on_its_condition_only(tmp_path: Path) -> None:
    # Two sites holding shards 1, 2, 3 of `messages`; from minute 10 things go wrong on
    # shards 1 (nobody leads it), 2 (under-replicated, lagging on site-0) and 3 (its
    # leader moves every minute). Shard 2 on site-1 stays below every threshold.
    def shard(where: str, number: int) -> str:
        return f'{where}, db="messages", shard="{number}"'

    series = [
        (f"stratamq_ds_under_replicated{{{shard(SITE, 2)}}}", "0+0x9 1+0x50"),
        # under-replicated for 4 minutes only (a replica catching up): too short
        (f"stratamq_ds_under_replicated{{{shard(HEALTHY, 2)}}}", "1+0x3 0+0x56"),
        (f"stratamq_ds_replica_lag{{{shard(SITE, 2)}}}", "0+0x9 20000+0x50"),
        (f"stratamq_ds_replica_lag{{{shard(HEALTHY, 2)}}}", "5000+0x60"),
        (f"stratamq_ds_replica_leader{{{shard(SITE, 1)}}}", "1+0x9 0+0x50"),
        (f"stratamq_ds_replica_leader{{{shard(HEALTHY, 1)}}}", "0+0x60"),
        (f"stratamq_ds_replica_leader{{{shard(SITE, 2)}}}", "0+0x60"),
        (f"stratamq_ds_replica_leader{{{shard(HEALTHY, 2)}}}", "1+0x60"),
        # each site starts or stops leading shard 3 once a minute from minute 10:
        # 30 handovers in 30 minutes; shard 2 changed leader once, long ago
        (f"stratamq_ds_leader_changes_total{{{shard(SITE, 3)}}}", "0+0x9 0+1x50"),
        (f"stratamq_ds_leader_changes_total{{{shard(HEALTHY, 3)}}}", "0+0x9 0+1x50"),
        (f"stratamq_ds_leader_changes_total{{{shard(SITE, 2)}}}", "1+0x60"),
        (f"stratamq_ds_leader_changes_total{{{shard(HEALTHY, 2)}}}", "1+0x60"),
        # site-0's leadership of shard 4 hears from no majority from minute 10 (its age
        # grows a minute a minute); site-1's leadership of shard 2 lost it for 20 s only
        (f"stratamq_ds_quorum_age_seconds{{{shard(SITE, 4)}}}", "0.2+0x9 60+60x50"),
        (f"stratamq_ds_quorum_age_seconds{{{shard(HEALTHY, 2)}}}", "0.3+0x11 20 0.3+0x47"),
        # site-0 refused a cut of shard 4 at minute 20
        (f"stratamq_ds_log_cuts_refused_total{{{shard(SITE, 4)}}}", "0+0x19 1+0x40"),
        (f"stratamq_ds_log_cuts_refused_total{{{shard(HEALTHY, 4)}}}", "0+0x60"),
        # the operator is scraped up until minute 10, then gone (its pod deleted); the
        # sites stay up, which must not hide it
        (f'up{{instance="10.0.0.9:8081", job="{OPERATOR_JOB}"}}', "1+0x9"),
        (f"up{{{SITE}}}", "1+0x60"),
    ]
    names = ["StratamqShardUnderReplicated", "StratamqReplicaLagHigh",
             "StratamqShardWithoutLeader", "StratamqFrequentLeaderChanges",
             "StratamqLeaderWithoutQuorum", "StratamqReplicaRefusedCut",
             "StratamqOperatorDown"]
    expected_at: dict[str, dict[str, list[dict[str, Any]]]] = {
        "8m": {name: [] for name in names},
        "25m": {
            "StratamqShardUnderReplicated": [alert(
                "StratamqShardUnderReplicated",
                "stratamq shard messages/2: under-replicated (leader site-0:18083)",
                severity="warning", instance="site-0:18083", job="stratamq", db="messages",
                shard="2")],
            "StratamqReplicaLagHigh": [alert(
                "StratamqReplicaLagHigh",
                "stratamq site site-0:18083: shard messages/2 20k entries behind",
                severity="warning", instance="site-0:18083", job="stratamq", db="messages",
                shard="2")],
            "StratamqShardWithoutLeader": [alert(
                "StratamqShardWithoutLeader", "stratamq shard messages/1: no leader",
                severity="critical", job="stratamq", db="messages", shard="1")],
            "StratamqLeaderWithoutQuorum": [alert(
                "StratamqLeaderWithoutQuorum",
                "stratamq shard messages/4: its leader site-0:18083 has heard from no "
                "majority for 16m 0s", severity="critical", instance="site-0:18083",
                job="stratamq", db="messages", shard="4")],
            "StratamqReplicaRefusedCut": [alert(
                "StratamqReplicaRefusedCut", "stratamq site site-0:18083: shard "
                "messages/4 refused to cut committed entries", severity="critical",
                instance="site-0:18083", db="messages", shard="4")],
            "StratamqOperatorDown": [alert(
                "StratamqOperatorDown", "stratamq operator: not running for 5 minutes",
                severity="critical")],
        },
        "45m": {"StratamqFrequentLeaderChanges": [alert(
            "StratamqFrequentLeaderChanges",
            "stratamq shard messages/3: leader changed 30 times in 30 minutes",
            severity="warning", job="stratamq", db="messages", shard="3")]},
    }
    run_promtool_test(tmp_path, series, expected_at)


def test_each_storage_alert_fires_on_its_condition_only(tmp_path: Path) -> None:
    """From the operator's metrics per storage (iot/mq goes wrong from minute 10,
    iot/ok stays well) and a site's disk filling at a steady pace."""
    operator = f'instance="10.0.0.9:8081", job="{OPERATOR_JOB}"'
    wrong = f'{operator}, namespace="iot", name="mq"'
    well = f'{operator}, namespace="iot", name="ok"'
    series = [
        (f"stratamq_operator_sites{{{wrong}}}", "3+0x60"),
        (f"stratamq_operator_sites_ready{{{wrong}}}", "3+0x9 2+0x50"),
        (f"stratamq_operator_sites{{{well}}}", "3+0x60"),
        # one site not ready for 5 minutes (a roll): too short
        (f"stratamq_operator_sites_ready{{{well}}}", "3+0x9 2+0x4 3+0x45"),
        (f'stratamq_operator_storage_phase{{{wrong}, phase="Degraded"}}', "0+0x9 1+0x50"),
        (f'stratamq_operator_storage_phase{{{well}, phase="Degraded"}}', "0+0x60"),
        (f'stratamq_operator_reconciles_total{{{operator}, result="error"}}', "0+0x9 0+1x50"),
        (f'stratamq_operator_status_refreshes_total{{{operator}, result="error"}}',
         "0+0x60"),
        # site-0's disk: 100 GiB, 45 GiB free, half a GiB less every minute (full in
        # 90 minutes); site-1's holds steady at 60 GiB free
        (f"stratamq_ds_filesystem_size_bytes{{{SITE}}}", f"{100 * GiB}+0x60"),
        (f"stratamq_ds_filesystem_free_bytes{{{SITE}}}", f"{45 * GiB}-{GiB // 2}x60"),
        (f"stratamq_ds_filesystem_size_bytes{{{HEALTHY}}}", f"{100 * GiB}+0x60"),
        (f"stratamq_ds_filesystem_free_bytes{{{HEALTHY}}}", f"{60 * GiB}+0x60"),
    ]
    names = ["StratamqSitesNotReady", "StratamqStorageDegraded",
             "StratamqOperatorReconcileErrors", "StratamqDiskFillingUp"]
    labels = {"instance": "10.0.0.9:8081", "job": OPERATOR_JOB,
              "namespace": "iot", "name": "mq"}
    expected_at: dict[str, dict[str, list[dict[str, Any]]]] = {
        "8m": {name: [] for name in names},
        # Degraded for 10 minutes: not yet
        "20m": {"StratamqStorageDegraded": []},
        "25m": {
            "StratamqSitesNotReady": [alert(
                "StratamqSitesNotReady", "stratamq storage iot/mq: only 2 sites ready",
                severity="warning", **labels)],
            "StratamqOperatorReconcileErrors": [alert(
                "StratamqOperatorReconcileErrors",
                "stratamq operator 10.0.0.9:8081: reconciles or status refreshes fail",
                "The operator has failed to apply a storage's objects or to refresh its "
                "status for 10 minutes (15 failures in the last 15). Its log names the "
                "storage and the API error (often RBAC or an admission webhook).",
                severity="warning", instance="10.0.0.9:8081", job=OPERATOR_JOB)],
            "StratamqDiskFillingUp": [],
        },
        "35m": {
            "StratamqStorageDegraded": [alert(
                "StratamqStorageDegraded", "stratamq storage iot/mq: Degraded for 15 minutes",
                severity="warning", phase="Degraded", **labels)],
            "StratamqDiskFillingUp": [alert(
                "StratamqDiskFillingUp",
                "stratamq site site-0:18083: data disk full within 4 hours at this rate",
                severity="warning", instance="site-0:18083", job="stratamq")],
        },
    }
    run_promtool_test(tmp_path, series, expected_at)


def run_promtool_test(tmp_path: Path, series: list[tuple[str, str]],
                      expected_at: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """`promtool test rules` on `series` (one sample a minute): at each time, each
    alert named fires exactly as listed."""
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": name, "values": values} for name, values in series],
            "alert_rule_test": [
                {"eval_time": at, "alertname": name, "exp_alerts": fired}
                for at, by_name in expected_at.items() for name, fired in by_name.items()],
        }],
    }
    path = tmp_path / "rules_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_keep_the_namespace_and_storage_of_their_sites(tmp_path: Path) -> None:
    """Two storages named alike in two namespaces (the operator's ServiceMonitor gives
    each site's series `namespace` and `storage`, and names its instance after its
    pod): an alert that sums over sites stays apart per storage and carries both, for
    Alertmanager to group and route by."""
    def site(namespace: str, pod: str) -> str:
        return (f'namespace="{namespace}", storage="mq", instance="{namespace}/{pod}", '
                f'job="mq", db="messages", shard="1"')

    series = [
        # shard 1 of iot/mq loses its leader at minute 10; fleet/mq keeps its
        (f"stratamq_ds_replica_leader{{{site('iot', 'mq-0')}}}", "1+0x9 0+0x50"),
        (f"stratamq_ds_replica_leader{{{site('iot', 'mq-1')}}}", "0+0x60"),
        (f"stratamq_ds_replica_leader{{{site('fleet', 'mq-0')}}}", "1+0x60"),
        (f"stratamq_ds_replica_leader{{{site('fleet', 'mq-1')}}}", "0+0x60"),
        # a flush fails on fleet's mq-1 from minute 10
        (f"stratamq_ds_buffer_batches_failed_total{{{site('fleet', 'mq-1')}}}",
         "0+0x9 1+1x50"),
    ]
    run_promtool_test(tmp_path, series, {"20m": {
        "StratamqShardWithoutLeader": [alert(
            "StratamqShardWithoutLeader", "stratamq shard messages/1: no leader",
            severity="critical", namespace="iot", storage="mq", job="mq", db="messages",
            shard="1")],
        "StratamqStorageWritesFailing": [alert(
            "StratamqStorageWritesFailing", "stratamq site fleet/mq-1: writes to messages fail",
            severity="critical", namespace="fleet", storage="mq", instance="fleet/mq-1",
            db="messages")],
    }})
