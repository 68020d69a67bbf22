"""A process that writes batches until it is killed; used by the crash-safety test.

Prints `acked <writer> <batch>` once the store_batch of that batch has returned, and
`kv-acked <writer> <n>` once a key-value write returned, so the test knows exactly
what the storage promised."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

from stratamq.broker.ds import DbOptions, DurableStorage, Message

OPTIONS = DbOptions(n_shards=4, flush_interval=0.002, wildcard_thresholds=(5, 3))
# The writer's layout for new generations, by name (epochs of 2**14 µs, ~16 ms).
LAYOUTS = {"wildcard_optimized_v2": OPTIONS,
           "wildcard_optimized": replace(OPTIONS, layout="wildcard_optimized",
                                         layout_options={"epoch_bits": 14})}


def batch_messages(run_id: int, writer: int, batch: int) -> list[Message]:
    return [Message(f"crash/w{writer}/t{(batch * 7 + i) % 11}",
                    f"{run_id}:{writer}:{batch}:{i}".encode(), client_id=f"w{writer}", qos=1)
            for i in range(5)]


KV_SHARDS = 3


def kv_entry(run_id: int, writer: int, number: int) -> tuple[str, bytes, bytes]:
    """(routing key, key, value) of a key-value write; each writer overwrites its key
    and adds a new one, so both overwrites and new keys must survive."""
    return (f"k{writer}", b"last/%d/%d" % (run_id, writer),
            b"%d:%d:%d" % (run_id, writer, number))


async def main(data_dir: str, run_id: int, layout: str) -> None:
    storage = DurableStorage(data_dir)
    await storage.open_db("messages", LAYOUTS[layout])
    kv = await storage.open_kv_db("sessions", KV_SHARDS)
    print("ready", flush=True)

    async def kv_writer(number: int) -> None:
        count = 0
        while True:
            routing, key, value = kv_entry(run_id, number, count)
            await kv.write(routing, puts=[(key, value), (b"each/" + value, b"")])
            print(f"kv-acked {number} {count}", flush=True)
            count += 1

    async def writer(number: int) -> None:
        batch = 0
        while True:
            await storage.store_batch("messages", batch_messages(run_id, number, batch))
            print(f"acked {number} {batch}", flush=True)
            batch += 1
            if number == 0 and batch % 10 == 0:
                await storage.add_generation("messages")

    await asyncio.gather(*(writer(n) for n in range(8)), *(kv_writer(n) for n in range(4)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
