"""The record a site keeps of each shared group (shared/positions.py): what
round-trips and what is refused."""

from __future__ import annotations

import pytest

from stratamq.broker.errors import CorruptDataError
from stratamq.broker.shared.groups import AbsentGroup
from stratamq.broker.shared.positions import decode, encode

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

