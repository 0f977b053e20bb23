"""Timers (D29) on the real NATS server: how late they fire, and what 10,000 pending timers cost.

    python bench/bench_timers.py [--timers 1000] [--pending 10000]

Prints fire time - due time (p50, p99, max) for ``--timers`` timers due over the next 3 s, published
by the bus as the services do; then the NATS server's resident memory and the stream's bytes before
and after setting ``--pending`` timers due in an hour, and the memory of an execution state holding
as many (tracemalloc).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import tracemalloc
from pathlib import Path

from noetl_mesh.core.events import make_event, stable_id
from noetl_mesh.core.state import ExecutionState, apply
from noetl_mesh.infra.bus import EVENTS, Bus, loads
from noetl_mesh.infra.embedded import EmbeddedNats


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def timer(eid: str, i: int, due: float) -> dict:
    tid = stable_id("bench", eid, i)
    fired = make_event("timer.fired", eid, event_id=stable_id("fired", tid), source="timer",
                       data={"timer_id": tid, "kind": "wait"})
    return {"timer_id": tid, "execution_id": eid, "due": due, "event": fired}


async def main(n: int, pending: int) -> None:
    with EmbeddedNats() as server:
        bus = await Bus.connect(server.url, "bench")
        await bus.setup(partitions=4)
        arrived: list[tuple[float, bytes]] = []

        async def on_msg(msg) -> None:  # a push consumer: the arrival time of each message as it comes
            arrived.append((time.time(), msg.data))

        await bus.js.subscribe("noetl.pevt.>", stream=EVENTS, cb=on_msg, ordered_consumer=True)
        start = time.time() + 0.5
        dues = {}
        for i in range(n):
            t = timer(f"x{i % 50}", i, start + 3.0 * i / n)
            dues[t["event"]["event_id"]] = t["due"]
            await bus.send_timer(t)
        deadline = time.time() + 15
        while len(arrived) < n and time.time() < deadline:
            await asyncio.sleep(0.1)
        late = sorted((now - dues[e["event_id"]]) * 1000 for now, data in arrived for e in loads(data))
        print(f"{len(late)}/{n} timers fired; fire - due: p50 {statistics.median(late):.1f} ms, "
              f"p99 {late[int(len(late) * 0.99) - 1]:.1f} ms, max {late[-1]:.1f} ms "
              "(as a push consumer receives them)")

        before, info = rss_kib(server.pid), await bus.js.stream_info(EVENTS)
        t0 = time.perf_counter()
        futures = [await bus.send_timer(timer(f"p{i % 100}", i, time.time() + 3600)) for i in range(pending)]
        await asyncio.gather(*futures)
        took = time.perf_counter() - t0
        after, info2 = rss_kib(server.pid), await bus.js.stream_info(EVENTS)
        print(f"{pending:,} pending timers set in {took:.2f} s ({pending / took:,.0f}/s); nats-server RSS "
              f"{before / 1024:.1f} -> {after / 1024:.1f} MiB (+{(after - before) / pending:.2f} KiB each), "
              f"stream +{(info2.state.bytes - info.state.bytes) / pending:.0f} bytes each")
        await bus.close()

    tracemalloc.start()
    state = ExecutionState("x")
    base = tracemalloc.get_traced_memory()[0]
    for i in range(pending):
        apply(state, make_event("timer.scheduled", "x", event_id=f"s{i}", source="router",
                                data={"timer_id": f"t{i}", "kind": "token", "due": 0.0,
                                      "data": {"token_id": f"k{i}", "step": "s", "place": "p", "args": {}}}))
    used = tracemalloc.get_traced_memory()[0] - base
    print(f"an execution state with {pending:,} pending timers: {used / 1024 / 1024:.1f} MiB "
          f"({used / pending:.0f} bytes each, the folded event ids included)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timers", type=int, default=1000)
    ap.add_argument("--pending", type=int, default=10_000)
    a = ap.parse_args()
    asyncio.run(main(a.timers, a.pending))
