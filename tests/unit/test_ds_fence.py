"""Fenced record writes (`ds.fence`): which writes of a batch hold against the stored
owner epochs and each other, and what epoch records the batch carries."""

from __future__ import annotations

import pytest

from stratamq.broker.ds.fence import (
    Fence,
    FencedError,
    check_fences,
    fence_key,
    stored_epoch,
    stored_owner,
)


def stored(epoch: int, owner: bytes = b"") -> bytes:
    return epoch.to_bytes(8, "big") + owner


def test_a_claim_moves_the_epoch_on_and_names_its_owner() -> None:
    puts = check_fences([Fence(b"s/c", 3, claim=True, owner=b"B")],
                        {fence_key(b"s/c"): stored(2, b"A")}.get)
    assert puts == [(fence_key(b"s/c"), stored(3, b"B"))]
    assert (stored_epoch(puts[0][1]), stored_owner(puts[0][1])) == (3, b"B")


def test_of_two_claims_of_one_epoch_the_second_is_refused() -> None:
    with pytest.raises(FencedError) as refused:
        check_fences([Fence(b"s/c", 3, claim=True, owner=b"B")],
                     {fence_key(b"s/c"): stored(3, b"C")}.get)
    assert refused.value.keys == {b"s/c"}


def test_a_write_of_the_old_owner_is_refused_and_the_owners_holds() -> None:
    records = {fence_key(b"s/c"): stored(3, b"B")}.get
    with pytest.raises(FencedError):
        check_fences([Fence(b"s/c", 2)], records)
    # the owner's own write keeps the owner the claim named
    assert check_fences([Fence(b"s/c", 3)], records) == [(fence_key(b"s/c"), stored(3, b"B"))]


def test_writes_of_a_batch_are_checked_in_order_and_refusals_name_their_keys() -> None:
    records = {fence_key(b"s/a"): stored(1, b"A")}.get
    # a claim then the old owner's write: the write comes after the claim, refused
    with pytest.raises(FencedError) as refused:
        check_fences([Fence(b"s/a", 2, claim=True, owner=b"B"), Fence(b"s/a", 1),
                      Fence(b"s/b", 5)], records)
    assert refused.value.keys == {b"s/a"}
    # the old owner's write then the claim: both hold
    assert check_fences([Fence(b"s/a", 1), Fence(b"s/a", 2, claim=True, owner=b"B")],
                        records) == [(fence_key(b"s/a"), stored(2, b"B"))]


def test_nothing_stored_is_epoch_zero_of_nobody() -> None:
    assert (stored_epoch(None), stored_owner(None)) == (0, b"")
    nothing: dict[bytes, bytes] = {}
    assert check_fences([Fence(b"s/n", 0)], nothing.get) == [(fence_key(b"s/n"), stored(0))]
