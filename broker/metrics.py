"""Broker metrics (prometheus-client). Storage metrics live in `ds/metrics.py`; the
`/metrics` endpoint serves both."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class Tally:
    """One labelled value of a LoopCounter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class LoopCounter(Collector):
    """A Prometheus counter for the per-packet path, counted only on the event loop
    thread: a plain int without the lock (and checks) of prometheus-client's Counter,
    which cost ~270 ns an increment, several times per message. Read at scrape time,
    which runs on the same loop."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = labelnames
        self._tallies: dict[tuple[str, ...], Tally] = {}
        if not labelnames:
            self._tallies[()] = Tally()
        REGISTRY.register(self)

    def labels(self, *values: str) -> Tally:
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name} has labels {self._labelnames}, got {values}")
        tally = self._tallies.get(values)
        if tally is None:
            tally = self._tallies[values] = Tally()
        return tally

    def inc(self, amount: int = 1) -> None:
        self._tallies[()].value += amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._documentation,
                                     labels=list(self._labelnames))
        for values, tally in list(self._tallies.items()):
            family.add_metric(list(values), tally.value)
        yield family


CONNECTIONS = Gauge("stratamq_connections", "Open client connections", ("listener",))
PACKETS_RECEIVED = LoopCounter("stratamq_packets_received", "MQTT packets received",
                               ("type",))
PACKETS_SENT = LoopCounter("stratamq_packets_sent", "MQTT packets sent", ("type",))
BYTES_RECEIVED = LoopCounter("stratamq_bytes_received", "Bytes received from clients")
BYTES_SENT = LoopCounter("stratamq_bytes_sent", "Bytes sent to clients")
MESSAGES_RECEIVED = LoopCounter("stratamq_messages_received", "PUBLISH messages accepted",
                                ("qos",))
MESSAGES_DELIVERED = LoopCounter("stratamq_messages_delivered",
                                 "PUBLISH messages sent to clients", ("qos",))
MESSAGES_DROPPED = Counter("stratamq_messages_dropped", "Messages not delivered", ("reason",))
SESSION_MESSAGES_EXPIRED = Counter(
    "stratamq_session_messages_expired",
    "Messages durable sessions lost before delivering them", ("reason",))
SESSIONS = Gauge("stratamq_sessions", "Sessions held in memory", ("kind",))
BACKGROUND_FAILURES = Counter("stratamq_background_failures",
                              "Failures of background loops and tasks (each restarted)",
                              ("loop",))
IN_FLIGHT = Gauge("stratamq_in_flight", "Outbound QoS 1/2 messages awaiting acknowledgement")
LOGINS_REFUSED = Counter("stratamq_logins_refused",
                         "CONNECTs refused before their password was checked: no room in "
                         "the hash pool (busy) or a source backed off after failures "
                         "(backoff)", ("reason",))
PASSWORD_CHECKS_PENDING = Gauge("stratamq_password_checks_pending",
                                "Password checks waiting for or running on a hash thread")


# The tallies of the per-packet counters, kept so the hot path skips the lookup.
@cache
def packets_received(class_name: str) -> Tally:
    """The tally of a packet class, by its name (label: the name in lower case)."""
    return PACKETS_RECEIVED.labels(class_name.lower())


@cache
def packets_sent(class_name: str) -> Tally:
    return PACKETS_SENT.labels(class_name.lower())


@cache
def messages_received(qos: int) -> Tally:
    return MESSAGES_RECEIVED.labels(str(qos))


@cache
def messages_delivered(qos: int) -> Tally:
    return MESSAGES_DELIVERED.labels(str(qos))
