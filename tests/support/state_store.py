"""The contract of `broker/controller/store.StateStore`, checked the same way over
each store (the local controller's files, the operator's status.controller): each
record kept is kept (never refused while no one else writes), and a store made
afresh over the same place loads the last one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from stratamq.broker.controller.store import Kept, StateStore

Record = TypeVar("Record")


def check_keeps_and_loads(fresh: Callable[[], StateStore[Record]],
                          records: Sequence[Record]) -> None:
    store = fresh()
    for record in records:
        assert store.keep(record) == Kept()
        assert store.load() == record
        assert fresh().load() == record
