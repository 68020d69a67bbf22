"""`stratamq spark launch JOB --site URL ... --workdir DIR` (or `--site-pod POD ...`): one
scheduled run of a job,
the program the operator's Spark driver runs (`spark-submit ... spark-main.py launch
...`, or a SparkApplication's `mainApplicationFile`).

Each shard is read once: the sites are asked which shards they hold and lead, and each
shard's copy is checkpointed at its leader (else at the first site holding a replica;
sites without replication each hold their own shards, and each reads its own:
`shards_to_read`). For each site in turn: a checkpoint of its shards through its admin
API into the shared work folder (a volume every site and every Spark pod mounts at the
same path; the checkpoint's manifest stays as `checkpoint.json`), the job on that
checkpoint in this driver's SparkSession, the result applied through the same admin
API (`gc`: the plan, which goes through each shard's log to every replica; `export`
leaves its Parquet in the folder), then the checkpoint is removed (its results stay).
A site that does not answer fails the run after the others are done; its replicated
shards are read at another replica. `learn-topics` takes the checkpoints first and
learns one seed from all of them, which it then gives every site: a seed learned per
site would leave the last site's.

A site is given by its admin API's URL (`--site`) or, where cluster DNS does not
reach the sites, by its pod (`--site-pod`): the run then starts by reading each pod's IP
from the API server (`--api-server`, with the pod's service account token; a pod
without an IP fails the run before anything is read).

The admin token comes from $STRATAMQ_ADMIN_TOKEN (the storage's admin Secret). A run
writes under `DIR/RUN/site-N/`; RUN is the launching Job's name (`--run`), so a run
started twice by hand never writes over another. Its outcome goes to
`DIR/RUN/result.json`, which `stratamq spark submit` (the launching Job's command,
around spark-submit) turns into the Job's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratamq.broker.admin.ctl import TOKEN_ENV, AdminClient, CtlError
from stratamq.broker.config import parse_duration
from stratamq.broker.ds import RetentionRules
from stratamq.broker.errors import StratamqError

DATABASE = "messages"
# Where the kubelet puts a pod's own namespace (beside its service account token).
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# The outcome of a run, in its folder.
RESULT_FILE = "result.json"


@dataclass(frozen=True, slots=True)
class SiteRun:
    """What one site's part of a run left: its folder and what the site answered."""

    site: str
    folder: Path
    applied: dict[str, Any] | None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratamq spark launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", choices=["gc", "learn-topics", "export"])
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--site", action="append", metavar="URL",
                       help="a site's admin API base URL (repeatable: every site)")
    given.add_argument("--site-pod", action="append", metavar="POD",
                       help="a site's pod (repeatable: every site), reached at its pod "
                            "IP on --admin-port, read from the API server at the start")
    parser.add_argument("--admin-port", type=int, default=18083,
                        help="with --site-pod: the sites' admin port (default 18083)")
    parser.add_argument("--namespace", default="",
                        help="with --site-pod: the pods' namespace (default: this pod's)")
    parser.add_argument("--api-server", default="https://kubernetes.default.svc",
                        help="with --site-pod: the API server's address (default "
                             "https://kubernetes.default.svc)")
    parser.add_argument("--workdir", required=True,
                        help="the shared folder (same path on the sites and here)")
    parser.add_argument("--run", default="", help="this run's name (default: the time)")
    parser.add_argument("--db", default=DATABASE, help=f"the database (default {DATABASE})")
    parser.add_argument("--default", default="1d", help="gc: retention of topics no rule "
                                                        "takes (the config's "
                                                        "message_retention_period)")
    parser.add_argument("--rule", action="append", default=[], metavar="FILTER=DURATION",
                        help="gc: a retention rule (repeatable)")
    parser.add_argument("--wildcard-thresholds", default="",
                        help="learn-topics: the sites' layout.wildcard_thresholds, "
                             "comma-separated (default: the broker's)")
    parser.add_argument("--hot-share", type=float, default=None,
                        help="learn-topics: see `stratamq spark learn-topics`")
    parser.add_argument("--top", type=int, default=8, help="export: patterns in the plot")
    parser.add_argument("--master", default="",
                        help='Spark master ("" (default) keeps spark-submit\'s)')
    return parser


