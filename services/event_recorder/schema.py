"""The recorder's Postgres schema: migrations, and the mapping between an event and its row.

Migrations are numbered and applied in order at start, each once (``schema_version``), under an
advisory lock so that replicas starting together do not race; every statement is idempotent anyway
(``IF NOT EXISTS``), so a half-applied migration can simply run again.

``event`` keeps one row per event id (D21) with the envelope's fields as columns (``data`` as jsonb,
any other top-level key in ``extra``) and ``seq``, the event's place in the log: ``bus.log_seq`` (stream sequence x 1024 + index in its message).
:func:`event_row` and :func:`row_event` are inverse: a row rebuilds the envelope that was published
(``timestamp`` back as a float epoch, to the microsecond Postgres keeps) plus ``seq``.

Events are written by users (workloads, playbooks, task results), so a value may be one Postgres
refuses. Rows and projection parameters are made storable here, so the batch path never fails on
them (:func:`text`, :func:`json_text`): NUL becomes the six characters ``\\u0000`` (text and jsonb
refuse it), an unpaired surrogate ``\\udXXX`` (not UTF-8), NaN and infinities the strings ``"NaN"``,
``"Infinity"``, ``"-Infinity"`` (not JSON), an integer beyond 64 bits its digits, and a timestamp
Postgres cannot hold moves to ``extra``. What Postgres refuses anyway is recorded as :func:`rejected`.
:func:`transient` tells a failure worth retrying (the database) from one that retrying cannot fix
(the row).

The ``execution`` projection's statements (:func:`projection`) are here too: one mapping from events
to what Postgres stores.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import time
from typing import Any, Sequence

import orjson
import psycopg
from psycopg import AsyncConnection
from psycopg_pool import PoolTimeout

from noetl_mesh.core.events import CORRELATION_KEYS
from noetl_mesh.core.state import FINAL
from noetl_mesh.infra import pg_migrations
from noetl_mesh.infra.bus import DISPATCH_EVENTS, INFO_EVENTS, LOOP_EVENTS


# What a view of an execution's state folds: its ``ctl`` events (bus.event_class): task progress and loop
# bookkeeping change no step's status or result (a loop's result and counts are on its loop.done). The
# condition is written out (not a parameter) so that the planner can use the partial index of migration 5,
# whose predicate is the same text; loop iterations are counted through the other one.
NOT_STATE = tuple(sorted(INFO_EVENTS | LOOP_EVENTS | DISPATCH_EVENTS))
STATE_EVENTS_SQL = "NOT (name = ANY (ARRAY[" + ", ".join(f"'{n}'" for n in NOT_STATE) + "]::text[]))"
ITERATION_EVENTS = ("loop.iteration.started", "loop.iteration.done", "loop.iteration.failed")
LOOP_EVENTS_SQL = "name = ANY (ARRAY[" + ", ".join(f"'{n}'" for n in ("loop.started", *ITERATION_EVENTS)) + "]::text[])"

MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "event log, catalog, execution projection", """
CREATE TABLE IF NOT EXISTS event (
    seq             bigint NOT NULL,
    event_id        text PRIMARY KEY,
    execution_id    text NOT NULL,
    name            text NOT NULL,
    source          text,
    entity          text,
    entity_id       text,
    status          text,
    step            text,
    task            text,
    "timestamp"     timestamptz,
    workflow_run_id text,
    step_run_id     text,
    task_run_id     text,
    parent_id       text,
    action_id       text,
    attempt         int,
    iteration       int,
    data            jsonb,
    extra           jsonb
);
CREATE INDEX IF NOT EXISTS event_execution_seq ON event (execution_id, seq);

CREATE TABLE IF NOT EXISTS catalog (
    id         bigserial PRIMARY KEY,
    path       text NOT NULL,
    version    int NOT NULL,
    name       text,
    content    text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (path, version)
);

CREATE TABLE IF NOT EXISTS execution (
    execution_id        text PRIMARY KEY,
    path                text,
    version             int,
    status              text NOT NULL DEFAULT 'PENDING',
    parent_execution_id text,
    created_at          timestamptz,
    started_at          timestamptz,
    finished_at         timestamptz,
    error               jsonb
);
CREATE INDEX IF NOT EXISTS execution_created ON execution (created_at DESC);
CREATE INDEX IF NOT EXISTS execution_status_created ON execution (status, created_at DESC);
"""),
    # 2 made the credential table, which the credentials service keeps now (services/credentials/store.py:
    # the same table); kept as a number so that the versions of existing databases still line up
    (2, "credential store (moved to the credentials service)", "SELECT 1"),
    (3, "who started each execution", """
