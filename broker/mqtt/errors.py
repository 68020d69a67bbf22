"""Errors the MQTT codec raises. Each carries the MQTT 5 reason code a listener sends in
CONNACK or DISCONNECT before it closes the connection (MQTT 5.0 section 4.13)."""

from __future__ import annotations

from ..errors import StratamqError


class MqttCodecError(StratamqError):
    """Base of the codec's errors: the bytes a peer sent are not acceptable MQTT."""

    mqtt_reason_code = 0x80


class MalformedPacketError(MqttCodecError):
    """The bytes cannot be parsed according to the specification."""

    mqtt_reason_code = 0x81


class ProtocolError(MqttCodecError):
    """The packet parses, but holds data the protocol does not allow."""

    mqtt_reason_code = 0x82


class PacketTooLargeError(MqttCodecError):
    mqtt_reason_code = 0x95


class UnsupportedProtocolVersionError(MqttCodecError):
    """A CONNECT for a protocol name or level this broker does not speak.

    `protocol_level` is the level byte the client sent (None when the packet ended before
    it): a listener answers a CONNACK encoded at level 4 with return code 1 for anything
    but level 5, since that two-byte CONNACK is the one every MQTT version understands."""

    mqtt_reason_code = 0x84

    def __init__(self, message: str, protocol_level: int | None = None) -> None:
        super().__init__(message)
        self.protocol_level = protocol_level
