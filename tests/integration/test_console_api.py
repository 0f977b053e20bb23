"""The console's routes on the real stack (services/gateway/console.py, live.py; the recorder's
``noetl.q.execution.state`` and notices): time travel through the engine's fold, filtered event
pages, a run's whole result, a catalog entry's findings, the live streams and their limits, the
files under /ui."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from noetl_mesh import limits

ROOT = Path(__file__).resolve().parents[2]
FORK_JOIN = (ROOT / "examples" / "fork_join.yaml").read_text()

APPROVAL = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: console_approval, path: console/approval}
workflow:
  - step: start
    tool:
      - {name: approve, kind: wait, signal: go, timeout: 1h}
    next: {arcs: [{step: big}]}
  - step: big
    tool: {kind: python, code: "result = ['x' * 100 for _ in range(2000)]"}
"""

LOOPED = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: console_loop, path: console/loop}
workflow:
  - step: start
    loop: {in: "{{ range(40) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 8}}
    tool: {kind: noop, result: "{{ iter.i * 2 }}"}
"""

LINTED = """apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: console_lint, path: console/lint}
workflow:
  - step: start
    tool: {kind: noop, result: 1}
    next: {arcs: [{step: end, args: {n: "{{ event.result }}"}}]}
  - step: end
    tool: {kind: noop, result: "{{ args.m }}"}
