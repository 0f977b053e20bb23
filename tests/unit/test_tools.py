"""The real tools: python (child processes), duckdb (in memory and on a file), http (a loopback server
started here). Nothing leaves 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler

from noetl_mesh.testing.fixture_api import QuietHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from noetl_mesh.core.pipeline import run_pipeline
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools import close_tools, default_tools
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.duckdb import DuckdbTool, to_json_value
from noetl_mesh.tools.http import HttpTool
from noetl_mesh.tools.python import PythonTool

pytestmark = pytest.mark.timeout(60)


def ctx(timeout: Any = None, **kw: Any) -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name="t", timeout=timeout, **kw)


# ============================================================================================ python


def py_run(*calls: tuple[dict, dict]) -> tuple[list[dict], PythonTool]:
    """Run the calls in order on one PythonTool inside one event loop; returns the outcomes."""
    tool = PythonTool()

    async def main() -> list[dict]:
        try:
            return [await tool.run(task, spec, ctx(spec.get("timeout"))) for task, spec in calls]
        finally:
            await tool.close()

    return asyncio.run(main()), tool


def test_python_result_variable_and_args_bound():
    (out,), _ = py_run(({"kind": "python", "code": "result = {'sum': a + b, 'name': name}",
                         "args": {"a": 1, "b": 2, "name": "x"}}, {}))
    assert out["status"] == "ok"
    assert out["result"] == {"sum": 3, "name": "x"}
    assert out["error"] is None
    assert out["py"]["exception_type"] is None


def test_python_input_alias_and_no_result_is_none():
    (a, b), _ = py_run(({"code": "result = v * 2", "input": {"v": 21}}, {}), ({"code": "x = 1"}, {}))
    assert a["result"] == 42
    assert b["status"] == "ok" and b["result"] is None


def test_python_main_gets_matching_params_only():
    code = "def main(a, b=10):\n    return [a, b]\n"
    (out,), _ = py_run(({"code": code, "args": {"a": 1, "zzz": 3}}, {}))
    assert out["result"] == [1, 10]


def test_python_main_with_kwargs_gets_all_and_async_main_works():
    code = "def main(a, **rest):\n    return {'a': a, 'rest': rest}\n"
    code2 = "import asyncio\nasync def main(x):\n    await asyncio.sleep(0)\n    return x + 1\n"
    (a, b), _ = py_run(({"code": code, "args": {"a": 1, "b": 2, "c": 3}}, {}), ({"code": code2, "args": {"x": 1}}, {}))
    assert a["result"] == {"a": 1, "rest": {"b": 2, "c": 3}}
    assert b["result"] == 2


def test_python_exception_type_message_traceback():
    code = "def main():\n    raise ValueError('bad value')\n"
    (out,), _ = py_run(({"code": code}, {}))
    assert out["status"] == "error"
    assert out["error"]["kind"] == "python_error"
    assert out["error"]["message"] == "bad value"
    assert out["error"]["retryable"] is False
    assert out["py"]["exception_type"] == "ValueError"
    assert "ValueError: bad value" in out["error"]["traceback"]
    assert "python_runner" not in out["error"]["traceback"]
    assert "line 2, in main" in out["error"]["traceback"]


def test_python_custom_exception_bare_name_and_sys_exit():
    code = "class Oops(Exception):\n    pass\nraise Oops('x')\n"
    (a, b), _ = py_run(({"code": code}, {}), ({"code": "import sys; sys.exit(4)"}, {}))
    assert a["py"]["exception_type"] == "Oops"
    assert b["py"]["exception_type"] == "SystemExit"


def test_python_timeout_kills_the_process_and_the_next_task_runs():
    slow = {"code": "import time\ntime.sleep(30)\nresult = 1"}
    (a, b), tool = py_run((slow, {"timeout": 0.5}), ({"code": "import os; result = os.getpid()"}, {}))
    assert a["status"] == "error"
    assert a["error"]["kind"] == "timeout"
    assert a["error"]["retryable"] is True
    assert b["status"] == "ok"
    assert tool.sandbox.spawned == 2


def test_python_crash_os_exit_is_an_error_and_the_next_task_runs():
    (a, b, c), tool = py_run(
        ({"code": "import os; os._exit(3)"}, {}),
        ({"code": "import sys; sys.stderr.write('about to fall\\n'); sys.stderr.flush()\n"
                  "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"}, {}),
        ({"code": "result = 'alive'"}, {}),
    )
    assert a["status"] == "error" and a["error"]["kind"] == "python_crash"
    assert "code 3" in a["error"]["message"]
    assert b["status"] == "error" and "SIGSEGV" in b["error"]["message"]
    assert "about to fall" in b["error"]["message"]  # the end of its standard error comes with it
    assert c["result"] == "alive"


def test_python_task_cancellation_kills_its_process():
    tool = PythonTool()

    async def main():
        try:
            run = asyncio.ensure_future(tool.run({"code": "import time\ntime.sleep(30)"}, {}, ctx()))
            for _ in range(500):
                await asyncio.sleep(0.02)
                if tool.sandbox.running():
                    break
            (victim,) = tool.sandbox.running()
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            for _ in range(500):  # the fork server reaps it
                if not _alive(victim):
                    break
                await asyncio.sleep(0.02)
            after = await tool.run({"code": "import os; result = os.getpid()"}, {}, ctx())
            return victim, after
        finally:
            await tool.close()

    victim, after = asyncio.run(main())
    assert not _alive(victim)
    assert after["status"] == "ok" and after["result"] != victim


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not reaped yet is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_python_stdout_is_captured_and_cannot_corrupt_the_answer():
    code = (
        "import os, sys\n"
        "print('{not json')\n"
        "print('hello', file=sys.stdout)\n"
        "os.write(1, b'raw fd write\\n')\n"
        "sys.__stdout__.write('dunder\\n'); sys.__stdout__.flush()\n"
        "data = sys.stdin.read()\n"
        "result = {'stdin': data}\n"
    )
    (a, b), _ = py_run(({"code": code}, {}), ({"code": "print('x' * 100000); result = 5"}, {}))
    assert a["status"] == "ok"
    assert a["result"] == {"stdin": ""}
    assert a["py"]["stdout"] == "{not json\nhello\n"
    assert b["result"] == 5
    assert len(b["py"]["stdout"]) == 64 * 1024
    assert b["py"]["stdout_truncated"] is True


def test_python_non_json_result_is_an_error():
    (a, b), _ = py_run(({"code": "result = object()"}, {}), ({"code": "result = float('nan')"}, {}))
    assert a["status"] == "error"
    assert a["error"]["kind"] == "python_error"
    assert "not JSON-serialisable" in a["error"]["message"]
    assert b["error"]["kind"] == "python_error"


def test_python_each_task_has_a_process_of_its_own():
    pid = {"code": "import os; result = os.getpid()"}
    outs, tool = py_run((pid, {}), (pid, {}), (pid, {}))
    pids = [o["result"] for o in outs]
    assert len(set(pids)) == 3
    assert [o["py"]["pid"] for o in outs] == pids


def test_python_state_does_not_leak_between_tasks():
    (a, b, c), _ = py_run(({"code": "secret = 1\nresult = 1"}, {}),
                          ({"code": "import json\njson.dumps = None\nimport builtins\nbuiltins.leak = 7"}, {}),
                          ({"code": "import json, builtins\nresult = [json.dumps(1), hasattr(builtins, 'leak'), "
                                    "'secret' in globals()]"}, {}))
    assert c["result"] == ["1", False, False]


def test_python_tasks_run_at_once():
    tool = PythonTool()
    # each task records when it started and ended; two tasks overlap when each starts before the other ends
    code = "import time\nstart = time.time()\ntime.sleep(0.4)\nresult = [start, time.time()]"

    async def main():
        try:
            return await asyncio.gather(tool.run({"code": code}, {}, ctx()), tool.run({"code": code}, {}, ctx()))
        finally:
            await tool.close()

    a, b = asyncio.run(main())
    (a0, a1), (b0, b1) = a["result"], b["result"]
    assert a0 < b1 and b0 < a1
    assert a["py"]["pid"] != b["py"]["pid"]


def test_python_bad_args_and_missing_code():
    (a, b), _ = py_run(({"code": "result = 1", "args": [1, 2]}, {}), ({"args": {}}, {}))
    assert a["error"]["kind"] == "python_error" and "mapping" in a["error"]["message"]
    assert b["error"]["kind"] == "python_error"


# ============================================================================================ duckdb


def duck(task: dict, spec: dict | None = None, tool: DuckdbTool | None = None) -> dict:
    own = tool is None
    tool = tool or DuckdbTool()

    async def main():
        try:
            return await tool.run(task, spec or {}, ctx((spec or {}).get("timeout")))
        finally:
            if own:
                await tool.close()

    return asyncio.run(main())


def test_duckdb_multi_statement_last_result():
    out = duck({"command": "create table t(a int, b varchar); insert into t values (1, 'x'), (2, 'y');\n"
                           "select a, b from t order by a"})
    assert out["status"] == "ok"
    assert out["result"] == {"rows": [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}], "columns": ["a", "b"], "row_count": 2}


def test_duckdb_semicolons_in_strings_and_comments_are_not_split():
    out = duck({"query": "select 'a;b' as s; -- trailing; comment\n"})
    assert out["result"]["rows"] == [{"s": "a;b"}]


def test_duckdb_positional_params_bound_not_formatted():
    evil = "x'); drop table t; --"
    out = duck({"command": "create table t(a int, s varchar); insert into t values (?, ?); select * from t",
                "params": [1, evil]})
    assert out["result"]["rows"] == [{"a": 1, "s": evil}]
    out = duck({"command": "select $1 + $2 as s", "params": [2, 3]})
    assert out["result"]["rows"] == [{"s": 5}]


def test_duckdb_named_params_bound_to_each_statement_that_declares_them():
    out = duck({"command": "create table t(a int); insert into t values ($x), ($y); select sum(a) as s, $x as x from t",
                "params": {"x": 4, "y": 5}})
    assert out["result"]["rows"] == [{"s": 9, "x": 4}]


def test_duckdb_dml_row_count_and_ddl():
    out = duck({"command": "create table t(a int); insert into t select * from range(5); "
                           "update t set a = a + 10 where a >= 2"})
    assert out["result"] == {"rows": [], "columns": [], "row_count": 3}
    out = duck({"command": "create table t(a int); insert into t select * from range(4); delete from t where a < 3"})
    assert out["result"]["row_count"] == 3
    out = duck({"command": "create table t(a int)"})
    assert out["result"] == {"rows": [], "columns": [], "row_count": 0}
    out = duck({"command": "create table t(a int); insert into t values (1), (2) returning a"})
    assert out["result"]["rows"] == [{"a": 1}, {"a": 2}]


def test_duckdb_value_conversion():
    out = duck({"command": (
        "select date '2024-01-02' as d, timestamp '2024-01-02 03:04:05.5' as ts, "
        "timestamptz '2024-01-02 03:04:05+02' as tz, time '01:02:03' as t, "
        "3.50::decimal(10,2) as dec, 7::decimal(10,0) as dint, "
        "'f5638683-aacd-4752-9350-d544c8995d60'::uuid as u, 'ab'::blob as b, "
        "interval 1 day + interval 3 hour as i, [date '2024-01-01'] as l, {'k': 1.5::decimal(4,1)} as st, "
        "[timestamptz '2024-01-01 00:00:00+00'] as ltz, null as n"
    )})
    row = out["result"]["rows"][0]
    assert row["d"] == "2024-01-02"
    assert row["ts"] == "2024-01-02T03:04:05.500000"
    assert row["tz"] == "2024-01-02T01:04:05+00:00"
    assert row["t"] == "01:02:03"
    assert row["dec"] == 3.5 and isinstance(row["dec"], float)
    assert row["dint"] == 7 and isinstance(row["dint"], int)
    assert row["u"] == "f5638683-aacd-4752-9350-d544c8995d60"
    assert row["b"] == "YWI="
    assert row["i"] == "P1DT3H"
    assert row["l"] == ["2024-01-01"]
    assert row["st"] == {"k": 1.5}
    assert row["ltz"] and row["ltz"][0].startswith("2024-01-01")
    assert row["n"] is None
    json.dumps(out["result"])
    assert to_json_value({1: b"\x00"}) == {"1": "AA=="}
    out = duck({"command": "select 'nan'::double as n, '-inf'::float as i, 1.5::double as f"})
    assert out["result"]["rows"] == [{"n": None, "i": None, "f": 1.5}]


def test_duckdb_empty_select_has_columns():
    out = duck({"command": "select 1 as a where false"})
    assert out["result"] == {"rows": [], "columns": ["a"], "row_count": 0}


def test_duckdb_errors():
    out = duck({"command": "selec 1"})
    assert out["status"] == "error"
    assert out["error"]["kind"] == "duckdb_error"
    assert out["error"]["retryable"] is False
    assert "syntax error" in out["error"]["message"]
    out = duck({"command": "select * from missing_table"})
    assert out["error"]["kind"] == "duckdb_error" and "missing_table" in out["error"]["message"]
    assert duck({"command": "select 1", "params": [1]})["error"]["kind"] == "duckdb_error"


def test_duckdb_in_memory_is_fresh_per_task_and_file_persists(tmp_path):
    from noetl_mesh.sandbox.policy import Policy
    from noetl_mesh.sandbox.supervisor import Supervisor

    tool = DuckdbTool(Supervisor(Policy(data_dirs=(str(tmp_path),))))

    async def main():
        try:
            a = await tool.run({"command": "create table t(a int)"}, {}, ctx())
            b = await tool.run({"command": "select count(*) as n from t"}, {}, ctx())
            path = str(tmp_path / "x.duckdb")
            c = await tool.run({"command": "create table t(a int); insert into t values (1), (2)", "db_path": path},
                               {}, ctx())
            d = await tool.run({"command": "select count(*) as n from t", "db_path": path}, {}, ctx())
            return a, b, c, d
        finally:
            await tool.close()
            await tool.sandbox.close()

    a, b, c, d = asyncio.run(main())
    assert a["status"] == "ok"
    assert b["status"] == "error"  # a new in-memory database does not have t
    assert c["result"]["row_count"] == 2
    assert d["result"]["rows"] == [{"n": 2}]


def test_duckdb_timeout_kills_the_query():
    out = duck({"command": "select sum(a.range * b.range) from range(100000) a, range(1000000) b"}, {"timeout": 0.3})
    assert out["status"] == "error"
    assert out["error"]["kind"] == "timeout"
    assert out["error"]["retryable"] is True


# ============================================================================================== http


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any, ctype: str = "application/json", extra: dict | None = None) -> None:
        data = body if isinstance(body, bytes) else (json.dumps(body) if ctype.endswith("json") else str(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Test", "yes")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _echo(self) -> dict:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode() if length else ""
        return {
            "method": self.command,
            "path": parts.path,
            "query": {k: v if len(v) > 1 else v[0] for k, v in parse_qs(parts.query).items()},
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": raw,
        }

    def do_GET(self) -> None:  # noqa: N802
        path = urlsplit(self.path).path
        if path == "/json":
            self._send(200, {"hello": "world", "echo": self._echo()})
        elif path == "/text":
            self._send(200, "plain text", "text/plain; charset=utf-8")
        elif path == "/login":
            self._send(200, {"ok": True}, extra={"Set-Cookie": "session=VICTIM-SESSION; Path=/"})
        elif path == "/problem":
            self._send(404, {"title": "not here"}, "application/problem+json")
        elif path.startswith("/status/"):
            code = int(path.rsplit("/", 1)[1])
            self._send(code, f"status {code}", "text/plain")
        elif path == "/slow":
            time.sleep(1.5)
            self._send(200, "late", "text/plain")
        elif path == "/trickle":  # an answer of 100 bytes, one every 0.1 s: no single read waits long
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:  # the client went away
                pass
        elif path == "/redirect":
            self._send(302, "", "text/plain", {"Location": "/text"})
        else:
            self._send(404, {"error": "no route"})

    def do_POST(self) -> None:  # noqa: N802
        self._send(201, self._echo())

    do_PUT = do_POST
    do_DELETE = do_GET


@pytest.fixture(scope="module")
def server():
    srv = QuietHTTPServer(("127.0.0.1", 0), _Handler)  # clients that time out on purpose hang up
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def opened_to(*urls: str) -> Policy:
    """D33: a pool that opens exactly the host:port of each URL (the loopback servers of these tests)."""
    return Policy(allow=parse_destinations(",".join(urlsplit(u).netloc for u in urls if "://" in u)))


def http(*tasks: dict, spec: dict | None = None, keychain: dict | None = None) -> list[dict]:
    tool = HttpTool(trust_env=False, policy=opened_to(*(str(t.get("url") or t.get("endpoint")) for t in tasks)))

    async def main():
        try:
            return [await tool.run(task, spec or {}, ctx((spec or {}).get("timeout"), keychain=keychain or {}))
                    for task in tasks]
        finally:
            await tool.close()

    return asyncio.run(main())


def test_http_get_json_params_and_helpers(server):
    (out,) = http({"url": f"{server}/json", "params": {"a": 1, "b": True, "skip": None, "l": [1, 2]}})
    assert out["status"] == "ok"
    assert out["result"]["hello"] == "world"
    assert out["result"]["echo"]["query"] == {"a": "1", "b": "true", "l": ["1", "2"]}
    assert out["http"]["status"] == 200
    assert out["http"]["headers"]["x-test"] == "yes"
    assert out["http"]["headers"]["content-type"] == "application/json"


def test_http_text_body_and_endpoint_alias(server):
    (out,) = http({"endpoint": f"{server}/text"})
    assert out["result"] == "plain text"
    assert out["error"] is None


def test_http_404_is_error_not_retryable_with_body(server):
    a, b = http({"url": f"{server}/problem"}, {"url": f"{server}/status/404"})
    assert a["status"] == "error"
    assert a["error"]["kind"] == "http_error" and a["error"]["retryable"] is False
    assert a["result"] == {"title": "not here"}  # +json parsed
    assert a["http"]["status"] == 404
    assert b["result"] == "status 404"


@pytest.mark.parametrize("code,retryable", [(503, True), (500, True), (429, True), (408, True), (400, False)])
def test_http_retryable_statuses(server, code, retryable):
    (out,) = http({"url": f"{server}/status/{code}"})
    assert out["error"]["kind"] == "http_error"
    assert out["error"]["retryable"] is retryable
    assert out["http"]["status"] == code


def test_http_post_json_headers_and_body(server):
    a, b, c = http(
        {"method": "post", "url": f"{server}/echo", "json": {"x": [1, 2]}, "headers": {"X-Token": "abc", "X-N": 5}},
        {"method": "PUT", "url": f"{server}/echo", "body": "raw text", "headers": {"Content-Type": "text/plain"}},
        {"method": "POST", "url": f"{server}/echo", "data": {"f": "v", "n": 2}},
    )
    assert a["http"]["status"] == 201 and a["status"] == "ok"
    assert a["result"]["method"] == "POST"
    assert json.loads(a["result"]["body"]) == {"x": [1, 2]}
    assert a["result"]["headers"]["x-token"] == "abc"
    assert a["result"]["headers"]["x-n"] == "5"
    assert a["result"]["headers"]["content-type"] == "application/json"
    assert b["result"]["body"] == "raw text" and b["result"]["method"] == "PUT"
    assert c["result"]["body"] == "f=v&n=2"


def test_http_auth_bearer_basic_list_and_keychain(server):
    outs = http(
        {"url": f"{server}/json", "auth": {"type": "bearer", "token": "tok"}},
        {"url": f"{server}/json", "auth": {"type": "basic", "username": "u", "password": "p"}},
        {"url": f"{server}/json", "auth": ["u", "p"]},
        {"url": f"{server}/json", "auth": "api"},
        {"url": f"{server}/json", "auth": "missing"},
        keychain={"api": {"name": "api", "kind": "static", "token": "kc"}},
    )
    hdr = [o["result"]["echo"]["headers"].get("authorization") for o in outs[:4]]
    assert hdr == ["Bearer tok", "Basic dTpw", "Basic dTpw", "Bearer kc"]
    assert outs[4]["error"]["kind"] == "invalid_task"


def test_http_timeout_field_wins_over_spec(server):
    # /slow answers after 1.5 s: under the spec's 30 s it would succeed; the field's 0.2 s stops it
    a, b = http({"url": f"{server}/slow", "timeout": 0.2}, {"url": f"{server}/slow", "timeout": {"read": 0.2}},
                spec={"timeout": 30})
    for out in (a, b):
        assert out["status"] == "error"
        assert out["error"]["kind"] == "timeout"
        assert out["error"]["retryable"] is True
        assert out["http"]["status"] is None


def test_http_spec_timeout_applies(server):
    (out,) = http({"url": f"{server}/slow"}, spec={"timeout": 0.2})
    assert out["error"]["kind"] == "timeout"


def test_a_server_that_trickles_its_answer_holds_an_http_task_no_longer_than_task_max_seconds(server):
    """``timeout`` bounds each operation; the whole request, at most task_max_seconds (D33: no task
    holds a worker's slot for good), whatever its timeout says (none, here)."""
    from noetl_mesh import limits

    with limits.override(task_max_seconds=1):
        (out,) = http({"url": f"{server}/trickle", "timeout": 0})
    assert out["error"]["kind"] == "timeout" and out["error"]["retryable"] is True, out
    assert "not answered in full within 1s (task_max_seconds" in out["error"]["message"], out


def test_http_connect_error_to_closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    (out,) = http({"url": f"http://127.0.0.1:{port}/x"})
    assert out["status"] == "error"
    assert out["error"]["kind"] == "http_connect_error"
    assert out["error"]["retryable"] is True
    assert out["http"]["status"] is None


def test_http_follows_redirects_and_rejects_bad_url(server):
    a, b = http({"url": f"{server}/redirect"}, {"url": "notascheme://x"})
    assert a["result"] == "plain text"
    assert b["error"]["kind"] == "invalid_task"


# ===================================================================== the pipeline with real tools


def test_pipeline_with_default_tools(server):
    tools = default_tools(http_trust_env=False, policy=opened_to(server))
    cmd = {
        "execution_id": "e1", "step": "s", "step_run_id": "r1", "iteration": None,
        "tasks": [
            {"name": "fetch", "kind": "http", "url": "{{ workload.base }}/json", "params": {"n": "{{ workload.n }}"}},
            {"name": "calc", "kind": "python", "code": "def main(n, hello):\n    return {'n': int(n) * 2, 'h': hello}",
             "args": {"n": "{{ fetch.result.echo.query.n }}", "hello": "{{ fetch.data.hello }}"}},
            {"name": "store", "kind": "duckdb",
             "command": "create table r(n int, h varchar); insert into r values ($n, $h); select * from r",
             "params": {"n": "{{ calc.result.n }}", "h": "{{ _prev.h }}"}},
            {"name": "pass", "kind": "noop"},
        ],
        "spec_layers": {"executor": None, "step": None, "loop": None},
        "workload": {"base": server, "n": 21}, "ctx": {}, "args": {}, "iter": None, "steps": {}, "keychain": {},
        "loop_mode": None,
    }

    async def main():
        events = []

        async def emit(name, fields):
            events.append(name)

        try:
            return await run_pipeline(cmd, tools, emit), events
        finally:
            await close_tools(tools)

    res, events = asyncio.run(main())
    assert res.status == "ok", res.error
    assert res.result == {"rows": [{"n": 42, "h": "world"}], "columns": ["n", "h"], "row_count": 1}
    assert events.count("task.processed") == 4


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """The same handler over TLS, with a self-signed certificate no trust store knows."""
    import datetime
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    srv = QuietHTTPServer(("127.0.0.1", 0), _Handler)
    srv.socket = context.wrap_socket(srv.socket, server_side=True)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"https://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_http_verify_false_skips_the_certificate_check_for_that_task_only(tls_server):
    checked, unchecked, checked_again, bad = http({"url": f"{tls_server}/text"},
                                                  {"url": f"{tls_server}/text", "verify": False},
                                                  {"url": f"{tls_server}/text", "verify": "true"},
                                                  {"url": f"{tls_server}/text", "verify": "no"})
    assert checked["status"] == "error" and "CERTIFICATE_VERIFY_FAILED" in checked["error"]["message"]
    assert unchecked["status"] == "ok" and unchecked["result"] == "plain text"
    assert checked_again["status"] == "error"  # the unchecked client is not the shared one
    assert bad["error"]["kind"] == "invalid_task" and "'verify' is true or false" in bad["error"]["message"]


def test_http_follow_redirects_false_returns_the_redirect(server):
    followed, kept = http({"url": f"{server}/redirect"}, {"url": f"{server}/redirect", "follow_redirects": False})
    assert followed["result"] == "plain text" and followed["http"]["status"] == 200
    assert kept["status"] == "ok" and kept["http"]["status"] == 302 and kept["http"]["headers"]["location"] == "/text"


def test_http_keeps_no_cookie_between_tasks(server):
    """One client serves every execution: a session cookie one task's server set never goes along with
    another task's request; a task that needs a cookie sends the header itself."""
    login, other, own = http({"url": f"{server}/login"}, {"url": f"{server}/json"},
                             {"url": f"{server}/json", "headers": {"Cookie": "mine=1"}})
    assert login["status"] == "ok" and login["http"]["headers"].get("set-cookie")
    assert "cookie" not in other["result"]["echo"]["headers"]
    assert own["result"]["echo"]["headers"]["cookie"] == "mine=1"
