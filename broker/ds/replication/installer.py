"""A new copy of one shard in place of this site's: a checkpoint of its leader's (a
bootstrap, asked by that leader) or an empty shard (this site left the replica set),
put in with the applier paused (docs/replication.md, "Bootstrapping a replica";
`bootstrap.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from ...errors import StorageError
from .. import metrics
from .applier import Applier
from .bootstrap import (
    Progress,
    check_install,
    fetch_checkpoint,
    finish_install,
    remove_staged,
    stage_empty_shard,
)
from .log import Position, StaleEpochError
from .replica_context import NotLeaderError, ReplicaContext, ReplicaRole

log = logging.getLogger(__name__)


class JoinedAgainError(StorageError):
    """The data of a replica that left its shard's replica set is kept: the site was
    placed in it again before its data went."""

    recoverable = True


class Installer:
    """The installs of one shard replica: one bootstrap at a time, and none cut
    short by a stopping site (`close` waits for it)."""

    def __init__(self, context: ReplicaContext, role: ReplicaRole, applier: Applier) -> None:
        self._context = context
        self._role = role
        self._log = context.log
        self._applier = applier
        self._bootstrap_task: asyncio.Task[Position] | None = None
        self._installing: asyncio.Task[None] | None = None
        self.progress: Progress | None = None  # of the bootstrap under way
        self.bootstraps = 0  # checkpoints installed here since the site started
        labels = (context.shard_set.name, str(context.shard_id))
        self._bootstraps_refused = metrics.BOOTSTRAPS_REFUSED.labels(*labels)
        self._cuts_refused = metrics.LOG_CUTS_REFUSED.labels(*labels)

    async def bootstrap_from(self, address: str, epoch: int) -> Position:
        """As a follower: install a checkpoint of the shard from its leader of `epoch`
        at `address` (asked by that leader); the position this log then ends at. One
        bootstrap at a time: a repeated ask waits for the one under way.
        StaleEpochError when this log has seen a newer epoch (checked again, under the
        log lock, before the checkpoint goes in), BootstrapRefusedError when the
        checkpoint was taken below what this replica applied."""
        await self.check_bootstrap_epoch(epoch)
        task = self._bootstrap_task
        if task is None or task.done():
            task = asyncio.create_task(self._bootstrap(address, epoch),
                                       name=f"ds-bootstrap-{self._context.label}")
            self._bootstrap_task = task
        return await asyncio.shield(task)

    async def check_bootstrap_epoch(self, epoch: int) -> None:
        """Take a bootstrap request of the leader of `epoch` as an append of it would
        be taken (from now on older leaders are refused); StaleEpochError, counted and
        logged, when this log has seen a newer one."""
        async with self._context.log_lock:
            try:
                await self._context.run(self._log.observe_epoch, epoch)
            except StaleEpochError as exc:
                self._refuse_bootstrap(exc)
                raise

    async def install_empty(self, still_left: Callable[[], bool]) -> bool:
        """Put an empty shard in place of this site's, its log at [0, 0], unless
        `still_left` says no, asked under the apply and log locks (this site was
        placed in the replica set again meanwhile: it may have taken appends that its
        leader counts, which the empty shard would wipe). Whether it was put."""
        shard_path = self._context.shard.path
        await self._context.run(stage_empty_shard, shard_path)

        def check() -> None:
            if not still_left():
                raise JoinedAgainError(f"{self._context.label}: placed in the replica set "
                                       f"again: its data stays")

        try:
            await self._install(shard_path, check)
        except JoinedAgainError:
            return False
        return True

    async def close(self) -> None:
        """Stop a bootstrap under way; wait for an install that has begun."""
        if self._bootstrap_task is not None:
            self._bootstrap_task.cancel()
            with contextlib.suppress(BaseException):
                await self._bootstrap_task
        if self._installing is not None:
            with contextlib.suppress(Exception):
                await self._installing

    def _refuse_bootstrap(self, error: StorageError) -> None:
        if isinstance(error, JoinedAgainError):
            return  # not a bootstrap: nothing to count or say
        if isinstance(error, StaleEpochError):
            self._bootstraps_refused.inc()
        else:
            self._cuts_refused.inc()
        log.error("%s: bootstrap refused: %s", self._context.label, error.message)

    async def _bootstrap(self, address: str, epoch: int) -> Position:
        if self._role.leadership is not None:
            raise NotLeaderError(f"{self._context.label}: this site leads the shard")
        progress = self.progress = Progress(address)
        shard_path = self._context.shard.path
        log.info("%s: bootstrapping from a checkpoint at %s (epoch %d)", self._context.label,
                 address, epoch)
        try:
            position = await fetch_checkpoint(self._context.client.session, address,
                                              self._context.shard_set.name, self._context.shard_id,
                                              shard_path, progress, self._context.executor)

            def check() -> None:
                # under the apply and log locks: nothing moves the epoch or the
                # applied offset between this check and the swap
                if epoch < self._log.epoch:
                    raise StaleEpochError(f"the bootstrap of epoch {epoch} was overtaken "
                                          f"by epoch {self._log.epoch}")
                check_install(position, self._applier.applied)

            await self._install(shard_path, check)
        finally:
            self.progress = None
        self.bootstraps += 1
        log.info("%s: bootstrapped from %s at offset %d, epoch %d: %d bytes in %d files "
                 "in %.1fs", self._context.label, address, position.offset, position.epoch,
                 progress.bytes_done, progress.files, progress.as_dict()["seconds"])
        self._applier.committed_moved()
        return self._log.last

    async def _install(self, shard_path: Path, check: Callable[[], None] | None = None
                       ) -> None:
        """Put the staged shard folder in place of the shard's and reset the log to
        its marker's position, with the applier paused. `check` runs first under the
        same locks; when it raises StorageError the staged folder is dropped (and the
        refusal counted and logged) instead. Not cancelled halfway: a stopping site
        waits for it (`close`), so the shard is not closed under it."""
        async def install() -> None:
            async with self._applier.paused(), self._context.log_lock:
                if check is not None:
                    try:
                        check()
                    except StorageError as exc:
                        self._refuse_bootstrap(exc)
                        await self._context.run(remove_staged, shard_path)
                        raise
                await self._context.shard_set.replace_shard(self._context.shard_id)
                await self._context.run(finish_install, shard_path, self._log)

        self._installing = asyncio.create_task(install(), name=f"ds-install-{self._context.label}")
        await asyncio.shield(self._installing)

