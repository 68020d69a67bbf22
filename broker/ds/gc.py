"""Applying a generation GC plan (made by `stratamq spark gc` from a checkpoint) on
the site: drop generations whose every message has expired under the per-topic
retention rules, and rewrite those partly expired to keep only their live messages
(deleted in place: the survivors keep their keys, so timestamps, streams, iterators
and session positions stay valid).

What the site checks before it touches anything:
- the plan is for this database on this site;
- the plan is not older than the data: its checkpoint is newer than the checkpoint of
  every plan applied before (kept per shard as a record), else the whole plan is
  refused (`GcPlanRefusedError`, 409);
- per generation: it is closed with the `until` the plan saw, and a fresh count of
  its messages and of those expired under the plan's rules at the plan's time is
  what the plan counted; a generation that changed is left alone and reported.
The current generation is never in a plan's drop or rewrite lists (the job keeps
it), and `Shard.gc_write` refuses it anyway. A rewrite's deletes go in batches of
about `DELETE_BATCH_BYTES`, each atomic; a plan cut short by a crash is not applied
again (its mark is written first), and the next plan deletes the rest.

On a replicated site every change goes through the shard's log at its leader
(`Database.gc_write`, `drop_generation`), so every replica deletes the same messages:
the site asked counts on its own copy (a closed generation is the same on every
replica) and the plan acts on the shards it holds a replica of; the others are
reported `skipped` (their data is not in this site's checkpoint: `stratamq spark
launch` makes a plan on every site). Only the compaction that frees the space runs
on the site asked alone: the other replicas free it as RocksDB compacts."""

from __future__ import annotations

import asyncio
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CorruptDataError, GcPlanRefusedError, GenerationError
from .backend import Consistency
from .layouts import ReadStats
from .message import peek_timestamp, peek_topic
from .retention import RetentionRules, is_expired
from .shard import Generation, Shard
from .shard_set import ShardSet
from .snapshot import stream_patterns

if TYPE_CHECKING:  # the database imports this module: its facade calls `apply_gc_plan`
    from .database import Database

PLAN_KIND = "stratamq-gc-plan"
PLAN_FORMAT = 1
# Record (per shard) holding the `created_at` of the newest checkpoint whose plan was
# applied; a plan from an older or the same checkpoint is older than the data.
APPLIED_RECORD = b"\xffgc/applied-checkpoint"
ACTIONS = ("drop", "rewrite", "keep")
_SCAN_BATCH = 4096
# A rewrite's deletes go through the shard log in entries of about this size.
DELETE_BATCH_BYTES = 256 * 1024
_U64 = struct.Struct(">Q")
_locks: weakref.WeakKeyDictionary[Database, asyncio.Lock] = weakref.WeakKeyDictionary()


@dataclass(slots=True)
class GenerationScan:
    """A generation counted against the rules at one time."""

    messages: int = 0
    expired: int = 0


def _walk(generation: Generation, rules: RetentionRules, now: int
          ) -> Iterator[list[bytes] | None]:
    """Every message of a generation, a page at a time: for each, its keys when it is
    expired at `now` (its data entry and every index entry the layout wrote for it),
    else None. Blocking."""
    layout = generation.layout
    for static, pattern in stream_patterns(generation.trie).items():
        after = 0
        while True:
            entries = layout.read(generation.data, static, pattern, ["#"], after, _SCAN_BATCH,
                                  ReadStats())
            if not entries:
                break
            for _key, value in entries:
                timestamp = peek_timestamp(value)
                topic = peek_topic(value)
                if not is_expired(rules, topic, timestamp, now):
                    yield None
                    continue
                topic_key = generation.trie.lookup(topic.split("/"))
                if topic_key is None or topic_key.static != static:
                    raise CorruptDataError(f"stored topic {topic!r} is not in its stream's trie")
                yield [entry_key for entry_key, _ in
                       layout.encode(topic, topic_key, timestamp, b"")]
            after = peek_timestamp(entries[-1][1])


