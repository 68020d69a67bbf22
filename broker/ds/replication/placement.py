"""Placement: where every shard of every database lives (docs/replication.md).

For each (database, shard): the replica set (site ids), the leader and the leader
epoch; the whole-cluster document carries a version number so that sites keep the
newest one they have seen. Everything here is immutable and free of I/O: the
controller, the Kubernetes operator and the sites share it.

The JSON form is the document the controller pushes and sites keep on disk: one
line per shard, so that a person can read and diff it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ...errors import LastReplicaError, PlacementError

# The JSON document's own format; a later incompatible change bumps it so that an
# older site refuses a document it would misread instead of guessing.
FORMAT = 1

# Site ids are 16 hex digits when a site makes its own (`site_id.py`), but tests and
# tools may name sites; the limit is the ReplicaTransition CRD's.
_SITE_ID = re.compile(r"[!-~]{1,128}")  # printable ASCII, no spaces
_DATABASE = re.compile(r"[a-z][a-z0-9_]{0,63}")

ShardId = tuple[str, int]
"""(database, shard number)."""


def check_site_id(site: object, where: str = "site") -> str:
    """`site` if it is a valid site id, else a `PlacementError` naming `where`."""
    if not isinstance(site, str) or not _SITE_ID.fullmatch(site):
        raise PlacementError(f"{where}: {site!r} is not a site id (1 to 128 printable "
                             f"ASCII characters, no spaces)")
    return site


def check_database(name: object, where: str = "database") -> str:
    if not isinstance(name, str) or not _DATABASE.fullmatch(name):
        raise PlacementError(f"{where}: {name!r} is not a database name (a lower-case "
                             f"letter, then up to 63 lower-case letters, digits or _)")
    return name


def _check_count(value: object, where: str) -> int:
    # bool is an int in Python; `true` in a document is a mistake, not the number 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlacementError(f"{where}: {value!r} is not a whole number >= 0")
    return value


@dataclass(frozen=True)
class ShardPlacement:
    """One shard's replica set (sorted site ids), its leader and the leader's epoch.
    The epoch grows whenever the leader changes, so a site can refuse appends from
    a leader that has been replaced."""

    database: str
    shard: int
    replicas: tuple[str, ...]
    leader: str
    epoch: int

    def __post_init__(self) -> None:
        name = f"{self.database}/{self.shard}"
        check_database(self.database, f"{name}: database")
        _check_count(self.shard, f"{name}: shard")
        _check_count(self.epoch, f"{name}: epoch")
        if not isinstance(self.replicas, tuple):
            raise PlacementError(f"{name}: replicas must be a tuple of site ids, not "
                                 f"{type(self.replicas).__name__}")
        if not self.replicas:
            raise PlacementError(f"{name}: the replica set is empty")
        for site in self.replicas:
            check_site_id(site, f"{name}: replica")
        if len(set(self.replicas)) != len(self.replicas):
            raise PlacementError(f"{name}: a site appears twice in the replica set "
                                 f"{list(self.replicas)}")
        if list(self.replicas) != sorted(self.replicas):
            # One spelling per set, so that equal placements compare and serialize equal.
            object.__setattr__(self, "replicas", tuple(sorted(self.replicas)))
        if self.leader not in self.replicas:
            raise PlacementError(f"{name}: the leader {self.leader!r} is not one of its "
                                 f"replicas {list(self.replicas)}")

    @property
    def id(self) -> ShardId:
        return (self.database, self.shard)

    def __str__(self) -> str:
        others = ", ".join(site for site in self.replicas if site != self.leader)
        return (f"{self.database}/{self.shard}: leader {self.leader} (epoch {self.epoch})"
                + (f", followers {others}" if others else ""))


@dataclass(frozen=True)
class Transition:
    """One step of a replica-set change: `+site` (the site bootstraps from a checkpoint
    of the leader, catches up, then joins) or `-site` (it leaves). A `-site` of the
    shard's leader names the `leader` that takes over; any other step has none."""

    database: str
    shard: int
    action: Literal["add", "remove"]
    site: str
    leader: str | None = None

    def __post_init__(self) -> None:
        check_database(self.database, "transition: database")
        _check_count(self.shard, "transition: shard")
        check_site_id(self.site, "transition: site")
        if self.action not in ("add", "remove"):
            raise PlacementError(f"transition: action {self.action!r} is not add or remove")
        if self.leader is not None:
            check_site_id(self.leader, "transition: leader")
            if self.action == "add" or self.leader == self.site:
                raise PlacementError(f"transition {self}: only a removal names a new "
                                     f"leader, and not the site that leaves")

    @property
    def shard_id(self) -> ShardId:
        return (self.database, self.shard)

    def apply_to(self, shard: ShardPlacement, above: int = 0) -> ShardPlacement:
        """`shard` after this step (see `apply_transition`); a new epoch goes above
        `above` too."""
        replicas = set(shard.replicas)
        leader, epoch = shard.leader, shard.epoch
        if self.action == "add":
            if self.site in replicas:
                raise PlacementError(f"{self}: {self.site} already holds "
                                     f"{shard.database}/{shard.shard}")
            replicas.add(self.site)
        else:
            if self.site not in replicas:
                raise PlacementError(f"{self}: {self.site} holds no replica of "
                                     f"{shard.database}/{shard.shard}")
            if replicas == {self.site}:
                raise LastReplicaError(f"{self}: {self.site} holds the last replica of "
                                       f"{shard.database}/{shard.shard}")
            replicas.discard(self.site)
            if self.site == leader:
                if self.leader is None:
                    raise PlacementError(f"{self}: {self.site} is the leader; the step "
                                         f"must name the replica that takes over")
                if self.leader not in replicas:
                    raise PlacementError(f"{self}: the new leader {self.leader} is not one "
                                         f"of the remaining replicas {sorted(replicas)}")
                leader, epoch = self.leader, max(epoch, above) + 1
            elif self.leader is not None:
                raise PlacementError(f"{self}: {self.site} is not the leader ({leader}), "
                                     f"so the step cannot hand leadership over")
        return replace(shard, replicas=tuple(sorted(replicas)), leader=leader, epoch=epoch)

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"database": self.database, "shard": self.shard,
                                 "action": self.action, "site": self.site}
        if self.leader is not None:
            entry["leader"] = self.leader
        return entry

    @classmethod
    def from_dict(cls, entry: object, where: str = "transition") -> Transition:
        mapping = _mapping(entry, where)
        optional = {"leader"} & mapping.keys()
        _only_keys(mapping, where, required={"database", "shard", "action", "site"} | optional)
        database = check_database(mapping["database"], f"{where}.database")
        shard = _check_count(mapping["shard"], f"{where}.shard")
        site = check_site_id(mapping["site"], f"{where}.site")
        leader = mapping.get("leader")
        if leader is not None:
            check_site_id(leader, f"{where}.leader")
        try:
            return cls(database=database, shard=shard, action=mapping["action"], site=site,
                       leader=leader)
        except PlacementError as exc:
            raise PlacementError(f"{where}: {exc.message}") from exc

    def __str__(self) -> str:
        sign = "+" if self.action == "add" else "-"
        handover = f" (leader -> {self.leader})" if self.leader is not None else ""
        return f"{self.database}/{self.shard}: {sign}{self.site}{handover}"


