"""MQTT codec under hypothesis: every valid packet survives encode/decode at every level,
the stream reader does not care how bytes are split, and no input makes the codec raise
anything but its own errors."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratamq.broker.mqtt import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    MqttCodecError,
    Packet,
    PacketReader,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
    decode,
    encode,
)
from stratamq.broker.mqtt.properties import SPECS, WILL_PROPERTIES
from stratamq.broker.mqtt.reason_codes import (
    AUTH_REASON_CODES,
    CONNACK_REASON_CODES,
    DISCONNECT_REASON_CODES,
    PUBACK_REASON_CODES,
    PUBREL_REASON_CODES,
    SUBACK_REASON_CODES,
    UNSUBACK_REASON_CODES,
)
from stratamq.broker.mqtt.wire import PacketType

LEVELS = (3, 4, 5)
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

texts = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
                max_size=12)
payloads = st.binary(max_size=64)
packet_ids = st.integers(1, 0xFFFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
zero_or_one = st.sampled_from([0, 1])

# A valid value for each property, by field name.
PROPERTY_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "payload_format_indicator": zero_or_one,
    "message_expiry_interval": u32,
    "content_type": texts,
    "response_topic": texts,
    "correlation_data": payloads,
    "subscription_identifiers": st.lists(st.integers(1, 268_435_455), max_size=3),
    "session_expiry_interval": u32,
    "assigned_client_identifier": texts,
    "server_keep_alive": u16,
    "authentication_method": texts,
    "authentication_data": payloads,
    "request_problem_information": zero_or_one,
    "will_delay_interval": u32,
    "request_response_information": zero_or_one,
    "response_information": texts,
    "server_reference": texts,
    "reason_string": texts,
    "receive_maximum": st.integers(1, 0xFFFF),
    "topic_alias_maximum": u16,
    "topic_alias": u16,
    "maximum_qos": zero_or_one,
    "retain_available": zero_or_one,
    "user_properties": st.lists(st.tuples(texts, texts), max_size=3),
    "maximum_packet_size": st.integers(1, 0xFFFF_FFFF),
    "wildcard_subscription_available": zero_or_one,
    "subscription_identifier_available": zero_or_one,
    "shared_subscription_available": zero_or_one,
}


def properties(kind: int, level: int) -> st.SearchStrategy[Properties]:
    if level != 5:
        return st.builds(Properties)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for spec in SPECS:
        if kind in spec.packets:
            value = PROPERTY_VALUES[spec.name]
            if kind == PacketType.SUBSCRIBE and spec.name == "subscription_identifiers":
                value = st.lists(st.integers(1, 268_435_455), max_size=1)
            fields[spec.name] = value if spec.repeatable else st.none() | value
    return st.builds(Properties, **fields).filter(
        lambda props: props.authentication_data is None
        or props.authentication_method is not None)


def codes(allowed: frozenset[int]) -> st.SearchStrategy[int]:
    return st.sampled_from(sorted(allowed))


@st.composite
def connects(draw: st.DrawFn, level: int) -> Connect:
    will = None
    if draw(st.booleans()):
        will = Will(draw(texts), draw(payloads), draw(st.integers(0, 2)), draw(st.booleans()),
                    draw(properties(WILL_PROPERTIES, level)))
    username = draw(st.none() | texts)
    # A password alone is MQTT 5 only.
    password = draw(st.none() | payloads) if username is not None or level == 5 else None
    return Connect(draw(texts), level, draw(st.booleans()), draw(u16), username, password,
                   will, draw(properties(PacketType.CONNECT, level)))


@st.composite
def connacks(draw: st.DrawFn, level: int) -> Connack:
    code = draw(codes(CONNACK_REASON_CODES) if level == 5 else st.integers(0, 5))
    return Connack(code == 0 and draw(st.booleans()), code,
                   draw(properties(PacketType.CONNACK, level)))


@st.composite
def publishes(draw: st.DrawFn, level: int) -> Publish:
    qos = draw(st.integers(0, 2))
    return Publish(draw(texts), draw(payloads), qos, draw(st.booleans()),
                   qos > 0 and draw(st.booleans()), draw(packet_ids) if qos else None,
                   draw(properties(PacketType.PUBLISH, level)))


def publish_acks(cls: type[Puback | Pubrec | Pubrel | Pubcomp], allowed: frozenset[int],
                 level: int) -> st.SearchStrategy[Packet]:
    if level != 5:
        return st.builds(cls, packet_ids)
    return st.builds(cls, packet_ids, codes(allowed), properties(cls.packet_type, level))


@st.composite
def subscribes(draw: st.DrawFn, level: int) -> Subscribe:
    if level == 5:
        options = st.builds(SubscriptionOptions, st.integers(0, 2), st.booleans(),
                            st.booleans(), st.integers(0, 2))
    else:
        options = st.builds(SubscriptionOptions, st.integers(0, 2))
    return Subscribe(draw(packet_ids), draw(st.lists(st.tuples(texts, options), min_size=1,
                                                     max_size=4)),
                     draw(properties(PacketType.SUBSCRIBE, level)))


def packets(level: int) -> st.SearchStrategy[Packet]:
    """Every packet type but CONNECT, valid at `level`."""
    v5 = level == 5
    suback_codes = codes(SUBACK_REASON_CODES) if v5 else st.sampled_from([0, 1, 2, 0x80])
    choices: list[st.SearchStrategy[Packet]] = [
        connacks(level),
        publishes(level),
        publish_acks(Puback, PUBACK_REASON_CODES, level),
        publish_acks(Pubrec, PUBACK_REASON_CODES, level),
        publish_acks(Pubrel, PUBREL_REASON_CODES, level),
        publish_acks(Pubcomp, PUBREL_REASON_CODES, level),
        subscribes(level),
        st.builds(Suback, packet_ids, st.lists(suback_codes, min_size=1, max_size=4),
                  properties(PacketType.SUBACK, level)),
        st.builds(Unsubscribe, packet_ids, st.lists(texts, min_size=1, max_size=4),
                  properties(PacketType.UNSUBSCRIBE, level)),
        st.builds(Pingreq),
        st.builds(Pingresp),
    ]
    if v5:
        choices += [
            st.builds(Unsuback, packet_ids,
                      st.lists(codes(UNSUBACK_REASON_CODES), min_size=1, max_size=4),
                      properties(PacketType.UNSUBACK, level)),
            st.builds(Disconnect, codes(DISCONNECT_REASON_CODES),
                      properties(PacketType.DISCONNECT, level)),
            st.builds(Auth, codes(AUTH_REASON_CODES), properties(PacketType.AUTH, level)),
        ]
    else:
        choices += [st.builds(Unsuback, packet_ids), st.builds(Disconnect)]
    return st.one_of(choices)


def any_packet(level: int) -> st.SearchStrategy[Packet]:
    return connects(level) | packets(level)


@st.composite
def streams(draw: st.DrawFn) -> tuple[int, list[Packet]]:
    """A connection's packets: a CONNECT, then what follows at its level."""
    level = draw(st.sampled_from(LEVELS))
    return level, [draw(connects(level)), *draw(st.lists(packets(level), max_size=8))]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    bounds = [0, *points, len(data)]
    return [data[start:stop] for start, stop in itertools.pairwise(bounds)]


