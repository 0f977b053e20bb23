"""The ``duckdb`` tool (D27, D33): SQL in a sandboxed task process of its own.

Fields: ``command`` (alias ``query``): one or more statements, split by DuckDB's own parser
(``extract_statements``) and run in order on one connection; ``params``: a list for positional
placeholders (``?``, ``$1``) or a mapping for named ones (``$name``), bound (never formatted) to every
statement that declares parameters (to the last statement when none declares any); ``db_path``: a
database file (default: a fresh in-memory database for the task). A relative ``db_path`` lies in the
task's scratch directory (gone when the task ends); a lasting one must be inside a data directory of the
worker pool (``NOETL_SANDBOX_DATA_DIRS``).

Result, of the last statement: ``{rows: [{column: value}], columns: [...], row_count: N}``. For a
statement without a result set (DDL, INSERT/UPDATE/DELETE without RETURNING...) ``rows`` and
``columns`` are empty and ``row_count`` is the number of rows affected. Values are JSON-ready: dates and
times ISO-8601 strings, intervals ISO-8601 durations, decimals numbers (int when integral), UUIDs
strings, blobs base64, NaN and infinities null. Rows are fetched in chunks; once their JSON passes
``limits.max_result_bytes`` fetching stops and the task fails with ``result_too_large`` (not retryable).
Errors: ``duckdb_error`` (not retryable) with DuckDB's message; ``sandbox`` when the SQL reaches for a
file outside the task's scratch directory and the pool's data directories (DuckDB's own external access
is off but for those, and the process cannot open anything else anyway); ``timeout`` (retryable) when
``spec.timeout`` runs out (the process is killed); ``limit_exceeded`` for the task process limits.

The query runs in a task process forked by the worker's sandbox (:mod:`noetl_mesh.sandbox`), which has
DuckDB imported already: :func:`execute` is what runs there.
"""
from __future__ import annotations

import base64
import datetime as _dt
import math
import os
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from .. import limits
from .base import ResultBudget, ResultTooLarge, ToolContext, error, ok

if TYPE_CHECKING:  # pragma: no cover
    from ..sandbox.supervisor import Supervisor

__all__ = ["DuckdbTool", "to_json_value", "execute"]

DEFAULT_TIMEOUT = 60.0  # KIND_DEFAULTS["duckdb"]["timeout"]
FETCH_ROWS = 1024  # rows fetched (and measured against max_result_bytes) at a time
_PLAIN = frozenset({int, str, bool, type(None)})  # floats are checked for NaN / infinity
_TSTZ = "TIMESTAMP WITH TIME ZONE"
_UTC = _dt.timezone.utc
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_UTC)


def _iso_duration(td: _dt.timedelta) -> str:
    total_us = td.days * 86_400_000_000 + td.seconds * 1_000_000 + td.microseconds
    sign = "-" if total_us < 0 else ""
    total_us = abs(total_us)
    days, rem = divmod(total_us, 86_400_000_000)
    hours, rem = divmod(rem, 3_600_000_000)
    minutes, rem = divmod(rem, 60_000_000)
    seconds, micros = divmod(rem, 1_000_000)
    out = f"{sign}P"
    if days:
        out += f"{days}D"
    if hours or minutes or seconds or micros or not days:
        out += "T"
        if hours:
            out += f"{hours}H"
        if minutes:
            out += f"{minutes}M"
        if seconds or micros or not (hours or minutes):
            out += f"{seconds}.{micros:06d}".rstrip("0").rstrip(".") + "S"
    return out


def to_json_value(v: Any) -> Any:
    """A DuckDB Python value as a JSON-ready value (D27)."""
    t = type(v)
    if t in _PLAIN:
        return v
    if t is float:
        return v if math.isfinite(v) else None  # JSON has no NaN / Infinity (as JSON.stringify does)
    if isinstance(v, (list, tuple)):
        return [to_json_value(x) for x in v]
    if isinstance(v, dict):
        return {(k if isinstance(k, str) else str(to_json_value(k))): to_json_value(x) for k, x in v.items()}
    if isinstance(v, Decimal):
        if not v.is_finite():
            return float(v)
        return int(v) if v.as_tuple().exponent >= 0 else float(v)
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, _dt.timedelta):
        return _iso_duration(v)
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, float):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, (int, str)):  # subclasses (e.g. enums of str)
        return v
    return str(v)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _bind(params: Any, stmt: Any) -> Any:
    """The parameters for one statement: a mapping is cut down to the names it declares."""
    if isinstance(params, Mapping):
        names = stmt.named_parameters
        return {k: v for k, v in params.items() if k in names}
    return list(params)


def _tstz(us: Any) -> Any:
    if us is None:
        return None
    try:
        return (_EPOCH + _dt.timedelta(microseconds=us)).isoformat()
    except OverflowError:
        return "infinity" if us > 0 else "-infinity"


