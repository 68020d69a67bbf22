"""Errors say whether they are recoverable; the edges choose codes and statuses."""

from __future__ import annotations

import pytest

from stratamq.broker.admin.http_errors import UnknownClientError, http_status
from stratamq.broker.errors import (
    CorruptDataError,
    GenerationError,
    InvalidIteratorError,
    InvalidTopicError,
    LastReplicaError,
    NoMajorityError,
    NotEnoughSitesError,
    PayloadTooLargeError,
    PlacementError,
    StalePlacementError,
    StorageBusyError,
    StorageClosedError,
    StorageTimeoutError,
    StratamqError,
    UnknownDatabaseError,
    UnknownSiteError,
)
from stratamq.broker.mqtt import MQTT_5, Disconnect, PacketReader, encode
from stratamq.broker.mqtt.error_codes import disconnect_reason_code, mqtt_reason_code
from stratamq.broker.mqtt.errors import MalformedPacketError, PacketTooLargeError


@pytest.mark.parametrize(("error", "recoverable", "reason", "status"), [
    (StorageClosedError("x"), True, 0x88, 503),
    (StorageBusyError("x"), True, 0x89, 429),
    (StorageTimeoutError("x"), True, 0x88, 504),
    (CorruptDataError("x"), False, 0x80, 500),
    (UnknownDatabaseError("x"), False, 0x80, 404),
    (InvalidIteratorError("x"), False, 0x80, 400),
    (GenerationError("x"), False, 0x80, 409),
    (InvalidTopicError("x"), False, 0x90, 400),
    (PayloadTooLargeError("x"), False, 0x95, 413),
    (MalformedPacketError("x"), False, 0x81, 400),
    (PacketTooLargeError("x"), False, 0x95, 413),
    (UnknownClientError("x"), False, 0x80, 404),
    (UnknownSiteError("x"), False, 0x80, 404),
    (NotEnoughSitesError("x"), False, 0x80, 400),
    (LastReplicaError("x"), False, 0x80, 400),
    (PlacementError("x"), False, 0x80, 400),
    (StalePlacementError("x"), False, 0x80, 409),
    (NoMajorityError("x"), True, 0x88, 503),
])
def test_recoverable_reason_code_and_status(error: StratamqError, recoverable: bool,
                                            reason: int, status: int) -> None:
    assert error.recoverable is recoverable
    assert mqtt_reason_code(error) == reason
    assert http_status(error) == status
    # What a connection is closed with is a DISCONNECT's code (0x88 is a CONNACK's
    # only): a client decodes it.
    code = disconnect_reason_code(error)
    assert code == (0x89 if reason == 0x88 else reason)
    [decoded] = PacketReader(1 << 20, protocol_level=MQTT_5).decode(
        encode(Disconnect(code), MQTT_5))
    assert decoded == Disconnect(code)
