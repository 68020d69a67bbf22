"""The HTTP edge's choice of status for an error, and the admin API's own errors."""

from __future__ import annotations

from ..errors import (
    CheckpointExistsError,
    ConfigError,
    ControllerFencedError,
    CorruptDataError,
    GcPlanRefusedError,
    GenerationError,
    InvalidIteratorError,
    InvalidMessageError,
    InvalidTopicError,
    InvalidTopicFilterError,
    NoMajorityError,
    PayloadTooLargeError,
    PlacementError,
    PlanError,
    SiteStateError,
    StalePlacementError,
    StorageBusyError,
    StorageTimeoutError,
    StratamqError,
    UnknownDatabaseError,
    UnknownSiteError,
)
from ..mqtt.errors import MqttCodecError, PacketTooLargeError


class UnknownClientError(StratamqError):
    pass


class ReplicationOffError(StratamqError):
    """A replication resource on a site that runs without replication."""


class BadRequestError(StratamqError):
    """A request body the API cannot use (not JSON, a missing or wrong field)."""


class ForbiddenPathError(StratamqError):
    """A folder outside those the API may write in."""


class RequestTimeoutError(StratamqError):
    """A request body not received within `admin.body_timeout`."""


_BY_TYPE: dict[type[StratamqError], int] = {
    UnknownClientError: 404,
    ReplicationOffError: 404,
    UnknownSiteError: 404,
    BadRequestError: 400,
    ForbiddenPathError: 403,
    RequestTimeoutError: 408,
    UnknownDatabaseError: 404,
    InvalidTopicError: 400,
    InvalidTopicFilterError: 400,
    InvalidMessageError: 400,
    InvalidIteratorError: 400,
    PacketTooLargeError: 413,
    PayloadTooLargeError: 413,
    MqttCodecError: 400,
    GenerationError: 409,
    PlanError: 400,
    SiteStateError: 409,
    ControllerFencedError: 409,
    PlacementError: 400,
    StalePlacementError: 409,
    NoMajorityError: 503,
    CheckpointExistsError: 409,
    GcPlanRefusedError: 409,
    StorageBusyError: 429,
    StorageTimeoutError: 504,
    CorruptDataError: 500,
    ConfigError: 500,
}


def http_status(error: StratamqError) -> int:
    """The status to answer `error` with: by its kind (the most specific known), else
    503 for what may work when retried and 500 for what will not."""
    for kind in type(error).__mro__:
        status = _BY_TYPE.get(kind)
        if status is not None:
            return status
    return 503 if error.recoverable else 500
