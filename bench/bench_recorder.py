"""The event-recorder alone: how fast it drains the events stream into Postgres, what one event row
costs in Python, how fast it answers an events page and an execution's status. Embedded NATS and Postgres; prints figures,
asserts nothing.

    python bench/bench_recorder.py            # 50,000 events per drain, 3 runs each
    python bench/bench_recorder.py --quick    # 10,000 events, 1 run
    python bench/bench_recorder.py status     # only the status requests (or: drain, page, batches)
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import psycopg

from bench_engine import _children, _cpu, chain
from noetl_mesh.core.events import make_event, new_execution_id
from noetl_mesh.core.local import run_local
from noetl_mesh.infra.bus import EVENTS, Bus
from noetl_mesh.infra.embedded import EmbeddedNats, provision_postgres
from noetl_mesh.services.event_recorder import schema
from noetl_mesh.services.event_recorder.service import RecorderService


def events(n: int, run: int) -> list[dict]:
    """Worker-like events: a task's outcome with a small result, spread over n / 100 executions."""
    xids = [new_execution_id() for _ in range(max(1, n // 100))]
    return [make_event("task.processed", xids[i % len(xids)], event_id=f"bench-{run}-{i}", source="bench",
                       step="fetch", task="call", step_run_id=f"r{i}", task_run_id=f"t{i}", attempt=1,
                       data={"outcome": {"status": "ok", "result": {"i": i, "name": "item", "tags": ["a", "b"]}}})
            for i in range(n)]


async def drain(nats_url: str, pg_dsn: str, n: int, per_message: int, run: int) -> float:
    """Events already in the stream, drained by a fresh recorder: events/s."""
    bus = await Bus.connect(nats_url, "bench")
    try:
        await bus.js.delete_stream(EVENTS)
    except Exception:  # noqa: BLE001 - first run
        pass
    await bus.setup(partitions=4)
    evs = events(n, run)
    for start in range(0, n, 1000 * per_message):
        chunk = evs[start:start + 1000 * per_message]
        futures = [await bus.send_events(chunk[i:i + per_message]) for i in range(0, len(chunk), per_message)]
        await asyncio.gather(*futures)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE event, execution")
    recorder = RecorderService(bus, pg_dsn=pg_dsn)
    t0 = time.perf_counter()
    await recorder.start()
    while recorder.recorded < n:
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - t0
    await recorder.stop()
    await bus.close()
    return n / elapsed


def row_cost(n: int = 20_000) -> float:
    """Python cost of one staging row (schema.event_row), µs."""
    evs = events(n, 0)
    t0 = time.perf_counter()
    for i, e in enumerate(evs):
        schema.event_row(i, e)
    return (time.perf_counter() - t0) / n * 1e6


async def page_rate(nats_url: str, pg_dsn: str, seconds: float = 3.0) -> tuple[float, float]:
    """Events pages of 100 events (and of 1000) answered per second, one request at a time."""
    bus = await Bus.connect(nats_url, "bench-pages")
    recorder = RecorderService(bus, pg_dsn=pg_dsn)
    await recorder.start()
    xid = new_execution_id()
    await recorder.store([(i, e) for i, e in enumerate(
        make_event("task.processed", xid, event_id=f"page-{i}", source="bench", step="s", task="t",
                   data={"outcome": {"status": "ok", "result": {"i": i, "text": "x" * 200}}}) for i in range(1000))])
    rates = []
    for limit in (100, 1000):
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            page = await bus.request("noetl.q.execution.events", {"execution_id": xid, "limit": limit})
            assert len(page["events"]) == limit
            done += 1
        rates.append(done / (time.perf_counter() - t0))
    await recorder.stop()
    await bus.close()
    return rates[0], rates[1]


async def status_rate(nats_url: str, pg_dsn: str, seconds: float = 3.0) -> list[tuple[str, float, float]]:
    """An execution's status (a 5-step chain's log), full and brief, one request at a time: requests per
    second, and this process's CPU per request (the recorder and its requester share it)."""
    bus = await Bus.connect(nats_url, "bench-status")
    recorder = RecorderService(bus, pg_dsn=pg_dsn)
    await recorder.start()
    run = await run_local(chain(5))
    await recorder.store(list(enumerate(run.log, start=1)))
    out = []
    for label, req in (("full", {"execution_id": run.execution_id}),
                       ("brief", {"execution_id": run.execution_id, "brief": True})):
        done, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            status = await bus.request("noetl.q.execution.get", req)
            assert status["status"] == "COMPLETED"
            done += 1
        out.append((label, done / (time.perf_counter() - t0), (time.process_time() - c0) / done * 1e6))
    await recorder.stop()
    await bus.close()
    return out


def _postgres_cpu(pg) -> float:
    """CPU seconds so far of Postgres: the postmaster and its backends (bench_engine.py's measure)."""
    return _cpu(pg.pid) + sum(_cpu(c) for c in _children(pg.pid))


async def batch_cost(nats_url: str, pg_dsn: str, pg, batches: int, per_batch: int = 2) -> tuple[int, float, float]:
    """What the recorder's write of one batch shaped like the burst's costs: whole 5-step executions
    (their events from the engine, the projection's updates included), ``per_batch`` of them per
    transaction. Returns events per batch, and the CPU ms per batch of this process (the recorder's
    Python) and of Postgres."""
    bus = await Bus.connect(nats_url, "bench-batches")
    recorder = RecorderService(bus, pg_dsn=pg_dsn)
    await recorder.start()
    logs = [(await run_local(chain(5))).log for _ in range(batches * per_batch)]
    seq, cpu, pg_cpu = 1, 0.0, _postgres_cpu(pg)
    for b in range(batches):
        records = []
        for log in logs[b * per_batch:(b + 1) * per_batch]:
            records += [(seq + i, e) for i, e in enumerate(log)]
            seq += len(log)
        c0 = time.process_time()
        await recorder.store(records)
        cpu += time.process_time() - c0
    pg_cpu = _postgres_cpu(pg) - pg_cpu
    await recorder.stop()
    await bus.close()
    return len(records), cpu / batches * 1000, pg_cpu / batches * 1000


async def main(args: argparse.Namespace) -> None:
    n, runs = (10_000, 1) if args.quick else (args.events, args.runs)
    which = set(args.which or ("drain", "page", "status", "batches"))
    if "drain" in which:
        print(f"event_row: {row_cost():.2f} µs per event", flush=True)
    nats = EmbeddedNats().start()
    pg = provision_postgres(fast=True)
    dsn = pg.create_database("bench_recorder")
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await schema.migrate(conn)
    try:
        if "drain" not in which:  # which makes the stream
            bus = await Bus.connect(nats.url, "bench")
            await bus.setup(partitions=4)
            await bus.close()
        for per_message in (1, 10) if "drain" in which else ():
            rates = [await drain(nats.url, dsn, n, per_message, run) for run in range(runs)]
            print(f"drain {n} events, {per_message} per message: "
                  f"{' / '.join(f'{r:,.0f}' for r in rates)} events/s (median {statistics.median(rates):,.0f})",
                  flush=True)
        if "page" in which:
            p100, p1000 = await page_rate(nats.url, dsn, seconds=1.0 if args.quick else 3.0)
            print(f"events page: {p100:,.0f} pages/s of 100 events, {p1000:,.0f} pages/s of 1000 events")
        for label, rate, cpu in await status_rate(nats.url, dsn, seconds=1.0 if args.quick else 3.0) \
                if "status" in which else ():
            print(f"status ({label}) of a 5-step execution: {rate:,.0f} requests/s, {cpu:.0f} µs of CPU per request"
                  " (recorder and requester)", flush=True)
        if "batches" in which:
            size, cpu, pg_cpu = await batch_cost(nats.url, dsn, pg, 100 if args.quick else 1000)
            print(f"batches of {size} events (two 5-step executions each): {cpu:.2f} ms of the recorder's CPU per"
                  f" batch, {pg_cpu:.2f} ms of Postgres", flush=True)
    finally:
        pg.drop_database("bench_recorder")
        pg.stop()
        nats.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", choices=["drain", "page", "status", "batches", []], default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