"""


def http(stack) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=stack.url, headers=stack.headers, trust_env=False, timeout=30)


async def start(client: httpx.AsyncClient, playbook: str, workload: dict | None = None) -> str:
    resp = await client.post("/api/executions", json={"playbook": playbook, "workload": workload or {}})
    assert resp.status_code == 202, resp.text
    return resp.json()["execution_id"]


async def finished(client: httpx.AsyncClient, eid: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the test waits; the console itself never polls
        state = (await client.get(f"/api/executions/{eid}/state")).json()
        if state.get("finished"):
            return state
        await asyncio.sleep(0.1)
    raise AssertionError(f"{eid} did not finish: {state}")


async def all_events(client: httpx.AsyncClient, eid: str) -> list[dict[str, Any]]:
    out, offset = [], 0
    while offset is not None:
        page = (await client.get(f"/api/executions/{eid}/events", params={"offset": offset, "limit": 1000})).json()
        out += page["events"]
        offset = page["next_offset"]
    return out


class Sse:
    """A live stream read as (event, data) pairs."""

    def __init__(self, response: httpx.Response):
        self.response, self.lines = response, response.aiter_lines()

    async def next(self, timeout: float = 20) -> tuple[str, Any]:
        event, data = None, None
        while True:
            line = await asyncio.wait_for(self.lines.__anext__(), timeout)
            if line.startswith(":"):
                continue
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = orjson.loads(line[6:])
            elif line == "" and event is not None:
                return event, data

    async def until(self, predicate, timeout: float = 30) -> list[tuple[str, Any]]:
        seen, deadline = [], time.monotonic() + timeout
        while True:
            item = await self.next(max(0.1, deadline - time.monotonic()))
            seen.append(item)
            if predicate(*item):
                return seen


def test_time_travel_folds_the_log_up_to_any_event(stack):
    async def go():
        async with http(stack) as client:
            eid = await start(client, FORK_JOIN)
            final = await finished(client, eid)
            assert final["status"] == "COMPLETED" and final["position"] == final["total"]
            assert final["steps"]["report"] == {"status": "done", "runs": 1, "skipped": 0, "active": 0, "tokens": 0}
            assert final["runs"]["report"]["shown"][0]["result"] == {"total_orders": 200}
            assert final["steps"]["apac"]["status"] == "idle"  # its arc's `when` did not hold
            events = await all_events(client, eid)
            assert len(events) == final["total"] and [e["seq"] for e in events] == sorted(e["seq"] for e in events)
            admitted = next(i for i, e in enumerate(events) if e["name"] == "step.admitted" and e["step"] == "report")
            before = (await client.get(f"/api/executions/{eid}/state", params={"upto": admitted})).json()
            assert before["position"] == admitted and before["at"]["seq"] == events[admitted - 1]["seq"]
            assert before["steps"]["report"]["runs"] == 0 and before["steps"]["report"]["status"] == "waiting"
            assert before["steps"]["report"]["tokens"] == 2  # both branches' tokens on its places, not consumed
            assert {t["place"] for t in before["tokens"]} == {"eu#0->report", "us#0->report"}
            at = (await client.get(f"/api/executions/{eid}/state", params={"seq": events[admitted]["seq"]})).json()
            assert at["position"] == admitted + 1 and at["steps"]["report"]["status"] == "running"
            nothing = (await client.get(f"/api/executions/{eid}/state", params={"upto": 0})).json()
            assert nothing["position"] == 0 and nothing["steps"] == {} and nothing["status"] == "PENDING"
            with_net = (await client.get(f"/api/executions/{eid}/state", params={"net": "true"})).json()
            edges = {e["id"]: e for e in with_net["net"]["edges"]}
            assert edges["start#0->eu"]["when"] == "{{ 'eu' in workload.regions }}"
            assert {n["id"]: n["join"] for n in with_net["net"]["nodes"]}["report"] is True
            assert (await client.get(f"/api/executions/{eid}/state", params={"upto": 1, "seq": 1})).status_code == 422
            assert (await client.get("/api/executions/nope/state")).status_code == 404

    stack.run(go())


def test_event_filters_loop_counts_and_a_runs_whole_result(stack):
    async def go():
        async with http(stack) as client:
            eid = await start(client, LOOPED)
            final = await finished(client, eid)
            run = final["runs"]["start"]["shown"][0]
            assert run["loop"]["total"] == 40 and run["loop"]["done"] == 40 and run["loop"]["failed"] == 0
            assert run["loop"]["in_flight"] == 0 and run["loop"]["mode"] == "parallel"
            page = (await client.get(f"/api/executions/{eid}/events", params={
                "name": ["loop.iteration.done"], "limit": 10})).json()
            assert page["total"] == 40 and len(page["events"]) == 10 and page["next_offset"] == 10
            assert page["log_total"] == final["total"] and {e["name"] for e in page["events"]} == {"loop.iteration.done"}
            one = (await client.get(f"/api/executions/{eid}/events", params={"iteration": 7, "name": [
                "loop.iteration.done", "task.processed"]})).json()
            assert [e["name"] for e in one["events"]] == ["task.processed", "loop.iteration.done"]
            assert one["events"][1]["data"]["result"] == 14
            # the middle of the loop: counts of the log up to there, never rows
            middle = next(i for i, e in enumerate(await all_events(client, eid))
                          if e["name"] == "loop.iteration.done" and e["iteration"] is not None) + 1
            partial = (await client.get(f"/api/executions/{eid}/state", params={"upto": middle})).json()
            progress = partial["runs"]["start"]["shown"][0]["loop"]
            assert progress["done"] == 1 and progress["total"] == 40 and progress["in_flight"] >= 1

            eid = await start(client, APPROVAL)
            deadline = time.monotonic() + 30
            while not (await client.get("/api/waits", params={"execution_id": eid})).json():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert (await client.post(f"/api/executions/{eid}/signals/go", json={"ok": True})).status_code == 202
            final = await finished(client, eid)
            shown = final["runs"]["big"]["shown"][0]
            assert shown["result"]["$size"] > 200_000 and shown["result"]["$items"] == 2000
            assert len(shown["result"]["$preview"]) <= 2048
            resp = await client.get(f"/api/executions/{eid}/runs/{shown['run_id']}/result")
            assert resp.status_code == 200 and "attachment" in resp.headers["content-disposition"]
            assert resp.json()["result"] == ["x" * 100] * 2000
            assert (await client.get(f"/api/executions/{eid}/runs/none/result")).status_code == 404
            listed = (await client.get("/api/executions", params={"path": "console/approval"})).json()
            assert [x["execution_id"] for x in listed] == [eid] and listed[0]["requested_by_name"] == "admin"
            assert (await client.get("/api/executions", params={"path": "console/approval", "since": "2999-01-01T00:00:00Z"})).json() == []
            assert (await client.get("/api/executions", params={"since": "yesterday"})).status_code == 422

    stack.run(go())


BIG_LOOP = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: console_big_loop, path: console/big_loop}
workflow:
  - step: start
    loop: {in: "{{ range(250) | list }}", iterator: i, spec: {mode: parallel, max_in_flight: 32}}
    tool: {kind: noop, result: "{{ iter.i }}"}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop, result: 1}
"""