ALTER TABLE execution ADD COLUMN IF NOT EXISTS requested_by text;
CREATE INDEX IF NOT EXISTS execution_requested_by_created ON execution (requested_by, created_at DESC);
"""),
    (4, "waits of wait tasks, the inbox of human tasks (D30)", """
CREATE TABLE IF NOT EXISTS wait (
    wait_id      text PRIMARY KEY,
    execution_id text NOT NULL,
    step         text,
    task         text,
    step_run_id  text,
    iteration    int,
    kind         text,
    signal       text,
    spec         jsonb,
    started_at   timestamptz,
    ended_at     timestamptz
);
CREATE INDEX IF NOT EXISTS wait_open ON wait (started_at DESC) WHERE ended_at IS NULL;
CREATE INDEX IF NOT EXISTS wait_execution ON wait (execution_id);
"""),
    # An execution's state is a fold of its few ctl events: without this index it reads every row of the
    # execution (400,000 for a 100,000-iteration loop). Partial, so only those rows pay for an entry. The
    # counters are kept by the statement that inserts the events (INSERT_EVENTS below): an execution's number
    # of events (NULL for one recorded before this migration: counted then) and each loop run's iterations;
    # the second index counts iterations up to a point of the log (time travel). On a big existing table
    # the indexes take a while to build, once.
    (5, "the state events of an execution; counters of events and of loop iterations", f"""
CREATE INDEX IF NOT EXISTS event_state ON event (execution_id, seq) WHERE {STATE_EVENTS_SQL};
CREATE INDEX IF NOT EXISTS event_loops ON event (execution_id, step_run_id, name, seq) INCLUDE ("timestamp")
    WHERE {LOOP_EVENTS_SQL};
ALTER TABLE execution ADD COLUMN IF NOT EXISTS event_count bigint;
ALTER TABLE execution ALTER COLUMN event_count SET DEFAULT 0;
CREATE TABLE IF NOT EXISTS loop_progress (
    execution_id text NOT NULL,
    step_run_id  text NOT NULL,
    started      bigint NOT NULL DEFAULT 0,
    done         bigint NOT NULL DEFAULT 0,
    failed       bigint NOT NULL DEFAULT 0,
    first_at     timestamptz,
    last_at      timestamptz,
    PRIMARY KEY (execution_id, step_run_id)
);
"""),
    # D32: the execution a restart goes on from; the index lists an execution's restarts (partial: most
    # executions are not restarts)
    (6, "the execution each restart goes on from", """
ALTER TABLE execution ADD COLUMN IF NOT EXISTS restarted_from text;
CREATE INDEX IF NOT EXISTS execution_restarts ON execution (restarted_from, created_at) WHERE restarted_from IS NOT NULL;
"""),
    # D33: who registered each version ({user_id, username}): a pool that names its roles checks the
    # author of the code it runs as well as whoever started it; null for versions registered before
    (7, "who registered each catalog version", """
ALTER TABLE catalog ADD COLUMN IF NOT EXISTS registered_by jsonb;
"""),
    # the executions list's order (newest first, nulls last, then by id) as indexes: the earlier ones
    # (created_at DESC: nulls first) did not match it, and every page sorted the whole table (0.4 s a
    # page with ~100,000 executions on a loaded machine: one user's list queries held up everyone's).
    # The builds come first (they block writes to the table, not reads); the drops, which block both,
    # last, just before the commit
    (8, "indexes in the executions list's order", """
