"""Shard log entries, forwarded writes and a placement push's peers: what round-trips,
and what is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stratamq.broker.config import load_config
from stratamq.broker.ds import Message
from stratamq.broker.ds.fence import Fence
from stratamq.broker.ds.replication import entries
from stratamq.broker.ds.replication.kept_placement import parse_peers
from stratamq.broker.ds.replication.wire import decode_submit, encode_submit
from stratamq.broker.errors import CorruptDataError, PlacementError

changes = st.one_of(
    st.binary(max_size=64),
    st.builds(entries.AddGeneration, st.integers(0, 2**64 - 1),
              st.lists(st.text(max_size=12), max_size=4).map(tuple)),
    st.builds(entries.DropGeneration, st.integers(0, 2**32 - 1)),
    st.builds(entries.GcWrite, st.integers(0, 2**32 - 1),
              st.lists(st.binary(max_size=40), max_size=5).map(tuple),
              st.lists(st.tuples(st.binary(max_size=20), st.binary(max_size=20)),
                       max_size=3).map(tuple)),
    st.builds(entries.SetTopicSeed, st.lists(st.text(max_size=12), max_size=4).map(tuple)),
    st.just(entries.Noop()))


@given(changes)
def test_entries_round_trip(change: entries.Change) -> None:
    raw = entries.encode(change)
    assert entries.decode(raw) == change
    assert raw[0] == {bytes: entries.Kind.BATCH, entries.AddGeneration: entries.Kind.ADD_GENERATION,
                      entries.DropGeneration: entries.Kind.DROP_GENERATION,
                      entries.GcWrite: entries.Kind.GC_WRITE,
                      entries.SetTopicSeed: entries.Kind.SET_TOPIC_SEED,
                      entries.Noop: entries.Kind.NOOP}[type(change)]


def test_a_batch_entry_is_its_kind_then_the_cooked_bytes() -> None:
    assert entries.encode_batch(b"cooked") == bytes((entries.Kind.BATCH,)) + b"cooked"
    assert entries.decode(entries.encode_batch(b"")) == b""


@pytest.mark.parametrize("raw", [b"", b"\x09", b"\x00extra", b"\x03\x00\x01",
                                 b"\x02\x00\x00\x00\x00\x00\x00\x00\x01{",
                                 b"\x02\x00\x00\x00\x00\x00\x00\x00\x01[1]",
                                 # a GC write: a key longer than the entry, a delete
                                 # missing, a record without its value
                                 b"\x04\x00\x00\x00\x01\x00\x00\x00\x01\x00\x00\x00\x05ab",
                                 b"\x04\x00\x00\x00\x01\x00\x00\x00\x01",
                                 b"\x04\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x01k",
                                 b"\x05{}"])
def test_damaged_entries_are_refused(raw: bytes) -> None:
    with pytest.raises(CorruptDataError):
        entries.decode(raw)


def test_a_forwarded_write_round_trips() -> None:
    messages = [Message("a/b", b"one", client_id="c1", qos=1),
                Message("a/c", b"", client_id="c1", qos=2, retain=True)]
    puts = [(b"qos2/c1/7", b"x"), (b"k", b"")]
    deletes = [b"qos2/c1/6"]
    raw = encode_submit(messages, puts, deletes)
    got_messages, got_puts, got_deletes, fence = decode_submit(raw)
    assert [(m.topic, m.payload, m.client_id, m.qos, m.retain) for m in got_messages] == \
        [(m.topic, m.payload, m.client_id, m.qos, m.retain) for m in messages]
    assert (got_puts, got_deletes, fence) == (puts, deletes, [])
    for damaged in (raw[:-1], raw + b"\x00", b"\x01" + raw[1:]):
        with pytest.raises(CorruptDataError):
            decode_submit(damaged)


def test_a_forwarded_fenced_write_round_trips() -> None:
    puts = [(b"s/c1", b"{}")]
    fences = [Fence(b"s/c1", 7, claim=True, owner=b"site-a"), Fence(b"s/c2", 2**40)]
    for some in (fences[:1], fences):
        raw = encode_submit([], puts, [], some)
        assert decode_submit(raw) == ([], puts, [], some)
        with pytest.raises(CorruptDataError):
            decode_submit(raw[:-1])


def test_peers_of_a_push_are_site_ids_with_host_and_port() -> None:
    assert parse_peers({"s1": "127.0.0.1:18084", "s2": "[::1]:9"}) == \
        {"s1": "127.0.0.1:18084", "s2": "[::1]:9"}
    bad: object
    for bad in ([], {"s 1": "h:1"}, {"s1": "host"}, {"s1": 18084}, {"s1": "h:port"}):
        with pytest.raises(PlacementError):
            parse_peers(bad)


def test_the_advertised_peer_address_defaults_to_the_bind_address() -> None:
    def advertised(cluster: dict[str, str]) -> str:
        return load_config(env={f"STRATAMQ__CLUSTER__{key.upper()}": value
                                for key, value in cluster.items()}).cluster.advertised_peer()

    assert advertised({}) == "127.0.0.1:18084"
    assert advertised({"peer_bind": "10.0.0.5:7000"}) == "10.0.0.5:7000"
    assert advertised({"peer_bind": "0.0.0.0:7000", "advertise": "site-1.svc:7000"}) == \
        "site-1.svc:7000"
    assert load_config(env={}).cluster.enable is False
    assert load_config(env={}).cluster.write_timeout == 5.0
