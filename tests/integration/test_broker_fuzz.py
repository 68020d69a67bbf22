"""Hostile input on live connections (docs/architecture.md "Guarantees" 4): random bytes, valid
packets with bytes flipped, inserted, deleted or cut off and remaining lengths
rewritten, and packets that are malformed on purpose, each sent over a raw socket to
one running broker. After every example the broker process lives, logged no traceback,
and a fresh paho client connects, publishes at QoS 1 and receives its message; clearly
malformed input closes the connection (MQTT 5: after a DISCONNECT with the reason);
and a durable subscriber set up at the start gets every well-behaved message in the
end. (The codec alone is fuzzed in tests/unit/test_mqtt_codec_fuzz.py.)

The suite runs a fixed set of cases (derandomized: the same every run, 2,700
in all). `make fuzz` runs many more from a random seed: FUZZ_EXAMPLES sets the cases
per test, FUZZ_SEED the seed (make prints it; set it to run a failure again)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import (
    MQTT_5,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketReader,
    Pingreq,
    Properties,
    Puback,
    Publish,
    Pubrel,
    Subscribe,
    SubscriptionOptions,
    Unsubscribe,
    Will,
    encode,
)
from stratamq.broker.mqtt.wire import encode_varint
from tests.integration.crash_clients import RawClient
from tests.integration.fuzz_site import Site, send_hostile

EXAMPLES = os.environ.get("FUZZ_EXAMPLES")
SEED = os.environ.get("FUZZ_SEED")


def fuzz(examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """`examples` fixed cases (FUZZ_EXAMPLES instead, when set), derandomized unless
    FUZZ_SEED names a seed. No example database either way: a run is its seed."""
    def configure(test: Callable[..., None]) -> Callable[..., None]:
        configured: Callable[..., None] = settings(
            max_examples=int(EXAMPLES) if EXAMPLES else examples, deadline=None,
            derandomize=SEED is None, suppress_health_check=[HealthCheck.too_slow])(test)
        return configured if SEED is None else seed(int(SEED))(configured)
    return configure

LEVELS = (3, 4, 5)
MAX_PACKET = 1024 * 1024  # the broker's defaults: max_packet_size,
RECEIVE_MAXIMUM = 128  # receive_maximum,
TOPIC_ALIAS_MAXIMUM = 64  # topic_alias_maximum
CONNECT_TYPE = 1

names = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=6)
topics = st.lists(names, min_size=1, max_size=3).map(lambda levels: "hostile/" + "/".join(levels))
filters = (topics | topics.map(lambda topic: topic + "/#") | st.just("hostile/+/x")
           | topics.map(lambda topic: "$share/g/" + topic))
payloads = st.binary(max_size=48)
packet_ids = st.integers(1, 0xFFFF)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    directory: Path = tmp_path_factory.mktemp("fuzz-broker")
    running = Site(BrokerProcess(directory).start())
    try:
        running.start()
        running.check("start")
        yield running
    finally:
        running.broker.kill()


# -- strategies -----------------------------------------------------------------------

@st.composite
def connects(draw: st.DrawFn, level: int) -> Connect:
    will = None
    if draw(st.booleans()):
        will = Will(draw(topics), draw(payloads), draw(st.integers(0, 2)), draw(st.booleans()))
    properties = Properties()
    if level == MQTT_5:
        properties.session_expiry_interval = draw(st.none() | st.integers(0, 60))
    username = draw(st.none() | names)
    password = draw(payloads) if username is not None and draw(st.booleans()) else None
    # client ids of their own: hostile input never takes over a well-behaved session
    return Connect("hostile-" + draw(names), level, draw(st.booleans()),
                   draw(st.integers(0, 60)), username, password, will, properties)


@st.composite
def publishes(draw: st.DrawFn, level: int) -> Publish:
    qos = draw(st.integers(0, 2))
    topic = draw(topics)
    properties = Properties()
    if level == MQTT_5:
        properties.message_expiry_interval = draw(st.none() | st.integers(0, 60))
        properties.user_properties = draw(st.lists(st.tuples(names, names), max_size=2))
        properties.topic_alias = draw(st.none() | st.integers(1, 70))
        if properties.topic_alias is not None and draw(st.booleans()):
            topic = ""  # use the alias set earlier (or not: a protocol error)
    return Publish(topic, draw(payloads), qos, draw(st.booleans()),
                   qos > 0 and draw(st.booleans()), draw(packet_ids) if qos else None,
                   properties)


@st.composite
def subscribes(draw: st.DrawFn, level: int) -> Subscribe:
    properties = Properties()
    if level == MQTT_5:
        options = st.builds(SubscriptionOptions, st.integers(0, 2), st.booleans(),
                            st.booleans(), st.integers(0, 2))
        properties.subscription_identifiers = draw(st.lists(st.integers(1, 1000),
                                                            max_size=1))
    else:
        options = st.builds(SubscriptionOptions, st.integers(0, 2))
    return Subscribe(draw(packet_ids),
                     draw(st.lists(st.tuples(filters, options), min_size=1, max_size=3)),
                     properties)


def packets(level: int) -> st.SearchStrategy[Packet]:
    """What may follow CONNECT at `level`."""
    disconnects = st.builds(Disconnect)
    if level == MQTT_5:
        disconnects = st.builds(Disconnect, st.sampled_from([0, 4]), st.builds(
            Properties, session_expiry_interval=st.none() | st.integers(0, 60)))
    return st.one_of(
        publishes(level),
        subscribes(level),
        st.builds(Unsubscribe, packet_ids, st.lists(filters, min_size=1, max_size=3)),
        st.builds(Puback, packet_ids),
        st.builds(Pubrel, packet_ids),
        st.builds(Pingreq),
        disconnects,
    )


def header_size(packet: bytes | bytearray) -> int:
    """Bytes of the fixed header: the type byte and the remaining length."""
    size = 2
    while size <= len(packet) and packet[size - 1] & 0x80:
        size += 1
    return size


@st.composite
def mutate(draw: st.DrawFn, packet: bytearray) -> bytearray:
    """One change to an encoded packet."""
    kind = draw(st.sampled_from(["flip", "replace", "insert", "delete", "truncate",
                                 "length"]))
    at = draw(st.integers(0, len(packet) - 1))
    if kind == "flip":
        packet[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "replace":
        packet[at] = draw(st.integers(0, 255))
    elif kind == "insert":
        packet[at:at] = draw(st.binary(min_size=1, max_size=4))
    elif kind == "delete":
        del packet[at:at + draw(st.integers(1, 4))]
    elif kind == "truncate":
        del packet[at:]
    else:  # the remaining length says something else than what follows
        head = header_size(packet)
        stated = len(packet) - head
        wrong = draw(st.sampled_from([
            encode_varint(max(stated + draw(st.integers(-8, 8)), 0)),
            encode_varint(draw(st.integers(0, 0x0FFF_FFFF))),
            b"\xff\xff\xff\xff\x7f",  # five bytes: longer than a varint may be
            b"\x80\x00",  # not the shortest encoding
        ]))
        packet[1:head] = wrong
    return packet


@st.composite
def mutated_streams(draw: st.DrawFn) -> list[bytes]:
    """A CONNECT and a few packets at its level, damaged 1-3 times, cut into 1-3
    chunks (sent back to back)."""
    level = draw(st.sampled_from(LEVELS))
    encoded = [bytearray(encode(draw(connects(level)), level))]
    encoded += [bytearray(encode(p, level))
                for p in draw(st.lists(packets(level), max_size=5))]
    for _ in range(draw(st.integers(1, 3))):
        # mostly spare the CONNECT: a broken one hides what follows
        index = draw(st.sampled_from([0, *range(1, len(encoded)), *range(1, len(encoded))]))
        if encoded[index]:
            encoded[index] = draw(mutate(encoded[index]))
    data = b"".join(encoded)
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=2))))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


MALFORMED = 0x81
PROTOCOL_ERROR = 0x82


@st.composite
def malformed_packets(draw: st.DrawFn, level: int) -> tuple[str, bytes, frozenset[int]]:
    """A packet that no broker may accept after a good CONNECT at `level`: (what it is,
    its bytes, the MQTT 5 DISCONNECT reason codes that are right for it)."""
    kinds = ["reserved type 0", "reserved flags", "QoS 3", "DUP at QoS 0", "second CONNECT",
             "five-byte remaining length", "too large", "wildcard in topic name",
             "packet id 0", "topic not UTF-8", "SUBSCRIBE without filters"]
    if level == MQTT_5:
        kinds += ["topic alias 0", "topic alias above maximum", "unknown topic alias",
                  "empty topic name", "AUTH", "receive maximum exceeded",
                  "DISCONNECT asks for a session"]
    kind = draw(st.sampled_from(kinds))
    body = draw(st.binary(max_size=16))
    no_properties = b"\x00" if level == MQTT_5 else b""

    def packet(first_byte: int, variable: bytes) -> bytes:
        return bytes([first_byte]) + encode_varint(len(variable)) + variable

    def topic_name(name: bytes) -> bytes:
        return len(name).to_bytes(2, "big") + name

    if kind == "reserved type 0":
        return kind, packet(draw(st.integers(0, 15)), body), frozenset({MALFORMED})
    if kind == "reserved flags":
        choices: list[Packet] = [Subscribe(1, [("hostile/#", SubscriptionOptions(1))]),
                                 Unsubscribe(1, ["hostile/#"]), Pubrel(1), Puback(1),
                                 Pingreq(), Disconnect()]
        valid = bytearray(encode(draw(st.sampled_from(choices)), level))
        required = valid[0] & 0x0F
        valid[0] = valid[0] & 0xF0 | draw(st.integers(0, 15).filter(lambda f: f != required))
        return kind, bytes(valid), frozenset({MALFORMED})
    if kind == "QoS 3":
        return kind, packet(0x36, topic_name(b"hostile/x") + b"\x00\x01" + no_properties
                            + body), frozenset({MALFORMED})
    if kind == "DUP at QoS 0":
        return kind, packet(0x38, topic_name(b"hostile/x") + no_properties + body), \
            frozenset({MALFORMED})
    if kind == "second CONNECT":
        return kind, encode(draw(connects(level)), level), frozenset({PROTOCOL_ERROR})
    if kind == "five-byte remaining length":
        return kind, b"\x30\xff\xff\xff\xff\x7f", frozenset({MALFORMED})
    if kind == "too large":  # only the fixed header: the size alone is enough
        return kind, b"\x30" + encode_varint(MAX_PACKET + draw(st.integers(0, 1000))), \
            frozenset({0x95})
    if kind == "wildcard in topic name":
        topic = draw(st.sampled_from(["hostile/#", "hostile/+/x", "+", "#"]))
        return kind, encode(Publish(topic, body, 1, packet_id=1), level), \
            frozenset({MALFORMED, PROTOCOL_ERROR, 0x90})
    if kind == "packet id 0":
        return kind, packet(0x32, topic_name(b"hostile/x") + b"\x00\x00" + no_properties
                            + body), frozenset({MALFORMED, PROTOCOL_ERROR})
    if kind == "topic not UTF-8":
        return kind, packet(0x30, topic_name(b"hostile/\xff" + body) + no_properties), \
            frozenset({MALFORMED})
    if kind == "SUBSCRIBE without filters":
        return kind, packet(0x82, b"\x00\x01" + no_properties), \
            frozenset({MALFORMED, PROTOCOL_ERROR})
    return (kind, *mqtt5_violation(draw, kind, body))


def mqtt5_violation(draw: st.DrawFn, kind: str, body: bytes) -> tuple[bytes, frozenset[int]]:
    """Well-formed MQTT 5 packets that break the protocol's rules."""
    if kind == "topic alias 0":
        return encode(Publish("hostile/x", body, properties=Properties(topic_alias=0)), 5), \
            frozenset({PROTOCOL_ERROR, 0x94})
    if kind == "topic alias above maximum":  # CONNACK said 64
        alias = draw(st.integers(TOPIC_ALIAS_MAXIMUM + 1, 0xFFFF))
        return encode(Publish("hostile/x", body, properties=Properties(topic_alias=alias)),
                      5), frozenset({0x94})
    if kind == "unknown topic alias":
        return encode(Publish("", body, properties=Properties(topic_alias=1)), 5), \
            frozenset({PROTOCOL_ERROR})
    if kind == "empty topic name":
        return encode(Publish("", body), 5), frozenset({PROTOCOL_ERROR, 0x90})
    if kind == "AUTH":  # no enhanced authentication was asked for
        return encode(Auth(0x18), 5), frozenset({PROTOCOL_ERROR})
    if kind == "receive maximum exceeded":  # in one go: none is stored meanwhile
        count = draw(st.integers(2 * RECEIVE_MAXIMUM, 3 * RECEIVE_MAXIMUM))
        return b"".join(encode(Publish("hostile/x", body, 1, packet_id=i), 5)
                        for i in range(1, count + 1)), frozenset({0x93})
    assert kind == "DISCONNECT asks for a session"  # CONNECT had expiry 0
    expiry = draw(st.integers(1, 0xFFFF_FFFF))
    return encode(Disconnect(0, Properties(session_expiry_interval=expiry)), 5), \
        frozenset({PROTOCOL_ERROR})


