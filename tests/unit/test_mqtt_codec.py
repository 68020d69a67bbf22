"""MQTT codec: byte-exact packets, the spec's malformed and protocol-error cases, the
stream reader."""

from __future__ import annotations

import pytest

from stratamq.broker.errors import StratamqError
from stratamq.broker.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Auth,
    Connack,
    ConnackReturnCode,
    Connect,
    Disconnect,
    MalformedPacketError,
    MqttCodecError,
    Packet,
    PacketReader,
    PacketTooLargeError,
    Pingreq,
    Pingresp,
    Properties,
    ProtocolError,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    ReasonCode,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    UnsupportedProtocolVersionError,
    Will,
    connack_return_code,
    decode,
    decode_body,
    encode,
    encode_publish,
)
from stratamq.broker.mqtt.wire import encode_varint, scan_varint


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def frame(first_byte: int, body: bytes) -> bytes:
    return bytes((first_byte,)) + encode_varint(len(body)) + body


def s(text: str) -> bytes:
    """A UTF-8 Encoded String field."""
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


CONNECT_V4 = frame(0x10, s("MQTT") + h("04 02 003c") + s("abc"))
CONNECT_V5 = frame(0x10, s("MQTT") + h("05 02 003c 00") + s("abc"))


# --- errors and reason codes ------------------------------------------------------------

@pytest.mark.parametrize(("error", "code"), [
    (MalformedPacketError, 0x81), (ProtocolError, 0x82), (PacketTooLargeError, 0x95),
    (UnsupportedProtocolVersionError, 0x84),
])
def test_errors_carry_their_reason_code(error: type[MqttCodecError], code: int) -> None:
    assert issubclass(error, StratamqError)
    assert error("x").mqtt_reason_code == code


def test_reason_codes_cover_section_2_4() -> None:
    values = {code.value for code in ReasonCode}
    assert values == {0x00, 0x01, 0x02, 0x04, 0x10, 0x11, 0x18, 0x19} | set(range(0x80, 0xA3))
    assert ReasonCode(0) is ReasonCode.SUCCESS
    assert {ReasonCode.NORMAL_DISCONNECTION.value, ReasonCode.GRANTED_QOS_0.value} == {0}


@pytest.mark.parametrize(("v5", "v3"), [
    (0x00, 0), (0x84, 1), (0x85, 2), (0x88, 3), (0x89, 3), (0x86, 4), (0x87, 5),
    (0x8A, 5), (0x8C, 4),
])
def test_connack_reason_code_maps_to_3_1_1(v5: int, v3: int) -> None:
    assert connack_return_code(v5) == ConnackReturnCode(v3)


def test_connack_reason_code_without_3_1_1_counterpart() -> None:
    assert connack_return_code(ReasonCode.MALFORMED_PACKET) is None


# --- byte-exact packets -----------------------------------------------------------------

@pytest.mark.parametrize(("value", "wire"), [
    # MQTT 5.0 table 1-1 (and 3.1.1 table 2.4), plus the example 321 = 0xC1 0x02.
    (0, "00"), (127, "7f"), (128, "8001"), (321, "c102"), (16_383, "ff7f"),
    (16_384, "808001"), (2_097_151, "ffff7f"), (2_097_152, "80808001"),
    (268_435_455, "ffffff7f"),
])
def test_variable_byte_integer(value: int, wire: str) -> None:
    assert encode_varint(value) == h(wire)
    assert scan_varint(h(wire), 0, len(h(wire))) == (value, len(h(wire)))


def test_variable_byte_integer_out_of_range() -> None:
    with pytest.raises(ValueError):
        encode_varint(268_435_456)