def rules(arguments: argparse.Namespace) -> RetentionRules:
    found = {}
    for rule in arguments.rule:
        topic_filter, equals, duration = rule.rpartition("=")
        if not equals or not topic_filter:
            raise ValueError(f"--rule {rule!r}: write FILTER=DURATION, such as sensors/#=7d")
        found[topic_filter] = parse_duration(duration)
    return RetentionRules(parse_duration(arguments.default), found)


def thresholds(arguments: argparse.Namespace) -> list[int] | None:
    text: str = arguments.wildcard_thresholds
    return [int(part) for part in text.split(",")] if text else None


def shards_to_read(views: list[tuple[str, dict[str, Any]]]) -> list[list[int]]:
    """For each site (its id and its view of the database, `GET
    /api/v1/ds/storages/DB`), the shards to checkpoint there: each shard's copy once,
    at its leader where that is one of the sites, else at the first site that holds a
    replica. A shard is one per replica set: sites without replication each hold
    their own data under the same shard ids, and each reads its own. Pure."""
    chosen: dict[tuple[int, tuple[str, ...]], int] = {}
    for index, (site, view) in enumerate(views):
        for shard in view["shards"]:
            replicas = tuple(sorted(shard["replicas"]))
            if site not in replicas:
                continue  # a shard this site holds no replica of: nothing of it to read
            key = (int(shard["id"]), replicas)
            if key not in chosen or shard["leader"] == site:
                chosen[key] = index
    return [sorted(shard_id for (shard_id, _), index in chosen.items() if index == site)
            for site in range(len(views))]


def checkpoint_plan(sites: list[AdminClient], database: str
                    ) -> tuple[list[list[int] | None], CtlError | None]:
    """Which shards each site checkpoints for this run (`shards_to_read`), asked of
    the sites; None for a site that does not answer (a replicated shard is then read
    at another of its replicas), with the first such error."""
    views, answered, failed = [], [], None
    for index, site in enumerate(sites):
        try:
            [own] = site.get("/api/v1/ds/sites")["data"]
            views.append((str(own["site"]), site.get(f"/api/v1/ds/storages/{database}")))
            answered.append(index)
        except CtlError as exc:
            failed = failed or exc
    chosen = dict(zip(answered, shards_to_read(views), strict=True))
    return [chosen.get(index) for index in range(len(sites))], failed


def admin_url(pod_ip: str, port: int) -> str:
    """A site's admin API at its pod's IP (an IPv6 address in brackets)."""
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}"


def pod_ips(pods: list[str], namespace: str, api_server: str) -> dict[str, str | None]:
    """Each pod's IP (None while it has none), read from the API server as this pod's
    service account (its token and CA, mounted by the kubelet)."""
    from kubernetes import client as kube_client
    from kubernetes import config as kube_config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    configuration = kube_client.Configuration()
    try:
        # Without the token's refresh hook, which would set the host back to
        # $KUBERNETES_SERVICE_HOST (read once: the run asks only at its start).
        kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration, try_refresh_token=False)
    except ConfigException as exc:
        raise StratamqError(f"--site-pod needs a pod's service account: {exc}") from exc
    configuration.host = api_server
    if not namespace:
        namespace = Path(SERVICE_ACCOUNT_NAMESPACE).read_text(encoding="utf-8").strip()
    found: dict[str, str | None] = {}
    with kube_client.ApiClient(configuration) as api:
        core = kube_client.CoreV1Api(api)
        for pod in pods:
            try:
                status = core.read_namespaced_pod(pod, namespace).status
                found[pod] = status.pod_ip if status else None
            except ApiException as exc:
                if exc.status != 404:
                    raise StratamqError(f"pod {namespace}/{pod}: {exc.status} "
                                        f"{exc.reason} from {api_server}") from exc
                found[pod] = None
    return found


def site_urls(arguments: argparse.Namespace) -> list[str]:
    """The sites' admin URLs: as given (`--site`), or at their pods' IPs."""
    if arguments.site:
        return list(arguments.site)
    ips = pod_ips(arguments.site_pod, arguments.namespace, arguments.api_server)
    missing = [pod for pod, ip in ips.items() if not ip]
    if missing:
        raise StratamqError(f"site pods without an IP (not scheduled or gone): "
                            f"{', '.join(missing)}")
    return [admin_url(ip, arguments.admin_port) for ip in ips.values() if ip]


def client(url: str) -> AdminClient:
    token = os.environ.get(TOKEN_ENV)
    # A checkpoint of a large database takes a while.
    return AdminClient(url, f"Bearer {token}" if token else None, timeout=600.0)


