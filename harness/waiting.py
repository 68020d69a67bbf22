"""The one way a test waits: poll a check until it holds or a deadline passes.

`wait_until` answers whether it held in time (for tests that assert on it with their
own message, or go on either way); `wait_for` returns the check's first true value
and fails the test at the deadline, naming what it waited for and, through `explain`,
the state that shows why. Errors of the types in `tolerate` (a site that is down or
still starting) count as "not yet"; any other error fails at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

NO_ERRORS: tuple[type[BaseException], ...] = ()


def wait_until(condition: Callable[[], object], timeout: float, every: float = 0.05,
               tolerate: tuple[type[BaseException], ...] = NO_ERRORS) -> bool:
    """Whether `condition` held within `timeout` seconds, polled every `every` seconds
    (and once more at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return True
        except tolerate:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)


def wait_for(what: str, check: Callable[[], T | None], timeout: float,
             explain: Callable[[], str] = lambda: "", every: float = 0.5,
             tolerate: tuple[type[BaseException], ...] = NO_ERRORS) -> T:
    """The first true value of `check`, polled every `every` seconds; an
    AssertionError "timed out waiting for <what>" (with the last tolerated error and
    `explain()`) when none came within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            found = check()
        except tolerate as error:
            found, last_error = None, error
        if found:
            return found
        if time.monotonic() >= deadline:
            error_text = f" (last error: {last_error!r})" if last_error else ""
            raise AssertionError(f"timed out waiting for {what} after {timeout:.0f} s"
                                 f"{error_text}\n{explain()}")
        time.sleep(every)
