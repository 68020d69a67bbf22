"""The smallest end-to-end check: a real broker process, a real client."""

from __future__ import annotations

import threading

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from harness.processes import BrokerProcess


def test_publish_subscribe_roundtrip_and_clean_stop(broker: BrokerProcess) -> None:
    received: list[bytes] = []
    arrived = threading.Event()

    def on_message(_c: mqtt.Client, _u: object, message: mqtt.MQTTMessage) -> None:
        received.append(bytes(message.payload))
        if len(received) == 3:
            arrived.set()

    subscriber = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="s",
                             protocol=mqtt.MQTTv5)
    subscriber.on_message = on_message
    subscriber.connect("127.0.0.1", broker.port)
    subscriber.loop_start()
    subscriber.subscribe("smoke/#", qos=1)[1]
    publisher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="p",
                            protocol=mqtt.MQTTv311)
    publisher.connect("127.0.0.1", broker.port)
    publisher.loop_start()
    import time
    time.sleep(0.3)
    for number in range(3):
        publisher.publish("smoke/t", b"%d" % number, qos=1).wait_for_publish(5)
    assert arrived.wait(5)
    assert received == [b"0", b"1", b"2"]
    for client in (publisher, subscriber):
        client.disconnect()
        client.loop_stop()
    assert broker.stop() == 0
    assert "stopped cleanly" in broker.log()
