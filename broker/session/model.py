"""The records a session is made of, and their persisted (JSON) form. Pure."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ds import Message, MessageProperties, Stream
from ..topic import SHARE_PREFIX

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
    pubrel_pending: list[int] = field(default_factory=list)  # outbound QoS 2 after PUBREC
    # outbound QoS 1/2 sent and not acknowledged: (packet id, cursor key, timestamp)
    resend: list[tuple[int, str, int]] = field(default_factory=list)
    # cursor keys read to the end of their closed generation and fully acknowledged;
    # kept until that generation is dropped, so the stream is never read again
    done: list[str] = field(default_factory=list)
    will: WillRecord | None = None
    disconnected_at: float | None = None  # wall clock seconds; None while connected
    owner_epoch: int = 0
    username: str | None = None  # who made it: only they may resume it

    def expired(self, now: float) -> bool:
        return self.disconnected_at is not None and \
            self.disconnected_at + self.expiry_interval <= now

    def to_json(self) -> bytes:
        data = asdict(self)
        if self.will is not None:
            data["will"]["payload"] = self.will.payload.hex()
            data["will"]["properties"] = _properties_to_json(self.will.properties)
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SessionRecord:
        data = json.loads(raw)
        will = data.pop("will")
        record = cls(
            subscriptions=[Subscription(**s) for s in data.pop("subscriptions")],
            cursors={k: CursorState(**v) for k, v in data.pop("cursors").items()},
            resend=[(int(packet_id), str(key), int(timestamp))
                    for packet_id, key, timestamp in data.pop("resend", [])],
            **data)
        if will is not None:
            record.will = WillRecord(
                will["topic"], bytes.fromhex(will["payload"]), will["qos"], will["retain"],
                _properties_from_json(will["properties"]), will["delay"])
        return record


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
