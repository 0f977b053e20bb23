"""Reading a large value back from the payload store (D23): message by message, as the engine does
(``PayloadStore.get``: the object's metadata, then each chunk by subject), against nats-py's ordered
consumer, which no service's NATS user may create any more (docs/nats-security.md). Alternating, on
an embedded NATS, the cache emptied before each read.

    python bench/bench_payloads.py [--rounds 30] [--sizes 64K,1M,8M]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import time

from noetl_mesh.infra.bus import Bus
from noetl_mesh.infra.embedded import provision_nats
from noetl_mesh.infra.wire import loads


def size_of(text: str) -> int:
    units = {"K": 1024, "M": 1024 * 1024}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


async def main(rounds: int, sizes: list[int]) -> None:
    server = provision_nats(store_dir=None, auth=None)
    bus = await Bus.connect(server.url, "bench-payloads")
    try:
        await bus.setup(1)
        store = bus.payloads
        bucket = await store.bucket()
        print(f"{'value':>8}  {'message by message p50':>24}  {'ordered consumer p50':>22}")
        for size in sizes:
            ref = await store.put({"x": "a" * size})
            times: dict[str, list[float]] = {"messages": [], "consumer": []}
            for _ in range(rounds):
                for way in ("messages", "consumer"):
                    store._cache.clear()
                    t0 = time.perf_counter()
                    if way == "messages":
                        await store.get(ref)
                    else:  # the same checks as PayloadStore.get: its digest, then the JSON
                        data = (await bucket.get(ref["key"])).data
                        assert hashlib.sha256(data).hexdigest() == ref["key"]
                        loads(data)
                    times[way].append((time.perf_counter() - t0) * 1000)
            print(f"{size // 1024:>7}K  {statistics.median(times['messages']):>21.2f} ms  "
                  f"{statistics.median(times['consumer']):>19.2f} ms")
    finally:
        await bus.close()
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="64K,1M,8M")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, [size_of(s) for s in args.sizes.split(",")]))
