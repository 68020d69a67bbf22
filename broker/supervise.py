"""Supervision of background work (loops and tasks nobody awaits): a failure is
logged with its traceback and counted in `stratamq_background_failures_total{loop}`,
and the work starts again after a pause, instead of ending silently."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from .metrics import BACKGROUND_FAILURES

log = logging.getLogger(__name__)

# The first restart comes soon; a body that keeps failing at once is restarted less
# and less often (up to MAX_PAUSE), so a lasting fault does not flood the log.
RESTART_PAUSE = 1.0
MAX_PAUSE = 60.0


def note_failure(loop: str) -> None:
    """Log the exception being handled (with traceback) and count it for `loop`."""
    log.exception("background work %r failed", loop)
    BACKGROUND_FAILURES.labels(loop).inc()


def note_task_failure(loop: str, task: asyncio.Task[None]) -> None:
    """A done callback for a task nobody awaits: note its exception, if it has one."""
    if task.cancelled() or task.exception() is None:
        return
    log.error("background work %r failed", loop, exc_info=task.exception())
    BACKGROUND_FAILURES.labels(loop).inc()


async def supervise(loop: str, body: Callable[[], Awaitable[None]],
                    pause: float = RESTART_PAUSE) -> None:
    """Run `body` until it returns; whenever it raises, note the failure and run it
    again after a pause. Cancellation ends it (and is not a failure)."""
    next_pause = pause
    while True:
        started = time.monotonic()
        try:
            await body()
            return
        except Exception:
            note_failure(loop)
        # a body that ran a good while before failing starts again soon
        if time.monotonic() - started > MAX_PAUSE:
            next_pause = pause
        await asyncio.sleep(next_pause)
        next_pause = min(next_pause * 2, MAX_PAUSE)
