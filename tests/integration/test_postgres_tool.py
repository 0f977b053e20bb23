"""The ``postgres`` tool (D8, D24, D27) against a real Postgres database, directly and through the
in-process reference engine (retry and jump policies on ``outcome.pg.code``)."""
from __future__ import annotations

import asyncio
import base64
import sys

import pytest
from psycopg.conninfo import conninfo_to_dict

from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.sandbox.policy import Policy, parse_destinations
from noetl_mesh.tools import close_tools, default_tools
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.postgres import PostgresTool, split_statements

from conftest import pg_endpoint

pytestmark = pytest.mark.integration

INJECTION = "x'); drop table t; --"


def ctx(**kw) -> ToolContext:
    return ToolContext(execution_id="e1", step="s", task_name="t", **kw)


@pytest.fixture(autouse=True)
def _open(pg_server, monkeypatch) -> None:
    """D33: these tools may reach the session's Postgres (on loopback), nothing else."""
    monkeypatch.setattr(sys.modules[__name__], "OPEN", opened_to(pg_endpoint(pg_server.dsn())))


def opened_to(*endpoints: str) -> Policy:
    return Policy(allow=parse_destinations(",".join(endpoints)))


OPEN = Policy()  # set by _open for each test


def run_tasks(*tasks, keychain=None, policy=None, **ctx_kw) -> list[dict]:
    """Run tasks in order on one tool instance (under ``policy``, default OPEN); their outcomes."""

    async def go():
        tool = PostgresTool(policy=policy or OPEN)
        try:
            return [await tool.run(task, {}, ctx(keychain=keychain or {}, **ctx_kw)) for task in tasks]
        finally:
            await tool.close()

    return asyncio.run(go())


def test_positional_and_named_params_are_bound_not_formatted(pg_dsn):
    create, ins1, ins2, sel, count = run_tasks(
        {"dsn": pg_dsn, "command": "create table t (id int primary key, name text)"},
        {"dsn": pg_dsn, "command": "insert into t values (%s, %s)", "params": [1, INJECTION]},
        {"dsn": pg_dsn, "query": "insert into t values (%(id)s, %(name)s)", "params": {"id": 2, "name": "bob", "extra": 1}},
        {"dsn": pg_dsn, "command": "select id, name from t where id >= %s order by id", "params": [1]},
        {"dsn": pg_dsn, "command": "select count(*) as n from t where name = %(n)s", "params": {"n": INJECTION}},
    )
    assert create == {"status": "ok", "result": {"rows": [], "columns": [], "row_count": 0}, "error": None}
    assert ins1["result"]["row_count"] == 1 and ins2["result"]["row_count"] == 1
    assert sel["result"] == {"rows": [{"id": 1, "name": INJECTION}, {"id": 2, "name": "bob"}],
                             "columns": ["id", "name"], "row_count": 2}
    assert count["result"]["rows"] == [{"n": 1}]


def test_multi_statement_returns_last_result_and_dml_row_count(pg_dsn):
    multi, dml, with_params = run_tasks(
        {"dsn": pg_dsn, "command": """
            create table t (id int, note text);  -- a comment; with a semicolon
            insert into t select g, 'a;b' from generate_series(1, 5) g;
            DO $body$ BEGIN PERFORM 1; END $body$;
            select count(*) as n, min(note) as note from t;
        """},
        {"dsn": pg_dsn, "command": "update t set note = 'x' where id > 2"},
        {"dsn": pg_dsn, "command": "delete from t where id = %s; insert into t values (%s, 'y'), (%s, 'z');"
                                   " select id from t where note <> 'x' order by id",
         "params": [1, 10, 11]},
    )
    assert multi["status"] == "ok", multi
    assert multi["result"] == {"rows": [{"n": 5, "note": "a;b"}], "columns": ["n", "note"], "row_count": 1}
    assert dml["result"] == {"rows": [], "columns": [], "row_count": 3}
    assert with_params["status"] == "ok", with_params
    assert with_params["result"]["rows"] == [{"id": 2}, {"id": 10}, {"id": 11}]


