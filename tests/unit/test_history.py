"""The history checker (tests/support/history.py): histories that must pass and ones
that must fail, each failure with the words its report must contain."""

from __future__ import annotations

import threading

import pytest

from tests.support.history import History, Message, runs_of, topic_matches

A = "pub-a"


def m(seq: int, qos: int = 1, topic: str = "t/x", publisher: str = A) -> Message:
    return Message(publisher, topic, qos, seq)


def subscriber(history: History, name: str = "sub", topic_filter: str = "t/#", *,
               durable: bool = True) -> None:
    history.connected(name, clean_start=not durable, durable=durable, session_present=False)
    history.subscribed(name, topic_filter, 2)


def publish(history: History, *messages: Message, ack: bool = True) -> None:
    for message in messages:
        history.published(message)
        if ack:
            history.acknowledged(message)


def deliver(history: History, *messages: Message, name: str = "sub", dup: bool = False,
            qos: int | None = None) -> None:
    for message in messages:
        history.received(name, message.topic, message.encode(),
                         message.qos if qos is None else qos, dup)


def reconnect(history: History, name: str = "sub", *, session_present: bool = True) -> None:
    history.disconnected(name)
    history.connected(name, clean_start=False, durable=True, session_present=session_present)


def failure(history: History) -> str:
    with pytest.raises(AssertionError) as raised:
        history.check()
    return str(raised.value)


# -- histories that pass ----------------------------------------------------------------

def test_everything_delivered_in_order_passes() -> None:
    history = History()
    subscriber(history)
    messages = [m(i, qos) for qos in (1, 2) for i in range(5)]
    publish(history, *messages)
    deliver(history, *messages)
    history.check()
    assert history.missing() == {}
    assert "acknowledged 10" in history.summary()


def test_qos1_resend_of_the_in_flight_window_after_a_reconnect_passes() -> None:
    """MQTT 5 4.6's own example: 1,2,3,2,3,4 (the resends carry DUP)."""
    history = History()
    subscriber(history)
    publish(history, *[m(i) for i in range(1, 5)])
    deliver(history, m(1), m(2), m(3))
    reconnect(history)
    deliver(history, m(2), m(3), dup=True)
    deliver(history, m(4))
    history.check()


def test_qos1_and_qos2_of_one_publisher_and_topic_may_pass_each_other() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0, 1), m(0, 2), m(1, 1), m(1, 2))
    deliver(history, m(0, 2), m(1, 2), m(0, 1), m(1, 1))
    history.check()


def test_publishers_and_topics_interleave_freely() -> None:
    history = History()
    subscriber(history)
    a0, a1 = m(0, topic="t/a"), m(1, topic="t/a")
    b0, b1 = m(0, topic="t/b", publisher="pub-b"), m(1, topic="t/b", publisher="pub-b")
    publish(history, a0, b0, a1, b1)
    deliver(history, b0, b1, a0, a1)
    history.check()


def test_messages_not_acknowledged_or_published_before_the_suback_may_be_missing() -> None:
    history = History()
    history.connected("sub", clean_start=False, durable=True, session_present=False)
    publish(history, m(0))  # before the SUBACK
    history.subscribed("sub", "t/#", 2)
    history.published(m(1))  # never acknowledged (refused, or the outcome unknown)
    history.refused(m(1), 0x80)
    publish(history, m(2, topic="other/x"))  # not matched by the filter
    history.check()


def test_an_unacknowledged_message_may_still_be_delivered() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0), ack=False)
    deliver(history, m(0))
    history.check()


def test_a_non_durable_session_whose_connection_ended_may_miss_messages() -> None:
    history = History()
    subscriber(history, durable=False)
    publish(history, m(0))
    history.disconnected("sub")
    publish(history, m(1))
    history.check()


def test_a_durable_session_keeps_its_subscriptions_across_reconnects() -> None:
    history = History()
    subscriber(history)
    reconnect(history)
    publish(history, m(0))
    deliver(history, m(0))
    history.check()


