"""The task result limit (``limits.max_result_bytes``): a task whose result is bigger ends with error kind
``result_too_large`` (not retryable, routable by its policy), and each tool stops reading a result as
soon as it passes the limit: http (Content-Length, then the streamed body), python (the child's answer
on the pipe), duckdb (rows fetched in chunks). Postgres: tests/integration/test_worker_limits.py."""
from __future__ import annotations

import asyncio
import re
import tracemalloc
from typing import Any

import pytest

from noetl_mesh import limits
from noetl_mesh.core.pipeline import run_pipeline
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.duckdb import DuckdbTool
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools.http import HttpTool
from noetl_mesh.tools.python import PythonTool
from streams import MIB, StreamServer

pytestmark = pytest.mark.timeout(120)

LIMIT = 256 * 1024


def ctx(task: str = "big", timeout: Any = None) -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name=task, timeout=timeout)


def assert_too_large(out: dict, task: str = "big") -> None:
    assert out["status"] == "error", out.get("error")
    assert out["result"] is None
    err = out["error"]
    assert err["kind"] == "result_too_large" and err["retryable"] is False, err
    message = err["message"]
    for part in (f"task {task!r}", "max_result_bytes = 256 KiB", "NOETL_LIMIT_MAX_RESULT_BYTES"):
        assert part in message, message


# ========================================================================== the pipeline's own check


class Returns:
    """A tool that returns what the task's ``value`` says (no limit of its own)."""

    async def run(self, task, spec, ctx):
        return {"status": "ok", "result": task["value"], "extra": {"kept": True}}


def command(tasks: list[dict]) -> dict:
    return {"execution_id": "e1", "step": "s", "step_run_id": "r1", "iteration": None, "tasks": tasks,
            "spec_layers": {}, "workload": {}, "ctx": {}, "args": {}, "iter": None, "steps": {}, "keychain": {}}


def pipeline(tasks: list[dict], tools: dict | None = None):
    events: list[tuple[str, dict]] = []

    async def emit(name, fields):
        events.append((name, fields))

    with limits.override(max_result_bytes=LIMIT):
        result = asyncio.run(run_pipeline(command(tasks), tools or {"returns": Returns()}, emit))
    return result, [f["outcome"] for n, f in events if n == "task.processed"]


def test_a_result_over_the_limit_is_an_error_outcome_of_any_tool():
    big = {"rows": [{"id": i, "text": "x" * 1000} for i in range(400)]}  # ~400 KiB of JSON
    result, (out,) = pipeline([{"name": "big", "kind": "returns", "value": big}])
    assert_too_large(out)
    assert re.search(r"is \d+\.\d KiB", out["error"]["message"])  # its size (~400 KiB)
    assert out["extra"] == {"kept": True}  # the tool's own details stay
    assert result.status == "error" and result.error["kind"] == "result_too_large"


