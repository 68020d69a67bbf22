"""Clients never publish to `$SYS`: those topics are the broker's (MQTT 5.0 section
4.7.2), whatever the ACL says. A PUBLISH to `$SYS` or `$SYS/...` is refused like an
ACL deny (MQTT 5 PUBACK/PUBREC 0x87; 3.1.1 has no way to say no: acknowledged and
dropped; QoS 0 dropped), retained or not, and a will on such a topic is refused at
CONNECT (CONNACK 0x87, return code 5). Other `$` topics stay open. The site runs
without any ACL file: the rule holds on its own."""

from __future__ import annotations

import pytest

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import MQTT_3_1_1, MQTT_5, Puback, Publish, Pubrec, Will
from tests.support.clients import RawClient, unique

NOT_AUTHORIZED = 0x87


def connected(broker: BrokerProcess, level: int = MQTT_5) -> RawClient:
    client = RawClient(broker.port, level)
    assert client.connect(unique("sys")).reason_code == 0
    return client


def test_publish_to_sys_is_refused(broker: BrokerProcess) -> None:
    level = unique("lvl")
    watcher = connected(broker)
    assert watcher.subscribe("$SYS/#", 1, packet_id=1).reason_codes == [1]
    assert watcher.subscribe("$SYS", 1, packet_id=2).reason_codes == [1]
    assert watcher.subscribe(f"$open/{level}", 1, packet_id=3).reason_codes == [1]
    client = connected(broker)
    refused = client.publish(f"$SYS/broker/{level}", b"forged", 1, packet_id=1)
    assert isinstance(refused, Puback) and refused.reason_code == NOT_AUTHORIZED
    refused2 = client.publish(f"$SYS/broker/{level}", b"forged", 2, packet_id=2)
    assert isinstance(refused2, Pubrec) and refused2.reason_code == NOT_AUTHORIZED
    refused3 = client.publish("$SYS", b"forged", 1, packet_id=3)
    assert isinstance(refused3, Puback) and refused3.reason_code == NOT_AUTHORIZED
    refused4 = client.publish(f"$SYS/{level}", b"forged", 1, packet_id=4, retain=True)
    assert isinstance(refused4, Puback) and refused4.reason_code == NOT_AUTHORIZED
    client.publish(f"$SYS/broker/{level}", b"forged", 0)  # QoS 0: dropped without a word
    # another `$` topic is not the broker's
    allowed = client.publish(f"$open/{level}", b"fine", 1, packet_id=5)
    assert isinstance(allowed, Puback) and allowed.reason_code == 0
    assert watcher.expect(Publish).payload == b"fine"  # and nothing refused before it
    watcher.quiet()
    # nothing was retained either
    late = connected(broker)
    assert late.subscribe(f"$SYS/{level}", 1).reason_codes == [1]
    late.quiet()
    for done in (late, client, watcher):
        done.disconnect()


def test_publish_to_sys_on_311_is_acknowledged_and_dropped(broker: BrokerProcess) -> None:
    level = unique("lvl")
    watcher = connected(broker)
    assert watcher.subscribe("$SYS/#", 1).reason_codes == [1]
    client = connected(broker, MQTT_3_1_1)
    # 3.1.1 has no way to say no (as for an ACL deny): PUBACK / PUBREC, then dropped
    assert isinstance(client.publish(f"$SYS/{level}", b"forged", 1, packet_id=1), Puback)
    client.send(Publish(f"$SYS/{level}", b"forged", 2, True, False, 2))
    assert client.expect(Pubrec).packet_id == 2
    watcher.quiet()
    late = connected(broker)
    assert late.subscribe(f"$SYS/{level}", 1).reason_codes == [1]
    late.quiet()
    for done in (late, watcher):
        done.disconnect()
    client.close()


@pytest.mark.parametrize(("level", "code"), [(MQTT_3_1_1, 5), (MQTT_5, NOT_AUTHORIZED)])
@pytest.mark.parametrize("topic", ["$SYS/will", "$SYS"])
def test_will_on_sys_is_refused(broker: BrokerProcess, level: int, code: int,
                                topic: str) -> None:
    client = RawClient(broker.port, level)
    connack = client.connect(unique("will"), will=Will(topic, b"x", 1, True))
    assert connack.reason_code == code
    assert client.wait_closed() == []
