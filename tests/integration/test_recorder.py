"""The event-recorder against real NATS and Postgres: recording, idempotency, the projection, the
rebuilt execution state, the catalog, restarts, a database outage, and the insert rate."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import Any
from unittest.mock import patch

import nats
import psycopg
import pytest
import yaml
from nats.js.api import AckPolicy
from nats.js.errors import NotFoundError

from noetl_mesh.core.events import make_event, new_execution_id, stable_id, writers_of
from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.infra.bus import EVENTS, Bus, BusError, batch_subject, dumps, log_seq, partition_from_subject
from noetl_mesh.infra import pinned
from noetl_mesh.infra.pinned import GROUP
from noetl_mesh.services.event_recorder import feeds
from noetl_mesh.services.event_recorder.service import RecorderService
from scenarios import TINY

pytestmark = pytest.mark.integration

PLAYBOOK = yaml.safe_load(TINY)



async def fresh_bus(nats_url: str) -> Bus:
    """A bus on an empty events stream (the NATS server is shared by the whole test session)."""
    bus = await Bus.connect(nats_url, "test")
    with contextlib.suppress(NotFoundError):
        await bus.js.delete_stream(EVENTS)
    await bus.setup(partitions=4)
    return bus


@contextlib.asynccontextmanager
async def recording(nats_url: str, pg_dsn: str):
    """A fresh bus and a started recorder on it: ``(bus, recorder)``, stopped and closed after."""
    bus = await fresh_bus(nats_url)
    rec = RecorderService(bus, pg_dsn=pg_dsn)
    await rec.start()
    try:
        yield bus, rec
    finally:
        await rec.stop()
        await bus.close()


async def eventually(check, timeout: float = 10.0, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s (last: {result!r})")
        await asyncio.sleep(every)


def count(dsn: str, sql: str = "SELECT count(*) FROM event", *params: Any) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchone()[0]


async def recorded(dsn: str, n: int) -> bool:
    return count(dsn) >= n


def small_events(n: int, executions: int = 50) -> list[dict[str, Any]]:
    xids = [new_execution_id() for _ in range(executions)]
    return [make_event("step.done", xids[i % executions], event_id=stable_id("ev", xids[0], i), source="worker:test",
                       step="s", step_run_id="r", data={"result": i}) for i in range(n)]


async def publish_all(bus: Bus, events: list[dict[str, Any]], chunk: int = 500) -> None:
    for i in range(0, len(events), chunk):
        await asyncio.gather(*(bus.publish_event(e) for e in events[i:i + chunk]))


def same_envelope(stored: dict[str, Any], original: dict[str, Any]) -> None:
    assert set(stored) == set(original) | {"seq"}
    assert stored["timestamp"] == pytest.approx(original["timestamp"], abs=1e-6)
    assert {k: v for k, v in stored.items() if k not in ("seq", "timestamp")} == \
           {k: v for k, v in original.items() if k != "timestamp"}


async def a_dead_reader_held_100(bus: Bus, nats_url: str, execution_id: str) -> str:
    """A recorder that fetched the first 100 messages of ``execution_id``'s partition, never acked them,
    gave up its pin and died; the partition's durable."""
    name = feeds.durable(await _partition_of(bus, execution_id))
    dead = await nats.connect(nats_url)
    inbox = dead.new_inbox()
    sub = await dead.subscribe(inbox)
    await dead.publish(f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS}.{name}",
                       json.dumps({"batch": 100, "expires": 10**9, "group": GROUP}).encode(), reply=inbox)
    held = [await sub.next_msg(timeout=5) for _ in range(100)]
    assert [m.metadata.sequence.stream for m in held] == list(range(1, 101))
    await dead.request(f"$JS.API.CONSUMER.UNPIN.{EVENTS}.{name}", json.dumps({"group": GROUP}).encode())
    await dead.close()
    return name


