"""The broker of one site: the core parts, wired together. Nothing else lives here."""

from __future__ import annotations

from ..ds import Database, DurableStorage, SiteReplication
from ..routing.relay import Relay
from ..routing.site_interest import SiteInterest
from ..session.session import Session
from ..session.store import SessionStore
from ..shared.backlog import SharedBacklog
from ..shared.choice import SiteChoice
from ..shared.positions import SharedPositions
from ..shared.replay import SharedReplay
from .dispatch import Dispatcher
from .ownership import Ownership
from .publish import Publisher
from .registry import Owner, SessionLimits, SessionRegistry
from .retained import RetainedStore

SESSIONS_DB = "sessions"
RETAINED_DB = "retained"


class Broker:
    def __init__(self, storage: DurableStorage, messages: Database, store: SessionStore,
                 retained: RetainedStore, limits: SessionLimits,
                 storage_timeout: float = 5.0, ownership: Ownership | None = None,
                 replication: SiteReplication | None = None) -> None:
        self.storage = storage
        self.ownership = ownership
        self.messages = messages
        self.retained = retained
        self.publisher = Publisher(messages, store, retained)
        # On a cluster: which topic filters each site's subscribers hold (this site's
        # set by the dispatcher, the peers' told through the relay), and so which
        # sites hold each shared group.
        interest = None if replication is None else \
            SiteInterest(messages.site_id, messages.fed_through)
        choice = SiteChoice(messages.site_id,
                            None if interest is None else interest.members_with)
        self.shared_backlog = SharedBacklog(storage, messages.name, choice)
        self.dispatcher = Dispatcher(
            choice=choice, backlog=self.shared_backlog, fed_through=messages.fed_through,
            on_interest=None if interest is None else interest.set_here)
        options = messages.options
        self.shared_positions = SharedPositions(
            self.dispatcher, store, storage.site_id,
            options.longest_retention_period or options.message_retention_period,
            load_wait=storage_timeout)
        self.registry = SessionRegistry(storage, messages.name, store, self.publisher,
                                        self.dispatcher, limits, ownership=ownership,
                                        groups_kept_for=self.shared_positions.kept_for)
        messages.add_commit_listener(self.dispatcher.on_commit, wants=self.dispatcher.wants)
        messages.add_feed_gap_listener(self.registry.on_feed_gap)
        messages.add_feed_gap_listener(self.dispatcher.on_feed_gap)
        messages.add_generation_pre_drop_listener(self.registry.before_generation_drop)
        messages.add_generation_drop_listener(self.registry.after_generation_drop)
        self.shared_replay = SharedReplay(storage, messages.name, self.dispatcher.group_of,
                                          choice)
        # On a cluster: the push of committed messages to the sites without a replica
        # of a shard, served on the peer port (`SiteReplication.add_service`).
        self.relay = None if replication is None or interest is None else \
            Relay.of(replication, messages, interest, self.dispatcher.shared_unsettled,
                     self.shared_replay.on_site_lost)

    @classmethod
    async def assemble(cls, storage: DurableStorage, messages: Database, n_shards: int,
                       sync_writes: bool, limits: SessionLimits,
                       replication: SiteReplication | None = None,
                       peer_timeout: float = 5.0) -> Broker:
        """The parts, wired; nothing runs and nothing is read until `start`. With
        `replication` (a cluster, its peer port not yet listening: the relay is added
        to it first): session writes are fenced by owner epochs, and the peer port
        serves other sites' takeovers of client ids."""
        sessions_db = await storage.open_kv_db(SESSIONS_DB, n_shards, sync_writes)
        retained_db = await storage.open_kv_db(RETAINED_DB, n_shards, sync_writes)
        retained = RetainedStore(retained_db) if replication is None else RetainedStore(
            retained_db, clock_lead=replication.peers_clock_lead)
        store = SessionStore(sessions_db, messages,
                             owner=storage.site_id if replication is not None else "")
        ownership = None if replication is None else \
            Ownership(store, replication, peer_timeout)
        return cls(storage, messages, store, retained, limits, peer_timeout, ownership,
                   replication)

    async def start(self) -> None:
        """Index the retained topics, serve takeovers, start the background loops."""
        await self.retained.load()
        if self.ownership is not None:
            self.ownership.serve(self.registry.release)
        self.shared_positions.start()
        self.registry.start()

    async def stop(self) -> None:
        await self.shared_replay.close()
        await self.shared_backlog.close()
        await self.registry.stop()
        await self.shared_positions.close()

    # The admin API lists these.
    @property
    def sessions(self) -> dict[str, Session]:
        return self.registry.sessions

    @property
    def connections(self) -> dict[str, Owner]:
        return self.registry.connections
