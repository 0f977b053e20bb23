"""The event-recorder against hostile input, with real NATS and Postgres: values Postgres refuses (NUL,
unpaired surrogates, odd numbers), rows Postgres refuses anyway, replies bigger than a NATS message,
catalog writes it cannot store, and a database that is not there when it starts.

Bad values are published on the bus directly: the gateway refuses some of them, but any writer (a
task's result, a direct publisher) can carry them."""
from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import orjson
import psycopg
import pytest
import yaml

from noetl_mesh import limits
from noetl_mesh.client import GatewayClient
from noetl_mesh.core.events import make_event, new_execution_id, stable_id
from noetl_mesh.infra.bus import EVENTS, Bus, BusError, dumps
from noetl_mesh.infra.embedded import EmbeddedPostgres, free_port
from noetl_mesh.infra.payloads import is_ref
from noetl_mesh.services.event_recorder import folds
from noetl_mesh.services.event_recorder.service import RecorderService
from scenarios import TINY
from test_recorder import count, eventually, fresh_bus
from conftest import new_user

pytestmark = pytest.mark.integration

PLAYBOOK = yaml.safe_load(TINY)
SURROGATE = "SURROGATE-HERE"  # replaced in the message bytes: orjson cannot write an unpaired surrogate


def requested(xid: str, *, workload: Any = None, parent: Any = None, playbook: Any = None) -> dict[str, Any]:
    return make_event("playbook.execution.requested", xid, event_id=stable_id("request", xid), source="gateway",
                      status="in_progress", data={"playbook": playbook or PLAYBOOK, "catalog": None,
                                                  "workload": workload or {}, "parent_execution_id": parent})


def nul_playbook() -> dict[str, Any]:
    doc = yaml.safe_load(TINY)
    doc["metadata"]["path"] = "tests/nu\x00l"
    doc["workflow"][0]["tool"]["result"] = "a\x00b"
    doc["workflow"][0]["st\x00ep-key"] = 1
    return doc


def raw(events: list[dict[str, Any]], replacement: bytes = b"") -> bytes:
    return dumps(events).replace(SURROGATE.encode(), replacement)


# the exact inputs, each as the bytes of one message; the key names what is hostile in it
def hostile_messages() -> dict[str, tuple[str, bytes]]:
    out: dict[str, tuple[str, bytes]] = {}

    def add(name: str, event: dict[str, Any], replacement: bytes = b"") -> None:
        out[name] = (event["execution_id"], raw([event], replacement))

    add("nul in parent_execution_id", requested(new_execution_id(), parent="a\x00b"))
    add("nul in a workload string", requested(new_execution_id(), workload={"s": "a\x00b", "deep": [{"x": "\x00"}]}))
    add("nul in a workload key", requested(new_execution_id(), workload={"k\x00ey": 1}))
    add("nul in the playbook", requested(new_execution_id(), playbook=nul_playbook()))
    add("escaped unpaired surrogate", requested(new_execution_id(), workload={"s": SURROGATE}), b"\\ud800")
    add("raw unpaired surrogate", requested(new_execution_id(), parent=SURROGATE), b"\xed\xa0\x80")
    xid = new_execution_id()
    add("nul in a finished error", make_event(
        "workflow.finished", xid, event_id=stable_id("fin", xid), source="router", status="error",
        data={"status": "FAILED", "error": {"kind": "x", "message": "a\x00b", "k\x00": "\x00"}}))
    xid = new_execution_id()
    add("nul in the envelope", make_event("step.done", xid, event_id="e\x00" + xid, source="worker:de\x00fault",
                                          step="s\x00", data={"result": 1}))
    xid = new_execution_id()
    add("timestamp postgres cannot hold", make_event("step.done", xid, event_id=stable_id("ts", xid),
                                                     source="worker:default", step="s", timestamp=1e300))
    xid = new_execution_id()
    add("NaN, infinity and a huge number", make_event("step.done", xid, event_id=stable_id("nan", xid),
                                                      source="worker:default", step="s", data={"n": 0, "big": 1, "t": 2}))
    name = "NaN, infinity and a huge number"
    out[name] = (xid, out[name][1].replace(b'"n":0', b'"n":NaN').replace(b'"big":1', b'"big":1' + b"0" * 400)
                 .replace(b'"t":2', b'"t":1e999999'))
    return out


