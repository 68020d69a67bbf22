"""An offline QoS 2 backlog far larger than the in-flight window and the session's
queue drains completely on reconnect, driven by the client's acknowledgements alone.

The periodic stream look (`renew_streams_interval`) and the replay's safety-net poll
(`idle_poll_interval`) are both an hour here, so neither can wake a stalled replay:
every read after the first must be woken by a PUBREC/PUBCOMP freeing room. The client
pipelines like many real ones: it answers every PUBLISH with PUBREC at once and every
PUBREL with PUBCOMP, so a window's PUBRECs all arrive before its PUBCOMPs."""

from __future__ import annotations

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import MQTT_5, Properties, Pubcomp, Publish, Pubrec, Pubrel
from tests.support.clients import RawClient, unique

WINDOW = 2  # the client's Receive Maximum
BACKLOG = 120
WAIT = 20.0  # per packet; generous: an hour is what is ruled out

BROKER_CONFIG = {
    "mqtt": {"max_queued_messages": 4},
    "durable_sessions": {"renew_streams_interval": "1h", "idle_poll_interval": "1h",
                         "batch_size": 5},
}


def test_offline_qos2_backlog_larger_than_the_window_drains(broker: BrokerProcess) -> None:
    prefix = unique("backlog")
    client_id = unique("drain")
    properties = Properties(session_expiry_interval=3600, receive_maximum=WINDOW)
    subscriber = RawClient(broker.port, MQTT_5)
    subscriber.connect(client_id, clean_start=False, properties=properties)
    assert subscriber.subscribe(f"{prefix}/#", 2).reason_codes == [2]
    subscriber.disconnect()

    publisher = RawClient(broker.port, MQTT_5)
    publisher.connect(unique("pub"))
    for number in range(BACKLOG):  # several topics: several streams
        ack = publisher.publish(f"{prefix}/{number % 4}", str(number).encode(), 2,
                                packet_id=number % 100 + 1)
        assert isinstance(ack, Pubcomp) and ack.reason_code == 0
    publisher.disconnect()

    subscriber = RawClient(broker.port, MQTT_5)
    assert subscriber.connect(client_id, clean_start=False,
                              properties=properties).session_present
    received: set[bytes] = set()
    in_flight: set[int] = set()
    most_in_flight = 0
    try:
        while len(received) < BACKLOG or in_flight:
            packet = subscriber.recv(WAIT)
            assert packet is not None, "the broker closed the connection"
            if isinstance(packet, Publish):
                assert packet.qos == 2 and packet.packet_id is not None
                in_flight.add(packet.packet_id)
                most_in_flight = max(most_in_flight, len(in_flight))
                received.add(packet.payload)
                subscriber.send(Pubrec(packet.packet_id))
            elif isinstance(packet, Pubrel):
                in_flight.discard(packet.packet_id)
                subscriber.send(Pubcomp(packet.packet_id))
    except TimeoutError:
        pass
    assert len(received) == BACKLOG, f"stalled after {len(received)} of {BACKLOG}"
    assert most_in_flight <= WINDOW
    subscriber.disconnect()
