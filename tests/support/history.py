"""A history of what MQTT clients published, had acknowledged and received, and a
checker over it (issue 7, "A history checker"; docs/architecture.md "Guarantees" 1 and 2).

Pure: no sockets, no clients, no clock. Clients (tests/support/recorder.py for paho)
report events into a `History` from any thread; every event gets the next number of
one counter, so "before" and "after" below mean the order in which the events were
recorded in this process.

A payload names its message: `Message(publisher, topic, qos, seq).encode()`; `seq`
counts per (publisher, topic, QoS) from 0.

What `check()` demands (and `problems()` lists):

1. **No acknowledged message lost.** A message whose PUBACK / PUBCOMP (a success, or
   PUBCOMP 0x92 "packet identifier not found" for a resent PUBREL) the publisher
   received must reach every subscriber session that should have it: a session with a
   subscription whose filter matches the topic, granted (SUBACK) before the message
   was handed to the publishing client. Sessions that cannot keep that promise are
   exempt: a non-durable session (clean start, or session expiry 0) once its
   connection ended, since MQTT discards such a session with its queue, and a session
   its client replaced with a clean start. A durable session that a reconnect finds
   gone (CONNACK session present 0) is a failure of its own ("session lost"); it must
   still have had what was published before that reconnect.
2. **QoS 2 exactly once.** A subscriber session's application receives a message
   delivered at QoS 2 at most once (paho hands QoS 2 to the application on PUBREL, so
   a PUBLISH resent with DUP before that is not a delivery).
3. **Order**, per subscriber session and (publisher, topic, QoS published). MQTT 5
   4.6 makes every topic an Ordered Topic for non-shared subscriptions: the server
   sends PUBLISH packets to a consumer, for the same topic and QoS, in the order it
   received them from a given client [MQTT-4.6.0-5, -6], and re-sends PUBLISH packets
   in the order of the original sends [MQTT-4.6.0-1]; its note spells out what a
   subscriber may see: "1,2,3,2,3,4" after a disconnection, so that "the final copy
   of each message received ... will be in the order that they were published". The
   key holds the published QoS: 4.6 orders per QoS, so a QoS 1 and a QoS 2 message
   of one publisher and topic may pass each other. Precisely, with H the highest
   seq this session received for the key before:
   A QoS 2 delivery of a message received before is left out here (rule 2 reports
   it), so order is judged on first deliveries at QoS 2.
   a. a delivery with seq <= H is a re-delivery: allowed only of a seq this session
      received before (a first delivery never comes after a newer one).
      A re-delivery must carry the DUP flag (MQTT-3.3.1-1), but a site killed with
      -9 forgets what it had sent and not yet recorded, and sends it again after the
      restart as a first attempt, DUP 0 (the single-site crash test accepts that
      too). So DUP is demanded only with `History(dup_required=True)`; otherwise
      re-deliveries without DUP are counted in `summary()`;
   b. taking for each seq its last delivery, these come in increasing seq order (the
      note's "final copy" rule: a resend of 2, 3 after 4 would break it).
   Gaps are not order violations: a message never delivered is rule 1's business
   (and a gap filled later breaks 3a).
4. **Nothing from nowhere.** Every delivery names a message some publisher handed to
   its client, on the topic it was published to.

Shared subscriptions and "no local" are not modelled.
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass, field

EXAMPLES = 5  # examples shown per kind of failure in a report


@dataclass(frozen=True, slots=True, order=True)
class Message:
    """What a payload says: who sent it, on which topic, at which QoS, its number."""

    publisher: str
    topic: str
    qos: int
    seq: int

    def encode(self) -> bytes:
        return f"{self.publisher}|{self.topic}|{self.qos}|{self.seq}".encode()

    @classmethod
    def decode(cls, payload: bytes) -> Message | None:
        """None for a payload not in this form."""
        try:
            publisher, topic, qos, seq = payload.decode().split("|")
            return cls(publisher, topic, int(qos), int(seq))
        except ValueError:
            return None

    @property
    def key(self) -> tuple[str, str, int]:
        return self.publisher, self.topic, self.qos

    def __str__(self) -> str:
        return f"{self.publisher}/{self.topic}/q{self.qos}#{self.seq}"


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 5 4.7: `+` one level, `#` the rest (also the parent level), and no
    wildcard at the first level matches a topic starting with `$`."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    levels = topic.split("/")
    parts = topic_filter.split("/")
    for index, part in enumerate(parts):
        if part == "#":
            return True
        if index >= len(levels):
            return False
        if part != "+" and part != levels[index]:
            return False
    return len(parts) == len(levels)


@dataclass(slots=True)
class Delivery:
    at: int
    payload: bytes
    topic: str
    qos: int
    dup: bool
    message: Message | None


@dataclass(slots=True)
class Subscription:
    topic_filter: str
    granted_qos: int
    at: int  # the SUBACK's event number


@dataclass(slots=True)
class Session:
    subscriber: str
    number: int  # 0, 1, ... per subscriber: a new one at each clean start or lost session
    durable: bool
    subscriptions: list[Subscription] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    ended_at: int | None = None  # a non-durable session's connection ended here
    lost: bool = False  # a reconnect found this durable session gone

    @property
    def name(self) -> str:
        return f"{self.subscriber}[{self.number}]"


@dataclass(slots=True)
class Publication:
    at: int  # when the message was handed to the client
    acked_at: int | None = None
    refused: int | None = None  # the reason code of a refusal


class History:
    """Thread-safe: clients record from their network threads."""

    def __init__(self, *, dup_required: bool = False) -> None:
        self.dup_required = dup_required
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self.publications: dict[Message, Publication] = {}
        self.sessions: dict[str, list[Session]] = {}  # subscriber -> its sessions, in order
        self.connects: collections.Counter[str] = collections.Counter()
        # subscriber -> the event numbers of its CONNACKs (to place a breach in time)
        self.connected_at: dict[str, list[int]] = collections.defaultdict(list)

    # -- publishers -------------------------------------------------------------------

    def published(self, message: Message) -> None:
        """The message was handed to the publishing client (it sends it now or after
        a reconnect)."""
        with self._lock:
            if message in self.publications:
                raise ValueError(f"{message} published twice: sequence numbers repeat")
            self.publications[message] = Publication(next(self._clock))

    def acknowledged(self, message: Message) -> None:
        """PUBACK (QoS 1) or PUBCOMP (QoS 2) with success arrived."""
        with self._lock:
            self.publications[message].acked_at = next(self._clock)

    def refused(self, message: Message, reason_code: int) -> None:
        with self._lock:
            self.publications[message].refused = reason_code

    # -- subscribers ------------------------------------------------------------------

    def connected(self, subscriber: str, *, clean_start: bool, durable: bool,
                  session_present: bool) -> None:
        """A successful CONNACK. `durable`: session expiry > 0 (and never shorter than
        the test), so the session must outlive every disconnection."""
        with self._lock:
            at = next(self._clock)
            self.connects[subscriber] += 1
            self.connected_at[subscriber].append(at)
            sessions = self.sessions.setdefault(subscriber, [])
            current = sessions[-1] if sessions else None
            if current is not None and not clean_start and session_present:
                return  # the same session resumed
            if current is not None and current.durable and not clean_start:
                current.lost = True
            if current is not None and current.ended_at is None:
                current.ended_at = at
            sessions.append(Session(subscriber, len(sessions), durable))

    def subscribed(self, subscriber: str, topic_filter: str, granted_qos: int) -> None:
        """A SUBACK granting `granted_qos` (< 0x80) for `topic_filter`."""
        with self._lock:
            self._current(subscriber).subscriptions.append(
                Subscription(topic_filter, granted_qos, next(self._clock)))

    def received(self, subscriber: str, topic: str, payload: bytes, qos: int,
                 dup: bool) -> None:
        """The client handed a message to its application."""
        with self._lock:
            self._current(subscriber).deliveries.append(
                Delivery(next(self._clock), payload, topic, qos, dup,
                         Message.decode(payload)))

    def disconnected(self, subscriber: str) -> None:
        """The connection ended (either side, cleanly or not)."""
        with self._lock:
            session = self._current(subscriber)
            if not session.durable and session.ended_at is None:
                session.ended_at = next(self._clock)

    def _current(self, subscriber: str) -> Session:
        sessions = self.sessions.get(subscriber)
        if not sessions:
            raise ValueError(f"{subscriber} recorded an event before its first CONNACK")
        return sessions[-1]

    # -- the checks -------------------------------------------------------------------

    def acknowledged_messages(self) -> list[Message]:
        with self._lock:
            return sorted(m for m, p in self.publications.items() if p.acked_at is not None)

    def published_messages(self) -> list[Message]:
        with self._lock:
            return sorted(self.publications)

    def missing(self) -> dict[str, list[Message]]:
        """Session name -> acknowledged messages it should have and has not (yet):
        poll this until it is empty before `check()`."""
        with self._lock:
            return self._missing()

    def _missing(self) -> dict[str, list[Message]]:
        acked = [(m, p) for m, p in self.publications.items() if p.acked_at is not None]
        found: dict[str, list[Message]] = {}
        for session in self._all_sessions():
            if session.ended_at is not None and not session.lost:
                continue  # ended by the client or with its connection: exempt
            received = {d.message for d in session.deliveries}
            lost = sorted(m for m, p in acked
                          if m not in received and _should_have(session, m, p))
            if lost:
                found[session.name] = lost
        return found

    def _all_sessions(self) -> list[Session]:
        return [s for sessions in self.sessions.values() for s in sessions]

    def problems(self) -> list[str]:
        """Every violation of the rules in the module docstring, one line per kind and
        session, with examples."""
        return [line for lines in self.problems_by_kind().values() for line in lines]

    def problems_by_kind(self) -> dict[str, list[str]]:
        """The violations under their rule: "session lost", "lost" (rule 1), "QoS 2
        duplicate" (2), "order" (3), "unknown" (4); only kinds that occur."""
        with self._lock:
            found: dict[str, list[str]] = collections.defaultdict(list)
            for session in self._all_sessions():
                if session.lost:
                    found["session lost"].append(
                        f"{session.name}: durable session lost (a reconnect got session "
                        "present 0)")
            for name, lost in sorted(self._missing().items()):
                found["lost"].append(f"{name}: {len(lost)} acknowledged messages never "
                                     f"delivered: {runs_of(lost)}")
            for session in self._all_sessions():
                for kind, lines in self._delivery_problems(session).items():
                    found[kind] += lines
            return dict(found)

    def _timeline(self, session: Session, deliveries: list[Delivery]) -> str:
        """Around the first order breach of one key: for each delivery, its seq, the
        event numbers of its publication, acknowledgement and arrival, and DUP; then
        the subscriber's CONNACKs. Event numbers order everything the clients saw."""
        index = _first_breach(deliveries)
        if index is None:
            return f"  {session.name}: no breach to place"
        rows = []
        for delivery in deliveries[max(index - 3, 0):index + 3]:
            assert delivery.message is not None
            publication = self.publications.get(delivery.message)
            published = "?" if publication is None else publication.at
            acked = "?" if publication is None else publication.acked_at
            rows.append(f"{delivery.message.seq} (published {published}, acked {acked}, "
                        f"arrived {delivery.at}{', DUP' if delivery.dup else ''})")
        return (f"  timeline of {session.name}: " + "; ".join(rows)
                + f"; its CONNACKs at {self.connected_at.get(session.subscriber, [])}")

    def _delivery_problems(self, session: Session) -> dict[str, list[str]]:
        found: dict[str, list[str]] = collections.defaultdict(list)
        unknown = [d for d in session.deliveries
                   if d.message is None or d.message not in self.publications
                   or d.message.topic != d.topic]
        if unknown:
            found["unknown"].append(
                f"{session.name}: {len(unknown)} deliveries of messages never published, "
                f"e.g. {[(d.topic, d.payload) for d in unknown[:EXAMPLES]]}")
        by_key: dict[tuple[str, str, int], list[Delivery]] = collections.defaultdict(list)
        for delivery in session.deliveries:
            if delivery.message is not None:
                by_key[delivery.message.key].append(delivery)
        twice: list[str] = []
        for key, deliveries in sorted(by_key.items()):
            twice += _qos2_duplicates(deliveries)
            problems = _order_problems(deliveries, self.dup_required)
            found["order"] += [f"{session.name} {'/'.join(map(str, key))}: {problem}"
                               for problem in problems]
            if problems:
                found["order"].append(self._timeline(session, deliveries))
        if twice:
            found["QoS 2 duplicate"].append(
                f"{session.name}: {len(twice)} QoS 2 messages delivered more than once, "
                f"e.g. {_examples(twice)}")
        return {kind: lines for kind, lines in found.items() if lines}

    def summary(self) -> str:
        with self._lock:
            publications = self.publications.values()
            sessions = self._all_sessions()
            return (f"published {len(self.publications)}, "
                    f"acknowledged {sum(p.acked_at is not None for p in publications)}, "
                    f"refused {sum(p.refused is not None for p in publications)}; "
                    f"{len(sessions)} subscriber sessions received "
                    f"{sum(len(s.deliveries) for s in sessions)} "
                    f"({sum(d.dup for s in sessions for d in s.deliveries)} with DUP, "
                    f"{sum(map(_redeliveries_without_dup, sessions))} re-deliveries "
                    "without DUP); "
                    f"connects {dict(self.connects)}")

    def check(self) -> None:
        """Raise AssertionError with a readable report on any violation."""
        found = self.problems()
        if found:
            raise AssertionError("history check failed: " + self.summary() + "\n"
                                 + "\n".join(f"- {line}" for line in found))


