"""Access control over MQTT: no anonymous clients, a password file, and ACL rules that
refuse publishing and subscribing (MQTT 5.0 CONNACK 0x86/0x87, PUBACK/PUBREC 0x87,
SUBACK 0x87; MQTT 3.1.1 CONNACK return codes 4 and 5, SUBACK 0x80)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.processes import BrokerProcess
from stratamq.broker.auth.passwords import set_password
from stratamq.broker.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Puback,
    Publish,
    Pubrec,
    Will,
)
from tests.support.clients import PahoClient, RawClient, unique

RULES = [
    {"permission": "allow", "action": "all", "topics": ["users/%u/#"]},
    {"permission": "deny", "action": "all", "topics": ["users/#"]},
    {"permission": "deny", "action": "publish", "topics": ["readonly/#"]},
    {"permission": "deny", "action": "subscribe", "topics": ["writeonly/#"]},
]


def BROKER_CONFIG(workdir: Path) -> dict[str, Any]:
    passwords = workdir / "passwd"
    for user in ("alice", "bob"):
        set_password(passwords, user, f"{user}-secret", "pbkdf2", iterations=1000)
    acl = workdir / "acl.yaml"
    acl.write_text(yaml.safe_dump(RULES))
    config = {"access_control": {"allow_anonymous": False, "password_file": str(passwords),
                                 "acl_file": str(acl), "acl_no_match": "allow"}}
    return config


def login(broker: BrokerProcess, user: str, level: int = MQTT_5) -> RawClient:
    client = RawClient(broker.port, level)
    connack = client.connect(unique(user), username=user, password=f"{user}-secret".encode())
    assert connack.reason_code == 0
    return client


@pytest.mark.parametrize(("level", "code"), [(MQTT_3_1_1, 5), (MQTT_5, 0x87)])
def test_anonymous_clients_are_not_authorized(broker: BrokerProcess, level: int,
                                              code: int) -> None:
    client = RawClient(broker.port, level)
    assert client.connect(unique("anon")).reason_code == code
    assert client.wait_closed() == []


@pytest.mark.parametrize(("level", "code"), [(MQTT_3_1_1, 4), (MQTT_5, 0x86)])
@pytest.mark.parametrize(("user", "password"), [("alice", b"wrong"), ("mallory", b"x"),
                                                ("alice", None)])
def test_bad_user_name_or_password(broker: BrokerProcess, level: int, code: int, user: str,
                                   password: bytes | None) -> None:
    client = RawClient(broker.port, level)
    connack = client.connect(unique("bad"), username=user, password=password)
    assert connack.reason_code == code
    assert client.wait_closed() == []


@pytest.mark.parametrize("version", [4, 5])
def test_users_in_the_password_file_connect(broker: BrokerProcess, version: int) -> None:
    client = PahoClient(broker.port, unique("paho"), version=version)
    client.client.username_pw_set("bob", "bob-secret")
    try:
        assert client.connect().reason_code == 0
        topic = f"users/bob/{unique('t')}"
        assert client.subscribe(topic, 1) == [1]
        assert client.publish(topic, b"mine", 1) == 0
        assert client.expect(1)[0].payload == b"mine"
    finally:
        client.stop()


def test_publish_refused_by_the_acl(broker: BrokerProcess) -> None:
    watcher = login(broker, "bob")
    watcher.subscribe("readonly/#", 1, packet_id=1)
    watcher.subscribe("open/#", 1, packet_id=2)
    alice = login(broker, "alice")
    refused = alice.publish("readonly/x", b"no", 1, packet_id=1)
    assert isinstance(refused, Puback) and refused.reason_code == 0x87
    refused2 = alice.publish("readonly/x", b"no", 2, packet_id=2)
    assert isinstance(refused2, Pubrec) and refused2.reason_code == 0x87
    refused3 = alice.publish("users/bob/inbox", b"no", 1, packet_id=3)  # not her folder
    assert isinstance(refused3, Puback) and refused3.reason_code == 0x87
    alice.publish("readonly/x", b"no", 0)  # QoS 0: dropped without a word
    allowed = alice.publish("open/x", b"yes", 1, packet_id=4)
    assert isinstance(allowed, Puback) and allowed.reason_code == 0
    assert watcher.expect(Publish).payload == b"yes"  # and nothing refused before it
    watcher.quiet()
    alice.disconnect()
    watcher.disconnect()


def test_publish_refused_on_311_is_not_delivered(broker: BrokerProcess) -> None:
    watcher = login(broker, "bob")
    watcher.subscribe("readonly/#", 1)
    alice = login(broker, "alice", MQTT_3_1_1)
    alice.publish("readonly/x", b"no", 1)  # 3.1.1 has no way to say no: PUBACK, dropped
    watcher.quiet()
    alice.disconnect()
    watcher.disconnect()


@pytest.mark.parametrize(("level", "code"), [(MQTT_3_1_1, 0x80), (MQTT_5, 0x87)])
def test_subscribe_refused_by_the_acl(broker: BrokerProcess, level: int, code: int) -> None:
    bob = login(broker, "bob", level)
    assert bob.subscribe("writeonly/x", 1, packet_id=1).reason_codes == [code]
    assert bob.subscribe("users/alice/#", 1, packet_id=2).reason_codes == [code]
    assert bob.subscribe("$share/g/writeonly/x", 1, packet_id=3).reason_codes == [code]
    assert bob.subscribe("users/bob/#", 1, packet_id=4).reason_codes == [1]
    # a refused subscription receives nothing
    alice = login(broker, "alice")
    alice.publish("writeonly/x", b"w", 1)
    bob.quiet()
    alice.disconnect()
    bob.disconnect()


def test_will_to_a_refused_topic_is_not_authorized(broker: BrokerProcess) -> None:
    client = RawClient(broker.port)
    connack = client.connect(unique("will"), username="alice", password=b"alice-secret",
                             will=Will("readonly/will", b"x"))
    assert connack.reason_code == 0x87
    assert client.wait_closed() == []