@dataclass(frozen=True)
class Placement:
    """Every shard of every database, with the document's version. Shards are kept in
    (database, shard) order and each database's shards are numbered 0..n_shards-1."""

    version: int
    shards: tuple[ShardPlacement, ...]
    _index: dict[ShardId, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_count(self.version, "placement: version")
        if not isinstance(self.shards, tuple):
            raise PlacementError("placement: shards must be a tuple of ShardPlacement")
        shards = tuple(sorted(self.shards, key=lambda shard: shard.id))
        index: dict[ShardId, int] = {}
        for position, shard in enumerate(shards):
            if shard.id in index:
                raise PlacementError(f"placement: {shard.database}/{shard.shard} appears twice")
            index[shard.id] = position
        for database in {shard.database for shard in shards}:
            numbers = [shard.shard for shard in shards if shard.database == database]
            if numbers != list(range(len(numbers))):
                missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
                raise PlacementError(f"placement: database {database} has shards "
                                     f"{numbers[0]}..{numbers[-1]} but not {missing}: "
                                     f"shards are numbered from 0 without gaps")
        object.__setattr__(self, "shards", shards)
        object.__setattr__(self, "_index", index)

    @classmethod
    def empty(cls) -> Placement:
        """The placement of a cluster that has no database yet (version 0)."""
        return cls(version=0, shards=())

    def databases(self) -> tuple[str, ...]:
        return tuple(sorted({shard.database for shard in self.shards}))

    def n_shards(self, database: str) -> int:
        """Shards of `database`; 0 if the placement has no such database."""
        return sum(1 for shard in self.shards if shard.database == database)

    def shards_of(self, database: str) -> tuple[ShardPlacement, ...]:
        return tuple(shard for shard in self.shards if shard.database == database)

    def shard(self, database: str, shard: int) -> ShardPlacement:
        position = self._index.get((database, shard))
        if position is None:
            raise PlacementError(f"placement version {self.version} has no shard "
                                 f"{database}/{shard}")
        return self.shards[position]

    def sites(self) -> frozenset[str]:
        """Every site that holds a replica of something."""
        return frozenset(site for shard in self.shards for site in shard.replicas)

    def replace_shards(self, shards: Iterable[ShardPlacement]) -> Placement:
        """This placement, one version newer, with `shards` in place of the ones with
        the same (database, shard) and any others added."""
        by_id = {shard.id: shard for shard in self.shards}
        by_id.update((shard.id, shard) for shard in shards)
        return Placement(version=self.version + 1, shards=tuple(by_id.values()))

    def __iter__(self) -> Iterator[ShardPlacement]:
        return iter(self.shards)

    # --- JSON ------------------------------------------------------------------------

    def to_json(self) -> str:
        """The readable document: one line per shard, databases in name order."""
        lines = ["{", f'  "format": {FORMAT},', f'  "version": {self.version},']
        databases = self.databases()
        if not databases:
            lines.append('  "databases": {}')
        else:
            lines.append('  "databases": {')
            for number, database in enumerate(databases):
                lines.append(f"    {json.dumps(database)}: [")
                shards = self.shards_of(database)
                for position, shard in enumerate(shards):
                    entry = json.dumps({"shard": shard.shard, "replicas": list(shard.replicas),
                                        "leader": shard.leader, "epoch": shard.epoch})
                    lines.append(f"      {entry}" + ("," if position < len(shards) - 1 else ""))
                lines.append("    ]" + ("," if number < len(databases) - 1 else ""))
            lines.append("  }")
        lines.append("}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Placement:
        """Parse and check a document; every problem is a `PlacementError` that says
        where in the document it is."""
        try:
            document = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PlacementError(f"placement: not JSON: {exc}") from exc
        return cls.from_dict(document)

    @classmethod
    def from_dict(cls, document: object) -> Placement:
        mapping = _mapping(document, "placement")
        _only_keys(mapping, "placement", required={"format", "version", "databases"})
        if mapping["format"] != FORMAT or isinstance(mapping["format"], bool):
            raise PlacementError(f"placement: format {mapping['format']!r} is not "
                                 f"{FORMAT}, the one this site reads")
        version = _check_count(mapping["version"], "placement: version")
        databases = _mapping(mapping["databases"], "placement: databases")
        shards: list[ShardPlacement] = []
        for database, entries in databases.items():
            check_database(database, "placement: databases")
            where = f"placement: databases.{database}"
            if not isinstance(entries, list):
                raise PlacementError(f"{where}: expected a list of shards, got "
                                     f"{type(entries).__name__}")
            for position, entry in enumerate(entries):
                shards.append(_shard_from_dict(database, entry, f"{where}[{position}]"))
        return cls(version=version, shards=tuple(shards))


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise PlacementError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _only_keys(mapping: Mapping[str, Any], where: str, required: set[str]) -> None:
    missing = sorted(required - mapping.keys())
    if missing:
        raise PlacementError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(mapping.keys() - required)
    if unknown:
        raise PlacementError(f"{where}: unknown key(s) {', '.join(unknown)}")


def _shard_from_dict(database: str, entry: object, where: str) -> ShardPlacement:
    mapping = _mapping(entry, where)
    _only_keys(mapping, where, required={"shard", "replicas", "leader", "epoch"})
    replicas = mapping["replicas"]
    if not isinstance(replicas, list):
        raise PlacementError(f"{where}.replicas: expected a list of site ids, got "
                             f"{type(replicas).__name__}")
    for site in replicas:
        check_site_id(site, f"{where}.replicas")
    check_site_id(mapping["leader"], f"{where}.leader")
    shard = _check_count(mapping["shard"], f"{where}.shard")
    epoch = _check_count(mapping["epoch"], f"{where}.epoch")
    try:
        return ShardPlacement(database=database, shard=shard, replicas=tuple(replicas),
                              leader=mapping["leader"], epoch=epoch)
    except PlacementError as exc:
        raise PlacementError(f"{where}: {exc.message}") from exc


# --- changes ---------------------------------------------------------------------------

def apply_transition(placement: Placement, transition: Transition,
                     above: int = 0) -> Placement:
    """`placement` after one step, one version newer. A removal of the leader hands
    leadership to the step's `leader` and starts a new epoch, above the placement's
    and above `above` (an epoch some replica reports having seen: the controller's
    placement may lag the sites', and an epoch must never be handed out twice). A
    step that does not fit the placement (adding a replica it has, removing one it
    lacks, removing the leader without a successor, removing the last replica)
    raises."""
    shard = placement.shard(transition.database, transition.shard)
    return placement.replace_shards([transition.apply_to(shard, above)])


def apply_transitions(placement: Placement, transitions: Iterable[Transition]) -> Placement:
    """`placement` after each step in order, one version newer per step (the same as
    `apply_transition` one at a time, without building every placement between)."""
    shards = {shard.id: shard for shard in placement.shards}
    steps = 0
    for transition in transitions:
        shard = shards.get(transition.shard_id)
        if shard is None:
            raise PlacementError(f"{transition}: placement version {placement.version} has "
                                 f"no shard {transition.database}/{transition.shard}")
        shards[transition.shard_id] = transition.apply_to(shard)
        steps += 1
    return Placement(version=placement.version + steps, shards=tuple(shards.values()))
