"""The recorder's Postgres schema: migrations, and the mapping between an event and its row.

Migrations are numbered and applied in order at start, each once (``schema_version``), under an
advisory lock so that replicas starting together do not race; every statement is idempotent anyway
(``IF NOT EXISTS``), so a half-applied migration can simply run again.

``event`` keeps one row per event id (D21) with the envelope's fields as columns (``data`` as jsonb,
any other top-level key in ``extra``) and ``seq``, the event's place in the log: ``bus.log_seq`` (stream sequence x 1024 + index in its message).
:func:`event_row` and :func:`row_event` are inverse: a row rebuilds the envelope that was published
(``timestamp`` back as a float epoch, to the microsecond Postgres keeps) plus ``seq``.
"""
from __future__ import annotations

from typing import Any, Sequence

import orjson
from psycopg import AsyncConnection

from noetl_mesh.core.events import CORRELATION_KEYS

from . import credentials as _credentials

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
    _credentials.MIGRATION,  # 2: the credential store (D24)
    (3, "who started each execution", """
ALTER TABLE execution ADD COLUMN IF NOT EXISTS requested_by text;
CREATE INDEX IF NOT EXISTS execution_requested_by_created ON execution (requested_by, created_at DESC);
"""),
]

_LOCK = 0x6E6F65746C  # "noetl": serialises migrations across replicas


async def migrate(conn: AsyncConnection) -> int:
    """Apply the missing migrations; returns the schema version now in place."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
        await conn.execute("""CREATE TABLE IF NOT EXISTS schema_version (
            version int PRIMARY KEY, description text, applied_at timestamptz NOT NULL DEFAULT now())""")
        cur = await conn.execute("SELECT coalesce(max(version), 0) FROM schema_version")
        current = (await cur.fetchone())[0]
        for version, description, ddl in MIGRATIONS:
            if version > current:
                await conn.execute(ddl)
                await conn.execute("INSERT INTO schema_version (version, description) VALUES (%s, %s)",
                                   (version, description))
                current = version
    return current


# ------------------------------------------------------------------------------------ event rows
ENVELOPE = ("event_id", "execution_id", "timestamp", "source", "name", "entity", "entity_id", "status",
            "step", "task", "data", *CORRELATION_KEYS)
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
INSERT_FROM_STAGE = f"""INSERT INTO event ({_EVENT_COLUMNS})
    SELECT {_STAGE_SELECT} FROM event_in ORDER BY seq ON CONFLICT (event_id) DO NOTHING"""
INSERT_EVENT = f"""INSERT INTO event ({_EVENT_COLUMNS})
    VALUES ({', '.join('to_timestamp(%s)' if c == 'ts' else '%s' for c in STAGE_COLUMNS)})
    ON CONFLICT (event_id) DO NOTHING"""

SELECT_EVENT = f"""SELECT seq, {', '.join(_TEXT)}, extract(epoch FROM "timestamp")::float8,
    attempt, iteration, data, extra FROM event"""


def _json(value: Any) -> str:
    text = orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)
    if b"\\u0000" in text:  # jsonb cannot hold NUL in a string: keep the event, lose the NULs
        text = orjson.dumps(_without_nul(orjson.loads(text)))
    return text.decode()


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    return value


def event_row(seq: int, event: dict[str, Any]) -> tuple:
    """The staging row of one event (``STAGE_COLUMNS`` order; json as text)."""
    extra = {k: v for k, v in event.items() if k not in ENVELOPE}
    row: list[Any] = [seq]
    for key in _TEXT:
        value = event.get(key)
        if value is not None and not isinstance(value, str):
            extra[key] = value  # odd type: the column stays null, the value is kept as sent
            value = None
        row.append(value.replace("\x00", "\ufffd") if value is not None else None)
    ts = event.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        extra["timestamp"], ts = ts, None
    row.append(ts)
    for key in _INT:
        value = event.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**31):
            extra[key], value = value, None
        row.append(value)
    row.append(_json(event.get("data") if event.get("data") is not None else {}))
    row.append(_json(extra) if extra else None)
    return tuple(row)


def row_event(row: Sequence[Any]) -> dict[str, Any]:
    """Rebuild the envelope (plus ``seq``) from a ``SELECT_EVENT`` row."""
    seq, *rest = row
    text = dict(zip(_TEXT, rest[: len(_TEXT)]))
    ts, attempt, iteration, data, extra = rest[len(_TEXT):]
    event = {
        "event_id": text["event_id"], "execution_id": text["execution_id"], "timestamp": ts,
        "source": text["source"], "name": text["name"], "entity": text["entity"],
        "entity_id": text["entity_id"], "status": text["status"], "step": text["step"],
        "task": text["task"], "data": data,
    }
    for key in CORRELATION_KEYS:
        event[key] = attempt if key == "attempt" else iteration if key == "iteration" else text[key]
    if extra:
        event.update(extra)
    event["seq"] = seq
    return event