async def publish_raw(bus: Bus, xid: str, data: bytes) -> None:
    """As its writer would (the writer is in the subject: the first event's source, read from the bytes)."""
    source = data.split(b'"source":"', 1)[1].split(b'"', 1)[0].decode("utf-8", "replace")
    writer = "worker" if source.startswith("worker:") else source
    await bus.js.publish(f"noetl.evt.{writer}.ctl.{xid}", data, stream=EVENTS)


# ------------------------------------------------------------------------------ values Postgres refuses
def test_values_postgres_refuses_are_stored_escaped_and_the_log_goes_on(nats_url: str, pg_dsn: str) -> None:
    messages = hostile_messages()
    normal = new_execution_id()

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        for xid, data in messages.values():  # all in the stream before the recorder starts: one batch
            await publish_raw(bus, xid, data)
        await bus.publish_event(requested(normal))
        rec = RecorderService(bus, pg_dsn=pg_dsn)
        await rec.start()
        try:
            await eventually(lambda: _recorded(pg_dsn, len(messages) + 1), timeout=15)
            for what, (xid, _) in messages.items():
                page = await bus.request("noetl.q.execution.events", {"execution_id": xid})
                assert page["total"] == 1, what
                stored = page["events"][0]
                assert "unrecordable" not in (stored["data"] or {}), (what, stored["data"])
            nul_parent = messages["nul in parent_execution_id"][0]
            state = await bus.request("noetl.q.execution.get", {"execution_id": nul_parent})
            assert state["status"] == "PENDING" and state["parent_execution_id"] == "a\\u0000b"
            rows = {r["execution_id"]: r for r in await bus.request("noetl.q.execution.list", {})}
            assert rows[nul_parent]["parent_execution_id"] == "a\\u0000b"
            assert rows[messages["nul in the playbook"][0]]["path"] == "tests/nu\\u0000l"
            assert rows[messages["raw unpaired surrogate"][0]]["parent_execution_id"] == "\\ud800"
            finished = rows[messages["nul in a finished error"][0]]
            assert finished["status"] == "FAILED" and finished["error"]["message"] == "a\\u0000b"
            assert finished["error"]["k\\u0000"] == "\\u0000"

            events = (await bus.request("noetl.q.execution.events",
                                        {"execution_id": messages["nul in a workload key"][0]}))["events"]
            assert events[0]["data"]["workload"] == {"k\\u0000ey": 1}
            events = (await bus.request("noetl.q.execution.events",
                                        {"execution_id": messages["escaped unpaired surrogate"][0]}))["events"]
            assert events[0]["data"]["workload"] == {"s": "\\ud800"}
            envelope = (await bus.request("noetl.q.execution.events",
                                          {"execution_id": messages["nul in the envelope"][0]}))["events"][0]
            assert (envelope["source"], envelope["step"]) == ("worker:de\\u0000fault", "s\\u0000")
            odd = (await bus.request("noetl.q.execution.events",
                                     {"execution_id": messages["NaN, infinity and a huge number"][0]}))["events"][0]
            assert odd["data"] == {"n": "NaN", "big": "1" + "0" * 400, "t": "Infinity"}
            ts = (await bus.request("noetl.q.execution.events",
                                    {"execution_id": messages["timestamp postgres cannot hold"][0]}))["events"][0]
            assert ts["timestamp"] == 1e300  # kept as sent (in extra); the column stays null

            # the log goes on: a normal execution published afterwards is recorded and folds
            later = new_execution_id()
            await bus.publish_event(requested(later))
            await eventually(lambda: _recorded(pg_dsn, len(messages) + 2), timeout=10)
            assert (await bus.request("noetl.q.execution.get", {"execution_id": later}))["status"] == "PENDING"
            ping = await bus.request("noetl.q.recorder.ping", {})
            assert ping["ok"] and ping["database"] and ping["consumer"] and ping["lag"] == 0
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())


async def _recorded(dsn: str, n: int) -> bool:
    return count(dsn) >= n