# ------------------------------------------------------------------------------------------ tests
def test_events_are_recorded_once_in_log_order_and_fold_to_the_state(nats_url: str, pg_dsn: str) -> None:
    run = asyncio.run(run_local(PLAYBOOK))
    expected = summary(run.state)
    assert expected["status"] == "COMPLETED"

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn, batch=7)  # small batches: many of them
        await rec.start()
        try:
            seqs = [await bus.publish_event(e) for e in run.log]
            await bus.publish_event(run.log[3])  # same id within the duplicate window: one stream entry
            # the same event stored twice in the stream (a republish after the window): recorded once
            extra = await bus.js.publish(batch_subject([run.log[4]]), dumps([run.log[4]]), stream=EVENTS)
            assert log_seq(extra.seq, 0) > seqs[-1]
            await eventually(lambda: recorded(pg_dsn, len(run.log)))
            await asyncio.sleep(0.2)  # let the republished copy arrive, if it were to be stored
            assert count(pg_dsn) == len(run.log)

            page = await bus.request("noetl.q.execution.events", {"execution_id": run.execution_id, "limit": 1000})
            assert page["total"] == len(run.log) and [e["seq"] for e in page["events"]] == seqs
            for stored, original in zip(page["events"], run.log):
                same_envelope(stored, original)

            state = await bus.request("noetl.q.execution.get", {"execution_id": run.execution_id})
            assert {k: state[k] for k in expected} == expected
            assert state["event_count"] == len(run.log) and state["error"] is None
            assert state["path"] == "tests/tiny" and state["finished_at"] and state["created_at"]
            brief = await bus.request("noetl.q.execution.get", {"execution_id": run.execution_id, "brief": True})
            assert {k: brief[k] for k in expected if k in brief} == {k: state[k] for k in expected if k in brief}
            assert brief["status"] == "COMPLETED" and brief["path"] == "tests/tiny" and brief["finished_at"]
            assert brief["event_count"] == len(run.log) and "steps" not in brief
            with psycopg.connect(pg_dsn, autocommit=True) as conn:  # recorded before the counter existed: counted
                conn.execute("UPDATE execution SET event_count = NULL WHERE execution_id = %s", (run.execution_id,))
                again = await bus.request("noetl.q.execution.get", {"execution_id": run.execution_id, "brief": True})
                again_full = await bus.request("noetl.q.execution.get", {"execution_id": run.execution_id})
                conn.execute("UPDATE execution SET event_count = %s WHERE execution_id = %s",
                             (len(run.log), run.execution_id))
                # an execution whose projection row is missing: its status is still the fold of its events
                row = conn.execute("DELETE FROM execution WHERE execution_id = %s RETURNING *", (run.execution_id,))
                saved, columns = row.fetchone(), [c.name for c in row.description]
                bare = await bus.request("noetl.q.execution.get", {"execution_id": run.execution_id})
                conn.execute(f"INSERT INTO execution ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})",
                             saved)
            assert again == brief and again_full == state
            assert {k: bare[k] for k in expected} == expected and bare["event_count"] == len(run.log)
            assert bare["path"] is None and bare["created_at"] is None
            with pytest.raises(BusError) as unknown:
                await bus.request("noetl.q.execution.get", {"execution_id": "nope", "brief": True})
            assert unknown.value.kind == "not_found"

            # paging
            xid = run.execution_id
            first = await bus.request("noetl.q.execution.events", {"execution_id": xid, "offset": 0, "limit": 5})
            rest = await bus.request("noetl.q.execution.events", {"execution_id": xid, "offset": 5, "limit": 1000})
            assert (first["total"], first["offset"], first["limit"], len(first["events"])) == (len(run.log), 0, 5, 5)
            assert [e["event_id"] for e in first["events"] + rest["events"]] == [e["event_id"] for e in run.log]
            capped = await bus.request("noetl.q.execution.events", {"execution_id": run.execution_id, "limit": 5000})
            assert capped["limit"] == 1000

            with pytest.raises(BusError) as missing:
                await bus.request("noetl.q.execution.get", {"execution_id": "nope"})
            assert missing.value.kind == "not_found"
            with pytest.raises(BusError) as missing:
                await bus.request("noetl.q.execution.events", {"execution_id": "nope"})
            assert missing.value.kind == "not_found"
            ping = await bus.request("noetl.q.recorder.ping", {})
            assert ping["ok"] is True and ping["lag"] == 0
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT status, path FROM execution WHERE execution_id = %s",
                            (run.execution_id,)).fetchone() == ("COMPLETED", "tests/tiny")