def until_closed(client: RawClient) -> tuple[list[Packet], bool]:
    """What the broker sends until it closes the connection; (packets, closed), where
    closed is False when it left the connection open for the client's timeout."""
    answers: list[Packet] = []
    while True:
        try:
            answers.append(client.receive())
        except TimeoutError:
            return answers, False
        except ConnectionError:
            return answers, True


# -- tests ------------------------------------------------------------------------------

@fuzz(1200)
@given(data=st.binary(min_size=1, max_size=300))
def test_random_bytes(site: Site, data: bytes) -> None:
    clearly_malformed = data[0] >> 4 != CONNECT_TYPE  # the first packet must be CONNECT
    exchange = send_hostile(site.broker.port, [data], 2.0 if clearly_malformed else 0.05)
    if clearly_malformed:
        assert exchange.closed, f"connection left open after {data!r}"
        assert exchange.received == b"", "answered a connection that never sent CONNECT"
    site.check(f"random bytes {data!r}")


@fuzz(500)
@given(chunks=mutated_streams())
def test_mutated_packets(site: Site, chunks: list[bytes]) -> None:
    send_hostile(site.broker.port, chunks, 0.05)
    site.check(f"mutated packets {chunks!r}")


@fuzz(1000)
@given(case=st.sampled_from(LEVELS).flatmap(
    lambda level: st.tuples(st.just(level), malformed_packets(level))))