def scan_generation(generation: Generation, rules: RetentionRules, now: int) -> GenerationScan:
    """Count a generation's messages, and those expired at `now`. Blocking."""
    scan = GenerationScan()
    for keys in _walk(generation, rules, now):
        scan.messages += 1
        scan.expired += keys is not None
    return scan


def expired_keys(generation: Generation, rules: RetentionRules, now: int
                 ) -> Iterator[list[bytes]]:
    """The keys of the generation's messages expired at `now`, in runs of about
    `DELETE_BATCH_BYTES` (a message's keys in one run: each run is deleted atomically,
    the rewrite as a whole is not), read as they are deleted: a
    generation of millions of expired messages is never held whole in memory.
    Blocking (each run: one `next` in the shard's executor)."""
    run: list[bytes] = []
    size = 0
    for keys in _walk(generation, rules, now):
        if keys is None:
            continue
        run += keys
        size += sum(len(key) for key in keys)
        if size >= DELETE_BATCH_BYTES:
            yield run
            run, size = [], 0
    if run:
        yield run


def check_plan(plan: Any, database: Database) -> tuple[RetentionRules, int, int]:
    """The plan's rules, time and checkpoint time, once it is known to be a plan for
    this database on this site."""
    if not isinstance(plan, dict) or plan.get("kind") != PLAN_KIND:
        raise GcPlanRefusedError(f"not a GC plan (kind {PLAN_KIND!r} missing)")
    if plan.get("format") != PLAN_FORMAT:
        raise GcPlanRefusedError(f"unknown GC plan format {plan.get('format')!r}")
    if plan.get("db") != database.name:
        raise GcPlanRefusedError(f"the plan is for database {plan.get('db')!r}, "
                                 f"not {database.name!r}")
    if plan.get("site") != database.site_id:
        raise GcPlanRefusedError(f"the plan was made from a checkpoint of site "
                                 f"{plan.get('site')!r}; this is site {database.site_id}")
    try:
        rules = RetentionRules.from_json(plan["retention"])
        made_at = int(plan["made_at"])
        created_at = int(plan["checkpoint"]["created_at"])
        for entry in plan["generations"]:
            if entry["action"] not in ACTIONS:
                raise ValueError(f"unknown action {entry['action']!r}")
            int(entry["shard"]), int(entry["generation"]), int(entry["messages"])
            int(entry["expired_messages"])
    except (KeyError, TypeError, ValueError) as exc:
        raise GcPlanRefusedError(f"the GC plan is malformed: {exc!r}") from exc
    return rules, made_at, created_at


async def apply_gc_plan(database: Database, shard_set: ShardSet, plan: Any
                        ) -> dict[str, Any]:
    """Apply a plan (see the module docstring) to `database`, whose copy on this site
    is `shard_set`; returns what was done per generation and the bytes freed."""
    rules, made_at, created_at = check_plan(plan, database)
    lock = _locks.setdefault(database, asyncio.Lock())
    held = [shard.shard_id for shard in shard_set.shards if database.holds(shard.shard_id)]
    async with lock:
        for shard_id in held:
            raw = await database.get_record(shard_id, APPLIED_RECORD, Consistency.COMMITTED)
            applied = _U64.unpack(raw)[0] if raw is not None else 0
            if applied >= created_at:
                raise GcPlanRefusedError(
                    f"the plan is older than the data: shard {shard_id} already had a "
                    f"plan applied from a checkpoint made at {applied} µs, and this plan's "
                    f"checkpoint was made at {created_at} µs; make a new checkpoint and plan")
        # Marked first: a plan half applied (a crash) is never applied again.
        marker = [(APPLIED_RECORD, _U64.pack(created_at))]
        for shard_id in held:
            await database.gc_write(shard_id, shard_set.shards[shard_id].current.info.id, [],
                                    marker)
        results = []
        for entry in plan["generations"]:
            if entry["action"] in ("drop", "rewrite"):
                results.append(await _apply_one(database, shard_set, entry, rules, made_at))
    return {"db": database.name, "site": database.site_id, "generations": results,
            "bytes_freed": sum(result["bytes_freed"] for result in results),
            "deleted_messages": sum(result["deleted_messages"] for result in results)}