@pytest.mark.parametrize(("packet", "level", "wire"), [
    (Connect("abc", 4, clean_start=True, keepalive=60), 4, CONNECT_V4),
    (Connect("abc", 5, clean_start=True, keepalive=60), 5, CONNECT_V5),
    (Connect("abc", 3, clean_start=False, keepalive=10), 3,
     frame(0x10, s("MQIsdp") + h("03 00 000a") + s("abc"))),
    (Connect("c", 4, username="u", password=b"pw",
             will=Will("w/t", b"bye", qos=1, retain=True)), 4,
     frame(0x10, s("MQTT") + h("04 ee 003c") + s("c") + s("w/t") + s("bye") + s("u")
           + s("pw"))),
    (Connack(session_present=True), 4, h("20 02 01 00")),
    (Connack(reason_code=ConnackReturnCode.NOT_AUTHORIZED), 4, h("20 02 00 05")),
    (Connack(), 5, h("20 03 00 00 00")),
    # 3.1.1 section 3.3: topic "a/b", packet identifier 10.
    (Publish("a/b", b"hi", qos=1, packet_id=10), 4, h("32 09 0003 612f62 000a 6869")),
    (Publish("a/b", b"", retain=True), 4, h("31 05 0003 612f62")),
    (Publish("a/b", b"x", qos=2, dup=True, packet_id=1), 5, h("3c 09 0003 612f62 0001 00 78")),
    # MQTT 5.0 section 1.5.4 example: "A\U0002A6D4" is 00 05 41 F0 AA 9B 94.
    (Publish("A\U0002A6D4", b""), 4, h("30 07 0005 41f0aa9b94")),
    (Publish("t", b"", properties=Properties(message_expiry_interval=60,
                                             user_properties=[("k", "v")])), 5,
     h("30 10 0001 74 0c 02 0000003c 26 0001 6b 0001 76")),
    (Puback(10), 4, h("40 02 000a")),
    (Puback(10), 5, h("40 02 000a")),
    (Puback(10, ReasonCode.NO_MATCHING_SUBSCRIBERS), 5, h("40 03 000a 10")),
    (Puback(10, 0x10, Properties(reason_string="r")), 5, h("40 08 000a 10 04 1f 0001 72")),
    (Pubrec(10), 4, h("50 02 000a")),
    (Pubrel(10), 4, h("62 02 000a")),
    (Pubcomp(10), 4, h("70 02 000a")),
    # 3.1.1 section 3.8.3 example: "a/b" at QoS 1 and "c/d" at QoS 2, identifier 10.
    (Subscribe(10, [("a/b", SubscriptionOptions(1)), ("c/d", SubscriptionOptions(2))]), 4,
     h("82 0e 000a 0003 612f62 01 0003 632f64 02")),
    (Subscribe(10, [("a/b", SubscriptionOptions(1, no_local=True, retain_as_published=True,
                                                 retain_handling=2))]), 5,
     h("82 09 000a 00 0003 612f62 2d")),
    (Suback(10, [0, 2, 0x80]), 4, h("90 05 000a 00 02 80")),
    (Suback(10, [0, 0x87]), 5, h("90 05 000a 00 00 87")),
    (Unsubscribe(10, ["a/b", "c/d"]), 4, h("a2 0c 000a 0003 612f62 0003 632f64")),
    (Unsuback(10), 4, h("b0 02 000a")),
    (Unsuback(10, [0x00, 0x11]), 5, h("b0 05 000a 00 00 11")),
    (Pingreq(), 4, h("c0 00")),
    (Pingresp(), 5, h("d0 00")),
    (Disconnect(), 4, h("e0 00")),
    (Disconnect(), 5, h("e0 00")),
    (Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE), 5, h("e0 01 04")),
    (Disconnect(0x8E, Properties(session_expiry_interval=0)), 5, h("e0 07 8e 05 11 00000000")),
    (Auth(), 5, h("f0 00")),
    (Auth(0x18, Properties(authentication_method="m")), 5, h("f0 06 18 04 15 0001 6d")),
])
def test_byte_exact(packet: Packet, level: int, wire: bytes) -> None:
    assert encode(packet, level) == wire
    assert decode(wire, level) == packet