POISON = """
CREATE FUNCTION poison_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.data ? 'poison' THEN RAISE EXCEPTION 'poisoned event' USING ERRCODE = '22023'; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER poison_event BEFORE INSERT ON event FOR EACH ROW EXECUTE FUNCTION poison_event();
CREATE FUNCTION poison_projection() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.path = 'poison/projection' THEN RAISE EXCEPTION 'poisoned projection'; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER poison_projection BEFORE INSERT OR UPDATE ON execution
    FOR EACH ROW EXECUTE FUNCTION poison_projection();
"""


def test_rows_postgres_refuses_anyway_are_recorded_as_rejected(nats_url: str, pg_dsn: str) -> None:
    """Whatever Postgres refuses despite the escaping (here: a DataError from a trigger on the event
    insert, a plain exception from one on the projection, an id too long for the index) is recorded as
    rejected — name and ids kept, data replaced — and everything else of the batch is recorded."""
    good = [make_event("step.done", new_execution_id(), event_id=f"good-{i}", source="worker:default", step="s",
                       data={"result": i}) for i in range(40)]
    poisoned_event = make_event("step.done", new_execution_id(), event_id="bad-event", source="worker:default", step="s",
                                data={"poison": 1})
    projection_doc = yaml.safe_load(TINY)
    projection_doc["metadata"]["path"] = "poison/projection"
    poisoned_projection = requested(new_execution_id(), playbook=projection_doc)
    long_id = secrets.token_hex(1500)  # over the btree index's row size (2704 bytes, incompressible), under
    # the 4 KiB NATS allows for a subject
    too_long = make_event("step.done", long_id, event_id="long-" + long_id, source="worker:default", step="s")
    batch = good[:15] + [poisoned_event] + good[15:30] + [poisoned_projection, too_long] + good[30:]

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn)
        await rec.start()  # migrates
        await rec.stop()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(POISON)
        for e in batch:
            await bus.publish_event(e)
        rec = RecorderService(bus, pg_dsn=pg_dsn)
        await rec.start()
        try:
            await eventually(lambda: _recorded(pg_dsn, len(batch)), timeout=15)
            page = await bus.request("noetl.q.execution.events", {"execution_id": poisoned_event["execution_id"]})
            stored = page["events"][0]
            assert (stored["event_id"], stored["name"], stored["step"]) == ("bad-event", "step.done", "s")
            assert "poisoned event" in stored["data"]["unrecordable"]
            page = await bus.request("noetl.q.execution.events",
                                     {"execution_id": poisoned_projection["execution_id"]})
            assert "poisoned projection" in page["events"][0]["data"]["unrecordable"]
            with psycopg.connect(pg_dsn) as conn:
                cut = conn.execute("SELECT execution_id, name, data FROM event WHERE name = 'step.done' AND "
                                   "event_id LIKE %s", ("long-%",)).fetchone()
            assert cut[0].startswith(long_id[:100]) and len(cut[0]) < 1000 and cut[1] == "step.done"
            assert "unrecordable" in cut[2]
            assert count(pg_dsn, "SELECT count(*) FROM event WHERE event_id LIKE %s", "good-%") == len(good)
            assert rec.rejected == 3
            await bus.publish_event(make_event("step.done", new_execution_id(), event_id="after", source="worker:default"))
            await eventually(lambda: _recorded(pg_dsn, len(batch) + 1), timeout=10)
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------ catalog and credentials
CATALOG = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: NAME, path: PATH}
workflow:
  - step: start
    tool: {kind: noop, result: hi}
