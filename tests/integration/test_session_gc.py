"""Sessions left behind by a crashed site expire on the restarted one: the GC task
deletes them and publishes their wills."""

from __future__ import annotations

import time
from pathlib import Path

from paho.mqtt.packettypes import PacketTypes

from harness.processes import BrokerProcess
from tests.support.clients import PahoClient, paho_properties


def test_expired_sessions_of_a_crashed_site_are_collected_and_wills_published(
        tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path, {"durable_sessions": {"session_gc_interval": "300ms"}})
    broker.start()
    try:
        doomed = PahoClient(broker.port, "doomed")
        doomed.client.will_set("gc/will", b"gone", qos=1, properties=paho_properties(
            PacketTypes.WILLMESSAGE, WillDelayInterval=3600))
        assert doomed.connect(clean_start=False, properties=paho_properties(
            PacketTypes.CONNECT, SessionExpiryInterval=2)).reason_code == 0
        assert doomed.subscribe("gc/never", 1) == [1]
        broker.kill()  # the session was connected: no disconnect time, no timers
        doomed.client.loop_stop()

        broker.start()
        watcher = PahoClient(broker.port, "watcher")
        assert watcher.connect().reason_code == 0
        assert watcher.subscribe("gc/will", 1) == [1]
        # expiry (2 s) comes before the will delay (1 h): the will goes out at expiry
        (will,) = watcher.expect(1, timeout=15)
        assert (will.topic, will.payload) == ("gc/will", b"gone")
        time.sleep(0.5)
        returning = PahoClient(broker.port, "doomed")
        connack = returning.connect(clean_start=False, properties=paho_properties(
            PacketTypes.CONNECT, SessionExpiryInterval=60))
        assert connack.reason_code == 0 and not connack.session_present
        for client in (watcher, returning):
            client.client.disconnect()
            client.client.loop_stop()
    finally:
        broker.kill()
