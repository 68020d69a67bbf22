"""Will messages (MQTT 5.0 section 3.1.2.5 and 3.1.3.2; MQTT 3.1.1 section 3.1.2.5)."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator

import pytest

from harness.processes import BrokerProcess
from stratamq.broker.mqtt import MQTT_3_1_1, MQTT_5, Properties, Will
from tests.support.clients import (
    TIMEOUT,
    PahoClient,
    RawClient,
    prop,
    unique,
)


@pytest.fixture
def watcher(broker: BrokerProcess) -> Iterator[tuple[PahoClient, str]]:
    """A subscriber to a fresh will topic."""
    topic = unique("will")
    client = PahoClient(broker.port, unique("watcher"))
    client.connect()
    client.subscribe(topic, 1)
    yield client, topic
    client.stop()


def will_client(broker: BrokerProcess, level: int, topic: str, *, delay: int | None = None,
                session_expiry: int | None = None, client_id: str | None = None,
                clean_start: bool = True) -> RawClient:
    client = RawClient(broker.port, level)
    properties = Properties(content_type="text/plain", user_properties=[("k", "v")]) \
        if level == MQTT_5 else Properties()
    properties.will_delay_interval = delay
    connack = client.connect(
        client_id or unique("dying"), clean_start=clean_start,
        properties=Properties(session_expiry_interval=session_expiry),
        will=Will(topic, b"gone", 1, False, properties))
    assert connack.reason_code == 0
    return client


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_will_is_published_when_the_connection_drops(broker: BrokerProcess,
                                                     watcher: tuple[PahoClient, str],
                                                     level: int) -> None:
    subscriber, topic = watcher
    will_client(broker, level, topic).close()
    [will] = subscriber.expect(1)
    assert (will.topic, will.payload, will.qos) == (topic, b"gone", 1)
    if level == MQTT_5:  # will properties travel with it
        assert prop(will.properties, "ContentType") == "text/plain"
        assert prop(will.properties, "UserProperty") == [("k", "v")]


@pytest.mark.parametrize("level", [MQTT_3_1_1, MQTT_5])
def test_no_will_after_a_normal_disconnect(broker: BrokerProcess,
                                           watcher: tuple[PahoClient, str],
                                           level: int) -> None:
    subscriber, topic = watcher
    will_client(broker, level, topic).disconnect()
    subscriber.quiet()


@pytest.mark.parametrize("reason_code", [0x04, 0x80, 0x83])
def test_disconnect_other_than_normal_publishes_the_will(broker: BrokerProcess,
                                                         watcher: tuple[PahoClient, str],
                                                         reason_code: int) -> None:
    """0x04 (disconnect with will message) asks for it; an error code does not remove
    it: only 0x00 does."""
    subscriber, topic = watcher
    will_client(broker, MQTT_5, topic).disconnect(reason_code)
    assert subscriber.expect(1)[0].payload == b"gone"


def test_will_is_published_when_the_keepalive_runs_out(broker: BrokerProcess,
                                                       watcher: tuple[PahoClient, str]) -> None:
    subscriber, topic = watcher
    client = RawClient(broker.port)
    client.connect(unique("silent"), keepalive=1, will=Will(topic, b"timed out", 1))
    assert subscriber.expect(1)[0].payload == b"timed out"
    client.close()


def test_will_delay_interval_holds_the_will_back(broker: BrokerProcess,
                                                 watcher: tuple[PahoClient, str]) -> None:
    subscriber, topic = watcher
    will_client(broker, MQTT_5, topic, delay=1, session_expiry=30).close()
    subscriber.quiet(0.5)  # the delay is one second
    assert subscriber.expect(1)[0].payload == b"gone"


def test_reconnect_within_the_will_delay_cancels_the_will(
        broker: BrokerProcess, watcher: tuple[PahoClient, str]) -> None:
    subscriber, topic = watcher
    client_id = unique("back")
    will_client(broker, MQTT_5, topic, delay=2, session_expiry=30, client_id=client_id).close()
    back = RawClient(broker.port)
    connack = back.connect(client_id, clean_start=False,
                           properties=Properties(session_expiry_interval=30))
    assert connack.session_present is True
    subscriber.quiet(2.2)
    back.disconnect()
    subscriber.quiet(0.1)


def test_will_delay_is_cut_short_by_session_expiry(broker: BrokerProcess,
                                                   watcher: tuple[PahoClient, str]) -> None:
    subscriber, topic = watcher
    # the session ends after one second, so the will goes then, not after an hour
    will_client(broker, MQTT_5, topic, delay=3600, session_expiry=1).close()
    assert subscriber.expect(1)[0].payload == b"gone"


def test_takeover_publishes_the_old_connections_will(broker: BrokerProcess,
                                                     watcher: tuple[PahoClient, str]) -> None:
    subscriber, topic = watcher
    client_id = unique("taken")
    old = will_client(broker, MQTT_5, topic, session_expiry=30, client_id=client_id)
    new = RawClient(broker.port)
    assert new.connect(client_id, clean_start=False,
                       properties=Properties(session_expiry_interval=30)).session_present
    assert subscriber.expect(1)[0].payload == b"gone"
    old.close()
    new.disconnect()


def test_retained_will_is_kept_for_later_subscribers(broker: BrokerProcess) -> None:
    topic = unique("last-will")
    client = RawClient(broker.port, MQTT_3_1_1)
    client.connect(unique("status"), will=Will(topic, b"offline", 1, True))
    client.close()
    later = PahoClient(broker.port, unique("later"))
    try:
        later.connect()
        later.subscribe(topic, 1)
        [will] = later.expect(1)
        deadline = time.monotonic() + TIMEOUT
        while not will.retain:
            # published after the SUBSCRIBE, it came as a live message; subscribing
            # again sends the retained copy once it is stored
            assert time.monotonic() < deadline, "the will was not retained"
            later.subscribe(topic, 1)
            with contextlib.suppress(queue.Empty):
                will = later.messages.get(timeout=0.2)
        assert will.payload == b"offline"
    finally:
        later.stop()


def test_a_will_on_a_wildcard_topic_is_never_published(broker: BrokerProcess) -> None:
    """A will topic must be a topic name. Refusing the CONNECT or keeping the will
    unpublished are both right; publishing it, or failing while the connection
    closes, is not. The valid will published afterwards shows the site went on."""
    topic = unique("will")
    subscriber = PahoClient(broker.port, unique("watcher"))
    subscriber.connect()
    subscriber.subscribe(f"{topic}/#", 1)
    bad = RawClient(broker.port, MQTT_5)
    connack = bad.connect(unique("dying"), will=Will(f"{topic}/+", b"bad", 1))
    bad.close()
    if connack.reason_code == 0:
        time.sleep(0.5)  # its connection's end is handled before the next one's
    will_client(broker, MQTT_5, f"{topic}/ok").close()
    [will] = subscriber.expect(1)
    assert (will.topic, will.payload) == (f"{topic}/ok", b"gone")
    with pytest.raises(queue.Empty):
        subscriber.messages.get(timeout=1.0)
    subscriber.stop()