def test_recording_the_same_batch_twice_stores_it_once(nats_url: str, pg_dsn: str) -> None:
    """A redelivery (the recorder died after its commit, before its ack) changes nothing."""
    run = asyncio.run(run_local(PLAYBOOK))
    records = list(enumerate(run.log, start=1))

    async def main() -> None:
        async with recording(nats_url, pg_dsn) as (bus, rec):
            await rec.store(records)
            before = await bus.request("noetl.q.execution.get", {"execution_id": run.execution_id})
            await rec.store(records)
            await rec.store(records[2:5])
            after = await bus.request("noetl.q.execution.get", {"execution_id": run.execution_id})
            assert count(pg_dsn) == len(run.log)
            assert before == after and after["status"] == "COMPLETED"

    asyncio.run(main())


def test_the_counters_add_what_each_batch_inserted(nats_url: str, pg_dsn: str) -> None:
    """One statement inserts a batch's events and adds them to the counters: each execution's events, each
    loop run's iterations started, done and failed, and the first and last end; a duplicate adds nothing."""
    x, y, t0 = new_execution_id(), new_execution_id(), 1_700_000_000.0

    def ev(xid: str, name: str, dt: float, iteration: int | None = None, run: str | None = "r"):
        return make_event(name, xid, event_id=f"{xid}-{name}-{iteration}-{dt}", source=writers_of(name)[0],
                          timestamp=t0 + dt, step="s", step_run_id=run, iteration=iteration)

    first = [ev(x, "workflow.started", 0, run=None), ev(y, "workflow.started", 0, run=None),
             *(ev(x, "loop.iteration.started", 1, i) for i in range(4)),
             ev(x, "loop.iteration.done", 3, 0), ev(x, "loop.iteration.failed", 2, 1), ev(x, "loop.iteration.done", 5, 2),
             ev(x, "loop.iteration.done", 4, 3, run=None)]  # no run: an event, not an iteration of a run
    second = [first[7], first[8], ev(x, "loop.iteration.done", 9, 3), ev(y, "step.done", 1, run="q")]

    def counters() -> tuple:
        with psycopg.connect(pg_dsn) as conn:
            counts = dict(conn.execute("SELECT execution_id, event_count FROM execution").fetchall())
            loops = conn.execute("SELECT execution_id, step_run_id, started, done, failed, extract(epoch FROM first_at)"
                                 "::float8 - %s, extract(epoch FROM last_at)::float8 - %s FROM loop_progress",
                                 (t0, t0)).fetchall()
        return counts, loops

    async def main() -> None:
        async with recording(nats_url, pg_dsn) as (bus, rec):
            await rec.store(list(enumerate(first, start=1)))
            assert counters() == ({x: 9, y: 1}, [(x, "r", 4, 2, 1, 2.0, 5.0)])
            await rec.store(list(enumerate(second, start=20)))  # two of them again
            assert counters() == ({x: 10, y: 2}, [(x, "r", 4, 3, 1, 2.0, 9.0)])

    asyncio.run(main())


def test_projection_follows_the_request_lifecycle(nats_url: str, pg_dsn: str) -> None:
    ok, rejected, running, child = (new_execution_id() for _ in range(4))
    t0 = time.time()

    def ev(name: str, xid: str, dt: float, data: dict[str, Any] | None = None, status: str = "success"):
        return make_event(name, xid, event_id=stable_id(name, xid), source=writers_of(name)[0], status=status,
                          data=data, timestamp=t0 + dt)

    requested = "playbook.execution.requested"
    events = [
        ev(requested, ok, 0, {"catalog": {"path": "cat/ok", "version": 3}, "playbook": None}, "in_progress"),
        ev(requested, rejected, 1, {"catalog": None, "playbook": {"metadata": {"name": "bad", "path": "inline/bad"}}},
           "in_progress"),
        ev("playbook.request.evaluated", rejected, 1.1, {"errors": ["broken"]}, "error"),
        ev("workflow.finished", rejected, 1.2,
           {"status": "FAILED", "error": {"kind": "invalid_playbook", "message": "broken"}}, "error"),
        ev(requested, running, 2, {"playbook": None, "catalog": None, "parent_execution_id": ok}, "in_progress"),
        ev("playbook.request.evaluated", running, 2.1, {"path": "from/evaluated", "version": None, "playbook": {}}),
        ev("workflow.started", running, 2.2),
        ev("workflow.started", ok, 3),
        ev("workflow.finished", ok, 4, {"status": "COMPLETED", "error": None}),
        # out of order (e.g. a redelivery): a late start does not reopen a finished execution
        ev("workflow.finished", child, 5, {"status": "CANCELLED", "error": {"kind": "cancelled"}}, "error"),
        ev("workflow.started", child, 4.5),
    ]

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn, batch=3)
        await rec.start()
        try:
            await publish_all(bus, events, chunk=1)
            await eventually(lambda: recorded(pg_dsn, len(events)))
            rows = {r["execution_id"]: r for r in await bus.request("noetl.q.execution.list", {})}
            assert rows[ok]["status"] == "COMPLETED" and (rows[ok]["path"], rows[ok]["version"]) == ("cat/ok", 3)
            assert rows[ok]["started_at"] and rows[ok]["finished_at"] and rows[ok]["error"] is None
            assert rows[rejected]["status"] == "FAILED" and rows[rejected]["path"] == "inline/bad"
            assert rows[rejected]["error"] == {"kind": "invalid_playbook", "message": "broken"}
            assert rows[running]["status"] == "RUNNING" and rows[running]["path"] == "from/evaluated"
            assert rows[running]["parent_execution_id"] == ok and rows[running]["finished_at"] is None
            assert rows[child]["status"] == "CANCELLED"
            newest_first = await bus.request("noetl.q.execution.list", {"limit": 2})
            assert [r["execution_id"] for r in newest_first] == [child, running]
            failed = await bus.request("noetl.q.execution.list", {"status": "FAILED"})
            assert [r["execution_id"] for r in failed] == [rejected]
            state = await bus.request("noetl.q.execution.get", {"execution_id": rejected})
            assert state["status"] == "FAILED" and state["error"]["kind"] == "invalid_playbook"
            with pytest.raises(BusError) as bad:
                await bus.request("noetl.q.execution.list", {"status": "SLEEPING"})
            assert bad.value.kind == "bad_request"
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())


