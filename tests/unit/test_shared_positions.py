"""The record a site keeps of each shared group (core/shared_positions.py): what
round-trips, what is refused, and the file of the previous version that is read once."""

from __future__ import annotations

import json

import pytest

from stratamq.broker.core.dispatch import AbsentGroup
from stratamq.broker.core.shared_positions import decode, decode_old_file, encode
from stratamq.broker.errors import CorruptDataError

GROUP = AbsentGroup({0: 17, 3: 1_700_000_000_000_000}, {"a", "b"})


def test_a_record_round_trips() -> None:
    assert decode(encode(GROUP, 12.5)) == (GROUP, 12.5)
    assert decode(encode(AbsentGroup({}, {"c"}), 1.0)) == (AbsentGroup({}, {"c"}), 1.0)


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"format": 2, "saved_at": 1}',
                                 b'{"format": 1, "saved_at": 1, "away": []}',
                                 b'{"format": 1, "saved_at": 1, "since": {"x": 1}, '
                                 b'"away": []}', b"\xff"])
def test_a_damaged_record_is_refused(raw: bytes) -> None:
    with pytest.raises(CorruptDataError):
        decode(raw)


def test_the_file_of_the_previous_version_is_read() -> None:
    text = json.dumps({"format": 1, "saved_at": 12.5, "groups": {
        "g/t/#": {"since": {"0": 17}, "away": ["a"]}}})
    assert decode_old_file(text) == ({"g/t/#": AbsentGroup({0: 17}, {"a"})}, 12.5)
    with pytest.raises(CorruptDataError):
        decode_old_file('{"format": 1, "saved_at": 1}')