def _fetch_select(con: Any, stmt: Any, params: Any, budget: ResultBudget) -> dict:
    """A SELECT: its types are bound first (a relation, not run), so TIMESTAMP WITH TIME ZONE can be
    converted without pytz by a projection around the query; then it runs once and its rows are
    fetched in chunks (:func:`_fetch`)."""
    rel = con.sql(stmt.query, params=params) if params is not None else con.sql(stmt.query)
    columns = list(rel.columns)
    type_names = [str(t) for t in rel.types]
    post: dict[int, Any] = {}
    query = stmt
    if any(_TSTZ in tn for tn in type_names):
        exprs = []
        for i, (c, tn) in enumerate(zip(columns, type_names)):
            q = _quote(c)
            if tn == _TSTZ:
                exprs.append(f"epoch_us({q}) AS {q}")
                post[i] = _tstz
            elif _TSTZ in tn:
                exprs.append(f"CAST(to_json({q}) AS VARCHAR) AS {q}")
                post[i] = _json_loads
            else:
                exprs.append(q)
        query = f"SELECT {', '.join(exprs)} FROM ({stmt.query}) AS _noetl_query"
    if params is not None:
        con.execute(query, params)
    else:
        con.execute(query)
    return _fetch(con, columns, budget, post)


def _json_loads(s: Any) -> Any:
    import json

    return None if s is None else json.loads(s)


def _shape_rows(columns: list[str], raw: list[tuple], post: dict[int, Any] | None = None) -> list[dict]:
    rows = []
    plain = _PLAIN
    for r in raw:
        if post:
            r = tuple(post[i](v) if i in post else v for i, v in enumerate(r))
        rows.append({c: (v if type(v) in plain else to_json_value(v)) for c, v in zip(columns, r)})
    return rows


def _fetch(con: Any, columns: list[str], budget: ResultBudget, post: dict[int, Any] | None = None) -> dict:
    """The current result's rows, fetched ``FETCH_ROWS`` at a time (DuckDB streams them) while their
    JSON size stays under ``max_result_bytes``: past it, fetching stops (:class:`ResultTooLarge`)."""
    rows: list[dict] = []
    while True:
        raw = con.fetchmany(FETCH_ROWS)
        if not raw:
            return {"rows": rows, "columns": columns, "row_count": len(rows)}
        chunk = _shape_rows(columns, raw, post)
        budget.add(chunk)
        rows.extend(chunk)


# DuckDB itself is imported where a task runs (its sandbox's task process, which loads it ahead); the
# worker only hands tasks over, and does not load it
def _run_statements(con: Any, sql: str, params: Any, budget: ResultBudget) -> dict:
    import duckdb

    stmts = con.extract_statements(sql)
    if not stmts:
        return {"rows": [], "columns": [], "row_count": 0}
    last = len(stmts) - 1
    has_params = params is not None and (len(params) > 0)
    declaring = {i for i, s in enumerate(stmts) if s.named_parameters} if has_params else set()
    if has_params and not declaring:
        declaring = {last}  # let DuckDB say what is wrong with them
    for i, stmt in enumerate(stmts):
        p = _bind(params, stmt) if i in declaring else None
        if i == last and stmt.type == duckdb.StatementType.SELECT:
            return _fetch_select(con, stmt, p, budget)
        if p is not None:
            con.execute(stmt, p)
        else:
            con.execute(stmt)
    desc = con.description
    if not desc:
        return {"rows": [], "columns": [], "row_count": 0}
    if len(desc) == 1 and desc[0][0] in ("Count", "Success"):
        raw = con.fetchall()
        # DML reports the rows it changed as one `Count` column; DDL/SET report nothing useful.
        count = raw[0][0] if (raw and desc[0][0] == "Count" and isinstance(raw[0][0], int)) else 0
        return {"rows": [], "columns": [], "row_count": count}
    return _fetch(con, [d[0] for d in desc], budget)


def connect(db_path: str | None, directories: list[str], memory_bytes: int | None) -> Any:
    """A connection whose file access is off but for ``directories`` (locked: SQL cannot turn it back
    on), extensions neither installed nor loaded on their own, memory bounded below the process limit."""
    import duckdb

    config: dict[str, Any] = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}
    if memory_bytes:
        config["memory_limit"] = f"{max(64, memory_bytes * 3 // 4 // (1 << 20))}MB"
    in_memory = not db_path or db_path == ":memory:"
    con = duckdb.connect(":memory:" if in_memory else db_path, config=config)
    try:
        if directories:
            quoted = ", ".join("'" + d.rstrip("/").replace("'", "''") + "/'" for d in directories)
            con.execute(f"SET allowed_directories = [{quoted}]")
            con.execute(f"SET temp_directory = '{directories[0].replace(chr(39), chr(39) * 2)}/.duckdb_tmp'")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


