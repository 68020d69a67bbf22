"""A durable session belongs to the user who made it; another user cannot resume it or take
it over (docs/replication.md, "Session ownership"; docs/architecture.md, guarantee 5). A
CONNECT by another authenticated user with the session's client id is refused with
CONNACK 0x87 (MQTT 5) or return code 5 (MQTT 3.1.1); the owner's session, its connection
when online and its queued messages are untouched, and the owner can still resume it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness.processes import BrokerProcess, running_broker
from stratamq.broker.auth.passwords import set_password
from stratamq.broker.mqtt import MQTT_3_1_1, MQTT_5, Packet, Properties, Publish
from tests.support.clients import RawClient, admin_get, unique

NOT_AUTHORIZED = {MQTT_5: 0x87, MQTT_3_1_1: 5}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    workdir = tmp_path_factory.mktemp("owner")
    passwords = workdir / "passwd"
    for user in ("alice", "mallory", "publisher"):
        set_password(passwords, user, f"{user}-secret", "pbkdf2", iterations=1000)
    config = {"access_control": {"allow_anonymous": False, "password_file": str(passwords)}}
    with running_broker(workdir, config) as process:
        yield process


def connect(broker: BrokerProcess, user: str, client_id: str, level: int,
            clean_start: bool = False) -> tuple[RawClient, int, bool]:
    client = RawClient(broker.port, level)
    properties = Properties(session_expiry_interval=300) if level == MQTT_5 else None
    connack = client.connect(client_id, clean_start=clean_start, username=user,
                             password=f"{user}-secret".encode(), properties=properties)
    return client, connack.reason_code, connack.session_present


def publish(broker: BrokerProcess, topic: str, payloads: list[bytes]) -> None:
    publisher, code, _ = connect(broker, "publisher", unique("pub"), MQTT_5, clean_start=True)
    assert code == 0
    for packet_id, payload in enumerate(payloads, 1):
        publisher.publish(topic, payload, 1, packet_id=packet_id)
    publisher.disconnect()


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_another_user_cannot_resume_a_durable_session(broker: BrokerProcess,
                                                      level: int) -> None:
    client_id, topic = unique("victim"), unique("inbox")
    # Clean Start 0 on a new client id: a new durable session (3.1.1 has no expiry)
    alice, code, present = connect(broker, "alice", client_id, level)
    assert (code, present) == (0, False)
    assert alice.subscribe(topic, 1).reason_codes == [1]
    alice.disconnect()
    publish(broker, topic, [b"one", b"two"])

    mallory, code, present = connect(broker, "mallory", client_id, level)
    stolen: list[Packet] = []
    if code == 0:  # the defect: show what was taken
        while True:
            try:
                packet = mallory.recv(1.0)
            except TimeoutError:
                break
            if packet is None:
                break
            stolen.append(packet)
    mallory.close()
    assert code == NOT_AUTHORIZED[level], (
        f"mallory resumed alice's session (CONNACK {code:#x}, session present {present}) "
        f"and got {[p.payload for p in stolen if isinstance(p, Publish)]}")

    alice, code, present = connect(broker, "alice", client_id, level)
    assert (code, present) == (0, True)
    got = [alice.expect(Publish) for _ in range(2)]
    assert [p.payload for p in got] == [b"one", b"two"]
    alice.disconnect()


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_another_user_cannot_take_over_a_connected_session(broker: BrokerProcess,
                                                           level: int) -> None:
    client_id, topic = unique("online"), unique("inbox")
    alice, code, _ = connect(broker, "alice", client_id, level)
    assert code == 0
    assert alice.subscribe(topic, 1).reason_codes == [1]

    mallory, code, _ = connect(broker, "mallory", client_id, level)
    mallory.close()
    assert code == NOT_AUTHORIZED[level], f"mallory took over: CONNACK {code:#x}"

    # alice was not kicked: her connection still gets what is published
    publish(broker, topic, [b"still mine"])
    assert alice.expect(Publish).payload == b"still mine"
    alice.disconnect()


def test_the_owner_can_still_take_over_her_own_session(broker: BrokerProcess) -> None:
    """The refusal is by user, not by client id: the owner's second connection takes
    the session over as usual (0x8E to the first)."""
    client_id = unique("mine")
    first, code, _ = connect(broker, "alice", client_id, MQTT_5, clean_start=True)
    assert code == 0
    second, code, present = connect(broker, "alice", client_id, MQTT_5)
    assert (code, present) == (0, True)
    assert [getattr(p, "reason_code", None) for p in first.wait_closed()] == [0x8E]
    second.disconnect()


def test_resumed_subscriptions_are_checked_against_the_acl_again(
        tmp_path: Path) -> None:
    """A rule added while a durable session was away applies to its stored
    subscriptions: on resume the denied ones are dropped, the others kept."""
    passwords = tmp_path / "passwd"
    set_password(passwords, "alice", "alice-secret", "pbkdf2", iterations=1000)
    acl = tmp_path / "acl.yaml"
    acl.write_text(yaml.safe_dump([]))
    config = {"access_control": {"allow_anonymous": False, "password_file": str(passwords),
                                 "acl_file": str(acl), "acl_no_match": "allow"}}
    client_id = unique("acl-resume")
    process = BrokerProcess(tmp_path, config).start()
    try:
        alice, code, _ = connect(process, "alice", client_id, MQTT_5)
        assert code == 0
        assert alice.subscribe("news/#", 1).reason_codes == [1]
        assert alice.subscribe("open/x", 1).reason_codes == [1]
        alice.disconnect()
        assert process.stop() == 0
        acl.write_text(yaml.safe_dump([
            {"permission": "deny", "action": "subscribe", "topics": ["news/#"]}]))
        process.start()
        alice, code, present = connect(process, "alice", client_id, MQTT_5)
        assert (code, present) == (0, True)
        kept = [s["topic_filter"] for s in admin_get(process, "/api/v1/subscriptions")["data"]
                if s["client_id"] == client_id]
        assert kept == ["open/x"]
        alice.disconnect()
    finally:
        process.kill()