def test_statements_run_in_one_transaction(pg_dsn):
    _, failed, check = run_tasks(
        {"dsn": pg_dsn, "command": "create table t (id int primary key)"},
        {"dsn": pg_dsn, "command": "insert into t values (1); insert into t values (1)"},
        {"dsn": pg_dsn, "command": "select count(*) as n from t"},
    )
    assert failed["status"] == "error" and failed["pg"]["code"] == "23505"
    assert "duplicate key" in failed["error"]["message"] and "DETAIL" in failed["error"]["message"]
    assert check["result"]["rows"] == [{"n": 0}]  # rolled back


def test_value_types(pg_dsn):
    (out,) = run_tasks({"dsn": pg_dsn, "command": """
        select date '2024-02-29' as d,
               timestamptz '2024-01-02 03:04:05.5+00' as ts,
               numeric '12.50' as dec, numeric '42' as whole,
               'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid as u,
               '{"a": [1, 2, null], "b": {"c": true}}'::jsonb as j,
               '\\x0102ff'::bytea as b,
               null::text as nothing"""})
    assert out["status"] == "ok", out
    row = out["result"]["rows"][0]
    assert row["d"] == "2024-02-29"
    assert row["ts"].startswith("2024-01-02T03:04:05.500000") and row["ts"][-6:] in ("+00:00",)
    assert row["dec"] == 12.5 and row["whole"] == 42 and isinstance(row["whole"], int)
    assert row["u"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert row["j"] == {"a": [1, 2, None], "b": {"c": True}}
    assert row["b"] == base64.b64encode(b"\x01\x02\xff").decode()
    assert row["nothing"] is None


def test_errors_carry_sqlstate_and_retryability(pg_dsn):
    syntax, serial = run_tasks(
        {"dsn": pg_dsn, "command": "selec 1"},
        {"dsn": pg_dsn, "command": "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$"},
    )
    assert syntax["status"] == "error"
    assert syntax["error"]["kind"] == "postgres_error" and syntax["error"]["retryable"] is False
    assert syntax["pg"] == {"code": "42601", "sqlstate": "42601"} and "syntax error" in syntax["error"]["message"]
    assert serial["error"] == {"kind": "postgres_error", "message": "conflict", "retryable": True}
    assert serial["pg"]["code"] == "40001"


def test_auth_through_keychain_entries(pg_dsn):
    parts = conninfo_to_dict(pg_dsn)
    fields = {"kind": "static", "host": parts.get("host", "127.0.0.1"), "port": parts.get("port", 5432),
              "user": parts.get("user"), "password": parts.get("password"), "database": parts["dbname"]}
    keychain = {"by_dsn": {"name": "by_dsn", "kind": "static", "dsn": pg_dsn}, "by_fields": fields}
    a, b = run_tasks(
        {"auth": "by_dsn", "command": "select current_database() as db"},
        {"auth": "by_fields", "command": "select current_database() as db"},
        keychain=keychain,
    )
    assert a["result"]["rows"] == b["result"]["rows"] == [{"db": parts["dbname"]}]


def test_missing_or_unusable_connection_info():
    none, unknown, fields, refused = run_tasks(
        {"command": "select 1"},
        {"auth": "nope", "command": "select 1"},
        {"auth": "partial", "command": "select 1"},
        {"dsn": "postgresql://u:s3cr3t-pw@127.0.0.1:1/db", "command": "select 1"},
        keychain={"partial": {"user": "u", "password": "s3cr3t-pw"}},
        policy=opened_to("127.0.0.1:1"),  # open, and nothing listens there
    )
    assert none["error"]["kind"] == "invalid_task" and "dsn" in none["error"]["message"]
    assert unknown["error"]["kind"] == "invalid_task" and "'nope'" in unknown["error"]["message"]
    assert fields["error"]["kind"] == "invalid_task" and "s3cr3t" not in str(fields)
    assert refused["error"]["kind"] == "postgres_connect_error" and refused["error"]["retryable"] is True
    assert "s3cr3t" not in str(refused)


def test_timeout_and_cancel(pg_dsn):
    async def go():
        tool = PostgresTool(policy=OPEN)
        try:
            slow = {"dsn": pg_dsn, "command": "select pg_sleep(5)"}
            timed_out = await tool.run(slow, {}, ctx(timeout=0.3))
            cancel = asyncio.Event()
            asyncio.get_running_loop().call_later(0.2, cancel.set)
            cancelled = await tool.run(slow, {}, ctx(cancel=cancel))
            after = await tool.run({"dsn": pg_dsn, "command": "select 1 as one"}, {}, ctx(timeout=5))
            return timed_out, cancelled, after
        finally:
            await tool.close()

    timed_out, cancelled, after = asyncio.run(go())
    assert timed_out["error"]["kind"] == "timeout" and timed_out["error"]["retryable"] is True
    assert cancelled["error"]["kind"] == "cancelled"
    assert after["result"]["rows"] == [{"one": 1}]  # the pool recovered


def test_split_statements():
    sql = """select ';' as a; select "x;y" from t -- c;
    ; /* a; /* nested; */ b; */ select E'it\\'s;' ; do $f$ begin; end $f$; select $1::int;"""
    assert split_statements(sql) == [
        "select ';' as a",
        'select "x;y" from t -- c;',  # the ; is inside the comment
        "/* a; /* nested; */ b; */ select E'it\\'s;'",
        "do $f$ begin; end $f$",
        "select $1::int",
    ]
    assert split_statements("  -- only a comment\n ; ") == []


# ------------------------------------------------------------------------------------- end to end
def playbook(tasks, workflow_extra=()):
    return {
        "apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "pg", "path": "tests/pg"},
        "workload": {"dsn": ""},
        "workflow": [{"step": "start", "tool": tasks}, *workflow_extra],
    }


def run_engine(doc, dsn):
    async def go():
        tools = default_tools(policy=OPEN)
        try:
            return await run_local(doc, tools=tools, workload={"dsn": dsn})
        finally:
            await close_tools(tools)

    r = asyncio.run(go())
    return summary(r.state), r


def test_engine_retries_serialization_failures(pg_dsn):
    run_tasks({"dsn": pg_dsn, "command": "create sequence attempts"})
    doc = playbook([{
        "name": "flaky", "kind": "postgres", "dsn": "{{ workload.dsn }}",
        # nextval is not rolled back with the failed transaction: each attempt counts
        "command": "DO $$ BEGIN IF nextval('attempts') < 3 THEN"
                   " RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END IF; END $$;"
                   " select currval('attempts') as attempt",
        "spec": {"policy": {"rules": [{
            "when": "{{ outcome.status == 'error' and outcome.pg.code in ['40001','40P01'] }}",
            "then": {"do": "retry", "attempts": 5, "delay": 0}}]}},
    }])
    s, r = run_engine(doc, pg_dsn)
    assert s["status"] == "COMPLETED"
    processed = [e for e in r.log if e["name"] == "task.processed"]
    assert len(processed) == 3 and [e["attempt"] for e in processed] == [1, 2, 3]
    assert s["steps"]["start"]["result"]["rows"] == [{"attempt": 3}]


def test_engine_jumps_to_fallback_on_syntax_error(pg_dsn):
    doc = playbook([
        {"name": "broken", "kind": "postgres", "dsn": "{{ workload.dsn }}", "command": "selec 1",
         "spec": {"policy": {"rules": [{"when": "{{ outcome.pg.code == '42601' }}",
                                        "then": {"do": "jump", "to": "fallback"}}]}}},
        {"name": "skipped", "kind": "noop", "result": "not reached"},
        {"name": "fallback", "kind": "postgres", "dsn": "{{ workload.dsn }}",
         "command": "select %s::text as via", "params": ["fallback"]},
    ])
    s, r = run_engine(doc, pg_dsn)
    assert s["status"] == "COMPLETED"
    assert s["steps"]["start"]["result"]["rows"] == [{"via": "fallback"}]
    tasks = [e["task"] for e in r.log if e["name"] == "task.processed"]
    assert tasks == ["broken", "fallback"]


def test_a_pooled_connection_forgets_one_tasks_session_before_the_next(pg_dsn):
    """Two executions with the same connection share a pool, never a session: a temporary table that
    shadows a real one, a read-only default or an advisory lock of one is gone for the next."""
    setup, shadow, lock, victim, check = run_tasks(
        {"dsn": pg_dsn, "command": "create table orders (id int, card text)"},
        {"dsn": pg_dsn, "command": "create temp table orders (id int, card text); "
                                   "set default_transaction_read_only = on"},
        {"dsn": pg_dsn, "command": "select pg_advisory_lock(42)"},
        {"dsn": pg_dsn, "command": "insert into orders values (1, 'alice') returning id"},
        {"dsn": pg_dsn, "command": "select pg_try_advisory_lock(42) as free, "
                                   "(select count(*) from pg_tables where tablename = 'orders') as real_tables"},
    )
    assert [o["status"] for o in (setup, shadow, lock, victim, check)] == ["ok"] * 5, [setup, shadow, lock, victim, check]
    assert victim["result"]["rows"] == [{"id": 1}]  # written, not refused as read-only
    assert check["result"]["rows"] == [{"free": True, "real_tables": 1}]
    rows, = run_tasks({"dsn": pg_dsn, "command": "select card from public.orders"})
    assert rows["result"]["rows"] == [{"card": "alice"}]  # into the real table, not a temporary one


@pytest.fixture()
def silent_port():
    """A TCP port that accepts connections and never answers (a database behind a black hole)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    held: list = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    srv.close()


def test_a_silent_server_holds_up_no_other_connection_and_no_task_for_ever(pg_dsn, silent_port):
    """One task connecting to a server that never answers, with no timeout of its own, holds up no
    other task's new connection (no lock is held while it waits), gives up within its connect wait,
    and lists at most MAX_HOSTS hosts; another connection string's task runs meanwhile."""
    from psycopg.conninfo import make_conninfo

    from noetl_mesh.tools.postgres import MAX_HOSTS

    silent = f"host={','.join(['127.0.0.1'] * 3)} port={silent_port} dbname=x user=x password=x"

    async def go():
        tool = PostgresTool(policy=opened_to(pg_endpoint(pg_dsn), f"127.0.0.1:{silent_port}"), connect_timeout=3)
        try:
            stuck = asyncio.create_task(tool.run({"dsn": silent, "command": "select 1"}, {"timeout": 0}, ctx()))
            await asyncio.sleep(0.5)
            other = await tool.run({"dsn": make_conninfo(pg_dsn, application_name="other"), "command": "select 1 as one"},
                                   {"timeout": 60}, ctx())
            was_waiting = not stuck.done()
            many = await tool.run({"dsn": f"host={','.join(['127.0.0.1'] * (MAX_HOSTS + 1))} port={silent_port} "
                                          "dbname=x user=x", "command": "select 1"}, {}, ctx())
            return other, was_waiting, await stuck, many
        finally:
            await tool.close()

    other, was_waiting, stuck, many = asyncio.run(go())
    assert was_waiting and other["status"] == "ok" and other["result"]["rows"] == [{"one": 1}], other
    assert stuck["error"]["kind"] == "postgres_connect_error" and "no connection within 3s" in stuck["error"]["message"]
    assert many["error"]["kind"] == "invalid_task" and f"at most {MAX_HOSTS}" in many["error"]["message"], many


def test_a_worker_keeps_a_bounded_number_of_pools(pg_dsn):
    """Connection strings that differ only in what a task may set (application_name) each get a pool,
    and the least recently used is closed past MAX_POOLS: a loop cannot grow a worker, or fill the
    database's connections, without bound."""
    from psycopg.conninfo import make_conninfo

    from noetl_mesh.tools.postgres import MAX_POOLS

    async def go():
        tool = PostgresTool(policy=OPEN)
        try:
            outs = [await tool.run({"dsn": make_conninfo(pg_dsn, application_name=f"a{i}"), "command": "select 1"},
                                   {}, ctx()) for i in range(MAX_POOLS * 3)]
            await asyncio.gather(*tool._closing)
            kept = len(tool._pools), [p.closed for p in tool._pools.values()]
            same = make_conninfo(pg_dsn, application_name="same")  # first used by several tasks at once: one pool
            outs += await asyncio.gather(*(tool.run({"dsn": same, "command": "select 1"}, {}, ctx()) for _ in range(6)))
            await asyncio.gather(*tool._closing)
            return outs, *kept, sum(1 for p in tool._pools.values() if not p.closed)
        finally:
            await tool.close()

    outs, kept, closed, open_after = asyncio.run(go())
    assert all(o["status"] == "ok" for o in outs), [o for o in outs if o["status"] != "ok"][:1]
    assert kept == MAX_POOLS and not any(closed) and open_after == MAX_POOLS
