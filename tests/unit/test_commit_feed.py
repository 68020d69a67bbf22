"""The commit feed decodes a batch cooked elsewhere (a replica's) only when one of
its listeners wants the shard's messages: a site with no subscriber does not decode
every message of every shard it holds a replica of."""

from __future__ import annotations

from stratamq.broker.ds.cooked import CookedBatch
from stratamq.broker.ds.feed import CommitFeed
from stratamq.broker.ds.message import Message
from stratamq.broker.ds.streams import StreamIndex


def applied_elsewhere_cooked(shard: int, last_timestamp: int) -> CookedBatch:
    """A batch as a follower applies it: its messages' keys and values, not them."""
    return CookedBatch(shard, 1, last_timestamp, 2)


def message(timestamp: int) -> Message:
    found = Message("t/a", b"x", qos=1)
    found.timestamp = timestamp
    return found


class Decoder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cooked: CookedBatch) -> list[tuple[bytes, Message]]:
        self.calls += 1
        return [(b"s", message(cooked.last_timestamp - 1)),
                (b"s", message(cooked.last_timestamp))]


def test_a_batch_nobody_wants_is_not_decoded_but_counts_as_fed() -> None:
    decode = Decoder()
    feed = CommitFeed("messages", 2, StreamIndex(), decode)
    fed: list[CookedBatch] = []
    subscribed: set[int] = set()
    feed.add_commit_listener(fed.append, wants=lambda shard: shard in subscribed)
    feed.committed(applied_elsewhere_cooked(0, 20))
    assert (decode.calls, fed, feed.fed_through()) == (0, [], [20, 0])
    subscribed.add(0)
    feed.committed(applied_elsewhere_cooked(0, 30))
    assert decode.calls == 1
    assert [m.timestamp for _static, m in fed[0].messages] == [29, 30]
    assert feed.fed_through() == [30, 0]
    # a batch its leader cooked here carries its messages: fed whoever wants them
    own = CookedBatch(1, 1, 5, 1, messages=[(b"s", message(5))])
    feed.committed(own)
    assert (decode.calls, fed[-1], feed.fed_through()) == (1, own, [30, 5])


def test_a_listener_without_an_interest_gets_every_batch() -> None:
    decode = Decoder()
    feed = CommitFeed("messages", 1, StreamIndex(), decode)
    fed: list[CookedBatch] = []
    feed.add_commit_listener(lambda _cooked: None, wants=lambda _shard: False)
    feed.add_commit_listener(fed.append)
    feed.committed(applied_elsewhere_cooked(0, 10))
    assert decode.calls == 1 and len(fed) == 1 and len(fed[0].messages) == 2


def test_a_shard_read_elsewhere_asks_only_the_applied_listeners() -> None:
    decode = Decoder()
    feed = CommitFeed("messages", 1, StreamIndex(), decode)
    readers: list[CookedBatch] = []
    pushes: list[CookedBatch] = []
    feed.add_commit_listener(readers.append)  # wants everything, but reads elsewhere
    feed.add_commit_listener(pushes.append, of_applied=True, wants=lambda _shard: False)
    feed.committed(applied_elsewhere_cooked(0, 10), read_elsewhere=True)
    assert (decode.calls, readers, pushes, feed.fed_through()) == (0, [], [], [0])


def test_a_batch_that_does_not_decode_is_a_feed_gap() -> None:
    """Applied but not fed: the readers are told to read the shard from storage."""
    def broken(_cooked: CookedBatch) -> list[tuple[bytes, Message]]:
        raise ValueError("an unknown stream")

    feed = CommitFeed("messages", 1, StreamIndex(), broken)
    fed: list[CookedBatch] = []
    gaps: list[tuple[int, int]] = []
    feed.add_commit_listener(fed.append)
    feed.add_feed_gap_listener(lambda shard, since: gaps.append((shard, since)))
    feed.committed(applied_elsewhere_cooked(0, 10))
    assert (fed, gaps) == ([], [(0, 1)])
