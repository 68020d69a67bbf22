"""`stratamq ctl clients`, `stratamq ctl ds info`, `stratamq ctl ds checkpoint DB DIR`,
`stratamq ctl ds apply-gc PLAN` and `stratamq ctl ds seed-topics DB FILE`: call the
admin API of a running site over HTTP and print readable tables. `stratamq ctl ds
set-replicas DB SITE...`, `ds join DB SITE`, `ds leave DB SITE` and `ds forget SITE`
call the cluster controller (default URL and token file: those of `stratamq
cluster`); `ds info` against the controller shows the whole cluster. `ds verify
[DB...]` asks the controller where the replicas are and compares the digests of
every shard's replicas (exit status 1 when any differ).

Credentials, first found wins: `--token`, `--user NAME[:PASSWORD]`, the environment
variable STRATAMQ_ADMIN_TOKEN, the token file (`--token-file`, default
`data/admin-token`, where a site that has no configured credentials keeps its
generated token)."""

from __future__ import annotations

import argparse
import base64
import getpass
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:18083"
DEFAULT_TOKEN_FILE = "data/admin-token"
# `stratamq cluster` with its defaults: the controller's API and the shared token.
CONTROLLER_URL = "http://127.0.0.1:18090"
CLUSTER_TOKEN_FILE = "data/cluster/admin-token"
CLUSTER_ACTIONS = {"set-replicas", "join", "leave", "forget"}
# actions that talk to the controller by default
CONTROLLER_ACTIONS = {*CLUSTER_ACTIONS, "verify"}
TOKEN_ENV = "STRATAMQ_ADMIN_TOKEN"


class CtlError(Exception):
    """A failure to report in one line (exit code 1)."""


class CheckFailedError(CtlError):
    """A check that ran and found something wrong: its whole output is printed, and
    the exit code is 1."""

    def __init__(self, output: str) -> None:
        super().__init__("the check failed")
        self.output = output


# -- HTTP ------------------------------------------------------------------------------

class AdminClient:
    def __init__(self, url: str, authorization: str | None, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.authorization = authorization
        self.timeout = timeout

    def get(self, path: str) -> Any:
        return self._call(path, None)

    def post(self, path: str, body: Any) -> Any:
        return self._call(path, json.dumps(body).encode("utf-8"), "POST")

    def put(self, path: str, body: Any) -> Any:
        return self._call(path, json.dumps(body).encode("utf-8"), "PUT")

    def delete(self, path: str) -> Any:
        return self._call(path, None, "DELETE")

    def _call(self, path: str, body: bytes | None, method: str = "GET") -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=body, headers=headers,
                                         method=method)
        if self.authorization is not None:
            request.add_header("Authorization", self.authorization)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            raise CtlError(_http_error(exc, self.url + path, self.authorization)) from exc
        except urllib.error.URLError as exc:
            raise CtlError(f"cannot reach the admin API at {self.url}: {exc.reason} (is the "
                           f"broker running, and is --url its admin.bind?)") from exc
        except (TimeoutError, OSError) as exc:
            raise CtlError(f"cannot reach the admin API at {self.url}: {exc}") from exc
        except ValueError as exc:
            raise CtlError(f"{self.url + path}: the answer is not JSON: {exc}") from exc


def _http_error(exc: urllib.error.HTTPError, url: str, authorization: str | None) -> str:
    try:
        message = str(json.load(exc).get("message", ""))
    except (ValueError, AttributeError, OSError):
        message = ""
    if exc.code == 401:
        given = "were refused" if authorization else "are missing"
        return (f"{url}: 401 Unauthorized: credentials {given}. Give --token, set "
                f"{TOKEN_ENV}, or run where the site's data/admin-token is readable "
                f"(--token-file)")
    return f"{url}: {exc.code} {exc.reason}" + (f": {message}" if message else "")