VALID = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: greeter, path: demo/greeter}
workflow:
  - step: start
    tool: {kind: noop, result: hi}
"""
INVALID = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: broken}
workflow:
  - step: start
    tool: {kind: nosuchtool}
    next: {arcs: [{step: nowhere}]}
  - step: start
    case: []
"""


def test_the_ends_of_runs_and_iterations_end_their_waits(nats_url: str, pg_dsn: str) -> None:
    """A batch's run and iteration ends close the waits they match, each at the first end that matches
    it (one statement for the whole batch); the others stay open."""
    xid, t0 = new_execution_id(), 1_700_000_000.0

    def ev(name: str, dt: float, run: str, iteration: int | None = None, wait: str | None = None):
        return make_event(name, xid, event_id=f"{name}-{run}-{iteration}-{dt}", source=writers_of(name)[0],
                          timestamp=t0 + dt, step="s", step_run_id=run, iteration=iteration,
                          data={"wait_id": wait, "kind": "signal", "spec": {"signal": "go"}} if wait else None)

    started = [ev("wait.started", 0, "r1", 1, "w1"), ev("wait.started", 0, "r1", 2, "w2"),
               ev("wait.started", 0, "r2", None, "w3"), ev("wait.started", 0, "r1", 3, "w4")]
    ends = [ev("loop.iteration.done", 2, "r1", 1), ev("step.done", 3, "r2"), ev("loop.iteration.failed", 1, "r1", 1),
            ev("loop.iteration.done", 4, "r9", 2)]  # another run's iteration 2: not w2's
    last = [ev("step.done", 5, "r1")]

    def ended() -> dict[str, float | None]:
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute("SELECT wait_id, extract(epoch FROM ended_at)::float8 - %s FROM wait ORDER BY 1",
                                (t0,)).fetchall()
        return {w: (round(t, 3) if t is not None else None) for w, t in rows}

    async def main() -> None:
        async with recording(nats_url, pg_dsn) as (bus, rec):
            await rec.store(list(enumerate(started, start=1)))
            await rec.store(list(enumerate(ends, start=10)))
            assert ended() == {"w1": 1.0, "w2": None, "w3": 3.0, "w4": None}
            await rec.store(list(enumerate(last, start=20)))
            assert ended() == {"w1": 1.0, "w2": 5.0, "w3": 3.0, "w4": 5.0}

    asyncio.run(main())


