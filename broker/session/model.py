"""The records a session is made of, and their persisted (JSON) form. Pure.

A session is stored as a head (its scalars, wills and in-flight packet ids) and one
part per subscription, cursor and finished cursor (`SessionStore` keys them), so a
change writes the head and the parts that changed (`changed_names`), not the whole
session."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ..ds import Message, MessageProperties, Stream
from ..topic import SHARE_PREFIX

_T = TypeVar("_T")

# A session expiry interval at which the session never expires (MQTT 5.0 3.1.2.11.2).
NEVER_EXPIRES = 2**32 - 1


@dataclass(slots=True)
class Subscription:
    """One subscription of a session. `topic_filter` is what topics are matched against
    (without a `$share/group/` prefix); `share_group` is set for shared ones."""

    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    identifier: int | None = None
    share_group: str | None = None
    since: int = 0  # µs: a durable session replays from here

    @property
    def key(self) -> str:
        """The filter as the client wrote it: the identity of the subscription."""
        if self.share_group is None:
            return self.topic_filter
        return f"{SHARE_PREFIX}{self.share_group}/{self.topic_filter}"

    @property
    def group_key(self) -> str:
        """`group/filter` of a shared subscription: the key of its shared group."""
        return f"{self.share_group}/{self.topic_filter}"


def split_shared(raw_filter: str) -> tuple[str | None, str]:
    """`$share/group/a/b` -> ("group", "a/b"); a plain filter -> (None, filter).
    Raises ValueError for a malformed shared filter (MQTT 5.0 section 4.8.2)."""
    if not raw_filter.startswith(SHARE_PREFIX):
        return None, raw_filter
    rest = raw_filter[len(SHARE_PREFIX):]
    group, _, topic_filter = rest.partition("/")
    if not group or "+" in group or "#" in group or not topic_filter:
        raise ValueError(f"malformed shared subscription {raw_filter!r}")
    return group, topic_filter


@dataclass(slots=True)
class WillRecord:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: MessageProperties
    delay: int  # seconds
    # Names this will among its client id's (drawn at random when it is set; 0: stored
    # before wills had one): stored with the message when it is published, so that a
    # publication retried after a failure whose outcome was not known stores it once
    # (`SessionStore.submit_will`, `Publisher.publish_will_once`).
    will_id: int = 0

    def to_message(self, client_id: str) -> Message:
        return Message(self.topic, self.payload, client_id, self.qos, self.retain,
                       self.properties)


@dataclass(slots=True)
class CursorState:
    """Progress of a durable session on one (filter, stream): everything up to
    `position` is done (acknowledged, or sent at QoS 0), and so is each timestamp in
    `done_above` (acknowledged out of order)."""

    position: int
    done_above: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SessionRecord:
    """What the `sessions` database holds for a durable session."""

    client_id: str
    expiry_interval: int
    subscriptions: list[Subscription] = field(default_factory=list)
    cursors: dict[str, CursorState] = field(default_factory=dict)  # cursor key -> state
    # outbound QoS 2 past PUBREC, in PUBREC order (their PUBRELs are resent in it)
    pubrel_pending: list[int] = field(default_factory=list)
    # outbound QoS 1/2 sent and not acknowledged: (packet id, cursor key, timestamp)
    resend: list[tuple[int, str, int]] = field(default_factory=list)
    # cursor keys read to the end of their closed generation and fully acknowledged;
    # kept until that generation is dropped, so the stream is never read again
    done: list[str] = field(default_factory=list)
    will: WillRecord | None = None
    disconnected_at: float | None = None  # wall clock seconds; None while connected
    owner_epoch: int = 0
    username: str | None = None  # who made it: only they may resume it
    # which session of the client id it is (`Session.incarnation`; 0: stored before)
    incarnation: int = 0

    def expired(self, now: float) -> bool:
        return self.disconnected_at is not None and \
            self.disconnected_at + self.expiry_interval <= now

    def as_parts(self) -> StoredParts:
        """Its parts, by name: this record's own objects, so neither may change
        while the other is in use."""
        return StoredParts({subscription.key: subscription
                            for subscription in self.subscriptions},
                           self.cursors, dict.fromkeys(self.done, True))

    def head_to_json(self) -> bytes:
        """Everything but the parts (built field by field: `asdict` would copy every
        subscription and cursor too)."""
        return json.dumps({
            "client_id": self.client_id, "expiry_interval": self.expiry_interval,
            "pubrel_pending": self.pubrel_pending, "resend": self.resend,
            "will": _will_to_json(self.will), "disconnected_at": self.disconnected_at,
            "owner_epoch": self.owner_epoch, "username": self.username,
            "incarnation": self.incarnation,
        }, separators=(",", ":")).encode()

    @classmethod
    def head_from_json(cls, raw: bytes) -> SessionRecord:
        """A stored head (`head_to_json`): the parts are left empty, for the caller to
        fill in."""
        data = json.loads(raw)
        return cls(
            client_id=str(data["client_id"]),
            expiry_interval=int(data["expiry_interval"]),
            pubrel_pending=[int(packet_id) for packet_id in data["pubrel_pending"]],
            resend=_resend_from_json(data["resend"]), will=_will_from_json(data["will"]),
            disconnected_at=data["disconnected_at"], owner_epoch=int(data["owner_epoch"]),
            username=data["username"], incarnation=int(data.get("incarnation", 0)))


@dataclass(slots=True)
class StoredParts:
    """The parts of a session known to be in storage, by name: what the next save
    compares with to write only what changed (`changed_names`). Subscriptions are
    replaced when they change, never changed in place, so most compare by identity."""

    subscriptions: dict[str, Subscription] = field(default_factory=dict)  # by key
    cursors: dict[str, CursorState] = field(default_factory=dict)  # by cursor key
    done: dict[str, bool] = field(default_factory=dict)  # cursor keys: a set, ordered


def changed_names(stored: Mapping[str, _T], current: Mapping[str, _T]
                  ) -> tuple[list[str], list[str]]:
    """(names whose value is new or differs from the stored one, names gone)."""
    changed = []
    for name, value in current.items():
        old = stored.get(name)
        if old is not value and old != value:
            changed.append(name)
    return changed, [name for name in stored if name not in current]


def subscription_to_json(subscription: Subscription) -> bytes:
    return json.dumps(asdict(subscription), separators=(",", ":")).encode()


def subscription_from_json(raw: bytes) -> Subscription:
    return Subscription(**json.loads(raw))


def cursor_to_json(state: CursorState) -> bytes:
    return json.dumps([state.position, state.done_above], separators=(",", ":")).encode()


def cursor_from_json(raw: bytes) -> CursorState:
    position, done_above = json.loads(raw)
    return CursorState(int(position), [int(timestamp) for timestamp in done_above])


def _resend_from_json(data: list[Any]) -> list[tuple[int, str, int]]:
    return [(int(packet_id), str(key), int(timestamp)) for packet_id, key, timestamp in data]


def _will_to_json(will: WillRecord | None) -> dict[str, Any] | None:
    if will is None:
        return None
    data = asdict(will)
    data["payload"] = will.payload.hex()
    data["properties"] = _properties_to_json(will.properties)
    return data


def _will_from_json(data: dict[str, Any] | None) -> WillRecord | None:
    if data is None:
        return None
    return WillRecord(data["topic"], bytes.fromhex(data["payload"]), data["qos"],
                      data["retain"], _properties_from_json(data["properties"]),
                      data["delay"], int(data.get("will_id", 0)))


def cursor_key(topic_filter: str, stream: Stream) -> str:
    return f"{stream.shard}:{stream.generation}:{stream.static.hex()}:{topic_filter}"


def parse_cursor_key(key: str) -> tuple[str, Stream]:
    shard, generation, static, topic_filter = key.split(":", 3)
    return topic_filter, Stream(int(shard), int(generation), bytes.fromhex(static))


def _properties_to_json(properties: MessageProperties) -> dict[str, Any]:
    data = asdict(properties)
    if properties.correlation_data is not None:
        data["correlation_data"] = properties.correlation_data.hex()
    return data


def _properties_from_json(data: dict[str, Any]) -> MessageProperties:
    if data.get("correlation_data") is not None:
        data["correlation_data"] = bytes.fromhex(data["correlation_data"])
    data["user_properties"] = tuple(tuple(pair) for pair in data["user_properties"])
    return MessageProperties(**data)