def test_short_forms_of_mqtt5_acknowledgements_decode() -> None:
    # Reason code present, property length left out; and explicit empty properties.
    assert decode(h("40 03 000a 00"), 5) == Puback(10)
    assert decode(h("40 04 000a 00 00"), 5) == Puback(10)
    assert decode(h("e0 02 00 00"), 5) == Disconnect()


def test_decode_body_takes_the_body_alone() -> None:
    assert decode_body(0x40, h("000a"), 4) == Puback(10)


# --- what the encoder does with what a level cannot carry -------------------------------

def test_encoder_maps_v5_codes_for_3_1_1() -> None:
    assert encode(Connack(reason_code=ReasonCode.BAD_USER_NAME_OR_PASSWORD), 4) == h("20020004")
    assert encode(Suback(1, [1, ReasonCode.NOT_AUTHORIZED]), 4) == h("9004 0001 01 80")
    assert encode(Puback(1, 0x10, Properties(reason_string="x")), 4) == h("4002 0001")
    assert encode(Disconnect(0x8E), 4) == h("e000")
    assert encode(Unsuback(1, [0x11]), 4) == h("b002 0001")


@pytest.mark.parametrize(("packet", "level"), [
    (Auth(), 4),
    (Connack(reason_code=ReasonCode.MALFORMED_PACKET), 4),
    (Connect("c", 5), 4),
    (Connect("c", 4, password=b"p"), 4),
    (Publish("t", b"", qos=1), 4),
    (Publish("t", b"", qos=3, packet_id=1), 4),
    (Publish("t", b"", dup=True), 4),
    (Publish("t" * 70_000, b""), 4),
    (Puback(70_000), 4),
    (Publish("t", b"", properties=Properties(message_expiry_interval=-1)), 5),
])
def test_encoder_refuses_what_cannot_be_encoded(packet: Packet, level: int) -> None:
    with pytest.raises(ValueError):
        encode(packet, level)


def test_encoder_writes_only_properties_the_packet_type_allows() -> None:
    packet = Puback(1, properties=Properties(topic_alias=3, reason_string="r"))
    assert decode(encode(packet, 5), 5) == Puback(1, properties=Properties(reason_string="r"))


# --- malformed packets and protocol errors ----------------------------------------------

def publish_v5(properties: bytes) -> bytes:
    return frame(0x30, s("t") + encode_varint(len(properties)) + properties)


def connect_v5(properties: bytes) -> bytes:
    return frame(0x10, s("MQTT") + h("05 02 003c") + encode_varint(len(properties))
                 + properties + s("c"))