def test_catalog_register_get_list(nats_url: str, pg_dsn: str) -> None:
    async def main() -> None:
        async with recording(nats_url, pg_dsn) as (bus, rec):
            one = await bus.request("noetl.q.catalog.register", {"content": VALID})
            two = await bus.request("noetl.q.catalog.register", {"content": VALID.replace("hi", "hello")})
            other = await bus.request("noetl.q.catalog.register",
                                      {"content": VALID.replace("demo/greeter", "demo/other")})
            assert (one["path"], one["version"], one["name"]) == ("demo/greeter", 1, "greeter")
            assert (two["version"], other["version"]) == (2, 1) and two["id"] != one["id"]
            assert one["warnings"] == []

            with pytest.raises(BusError) as invalid:
                await bus.request("noetl.q.catalog.register", {"content": INVALID})
            assert invalid.value.kind == "invalid_playbook"
            errors = invalid.value.details
            assert len(errors) >= 3 and all({"location", "message", "severity"} <= set(e) for e in errors)
            assert all(isinstance(e["line"], int) and isinstance(e["column"], int) for e in errors), errors
            with pytest.raises(BusError) as not_yaml:
                await bus.request("noetl.q.catalog.register", {"content": "a: [b"})
            assert not_yaml.value.kind == "invalid_playbook" and "YAML" in not_yaml.value.details[0]["message"]

            latest = await bus.request("noetl.q.catalog.get", {"path": "demo/greeter"})
            assert latest["version"] == 2 and "hello" in latest["content"]
            first = await bus.request("noetl.q.catalog.get", {"path": "demo/greeter", "version": 1})
            assert first["content"] == VALID and first["id"] == one["id"]
            by_id = await bus.request("noetl.q.catalog.get", {"id": other["id"]})
            assert by_id["path"] == "demo/other"
            for missing in ({"path": "demo/none"}, {"path": "demo/greeter", "version": 9}, {"id": 999}):
                with pytest.raises(BusError) as err:
                    await bus.request("noetl.q.catalog.get", missing)
                assert err.value.kind == "not_found"

            everything = await bus.request("noetl.q.catalog.list", {})
            assert [e["id"] for e in everything] == [other["id"], two["id"], one["id"]]
            assert "content" not in everything[0]
            versions = await bus.request("noetl.q.catalog.list", {"path": "demo/greeter"})
            assert [e["version"] for e in versions] == [2, 1]

            # concurrent registrations of one path get distinct versions
            many = await asyncio.gather(*(bus.request("noetl.q.catalog.register", {"content": VALID})
                                          for _ in range(5)))
            assert sorted(r["version"] for r in many) == [3, 4, 5, 6, 7]

    asyncio.run(main())


def test_restart_mid_stream_loses_and_duplicates_nothing(nats_url: str, pg_dsn: str) -> None:
    events = small_events(3000)

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        publishing = asyncio.create_task(publish_all(bus, events, chunk=50))
        for _ in range(3):
            rec = RecorderService(bus, pg_dsn=pg_dsn, batch=100, drain_timeout=0, ack_wait=3)
            await rec.start()
            await asyncio.sleep(0.15)
            await rec.stop()
        await publishing
        rec = RecorderService(bus, pg_dsn=pg_dsn, batch=100, ack_wait=3)
        await rec.start()
        try:  # messages a stopped recorder still held come back after ack_wait
            await eventually(lambda: recorded(pg_dsn, len(events)), timeout=40)
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())
    assert count(pg_dsn) == len(events)
    assert count(pg_dsn, "SELECT count(DISTINCT seq) FROM event") == len(events)
    assert count(pg_dsn, "SELECT max(seq) FROM event") == log_seq(len(events), 0)


def test_a_batch_stops_growing_at_its_byte_limit(nats_url: str, pg_dsn: str) -> None:
    """The writer's batch is bounded in bytes as well as in messages: a backlog of big messages is
    written in several transactions, none much over ``BATCH_BYTES``, and all of it is recorded."""
    from noetl_mesh.services.event_recorder import service

    xid = new_execution_id()
    events = [make_event("step.done", xid, event_id=stable_id("big", xid, i), source="worker:test", step="s",
                         step_run_id="r", data={"result": "x" * 1000}) for i in range(40)]

    async def main() -> list[int]:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn, batch=500)
        gate, sizes = asyncio.Event(), []
        store = rec.store

        async def held(records):
            sizes.append(len(records))
            if len(sizes) == 1:
                await gate.wait()  # the rest queues up behind the first write
            await store(records)

        rec.store = held
        await rec.start()
        try:
            await publish_all(bus, events)
            await eventually(lambda: _true(bool(sizes) and sizes[0] + rec._queue.qsize() == len(events)))
            gate.set()
            await eventually(lambda: recorded(pg_dsn, len(events)))
        finally:
            await rec.stop()
            await bus.close()
        return sizes

    with patch.object(service, "BATCH_BYTES", 4096):  # about four of these messages
        sizes = asyncio.run(main())
    assert sum(sizes) == len(events) and max(sizes) <= 5 and len(sizes) >= 8, sizes