def test_the_limit_is_the_json_size_and_a_result_at_the_limit_passes():
    exact = "y" * (LIMIT - 2)  # a JSON string: two quotes more
    result, (a, b) = pipeline([{"name": "a", "kind": "returns", "value": exact},
                               {"name": "big", "kind": "returns", "value": exact + "y"}])
    assert a["status"] == "ok" and a["result"] == exact
    assert_too_large(b)
    escaped = "\n" * (LIMIT // 2)  # each character is two bytes of JSON
    _, (c,) = pipeline([{"name": "big", "kind": "returns", "value": escaped}])
    assert_too_large(c)


def test_noop_results_are_checked_too():
    _, (out,) = pipeline([{"name": "big", "kind": "noop", "result": "{{ 'z' * 300000 }}"}])
    assert_too_large(out)


def test_the_policy_routes_result_too_large_like_any_error():
    tasks = [
        {"name": "big", "kind": "returns", "value": "x" * (LIMIT + 1),
         "spec": {"policy": {"rules": [
             {"when": "{{ outcome.error.kind == 'result_too_large' }}",
              "then": {"do": "jump", "to": "small", "set_ctx": {"why": "{{ outcome.error.kind }}"}}},
             {"else": {"then": {"do": "continue"}}}]}}},
        {"name": "never", "kind": "returns", "value": 1},
        {"name": "small", "kind": "returns", "value": "a summary"},
    ]
    result, outs = pipeline(tasks)
    assert result.status == "ok" and result.result == "a summary"
    assert result.ctx_patch == {"why": "result_too_large"}
    assert [o["status"] for o in outs] == ["error", "ok"]


# ============================================================================================== http


@pytest.fixture(scope="module")
def streams():
    srv = StreamServer()
    yield srv.url
    srv.stop()


def http(url: str) -> tuple[dict, int]:
    """(outcome, peak bytes allocated by Python meanwhile)."""
    tool = HttpTool(trust_env=False, policy=Policy(allow=parse_destinations(url.split("/")[2])))  # D33: this server

    async def main():
        try:
            return await tool.run({"url": url}, {}, ctx())
        finally:
            await tool.close()

    tracemalloc.start()
    try:
        with limits.override(max_result_bytes=LIMIT):
            out = asyncio.run(main())
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_http_streamed_body_stops_at_the_limit(streams):
    out, peak = http(f"{streams}/stream/{300 * MIB}")
    assert_too_large(out)
    assert "more than 256 KiB" in out["error"]["message"]
    assert out["http"]["status"] == 200
    assert peak < 16 * MIB  # the 300 MiB were never held
    assert StreamServer.sent[f"/stream/{300 * MIB}"] < 100 * MIB


def test_http_content_length_over_the_limit_is_refused_before_reading(streams):
    out, peak = http(f"{streams}/announce/{300 * MIB}")
    assert_too_large(out)
    assert "is 300 MiB" in out["error"]["message"]
    assert peak < 16 * MIB
    assert StreamServer.sent.get(f"/announce/{300 * MIB}", 0) < 100 * MIB  # what the sockets buffered, at most


def test_http_body_under_the_limit_is_read_and_parsed(streams):
    out, _ = http(f"{streams}/json/{LIMIT - 1000}")
    assert out["status"] == "ok" and out["result"] == "j" * (LIMIT - 1000)
    out, _ = http(f"{streams}/stream/{LIMIT - 10}")
    assert out["status"] == "ok" and len(out["result"]) == LIMIT - 10


# ============================================================================================ python


def test_python_huge_result_is_refused_on_the_socket_and_the_next_task_runs():
    tool = PythonTool()

    async def main():
        try:
            with limits.override(max_result_bytes=LIMIT):
                tracemalloc.start()
                try:
                    big = await tool.run({"code": "result = ['x' * 1000] * 20000"}, {}, ctx())  # ~20 MB
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
                small = await tool.run({"code": "result = 'y' * 1000"}, {}, ctx("small"))
                edge = await tool.run({"code": f"result = 'z' * {LIMIT - 2}"}, {}, ctx("edge"))
            # under the default limit: an answer of several of the pipe reader's 1 MiB parts
            whole = await tool.run({"code": "result = ['ab' * 50] * 50000"}, {}, ctx("whole"))
            return big, peak, small, edge, whole
        finally:
            await tool.close()

    big, peak, small, edge, whole = asyncio.run(main())
    assert_too_large(big)
    assert peak < 16 * MIB  # the worker did not read the child's 20 MB answer
    assert small["status"] == "ok" and small["result"] == "y" * 1000
    assert edge["status"] == "ok" and len(edge["result"]) == LIMIT - 2
    assert whole["status"] == "ok" and whole["result"] == ["ab" * 50] * 50000


# ============================================================================================ duckdb


def test_duckdb_stops_fetching_rows_past_the_limit():
    tool = DuckdbTool()

    async def main():
        try:
            with limits.override(max_result_bytes=LIMIT):
                # 100 GB if it were all fetched: a tool that fetched on would outlast the test's timeout
                big = await tool.run({"command": "select repeat('x', 1000) as s from range(100000000)"}, {}, ctx())
                under = await tool.run({"command": "select repeat('x', 100) as s from range(1000)"}, {}, ctx("u"))
                dml = await tool.run({"command": "create table t as select range as i from range(100000);"
                                                 "insert into t select * from range(10) returning i"}, {}, ctx("d"))
            return big, under, dml
        finally:
            await tool.close()

    big, under, dml = asyncio.run(main())
    assert_too_large(big)
    assert "more than 256 KiB" in big["error"]["message"]
    assert under["status"] == "ok" and under["result"]["row_count"] == 1000
    assert dml["status"] == "ok" and dml["result"]["row_count"] == 10


class Circular:
    async def run(self, task, spec, ctx):
        value: list = []
        value.append(value)
        return {"status": "ok", "result": value}


def test_a_result_that_cannot_be_json_is_an_error_not_a_crash():
    _, (out,) = pipeline([{"name": "loop", "kind": "circular"}], {"circular": Circular()})
    assert out["status"] == "error" and out["error"]["kind"] == "tool_error"
    assert "deeper than 64 levels (the limit max_value_depth)" in out["error"]["message"]  # it has no end
    # the event log's JSON (orjson) holds integers of 64 bits: a bigger one is the task's error, at once,
    # not a report that cannot be sent (its command was redelivered until the step failed as worker_lost)
    for value in (10 ** 4000, 2 ** 64, -(2 ** 63) - 1, {"a": [2 ** 64]}):
        _, (big_int,) = pipeline([{"name": "n", "kind": "returns", "value": value}])
        assert big_int["status"] == "error" and big_int["error"]["kind"] == "tool_error", big_int
        assert "not JSON-serialisable" in big_int["error"]["message"] and "64-bit" in big_int["error"]["message"]
    for value in (2 ** 64 - 1, -(2 ** 63), {"a": [2 ** 63]}):
        _, (fits,) = pipeline([{"name": "n", "kind": "returns", "value": value}])
        assert fits["status"] == "ok" and fits["result"] == value


def nested(levels: int, leaf=1):
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def test_a_result_nested_deeper_than_max_value_depth_is_the_tasks_error():
    """Wrapped in the events' envelope (and a parent's view of a child's result) a value nested near
    the encoder's 254 levels could not be sent: its report was retried until the step failed as
    worker_lost, its task run again each time. It is refused where it is made, saying why."""
    _, (fits,) = pipeline([{"name": "n", "kind": "returns", "value": nested(64)}])
    assert fits["status"] == "ok" and fits["result"] == nested(64)
    for value in (nested(65), nested(250), {"rows": [1, 2, nested(64)]}):
        _, (deep,) = pipeline([{"name": "n", "kind": "returns", "value": value}])
        assert deep["status"] == "error" and deep["error"]["kind"] == "tool_error", deep
        assert "deeper than 64 levels (the limit max_value_depth)" in deep["error"]["message"]
    with limits.override(max_value_depth=100):
        _, (fits,) = pipeline([{"name": "n", "kind": "returns", "value": nested(100)}])
        assert fits["status"] == "ok"
