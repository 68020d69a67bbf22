"""A message's writes (the message, its retained copy) answer its client as one:
done once every write is, failed with the first failure."""

from __future__ import annotations

import asyncio

import pytest

from stratamq.broker.core.publish import all_stored
from stratamq.broker.errors import StorageTimeoutError
from tests.support.storage import run


def test_a_failed_retained_write_waits_for_the_message_write_still_under_way() -> None:
    """The retained copy's write fails while the message's is still under way: the
    outcome is known only once both are. With asyncio.gather the QoS 2 packet id was
    marked unknown at once, the client disconnected, and its resend, not finding the
    message stored yet, stored it a second time (found by reading)."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        message, retained = loop.create_future(), loop.create_future()
        both = all_stored([message, retained])
        retained.set_exception(StorageTimeoutError("the retained shard out of reach"))
        await asyncio.sleep(0)
        assert not both.done()
        message.set_result(None)
        with pytest.raises(StorageTimeoutError):
            await asyncio.wait_for(both, 5)

        alone = loop.create_future()
        assert all_stored([alone]) is alone
        first, second = loop.create_future(), loop.create_future()
        stored = all_stored([first, second])
        first.set_result(None)
        second.set_result(None)
        await asyncio.wait_for(stored, 5)
        assert stored.exception() is None

    run(main())