def test_malformed_packet_closes_the_connection_with_its_reason(
        site: Site, case: tuple[int, tuple[str, bytes, frozenset[int]]]) -> None:
    level, (kind, packet, reasons) = case
    client = RawClient(site.broker.port, level)
    try:
        client.connect(f"hostile-malformed-{level}", clean_start=True, session_expiry=0)
        client.sock.sendall(packet)
        answers, closed = until_closed(client)
    finally:
        client.close()
    what = f"{kind} at level {level} ({packet!r})"
    assert closed, f"{what}: connection left open"
    if level == MQTT_5:
        assert len(answers) == 1 and isinstance(answers[0], Disconnect), \
            f"{what}: wanted one DISCONNECT, got {answers}"
        assert answers[0].reason_code in reasons, \
            f"{what}: DISCONNECT reason 0x{answers[0].reason_code:02x}, wanted one of " \
            f"{sorted(hex(r) for r in reasons)}"
    else:
        assert answers == [], f"{what}: a 3.1.1 server sends no DISCONNECT: {answers}"
    site.check(what)


def test_durable_subscriber_gets_every_well_behaved_message(site: Site) -> None:
    """Runs last in this module: storage is intact after everything above."""
    site.probe()
    present, received = site.durable_payloads(len(site.probes))
    assert present, "the durable session is gone"
    missing = [p for p in site.probes if p not in received]
    assert not missing, f"{len(missing)} of {len(site.probes)} missing, e.g. {missing[:5]}"
    unexpected = sorted(set(received) - set(site.probes))
    assert not unexpected, f"unexpected messages: {unexpected[:5]}"


def test_connack_answers_a_bad_protocol_level(site: Site) -> None:
    """A CONNECT for a protocol level the broker does not speak gets CONNACK 0x01 in the
    3.1.1 format and a closed connection (MQTT-3.1.2-2)."""
    connect = bytearray(encode(Connect("hostile-level", 4), 4))
    connect[8] = 9  # the protocol level byte, after 0x10, length, 0x0004 and "MQTT"
    exchange = send_hostile(site.broker.port, [bytes(connect)], 2.0)
    assert exchange.closed
    answer = PacketReader(1024, protocol_level=4).decode(exchange.received)
    assert answer == [Connack(False, 0x01)], answer
    site.check("CONNECT at protocol level 9")
