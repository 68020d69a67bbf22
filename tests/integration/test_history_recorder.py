"""The history recorder on real paho clients against one real site, SIGKILLed and
restarted while they run: the recorded history passes the checker, and it holds what
happened (QoS 1 and 2 acknowledged, DUP resends after the restarts)."""

from __future__ import annotations

import time
from pathlib import Path

from harness.processes import HOST, BrokerProcess
from harness.waiting import wait_until
from tests.support.history import History
from tests.support.recorder import (
    RecordingClient,
    RecordingPublisher,
    RecordingSubscriber,
    all_connected,
    connect_counts,
    more_acknowledged,
)

KILLS = 2


def test_recorded_history_of_a_site_killed_twice_passes_the_check(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path).start()
    history = History()
    durable = RecordingSubscriber(history, "rec-durable", HOST, broker.port, "rec/#")
    live = RecordingSubscriber(history, "rec-live", HOST, broker.port, "rec/a", 1,
                               durable=False)
    publishers = [RecordingPublisher(history, f"rec-p{i}", HOST, broker.port,
                                     ["rec/a", "rec/b"]) for i in range(2)]
    clients: list[RecordingClient] = [durable, live, *publishers]
    try:
        for subscriber in (durable, live):
            subscriber.start()
            assert subscriber.subscribed.wait(10), "no SUBACK"
        for publisher in publishers:
            publisher.start()
        assert all_connected(clients, 20, clients), "clients did not connect"
        for kill in range(KILLS):
            assert more_acknowledged(history, 50, 20), history.summary()
            before = connect_counts(clients)
            broker.kill()
            broker.start()
            # every client is back and 50 more messages acknowledged before the next kill
            assert all_connected(clients, 20, clients, before), \
                f"clients did not reconnect after kill {kill}"
        assert more_acknowledged(history, 50, 20), history.summary()
        time.sleep(0.5)
        for publisher in publishers:
            publisher.stop_publishing()
        assert wait_until(lambda: all(p.unacked() == 0 for p in publishers), 20), \
            history.summary()
        wait_until(lambda: not history.missing(), 20)
        time.sleep(0.3)  # resends on their way arrive too
    finally:
        for client in clients:
            client.close()
        broker.kill()
    print(history.summary())
    history.check()
    acknowledged = history.acknowledged_messages()
    assert {m.qos for m in acknowledged} == {1, 2}
    assert durable.connects == KILLS + 1
    assert all(p.connects == KILLS + 1 for p in publishers)
    assert history.sessions["rec-live"][-1].number == KILLS  # a new session per connect
