"""Which shard a client's messages go to, for tests that aim at a shard."""

from __future__ import annotations

from stratamq.broker.ds.shard_set import shard_of


def client_id_on_shard(prefix: str, shard: int, n_shards: int) -> str:
    """`prefix-N` with the smallest N whose messages go to `shard` of `n_shards`
    (sites shard by publisher client id)."""
    for number in range(10_000):
        client_id = f"{prefix}-{number}"
        if shard_of(client_id, n_shards) == shard:
            return client_id
    raise AssertionError(f"no client id on shard {shard} of {n_shards}")