def take_checkpoint(site: AdminClient, database: str, folder: Path,
                    shards: list[int]) -> None:
    """A checkpoint of `shards` of the site's `database` in `folder/checkpoint`; its
    manifest is kept beside it (`checkpoint.json`: what the run read there)."""
    folder.mkdir(parents=True)
    made = site.post(f"/api/v1/ds/storages/{database}/checkpoints",
                     {"dir": str(folder / "checkpoint"), "shards": shards})
    (folder / "checkpoint.json").write_text(json.dumps(made["manifest"], indent=2) + "\n",
                                            encoding="utf-8")


def run_site(spark: Any, arguments: argparse.Namespace, site: AdminClient,
             folder: Path, shards: list[int]) -> dict[str, Any] | None:
    """Checkpoint `shards`, job, apply for one site (`gc`, `export`); the site's answer
    to the apply (None for export)."""
    database = urllib.parse.quote(arguments.db, safe="")
    checkpoint = folder / "checkpoint"
    take_checkpoint(site, database, folder, shards)
    try:
        if arguments.job == "gc":
            from .gc import make_plan

            plan = make_plan(spark, str(checkpoint), rules(arguments))
            (folder / "gc-plan.json").write_text(json.dumps(plan, indent=2) + "\n",
                                                 encoding="utf-8")
            answer: dict[str, Any] = site.post(f"/api/v1/ds/storages/{database}/gc-plan",
                                               plan)
            return answer
        from .export import export_usage
        from .topics import DEFAULT_THRESHOLDS

        export_usage(spark, str(checkpoint), str(folder / "usage.parquet"),
                     str(folder / "usage.png"), arguments.top,
                     thresholds(arguments) or DEFAULT_THRESHOLDS)
        return None
    finally:
        # The checkpoint holds the site's files (hard links on the site's side, or
        # copies on this volume): only the results are worth keeping.
        shutil.rmtree(checkpoint, ignore_errors=True)


def learn_topics(spark: Any, arguments: argparse.Namespace, urls: list[str],
                 run_folder: Path) -> list[SiteRun]:
    """Every site's checkpoint, one seed from all of them, the seed given to every
    site; the checkpoints are removed, `seed.json` stays in the run's folder."""
    from .topics import DEFAULT_HOT_SHARE, make_seed

    database = urllib.parse.quote(arguments.db, safe="")
    sites = [client(url) for url in urls]
    folders = [run_folder / f"site-{index}" for index in range(len(sites))]
    # each shard read once; a site with nothing to read takes no checkpoint
    plan, failed = checkpoint_plan(sites, database)
    if failed is not None:  # one seed from every site's data, or none
        raise failed
    reading = [(site, folder, shards) for site, folder, shards
               in zip(sites, folders, plan, strict=True) if shards]
    try:
        for site, folder, shards in reading:
            take_checkpoint(site, database, folder, shards)
        hot_share = (DEFAULT_HOT_SHARE if arguments.hot_share is None
                     else arguments.hot_share)
        seed = make_seed(spark, [str(folder / "checkpoint") for _, folder, _ in reading],
                         thresholds(arguments), hot_share)
    finally:
        for folder in folders:
            shutil.rmtree(folder / "checkpoint", ignore_errors=True)
    (run_folder / "seed.json").write_text(json.dumps(seed, indent=2) + "\n",
                                          encoding="utf-8")
    done = []
    for url, site, folder in zip(urls, sites, folders, strict=True):
        answer = site.put(f"/api/v1/ds/storages/{database}/topic-structure",
                          {"patterns": seed["patterns"]})
        done.append(SiteRun(site=url, folder=folder, applied=answer))
        print(f"stratamq spark launch learn-topics: seed given to {url}", file=sys.stderr)
    return done


