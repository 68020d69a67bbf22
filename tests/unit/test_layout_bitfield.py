"""The key scheme of layout `wildcard_optimized` (pure: no RocksDB)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stratamq.broker.ds.layouts import make_layout
from stratamq.broker.ds.layouts.wildcard_optimized import (
    KeyScheme,
    WildcardOptimized,
    decode_key,
    encode_key,
    next_matching,
    option_problems,
)
from stratamq.broker.ds.lts import TopicKey
from stratamq.broker.errors import ConfigError

STATIC = bytes(range(1, 9))
timestamps = st.integers(min_value=0, max_value=2**64 - 1)
levels = st.sampled_from(["a", "b", "c", "dev-1", "dev-2", "ü", ""])
sizes = st.tuples(st.integers(1, 8), st.integers(1, 64), st.integers(1, 40))


@given(sizes, st.lists(levels, max_size=4).map(tuple), timestamps)
def test_decode_gives_back_what_was_encoded(size: tuple[int, int, int],
                                            varying: tuple[str, ...], timestamp: int) -> None:
    index_bytes, level_bits, epoch_bits = size
    options = {"topic_index_bytes": index_bytes, "bits_per_topic_level": level_bits,
               "epoch_bits": epoch_bits}
    key = encode_key(STATIC, varying, timestamp, **options)
    scheme = KeyScheme(index_bytes, level_bits, epoch_bits, len(varying))
    assert len(key) == index_bytes + scheme.size == index_bytes + (64 + len(varying)
                                                                   * level_bits + 7) // 8
    prefix, epoch, decoded, hashes = decode_key(key, len(varying), **options)
    assert prefix == STATIC[:index_bytes]
    assert decoded == timestamp and epoch == timestamp >> epoch_bits
    assert hashes == [scheme.level_bits(level) for level in varying]
    assert all(0 <= h < 2**level_bits for h in hashes)


@given(sizes, st.lists(levels, min_size=1, max_size=3).map(tuple),
       st.lists(levels, min_size=1, max_size=3).map(tuple), timestamps, timestamps)
def test_keys_order_by_epoch_then_levels_then_time(
        size: tuple[int, int, int], one: tuple[str, ...], other: tuple[str, ...],
        t1: int, t2: int) -> None:
    index_bytes, level_bits, epoch_bits = size
    if len(one) != len(other):
        other = (other * 3)[:len(one)]
    options = {"topic_index_bytes": index_bytes, "bits_per_topic_level": level_bits,
               "epoch_bits": epoch_bits}
    k1, k2 = encode_key(STATIC, one, t1, **options), encode_key(STATIC, other, t2, **options)
    scheme = KeyScheme(index_bytes, level_bits, epoch_bits, len(one))
    expected1 = (t1 >> epoch_bits, [scheme.level_bits(x) for x in one], t1 % 2**epoch_bits)
    expected2 = (t2 >> epoch_bits, [scheme.level_bits(x) for x in other], t2 % 2**epoch_bits)
    assert (k1 < k2) == (expected1 < expected2)
    if one == other:  # one topic: keys in timestamp order
        assert (k1 < k2) == (t1 < t2)


def test_hand_computed_key() -> None:
    # epoch_bits 4, 8 bits a level, one varying level: field = 64 + 8 = 72 bits, 9 bytes
    key = encode_key(STATIC, ("a",), 0x1234_5678_9ABC_DEF5, topic_index_bytes=2,
                     bits_per_topic_level=8, epoch_bits=4)
    scheme = KeyScheme(2, 8, 4, 1)
    expected = (0x1234_5678_9ABC_DEF << 12) | (scheme.level_bits("a") << 4) | 0x5
    assert key == STATIC[:2] + expected.to_bytes(9, "big")


def test_padding_goes_at_the_end() -> None:
    # 64 + 3 bits: 9 bytes, the last 5 bits zero; the first 8 bytes start with the epoch
    key = encode_key(STATIC, ("x",), 2**40 + 7, bits_per_topic_level=3, epoch_bits=10)
    field = key[8:]
    assert len(field) == 9 and field[-1] & 0b11111 == 0
    assert int.from_bytes(field[:8], "big") >> 10 == (2**40 + 7) >> 10


def brute_next(at_least: int, mask: int, value: int, width: int) -> int | None:
    return next((f for f in range(at_least, 2**width) if f & mask == value), None)


@given(st.integers(1, 10).flatmap(lambda width: st.tuples(
    st.just(width), st.integers(0, 2**width), st.integers(0, 2**width - 1),
    st.integers(0, 2**width - 1))))
def test_next_matching_is_the_smallest_matching_field(
        case: tuple[int, int, int, int]) -> None:
    width, at_least, mask, value = case
    value &= mask
    assert next_matching(at_least, mask, value, width) == brute_next(at_least, mask, value,
                                                                     width)


def test_sizes_that_cannot_hold_a_key_are_refused() -> None:
    assert option_problems(8, 64, 20) == []
    problems = option_problems(0, 65, 41)
    assert len(problems) == 3
    assert "topic_index_bytes is 0" in problems[0] and "1 to 8" in problems[0]
    assert "bits_per_topic_level is 65" in problems[1] and "1 to 64" in problems[1]
    assert "epoch_bits is 41" in problems[2]
    with pytest.raises(ConfigError, match="topic_index_bytes is 9"):
        make_layout("wildcard_optimized", {"topic_index_bytes": 9})
    with pytest.raises(ConfigError, match="has no options"):
        make_layout("wildcard_optimized", {"epoch_length": 9})
    with pytest.raises(ConfigError, match="takes no options"):
        make_layout("wildcard_optimized_v2", {"epoch_bits": 9})
    with pytest.raises(ConfigError, match="not available"):
        make_layout("btree", {})


def test_layout_records_every_option_and_writes_one_key_per_message() -> None:
    layout = make_layout("wildcard_optimized", {"epoch_bits": 12})
    assert layout.options() == {"topic_index_bytes": 8, "bits_per_topic_level": 64,
                                "epoch_bits": 12}
    assert isinstance(layout, WildcardOptimized) and layout.epoch_us == 4096
    entries = layout.encode("s/1/t", TopicKey(STATIC, ("1",)), 99, b"m")
    assert entries == [(encode_key(STATIC, ("1",), 99, epoch_bits=12), b"m")]
    # the cached per-topic part gives the same key as the pure function
    assert layout.encode("s/1/t", TopicKey(STATIC, ("1",)), 5000, b"m")[0][0] == \
        encode_key(STATIC, ("1",), 5000, epoch_bits=12)
