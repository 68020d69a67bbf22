"""Where a controller keeps its state between rounds and across restarts: the port both
controllers keep it through, whatever holds it.

- The local controller (`controller.py`) keeps it in its data folder
  (`state.StateFiles`): one writer, held by `state.FolderLock`, so a keep is never
  refused.
- The operator (`operator/controller.py`) keeps it in the DurableStorage's
  `status.controller` (`operator/kept_state.KeptState`): a write conditional on the
  resourceVersion it last read or wrote, refused when another operator wrote since
  (a Kopf peering hand-over). A refused keep drops the round: nothing of it is pushed,
  and the state the other writer kept (`KeepRefused.theirs`) is taken instead.

What a record holds is each store's own (the local controller knows a site by its
admin URL, the operator by its pod): the port is generic in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

Record = TypeVar("Record")


@dataclass(frozen=True)
class Kept:
    """The store holds the record now: what was decided on it may be pushed."""


@dataclass(frozen=True)
class KeepRefused(Generic[Record]):
    """The store did not take the record: another writer kept `theirs` since this
    controller last loaded or kept (None: the store is gone, or kept changing)."""

    theirs: Record | None


class StateStore(Protocol[Record]):
    """A controller's kept state: `load` gives what the store holds (as last read or
    kept), `keep` replaces it, or is refused (`KeepRefused`) when another writer kept
    another record since; then nothing decided on this controller's record may be
    pushed."""

    def load(self) -> Record: ...

    def keep(self, record: Record) -> Kept | KeepRefused[Record]: ...