CREATE INDEX IF NOT EXISTS execution_listed ON execution (created_at DESC NULLS LAST, execution_id);
CREATE INDEX IF NOT EXISTS execution_listed_status ON execution (status, created_at DESC NULLS LAST, execution_id);
CREATE INDEX IF NOT EXISTS execution_listed_user ON execution (requested_by, created_at DESC NULLS LAST, execution_id);
CREATE INDEX IF NOT EXISTS execution_listed_path ON execution (path, created_at DESC NULLS LAST, execution_id);
DROP INDEX IF EXISTS execution_created;
DROP INDEX IF EXISTS execution_status_created;
DROP INDEX IF EXISTS execution_requested_by_created;
"""),
]

_LOCK = 0x6E6F65746C  # "noetl": serialises migrations across replicas


async def migrate(conn: AsyncConnection) -> int:
    """Apply the missing migrations (replicas starting together wait on an advisory lock); the schema version now in place."""
    return await pg_migrations.apply(conn, MIGRATIONS, table="schema_version", lock=_LOCK)


# ------------------------------------------------------------------------ values Postgres can store
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")  # NUL; surrogates (in a str, always unpaired)


def _escape(match: re.Match) -> str:
    return f"\\u{ord(match.group()):04x}"


def text(value: str) -> str:
    """``value`` as a text column can hold it: NUL and unpaired surrogates escaped (``\\u0000``)."""
    if "\x00" in value or (not value.isascii() and _UNSTORABLE.search(value)):
        return _UNSTORABLE.sub(_escape, value)
    return value


def unstorable(value: str) -> str | None:
    """Why Postgres cannot store ``value`` as text, or None."""
    if "\x00" in value:
        return "contains a NUL character (\\u0000)"
    if not value.isascii() and (m := _UNSTORABLE.search(value)):
        return f"contains an unpaired surrogate (\\u{ord(m.group()):04x}), which is not UTF-8"
    return None


def clean(value: Any) -> Any:
    """``value`` with every string (keys too) as :func:`text` makes it, every NaN or infinity as a
    string, every integer beyond 64 bits as its digits: a JSON value jsonb accepts and every service
    (orjson) can carry."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, int) and not -2**63 <= value < 2**64:
        return str(value)
    if isinstance(value, dict):
        return {text(k) if isinstance(k, str) else k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def json_text(value: Any) -> str:
    """``value`` as JSON text a jsonb column accepts."""
    try:
        data = orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # an unpaired surrogate, an integer over 64 bits, nesting deeper than orjson goes
        return json.dumps(clean(value), default=str, ensure_ascii=False)
    if b"\\u0000" in data:  # jsonb refuses NUL even escaped
        return orjson.dumps(clean(value), default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    return data.decode()


def decode(data: bytes) -> Any:
    """A message's JSON. What orjson refuses but the standard library reads (unpaired surrogates, NaN,
    Infinity, bytes that are not UTF-8) is read and cleaned (:func:`clean`): such an event is recorded, not
    lost. Raises ``ValueError`` for what is not JSON at all."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            decoded = data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            decoded = data.decode("utf-8", "surrogateescape")
        return clean(json.loads(decoded))


_TS_RANGE = 1e11  # seconds around 1970 (years -1200 to 5100): inside what timestamptz holds


def timestamp(value: Any) -> float | None:
    """An epoch ``to_timestamp`` accepts, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and -_TS_RANGE < value < _TS_RANGE:
        return value
    return None


# --------------------------------------------------------------------------------- failures
# SQLSTATE classes of a database that is down, busy or being changed by its operator: retry the same
# batch. Anything else (data exceptions 22, integrity 23, program limits 54, a trigger's exception,
# a value the driver cannot send) is the row's: retrying cannot fix it.
_TRANSIENT_CLASSES = ("08", "40", "53", "55", "57", "58")
_TRANSIENT_STATES = frozenset({
    "42P01", "42703", "42501",  # undefined table or column, no privilege: the schema or grants are being changed
    "3D000", "28000", "28P01",  # database missing, authentication: the operator's to fix
    "25006",  # read-only transaction: a standby being promoted
})


def transient(exc: BaseException) -> bool:
    """Whether a failure to write is the database's (retry) rather than the data's (split, reject)."""
    if isinstance(exc, (PoolTimeout, OSError)):  # OSError: connections, timeouts
        return True
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        if state:
            return state[:2] in _TRANSIENT_CLASSES or state in _TRANSIENT_STATES
        return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))  # connection lost
    return False


# ------------------------------------------------------------------------------------ event rows
ENVELOPE = frozenset(("event_id", "execution_id", "timestamp", "source", "name", "entity", "entity_id", "status",
                      "step", "task", "data", *CORRELATION_KEYS))
_TEXT = ("event_id", "execution_id", "name", "source", "entity", "entity_id", "status", "step", "task",
         "workflow_run_id", "step_run_id", "task_run_id", "parent_id", "action_id")
_INT = ("attempt", "iteration")