"""


def test_catalog_writes_postgres_cannot_store_are_bad_requests(nats_url: str, pg_dsn: str) -> None:
    """(Credential writes: the credentials service's, tests/integration/test_credentials.py.)"""

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn)
        await rec.start()
        try:
            # YAML escapes give a NUL or an unpaired surrogate without one in the text
            for name, path, where in (("g", '"demo/a\\0b"', "metadata.path"), ('"a\\0"', "demo/n", "metadata.name"),
                                      ("g", '"demo/\\ud800"', "metadata.path")):
                with pytest.raises(BusError) as bad:
                    await bus.request("noetl.q.catalog.register",
                                      {"content": CATALOG.replace("NAME", name).replace("PATH", path)})
                # the validator refuses it first (NUL and unpaired surrogates are never playbook text),
                # at its location; the recorder's own refusal stays for what gets past it (below)
                found = str(bad.value.details)
                assert bad.value.kind == "invalid_playbook" and "line 4" in found, bad.value
                assert any(w in found for w in ("NUL", "surrogate", "invalid Unicode")), found
            with pytest.raises(BusError) as bad:  # a path longer than the unique index could hold: a catalog
                await bus.request("noetl.q.catalog.register",  # path has at most 1024 characters (lang/paths.py)
                                  {"content": CATALOG.replace("NAME", "g").replace("PATH", secrets.token_hex(1500))})
            assert bad.value.kind == "invalid_playbook" and "3000 characters" in str(bad.value.details), bad.value
            for req in ({"path": "demo/a\x00b"}, {"path": "demo/x", "version": 1}):
                with pytest.raises(BusError) as missing:
                    await bus.request("noetl.q.catalog.get", req)
                assert missing.value.kind == "not_found"
            # an unpaired surrogate in the request itself (orjson refuses it): the requester's fault
            for subject, body in (("noetl.q.catalog.register", {"content": CATALOG.replace("NAME", SURROGATE)}),):
                msg = await bus.nc.request(subject, raw([body], b"\\ud800")[1:-1], timeout=10)
                error = orjson.loads(msg.data)["error"]
                assert error["kind"] == "bad_request" and "not valid JSON" in error["message"], error
            with pytest.raises(BusError) as missing:
                await bus.request("noetl.q.execution.get", {"execution_id": "a\x00b"})
            assert missing.value.kind == "not_found"
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------ replies within the budget
def test_replies_stay_within_max_reply_bytes(nats_url: str, pg_dsn: str) -> None:
    """With a small budget: pages are cut by bytes and say where to go on; an event bigger than the
    budget comes with its big values as references; a summary, a catalog entry and a list likewise;
    a reply that cannot be made to fit is a too_large error naming the limit."""
    xid = new_execution_id()
    doc = yaml.safe_load(TINY)
    big = [make_event("task.processed", xid, event_id=f"big-{i}", source="worker:default", step="start", task="t",
                      data={"outcome": {"status": "ok", "result": "r" * 20_000}}) for i in range(10)]
    huge = make_event("task.processed", xid, event_id="huge", source="worker:default", step="start", task="t",
                      data={"outcome": {"status": "ok", "result": "h" * 100_000}})
    errors = [make_event("workflow.finished", new_execution_id(), event_id=f"err-{i}", source="worker:default",
                         status="error", data={"status": "FAILED", "error": {"message": "e" * 3000}})
              for i in range(40)]

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=pg_dsn)
        await rec.start()
        try:
            await rec.store(list(enumerate([requested(xid, playbook=doc), *big, huge, *errors], start=1)))
            budget = 64 * 1024
            with limits.override(max_reply_bytes=budget):
                pages, offset = [], 0
                while offset is not None:
                    page = await _request_bytes(bus, "noetl.q.execution.events",
                                                {"execution_id": xid, "offset": offset, "limit": 1000}, budget)
                    assert page["total"] == 12 and page["offset"] == offset and page["events"]
                    pages.append(page)
                    offset = page["next_offset"]
                events = [e for p in pages for e in p["events"]]
                assert len(events) == 12 and len(pages) >= 4
                assert [e["event_id"] for e in events[1:]] == [f"big-{i}" for i in range(10)] + ["huge"]
                assert all(e["data"]["outcome"]["result"] == "r" * 20_000 for e in events[1:11])
                shrunk = events[11]["data"]["outcome"]
                assert is_ref(shrunk["result"]) and await bus.payloads.expand(shrunk) == huge["data"]["outcome"]

                listed = await _request_bytes(bus, "noetl.q.execution.list", {"limit": 1000}, budget)
                assert len(listed) == 41
                expanded = await bus.payloads.expand(listed)
                assert sorted(r["error"]["message"] for r in expanded if r["error"]) == ["e" * 3000] * 40

                catalog = CATALOG.replace("NAME", "big").replace("PATH", "demo/big") + "# " + "c" * 200_000 + "\n"
                entry = await bus.request("noetl.q.catalog.register", {"content": catalog})
                got = await _request_bytes(bus, "noetl.q.catalog.get", {"id": entry["id"]}, budget)
                assert got["path"] == "demo/big" and is_ref(got["content"])
                assert await bus.payloads.expand(got["content"]) == catalog

            with limits.override(max_reply_bytes=300):
                with pytest.raises(BusError) as too_large:
                    await bus.request("noetl.q.execution.list", {"limit": 1000})
                assert too_large.value.kind == "too_large"
                assert "max_reply_bytes" in too_large.value.message
                assert "NOETL_LIMIT_MAX_REPLY_BYTES" in too_large.value.message
        finally:
            await rec.stop()
            await bus.close()

    asyncio.run(main())


