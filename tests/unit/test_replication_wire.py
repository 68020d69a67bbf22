"""The bytes of the peer protocol round-trip, and damaged ones are refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stratamq.broker.ds.replication import AppendRequest, AppendResult, Entry, Position
from stratamq.broker.ds.replication.wire import (
    decode_request,
    decode_result,
    encode_request,
    encode_result,
)
from stratamq.broker.errors import CorruptDataError

u64 = st.integers(0, 2**64 - 1)
positions = st.builds(Position, u64, u64)
requests = st.builds(AppendRequest, u64, positions,
                     st.lists(st.builds(Entry, positions, st.binary(max_size=64)), max_size=5),
                     u64, u64)
results = st.builds(AppendResult, st.booleans(), u64, positions, u64)


@given(requests)
def test_requests_round_trip(request: AppendRequest) -> None:
    raw = encode_request(request)
    assert decode_request(raw) == request
    with pytest.raises(CorruptDataError):
        decode_request(raw[:-1])
    with pytest.raises(CorruptDataError):
        decode_request(raw + b"\x00")


@given(results)
def test_results_round_trip(result: AppendResult) -> None:
    raw = encode_result(result)
    assert decode_result(raw) == result
    with pytest.raises(CorruptDataError):
        decode_result(raw[:-1])


def test_another_protocol_version_is_refused() -> None:
    raw = encode_result(AppendResult(True, 1, Position(1, 1)))
    with pytest.raises(CorruptDataError, match="version 1"):  # before trimming was told
        decode_result(b"\x01" + raw[1:])