def test_record_from_many_threads() -> None:
    history = History()
    subscriber(history)

    def run(publisher: str) -> None:
        for seq in range(200):
            message = m(seq, publisher=publisher)
            publish(history, message)
            deliver(history, message)

    threads = [threading.Thread(target=run, args=(f"p{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    history.check()
    assert len(history.acknowledged_messages()) == 800


# -- histories that fail ----------------------------------------------------------------

def test_an_acknowledged_message_never_delivered_fails() -> None:
    history = History()
    subscriber(history)
    subscriber(history, "other")
    publish(history, m(0), m(1), m(2))
    deliver(history, m(0), m(2))
    deliver(history, m(0), m(1), m(2), name="other")
    assert history.missing() == {"sub[0]": [m(1)]}
    report = failure(history)
    assert "sub[0]: 1 acknowledged messages never delivered: pub-a/t/x/q1#1 (1)" in report
    assert "other" not in report.split("\n", 1)[1]


def test_a_qos2_message_delivered_twice_fails() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0, 2), m(1, 2))
    deliver(history, m(0, 2), m(1, 2))
    reconnect(history)
    deliver(history, m(1, 2), dup=True)
    report = failure(history)
    assert "1 QoS 2 messages delivered more than once, e.g. pub-a/t/x/q2#1" in report
    assert list(history.problems_by_kind()) == ["QoS 2 duplicate"]  # not also "order"


def test_qos1_redelivery_without_dup_passes_unless_dup_is_required() -> None:
    for dup_required in (False, True):
        history = History(dup_required=dup_required)
        subscriber(history)
        publish(history, *[m(i) for i in range(4)])
        deliver(history, m(0), m(1), m(2))
        reconnect(history)
        deliver(history, m(1), m(2), m(3))  # a resend, but DUP is not set
        if dup_required:
            assert "1 came after 2 without DUP" in failure(history)
        else:
            history.check()
            assert "2 re-deliveries without DUP" in history.summary()


def test_a_repeat_of_the_latest_without_dup_fails_when_dup_is_required() -> None:
    history = History(dup_required=True)
    subscriber(history)
    publish(history, m(0), m(1))
    deliver(history, m(0), m(1), m(1))
    assert "1 came after 1 without DUP" in failure(history)


def test_a_first_delivery_after_a_newer_message_fails_even_with_dup() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0), m(1), m(2))
    deliver(history, m(0), m(2))
    deliver(history, m(1), dup=True)  # message 1 was skipped, then filled in
    report = failure(history)
    assert "1 came after 2 never delivered before" in report
    # Where the breach sits among the events the clients saw (published 1, acked 2 ...)
    assert ("timeline of sub[0]: 0 (published 2, acked 3, arrived 8); 2 (published 6, "
            "acked 7, arrived 9); 1 (published 4, acked 5, arrived 10, DUP); its CONNACKs "
            "at [0]") in report


def test_a_resend_out_of_the_original_order_fails() -> None:
    """1,2,3,4 then resends 3,2: every single delivery is a DUP redelivery, but the
    final copies are 1,4,3,2."""
    history = History()
    subscriber(history)
    publish(history, *[m(i) for i in range(1, 5)])
    deliver(history, m(1), m(2), m(3), m(4))
    reconnect(history)
    deliver(history, m(3), m(2), dup=True)
    assert "final copies out of order: 3 last arrived after 4" in failure(history)


def test_a_qos2_first_delivery_out_of_order_fails() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0, 2), m(1, 2))
    deliver(history, m(1, 2), m(0, 2))
    assert "pub-a/t/x/2: 0 came after 1 never delivered before" in failure(history)
    assert list(history.problems_by_kind()) == ["order"]


def test_a_lost_durable_session_fails() -> None:
    history = History()
    subscriber(history)
    reconnect(history, session_present=False)
    publish(history, m(0))  # the lost session's subscription is gone with it
    report = failure(history)
    assert "sub[0]: durable session lost" in report
    assert "never delivered" not in report


def test_a_delivery_of_something_never_published_fails() -> None:
    history = History()
    subscriber(history)
    history.received("sub", "t/x", b"not a numbered payload", 1, False)
    publish(history, m(0))
    deliver(history, m(0))
    history.received("sub", "t/y", m(0).encode(), 1, True)  # on the wrong topic
    assert "2 deliveries of messages never published" in failure(history)


def test_a_sequence_number_published_twice_is_a_test_error() -> None:
    history = History()
    history.published(m(0))
    with pytest.raises(ValueError, match="published twice"):
        history.published(m(0))


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), [
    ("t/#", "t", True), ("t/#", "t/a/b", True), ("t/+", "t/a", True),
    ("t/+", "t/a/b", False), ("t/+/c", "t/b/c", True), ("t/a", "t/a", True),
    ("t/a", "t/b", False), ("#", "$SYS/x", False), ("+/x", "$SYS/x", False),
    ("$SYS/#", "$SYS/x", True), ("t/a/b", "t/a", False), ("+", "", True),
])
def test_topic_matches(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected


def test_a_lost_durable_session_still_owes_what_came_before_the_loss() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0))
    reconnect(history, session_present=False)
    report = failure(history)
    assert "sub[0]: 1 acknowledged messages never delivered: pub-a/t/x/q1#0 (1)" in report


def test_a_session_replaced_by_a_clean_start_is_exempt() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0))
    history.connected("sub", clean_start=True, durable=True, session_present=False)
    history.check()


def test_problems_come_under_their_rule() -> None:
    history = History()
    subscriber(history)
    publish(history, m(0, 2), m(1, 2), m(2))
    deliver(history, m(1, 2), m(0, 2), m(0, 2))
    history.received("sub", "t/x", b"junk", 1, False)
    reconnect(history, session_present=False)
    assert sorted(history.problems_by_kind()) == [
        "QoS 2 duplicate", "lost", "order", "session lost", "unknown"]


def test_losses_are_reported_as_runs_per_publisher_topic_and_qos() -> None:
    lost = [Message("p", "t", 1, seq) for seq in (3, 4, 5, 9)] + [Message("p", "t", 2, 4)]
    assert runs_of(lost) == "p/t/q1#3-5 (3), p/t/q1#9 (1), p/t/q2#4 (1)"