async def _request_bytes(bus: Bus, subject: str, payload: dict[str, Any], budget: int) -> Any:
    msg = await bus.nc.request(subject, dumps(payload), timeout=10)
    assert len(msg.data) <= budget, (subject, len(msg.data))
    reply = orjson.loads(msg.data)
    assert not (isinstance(reply, dict) and "error" in reply and len(reply) == 1), reply
    return reply


# ------------------------------------------------------------------------------ a database that is not there
def test_a_recorder_started_without_postgres_waits_for_it(nats_url: str) -> None:
    port = free_port()
    password = "the-recorders-own"
    dsn = f"host=127.0.0.1 port={port} user=postgres password='{password}' dbname=postgres connect_timeout=2"
    xid = new_execution_id()

    async def main() -> None:
        bus = await fresh_bus(nats_url)
        rec = RecorderService(bus, pg_dsn=dsn)
        await rec.start()  # returns (else the test's timeout): the database is retried in the background
        pg = None
        try:
            await bus.publish_event(requested(xid))
            ping = await bus.request("noetl.q.recorder.ping", {}, timeout=5)
            assert ping["ok"] is False and ping["database"] is False and ping["consumer"] is False
            with pytest.raises(BusError) as unavailable:
                await bus.request("noetl.q.execution.get", {"execution_id": xid}, timeout=5)
            assert unavailable.value.kind == "unavailable"
            await asyncio.sleep(3)  # a few attempts
            assert not rec._task.done()  # still waiting, not exited
            pg = await asyncio.to_thread(EmbeddedPostgres(port=port, fast=True, password=password).start)

            async def records() -> bool:
                try:
                    state = await bus.request("noetl.q.execution.get", {"execution_id": xid}, timeout=5)
                except BusError:
                    return False
                return state["status"] == "PENDING"

            await eventually(records, timeout=30, every=0.5)
            ping = await bus.request("noetl.q.recorder.ping", {}, timeout=5)
            assert ping["ok"] and ping["database"] and ping["consumer"] and ping["recorded"] == 1

            # the database goes away and comes back empty (a new cluster on the same port)
            await asyncio.to_thread(pg.stop)
            pg = None

            async def database_down() -> bool:
                ping = await bus.request("noetl.q.recorder.ping", {}, timeout=5)
                return not ping["ok"] and not ping["database"] and ping["consumer"]

            await eventually(database_down, timeout=10, every=0.2)
            second = new_execution_id()
            await bus.publish_event(requested(second))
            pg = await asyncio.to_thread(EmbeddedPostgres(port=port, fast=True, password=password).start)

            async def migrated_and_recorded() -> bool:
                try:
                    return count(pg.dsn(), "SELECT count(*) FROM execution WHERE execution_id = %s", second) == 1
                except psycopg.errors.UndefinedTable:
                    return False

            await eventually(migrated_and_recorded, timeout=30, every=0.5)
        finally:
            await rec.stop()
            await bus.close()
            if pg is not None:
                await asyncio.to_thread(pg.stop)

    asyncio.run(main())


# ------------------------------------------------------------------------------ through the whole stack
def _loop_of_big_results(n: int, size: int) -> dict[str, Any]:
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "bigloop", "path": "tests/bigloop"},
            "workflow": [{"step": "start", "loop": {"in": f"{{{{ range({n}) | list }}}}", "iterator": "i",
                                                    "spec": {"mode": "parallel"}},
                          "tool": {"kind": "noop", "result": f"{{{{ 'x' * {size} }}}}"}}]}


def _chain_of_big_results(n: int, size: int) -> dict[str, Any]:
    steps = [{"step": f"s{i}", "tool": {"kind": "noop", "result": f"{{{{ '{i}' * {size} }}}}"},
              **({"next": {"arcs": [{"step": f"s{i + 1}"}]}} if i < n - 1 else {})} for i in range(n)]
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "bigchain", "path": "tests/bigchain"},
            "workflow": steps}


