"""The shard leader's senders: one task per follower ships the log to it (heartbeats
when idle) and has it install a checkpoint when the log no longer holds what it
lacks (docs/replication.md, "In a running site", "Bootstrapping a replica")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from .bootstrap import request_bootstrap, should_bootstrap
from .leader import Leadership
from .log import BootstrapNeededError, LogGapError, StaleEpochError
from .peer import PeerError
from .replica_context import RETRY_INTERVAL, ReplicaContext, ReplicaRole

log = logging.getLogger(__name__)

# The longest a new commit offset waits for the append it was to ride on (one coming
# is waited for, `Senders.tell_commit`) before the followers are sent it alone.
COMMIT_LINGER = 0.05


class Senders:
    """The send loops of this site's leadership of one shard. `on_committed` is told
    when a follower's answer moves the commit offset; `append_coming` says whether
    this leader is about to append (a write on its way)."""

    def __init__(self, context: ReplicaContext, role: ReplicaRole,
                 on_committed: Callable[[], None], append_coming: Callable[[], bool]) -> None:
        self._context = context
        self._role = role
        self._on_committed = on_committed
        self._append_coming = append_coming
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._send_now: dict[str, asyncio.Event] = {}
        # per follower: a request is to go even with nothing new in it (`send_now`);
        # a wake for appended entries (`appended`) sends only what the follower lacks
        self._send_anyway: dict[str, bool] = {}
        # set (and replaced) each time a follower answers this leader
        self._answered = asyncio.Event()
        # set while a new commit offset waits for an append to ride on (`tell_commit`)
        self._commit_timer: asyncio.TimerHandle | None = None

    def start(self, leadership: Leadership) -> None:
        for follower in leadership.replica_set:
            if follower == leadership.site:
                continue
            self._send_now[follower] = asyncio.Event()
            self._send_now[follower].set()
            self._senders[follower] = asyncio.create_task(
                self._send_loop(leadership, follower),
                name=f"ds-send-{self._context.label}-{follower}")

    def stop(self) -> None:
        if self._commit_timer is not None:
            self._commit_timer.cancel()
            self._commit_timer = None
        for task in self._senders.values():
            task.cancel()
        self._senders.clear()
        self._send_now.clear()
        self._send_anyway.clear()

    def send_now(self) -> None:
        """Send every follower what it lacks (a heartbeat if nothing) without waiting
        for the heartbeat interval; a request in flight is sent again once answered."""
        for follower in self._send_now:
            self._send_anyway[follower] = True
        self._wake_all()

    def appended(self) -> None:
        """This leader appended entries: each follower is sent them, and the commit
        offset with them, unless its sender shipped them already: the log's end moves
        on the executor, before the loop tells this, and a sender between two requests
        reads the log then. (Woken by it anyway, a sender that found nothing to send
        sent a request of no entries: one in ten of a loaded follower's appends.)"""
        self._wake_all()

    def _wake_all(self) -> None:
        if self._commit_timer is not None:  # what it waited for goes now
            self._commit_timer.cancel()
            self._commit_timer = None
        for event in self._send_now.values():
            event.set()

    def tell_commit(self) -> None:
        """The commit offset moved: the followers learn it at once, or with this
        leader's next append where one is coming (a write queued or on its way to the
        log: under load there always is), which saves each follower a request of no
        entries per write. Should that append not come (its write failed), they are
        sent the offset after `COMMIT_LINGER`."""
        if not self._append_coming():
            self.send_now()
        elif self._commit_timer is None:
            self._commit_timer = asyncio.get_running_loop().call_later(
                COMMIT_LINGER, self.send_now)

    def next_answer(self) -> Coroutine[Any, Any, Literal[True]]:
        """What returns when a follower next answers from now on (or `tell_answered`
        is called): the wait is bound now, not when it is first awaited."""
        return self._answered.wait()

    def tell_answered(self) -> None:
        """Wake whoever waits for a follower's answer (`next_answer`): the
        leadership they wait on may have gone."""
        self._answered.set()
        self._answered = asyncio.Event()

    async def _send_loop(self, leadership: Leadership, follower: str) -> None:
        told_committed = -1
        wake = self._send_now[follower]
        shard_log, settings = self._context.log, self._context.settings
        while self._role.leadership is leadership and leadership.current:
            heartbeat_due = False
            if not self._news_for(leadership, follower, told_committed):
                try:
                    await asyncio.wait_for(wake.wait(), settings.heartbeat_interval)
                except TimeoutError:
                    heartbeat_due = True
            wake.clear()
            if self._role.leadership is not leadership or not leadership.current:
                return  # (a newer leader's entries may be in the log now: not ours to send)
            if not (self._send_anyway.pop(follower, False) or heartbeat_due
                    or self._news_for(leadership, follower, told_committed)):
                continue  # woken for entries it shipped already: nothing to send
            address = self._role.peers.get(follower)
            if address is None:
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            try:
                if should_bootstrap(leadership.next_offset.get(follower, 0),
                                    shard_log.first_offset, shard_log.last.offset,
                                    settings.log_retain_entries):
                    raise BootstrapNeededError(f"{follower} holds nothing of a log of "
                                               f"{shard_log.last.offset} entries",
                                               shard_log.first_offset)
                # a follower right behind gets the newest entries from memory
                request = leadership.request_from_memory(follower)
                if request is None:
                    request = await self._context.run(leadership.request_for, follower)
                sent = time.monotonic()
                result = await self._context.client.append(
                    address, self._context.shard_set.name, self._context.shard_id, request)
            except BootstrapNeededError as exc:
                await self._bootstrap_follower(leadership, follower, address, exc.message)
                continue
            except StaleEpochError as exc:
                if self._role.leadership is leadership:
                    self._role.step_down(f"{follower} knows a newer leader: {exc.message}")
                return
            except (PeerError, LogGapError) as exc:
                log.debug("%s: append to %s failed: %s", self._context.label, follower, exc)
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            if self._role.leadership is not leadership:
                return
            leadership.heard_from(follower, time.monotonic())
            leadership.confirmed_by(follower, sent)
            self.tell_answered()
            told_committed = request.committed
            before = leadership.committed
            leadership.on_result(follower, result)
            if leadership.committed != before:
                self._on_committed()
                self.tell_commit()

    def _news_for(self, leadership: Leadership, follower: str, told_committed: int) -> bool:
        """Whether `follower` lacks entries, or a commit offset that is not waiting
        for an append to ride on (`tell_commit`)."""
        behind = leadership.next_offset.get(follower, 0) <= self._context.log.last.offset
        return behind or (told_committed < leadership.committed and self._commit_timer is None)

    async def _bootstrap_follower(self, leadership: Leadership, follower: str, address: str,
                                  why: str) -> None:
        """Have `follower` install a checkpoint of this leader's shard; it reads the
        log from where the checkpoint was taken on."""
        own = self._role.peers.get(self._context.settings.site)
        if own is None:
            log.warning("%s: cannot bootstrap %s (%s): this site's peer address is "
                        "unknown", self._context.label, follower, why)
            await asyncio.sleep(RETRY_INTERVAL)
            return
        log.info("%s: %s bootstraps from a checkpoint: %s", self._context.label, follower, why)
        try:
            position = await request_bootstrap(
                self._context.client.session, address, self._context.shard_set.name,
                self._context.shard_id, own, leadership.epoch)
        except StaleEpochError as exc:
            if self._role.leadership is leadership:
                self._role.step_down(f"{follower} knows a newer leader: {exc.message}")
            return
        except PeerError as exc:
            log.warning("%s: bootstrap of %s failed (tried again): %s", self._context.label,
                        follower, exc.message)
            await asyncio.sleep(RETRY_INTERVAL)
            return
        if self._role.leadership is leadership:
            leadership.heard_from(follower, time.monotonic())
            log.info("%s: %s bootstrapped up to offset %d", self._context.label, follower,
                     position.offset)
            leadership.next_offset[follower] = position.offset + 1
