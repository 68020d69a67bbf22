"""What a password check may cost the site: a bounded pool of hashing threads, and a
back-off for source addresses whose logins fail.

A password hash costs 0.1-0.3 s of CPU on purpose. Without a bound, a storm of
wrong-password CONNECTs queues hashes without end and a legitimate login waits behind
all of them (22.9 s under 100 clients at ~150 B/s each). Here:

* `HashPool` runs hashes on `workers` threads of its own (not the loop's default
  executor, which storage work shares) with at most `queue` checks admitted beyond
  them, and at most `per_source` from one source address, so one address cannot fill
  the queue. A check that finds no room is refused at once (Server busy): the client
  tries again later instead of waiting without bound.
* `FailureBackoff` remembers failed logins per source address. After `FREE_FAILURES`
  failures, every further failure closes the source for a period that doubles (1 s,
  2 s, 4 s, ... at most `max_backoff`); a CONNECT with a password from a closed source
  is refused without hashing (Connection rate exceeded). The table is a bounded LRU
  (`MAX_SOURCES`), an entry quiet for twice `max_backoff` is forgotten.

Many sources at once (a botnet) still fill the queue; then legitimate logins are
refused with Server busy quickly rather than left waiting, and succeed on a retry
once the storm's sources are backed off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..metrics import LOGINS_REFUSED, PASSWORD_CHECKS_PENDING

# Failures a source may have before it is backed off: users mistyping a password a
# few times are not slowed down, nor are the other users behind the same address (a
# NAT, a proxy), who share its back-off once it starts.
FREE_FAILURES = 10
FIRST_BACKOFF = 1.0  # seconds; doubled with every further failure
# Source addresses remembered (LRU). An entry is a few hundred bytes: ~3 MB at most.
MAX_SOURCES = 10_000


@dataclass
class _Failures:
    count: int
    closed_until: float
    last_failure: float


class FailureBackoff:
    """Failed logins per source address, and whether a source is backed off now.
    Not thread-safe: used on the event loop only. `clock` is injectable for tests."""

    def __init__(self, max_backoff: float, *, max_sources: int = MAX_SOURCES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_backoff = max_backoff
        self._max_sources = max_sources
        self._clock = clock
        self._sources: OrderedDict[str, _Failures] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sources)

    def backed_off(self, source: str) -> bool:
        """Whether logins from `source` are refused now, without a hash."""
        entry = self._current(source)
        return entry is not None and self._clock() < entry.closed_until

    def failed(self, source: str) -> None:
        """A login from `source` failed its password check."""
        if self._max_backoff <= 0:
            return
        now = self._clock()
        entry = self._current(source)
        if entry is None:
            entry = self._sources[source] = _Failures(0, now, now)
            while len(self._sources) > self._max_sources:
                self._sources.popitem(last=False)
        entry.count += 1
        entry.last_failure = now
        beyond = entry.count - FREE_FAILURES
        if beyond > 0:
            # 2**beyond only up to the cap: no huge numbers after many failures
            doubling = min(beyond - 1, 30)
            entry.closed_until = now + min(self._max_backoff, FIRST_BACKOFF * 2 ** doubling)
        self._sources.move_to_end(source)

    def _current(self, source: str) -> _Failures | None:
        entry = self._sources.get(source)
        if entry is not None and self._clock() - entry.last_failure > 2 * self._max_backoff:
            del self._sources[source]  # quiet long enough: a clean slate
            return None
        return entry


class ServerBusy(Exception):
    """No room in the hash pool for this check (for its source or at all)."""


class HashPool:
    """Password hashes off the event loop, on a bounded number of threads, with a
    bounded number of checks admitted (see the module docstring). Admission and the
    counts live on the event loop; the threads only hash."""

    def __init__(self, workers: int, queue: int, per_source: int) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="password-hash")
        self._capacity = workers + queue
        self._per_source = per_source
        self._admitted = 0
        self._by_source: dict[str, int] = {}

    async def run(self, source: str, check: Callable[[], bool]) -> bool:
        """`check()` on a hashing thread; raises ServerBusy at once when there is no
        room for it. A caller cancelled meanwhile leaves the check holding its room
        until its thread is done with it."""
        held = self._by_source.get(source, 0)
        if self._admitted >= self._capacity or held >= self._per_source:
            LOGINS_REFUSED.labels("busy").inc()
            raise ServerBusy()
        self._admitted += 1
        self._by_source[source] = held + 1
        PASSWORD_CHECKS_PENDING.set(self._admitted)
        loop = asyncio.get_running_loop()
        future = self._executor.submit(check)

        def done(_future: Future[bool]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: site stopped
                loop.call_soon_threadsafe(self._release, source)

        future.add_done_callback(done)
        return await asyncio.wrap_future(future)

    def _release(self, source: str) -> None:
        self._admitted -= 1
        left = self._by_source[source] - 1
        if left:
            self._by_source[source] = left
        else:
            del self._by_source[source]
        PASSWORD_CHECKS_PENDING.set(self._admitted)

    def close(self) -> None:
        """Stop the threads once the checks under way are done (not waited for)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