def decode_all(reader: PacketReader, pieces: list[bytes]) -> list[Packet]:
    out: list[Packet] = []
    for piece in pieces:
        out += reader.decode(piece)
    return out


# --- round trips ------------------------------------------------------------------------

@FUZZ
@given(st.sampled_from(LEVELS).flatmap(lambda level: st.tuples(st.just(level),
                                                                 any_packet(level))))
def test_round_trip(case: tuple[int, Packet]) -> None:
    level, packet = case
    assert decode(encode(packet, level), level) == packet


@FUZZ
@given(streams(), st.lists(st.integers(0, 10_000), max_size=12))
def test_reader_is_indifferent_to_splits(stream: tuple[int, list[Packet]],
                                         cuts: list[int]) -> None:
    level, sent = stream
    data = b"".join(encode(packet, level) for packet in sent)
    reader = PacketReader(1 << 20)
    assert decode_all(reader, split(data, cuts)) == sent
    assert reader.protocol_level == level
    assert reader.buffered == 0


# --- hostile input ----------------------------------------------------------------------

@FUZZ
@given(st.sampled_from([None, *LEVELS]), st.binary(max_size=200),
       st.lists(st.integers(0, 1000), max_size=4))
def test_random_bytes_raise_only_codec_errors(level: int | None, data: bytes,
                                              cuts: list[int]) -> None:
    reader = PacketReader(1000, protocol_level=level)
    with contextlib.suppress(MqttCodecError):
        decode_all(reader, split(data, cuts))
    for decode_level in LEVELS:
        with contextlib.suppress(MqttCodecError):
            decode(data, decode_level)


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    level, sent = draw(streams())
    data = bytearray(b"".join(encode(packet, level) for packet in sent))
    # Mostly spare the CONNECT: a broken first packet hides the rest of the stream.
    after_connect = len(encode(sent[0], level))
    for _ in range(draw(st.integers(1, 4))):
        low = draw(st.sampled_from([0, after_connect, after_connect]))
        at = draw(st.integers(min(low, len(data)), len(data)))
        action = draw(st.sampled_from(["replace", "insert", "delete"]))
        if action == "insert" or at == len(data):
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
        elif action == "replace":
            data[at] = draw(st.integers(0, 255))
        else:
            del data[at:at + draw(st.integers(1, 3))]
    return bytes(data)


@FUZZ
@given(mutated_streams(), st.lists(st.integers(0, 10_000), max_size=4))
def test_mutated_streams_raise_only_codec_errors(data: bytes, cuts: list[int]) -> None:
    reader = PacketReader(1 << 16)
    with contextlib.suppress(MqttCodecError):
        decode_all(reader, split(data, cuts))


@FUZZ
@given(st.sampled_from(LEVELS).flatmap(lambda level: st.tuples(st.just(level),
                                                                 any_packet(level))),
       st.integers(0, 10_000), st.integers(0, 255))
def test_one_changed_byte_in_a_packet_raises_only_codec_errors(
        case: tuple[int, Packet], at: int, value: int) -> None:
    level, packet = case
    data = bytearray(encode(packet, level))
    data[at % len(data)] = value
    for decode_level in LEVELS:
        with contextlib.suppress(MqttCodecError):
            decode(data, decode_level)
