"""The ``duckdb`` tool (D27).

Fields: ``command`` (alias ``query``): one or more statements, split by DuckDB's own parser
(``extract_statements``) and run in order on one connection; ``params``: a list for positional
placeholders (``?``, ``$1``) or a mapping for named ones (``$name``), bound (never formatted) to every
statement that declares parameters (to the last statement when none declares any); ``db_path``: a
database file (default: a fresh in-memory database for the task).

Result, of the last statement: ``{rows: [{column: value}], columns: [...], row_count: N}``. For a
statement without a result set (DDL, INSERT/UPDATE/DELETE without RETURNING...) ``rows`` and
``columns`` are empty and ``row_count`` is the number of rows affected. Values are JSON-ready: dates and
times ISO-8601 strings, intervals ISO-8601 durations, decimals numbers (int when integral), UUIDs
strings, blobs base64, NaN and infinities null. Rows are fetched in chunks; once their JSON passes
``limits.max_result_bytes`` fetching stops and the task fails with ``result_too_large`` (not retryable).
Errors: ``duckdb_error`` (not retryable) with DuckDB's message; ``timeout`` (retryable) when
``spec.timeout`` runs out (the query is interrupted).

Work runs in a thread so the event loop is never blocked. A fresh in-memory database costs ~10 ms to
open; the tool keeps one unused one ready (opened in the background), so a task rarely waits for it.
"""
from __future__ import annotations

import asyncio
import base64
import datetime as _dt
import math
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import duckdb

from .base import ResultBudget, ResultTooLarge, ToolContext, error, ok, timeout_seconds

__all__ = ["DuckdbTool", "to_json_value"]

DEFAULT_TIMEOUT = 60.0  # KIND_DEFAULTS["duckdb"]["timeout"]
FETCH_ROWS = 1024  # rows fetched (and measured against max_result_bytes) at a time
_PLAIN = frozenset({int, str, bool, type(None)})  # floats are checked for NaN / infinity
_TSTZ = "TIMESTAMP WITH TIME ZONE"
_UTC = _dt.timezone.utc
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_UTC)


class _Interrupted(Exception):
    pass


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


def _fetch_select(con: Any, stmt: Any, params: Any, state: dict) -> dict:
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
    return _fetch(con, columns, state, post)


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


def _fetch(con: Any, columns: list[str], state: dict, post: dict[int, Any] | None = None) -> dict:
    """The current result's rows, fetched ``FETCH_ROWS`` at a time (DuckDB streams them) while their
    JSON size stays under ``max_result_bytes``: past it, fetching stops (:class:`ResultTooLarge`)."""
    budget = ResultBudget("the rows fetched")
    rows: list[dict] = []
    while True:
        if state.get("interrupted"):
            raise _Interrupted()
        raw = con.fetchmany(FETCH_ROWS)
        if not raw:
            return {"rows": rows, "columns": columns, "row_count": len(rows)}
        chunk = _shape_rows(columns, raw, post)
        budget.add(chunk)
        rows.extend(chunk)


def _run_statements(con: Any, sql: str, params: Any, state: dict) -> dict:
    stmts = con.extract_statements(sql)
    if not stmts:
        return {"rows": [], "columns": [], "row_count": 0}
    last = len(stmts) - 1
    has_params = params is not None and (len(params) > 0)
    declaring = {i for i, s in enumerate(stmts) if s.named_parameters} if has_params else set()
    if has_params and not declaring:
        declaring = {last}  # let DuckDB say what is wrong with them
    for i, stmt in enumerate(stmts):
        if state.get("interrupted"):
            raise _Interrupted()
        p = _bind(params, stmt) if i in declaring else None
        if i == last and stmt.type == duckdb.StatementType.SELECT:
            return _fetch_select(con, stmt, p, state)
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
    return _fetch(con, [d[0] for d in desc], state)


class DuckdbTool:
    """``kind: duckdb`` (D27)."""

    kind = "duckdb"

    def __init__(self, *, keep_spare: bool = True) -> None:
        self._keep_spare = keep_spare
        self._lock = threading.Lock()
        self._spares: list[Any] = []
        self._refilling = False
        self._executor: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- in-memory databases, pre-opened

    def _bg(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noetl-duckdb")
        return self._executor

    def _memory_connection(self) -> Any:
        con = None
        with self._lock:
            if self._spares:
                con = self._spares.pop()
        if con is None:
            con = duckdb.connect(":memory:")
        if self._keep_spare:
            self._refill()
        return con

    def _refill(self) -> None:
        with self._lock:
            if self._refilling or self._spares:
                return
            self._refilling = True

        def make() -> None:
            try:
                c = duckdb.connect(":memory:")
            except Exception:  # noqa: BLE001
                c = None
            with self._lock:
                self._refilling = False
                if c is not None:
                    self._spares.append(c)

        try:
            self._bg().submit(make)
        except RuntimeError:  # executor shut down
            with self._lock:
                self._refilling = False

    def _dispose(self, con: Any, in_memory: bool) -> None:
        if in_memory and self._keep_spare:
            try:
                self._bg().submit(_close_quietly, con)
                return
            except RuntimeError:
                pass
        _close_quietly(con)

    # ------------------------------------------------------------------------------------------- run

    def _execute(self, sql: str, params: Any, db_path: str | None, state: dict) -> dict:
        in_memory = not db_path or db_path == ":memory:"
        con = self._memory_connection() if in_memory else duckdb.connect(db_path)
        state["con"] = con
        try:
            if state.get("interrupted"):
                raise _Interrupted()
            return _run_statements(con, sql, params, state)
        finally:
            state["con"] = None
            self._dispose(con, in_memory)

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
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
        timeout = timeout_seconds(ctx.timeout if ctx.timeout is not None else spec.get("timeout"), DEFAULT_TIMEOUT)
        state: dict[str, Any] = {}
        fut = asyncio.ensure_future(asyncio.to_thread(self._execute, sql, params, db_path, state))
        try:
            done, _ = await asyncio.wait((fut,), timeout=timeout)
        except asyncio.CancelledError:
            _interrupt(state)
            raise
        if not done:
            _interrupt(state)
            try:
                await fut
            except BaseException:  # noqa: BLE001 - the interrupted query's own error is not the story
                pass
            return error("timeout", f"duckdb task exceeded its timeout of {timeout:g}s (query interrupted)", True)
        try:
            return ok(fut.result())
        except ResultTooLarge as e:
            return e.outcome(ctx)
        except _Interrupted:
            return error("timeout", "duckdb task interrupted", True)
        except duckdb.Error as e:
            return error("duckdb_error", str(e))
        except Exception as e:  # noqa: BLE001 - e.g. parameters DuckDB cannot convert
            return error("duckdb_error", f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        ex, self._executor = self._executor, None
        if ex is not None:
            await asyncio.to_thread(ex.shutdown, True)
        with self._lock:
            spares, self._spares = self._spares, []
        for c in spares:
            _close_quietly(c)


def _interrupt(state: dict) -> None:
    state["interrupted"] = True
    con = state.get("con")
    if con is not None:
        try:
            con.interrupt()
        except Exception:  # noqa: BLE001
            pass


def _close_quietly(con: Any) -> None:
    try:
        con.close()
    except Exception:  # noqa: BLE001
        pass