def test_six_loop_iterations_of_200_kb_have_readable_events(stack) -> None:
    status, events = stack.execute(_loop_of_big_results(6, 200_000), timeout=60)
    assert status["status"] == "COMPLETED"
    done = [e for e in events if e["name"] == "loop.iteration.done"]
    assert len(done) == 6 and len({e["event_id"] for e in events}) == len(events)

    async def pages() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.url, trust_env=False, timeout=30, headers=stack.headers) as http:
            sizes, offset = [], 0
            while offset is not None:
                resp = await http.get(f"/api/executions/{status['execution_id']}/events",
                                      params={"offset": offset, "limit": 1000})
                assert resp.status_code == 200, resp.text
                sizes.append(len(resp.content))
                offset = resp.json()["next_offset"]
            return sizes

    sizes = stack.run(pages())
    assert len(sizes) > 1 and max(sizes) <= limits.current().max_reply_bytes + 4096


def test_six_chained_steps_of_200_kb_have_a_readable_state(stack) -> None:
    status, _ = stack.execute(_chain_of_big_results(6, 200_000), timeout=60)
    assert status["status"] == "COMPLETED"

    async def state() -> dict[str, Any]:
        async with stack.client() as client:
            return await client.status(status["execution_id"])

    full = stack.run(state())
    assert full["status"] == "COMPLETED"
    assert {name: step["result"] for name, step in full["steps"].items()} == {
        f"s{i}": str(i) * 200_000 for i in range(6)}


@pytest.mark.parametrize("what", ["nul in parent_execution_id", "nul in a workload string",
                                  "nul in a workload key", "nul in the playbook", "escaped unpaired surrogate",
                                  "raw unpaired surrogate"])
def test_a_hostile_request_leaves_the_next_execution_alone(stack, what: str) -> None:
    xid, data = hostile_messages()[what]

    async def publish() -> None:
        settings = stack.stack.settings  # as the gateway would publish them (a request is the gateway's)
        bus = await Bus.connect(settings.nats_url, "hostile", settings.creds_for("gateway"))
        try:
            await publish_raw(bus, xid, data)
        finally:
            await bus.close()

    stack.run(publish())
    status, events = stack.execute(PLAYBOOK, timeout=30)  # a guard against a hang only
    assert status["status"] == "COMPLETED"
    assert events[0]["name"] == "playbook.execution.requested"

    async def bad_events() -> dict[str, Any]:
        async with stack.client() as client:
            return await client.events(xid)

    page = stack.run(bad_events())
    assert page["events"][0]["event_id"] == stable_id("request", xid)


def test_a_catalog_entry_over_the_reply_budget_is_read_and_started_by_path(stack) -> None:
    """The recorder sends the text of a big entry by reference; the gateway and admission expand it."""
    doc = yaml.safe_load(TINY)
    doc["metadata"]["path"] = "tests/big-entry"
    doc["workflow"][0]["desc"] = "d" * 200_000  # the entry: over a 64 KiB reply budget
    text = yaml.safe_dump(doc)

    async def main() -> tuple[dict, dict]:
        async with stack.client() as client:
            await client.register(text)
            entry = await client._call("GET", "/api/catalog/by-path/tests/big-entry")
            xid = await client.start(path="tests/big-entry")
            return entry, await client.wait(xid, timeout=30)

    with limits.override(max_reply_bytes=64 * 1024):
        entry, final = stack.run(main())
    assert entry["content"] == text
    assert final["status"] == "COMPLETED"


