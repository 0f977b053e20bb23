"""How long a decision's command takes to reach a waiting worker, four ways, on the real NATS server.

    python bench/bench_command_hop.py [--rounds 400]

Admission stores a decision's events before it sends the command (infra/bus.py ``Bus.publish_all``), so
that a worker's report is never in the log before the decision. This measures what that order costs and
what the server's own ways of keeping it would cost instead. Each round: one events message and one
command (600 bytes each), a pull request already open for the command; the time from the first publish
to the command's delivery.

- ``acked``: as the engine does: the events, their PubAck, then the command to the commands stream.
- ``atomic``: both as one atomic batch (``allow_atomic``) into the events stream, the worker's consumer
  on the events stream: stored together, in order, or not at all.
- ``sourced``: both into the events stream without waiting; the commands stream sources the command
  from it (the server copies it only once stored, after the events).
- ``unordered``: both without waiting, nothing kept in order: the floor.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import nats

from noetl_mesh.infra.bus import dumps, loads
from noetl_mesh.infra.embedded import EmbeddedNats

MODES = ("acked", "atomic", "sourced", "unordered")
PAYLOAD = b"x" * 600


async def main(rounds: int) -> None:
    with EmbeddedNats() as server:
        nc, wc = await nats.connect(server.url), await nats.connect(server.url)

        async def api(subject: str, body: dict) -> None:
            reply = loads((await nc.request(subject, dumps(body), timeout=5)).data)
            assert "error" not in reply, reply

        await api("$JS.API.STREAM.CREATE.EV", {"name": "EV", "subjects": ["ev.>", "src.>", "atomic.>", "floor.>"],
                                               "storage": "file", "allow_atomic": True})
        await api("$JS.API.STREAM.CREATE.CMD", {"name": "CMD", "subjects": ["cmd.>"], "storage": "file",
                                                "retention": "workqueue"})
        await api("$JS.API.STREAM.CREATE.SRC", {"name": "SRC", "storage": "file", "retention": "workqueue", "sources": [
            {"name": "EV", "subject_transforms": [{"src": "src.>", "dest": "sourced.>"}]}]})
        js, wjs = nc.jetstream(), wc.jetstream()
        readers = {"acked": await wjs.pull_subscribe("cmd.p", durable="acked", stream="CMD"),
                   "atomic": await wjs.pull_subscribe("atomic.cmd", durable="atomic", stream="EV"),
                   "sourced": await wjs.pull_subscribe("sourced.cmd", durable="sourced", stream="SRC"),
                   "unordered": await wjs.pull_subscribe("floor.cmd", durable="floor", stream="EV")}
        commits: asyncio.Queue = asyncio.Queue()

        async def committed(msg) -> None:
            commits.put_nowait(msg)

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=committed)
        took: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(rounds):
            for mode in MODES if i % 2 else reversed(MODES):  # alternating, so no mode always goes first
                fetch = asyncio.ensure_future(readers[mode].fetch(1, timeout=5))
                await asyncio.sleep(0.002)  # the pull request is open at the server
                t0 = time.perf_counter()
                if mode == "acked":
                    await js.publish("ev.x", PAYLOAD)
                    await nc.publish("cmd.p", PAYLOAD)
                elif mode == "atomic":
                    batch = uuid.uuid4().hex[:20]
                    await nc.publish("atomic.ev", PAYLOAD, headers={"Nats-Batch-Id": batch, "Nats-Batch-Sequence": "1"})
                    await nc.publish("atomic.cmd", PAYLOAD, reply=inbox, headers={
                        "Nats-Batch-Id": batch, "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1"})
                elif mode == "sourced":
                    await nc.publish("src.ev", PAYLOAD)
                    await nc.publish("src.cmd", PAYLOAD)
                else:
                    await nc.publish("floor.ev", PAYLOAD)
                    await nc.publish("floor.cmd", PAYLOAD)
                (msg,) = await fetch
                took[mode].append((time.perf_counter() - t0) * 1000)
                await msg.ack()
                if mode == "atomic":
                    reply = loads((await asyncio.wait_for(commits.get(), 5)).data)
                    assert reply.get("count") == 2, reply
        await nc.close()
        await wc.close()
    print(f"{rounds} rounds each, ms from the first publish to the command's delivery")
    for mode in MODES:
        xs = sorted(took[mode])
        print(f"  {mode:<10} p50 {statistics.median(xs):.3f}  p90 {xs[int(0.9 * len(xs))]:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=400)
    asyncio.run(main(parser.parse_args().rounds))