MALFORMED: list[tuple[str, bytes, int]] = [
    ("packet type 0", h("00 00"), 4),
    ("SUBSCRIBE flags 0", h("80 06 0001 0001 61 00"), 4),
    ("UNSUBSCRIBE flags 0", h("a0 05 0001 0001 61"), 4),
    ("PUBREL flags 0", h("60 02 0001"), 4),
    ("PUBACK flags 1", h("41 02 0001"), 4),
    ("PINGREQ flags 8", h("c8 00"), 4),
    ("CONNACK flags 2", h("22 02 00 00"), 4),
    ("PUBLISH QoS 3", h("36 05 0001 74 0001"), 4),
    ("PUBLISH DUP at QoS 0", h("38 03 0001 74"), 4),
    ("PUBLISH packet id 0", h("32 05 0001 74 0000"), 4),
    ("PUBACK packet id 0", h("40 02 0000"), 4),
    ("SUBSCRIBE packet id 0", h("82 06 0000 0001 61 00"), 4),
    ("UNSUBSCRIBE packet id 0", h("a2 05 0000 0001 61"), 4),
    ("topic not UTF-8", h("30 04 0002 c328"), 4),
    ("topic with encoded surrogate", h("30 05 0003 eda080"), 4),
    ("topic with overlong NUL", h("30 04 0002 c080"), 4),
    ("topic with U+0000", h("30 05 0003 610062"), 4),
    ("client id with U+0000", frame(0x10, s("MQTT") + h("04 02 003c") + s("a\x00")), 4),
    ("topic longer than packet", h("30 04 0009 6162"), 4),
    ("PUBLISH without topic length", h("30 01 00"), 4),
    ("PUBLISH without packet id", h("32 03 0001 74"), 4),
    ("PINGREQ with a body", h("c0 01 00"), 4),
    ("PINGRESP with a body", h("d0 01 00"), 4),
    ("3.1.1 DISCONNECT with a body", h("e0 01 00"), 4),
    ("3.1.1 PUBACK with a reason code", h("40 03 0001 00"), 4),
    ("3.1.1 UNSUBACK with a reason code", h("b0 03 0001 00"), 4),
    ("3.1.1 AUTH", h("f0 00"), 4),
    ("AUTH without property length", h("f0 01 18"), 5),
    ("CONNECT with bytes left over",
     frame(0x10, s("MQTT") + h("04 02 003c") + s("abc") + b"\x00"), 4),
    ("CONNECT truncated", frame(0x10, s("MQTT") + h("04 02 003c 0005 6162")), 4),
    ("CONNECT reserved flag", frame(0x10, s("MQTT") + h("04 03 003c") + s("c")), 4),
    ("will QoS without will flag", frame(0x10, s("MQTT") + h("04 0a 003c") + s("c")), 4),
    ("will retain without will flag", frame(0x10, s("MQTT") + h("04 22 003c") + s("c")), 4),
    ("will QoS 3", frame(0x10, s("MQTT") + h("04 1e 003c") + s("c") + s("t") + s("p")), 4),
    ("3.1.1 password without user name",
     frame(0x10, s("MQTT") + h("04 42 003c") + s("c") + s("p")), 4),
    ("3.1.1 subscription options bit 2", h("82 06 0001 0001 61 04"), 4),
    ("3.1.1 subscription QoS 3", h("82 06 0001 0001 61 03"), 4),
    ("MQTT 5 subscription options reserved bits", h("82 07 0001 00 0001 61 40"), 5),
    ("subscription without options byte", h("82 05 0001 0001 61"), 4),
    ("unknown property", publish_v5(h("05 00")), 5),
    ("property not allowed in PUBLISH", publish_v5(h("21 0001")), 5),
    ("property not allowed in CONNECT", connect_v5(h("23 0001")), 5),
    ("will property in CONNECT properties", connect_v5(h("18 00000001")), 5),
    ("property length past the end", frame(0x30, s("t") + h("05 02 0000")), 5),
    ("truncated property value", publish_v5(h("02 0000")), 5),
    ("property string with U+0000", publish_v5(h("03 0001 00")), 5),
    ("user property value not UTF-8", publish_v5(h("26 0001 61 0001 ff")), 5),
    ("non-minimal property length", frame(0x30, s("t") + h("8000")), 5),
]


@pytest.mark.parametrize(("wire", "level"), [(w, lv) for _, w, lv in MALFORMED],
                         ids=[name for name, _, _ in MALFORMED])
def test_malformed(wire: bytes, level: int) -> None:
    with pytest.raises(MalformedPacketError) as caught:
        decode(wire, level)
    assert caught.value.mqtt_reason_code == 0x81