async def _true(value: bool) -> bool:
    return value


async def _partition_of(bus: Bus, xid: str) -> int:
    """The partition the stream's transform gives an execution (the one message it has, read back)."""
    msg = await bus.js.get_last_msg(EVENTS, f"noetl.pevt.*.*.{xid}.*")
    return partition_from_subject(msg.subject)


@pytest.mark.parametrize("ack_wait", [1.0, 120.0], ids=["redelivered", "read-from-the-stream"])
def test_a_batch_held_by_a_dead_recorder_is_not_acked_away(nats_url: str, pg_dsn: str, ack_wait: float) -> None:
    """AckPolicy.ALL: acking seq N acks everything of the partition below; messages a crashed recorder
    had fetched must be recorded before the consumer's floor passes them: after their redelivery
    (ack_wait 1 s), or read from the stream by the feed that reads next (ack_wait 120 s: they would
    come back only after two minutes; the log is whole, and the partition acknowledged, in seconds)."""
    events = small_events(600, executions=1)

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn, ack_wait=ack_wait)
        await rec.start()
        await rec.stop()  # the durables exist now
        await publish_all(bus, events[:300])
        name = await a_dead_reader_held_100(bus, nats_url, events[0]["execution_id"])
        rec = RecorderService(bus, pg_dsn=pg_dsn, ack_wait=ack_wait)
        await rec.start()
        try:
            await publish_all(bus, events[300:])
            await eventually(lambda: recorded(pg_dsn, len(events)), timeout=30)

            async def all_acked() -> bool:
                info = await bus.js.consumer_info(EVENTS, name)
                return info.ack_floor.stream_seq == len(events) and info.num_ack_pending == 0

            await eventually(all_acked, timeout=30)
            if ack_wait > 60:
                assert (await bus.js.consumer_info(EVENTS, name)).num_redelivered == 0  # the feed read them
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())
    assert count(pg_dsn) == len(events)


def test_two_recorders_share_the_partitions_and_one_that_dies_loses_nothing(nats_url: str, pg_dsn: str) -> None:
    """Recorder replicas deal the partitions out (each reads its own durables); when one is killed
    mid-stream (no drain, no ack, no unpin) the other takes its partitions over once its membership
    expires, and every event is recorded once."""
    events = small_events(3000, executions=40)

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        one, other = await Bus.connect(nats_url, "rec-1"), await Bus.connect(nats_url, "rec-2")
        a = RecorderService(one, pg_dsn=pg_dsn, batch=50, ack_wait=2.0)
        b = RecorderService(other, pg_dsn=pg_dsn, batch=50, ack_wait=2.0)
        await a.start()
        await b.start()
        try:
            async def shared() -> bool:
                await a.membership.beat()
                await b.membership.beat()
                return set(a.feeds) | set(b.feeds) == set(range(4)) and not set(a.feeds) & set(b.feeds)

            await eventually(shared, timeout=15)
            await publish_all(bus, events[:1500], chunk=50)

            async def both_write() -> bool:
                return bool(a.recorded and b.recorded)

            await eventually(both_write, timeout=15)
            await one.nc.close()  # "killed": its connection gone, its key left to expire
            a._stopping.set()
            await publish_all(bus, events[1500:], chunk=50)
            await eventually(lambda: recorded(pg_dsn, len(events)), timeout=40)
            assert set(b.feeds) == set(range(4))
        finally:
            await b.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(a.stop(), 10)
            await other.close()
            await bus.close()

    # a dead reader's pin moves after the priority timeout (10 s): 2 s here, set when the durables are made
    with patch.dict(os.environ, {"NOETL_MEMBERSHIP_TTL": "2"}), patch.object(pinned, "PIN_TIMEOUT", 2.0):
        asyncio.run(main())
    assert count(pg_dsn) == len(events)
    assert count(pg_dsn, "SELECT count(DISTINCT seq) FROM event") == len(events)


