"""The worker against real servers: the task result limit (``max_result_bytes``) in the postgres tool
and in a whole stack offered a 300 MB http body, and secret masking (D24) of an http URL query string
in events and in every log record."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from urllib.parse import quote, quote_plus

import pytest

from noetl_mesh import limits
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.postgres import PostgresTool
from conftest import pg_endpoint
from streams import MIB, StreamServer

pytestmark = pytest.mark.integration

LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def streams():
    srv = StreamServer()
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def allow_net(streams) -> str:
    """The module's stack's tasks call the stream server: its endpoint alone is opened (D33)."""
    return streams.split("//", 1)[1]


# ========================================================================================== postgres


def pg(*tasks: dict) -> tuple[list[dict], list[float]]:
    """Run the tasks in order on one tool (one pool) under LIMIT; (outcomes, seconds each)."""

    async def go():
        tool = PostgresTool(policy=Policy(allow=parse_destinations(pg_endpoint(tasks[0]["dsn"]))))  # D33: it alone
        outs, times = [], []
        try:
            with limits.override(max_result_bytes=LIMIT):
                for task in tasks:
                    t0 = time.perf_counter()
                    outs.append(await tool.run(task, {}, ToolContext("e1", "s", task.get("name", "big"))))
                    times.append(time.perf_counter() - t0)
            return outs, times
        finally:
            await tool.close()

    return asyncio.run(go())


def assert_too_large(out: dict, task: str = "big") -> None:
    assert out["status"] == "error" and out["result"] is None, out.get("error")
    err = out["error"]
    assert err["kind"] == "result_too_large" and err["retryable"] is False
    for part in (f"task {task!r}", "max_result_bytes = 256 KiB", "NOETL_LIMIT_MAX_RESULT_BYTES"):
        assert part in err["message"], err["message"]


def test_postgres_stops_fetching_rows_past_the_limit(pg_dsn):
    huge = "select repeat('x', 1000) as s from generate_series(1, 10000000)"  # 10 GB if it were sent
    (setup, big, multi, returning, after, empty), seconds = pg(
        {"dsn": pg_dsn, "command": "create table t (s text); insert into t select repeat('y', 1000) "
                                   "from generate_series(1, 2000)", "name": "setup"},
        {"dsn": pg_dsn, "command": huge},
        {"dsn": pg_dsn, "command": "select 1; select * from t"},
        {"dsn": pg_dsn, "command": "insert into t select repeat('z', 1000) from generate_series(1, 1000) "
                                   "returning s"},
        {"dsn": pg_dsn, "command": "select count(*) as n from t where s like %s", "params": ["z%"], "name": "n"},
        {"dsn": pg_dsn, "command": "select 1 as a, 'b' as b where false", "name": "e"},
    )
    assert setup["status"] == "ok", setup
    assert_too_large(big)
    assert "more than 256 KiB" in big["error"]["message"]
    assert seconds[1] < 60  # the server was stopped, not read to the end
    assert_too_large(multi)  # the last statement of several, read through a cursor
    assert_too_large(returning)  # not a plain query: fetched in chunks from what libpq received
    # the failed insert rolled back, and the pool's connections still work
    assert after["status"] == "ok" and after["result"]["rows"] == [{"n": 0}], after
    assert empty["result"] == {"rows": [], "columns": ["a", "b"], "row_count": 0}


def test_postgres_results_under_the_limit_are_whole(pg_dsn):
    (rows, multi), _ = pg(
        {"dsn": pg_dsn, "command": "select g as i, repeat('w', 100) as s from generate_series(1, 2000) g",
         "name": "r"},
        {"dsn": pg_dsn, "command": "create table u (i int); insert into u values (1), (2); "
                                   "select i from u order by i", "name": "m"},
    )
    assert rows["status"] == "ok" and rows["result"]["row_count"] == 2000
    assert rows["result"]["rows"][-1] == {"i": 2000, "s": "w" * 100}
    assert multi["result"] == {"rows": [{"i": 1}, {"i": 2}], "columns": ["i"], "row_count": 2}


# ====================================================================================== whole stack


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """The highest resident size of this process (the whole stack runs in it) while in the block."""

    def __enter__(self) -> "PeakRss":
        self.start = self.peak = _rss_mib()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, _rss_mib())

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    @property
    def growth(self) -> float:
        return self.peak - self.start


SMALL = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: small, path: t/limits/small}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'n': 1}"}
"""

HUGE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: huge, path: t/limits/huge}
workflow:
  - step: start
    tool: {name: fetch, kind: http, url: "{{ workload.url }}", timeout: 120}
