"""A plan's steps laid out so that several shards move at once (`in_waves`).

The controller carries a plan out in order and may take the steps at the head of what
is left in one round when each is on a shard of its own (decisions.advance), up to
`max_concurrent_moves`. The planner lists a shard's steps together (`+D`, then `-A`),
which leaves nothing to take together: `in_waves` lays the same steps out so that the
first steps of `width` shards come one after the other, then their second steps, and
so on. Steps of different shards commute (each changes its own shard), so the
reordered plan reaches the same target; a shard's own steps keep their order, so
every rule a plan keeps per shard (add before remove, never below the replication
factor) still holds. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from .placement import ShardId, Transition


def moves_of(transitions: Sequence[Transition]) -> list[list[Transition]]:
    """The plan cut into moves: each run of consecutive steps on one shard."""
    moves: list[list[Transition]] = []
    for step in transitions:
        if moves and moves[-1][0].shard_id == step.shard_id:
            moves[-1].append(step)
        else:
            moves.append([step])
    return moves


def in_waves(transitions: Sequence[Transition], width: int) -> tuple[Transition, ...]:
    """`transitions` in waves of at most `width` moves on distinct shards, each wave's
    moves interleaved (the first step of each, then the second of each, ...), moves in
    the plan's order. Width 1 (or a plan of one move per wave) changes nothing."""
    if width < 1:
        raise ValueError(f"width {width}: at least 1")
    if width == 1:
        return tuple(transitions)
    waves: list[list[list[Transition]]] = []
    shards: set[ShardId] = set()
    for move in moves_of(transitions):
        shard = move[0].shard_id
        if not waves or len(waves[-1]) == width or shard in shards:
            # A shard moved twice goes in a later wave, after its first move.
            waves.append([])
            shards = set()
        waves[-1].append(move)
        shards.add(shard)
    ordered: list[Transition] = []
    for wave in waves:
        for position in range(max(len(move) for move in wave)):
            ordered.extend(move[position] for move in wave if position < len(move))
    return tuple(ordered)
