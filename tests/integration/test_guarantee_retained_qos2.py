"""A QoS 2 PUBLISH with RETAIN whose retained copy cannot be stored is not stored
either, so its resend is stored whole. The message and its packet id are one write,
the retained copy another (another database); a resend whose packet id is found
recorded is answered PUBREC and not stored again. With both written side by side, a
retained copy that failed alone was never written: the client, told PUBREC on its
resend, had its retained message lost.

In process (a real site: listeners, RocksDB), so the retained database alone can be
made to fail: it is closed under the running site, as at a shutdown or a failed
disk, and refuses every write. (The connection closed then had a DISCONNECT with
reason code 0x88, which is a CONNACK's only: the client could not decode it.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from stratamq.broker.core.broker import RETAINED_DB
from stratamq.broker.mqtt import (
    MQTT_5,
    Disconnect,
    Properties,
    Pubcomp,
    Publish,
    Suback,
    Subscribe,
    SubscriptionOptions,
    encode,
)
from tests.support.clients import RawClient
from tests.support.storage import read_filter, run, running_site

TOPIC = "state/door"


def test_a_qos2_retained_message_whose_retained_copy_fails_is_not_stored(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running_site(tmp_path / "data") as (site, port):
            client = await asyncio.to_thread(RawClient, port)
            await asyncio.to_thread(client.connect, "writer")
            done = await asyncio.to_thread(client.publish, TOPIC, b"open", 2, packet_id=1,
                                           retain=True)
            assert isinstance(done, Pubcomp), done
            await site.storage.kv_databases[RETAINED_DB].database.close()
            await asyncio.to_thread(client.send, Publish(TOPIC, b"closed", 2, True, False, 2,
                                                         Properties()))
            answered = await asyncio.to_thread(client.wait_closed)
            # no PUBREC: closed, with a code that says to try later (Server busy)
            assert [(type(packet), getattr(packet, "reason_code", None))
                    for packet in answered] == [(Disconnect, 0x89)], answered
            stored = await read_filter(site.storage, "messages", TOPIC)
            assert [message.payload for message in stored] == [b"open"]
    run(scenario())


def test_a_topics_retained_message_is_the_last_published_whatever_their_qos(
        tmp_path: Path) -> None:
    """A QoS 1 RETAIN message then a QoS 2 one on the same topic, in one segment: the
    QoS 2 one's retained copy, written first (above), must still be written after the
    QoS 1 one's, or the topic keeps the older message."""
    async def scenario() -> None:
        async with running_site(tmp_path / "data") as (_site, port):
            writer = await asyncio.to_thread(RawClient, port)
            await asyncio.to_thread(writer.connect, "writer")
            await asyncio.to_thread(writer.send_bytes, b"".join(
                encode(Publish(TOPIC, payload, qos, True, False, packet_id, Properties()),
                       MQTT_5) for payload, qos, packet_id in ((b"older", 1, 1),
                                                               (b"newer", 2, 2))))
            acks = [await asyncio.to_thread(writer.recv) for _ in range(2)]
            assert sorted(type(ack).__name__ for ack in acks) == ["Puback", "Pubrec"], acks
            reader = await asyncio.to_thread(RawClient, port)
            await asyncio.to_thread(reader.connect, "reader")
            await asyncio.to_thread(reader.send, Subscribe(
                1, [(TOPIC, SubscriptionOptions(0))], Properties()))
            await asyncio.to_thread(reader.expect, Suback)
            retained = await asyncio.to_thread(reader.expect, Publish)
            assert (retained.payload, retained.retain) == (b"newer", True)
    run(scenario())