def test_the_single_durable_of_an_earlier_version_hands_over_at_its_ack_floor(nats_url: str, pg_dsn: str) -> None:
    """An events stream an earlier recorder read through the one durable ``event-recorder``, up to
    stream sequence 100: the partitions' durables start after that (what it recorded is not read
    again), every later event is recorded, and the earlier durable is gone."""
    events = small_events(300)

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        try:
            await bus.consumer(EVENTS, feeds.DURABLE, "noetl.pevt.>", max_ack_pending=1000, ack_policy=AckPolicy.ALL)
            await publish_all(bus, events)
            earlier = await bus.js.pull_subscribe_bind(feeds.DURABLE, stream=EVENTS)
            msgs = await earlier.fetch(100, timeout=5)
            assert msgs[-1].metadata.sequence.stream == 100
            await msgs[-1].ack_sync()  # the earlier recorder's place: 1-100 are in its database
            await earlier.unsubscribe()
            rec = RecorderService(bus, pg_dsn=pg_dsn)
            await rec.start()
            try:
                await eventually(lambda: recorded(pg_dsn, 200), timeout=15)
                await asyncio.sleep(0.5)  # and nothing more comes
            finally:
                await rec.stop()
            names = [c.name for c in await bus.js.consumers_info(EVENTS)]
            assert feeds.DURABLE not in names and feeds.durable(0) in names
            again = RecorderService(bus, pg_dsn=pg_dsn)  # a restart keeps the durables' start
            await again.start()
            try:
                assert again._consuming() and set(again.feeds) == set(range(4))
                await publish_all(bus, small_events(10))
                await eventually(lambda: recorded(pg_dsn, 210), timeout=15)
            finally:
                await again.stop()
        finally:
            await bus.close()

    asyncio.run(main())
    assert count(pg_dsn) == 210
    assert count(pg_dsn, "SELECT min(seq) FROM event") == log_seq(101, 0)


def test_a_database_outage_delays_recording_and_loses_nothing(nats_url: str, pg_dsn: str) -> None:
    events = small_events(400)

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn, batch=50)
        await rec.start()
        try:
            await publish_all(bus, events[:100])
            await eventually(lambda: recorded(pg_dsn, 100))
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("ALTER TABLE event RENAME TO event_away")
            await publish_all(bus, events[100:])
            await asyncio.sleep(0.5)  # the recorder fails and retries meanwhile
            assert count(pg_dsn, "SELECT count(*) FROM event_away") == 100
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute("ALTER TABLE event_away RENAME TO event")
            await eventually(lambda: recorded(pg_dsn, len(events)), timeout=15)
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())
    assert count(pg_dsn) == len(events)


def test_odd_events_are_recorded_and_round_trip(nats_url: str, pg_dsn: str) -> None:
    """Values Postgres cannot hold as sent (NUL in text) are stored escaped; unexpected keys are kept."""
    xid = new_execution_id()
    nul = make_event("ctx.patched", xid, event_id="odd-1", source="worker:test", data={"patch": {"k": "a\x00b"}})
    extra = dict(make_event("step.started", xid, event_id="odd-2", source="worker:test", step="s", iteration=1),
                 custom={"x": 1}, attempt="first")

    async def main() -> None:
        async with recording(nats_url, pg_dsn) as (bus, rec):
            await publish_all(bus, [nul, extra])
            await eventually(lambda: recorded(pg_dsn, 2))
            page = await bus.request("noetl.q.execution.events", {"execution_id": xid})
            got_nul, got_extra = page["events"]
            assert got_nul["data"] == {"patch": {"k": "a\\u0000b"}}
            same_envelope(got_extra, extra)

    asyncio.run(main())


def test_insert_rate(nats_url: str, pg_dsn: str) -> None:
    """20,000 small events already in the stream, drained by a fresh recorder (printed: -s)."""
    n = 20_000
    events = small_events(n, executions=200)

    async def main() -> float:
        bus = await fresh_bus(nats_url)
        await publish_all(bus, events, chunk=1000)
        rec = RecorderService(bus, pg_dsn=pg_dsn)
        started = time.perf_counter()
        await rec.start()
        try:
            while rec.recorded < n:
                await asyncio.sleep(0.005)
            return time.perf_counter() - started
        finally:
            await rec.stop()
            await bus.close()

    elapsed = asyncio.run(main())
    print(f"\nevent-recorder: {n} events drained in {elapsed:.2f}s = {n / elapsed:,.0f} events/s")
    assert count(pg_dsn) == n