# the staging table COPY writes into (per connection, emptied at commit); ``ts`` is the float epoch
STAGE_COLUMNS = ("seq", *_TEXT, "ts", *_INT, "data", "extra")
CREATE_STAGE = f"""CREATE TEMP TABLE IF NOT EXISTS event_in (
    seq bigint, {', '.join(f'{c} text' for c in _TEXT)}, ts float8, attempt int, iteration int,
    data jsonb, extra jsonb) ON COMMIT DELETE ROWS"""
COPY_STAGE = f"COPY event_in ({', '.join(STAGE_COLUMNS)}) FROM STDIN"
_EVENT_COLUMNS = ", ".join(c if c != "ts" else '"timestamp"' for c in STAGE_COLUMNS)
_STAGE_SELECT = ", ".join(c if c != "ts" else "to_timestamp(ts)" for c in STAGE_COLUMNS)
_ITERATIONS_SQL = ", ".join(f"'{n}'" for n in ITERATION_EVENTS)
# Insert the staged rows (a duplicate, D21, is not inserted) and add what was inserted to the counters, in
# one statement: each execution's events, each loop run's iterations started, done and failed (first and
# last: of the iterations that ended, for the rate). The execution rows are the projection's (written first).
INSERT_EVENTS = f"""WITH inserted AS (INSERT INTO event ({_EVENT_COLUMNS})
    SELECT {_STAGE_SELECT} FROM event_in ORDER BY seq ON CONFLICT (event_id) DO NOTHING
    RETURNING execution_id, name, step_run_id, "timestamp"),
counted AS (UPDATE execution AS x SET event_count = x.event_count + c.n
    FROM (SELECT execution_id, count(*) AS n FROM inserted GROUP BY 1) c WHERE x.execution_id = c.execution_id)
INSERT INTO loop_progress AS p (execution_id, step_run_id, started, done, failed, first_at, last_at)
SELECT execution_id, step_run_id, count(*) FILTER (WHERE name = 'loop.iteration.started'),
    count(*) FILTER (WHERE name = 'loop.iteration.done'), count(*) FILTER (WHERE name = 'loop.iteration.failed'),
    min("timestamp") FILTER (WHERE name <> 'loop.iteration.started'),
    max("timestamp") FILTER (WHERE name <> 'loop.iteration.started')
FROM inserted WHERE name IN ({_ITERATIONS_SQL}) AND step_run_id IS NOT NULL GROUP BY 1, 2
ON CONFLICT (execution_id, step_run_id) DO UPDATE SET
    started = p.started + excluded.started, done = p.done + excluded.done, failed = p.failed + excluded.failed,
    first_at = least(p.first_at, excluded.first_at), last_at = greatest(p.last_at, excluded.last_at)"""

SELECT_EVENT = f"""SELECT seq, {', '.join(_TEXT)}, extract(epoch FROM "timestamp")::float8,
    attempt, iteration, data, extra FROM event"""


def _small_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**31 else None


def event_row(seq: int, event: dict[str, Any]) -> tuple:
    """The staging row of one event (``STAGE_COLUMNS`` order; json as text), every value storable."""
    extra = {k: v for k, v in event.items() if k not in ENVELOPE}
    row: list[Any] = [seq]
    for key in _TEXT:
        value = event.get(key)
        if value is not None:
            if not isinstance(value, str):
                extra[key] = value  # odd type: the column stays null, the value is kept as sent
                value = None
            elif "\x00" in value or not value.isascii():  # (the test inline: this loop is the hot path)
                value = text(value)
        row.append(value)
    ts = event.get("timestamp")
    if ts is not None and timestamp(ts) is None:
        extra["timestamp"], ts = ts, None
    row.append(ts)
    for key in _INT:
        value = event.get(key)
        if value is not None and _small_int(value) is None:
            extra[key], value = value, None
        row.append(value)
    row.append(json_text(event.get("data") if event.get("data") is not None else {}))
    row.append(json_text(extra) if extra else None)
    return tuple(row)


def row_event(row: Sequence[Any]) -> dict[str, Any]:
    """Rebuild the envelope (plus ``seq``) from a ``SELECT_EVENT`` row."""
    seq, *rest = row
    text_ = dict(zip(_TEXT, rest[: len(_TEXT)]))
    ts, attempt, iteration, data, extra = rest[len(_TEXT):]
    event = {
        "event_id": text_["event_id"], "execution_id": text_["execution_id"], "timestamp": ts,
        "source": text_["source"], "name": text_["name"], "entity": text_["entity"],
        "entity_id": text_["entity_id"], "status": text_["status"], "step": text_["step"],
        "task": text_["task"], "data": data,
    }
    for key in CORRELATION_KEYS:
        event[key] = attempt if key == "attempt" else iteration if key == "iteration" else text_[key]
    if extra:
        event.update(extra)
    event["seq"] = seq
    return event