def _should_have(session: Session, message: Message, publication: Publication) -> bool:
    if session.ended_at is not None and publication.at > session.ended_at:
        return False  # after a lost session's end: its subscriptions went with it
    return any(s.at < publication.at and topic_matches(s.topic_filter, message.topic)
               for s in session.subscriptions)


def _first_breach(deliveries: list[Delivery]) -> int | None:
    """The index of the first delivery of a seq below one delivered before it."""
    highest = -1
    for index, delivery in enumerate(deliveries):
        assert delivery.message is not None
        if delivery.message.seq < highest:
            return index
        highest = max(highest, delivery.message.seq)
    return None


def _qos2_duplicates(deliveries: list[Delivery]) -> list[str]:
    counts = collections.Counter(d.message for d in deliveries if d.qos == 2)
    return [str(m) for m, n in sorted(counts.items(), key=lambda i: str(i[0])) if n > 1]


def _order_problems(deliveries: list[Delivery], dup_required: bool) -> list[str]:
    """Rules 3a and 3b for the deliveries of one key, in arrival order; at most one
    report per rule (the first breach), with the neighbourhood of seqs."""
    deliveries = _without_qos2_repeats(deliveries)
    seqs = [d.message.seq for d in deliveries if d.message is not None]
    found = []
    seen: set[int] = set()
    highest = -1
    for index, delivery in enumerate(deliveries):
        assert delivery.message is not None
        seq = delivery.message.seq
        if seq <= highest:
            why = ("never delivered before" if seq not in seen else
                   "without DUP" if dup_required and not delivery.dup else "")
            if why:
                found.append(f"{seq} came after {highest} {why} "
                             f"(seqs ...{_window(seqs, index)})")
                break
        seen.add(seq)
        highest = max(highest, seq)
    last_at = {d.message.seq: index for index, d in enumerate(deliveries)
               if d.message is not None}
    finals = [seq for seq, _ in sorted(last_at.items(), key=lambda item: item[1])]
    for index in range(1, len(finals)):
        if finals[index] < finals[index - 1]:
            found.append(f"final copies out of order: {finals[index]} last arrived after "
                         f"{finals[index - 1]} (final seqs ...{_window(finals, index)})")
            break
    return found


