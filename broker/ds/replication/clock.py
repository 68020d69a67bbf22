"""How far each peer's wall clock is from this site's, estimated from the peer port's
answers (docs/replication.md, "Clock skew").

Every answer of a peer port carries the peer's wall clock when it answered
(`TIME_HEADER`, seconds). With this site's wall clock when the request left (t0) and
when the answer came (t3), the peer's clock runs `peer - (t0 + t3) / 2` ahead of
this site's, within half the round trip (NTP's offset estimate, with the peer's
receive and send times taken as one). Each request to a peer gives one estimate;
the estimate of the fastest round trip of the last `WINDOW` seconds is kept (the
tightest bound), so a slow answer does not move it.

What uses it: deadlines sent to a peer (a forwarded write, a release of a client id)
are stated in that peer's clock, so a site whose clock is off neither refuses writes
as expired nor takes late ones; the retained messages a SUBSCRIBE sends take those
set up to `largest_lead` past its time (set on a site whose clock runs ahead, they
carry a later time though they came before the subscription's routes). The offsets
are reported (`status`, the metric
`stratamq_ds_peer_clock_offset_seconds`) and a warning logged once an offset passes
`CLOCK_SKEW_WARNING` beyond its uncertainty: message timestamps, and the broker's
times compared with them, are wall clocks of the site that made them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp
from prometheus_client import Gauge

log = logging.getLogger(__name__)

TIME_HEADER = "X-Stratamq-Time"
# Estimates are kept this long; the one of the fastest round trip among them counts.
WINDOW = 30.0
# Past this (seconds, beyond the estimate's uncertainty) a peer's clock is warned of.
CLOCK_SKEW_WARNING = 0.5

PEER_CLOCK_OFFSET = Gauge(
    "stratamq_ds_peer_clock_offset_seconds",
    "How far a peer site's wall clock runs ahead of this site's (negative: behind), "
    "estimated from its peer port's answers", ("peer",))


@dataclass(frozen=True, slots=True)
class Estimate:
    offset: float  # seconds the peer's clock runs ahead of this site's
    round_trip: float  # seconds; the offset is right within half of it
    at: float  # this site's monotonic clock when it was made

    @property
    def uncertainty(self) -> float:
        return self.round_trip / 2


def estimate(sent: float, peer_time: float, received: float, round_trip: float,
             at: float) -> Estimate:
    """The offset of a peer that answered at `peer_time` (its wall clock) a request
    sent at `sent` and answered at `received` (this site's wall clock)."""
    return Estimate(peer_time - (sent + received) / 2, max(0.0, round_trip), at)


def better(kept: Estimate | None, new: Estimate, window: float = WINDOW) -> Estimate:
    """The estimate to keep: the new one unless the kept one is recent and came from
    a faster round trip."""
    if kept is None or new.at - kept.at > window or new.round_trip <= kept.round_trip:
        return new
    return kept


class ClockOffsets:
    """The peers' clock offsets as this site's peer client sees them, by peer address
    (host:port). `trace_config()` goes to the peer client's aiohttp session."""

    def __init__(self, warn_beyond: float = CLOCK_SKEW_WARNING) -> None:
        self._estimates: dict[str, Estimate] = {}
        self._warned: set[str] = set()
        self._warn_beyond = warn_beyond

    def offset(self, address: str) -> float:
        """Seconds the clock of the peer at `address` runs ahead of this site's (0
        before it answered anything)."""
        kept = self._estimates.get(address)
        return 0.0 if kept is None else kept.offset

    def largest_lead(self) -> float:
        """Seconds the clock of the peer furthest ahead may run ahead of this site's
        (its offset plus that estimate's uncertainty; 0 when none runs ahead)."""
        return max([0.0, *(kept.offset + kept.uncertainty
                            for kept in self._estimates.values())])

    def peer_time(self, address: str, local: float) -> float:
        """This site's wall clock time `local` in the clock of the peer at `address`."""
        return local + self.offset(address)

    def status(self) -> dict[str, dict[str, float]]:
        return {address: {"offset": round(kept.offset, 4),
                          "uncertainty": round(kept.uncertainty, 4)}
                for address, kept in sorted(self._estimates.items())}

    def observe(self, address: str, new: Estimate) -> None:
        kept = better(self._estimates.get(address), new)
        self._estimates[address] = kept
        PEER_CLOCK_OFFSET.labels(address).set(kept.offset)
        skewed = abs(kept.offset) - kept.uncertainty > self._warn_beyond
        if skewed and address not in self._warned:
            self._warned.add(address)
            log.warning("the clock of peer %s runs %.3fs %s of this site's (within %.3fs): "
                        "message timestamps, and the broker's times compared with them, "
                        "are each site's wall clock; synchronise the clocks (NTP)", address,
                        abs(kept.offset), "ahead" if kept.offset > 0 else "behind",
                        kept.uncertainty)
        elif not skewed and address in self._warned:
            self._warned.discard(address)
            log.info("the clock of peer %s is within %.3fs of this site's again", address,
                     abs(kept.offset) + kept.uncertainty)

    def answered(self, address: str, sent: float, sent_monotonic: float, peer_time: float,
                 received: float, received_monotonic: float) -> None:
        """A request to `address` sent at `sent` (wall clock; `sent_monotonic`) was
        answered at `received` with the peer's wall clock `peer_time`: one more
        estimate of its offset."""
        self.observe(address, estimate(sent, peer_time, received,
                                       received_monotonic - sent_monotonic,
                                       received_monotonic))

    def trace_config(self) -> aiohttp.TraceConfig:
        """Hooks that make an estimate from every answer that carries the header."""
        trace = aiohttp.TraceConfig()

        async def started(_session: aiohttp.ClientSession, context: SimpleNamespace,
                          _params: aiohttp.TraceRequestStartParams) -> None:
            context.sent = time.time()
            context.sent_monotonic = time.monotonic()

        async def ended(_session: aiohttp.ClientSession, context: SimpleNamespace,
                        params: aiohttp.TraceRequestEndParams) -> None:
            received, received_monotonic = time.time(), time.monotonic()
            raw = params.response.headers.get(TIME_HEADER)
            sent = getattr(context, "sent", None)
            if raw is None or sent is None:
                return
            try:
                peer_time = float(raw)
            except ValueError:
                return
            self.answered(f"{params.url.host}:{params.url.port}", sent,
                          context.sent_monotonic, peer_time, received, received_monotonic)

        trace.on_request_start.append(started)
        trace.on_request_end.append(ended)
        return trace