_KEEP = 256  # a rejected event's strings are cut to about this many characters


def _cut(value: str) -> str:
    value = text(value)
    if len(value) <= _KEEP:
        return value
    return f"{value[:_KEEP - 40]}...sha256:{hashlib.sha256(value.encode()).hexdigest()[:24]}"


def rejected(event: dict[str, Any], reason: str) -> dict[str, Any]:
    """The event as recorded when Postgres refuses it even made storable: its name and ids (strings
    only; a long one cut, with a digest of the whole, so a redelivery makes the same id), its
    timestamp and numbers, and ``data = {"unrecordable": reason}``; nothing else."""
    out: dict[str, Any] = {key: _cut(event[key]) for key in _TEXT if isinstance(event.get(key), str)}
    out.update({key: event[key] for key in _INT if _small_int(event.get(key)) is not None})
    if timestamp(event.get("timestamp")) is not None:
        out["timestamp"] = event["timestamp"]
    out["data"] = {"unrecordable": text(reason)[:2000]}
    return out


def is_rejected(event: dict[str, Any]) -> bool:
    data = event.get("data")
    return isinstance(data, dict) and set(data) == {"unrecordable"}


# ------------------------------------------------------------------------ the execution projection
UPSERT_REQUESTED = """
INSERT INTO execution AS x (execution_id, path, version, status, parent_execution_id, created_at, requested_by,
                            restarted_from)
VALUES (%(id)s, coalesce(%(path)s, (SELECT path FROM catalog WHERE id = %(catalog_id)s)),
        coalesce(%(version)s, (SELECT version FROM catalog WHERE id = %(catalog_id)s)),
        'PENDING', %(parent)s, to_timestamp(%(ts)s),
        coalesce(%(by)s, (SELECT requested_by FROM execution WHERE execution_id = %(parent)s)), %(restarted_from)s)
ON CONFLICT (execution_id) DO UPDATE SET
    path = coalesce(x.path, excluded.path), version = coalesce(x.version, excluded.version),
    parent_execution_id = coalesce(x.parent_execution_id, excluded.parent_execution_id),
    created_at = least(x.created_at, excluded.created_at),
    requested_by = coalesce(x.requested_by, excluded.requested_by),
    restarted_from = coalesce(x.restarted_from, excluded.restarted_from)"""
UPDATE_EVALUATED = """
UPDATE execution SET path = coalesce(path, %(path)s), version = coalesce(version, %(version)s)
WHERE execution_id = %(id)s"""
UPSERT_STARTED = """
INSERT INTO execution AS x (execution_id, status, created_at, started_at)
VALUES (%(id)s, 'RUNNING', to_timestamp(%(ts)s), to_timestamp(%(ts)s))
ON CONFLICT (execution_id) DO UPDATE SET
    status = CASE WHEN x.status = 'PENDING' THEN 'RUNNING' ELSE x.status END,
    started_at = coalesce(x.started_at, excluded.started_at)"""
UPSERT_FINISHED = """
INSERT INTO execution AS x (execution_id, status, created_at, finished_at, error)
VALUES (%(id)s, %(status)s, to_timestamp(%(ts)s), to_timestamp(%(ts)s), %(error)s::jsonb)
ON CONFLICT (execution_id) DO UPDATE SET
    status = excluded.status, finished_at = excluded.finished_at, error = excluded.error"""