def launch(arguments: argparse.Namespace) -> list[SiteRun]:
    """The run; its outcome is also written to `RUN/result.json` (what `stratamq spark
    submit` checks: spark-submit in cluster mode does not pass the driver's exit
    code on)."""
    from .session import spark_session

    run = arguments.run or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run_folder = Path(arguments.workdir).absolute() / run
    if run_folder.exists():  # before Spark starts (seconds), and never another run's
        raise FileExistsError(f"{run_folder} exists: give each run a name of its own")
    run_folder.mkdir(parents=True)
    done: list[SiteRun] = []
    try:
        urls = site_urls(arguments)  # before Spark starts
        spark = spark_session(f"stratamq-{arguments.job}", arguments.master or None)
        try:
            if arguments.job == "learn-topics":
                done += learn_topics(spark, arguments, urls, run_folder)
            else:
                sites = [client(url) for url in urls]
                database = urllib.parse.quote(arguments.db, safe="")
                # each shard read once, at one site; the sites that answer are done
                # before the run fails for one that does not
                plan, failed = checkpoint_plan(sites, database)
                for index, (url, site, shards) in enumerate(
                        zip(urls, sites, plan, strict=True)):
                    if not shards:
                        continue
                    folder = run_folder / f"site-{index}"
                    answer = run_site(spark, arguments, site, folder, shards)
                    done.append(SiteRun(site=url, folder=folder, applied=answer))
                    print(f"stratamq spark launch {arguments.job}: {url} done in {folder}",
                          file=sys.stderr)
                if failed is not None:
                    raise failed
        finally:
            spark.stop()
    except BaseException as exc:
        write_result(run_folder, "Failed", done, f"{type(exc).__name__}: {exc}")
        raise
    write_result(run_folder, "Succeeded", done, "")
    return done


def write_result(run_folder: Path, result: str, done: list[SiteRun], message: str) -> None:
    sites = [{"site": run.site, "folder": str(run.folder), "applied": run.applied}
             for run in done]
    (run_folder / RESULT_FILE).write_text(json.dumps(
        {"result": result, "message": message, "sites_done": sites}, indent=2) + "\n",
        encoding="utf-8")


def launch_main(argv: list[str]) -> int:
    """Returns the exit code: 0 done, 1 failed (a site's part failed: the runs of the
    sites before it stand), 2 bad usage."""
    try:
        arguments = parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        launch(arguments)
    except (CtlError, StratamqError, ValueError, OSError) as exc:
        print(f"stratamq spark launch {arguments.job}: {exc}", file=sys.stderr)
        return 1
    return 0


def run_forwarding_sigterm(command: list[str]) -> int:
    """Run `command`, passing a SIGTERM on to it; its exit code. The Job's pod is
    stopped with SIGTERM (its deadline, a deletion): spark-submit's driver then stops
    its executors itself. (As the pod's first process, this one would otherwise
    ignore the signal until the kubelet's SIGKILL.)"""
    child = subprocess.Popen(command)
    before = signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    try:
        code = child.wait()
        return 128 - code if code < 0 else code  # killed by a signal: as a shell says
    finally:
        signal.signal(signal.SIGTERM, before)


def submit_main(argv: list[str]) -> int:
    """`stratamq spark submit --result FILE -- spark-submit ...`: run spark-submit, then
    fail unless it exited 0 and the run's result file says Succeeded. In client mode
    (the operator's Jobs) spark-submit exits with the driver's code; in Kubernetes
    cluster mode it exits 0 whatever the driver did (Spark 4.x). Either way the file
    the driver writes (`launch`) says why a run failed, so the launching Job's own
    outcome and message (status.spark) come from both."""
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            _submit_parser().print_help()
            return 0
        print("usage: stratamq spark submit --result FILE -- spark-submit ...",
              file=sys.stderr)
        return 2
    own, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    try:
        arguments = _submit_parser().parse_args(own)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    if not command:
        print("stratamq spark submit: no command after --", file=sys.stderr)
        return 2
    code = run_forwarding_sigterm(command)  # its output is the pod's log
    try:
        result = json.loads(Path(arguments.result).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        result = {"result": None, "message": f"the driver left no result ({exc}): it "
                                             f"stopped before the end; see its log"}
    failed = result.get("result") != "Succeeded"
    if code != 0:  # the last line of the log: the Job's message (FallbackToLogsOnError)
        why = f": {result.get('message')}" if failed and result.get("message") else ""
        print(f"stratamq spark submit: {command[0]} exited with {code}{why}",
              file=sys.stderr)
        return code
    if result.get("result") is None:
        print(f"stratamq spark submit: {result['message']}", file=sys.stderr)
        return 1
    if failed:
        print(f"stratamq spark submit: the run failed: {result.get('message')}",
              file=sys.stderr)
        return 1
    return 0


def _submit_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stratamq spark submit", usage="%(prog)s [-h] --result FILE -- spark-submit ...",
        description="Run spark-submit (the command after --), then exit non-zero unless it "
                    "succeeded and the run's result file says Succeeded.")
    parser.add_argument("--result", required=True, metavar="FILE",
                        help="the run's result.json, which `stratamq spark launch` writes")
    return parser