def authorization(arguments: argparse.Namespace) -> str | None:
    if arguments.token:
        return f"Bearer {arguments.token}"
    if arguments.user:
        username, colon, password = arguments.user.partition(":")
        if not colon:
            password = getpass.getpass(f"admin password for {username}: ")
        pair = f"{username}:{password}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")
    token = os.environ.get(TOKEN_ENV)
    if token:
        return f"Bearer {token}"
    try:
        token = Path(arguments.token_file).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CtlError(f"cannot read the token file {arguments.token_file}: {exc}") from exc
    return f"Bearer {token}" if token else None


# -- formatting ------------------------------------------------------------------------

def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in row]
                                         for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths,
                                                                        strict=True)).rstrip()
                     for row in cells)


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def microseconds(value: int | None) -> str:
    if value is None:
        return "-"
    moment = datetime.fromtimestamp(value / 1_000_000, UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def format_clients(clients: list[dict[str, Any]]) -> str:
    if not clients:
        return "no connected clients"
    return table(
        ["CLIENT ID", "USERNAME", "PEER", "LISTENER", "MQTT", "KEEPALIVE", "CONNECTED AT",
         "DURABLE", "EXPIRY", "SUBS", "IN-FLIGHT", "QUEUED"],
        [[c["client_id"], c["username"] or "-", c["peer"], c["listener"],
          c["protocol_version"], c["keepalive"], c["connected_at"],
          "yes" if c["durable"] else "no", c["expiry_interval"], c["subscriptions"],
          c["in_flight"], c["queued"]] for c in clients])


def format_ds_info(sites: list[dict[str, Any]], storages: list[dict[str, Any]]) -> str:
    """The shape of `emqx ctl ds info`: sites, shards with replicas, then (beyond
    EMQX) the generations of each shard."""
    lines = ["SITES:", table(["Site", "Status", "Shards"],
                             [[s["site"], "up" if s["up"] else "down", len(s["shards"])]
                              for s in sites]), ""]
    lines += ["DATABASES:", table(
        ["Database", "Shards", "Layout", "Disk"],
        [[db["name"], db["n_shards"], db["layout"], human_bytes(db["disk_bytes"])]
         for db in storages]), ""]
    shard_rows = []
    generation_rows = []
    for db in storages:
        for shard in db["shards"]:
            name = f"{db['name']}/{shard['id']}"
            shard_rows.append([name, ",".join(shard["replicas"]), shard["leader"],
                               len(shard["generations"]), human_bytes(shard["disk_bytes"])])
            generation_rows += [[name, g["id"], g["layout"], microseconds(g["created_at"]),
                                 microseconds(g["since"]),
                                 "current" if g["until"] is None else microseconds(g["until"])]
                                for g in shard["generations"]]
    lines += ["SHARDS:", table(["Shard", "Replicas", "Leader", "Generations", "Disk"],
                               shard_rows), ""]
    lines += ["GENERATIONS:", table(["Shard", "Generation", "Layout", "Created", "Since",
                                     "Until"], generation_rows)]
    return "\n".join(lines)


def format_cluster_info(sites: list[dict[str, Any]], storages: list[dict[str, Any]]) -> str:
    """The cluster as its controller sees it: sites (with their zones), then per
    database every shard's replicas, leader, epoch, committed offset, lag per replica
    and pending steps."""
    lines = ["SITES:", table(
        ["Site", "Status", "Zone", "Admin", "Peer", "Placement", "Leads", "Shards"],
        [[s["site"], "up" if s["up"] else "down", s.get("zone") or "-", s["admin_url"],
          s["peer"] or "-", "-" if s["placement_version"] is None else s["placement_version"],
          sum(1 for shard in s["shards"] if shard["role"] == "leader"), len(s["shards"])]
         for s in sites])]
    for db in storages:
        lines += ["", f"STORAGE {db['name']}: placement version {db['placement_version']}, "
                      f"replication factor {db['replication_factor']}, sites "
                      f"{','.join(db['sites']) or '-'}"]
        rows = [[f"{db['name']}/{shard['id']}", ",".join(shard["replicas"]), shard["leader"],
                 shard["epoch"], "-" if shard["committed"] is None else shard["committed"],
                 ",".join("-" if shard["lag"].get(site) is None else str(shard["lag"][site])
                          for site in shard["replicas"]),
                 " ".join(shard["transitions"]) or "-"] for shard in db["shards"]]
        lines.append(table(["Shard", "Replicas", "Leader", "Epoch", "Committed",
                            "Lag (per replica)", "Transitions"], rows))
        if db["plan"]:
            lines += ["", f"PLAN ({len(db['plan'])} steps left):",
                      *(f"  {step}" for step in db["plan"])]
    return "\n".join(lines)


def _ds_replicas(client: AdminClient, arguments: argparse.Namespace) -> str:
    """set-replicas / join / leave / forget: ask the controller, show its answer."""
    given, action = arguments.arguments, arguments.action
    if action == "forget":
        if len(given) != 1:
            raise CtlError("usage: stratamq ctl ds forget SITE")
        answer = client.delete("/api/v1/ds/sites/" + urllib.parse.quote(given[0], safe=""))
        return json.dumps(answer, indent=2) if arguments.json else f"site {given[0]} forgotten"
    if action == "set-replicas":
        if len(given) < 2:
            raise CtlError("usage: stratamq ctl ds set-replicas DB SITE...")
        path = f"/api/v1/ds/storages/{urllib.parse.quote(given[0], safe='')}/replicas"
        answer = client.put(path, given[1:])
    else:
        if len(given) != 2:
            raise CtlError(f"usage: stratamq ctl ds {action} DB SITE")
        path = (f"/api/v1/ds/storages/{urllib.parse.quote(given[0], safe='')}/replicas/"
                f"{urllib.parse.quote(given[1], safe='')}")
        answer = client.put(path, None) if action == "join" else client.delete(path)
    if arguments.json:
        return json.dumps(answer, indent=2)
    steps = answer["plan"]
    return "\n".join([f"{answer['name']}: sites {','.join(answer['sites'])}; "
                      + (f"{len(steps)} steps planned:" if steps else "nothing to move"),
                      *(f"  {step}" for step in steps)])


# -- commands --------------------------------------------------------------------------

# `ctl ds` actions: their arguments ((name, argparse nargs), in order) and what they
# do. Each is a subcommand with a help of its own.
DS_ACTIONS: dict[str, tuple[tuple[tuple[str, str | None], ...], str]] = {
    "info": ((), "sites, databases, shards and generations (of a site; of the whole "
                 "cluster when --url is the controller)"),
    "checkpoint": ((("DB", None), ("DIR", None)),
                   "a checkpoint of database DB in the new folder DIR on the site's "
                   "machine (what the Spark jobs read)"),
    "apply-gc": ((("PLAN", None),), "apply a GC plan file of `stratamq spark gc`"),
    "seed-topics": ((("DB", None), ("FILE", None)),
                    "seed the next generation's topic structure with a file of "
                    "`stratamq spark learn-topics`"),
    "verify": ((("DB", "*"),), "compare the content digests of every shard's replicas, of "
                               "every database or of those named (through the "
                               "controller); exit status 1 when any differ"),
    "set-replicas": ((("DB", None), ("SITE", "+")),
                     "move database DB onto exactly these sites (the controller)"),
    "join": ((("DB", None), ("SITE", None)),
             "add SITE to the sites of database DB (the controller)"),
    "leave": ((("DB", None), ("SITE", None)), "drain SITE of database DB (the controller)"),
    "forget": ((("SITE", None),), "drop a site that is down and holds nothing (the "
                                  "controller)"),
}


def _common_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The connection options, on `ctl CMD` and again on each `ctl ds ACTION`, so they
    may come before or after the action. On the actions their defaults are
    suppressed, so that an option given before the action is not reset after it."""
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    parser.add_argument("--url", help=f"admin API base URL (default {DEFAULT_URL}; for the "
                                      f"cluster actions the controller, {CONTROLLER_URL})",
                        **default)
    parser.add_argument("--token", help=f"admin API token (else ${TOKEN_ENV} or the token file)",
                        **default)
    parser.add_argument("--user", metavar="NAME[:PASSWORD]",
                        help="HTTP basic credentials (the password is asked for when left out)",
                        **default)
    parser.add_argument("--token-file",
                        help=f"file holding a generated token (default {DEFAULT_TOKEN_FILE}; "
                             f"for the cluster actions {CLUSTER_TOKEN_FILE})", **default)
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead",
                        **default)


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"stratamq ctl {command}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _common_options(parser, suppress=False)
    if command == "clients":
        parser.add_argument("action", nargs="?", choices=["list", "show"], default="list",
                            help="list (default): every connected client; show: one")
        parser.add_argument("client_id", nargs="?", help="the client of `show`")
        return parser
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION",
                                    title="actions (`stratamq ctl ds ACTION --help`)")
    for name, (positionals, summary) in DS_ACTIONS.items():
        action = actions.add_parser(name, help=summary, description=summary)
        _common_options(action, suppress=True)
        for number, (metavar, nargs) in enumerate(positionals):
            action.add_argument(f"positional_{number}", metavar=metavar, nargs=nargs)
        if name == "verify":
            action.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                                help="how long a replica that lags may take to reach the "
                                     "offset of the others (default 10)")
    return parser


def _positionals(arguments: argparse.Namespace) -> list[str]:
    """A `ds` action's arguments, in order, as one list."""
    found: list[str] = []
    for number in range(len(DS_ACTIONS[arguments.action][0])):
        value = getattr(arguments, f"positional_{number}")
        found += value if isinstance(value, list) else [value]
    return found


def _clients(client: AdminClient, arguments: argparse.Namespace) -> str:
    if arguments.action == "show":
        if not arguments.client_id:
            raise CtlError("`clients show` needs a client id")
        found = client.get("/api/v1/clients/" + urllib.parse.quote(arguments.client_id,
                                                                    safe=""))
        if arguments.json:
            return json.dumps(found, indent=2)
        return "\n".join(f"{key}: {value}" for key, value in found.items())
    clients = client.get("/api/v1/clients")["data"]
    return json.dumps(clients, indent=2) if arguments.json else format_clients(clients)


def _ds_info(client: AdminClient, arguments: argparse.Namespace) -> str:
    sites = client.get("/api/v1/ds/sites")["data"]
    names = [db["name"] for db in client.get("/api/v1/ds/storages")["data"]]
    storages = [client.get("/api/v1/ds/storages/" + urllib.parse.quote(name, safe=""))
                for name in names]
    if arguments.json:
        return json.dumps({"sites": sites, "storages": storages}, indent=2)
    if all("placement_version" in storage for storage in storages):
        return format_cluster_info(sites, storages)
    return format_ds_info(sites, storages)


def _ds_checkpoint(client: AdminClient, arguments: argparse.Namespace) -> str:
    if len(arguments.arguments) != 2:
        raise CtlError("usage: stratamq ctl ds checkpoint DB DIR")
    db, folder = arguments.arguments
    # relative to where ctl runs, which is where a user typing a path means it
    answer = client.post(f"/api/v1/ds/storages/{urllib.parse.quote(db, safe='')}/checkpoints",
                         {"dir": os.path.abspath(folder)})
    if arguments.json:
        return json.dumps(answer, indent=2)
    manifest = answer["manifest"]
    rows = [[f"{db}/{shard['id']}", g["id"], g["layout"], microseconds(g["since"]),
             "current" if g["until"] is None else microseconds(g["until"]),
             human_bytes(g["bytes"])]
            for shard in manifest["shards"] for g in shard["generations"]]
    return "\n".join([f"checkpoint of {db} (site {manifest['site']}) in {answer['dir']}",
                      table(["Shard", "Generation", "Layout", "Since", "Until", "Size"], rows)])


def _ds_apply_gc(client: AdminClient, arguments: argparse.Namespace) -> str:
    if len(arguments.arguments) != 1:
        raise CtlError("usage: stratamq ctl ds apply-gc PLAN")
    try:
        plan = json.loads(Path(arguments.arguments[0]).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CtlError(f"cannot read the plan {arguments.arguments[0]}: {exc}") from exc
    if not isinstance(plan, dict) or not isinstance(plan.get("db"), str):
        raise CtlError(f"{arguments.arguments[0]} is not a GC plan (no db)")
    db = plan["db"]
    report = client.post(f"/api/v1/ds/storages/{urllib.parse.quote(db, safe='')}/gc-plan", plan)
    if arguments.json:
        return json.dumps(report, indent=2)
    rows = [[f"{db}/{g['shard']}", g["generation"], g["action"], g["status"],
             g["deleted_messages"], human_bytes(g["bytes_freed"]), g.get("reason", "")]
            for g in report["generations"]]
    return "\n".join([
        table(["Shard", "Generation", "Action", "Status", "Deleted", "Freed", "Reason"], rows),
        f"{report['deleted_messages']} messages deleted, "
        f"{human_bytes(report['bytes_freed'])} freed"])


def _ds_seed_topics(client: AdminClient, arguments: argparse.Namespace) -> str:
    if len(arguments.arguments) != 2:
        raise CtlError("usage: stratamq ctl ds seed-topics DB FILE")
    db, path = arguments.arguments
    try:
        seed = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CtlError(f"cannot read the seed {path}: {exc}") from exc
    patterns = seed.get("patterns") if isinstance(seed, dict) else None
    if not isinstance(patterns, list):
        raise CtlError(f"{path} is not a topic seed (no patterns)")
    answer = client.put(f"/api/v1/ds/storages/{urllib.parse.quote(db, safe='')}"
                        "/topic-structure", {"patterns": patterns})
    if arguments.json:
        return json.dumps(answer, indent=2)
    return f"{answer['patterns']} stream patterns seeded into {db}: {answer['applies_to']}"


def _ds_verify(client: AdminClient, arguments: argparse.Namespace) -> str:
    from .verify import report, verify  # verify.py uses this module's client

    output, same = report(verify(client, arguments.arguments, arguments.wait),
                          arguments.json)
    if not same:
        raise CheckFailedError(output)
    return output


def _ds(client: AdminClient, arguments: argparse.Namespace) -> str:
    if arguments.action == "verify":
        return _ds_verify(client, arguments)
    if arguments.action in CLUSTER_ACTIONS:
        return _ds_replicas(client, arguments)
    if arguments.action == "seed-topics":
        return _ds_seed_topics(client, arguments)
    if arguments.action == "checkpoint":
        return _ds_checkpoint(client, arguments)
    if arguments.action == "apply-gc":
        return _ds_apply_gc(client, arguments)
    if arguments.arguments:
        raise CtlError(f"`ds {arguments.action}` takes no arguments")
    return _ds_info(client, arguments)


def ctl_main(command: str, argv: list[str]) -> int:
    """`stratamq ctl clients|ds ...`. Returns the exit code: 0 done, 1 failed,
    2 bad usage."""
    try:
        arguments = _parser(command).parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2, message printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    if command == "ds":
        arguments.arguments = _positionals(arguments)
    cluster = command == "ds" and arguments.action in CONTROLLER_ACTIONS
    if arguments.url is None:
        arguments.url = CONTROLLER_URL if cluster else DEFAULT_URL
    if arguments.token_file is None:
        arguments.token_file = CLUSTER_TOKEN_FILE if cluster else DEFAULT_TOKEN_FILE
    try:
        client = AdminClient(arguments.url, authorization(arguments))
        output = _clients(client, arguments) if command == "clients" \
            else _ds(client, arguments)
    except CheckFailedError as exc:
        print(exc.output)
        return 1
    except CtlError as exc:
        print(f"stratamq ctl {command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1
    print(output)
    return 0
