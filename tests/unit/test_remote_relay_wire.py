"""Bytes of the peer port's remote reads and relay round-trip, and broken ones
are refused as corrupt."""

from __future__ import annotations

import pytest

from stratamq.broker.ds import END_OF_STREAM, Iterator, Message, Stream
from stratamq.broker.ds.generation import GenerationInfo
from stratamq.broker.ds.lts import Edge
from stratamq.broker.ds.replication.remote_wire import (
    decode_generations,
    decode_next,
    encode_generations,
    encode_next,
)
from stratamq.broker.errors import CorruptDataError
from stratamq.broker.routing.relay_wire import Push, decode_push, encode_push

STREAM = Stream(3, 2, b"\x01" * 8)
MESSAGE = Message("a/b", b"payload", client_id="c1", qos=2, timestamp=1234)


def test_a_next_answer_round_trips() -> None:
    iterator = Iterator(STREAM, "a/+", ("b",), 1234)
    decoded = decode_next(encode_next((iterator, [(b"key", MESSAGE)])))
    assert not isinstance(decoded, type(END_OF_STREAM))
    assert decoded == (iterator, [(b"key", MESSAGE)])
    assert decode_next(encode_next(END_OF_STREAM)) == END_OF_STREAM


def test_a_push_round_trips() -> None:
    push = Push(3, True, [(2, b"\x01" * 8, MESSAGE), (2, b"\x02" * 8, MESSAGE)])
    assert decode_push(encode_push(push)) == push


def test_mirrored_generations_round_trip() -> None:
    info = GenerationInfo(1, "wildcard_optimized_v2", {}, 10, 10, 99)
    edges = [Edge(b"\x00" * 8, "a", b"\x01" * 8), Edge(b"\x01" * 8, "\x00", b"\x02" * 8)]
    assert decode_generations(encode_generations({1: (info, edges)})) == {1: (info, edges)}


@pytest.mark.parametrize("raw", [b"", b"\x01", b"\x02", b"\x01\x00\x00\x00\x09abc"])
def test_a_broken_next_answer_is_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptDataError):
        decode_next(raw)


def test_a_truncated_push_is_corrupt() -> None:
    raw = encode_push(Push(1, False, [(1, b"\x01" * 8, MESSAGE)]))
    with pytest.raises(CorruptDataError):
        decode_push(raw[:-3])
    with pytest.raises(CorruptDataError):
        decode_push(raw + b"x")