FAILING = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: console_failing, path: console/failing}
workflow:
  - step: start
    tool: {kind: python, code: "raise KeyError('missing')"}
"""


def test_the_timeline_has_runs_tasks_waits_and_loops_bounded(stack):
    """GET /api/executions/{id}/timeline: each step run with its times and tasks; a small loop's iterations
    one by one, a big one as counts per slice of the window (zoomed with from/to); a run waiting for a
    signal is waiting."""
    async def go():
        async with http(stack) as client:
            eid = await start(client, FORK_JOIN)
            await finished(client, eid)
            tl = (await client.get(f"/api/executions/{eid}/timeline")).json()
            assert tl["status"] == "COMPLETED" and tl["start"] <= tl["end"] and tl["runs_total"] == 4
            runs = {r["step"]: r for r in tl["runs"]}
            assert set(runs) == {"start", "eu", "us", "report"}
            for r in runs.values():
                assert r["status"] == "done" and r["admitted_at"] <= r["started_at"] <= r["ended_at"] <= tl["end"]
            (task,) = runs["eu"]["tasks"]
            assert task["status"] == "done" and task["attempt"] == 1
            assert runs["eu"]["started_at"] <= task["started_at"] <= task["ended_at"] <= runs["eu"]["ended_at"]

            eid = await start(client, LOOPED)
            await finished(client, eid)
            (loop_run,) = (await client.get(f"/api/executions/{eid}/timeline")).json()["runs"]
            assert [i["iteration"] for i in loop_run["loop"]["iterations"]] == list(range(40))
            assert {i["status"] for i in loop_run["loop"]["iterations"]} == {"done"} and len(loop_run["tasks"]) == 40

            eid = await start(client, BIG_LOOP)
            await finished(client, eid)
            tl = (await client.get(f"/api/executions/{eid}/timeline", params={"buckets": 10})).json()
            big, end = tl["runs"]
            loop = big["loop"]
            assert loop["total"] == 250 and loop["done"] == 250 and "iterations" not in loop and "tasks" not in big
            assert len(loop["slices"]["done"]) == 12 and sum(loop["slices"]["done"]) == 250
            assert loop["slices"]["done"][0] == loop["slices"]["done"][-1] == 0  # nothing outside the execution
            assert end["tasks"][0]["status"] == "done"
            # zoomed to the loop's second half: what ended before and after the window is counted apart
            middle = (loop["first_at"] + loop["last_at"]) / 2
            zoomed = (await client.get(f"/api/executions/{eid}/timeline", params={
                "from": str(middle), "to": str(loop["last_at"] + 0.001), "buckets": 5})).json()
            slices = zoomed["runs"][0]["loop"]["slices"]["done"]
            assert zoomed["window"]["from"] == pytest.approx(middle) and len(slices) == 7
            assert sum(slices) == 250 and slices[0] > 0 and sum(slices[1:6]) > 0

            eid = await start(client, APPROVAL)
            deadline = time.monotonic() + 30
            while True:
                tl = (await client.get(f"/api/executions/{eid}/timeline")).json() \
                    if (await client.get(f"/api/waits", params={"execution_id": eid})).json() else None
                if tl and tl["runs"] and tl["runs"][0]["status"] == "waiting":
                    break
                assert time.monotonic() < deadline, tl
                await asyncio.sleep(0.1)
            waiting = tl["runs"][0]
            assert tl["end"] is None and waiting["ended_at"] is None
            assert waiting["waits"][0]["signal"] == "go" and waiting["waits"][0]["ended_at"] is None
            assert waiting["tasks"][0]["status"] == "waiting" and waiting["tasks"][0]["suspended_at"]
            assert (await client.post(f"/api/executions/{eid}/signals/go", json={"ok": True})).status_code == 202
            await finished(client, eid)
            done = (await client.get(f"/api/executions/{eid}/timeline")).json()["runs"][0]
            assert done["status"] == "done" and done["waits"][0]["ended_at"] >= done["waits"][0]["started_at"]

            assert (await client.get("/api/executions/nope/timeline")).status_code == 404
            assert (await client.get(f"/api/executions/{eid}/timeline", params={"from": "10", "to": "5"})).status_code == 422
            assert (await client.get(f"/api/executions/{eid}/timeline", params={"buckets": 0})).status_code == 422
            assert (await client.get(f"/api/executions/{eid}/timeline", params={"from": "soon"})).status_code == 422

    stack.run(go())


def test_the_overview_and_the_search_by_id_prefix(stack):
    """GET /api/stats/executions: per status over time, the slowest playbooks, failures by error kind;
    GET /api/executions?id=: an id or the start of one."""
    async def go():
        async with http(stack) as client:
            since = time.time() - 1
            ok, failed = await start(client, FORK_JOIN), await start(client, FAILING)
            for eid in (ok, failed):
                await finished(client, eid)
            stats = (await client.get("/api/stats/executions", params={"since": str(since), "buckets": 6})).json()
            assert stats["since"] == pytest.approx(since) and len(stats["by_status"]) == 6
            assert stats["totals"]["COMPLETED"] >= 1 and stats["totals"]["FAILED"] >= 1
            assert sum(s.get("FAILED", 0) for s in stats["by_status"]) == stats["totals"]["FAILED"]
            kinds = {f["kind"]: f for f in stats["failures"]}
            assert kinds["python_error"]["count"] >= 1 and kinds["python_error"]["latest_execution"] == failed
            assert "missing" in kinds["python_error"]["latest_message"]
            paths = {p["path"]: p for p in stats["slowest"]}
            fork = paths["examples/fork_join"]
            assert fork["count"] >= 1 and 0 <= fork["p50_seconds"] <= fork["p95_seconds"] <= fork["max_seconds"]
            assert paths["console/failing"]["failed"] >= 1
            for params in ({"since": "2030-01-01T00:00:00Z", "until": "2029-01-01T00:00:00Z"},
                           {"since": "2000-01-01T00:00:00Z"}, {"buckets": 0}, {"until": "later"}):
                assert (await client.get("/api/stats/executions", params=params)).status_code == 422, params
            found = (await client.get("/api/executions", params={"id": ok[:6]})).json()
            assert ok in [x["execution_id"] for x in found] and all(x["execution_id"].startswith(ok[:6]) for x in found)
            assert [x["execution_id"] for x in (await client.get("/api/executions", params={"id": ok})).json()] == [ok]
            assert (await client.get("/api/executions", params={"id": "x y"})).status_code == 422

    stack.run(go())


def test_the_counters_equal_the_log_and_a_redelivered_event_counts_once(stack):
    """event_count and loop_progress are added in the transaction that inserts the events: a message
    published again (a redelivery past JetStream's duplicate window) inserts nothing and adds nothing."""
    import psycopg

    from noetl_mesh.infra.bus import Bus, EVENTS, batch_subject, dumps

    async def go():
        async with http(stack) as client:
            eid = await start(client, LOOPED)
            final = await finished(client, eid)
            events = await all_events(client, eid)
        with psycopg.connect(stack.stack.settings.pg_dsn) as conn:
            counted = conn.execute("SELECT count(*) FROM event WHERE execution_id = %s", (eid,)).fetchone()[0]
            done = conn.execute("SELECT done, started FROM loop_progress WHERE execution_id = %s", (eid,)).fetchone()
        assert final["total"] == counted == len(events) and done == (40, 40)
        again = [{k: v for k, v in e.items() if k != "seq"} for e in events if e["name"] == "loop.iteration.done"][:5]
        bus = await Bus.connect(stack.nats_url, "test", stack.admin)
        try:
            await bus.js.publish(batch_subject(again), dumps(again), stream=EVENTS, headers={"Nats-Msg-Id": "again-1"})
            marker = await bus.js.publish(batch_subject(again), dumps(again[:1]), stream=EVENTS,
                                          headers={"Nats-Msg-Id": "again-2"})
        finally:
            await bus.close()
        deadline = time.monotonic() + 20
        while True:  # the recorder has passed both messages once its consumer's ack floor has
            with psycopg.connect(stack.stack.settings.pg_dsn) as conn:
                now = conn.execute("SELECT event_count FROM execution WHERE execution_id = %s", (eid,)).fetchone()[0]
                loops = conn.execute("SELECT done FROM loop_progress WHERE execution_id = %s", (eid,)).fetchone()[0]
            async with http(stack) as client:
                lag = (await client.get("/ready")).json()["recorder"].get("lag")
            if lag == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert marker.seq and now == counted and loops == 40

    stack.run(go())


def test_a_catalog_entrys_findings_at_their_lines_and_its_net(stack):
    async def go():
        async with http(stack) as client:
            entry = (await client.post("/api/catalog", json={"content": LINTED})).json()
            report = (await client.get(f"/api/catalog/{entry['id']}/lint")).json()
            assert report["valid"] is True and report["path"] == "console/lint"
            found = [f for f in report["findings"] if f["code"] == "L403"]
            assert found and found[0]["line"] == 9 and found[0]["severity"] == "error"
            assert [n["id"] for n in report["net"]["nodes"]] == ["start", "end"]
            assert report["net"]["edges"][0]["args"] == {"n": "{{ event.result }}"}

    stack.run(go())


def test_a_live_stream_carries_what_was_recorded_and_the_state_after_it(stack):
    async def go():
        async with http(stack) as client:
            eid = await start(client, APPROVAL)
            async with client.stream("GET", f"/api/live/executions/{eid}") as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                sse = Sse(resp)
                event, hello = await sse.next()
                assert event == "hello" and hello["execution_id"] == eid
                deadline = time.monotonic() + 30
                while not (await client.get("/api/waits", params={"execution_id": eid})).json():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
                async with client.stream("GET", "/api/live/executions") as listing:
                    lst = Sse(listing)
                    assert (await lst.next())[0] == "hello"
                    await client.post(f"/api/executions/{eid}/signals/go", json={})
                    seen = await sse.until(lambda e, d: e == "state" and d["status"] == "COMPLETED")
                    names = {n for e, d in seen if e == "events" for n in d["names"]}
                    assert {"signal.received", "workflow.finished"} <= names
                    tails = [ev for e, d in seen if e == "events" for ev in d["events"]]
                    assert tails == sorted(tails, key=lambda ev: ev["seq"])  # log order
                    assert all("data" not in ev for ev in tails)  # compact: the page reads data on demand
                    changed = await lst.until(lambda e, d: e == "executions" and eid in d["changed"])
                    assert changed
            # only one topic per execution, gone with its last stream
            gateway = stack.stack.services("gateway")[0]
            await asyncio.sleep(0.2)
            assert eid not in gateway.app.state.live.topics and gateway.app.state.live.streams == 0

    stack.run(go())


def test_live_streams_are_limited_per_session_and_end_with_their_lifetime(stack):
    async def go():
        async with http(stack) as client:
            eid = await start(client, FORK_JOIN)
            await finished(client, eid)
            with limits.override(max_live_streams_per_session=2):
                async with client.stream("GET", f"/api/live/executions/{eid}") as a, \
                        client.stream("GET", "/api/live/executions") as b:
                    assert (await Sse(a).next())[0] == "hello" and (await Sse(b).next())[0] == "hello"
                    hub = stack.stack.services("gateway")[0].app.state.live
                    async with client.stream("GET", f"/api/live/executions/{eid}") as refused:
                        # a stream let in would never end: its status is enough, and says what the hub counted
                        assert refused.status_code == 429, (refused.status_code, hub.streams, dict(hub.per_session))
                        assert "max_live_streams_per_session" in (await refused.aread()).decode()
                        assert refused.headers["retry-after"]
            async with client.stream("GET", "/api/live/executions", params={"seconds": 1}) as short:
                sse = Sse(short)
                assert (await sse.next())[0] == "hello"
                event, data = await sse.next(timeout=5)
                assert event == "bye" and data["reason"] == "lifetime"
            assert (await client.get("/api/live/executions/a.b")).status_code == 422
            anonymous = await httpx.AsyncClient(base_url=stack.url, trust_env=False).get("/api/live/executions")
            assert anonymous.status_code == 401

    stack.run(go())


def test_a_stream_ends_at_once_when_its_session_or_token_is_revoked(stack):
    """A revocation ends the live streams of the session or token at once, with ``bye`` naming it: by
    the revocation notice, not by the token's check every 30 s (live.RECHECK, left as it is: each
    stream here must end well before it). A logout, a revoked API token, a disabled user."""
    from noetl_mesh.services.gateway import live

    assert live.RECHECK >= 30
    password = "a long enough password 1"
    gateway = stack.stack.services("gateway")[0]

    async def open_as(token: str):
        return httpx.AsyncClient(base_url=stack.url, headers={"Authorization": f"Bearer {token}"},
                                 trust_env=False, timeout=30)

    async def ends(client: httpx.AsyncClient, revoke) -> dict[str, Any]:
        """Open a stream, revoke, and read until the stream ends: its last event, which must come
        before a timeout far below RECHECK."""
        async with client.stream("GET", "/api/live/executions") as resp:
            sse = Sse(resp)
            assert (await sse.next())[0] == "hello"
            await revoke()
            event, data = await sse.next(timeout=5)
            with pytest.raises(StopAsyncIteration):  # and nothing after it: the response is over
                await sse.next(timeout=5)
            assert event == "bye", (event, data)
            return data

    async def go():
        async with http(stack) as admin:
            await admin.post("/api/users", json={"username": "viv", "password": password, "roles": ["viewer"]})
            login = lambda: admin.post("/api/auth/login", json={"username": "viv", "password": password})  # noqa: E731
            async with await open_as((await login()).json()["token"]) as viv:
                bye = await ends(viv, lambda: viv.post("/api/auth/logout"))
                assert (bye["reason"], bye["cause"]) == ("revoked", "logout") and "session was revoked" in bye["message"]

            async with await open_as((await login()).json()["token"]) as viv:
                made = (await viv.post("/api/tokens", json={"name": "live"})).json()
                async with await open_as(made["token"]) as api:
                    bye = await ends(api, lambda: viv.delete(f"/api/tokens/{made['token_id']}"))
                    assert (bye["reason"], bye["cause"]) == ("revoked", "revoked") and "API token" in bye["message"]

                user_id = (await viv.get("/api/auth/whoami")).json()["user_id"]
                bye = await ends(viv, lambda: admin.post(f"/api/users/{user_id}/disable"))
                assert (bye["reason"], bye["cause"]) == ("revoked", "user_disabled"), bye
        # each stream's end is counted once its response has closed: wait for it (a guard, not a race)
        state = gateway.app.state.live
        deadline = time.monotonic() + 30
        while (state.streams, state.holders) != (0, {}) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert state.streams == 0 and state.holders == {}

    stack.run(go())


def test_the_console_files_are_served_offline_with_a_strict_policy(stack):
    with httpx.Client(base_url=stack.url, trust_env=False) as client:  # no token: the files hold no data
        page = client.get("/ui/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY"
        for ref in ("app.js", "style.css", "vendor/dagre.esm.js"):
            assert ref in page.text
            assert client.get(f"/ui/{ref}").status_code == 200, ref
        assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
        root = client.get("/")  # the printed gateway URL, opened in a browser: the console
        assert root.status_code == 307 and root.headers["location"] == "/ui/"
        assert client.get("/", follow_redirects=True).text == page.text


def test_the_recorder_sends_notices_only_of_what_a_console_stream_watches(stack):
    """Nobody watches an execution: the recorder sends no notice of it (they were most of a busy
    recorder's work). A stream opened on another execution is announced to the recorder, which then
    sends that one's notices."""
    from noetl_mesh.infra.bus import Bus

    async def go():
        bus = await Bus.connect(stack.nats_url, "probe", stack.stack.settings.creds_for("admin"))
        heard: list[str] = []

        async def on(msg):
            heard.append(msg.subject.rsplit(".", 1)[-1])

        await bus.nc.subscribe("noetl.live.x.*", cb=on)
        try:
            recorder = stack.stack.services("event-recorder")[0]
            while time.monotonic() < recorder.interest.everything_until:  # a starting recorder sends everything
                await asyncio.sleep(0.1)
            async with http(stack) as client:
                quiet = await start(client, FORK_JOIN)
                await finished(client, quiet)
                await asyncio.sleep(0.3)
                assert quiet not in heard
                watched = await start(client, APPROVAL)  # waits for an approval: it stays running
                async with client.stream("GET", f"/api/live/executions/{watched}") as resp:
                    sse = Sse(resp)
                    assert (await sse.next())[0] == "hello"
                    # at once: recorded or not yet, the execution is cancelled
                    assert (await client.post(f"/api/executions/{watched}/cancel")).status_code == 202
                    await sse.until(lambda event, data: event == "state" and data.get("finished"), timeout=90)
                assert watched in heard and quiet not in heard
        finally:
            await bus.close()

    stack.run(go(), 200)  # two executions, a stream and a cancel: a guard against a hang (a timeout names every
    # waiting task of the loop, before pytest-timeout's 300 s would say only where the test thread waits)


def test_a_stream_learns_the_end_it_had_no_notice_of(stack):
    """Notices are at most once, and none comes of what was recorded before the recorders heard of a
    stream: a stream opened on an execution that has already ended (no notice will ever come) still
    gets its finished state, read after IDLE_REFRESH s without a notice."""

    async def go():
        async with http(stack) as client:
            eid = await start(client, FORK_JOIN)
            await finished(client, eid)
            async with client.stream("GET", f"/api/live/executions/{eid}") as resp:
                sse = Sse(resp)
                assert (await sse.next())[0] == "hello"
                seen = await sse.until(lambda event, data: event == "state" and data.get("finished"))
                assert not [event for event, _ in seen if event == "events"]  # no notice: the view came anyway

    stack.run(go(), 120)


def test_a_child_execution_is_listed_as_started_on_behalf_of_its_parents_starter(stack):
    """A child is started by its parent, on behalf of whoever started the parent: the list names that user
    (not a bare id) and the parent, for a grandchild too."""
    nested = (ROOT / "examples" / "nested.yaml").read_text()
    child = (ROOT / "examples" / "nested_child.yaml").read_text()

    async def go():
        async with stack.client() as client:
            await client.register(child)
            parent = await client.start(nested)
            status = await client.wait(parent, timeout=60)
            assert status["status"] == "COMPLETED", status
            rows = await client.list_executions(path="examples/nested_child")
            views = [(await client._call("GET", f"/api/executions/{r['execution_id']}/state")) for r in rows]
            return parent, rows, views

    parent, rows, views = stack.run(go())
    assert rows and all(r["parent_execution_id"] == parent for r in rows)
    assert {r["requested_by_name"] for r in rows} == {"admin"}
    assert all(v["requested_by"]["username"] == "admin" and v["parent_execution_id"] == parent for v in views)