INSERT_WAIT = """
INSERT INTO wait (wait_id, execution_id, step, task, step_run_id, iteration, kind, signal, spec, started_at)
VALUES (%(wait_id)s, %(id)s, %(step)s, %(task)s, %(run)s, %(iteration)s, %(kind)s, %(signal)s, %(spec)s::jsonb,
        to_timestamp(%(ts)s))
ON CONFLICT (wait_id) DO NOTHING"""
END_WAIT = "UPDATE wait SET ended_at = to_timestamp(%(ts)s) WHERE wait_id = %(wait_id)s AND ended_at IS NULL"
# the ends of runs (and of iterations) of a whole batch in one statement, not one per event: a
# 100,000-iteration loop has as many iteration ends, and its waits are usually none; a wait several ends
# match ends at the first of them
END_RUN_WAITS = """UPDATE wait AS w SET ended_at = to_timestamp(m.ts)
FROM (SELECT o.wait_id, min(u.ts) AS ts
      FROM unnest(%(ids)s::text[], %(runs)s::text[], %(iterations)s::int[], %(ts)s::float8[]) AS u(id, run, iteration, ts)
      JOIN wait o ON o.execution_id = u.id AND o.step_run_id = u.run AND (u.iteration IS NULL OR o.iteration = u.iteration)
                 AND o.ended_at IS NULL
      GROUP BY o.wait_id) m
WHERE w.wait_id = m.wait_id"""
END_EXECUTION_WAITS = "UPDATE wait SET ended_at = to_timestamp(%(ts)s) WHERE execution_id = %(id)s AND ended_at IS NULL"
_RUN_ENDS = ("step.done", "step.failed", "loop.done", "loop.iteration.done", "loop.iteration.failed")


def _str(value: Any) -> str | None:
    return text(value) if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def projection(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The projection updates a batch of events implies, by statement, in log order; every parameter
    storable."""
    out: dict[str, list[dict[str, Any]]] = {
        UPSERT_REQUESTED: [], UPDATE_EVALUATED: [], UPSERT_STARTED: [], UPSERT_FINISHED: [],
        INSERT_WAIT: [], END_WAIT: [], END_RUN_WAITS: [], END_EXECUTION_WAITS: []}
    ends: list[tuple[str, str, int | None, float]] = []  # END_RUN_WAITS: (execution, run, iteration, time)
    for e in events:
        name, data = e.get("name"), _dict(e.get("data"))
        ts = timestamp(e.get("timestamp"))
        ts = time.time() if ts is None else ts
        xid = text(e["execution_id"])
        if name == "playbook.execution.requested":
            catalog, meta = _dict(data.get("catalog")), _dict(_dict(data.get("playbook")).get("metadata"))
            out[UPSERT_REQUESTED].append({
                "id": xid, "path": _str(catalog.get("path")) or _str(meta.get("path")),
                "version": _small_int(catalog.get("version")), "catalog_id": _small_int(catalog.get("id")),
                "parent": _str(data.get("parent_execution_id")), "ts": ts,
                # who started it (the gateway's caller); a child without one takes its parent's
                "by": _str(_dict(data.get("requested_by")).get("user_id")),
                "restarted_from": _str(_dict(data.get("restarted_from")).get("execution"))})  # D32
        elif name == "playbook.request.evaluated" and e.get("status") != "error":
            out[UPDATE_EVALUATED].append({"id": xid, "path": _str(data.get("path")),
                                          "version": _small_int(data.get("version"))})
        elif name == "workflow.started":
            out[UPSERT_STARTED].append({"id": xid, "ts": ts})
        elif name == "workflow.finished":
            status = data.get("status") if data.get("status") in FINAL else "FAILED"
            error = data.get("error")
            out[UPSERT_FINISHED].append({"id": xid, "status": status, "ts": ts,
                                         "error": json_text(error) if error is not None else None})
            out[END_EXECUTION_WAITS].append({"id": xid, "ts": ts})
        elif name == "wait.started" and isinstance(data.get("wait_id"), str):  # D30: the inbox
            spec = _dict(data.get("spec"))
            out[INSERT_WAIT].append({
                "wait_id": text(data["wait_id"]), "id": xid, "step": _str(e.get("step")), "task": _str(e.get("task")),
                "run": _str(e.get("step_run_id")), "iteration": _small_int(e.get("iteration")),
                "kind": _str(data.get("kind")), "signal": _str(spec.get("signal")), "spec": json_text(spec), "ts": ts})
        elif name == "wait.ended" and isinstance(data.get("wait_id"), str):
            out[END_WAIT].append({"wait_id": text(data["wait_id"]), "ts": ts})
        elif name in _RUN_ENDS and isinstance(e.get("step_run_id"), str):  # a run that ended stops waiting
            ends.append((xid, text(e["step_run_id"]),
                         _small_int(e.get("iteration")) if name.startswith("loop.it") else None, ts))
    if ends:  # one statement of arrays for the batch
        out[END_RUN_WAITS] = [{key: [end[i] for end in ends] for i, key in enumerate(("ids", "runs", "iterations", "ts"))}]
    return {sql: params for sql, params in out.items() if params}