def execute(req: dict, confined: bool = False, warm: Any = None) -> dict:
    """In a task process: run one request ``{sql, params, db_path, max_result_bytes, directories,
    memory_bytes}``; the answer ``{ok, result}`` or ``{ok: false, kind, message}``. ``warm``: an
    in-memory database the process opened while it waited (used when the request asks for one)."""
    import duckdb

    db_path = req.get("db_path")
    if warm is not None and (not db_path or db_path == ":memory:"):
        con = warm
    else:
        if warm is not None:
            _close_quietly(warm)
        try:
            con = connect(db_path, [os.getcwd(), *(req.get("directories") or [])], req.get("memory_bytes"))
        except duckdb.Error as e:
            return _failure(e, confined)
    try:
        budget = ResultBudget("the rows fetched", req.get("max_result_bytes"))
        return {"ok": True, "result": _run_statements(con, req["sql"], req.get("params"), budget)}
    except ResultTooLarge as e:
        return {"ok": False, "kind": "result_too_large", "size": e.size, "read": e.read}
    except MemoryError:
        return {"ok": False, "kind": "limit_exceeded", "limit": "task_max_memory_bytes", "message": "out of memory"}
    except duckdb.OutOfMemoryException as e:
        return {"ok": False, "kind": "limit_exceeded", "limit": "task_max_memory_bytes", "message": str(e)}
    except Exception as e:  # noqa: BLE001 - duckdb errors, parameters DuckDB cannot convert
        return _failure(e, confined)
    finally:
        _close_quietly(con)


def _failure(e: BaseException, confined: bool) -> dict:
    import duckdb

    if isinstance(e, duckdb.PermissionException) or (confined and isinstance(e, duckdb.IOException)
                                                      and "Permission denied" in str(e)):
        return {"ok": False, "kind": "sandbox", "message": f"refused by the sandbox (D33): {e} (a duckdb task reads "
                                                           "and writes its scratch directory and the worker pool's "
                                                           "data directories only)"}
    if isinstance(e, duckdb.Error):
        return {"ok": False, "kind": "duckdb_error", "message": str(e)}
    return {"ok": False, "kind": "duckdb_error", "message": f"{type(e).__name__}: {e}"}


class DuckdbTool:
    """``kind: duckdb`` (D27)."""

    kind = "duckdb"

    def __init__(self, sandbox: "Supervisor | None" = None) -> None:
        if sandbox is None:
            from ..sandbox.supervisor import Supervisor

            sandbox = Supervisor()
            self._own = True
        else:
            self._own = False
        self.sandbox = sandbox

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        from ..sandbox.supervisor import SandboxUnavailable, TaskCrashed
        from .python import sandbox_error

        sql = task.get("command")
        if sql is None:
            sql = task.get("query")
        if not isinstance(sql, str):
            return error("duckdb_error", "duckdb task needs 'command' (alias 'query'): SQL text")
        params = task.get("params")
        if params is not None and not isinstance(params, (list, tuple, Mapping)):
            return error("duckdb_error", f"'params' must be a list or a mapping, got {type(params).__name__}")
        db_path = task.get("db_path")
        if db_path is not None and not isinstance(db_path, str):
            return error("duckdb_error", f"'db_path' must be a string, got {type(db_path).__name__}")
        from .base import task_timeout

        timeout, said = task_timeout(ctx.timeout if ctx.timeout is not None else spec.get("timeout"), DEFAULT_TIMEOUT)
        values = limits.current()
        request = {"sql": sql, "params": params, "db_path": db_path, "max_result_bytes": values.max_result_bytes,
                   "directories": list(self.sandbox.policy.data_dirs), "memory_bytes": values.task_max_memory_bytes}
        try:
            answer = await self.sandbox.run("duckdb", request, timeout=timeout,
                                            max_answer=values.max_result_bytes + 64 * 1024)
        except ResultTooLarge as e:
            return e.outcome(ctx)
        except TimeoutError:
            return error("timeout", f"duckdb task exceeded its timeout of {said} (process killed)", True)
        except (SandboxUnavailable, TaskCrashed) as e:
            return sandbox_error(e, "duckdb_error")
        if answer.get("ok"):
            return ok(answer.get("result"))
        kind = answer.get("kind") or "duckdb_error"
        if kind == "result_too_large":
            return ResultTooLarge(answer.get("size"), answer.get("read")).outcome(ctx)
        if kind == "limit_exceeded":
            from .python import limit_message

            return error(kind, limit_message(answer.get("limit") or "task_max_memory_bytes",
                                             f"duckdb task: {answer.get('message')}"))
        return error(kind, answer.get("message") or "")

    async def close(self) -> None:
        if self._own:
            await self.sandbox.close()


def _close_quietly(con: Any) -> None:
    try:
        con.close()
    except Exception:  # noqa: BLE001
        pass
