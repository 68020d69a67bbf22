"""Typed errors. Each carries the MQTT 5 reason code and HTTP status it maps to,
so a listener or the admin API can answer without guessing."""

from __future__ import annotations


class StratamqError(Exception):
    """Base of every error stratamq raises on purpose."""

    mqtt_reason_code: int = 0x80  # Unspecified error
    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidTopicError(StratamqError):
    mqtt_reason_code = 0x90  # Topic Name invalid
    http_status = 400


class InvalidTopicFilterError(StratamqError):
    mqtt_reason_code = 0x8F  # Topic Filter invalid
    http_status = 400


class PayloadTooLargeError(StratamqError):
    mqtt_reason_code = 0x95  # Packet too large
    http_status = 413


class InvalidMessageError(StratamqError):
    """A message the storage refuses as a whole (bad QoS, bad property value)."""

    mqtt_reason_code = 0x81  # Malformed Packet
    http_status = 400


class UnknownDatabaseError(StratamqError):
    mqtt_reason_code = 0x80
    http_status = 404


class InvalidIteratorError(StratamqError):
    """Iterator bytes that do not decode, or point at nothing this site has."""

    mqtt_reason_code = 0x80
    http_status = 400


class GenerationError(StratamqError):
    """A generation operation that the shard refuses (drop the current one, unknown id)."""

    mqtt_reason_code = 0x80
    http_status = 409


class CorruptDataError(StratamqError):
    """Stored bytes that do not decode: a bug or a damaged disk, never bad input."""

    mqtt_reason_code = 0x80
    http_status = 500


class StorageClosedError(StratamqError):
    mqtt_reason_code = 0x88  # Server unavailable
    http_status = 503


class ConfigError(StratamqError):
    """Bad configuration: the message names the key and says why."""

    mqtt_reason_code = 0x80
    http_status = 500