def _without_qos2_repeats(deliveries: list[Delivery]) -> list[Delivery]:
    """Order is judged on first deliveries at QoS 2: a repeat breaks rule 2 already."""
    seen: set[Message] = set()
    kept = []
    for delivery in deliveries:
        if delivery.qos == 2 and delivery.message in seen:
            continue
        if delivery.message is not None:
            seen.add(delivery.message)
        kept.append(delivery)
    return kept


def _redeliveries_without_dup(session: Session) -> int:
    seen: set[Message] = set()
    count = 0
    for delivery in session.deliveries:
        if delivery.message in seen and not delivery.dup:
            count += 1
        if delivery.message is not None:
            seen.add(delivery.message)
    return count


def _window(seqs: list[int], index: int) -> list[int]:
    return seqs[max(index - 6, 0):index + 3]


def runs_of(messages: list[Message]) -> str:
    """Messages as runs of seqs per publisher, topic and QoS: `pub/t/q1#3-9 (7)`."""
    by_key: dict[tuple[str, str, int], list[int]] = collections.defaultdict(list)
    for message in messages:
        by_key[(message.publisher, message.topic, message.qos)].append(message.seq)
    runs = []
    for (publisher, topic, qos), seqs in sorted(by_key.items()):
        seqs.sort()
        start = previous = seqs[0]
        for seq in [*seqs[1:], None]:
            if seq is not None and seq == previous + 1:
                previous = seq
                continue
            span = f"{start}" if start == previous else f"{start}-{previous}"
            runs.append(f"{publisher}/{topic}/q{qos}#{span} ({previous - start + 1})")
            if seq is not None:
                start = previous = seq
    shown = ", ".join(runs[:3 * EXAMPLES])
    return shown + (f", ... ({len(runs)} runs)" if len(runs) > 3 * EXAMPLES else "")


def _examples(items: list[Message] | list[str]) -> str:
    shown = ", ".join(str(item) for item in items[:EXAMPLES])
    return shown + (", ..." if len(items) > EXAMPLES else "")