def test_a_large_fold_is_streamed_kept_and_one_at_a_time(stack, monkeypatch) -> None:
    """The status and the console's view of an execution with many state events: folded in chunks, the
    same answer as a fold in one go; asked again unchanged, not folded again; and while another large
    fold holds the recorder's slot, ``503`` with a time to retry, while small reads still answer (an
    execution at ``max_step_runs`` took the recorder from everyone when eight viewers asked at once)."""
    status, _ = stack.execute(_chain_of_big_results(8, 10), timeout=60)
    xid = status["execution_id"]
    recorder = stack.stack.services("event-recorder")[0]

    async def read() -> tuple[dict, dict, dict]:
        async with httpx.AsyncClient(base_url=stack.url, trust_env=False, timeout=30, headers=stack.headers) as http:
            got = [await http.get(f"/api/executions/{xid}"), await http.get(f"/api/executions/{xid}/state"),
                   await http.get(f"/api/executions/{xid}/state", params={"upto": 12})]
        assert all(r.status_code == 200 for r in got), [r.text for r in got]
        return tuple(r.json() for r in got)

    small = stack.run(read())
    assert small[0]["status"] == "COMPLETED" and len(small[0]["steps"]) == 8
    folded: list[int] = []
    stream = folds.stream

    async def counted(*args: Any, **kw: Any) -> Any:
        state, n = await stream(*args, **kw)
        folded.append(n)
        return state, n

    monkeypatch.setattr(folds, "SMALL", 5)
    monkeypatch.setattr(folds, "CHUNK", 3)  # every read below is large, and folds in many chunks
    monkeypatch.setattr(folds, "WAIT", 30.0)
    monkeypatch.setattr(folds, "stream", counted)
    large = stack.run(read())
    assert large == small
    assert len(folded) == 3 and all(n > 5 for n in folded)
    # kept, the log not having moved: the status and the whole view; a view at an earlier event is not
    assert stack.run(read()) == small and len(folded) == 4

    async def as_users() -> list[httpx.Response]:
        large = recorder.large
        async with httpx.AsyncClient(base_url=stack.url, trust_env=False, timeout=30, headers=stack.headers) as http:
            me = (await http.get("/api/auth/whoami")).json()["user_id"]
            viewer = await new_user(stack, "fold-reader", ["viewer"])
            assert (await http.get(f"/api/executions/{xid}/state", params={"upto": 10**6})).json() == small[1]
            large.readers[me] = folds.PER_READER  # as many large reads of the admin's wait or run as may
            try:
                refused = await http.get(f"/api/executions/{xid}/state", params={"upto": 11})
            finally:
                del large.readers[me]
            # one large read of the admin's is being folded: the admin's next waits for it; the viewer's does not
            large.readers[me], turn = 1, large.turns.setdefault(me, asyncio.Lock())
            await turn.acquire()
            try:
                waiting = asyncio.ensure_future(http.get(f"/api/executions/{xid}/state", params={"upto": 12}))
                async with httpx.AsyncClient(base_url=stack.url, trust_env=False, timeout=30,
                                             headers={"Authorization": f"Bearer {viewer}"}) as dev:
                    theirs = await dev.get(f"/api/executions/{xid}/state", params={"upto": 11})
                still = not waiting.done()
            finally:
                turn.release()
            mine = await waiting
            large.readers[me] -= 1
            if not large.readers[me]:
                del large.readers[me]
                large.turns.pop(me, None)
            assert not large.readers and not large.turns
            return [refused, theirs, still, mine]

    refused, theirs, still, mine = stack.run(as_users())
    assert refused.status_code == 429 and refused.headers["retry-after"] == str(folds.RETRY_AFTER), refused.text
    assert "one at a time per user" in refused.text
    assert theirs.status_code == 200 and theirs.json()["position"] == 11, theirs.text
    assert still and mine.status_code == 200 and mine.json()["position"] == 12, mine.text
    assert len(folded) == 6  # upto past the last event is the whole view, kept; then the viewer's, the admin's

    monkeypatch.setattr(folds, "WAIT", 0.3)

    async def while_held() -> list[httpx.Response]:
        await recorder.large.slot.acquire()  # another large fold runs
        try:
            async with httpx.AsyncClient(base_url=stack.url, trust_env=False, timeout=30,
                                         headers=stack.headers) as http:
                return [await http.get(f"/api/executions/{xid}/state", params={"upto": 13}),
                        await http.get(f"/api/executions/{xid}", params={"brief": "true"}),
                        await http.get(f"/api/executions/{xid}/events", params={"limit": 5})]
        finally:
            recorder.large.slot.release()

    waited, brief, page = stack.run(while_held())
    assert waited.status_code == 503 and waited.headers["retry-after"] == str(folds.RETRY_AFTER)
    assert "one at a time" in waited.text
    assert brief.status_code == 200 and brief.json()["status"] == "COMPLETED"
    assert page.status_code == 200 and len(page.json()["events"]) == 5
    assert len(folded) == 6
