"""The MQTT edge's choice of reason code for an error (MQTT 5.0 section 2.4)."""

from __future__ import annotations

from ..errors import (
    InvalidMessageError,
    InvalidTopicError,
    InvalidTopicFilterError,
    PayloadTooLargeError,
    StorageBusyError,
    StratamqError,
)
from .errors import MqttCodecError
from .reason_codes import ReasonCode

_BY_TYPE: dict[type[StratamqError], int] = {
    InvalidTopicError: ReasonCode.TOPIC_NAME_INVALID,
    InvalidTopicFilterError: ReasonCode.TOPIC_FILTER_INVALID,
    PayloadTooLargeError: ReasonCode.PACKET_TOO_LARGE,
    InvalidMessageError: ReasonCode.MALFORMED_PACKET,
    StorageBusyError: ReasonCode.SERVER_BUSY,
}


def mqtt_reason_code(error: StratamqError) -> int:
    """The reason code to answer `error` with: the codec's own for bad packets;
    Server unavailable for what may work later; Unspecified error otherwise."""
    if isinstance(error, MqttCodecError):
        return error.mqtt_reason_code
    for kind in type(error).__mro__:
        code = _BY_TYPE.get(kind)
        if code is not None:
            return int(code)
    return int(ReasonCode.SERVER_UNAVAILABLE if error.recoverable
               else ReasonCode.UNSPECIFIED_ERROR)


def disconnect_reason_code(error: StratamqError) -> int:
    """`mqtt_reason_code` for a DISCONNECT, which has no Server unavailable (0x88 is
    a CONNACK's only, MQTT 5.0 3.14.2.1: a client's decoder may refuse it there):
    Server busy says the same in a DISCONNECT, that the client may try again later."""
    code = mqtt_reason_code(error)
    return int(ReasonCode.SERVER_BUSY) if code == ReasonCode.SERVER_UNAVAILABLE else code
