"""Typed errors. Each says whether it is `recoverable`: whether the same request may
succeed if retried later (the storage was closing, busy, slow) or never will (bad
input, corrupt data, an unknown database). MQTT reason codes and HTTP statuses are
chosen at the edges (`mqtt.error_codes`, `admin.http_errors`), not here."""

from __future__ import annotations


class StratamqError(Exception):
    """Base of every error stratamq raises on purpose."""

    recoverable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidTopicError(StratamqError):
    pass


class InvalidTopicFilterError(StratamqError):
    pass


class PayloadTooLargeError(StratamqError):
    pass


class InvalidMessageError(StratamqError):
    """A message the storage refuses as a whole (bad QoS, bad property value)."""


class ConfigError(StratamqError):
    """Bad configuration: the message names the key and says why."""


class ListenError(StratamqError):
    """A listener could not take its address (another process has the port, or the
    host is not this machine's): the message names the setting and the address."""


class StorageError(StratamqError):
    """Base of the storage's errors about its own state (not about the input)."""


class UnknownDatabaseError(StorageError):
    pass


class InvalidIteratorError(StorageError):
    """Iterator bytes that do not decode, or point at nothing this site has."""


class GenerationError(StorageError):
    """A generation operation that the shard refuses (drop the current one, unknown id)."""


class CheckpointExistsError(StorageError):
    """A checkpoint's target folder exists already: checkpoints never overwrite."""


class FolderInUseError(StorageError):
    """A database folder a running site holds open (its RocksDB locked): a batch job
    reads a checkpoint of it instead, or the folder once the site has stopped."""


class GcPlanRefusedError(StorageError):
    """A generation GC plan the site will not apply: not for this site or database,
    malformed, or older than the data (made from a checkpoint older than one whose
    plan was applied already)."""


class CorruptDataError(StorageError):
    """Stored bytes that do not decode: a bug or a damaged disk, never bad input."""


class StorageClosedError(StorageError):
    """The storage is starting, closing or closed: retry against a running site."""

    recoverable = True


class StorageBusyError(StorageError):
    """A shard cannot take more now (its write buffer is full): retry later."""

    recoverable = True


class StorageTimeoutError(StorageError):
    """A storage operation did not finish in time; it may succeed when retried."""

    recoverable = True


class WriteAbandonedError(StorageError):
    """A write queued behind one that failed was dropped unwritten, so that it cannot
    be committed before the failed one is sent again: retry it after that one."""

    recoverable = True


class ForwardRefusedError(StorageError):
    """A write another site forwarded to this site as its shard's leader, refused
    unwritten because this site stopped leading first: passing it on to the next
    leader could wait behind the sender's own forward, so the sender writes it again
    there."""

    recoverable = True


class PlacementError(StratamqError):
    """A placement document (replica sets, leaders, epochs) that is not valid, or a
    change that does not apply to it (adding a site that already holds the shard)."""


class StalePlacementError(PlacementError):
    """A placement older than (or conflicting with) the one a site keeps: the newest
    version wins, so an older one pushed later is refused."""


class PlanError(StratamqError):
    """A replication request that no plan can satisfy; the message says why."""


class NotEnoughSitesError(PlanError):
    """Fewer sites that may hold replicas than the replication factor asks for."""


class UnknownSiteError(PlanError):
    """A site id that is not among the sites the request or the cluster knows."""


class LastReplicaError(PlanError):
    """A change that would leave a shard with no replica at all."""


class SiteStateError(PlanError):
    """A request the site's state forbids now: forgetting a site that is up or still
    holds replicas, placing a replica on a site that is down."""


class ControllerFencedError(StratamqError):
    """A request to a controller that the sites fenced: they hold a newer controller's
    term, so this one decides nothing (ask the newer one)."""


class ClusterNotReadyError(StratamqError):
    """The controller has no placement yet (too few sites have answered)."""

    recoverable = True


class NoMajorityError(StratamqError):
    """A shard whose alive replicas are no majority of its replica set: no new leader
    can be chosen without risking acknowledged writes; retry when more are back."""

    recoverable = True
