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
from collections import OrderedDict, deque
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


@dataclass
class _Check:
    check: Callable[[], bool]
    outcome: asyncio.Future[bool]


class ServerBusy(Exception):
    """No room in the hash pool for this check (for its source or at all)."""


class HashPool:
    """Password hashes off the event loop, on a bounded number of threads, with a
    bounded number of checks admitted (see the module docstring). Admission, the
    order of the checks and the counts live on the event loop; the threads only hash.

    A free thread takes the next check of the source with the fewest checks running,
    and among those of the one served least recently, not the oldest check: a storm
    from one address keeps up to `per_source` checks queued, and a login from
    another address would otherwise wait for all of them."""

    def __init__(self, workers: int, queue: int, per_source: int) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="password-hash")
        self._workers = workers
        self._capacity = workers + queue
        self._per_source = per_source
        self._admitted = 0
        self._by_source: dict[str, int] = {}  # admitted checks, running or waiting
        self._running: dict[str, int] = {}
        # when each source with checks admitted last had one started (a count of starts)
        self._last_started: dict[str, int] = {}
        self._starts = 0
        # per source, its checks not started yet; sources in the order they came
        self._waiting: OrderedDict[str, deque[_Check]] = OrderedDict()

    async def run(self, source: str, check: Callable[[], bool]) -> bool:
        """`check()` on a hashing thread; raises ServerBusy at once when there is no
        room for it. A caller that goes before its check started takes the check
        with it; one that goes later leaves it holding its room until done."""
        held = self._by_source.get(source, 0)
        if self._admitted >= self._capacity or held >= self._per_source:
            LOGINS_REFUSED.labels("busy").inc()
            raise ServerBusy()
        self._admitted += 1
        self._by_source[source] = held + 1
        PASSWORD_CHECKS_PENDING.set(self._admitted)
        waiting = _Check(check, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(source, deque()).append(waiting)
        self._start_some()
        try:
            return await waiting.outcome
        except asyncio.CancelledError:
            self._withdraw(source, waiting)
            raise

    def _withdraw(self, source: str, waiting: _Check) -> None:
        """A caller went: its check goes too, unless it has started."""
        queued = self._waiting.get(source)
        if queued is None or waiting not in queued:
            return  # started: it holds its room until done
        queued.remove(waiting)
        if not queued:
            del self._waiting[source]
        self._release(source)

    def _start_some(self) -> None:
        loop = asyncio.get_running_loop()
        while sum(self._running.values()) < self._workers and self._waiting:
            source = min(self._waiting, key=lambda name: (self._running.get(name, 0),
                                                          self._last_started.get(name, -1)))
            queued = self._waiting[source]
            waiting = queued.popleft()
            if not queued:
                del self._waiting[source]
            self._running[source] = self._running.get(source, 0) + 1
            self._starts += 1
            self._last_started[source] = self._starts
            work = self._executor.submit(waiting.check)

            def done(work: Future[bool], source: str = source,
                     outcome: asyncio.Future[bool] = waiting.outcome) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: site stopped
                    loop.call_soon_threadsafe(self._finished, source, outcome, work)

            work.add_done_callback(done)

    def _finished(self, source: str, outcome: asyncio.Future[bool],
                  work: Future[bool]) -> None:
        left = self._running[source] - 1
        if left:
            self._running[source] = left
        else:
            del self._running[source]
        self._release(source)
        if not outcome.done():
            if work.cancelled():
                outcome.cancel()
            elif (error := work.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(work.result())
        self._start_some()

    def _release(self, source: str) -> None:
        self._admitted -= 1
        left = self._by_source[source] - 1
        if left:
            self._by_source[source] = left
        else:
            del self._by_source[source]
            self._last_started.pop(source, None)
        PASSWORD_CHECKS_PENDING.set(self._admitted)

    def close(self) -> None:
        """Stop the threads once the checks under way are done (not waited for); the
        checks not started are cancelled (their callers get CancelledError)."""
        waiting = [check for queued in self._waiting.values() for check in queued]
        self._waiting.clear()
        for check in waiting:
            check.outcome.cancel()
        self._executor.shutdown(wait=False)  # it holds only checks already started
