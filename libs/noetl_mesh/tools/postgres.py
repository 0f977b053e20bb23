"""The ``postgres`` tool (D8, D24, D27).

Fields: ``command`` (alias ``query``): one or more statements; ``params``: a list for positional
placeholders (``%s``) or a mapping for named ones (``%(name)s``), bound by psycopg (never formatted into
the text); ``dsn``: a connection string, or ``auth``: the name of a keychain entry (D24) giving either
``dsn`` or ``host``, ``port``, ``user``, ``password``, ``dbname`` (alias ``database``).

All statements run in one transaction (committed at the end, rolled back on error). Without ``params``
the command goes to the server as written (simple protocol: several statements in one round trip). With
``params`` the command is split into statements (on ``;`` outside quotes, dollar quotes and comments)
and the params are bound to each statement that has placeholders; with a list and several such
statements, the list is dealt out in order when its length is the total number of placeholders.

Result, of the last statement: ``{rows: [{column: value}], columns: [...], row_count: N}``; without a
result set ``rows`` and ``columns`` are empty and ``row_count`` is the number of rows affected. Values
are converted as the duckdb tool does (dates ISO-8601, decimals numbers, UUIDs strings, bytea base64);
json/jsonb arrive parsed. Rows are fetched in chunks; once their JSON passes ``limits.max_result_bytes``
fetching stops and the task fails with ``result_too_large`` (not retryable). When the last statement is
a plain query (:func:`_is_query`) it is read through a server-side cursor, so the rows past the limit
are never sent; otherwise (``INSERT ... RETURNING``...) libpq receives the whole result first.

Errors: ``postgres_error`` with the server's message (primary + detail) and ``pg: {code, sqlstate}``,
retryable for serialization failures, deadlocks, connection trouble, admin shutdown and too many
connections; ``postgres_connect_error`` (retryable) when no connection can be had; ``timeout``
(retryable) when ``spec.timeout`` runs out (``statement_timeout`` on the server, and a client-side
deadline); ``invalid_task`` when the task gives no usable connection or command. Passwords never appear
in an outcome.

Connections come from one ``psycopg_pool.AsyncConnectionPool`` per distinct connection string per tool
instance (created lazily; ``close()`` closes them).

Destinations (D33): before connecting, every host of the connection (``host``, a comma-separated list,
with its ``port``; ``hostaddr`` when given) is resolved here and each address checked with the worker pool's policy
(:mod:`noetl_mesh.sandbox.net`); unix-socket directories (and no host at all: libpq's local socket) are
local and refused. The connection string then names the checked addresses (``hostaddr``, with ``host``
kept for TLS and messages), so libpq connects to nothing else. A refusal is the outcome ``sandbox``
(not retryable). The connection may set only what concerns the server it reaches (``_TASK_KEYS``): no
option that reads or writes the worker's files, and no password file, client certificate or Kerberos
identity of the worker's (``_TASK_FIXED``); the worker starts without libpq's ``PG*`` variables. A
pooled connection is reset (``DISCARD ALL``) before another task gets it: temporary tables, settings,
prepared statements and advisory locks of one execution never reach another.
"""
from __future__ import annotations

import asyncio
import os
import re
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import Any

import psycopg
from psycopg import conninfo as _conninfo
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from ..core.keychain import masker
from ..sandbox.net import Refused, Resolver, allowed_addresses, check_address, is_address
from ..sandbox.policy import Policy
from .base import ResultBudget, ResultTooLarge, ToolContext, bounded, error, ok, task_timeout
from .duckdb import FETCH_ROWS, _shape_rows

__all__ = ["PostgresTool", "split_statements", "RETRYABLE_SQLSTATES"]

DEFAULT_TIMEOUT = 60.0  # KIND_DEFAULTS["postgres"]["timeout"]
CONNECT_TIMEOUT = 10.0  # the most a task waits for a connection (within its own timeout)
GRACE = 2.0  # client-side deadline beyond the server's statement_timeout
POOL_MAX_SIZE = 4
MAX_POOLS = 16  # connection strings a worker keeps a pool for; the least recently used one is closed past it
POOL_MAX_IDLE = 60.0  # seconds an idle pooled connection is kept
MAX_HOSTS = 8  # hosts one connection string may list

RETRYABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})
_RETRYABLE_CLASSES = ("40", "08")
_ENTRY_KEYS = ("host", "port", "user", "password", "dbname", "sslmode", "options", "application_name")
_PLACEHOLDER = re.compile(r"%(?:\(([^)]+)\).|.)", re.S)  # as psycopg sees them
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\u0080-\uffff][A-Za-z0-9_\u0080-\uffff]*)?\$")


class _BadTask(Exception):
    pass


class _ConnectError(Exception):
    pass


# ------------------------------------------------------------------------------------ statements


def _end_of_quoted(sql: str, i: int, quote: str, escapes: bool) -> int:
    """The index after the literal or quoted identifier opening at ``i`` (a doubled quote stays inside;
    with ``escapes``, an ``E'...'`` string, so does a backslash-escaped character)."""
    n = len(sql)
    i += 1
    while i < n:
        if escapes and sql[i] == "\\":
            i += 2
            continue
        if sql[i] == quote:
            if i + 1 < n and sql[i + 1] == quote:
                i += 2
                continue
            break
        i += 1
    return i + 1


def split_statements(sql: str) -> list[str]:
    """The statements of ``sql``: split on ``;`` outside string literals (``'...'``, ``E'...'``),
    quoted identifiers, dollar-quoted bodies and comments (``--``, nested ``/* */``). Statements with
    nothing but whitespace and comments are dropped; each keeps its own text without the ``;``."""
    out: list[str] = []
    n = len(sql)
    i = start = 0
    content = False
    while i < n:
        c = sql[i]
        if c in "'\"":
            escapes = c == "'" and i > 0 and sql[i - 1] in "eE" and (
                i < 2 or not (sql[i - 2].isalnum() or sql[i - 2] == "_"))
            i = _end_of_quoted(sql, i, c, escapes)
            content = True
        elif c == "-" and sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif c == "/" and sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "$" and not (i > 0 and (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            m = _DOLLAR_TAG.match(sql, i)
            if m:
                end = sql.find(m.group(0), m.end())
                i = n if end < 0 else end + len(m.group(0))
            else:
                i += 1
            content = True
        elif c == ";":
            if content:
                out.append(sql[start:i].strip())
            start, content = i + 1, False
            i += 1
        else:
            if not c.isspace():
                content = True
            i += 1
    if content:
        out.append(sql[start:].strip())
    return out


def _placeholders(stmt: str) -> tuple[int, set[str]]:
    """(positional placeholder count, named placeholder names) as psycopg would read ``stmt``."""
    count, names = 0, set()
    for m in _PLACEHOLDER.finditer(stmt):
        if m.group(0) == "%%":
            continue
        if m.group(1) is not None:
            names.add(m.group(1))
        else:
            count += 1
    return count, names


_NOT_WORDS = re.compile(r"""[eE]'(?:[^'\\]|\\.|'')*'|'(?:[^']|'')*'|"(?:[^"]|"")*"|--[^\n]*|/\*.*?\*/"""
                        r"|\$((?:[A-Za-z_][A-Za-z0-9_]*)?)\$.*?\$\1\$", re.S)
_WORD = re.compile(r"[A-Za-z_]+")
_QUERY_FIRST = frozenset({"SELECT", "WITH", "VALUES", "TABLE"})
_NOT_IN_QUERY = frozenset({"INTO", "INSERT", "UPDATE", "DELETE", "MERGE"})


def _is_query(stmt: str) -> bool:
    """Whether one statement is a plain query (its rows can be read through a cursor): it starts with
    SELECT, WITH, VALUES or TABLE and has none of INTO, INSERT, UPDATE, DELETE, MERGE (outside literals
    and comments). A doubtful statement is not one: it runs as usual."""
    words = [w.upper() for w in _WORD.findall(_NOT_WORDS.sub(" ", stmt))]
    return bool(words) and words[0] in _QUERY_FIRST and _NOT_IN_QUERY.isdisjoint(words)


def _plan(sql: str, params: Any) -> list[tuple[str, Any]]:
    """``[(statement, params or None)]`` to execute in order."""
    if params is None or (isinstance(params, (list, tuple, Mapping)) and len(params) == 0):
        stmts = split_statements(sql)
        if len(stmts) > 1 and _is_query(stmts[-1]):  # the last one alone, so that its rows can be streamed
            return [(";\n".join(stmts[:-1]), None), (stmts[-1], None)]
        return [(sql, None)]  # as written: the server splits it
    stmts = split_statements(sql)
    if not stmts:
        return [(sql, None)]
    if len(stmts) == 1:
        return [(stmts[0], params)]
    counts = [_placeholders(s) for s in stmts]
    declaring = [i for i, (k, names) in enumerate(counts) if k or names]
    if not declaring:
        declaring = [len(stmts) - 1]  # let psycopg say what is wrong with them
    bound: dict[int, Any] = {}
    if isinstance(params, Mapping):
        for i in declaring:
            bound[i] = params
    else:
        params = list(params)
        total = sum(counts[i][0] for i in declaring)
        if len(declaring) > 1 and total == len(params) and any(counts[i][0] != len(params) for i in declaring):
            pos = 0
            for i in declaring:
                k = counts[i][0]
                bound[i] = params[pos:pos + k]
                pos += k
        else:
            for i in declaring:
                bound[i] = params
    return [(s, bound.get(i)) for i, s in enumerate(stmts)]


# ----------------------------------------------------------------------------------- connection


def _conninfo_for(task: Mapping[str, Any], keychain: Mapping[str, Any]) -> str:
    dsn = task.get("dsn")
    if dsn not in (None, ""):
        if not isinstance(dsn, str):
            raise _BadTask(f"'dsn' must be a string, got {type(dsn).__name__}")
        return dsn
    auth = task.get("auth")
    if auth in (None, "", {}):
        raise _BadTask("postgres task needs a connection: 'dsn' (a connection string) or 'auth' (a keychain entry)")
    entry = auth
    if isinstance(auth, str):
        entry = keychain.get(auth) if isinstance(keychain, Mapping) else None
        if not isinstance(entry, Mapping):
            raise _BadTask(f"auth {auth!r} names no keychain entry")
    if not isinstance(entry, Mapping):
        raise _BadTask(f"'auth' must be a keychain entry name, got {type(auth).__name__}")
    for nested in ("data", "value", "values"):  # entries may keep their fields one level down
        if not any(k in entry for k in ("dsn", "host", "dbname", "database")) and isinstance(entry.get(nested), Mapping):
            entry = entry[nested]
    where = f"auth {auth!r}" if isinstance(auth, str) else "auth"
    if entry.get("dsn") not in (None, ""):
        if not isinstance(entry["dsn"], str):
            raise _BadTask(f"{where}: 'dsn' must be a string")
        return entry["dsn"]
    fields = {k: entry[k] for k in _ENTRY_KEYS if entry.get(k) not in (None, "")}
    if "dbname" not in fields and entry.get("database") not in (None, ""):
        fields["dbname"] = entry["database"]
    if "host" not in fields or "dbname" not in fields:
        raise _BadTask(f"{where} needs 'dsn', or 'host' and 'dbname' (with 'port', 'user', 'password')")
    try:
        return _conninfo.make_conninfo(**{k: str(v) for k, v in fields.items()})
    except psycopg.ProgrammingError as e:
        raise _BadTask(f"{where}: bad connection fields ({type(e).__name__})") from None


_UNIX = ("is a unix-socket directory: a local connection, closed to tasks on this worker pool (D33); "
         "connect over TCP (host and port) to an address the pool allows")


def _listed(params: Mapping[str, Any], key: str) -> list[str]:
    """A libpq list parameter (``host``, ``hostaddr``, ``port``), split on commas. (The worker's own
    ``PG*`` variables are not a task's: the worker drops them when it starts, see :func:`forget_libpq_env`.)"""
    value = params.get(key)
    return [] if value is None or str(value) == "" else [v.strip() for v in str(value).split(",")]


# What a task's connection may say. Everything else of libpq reads the worker's files or environment or
# writes files (service, passfile, sslkey, sslcert, sslkeylogfile, sslcrl...), or hands the worker's
# identity to a server (gssencmode, krbsrvname, gssdelegation): refused, named in the error.
_TASK_KEYS = frozenset({
    "host", "hostaddr", "port", "dbname", "user", "password", "sslmode", "sslrootcert", "application_name",
    "connect_timeout", "options", "client_encoding", "target_session_attrs", "keepalives", "keepalives_idle",
    "keepalives_interval", "keepalives_count", "tcp_user_timeout", "sslnegotiation", "require_auth",
    "load_balance_hosts", "channel_binding",
})
# and what is set for every task connection, whatever it said: no password file, no client certificate,
# no Kerberos/GSSAPI (the worker's credentials), no key log
_TASK_FIXED = {"passfile": "/dev/null", "sslcertmode": "disable", "gssencmode": "disable"}


def forget_libpq_env(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove libpq's ``PG*`` variables from the worker's environment (a task's connection would take
    the worker's password, user, service file or key from them); the names removed."""
    env = os.environ if environ is None else environ
    names = [k for k in env if k.startswith("PG")]
    for k in names:
        del env[k]
    return names


async def _pinned(conninfo: str, policy: Policy, resolver: Resolver | None = None) -> str:
    """``conninfo`` with every host resolved and checked (D33) and pinned as ``hostaddr``: one entry
    per allowed address, ``host`` kept (TLS, messages). Refused hosts are left out; :class:`Refused`
    (the first refusal) when none is left, ``_BadTask`` for lists that do not match, ``_ConnectError``
    when a name does not resolve and no other host is left."""
    try:
        params = _conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        raise _BadTask(f"bad connection string ({str(e).strip() or type(e).__name__})") from None
    refused = sorted(k for k in params if k not in _TASK_KEYS)
    if refused:
        raise Refused("postgres", f"the connection option {refused[0]!r} is not a task's to set: it reads or "
                                  "writes the worker's own files or credentials (D33); allowed: "
                                  + ", ".join(sorted(_TASK_KEYS)))
    rootcert = params.get("sslrootcert")
    if rootcert not in (None, "", "system"):
        raise Refused("postgres", "sslrootcert names a file of the worker: only 'system' (the worker's trusted "
                                  "certificates) is a task's to ask for (D33)")
    hosts, addrs, ports = _listed(params, "host"), _listed(params, "hostaddr"), _listed(params, "port")
    n = max(len(hosts), len(addrs))
    if n > MAX_HOSTS:
        raise _BadTask(f"{n} hosts: a connection string lists at most {MAX_HOSTS}")
    if hosts and addrs and len(hosts) != len(addrs):
        raise _BadTask(f"{len(hosts)} host names but {len(addrs)} hostaddr values")
    if len(ports) > 1 and len(ports) != n:
        raise _BadTask(f"{len(ports)} ports for {n} hosts")
    for p in ports:
        if not p.isdigit() or not 0 < int(p) < 65536:
            raise _BadTask(f"port {p[:20]!r} is not a number from 1 to 65535")
    if n == 0:
        raise Refused("postgres", "no host given: libpq would use its local unix socket, closed to tasks on this "
                                  "worker pool (D33); give host and port of a server the pool allows")
    out: list[tuple[str, str, str]] = []  # (host, hostaddr, port)
    first: tuple[str, Exception] | None = None  # the first host left out, and why
    for i in range(n):
        host = hosts[i] if hosts else ""
        addr = addrs[i] if addrs else ""
        port = ports[i] if len(ports) > 1 else ports[0] if ports else "5432"
        try:
            if addr:  # the task's own address: checked as is (its host name proves nothing, so is not matched)
                if not is_address(addr):
                    raise _BadTask(f"hostaddr {addr[:60]!r} is not an IP address")
                check_address(policy, "postgres", addr, int(port))
                out.append((host or addr, addr, port))
            elif not host or host.startswith(("/", "@")):
                raise Refused("postgres", f"host {host or '(empty)'!r} {_UNIX}")
            else:
                for address in await allowed_addresses(policy, "postgres", host, int(port), resolver):
                    out.append((host, address, port))
        except (Refused, OSError) as e:
            first = first or (host, e)
    if not out:
        assert first is not None
        host, e = first
        if isinstance(e, OSError):
            raise _ConnectError(f"cannot resolve {host!r}: {e.strerror or e}")
        raise e
    params.update(host=",".join(h for h, _, _ in out), hostaddr=",".join(a for _, a, _ in out),
                  port=",".join(p for _, _, p in out), **_TASK_FIXED)
    return _conninfo.make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})


async def _reset(conn: Any) -> None:
    """A connection back in the pool forgets its session (temporary tables, settings, prepared
    statements, advisory locks, LISTENs): the next task, of any execution, starts clean."""
    await conn.set_autocommit(True)
    try:
        await conn.execute("DISCARD ALL")
    finally:
        await conn.set_autocommit(False)


def _secrets(conninfo: str) -> list[str]:
    try:
        password = _conninfo.conninfo_to_dict(conninfo).get("password")
    except Exception:  # noqa: BLE001
        password = None
    return [s for s in (conninfo, str(password) if password else None) if s]


def _mask(message: str, secrets: list[str]) -> str:
    return masker(secrets).text(message)


# --------------------------------------------------------------------------------------- results


async def _run_plan(conn: Any, plan: list[tuple[str, Any]], timeout_ms: int | None) -> dict:
    async with conn.cursor() as cur:
        if timeout_ms:
            await cur.execute("SELECT set_config('statement_timeout', %s, true)", (str(timeout_ms),))
        *before, (last, last_params) = plan
        for stmt, params in before:
            await _execute(cur, stmt, params)
        if len(split_statements(last)) == 1 and _is_query(last):
            # a query: its rows come through a server-side cursor, a chunk at a time, so that reading
            # stops at the result limit without the server sending (or libpq holding) the rest
            async with conn.cursor(name="noetl_result") as rows:
                await rows.execute(last, last_params)
                return await _fetch(rows)
        await _execute(cur, last, last_params)
        while cur.nextset():  # several statements in one text: the last result counts
            pass
        if not cur.description:
            return {"rows": [], "columns": [], "row_count": max(cur.rowcount, 0)}
        return await _fetch(cur)


async def _execute(cur: Any, stmt: str, params: Any) -> None:
    if params is None:
        await cur.execute(stmt, prepare=False)
    else:
        await cur.execute(stmt, params)


async def _fetch(cur: Any) -> dict:
    """The rows of the cursor's result, fetched ``FETCH_ROWS`` at a time while their JSON size stays
    under ``max_result_bytes`` (past it: :class:`ResultTooLarge`)."""
    columns = [d.name for d in cur.description]
    budget = ResultBudget("the rows fetched")
    rows: list[dict] = []
    while True:
        raw = await cur.fetchmany(FETCH_ROWS)
        if not raw:
            return {"rows": rows, "columns": columns, "row_count": len(rows)}
        chunk = _shape_rows(columns, raw)
        budget.add(chunk)
        rows.extend(chunk)


def _pg_error(e: psycopg.Error, secrets: list[str]) -> dict:
    sqlstate = getattr(e, "sqlstate", None)
    diag = getattr(e, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    detail = getattr(diag, "message_detail", None) if diag is not None else None
    message = primary or str(e).strip() or type(e).__name__
    if detail:
        message = f"{message}\nDETAIL: {detail}"
    message = _mask(message, secrets)
    pg = {"code": sqlstate, "sqlstate": sqlstate}
    if sqlstate == "57014" or isinstance(e, psycopg.errors.QueryCanceled):
        return error("timeout", message, True, pg=pg)
    if sqlstate is None and isinstance(e, psycopg.OperationalError):
        return error("postgres_connect_error", message, True, pg=pg)  # the connection broke
    retryable = bool(sqlstate) and (sqlstate[:2] in _RETRYABLE_CLASSES or sqlstate in RETRYABLE_SQLSTATES)
    return error("postgres_error", message, retryable, pg=pg)


# ------------------------------------------------------------------------------------------ tool


class PostgresTool:
    """``kind: postgres`` (D27)."""

    kind = "postgres"

    def __init__(self, *, max_size: int = POOL_MAX_SIZE, connect_timeout: float = CONNECT_TIMEOUT,
                 policy: Policy | None = None, resolver: Resolver | None = None) -> None:
        """``policy``: the worker pool's (D33; default: nothing opened beyond the default), ``resolver``:
        how host names are resolved (default: the system's; tests give a stub)."""
        self._policy = policy if policy is not None else Policy()
        self._resolver = resolver
        self._max_size = max_size
        self._connect_timeout = connect_timeout
        self._pools: OrderedDict[str, AsyncConnectionPool] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task] = set()

    async def _pool(self, conninfo: str, timeout: float) -> AsyncConnectionPool:
        """The pool of ``conninfo``, made on first use after one direct connection (a bad address or
        password fails fast with the server's reason, instead of the pool retrying in the background
        until its wait runs out), which has ``timeout`` seconds in all, whatever hosts it tries. No
        lock is held meanwhile: a task waiting on a silent server holds up no other connection
        string's. At most :data:`MAX_POOLS` are kept: past it the least recently used is closed."""
        pool = self._pools.get(conninfo)
        if pool is None:
            try:
                probe = await asyncio.wait_for(psycopg.AsyncConnection.connect(
                    conninfo, connect_timeout=max(1, int(timeout + 0.999))), timeout)
            except asyncio.TimeoutError:
                raise _ConnectError(f"no connection within {timeout:g}s") from None
            except psycopg.Error as e:
                raise _ConnectError(str(e).strip() or type(e).__name__) from None
            await probe.close()
            made = AsyncConnectionPool(conninfo, min_size=0, max_size=self._max_size, open=False,
                                       max_idle=POOL_MAX_IDLE, timeout=self._connect_timeout,
                                       name="noetl-postgres", reset=_reset)
            await made.open(wait=False)
            pool = self._pools.get(conninfo)
            if pool is not None:  # another task made one meanwhile: that one is kept
                self._close(made)
            else:
                pool = self._pools[conninfo] = made
                while len(self._pools) > MAX_POOLS:
                    self._close(self._pools.popitem(last=False)[1])
        self._pools.move_to_end(conninfo)
        return pool

    def _close(self, pool: AsyncConnectionPool) -> None:
        """Close ``pool`` in the background: a connection in use is closed as its task returns it."""
        closing = asyncio.create_task(pool.close(timeout=self._connect_timeout))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def _execute(self, conninfo: str, plan: list[tuple[str, Any]], timeout: float | None) -> dict:
        connect_wait = min(self._connect_timeout, timeout) if timeout else self._connect_timeout
        pool = await self._pool(conninfo, connect_wait)
        try:
            try:
                conn = await pool.getconn(timeout=connect_wait)
            except PoolClosed:  # closed as the least recently used meanwhile: its connection string's next
                pool = await self._pool(conninfo, connect_wait)
                conn = await pool.getconn(timeout=connect_wait)
        except PoolTimeout as e:
            raise _ConnectError(f"no connection within {connect_wait:g}s ({e})") from None
        try:
            result = await _run_plan(conn, plan, int(timeout * 1000) if timeout else None)
            await conn.commit()
            return result
        except BaseException:
            try:
                await asyncio.shield(conn.rollback())
            except BaseException:  # noqa: BLE001 - the pool discards a broken connection
                pass
            raise
        finally:
            await asyncio.shield(pool.putconn(conn))

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        sql = task.get("command")
        if sql is None:
            sql = task.get("query")
        if not isinstance(sql, str) or not sql.strip():
            return error("invalid_task", "postgres task needs 'command' (alias 'query'): SQL text")
        params = task.get("params")
        if params is not None and not isinstance(params, (list, tuple, Mapping)):
            return error("invalid_task", f"'params' must be a list or a mapping, got {type(params).__name__}")
        try:
            conninfo = _conninfo_for(task, ctx.keychain or {})
        except _BadTask as e:
            return error("invalid_task", str(e))
        secrets = _secrets(conninfo)
        timeout, said = task_timeout(ctx.timeout if ctx.timeout is not None else spec.get("timeout"), DEFAULT_TIMEOUT)
        plan = _plan(sql, dict(params) if isinstance(params, Mapping) else params)

        async def checked_then_executed() -> dict:  # D33: libpq connects to the checked addresses only
            return await self._execute(await _pinned(conninfo, self._policy, self._resolver), plan, timeout)

        how, work = await bounded(checked_then_executed(), ctx.cancel, timeout + GRACE)
        if how == "cancelled":
            return error("cancelled", "postgres task cancelled")
        if how == "timeout":
            return error("timeout", f"postgres task exceeded its timeout of {said}", True)
        try:
            return ok(work.result())
        except ResultTooLarge as e:
            return e.outcome(ctx)
        except Refused as e:
            return error(Refused.kind, _mask(str(e), secrets))
        except _BadTask as e:
            return error("invalid_task", _mask(str(e), secrets))
        except _ConnectError as e:
            return error("postgres_connect_error", _mask(f"cannot connect to postgres: {e}", secrets), True)
        except psycopg.Error as e:
            return _pg_error(e, secrets)
        except Exception as e:  # noqa: BLE001 - e.g. a value psycopg cannot adapt
            return error("postgres_error", _mask(f"{type(e).__name__}: {e}", secrets), pg={"code": None, "sqlstate": None})

    async def close(self) -> None:
        pools, self._pools = self._pools, OrderedDict()
        for pool in pools.values():
            try:
                await pool.close()
            except Exception:  # noqa: BLE001
                pass
        await asyncio.gather(*self._closing, return_exceptions=True)