async def _apply_one(database: Database, shard_set: ShardSet, entry: dict[str, Any],
                     rules: RetentionRules, made_at: int) -> dict[str, Any]:
    shard_id, generation_id = int(entry["shard"]), int(entry["generation"])
    result: dict[str, Any] = {"shard": shard_id, "generation": generation_id,
                              "action": entry["action"], "deleted_messages": 0,
                              "bytes_freed": 0}
    if not 0 <= shard_id < len(shard_set.shards):
        return {**result, "status": "refused", "reason": f"no shard {shard_id}"}
    if not database.holds(shard_id):
        return {**result, "status": "skipped",
                "reason": f"this site holds no replica of shard {shard_id}; a plan made on "
                          "a site that does covers it"}
    shard = shard_set.shards[shard_id]
    generation = shard.generations.get(generation_id)
    if generation is None:
        return {**result, "status": "gone", "reason": "the generation is no longer there"}
    if generation.info.is_current or generation.info.until != entry.get("until"):
        return {**result, "status": "refused",
                "reason": "the generation is current or closed at another time than the "
                          "plan saw"}
    loop = asyncio.get_running_loop()
    async with database.reading(shard_id, generation_id):
        scan = await loop.run_in_executor(shard_set.executor, scan_generation, generation,
                                          rules, made_at)
        before = await loop.run_in_executor(shard_set.executor, shard.generation_bytes,
                                            generation)
    if (scan.messages, scan.expired) != (entry["messages"], entry["expired_messages"]):
        return {**result, "status": "refused",
                "reason": f"the generation changed since the checkpoint: it holds "
                          f"{scan.messages} messages, {scan.expired} expired; the plan "
                          f"counted {entry['messages']}, {entry['expired_messages']}"}
    if entry["action"] == "drop":
        if scan.expired != scan.messages:
            return {**result, "status": "refused",
                    "reason": f"{scan.messages - scan.expired} messages are still live"}
        await database.drop_generation(shard_id, generation_id)
        return {**result, "status": "dropped", "deleted_messages": scan.messages,
                "bytes_freed": before}
    return await _rewrite(database, shard_set, shard, generation_id, scan, before, result,
                          rules, made_at)


async def _rewrite(database: Database, shard_set: ShardSet, shard: Shard, generation_id: int,
                   scan: GenerationScan, before: int, result: dict[str, Any],
                   rules: RetentionRules, made_at: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    runs: Iterator[list[bytes]] | None = None
    walked: Shard | None = None
    while True:
        async with database.reading(shard.shard_id, generation_id):
            # the shard's copy here may have been replaced meanwhile (a checkpoint
            # installed): walked again in the new one (deleting a key twice is harmless)
            shard = shard_set.shards[shard.shard_id]
            generation = shard.generations.get(generation_id)
            if generation is None:  # dropped meanwhile (retention)
                return {**result, "status": "gone", "reason": "dropped while being rewritten"}
            if runs is None or walked is not shard:
                runs, walked = expired_keys(generation, rules, made_at), shard
            deletes = await loop.run_in_executor(shard_set.executor, next, runs, None)
        if deletes is None:
            break
        try:
            await database.gc_write(shard.shard_id, generation_id, deletes, [])
        except GenerationError:  # dropped meanwhile (retention)
            return {**result, "status": "gone", "reason": "dropped while being rewritten"}
    async with database.reading(shard.shard_id, generation_id):
        generation = shard.generations.get(generation_id)
        if generation is None:
            return {**result, "status": "rewritten", "deleted_messages": scan.expired,
                    "bytes_freed": before}
        await loop.run_in_executor(shard_set.executor, shard.compact_generation,
                                   generation_id)
        after = await loop.run_in_executor(shard_set.executor, shard.generation_bytes,
                                           generation)
    return {**result, "status": "rewritten", "deleted_messages": scan.expired,
            "bytes_freed": max(0, before - after)}