"""


def test_a_300_mb_http_body_fails_its_task_alone(stack, streams):
    """The reproduction: a task offered a 300 MB body (the default limit is 32 MiB)."""
    stack.execute(SMALL, timeout=60)  # warm: python children, connections
    with PeakRss() as rss:
        t0 = time.perf_counter()
        status, events = stack.execute(HUGE, {"url": f"{streams}/stream/{300 * MIB}"}, timeout=120)
        seconds = time.perf_counter() - t0
    assert status["status"] == "FAILED", status
    outcome = next(e for e in events if e["name"] == "task.processed")["data"]["outcome"]
    assert outcome["error"]["kind"] == "result_too_large" and outcome["error"]["retryable"] is False
    assert "max_result_bytes = 32 MiB" in outcome["error"]["message"]
    assert "'fetch'" in outcome["error"]["message"]
    assert rss.growth < 200, f"the stack grew by {rss.growth:.0f} MiB"  # 300 MB never held
    assert StreamServer.sent[f"/stream/{300 * MIB}"] < 200 * MIB
    # every other execution keeps going
    after, _ = stack.execute(SMALL, timeout=60)
    assert after["status"] == "COMPLETED" and after["steps"]["start"]["result"] == {"n": 1}


FORGE = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: forge, path: t/limits/forge}
workflow:
  - step: start
    tool: {kind: python, code: 'result = {"big": "A" * 300000}'}
    next: {arcs: [{step: forge}]}
  - step: forge
    tool:
      kind: python
      code: |
        import hashlib
        body = ('"' + "A" * 300000 + '"').encode()
        key = hashlib.sha256(body).hexdigest()
        result = {"refs": [{"store": "nats-object:noetl_payloads", "key": key, "size": len(body),
                            "checksum": "sha256:" + key}] * 2000}
"""


def test_a_task_cannot_make_the_engine_copy_a_stored_value_by_returning_references_to_it(stack):
    """The first step's 300 KB result is stored in the object store (D23); the second returns 2,000
    references to it, computed from its content (300 KB of JSON): before, every service fetched and
    copied it (a 600 MB step result, a worker at 1 GB, the execution stuck). Now the task fails, alone."""
    status, events = stack.execute(FORGE, timeout=120)
    assert status["status"] == "FAILED", status
    forge = next(e for e in events if e["name"] == "task.processed" and e["step"] == "forge")["data"]["outcome"]
    assert forge["status"] == "error" and forge["result"] is None and forge["error"]["kind"] == "tool_error"
    assert "its result.refs[1999]" in forge["error"]["message"] and "only the engine writes (D23)" in forge["error"]["message"]
    assert len(json.dumps(events)) < 2 * MIB  # nothing was expanded: the log holds the first result once, at most
    after, _ = stack.execute(SMALL, timeout=60)
    assert after["status"] == "COMPLETED"


SECRET = "tok/3n+s3cr3t é&x"

LEAK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: leak, path: t/limits/leak}
keychain:
  - {name: api, kind: env, var: LEAK_TEST_URL_SECRET}
workflow:
  - step: start
    tool:
      - {name: in_url, kind: http, url: "{{ workload.base }}/echo?token={{ keychain.api.value }}"}
      - {name: in_params, kind: http, url: "{{ workload.base }}/echo", params: {token: "{{ keychain.api.value }}"}}
      - {name: failing, kind: http, url: "{{ workload.base }}/missing?token={{ keychain.api.value }}"}
"""


def test_a_secret_in_an_http_url_query_string_reaches_neither_events_nor_logs(stack, streams, monkeypatch, caplog):
    monkeypatch.setenv("LEAK_TEST_URL_SECRET", SECRET)
    monkeypatch.setenv("NOETL_KEYCHAIN_ENV", "LEAK_TEST_URL_SECRET")  # the worker pool exposes it (D24)
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)  # however verbose an operator makes them
    status, events = stack.execute(LEAK, {"base": streams}, timeout=60)
    assert status["status"] == "FAILED"  # the last task's 404
    outcomes = {e["task"]: e["data"]["outcome"] for e in events if e["name"] == "task.processed"}
    assert outcomes["in_url"]["result"] == {"url": "/echo?token=***"}  # the task did send the secret
    assert outcomes["in_params"]["result"] == {"url": "/echo?token=***"}
    assert "***" in outcomes["failing"]["error"]["message"]
    assert any(r.name == "httpx" for r in caplog.records)  # the request lines were logged, masked
    forms = [SECRET, quote(SECRET, safe=""), quote(SECRET), quote_plus(SECRET),
             base64.b64encode(SECRET.encode()).decode(), base64.urlsafe_b64encode(SECRET.encode()).decode(),
             json.dumps(SECRET)[1:-1]]
    published = json.dumps(events, ensure_ascii=False) + json.dumps(status, ensure_ascii=False)
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    for form in forms:
        assert form not in published, form
        assert form not in logged, form
