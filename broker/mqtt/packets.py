"""MQTT control packets (MQTT 5.0 chapter 3, MQTT 3.1.1 chapter 3) as plain records.

One class serves every protocol level: fields that only MQTT 5 has (reason codes on
acknowledgements, properties) keep their defaults at levels 3 and 4, and the encoder
leaves them out there.

The classes are mutable slots dataclasses, not frozen ones: a frozen dataclass costs
about five times as much to build in CPython 3.11, and the broker builds one per
message. Treat decoded packets as read-only; the codec never changes a packet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

from .properties import Properties
from .wire import PacketType

# Protocol levels (the CONNECT "Protocol Level" byte): MQTT 3.1 ("MQIsdp"), 3.1.1, 5.0.
MQTT_3_1 = 3
MQTT_3_1_1 = 4
MQTT_5 = 5
PROTOCOL_LEVELS = (MQTT_3_1, MQTT_3_1_1, MQTT_5)


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Connect:
    packet_type: ClassVar[PacketType] = PacketType.CONNECT
    client_id: str
    protocol_level: int = MQTT_3_1_1
    clean_start: bool = True  # "Clean Session" before MQTT 5: the same bit
    keepalive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Connack:
    """`reason_code` is the MQTT 5 reason code at level 5 and the 3.1.1 return code
    (0-5) at levels 3 and 4. The encoder maps a v5 refusal code (0x80 and up) to the
    3.1.1 return code when it writes level 3 or 4, so one Connack serves both."""

    packet_type: ClassVar[PacketType] = PacketType.CONNACK
    session_present: bool = False
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Publish:
    packet_type: ClassVar[PacketType] = PacketType.PUBLISH
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # set exactly when qos > 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class _PublishAck:
    """PUBACK, PUBREC, PUBREL, PUBCOMP share one layout (MQTT 5.0 sections 3.4-3.7)."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Puback(_PublishAck):
    packet_type: ClassVar[PacketType] = PacketType.PUBACK


@dataclass(slots=True)
class Pubrec(_PublishAck):
    packet_type: ClassVar[PacketType] = PacketType.PUBREC


@dataclass(slots=True)
class Pubrel(_PublishAck):
    packet_type: ClassVar[PacketType] = PacketType.PUBREL


@dataclass(slots=True)
class Pubcomp(_PublishAck):
    packet_type: ClassVar[PacketType] = PacketType.PUBCOMP


@dataclass(slots=True)
class SubscriptionOptions:
    """The options byte of a SUBSCRIBE entry. Before MQTT 5 only `qos` exists."""

    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Subscribe:
    """Topic filters are only checked to be well-formed strings: their syntax is the
    session's to check (topic.validate_filter), since MQTT 5 answers a bad filter with a
    SUBACK reason code, not by closing the connection."""

    packet_type: ClassVar[PacketType] = PacketType.SUBSCRIBE
    packet_id: int
    subscriptions: list[tuple[str, SubscriptionOptions]]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Suback:
    """One reason code per topic filter. At levels 3 and 4 the encoder writes any
    failure code (0x80 and up) as the one 3.1.1 failure code, 0x80."""

    packet_type: ClassVar[PacketType] = PacketType.SUBACK
    packet_id: int
    reason_codes: list[int]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Unsubscribe:
    packet_type: ClassVar[PacketType] = PacketType.UNSUBSCRIBE
    packet_id: int
    topic_filters: list[str]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Unsuback:
    """`reason_codes` exist in MQTT 5 only: empty when decoded at levels 3 and 4, and
    not written there."""

    packet_type: ClassVar[PacketType] = PacketType.UNSUBACK
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Pingreq:
    packet_type: ClassVar[PacketType] = PacketType.PINGREQ


@dataclass(slots=True)
class Pingresp:
    packet_type: ClassVar[PacketType] = PacketType.PINGRESP


@dataclass(slots=True)
class Disconnect:
    packet_type: ClassVar[PacketType] = PacketType.DISCONNECT
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Auth:
    """MQTT 5 only."""

    packet_type: ClassVar[PacketType] = PacketType.AUTH
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


Packet: TypeAlias = (Connect | Connack | Publish | Puback | Pubrec | Pubrel | Pubcomp | Subscribe
                      | Suback | Unsubscribe | Unsuback | Pingreq | Pingresp | Disconnect
                      | Auth)
