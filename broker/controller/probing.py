"""The heartbeat probes of a round, as both controllers run them: every site at once,
so that a round waits for the slowest site at most `deadline` seconds, not the sum of
every site's time, and a hung site (one that takes the connection and answers nothing)
does not hold up the failover of every other site's shards. A probe not done by the
deadline counts as no answer (None), like one that failed; the answers come in the
order of the addresses.

The probe is the caller's: the local controller's `SiteClient.probe` (aiohttp, on its
event loop: `probe_concurrently`), the operator's blocking urllib one
(`operator/sites.py`, in Kopf's timer thread: `probe_in_threads`). A probe that raises
(not an expected failure: those it answers None for) fails the round, in both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

Answer = TypeVar("Answer")


async def probe_concurrently(addresses: Sequence[str],
                             probe: Callable[[str], Awaitable[Answer]],
                             deadline: float) -> list[Answer | None]:
    """`probe` of every address at once on the running event loop; one not done by
    `deadline` is cancelled."""
    if not addresses:
        return []
    tasks = [asyncio.ensure_future(probe(address)) for address in addresses]
    try:
        done, _ = await asyncio.wait(tasks, timeout=deadline)
        return [task.result() if task in done else None for task in tasks]
    finally:
        for task in tasks:
            task.cancel()  # nothing where done: the late ones, or all when cancelled


def probe_in_threads(addresses: Sequence[str], probe: Callable[[str], Answer],
                     deadline: float, max_parallel: int) -> list[Answer | None]:
    """`probe` of every address at once, in up to `max_parallel` threads; a probe not
    done by `deadline` is not waited for (its thread ends with its socket timeout)."""
    if not addresses:
        return []
    pool = ThreadPoolExecutor(max_workers=min(len(addresses), max_parallel),
                              thread_name_prefix="stratamq-probe")
    try:
        futures = [pool.submit(probe, address) for address in addresses]
        wait(futures, timeout=deadline)
        return [future.result() if future.done() else None for future in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