PROTOCOL_ERRORS: list[tuple[str, bytes, int]] = [
    ("SUBSCRIBE without filters", h("82 02 0001"), 4),
    ("MQTT 5 SUBSCRIBE without filters", h("82 03 0001 00"), 5),
    ("UNSUBSCRIBE without filters", h("a2 02 0001"), 4),
    ("MQTT 5 subscription QoS 3", h("82 07 0001 00 0001 61 03"), 5),
    ("MQTT 5 retain handling 3", h("82 07 0001 00 0001 61 30"), 5),
    ("duplicate message expiry", publish_v5(h("02 00000001 02 00000002")), 5),
    ("payload format indicator 2", publish_v5(h("01 02")), 5),
    ("subscription identifier 0", frame(0x82, h("0001 02 0b 00") + s("a") + b"\x00"), 5),
    ("two subscription identifiers in SUBSCRIBE",
     frame(0x82, h("0001 04 0b 01 0b 02") + s("a") + b"\x00"), 5),
    ("receive maximum 0", connect_v5(h("21 0000")), 5),
    ("maximum packet size 0", connect_v5(h("27 00000000")), 5),
    ("request problem information 2", connect_v5(h("17 02")), 5),
    ("authentication data without method", connect_v5(h("16 0001 61")), 5),
    ("maximum QoS 2", h("20 05 00 00 02 24 02"), 5),
    ("retain available 2", h("20 05 00 00 02 25 02"), 5),
    ("PUBACK reason code 0x05", h("40 03 0001 05"), 5),
    ("PUBREL reason code 0x10", h("62 03 0001 10"), 5),
    ("DISCONNECT reason code 0x01", h("e0 01 01"), 5),
    ("AUTH reason code 0x01", h("f0 02 01 00"), 5),
    ("CONNACK return code 6", h("20 02 00 06"), 4),
    ("CONNACK session present with refusal", h("20 02 01 05"), 4),
    ("SUBACK without reason codes", h("90 02 0001"), 4),
    ("3.1.1 SUBACK code 0x87", h("90 03 0001 87"), 4),
    ("UNSUBACK reason code 0x05", h("b0 04 0001 00 05"), 5),
]


@pytest.mark.parametrize(("wire", "level"), [(w, lv) for _, w, lv in PROTOCOL_ERRORS],
                         ids=[name for name, _, _ in PROTOCOL_ERRORS])
def test_protocol_error(wire: bytes, level: int) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode(wire, level)
    assert caught.value.mqtt_reason_code == 0x82


def test_repeatable_properties() -> None:
    packet = decode(publish_v5(h("0b 01 0b 02 26 0001 61 0001 62 26 0001 61 0001 63")), 5)
    assert isinstance(packet, Publish)
    assert packet.properties.subscription_identifiers == [1, 2]
    assert packet.properties.user_properties == [("a", "b"), ("a", "c")]


def test_mqtt5_allows_password_without_user_name() -> None:
    wire = frame(0x10, s("MQTT") + h("05 42 003c 00") + s("c") + s("pw"))
    assert decode(wire, 5) == Connect("c", 5, password=b"pw")


def test_mqtt_3_1_is_accepted_with_its_protocol_name() -> None:
    packet = decode(frame(0x10, s("MQIsdp") + h("03 02 003c") + s("c")), 4)
    assert packet == Connect("c", 3)


@pytest.mark.parametrize(("name", "level"), [("MQTT", 6), ("MQTT", 3), ("MQIsdp", 4),
                                             ("MQTT", 0x84), ("HTTP", 4)])
def test_unsupported_protocol(name: str, level: int) -> None:
    wire = frame(0x10, s(name) + bytes((level,)) + h("02 003c") + s("c"))
    with pytest.raises(UnsupportedProtocolVersionError) as caught:
        decode(wire, 4)
    assert caught.value.mqtt_reason_code == 0x84
    assert caught.value.protocol_level == level


def test_decode_checks_the_remaining_length() -> None:
    with pytest.raises(MalformedPacketError):
        decode(h("c0 01"), 4)  # a byte missing
    with pytest.raises(MalformedPacketError):
        decode(h("c0 00 00"), 4)  # a byte too many
    with pytest.raises(MalformedPacketError):
        decode(h("c0"), 4)
    with pytest.raises(ValueError):
        decode(h("c0 00"), 6)


# --- the stream reader ------------------------------------------------------------------

def test_reader_byte_by_byte() -> None:
    stream = CONNECT_V5 + encode(Publish("a/b", b"x" * 300, 1, packet_id=7,
                                         properties=Properties(topic_alias=1)), 5)
    stream += encode(Pingreq(), 5) + encode(Disconnect(0x04), 5)
    reader = PacketReader(1024)
    packets: list[Packet] = []
    for index in range(len(stream)):
        packets += reader.decode(stream[index:index + 1])
    assert packets == [decode(CONNECT_V5, 5), Publish("a/b", b"x" * 300, 1, packet_id=7,
                                                      properties=Properties(topic_alias=1)),
                       Pingreq(), Disconnect(0x04)]
    assert reader.protocol_level == 5
    assert reader.buffered == 0


