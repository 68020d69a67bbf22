"""Broker metrics (prometheus-client). Storage metrics live in `ds/metrics.py`; the
`/metrics` endpoint serves both."""

from __future__ import annotations

from functools import cache

from prometheus_client import Counter, Gauge

CONNECTIONS = Gauge("stratamq_connections", "Open client connections", ("listener",))
PACKETS_RECEIVED = Counter("stratamq_packets_received", "MQTT packets received", ("type",))
PACKETS_SENT = Counter("stratamq_packets_sent", "MQTT packets sent", ("type",))
BYTES_RECEIVED = Counter("stratamq_bytes_received", "Bytes received from clients")
BYTES_SENT = Counter("stratamq_bytes_sent", "Bytes sent to clients")
MESSAGES_RECEIVED = Counter("stratamq_messages_received", "PUBLISH messages accepted",
                            ("qos",))
MESSAGES_DELIVERED = Counter("stratamq_messages_delivered", "PUBLISH messages sent to clients",
                             ("qos",))
MESSAGES_DROPPED = Counter("stratamq_messages_dropped", "Messages not delivered", ("reason",))
SESSION_MESSAGES_EXPIRED = Counter(
    "stratamq_session_messages_expired",
    "Messages durable sessions lost before delivering them", ("reason",))
SESSIONS = Gauge("stratamq_sessions", "Sessions held in memory", ("kind",))
BACKGROUND_FAILURES = Counter("stratamq_background_failures",
                              "Failures of background loops and tasks (each restarted)",
                              ("loop",))
IN_FLIGHT = Gauge("stratamq_in_flight", "Outbound QoS 1/2 messages awaiting acknowledgement")


# `.labels()` validates and locks on every call; the broker counts every packet, so
# it keeps the labelled children it has made.
@cache
def packets_received(kind: str) -> Counter:
    return PACKETS_RECEIVED.labels(kind)


@cache
def packets_sent(kind: str) -> Counter:
    return PACKETS_SENT.labels(kind)


@cache
def messages_received(qos: int) -> Counter:
    return MESSAGES_RECEIVED.labels(str(qos))


@cache
def messages_delivered(qos: int) -> Counter:
    return MESSAGES_DELIVERED.labels(str(qos))