def test_reader_keeps_a_partial_packet() -> None:
    reader = PacketReader(1024)
    assert reader.decode(CONNECT_V4 + h("32 09 0003")) == [decode(CONNECT_V4, 4)]
    assert reader.buffered == 4
    assert reader.protocol_level == 4
    assert reader.decode(bytearray(h("612f62 000a 6869 c000"))) == [
        Publish("a/b", b"hi", 1, packet_id=10), Pingreq()]
    assert reader.buffered == 0


def test_reader_accepts_memoryview() -> None:
    reader = PacketReader(1024, protocol_level=4)
    assert reader.decode(memoryview(h("c000 c0"))) == [Pingreq()]
    assert reader.decode(memoryview(h("00"))) == [Pingreq()]


def test_reader_refuses_a_large_packet_from_its_header() -> None:
    reader = PacketReader(100, protocol_level=4)
    assert reader.decode(h("30 62")) == []  # 2 + 98 = 100 bytes: allowed
    reader = PacketReader(100, protocol_level=4)
    with pytest.raises(PacketTooLargeError) as caught:
        reader.decode(h("30 63"))  # 101 bytes, no body sent yet
    assert caught.value.mqtt_reason_code == 0x95
    reader = PacketReader(100_000, protocol_level=4)
    reader.decode(h("30"))
    with pytest.raises(PacketTooLargeError):
        reader.decode(h("ffff7f"))


def test_reader_refuses_a_long_remaining_length() -> None:
    reader = PacketReader(1 << 30, protocol_level=4)
    assert reader.decode(h("30 ff ff ff")) == []  # could still end in the fourth byte
    with pytest.raises(MalformedPacketError):
        reader.decode(h("ff 01"))


def test_reader_refuses_a_padded_remaining_length() -> None:
    with pytest.raises(MalformedPacketError):
        PacketReader(1024, protocol_level=4).decode(h("c0 80 00"))


def test_reader_wants_connect_first_and_once() -> None:
    with pytest.raises(ProtocolError):
        PacketReader(1024).decode(h("c0"))  # known from the first byte
    with pytest.raises(ProtocolError):
        PacketReader(1024).decode(CONNECT_V4 + CONNECT_V4)
    reader = PacketReader(1024)
    reader.decode(CONNECT_V4)
    with pytest.raises(ProtocolError):
        reader.decode(CONNECT_V4)


def test_reader_decodes_after_connect_at_its_level() -> None:
    # The same bytes are a valid MQTT 5 PUBACK and a malformed 3.1.1 one.
    puback = h("40 03 000a 10")
    assert PacketReader(1024).decode(CONNECT_V5 + puback)[1] == Puback(10, 0x10)
    with pytest.raises(MalformedPacketError):
        PacketReader(1024).decode(CONNECT_V4 + puback)


def test_reader_protocol_level_is_settable() -> None:
    reader = PacketReader(1024, protocol_level=4)
    reader.protocol_level = 5
    assert reader.decode(h("40 03 000a 10")) == [Puback(10, 0x10)]


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
@pytest.mark.parametrize("qos,dup,retain", [(0, False, False), (1, True, False), (2, False, True)])
def test_encode_publish_matches_encoding_the_packet(level: int, qos: int, dup: bool,
                                                    retain: bool) -> None:
    properties = Properties(message_expiry_interval=30, topic_alias=3,
                            user_properties=[("k", "v")], subscription_identifiers=[7])
    packet_id = 42 if qos else None
    packet = Publish("a/b", b"payload", qos, retain, dup, packet_id, properties)
    assert encode_publish("a/b", b"payload", qos, retain, dup, packet_id, properties,
                          level) == encode(packet, level)
    with pytest.raises(ValueError):
        encode_publish("a/b", b"", 1, False, False, None, Properties(), level)
