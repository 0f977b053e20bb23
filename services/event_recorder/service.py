"""event-recorder: the only service that owns Postgres.

It reads every event of ``NOETL_EVENTS`` through one durable pull consumer and writes them in batches
(one transaction per batch: the events, then the ``execution`` projection), acknowledging a batch only
once it is committed. It also keeps the playbook catalog, and answers the read queries of the gateway
over NATS request/reply (``noetl.q.catalog.*``, ``noetl.q.execution.*``, ``noetl.q.recorder.ping``).

Consumption and acknowledgement. The consumer uses ``AckPolicy.ALL``: acking a message acks every
message of a lower stream sequence. That is only safe when nothing below it is still unrecorded, which
is not the case when a previous recorder died holding a fetched batch (its messages stay pending until
``ack_wait`` runs out). So the recorder acks the highest sequence it holds only when every sequence
between the consumer's ack floor and it has been recorded by this process, or the server confirms
that the only outstanding messages are ours; otherwise it keeps recording and waits for the
redelivery. A batch that cannot be written (database down) is retried in place, with backoff, before
anything newer is fetched: a ``nak`` followed by further fetches would let a later cumulative ack
cover the nak'ed messages. Recording is idempotent (``ON CONFLICT (event_id) DO NOTHING``, D21), so
redeliveries are harmless. Run one recorder per events stream.

Execution state for ``noetl.q.execution.get`` is rebuilt from the recorded events with the engine's
own fold (D22); the ``execution`` table is only a projection for lists and filters.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
from nats.js.api import AckPolicy
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from noetl_mesh.core.state import FINAL, fold, summary
from noetl_mesh.infra.bus import (
    DISPATCH_EVENTS,
    EVENTS,
    INFO_EVENTS,
    LOOP_EVENTS,
    Q_CATALOG_GET,
    Q_CATALOG_LIST,
    Q_CATALOG_REGISTER,
    Q_EXECUTION_EVENTS,
    Q_EXECUTION_GET,
    Q_EXECUTION_LIST,
    Q_RECORDER_PING,
    Bus,
    BusError,
    loads,
    log_seq,
)
from noetl_mesh.lang.validate import validate_text

from . import credentials, schema

log = logging.getLogger("noetl.event-recorder")

DURABLE = "event-recorder"
NOT_SUMMARY = sorted(INFO_EVENTS | LOOP_EVENTS | DISPATCH_EVENTS)
QUEUE = "event-recorder"
FILTER = "noetl.pevt.>"


STATUSES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED")
MAX_PAGE = 1000

# --------------------------------------------------------------------------- projection statements
_UPSERT_REQUESTED = """
INSERT INTO execution AS x (execution_id, path, version, status, parent_execution_id, created_at, requested_by)
VALUES (%(id)s, coalesce(%(path)s, (SELECT path FROM catalog WHERE id = %(catalog_id)s)),
        coalesce(%(version)s, (SELECT version FROM catalog WHERE id = %(catalog_id)s)),
        'PENDING', %(parent)s, to_timestamp(%(ts)s),
        coalesce(%(by)s, (SELECT requested_by FROM execution WHERE execution_id = %(parent)s)))
ON CONFLICT (execution_id) DO UPDATE SET
    path = coalesce(x.path, excluded.path), version = coalesce(x.version, excluded.version),
    parent_execution_id = coalesce(x.parent_execution_id, excluded.parent_execution_id),
    created_at = least(x.created_at, excluded.created_at),
    requested_by = coalesce(x.requested_by, excluded.requested_by)"""
_UPDATE_EVALUATED = """
UPDATE execution SET path = coalesce(path, %(path)s), version = coalesce(version, %(version)s)
WHERE execution_id = %(id)s"""
_UPSERT_STARTED = """
INSERT INTO execution AS x (execution_id, status, created_at, started_at)
VALUES (%(id)s, 'RUNNING', to_timestamp(%(ts)s), to_timestamp(%(ts)s))
ON CONFLICT (execution_id) DO UPDATE SET
    status = CASE WHEN x.status = 'PENDING' THEN 'RUNNING' ELSE x.status END,
    started_at = coalesce(x.started_at, excluded.started_at)"""
_UPSERT_FINISHED = """
INSERT INTO execution AS x (execution_id, status, created_at, finished_at, error)
VALUES (%(id)s, %(status)s, to_timestamp(%(ts)s), to_timestamp(%(ts)s), %(error)s)
ON CONFLICT (execution_id) DO UPDATE SET
    status = excluded.status, finished_at = excluded.finished_at, error = excluded.error"""
_EXECUTION_COLUMNS = ("execution_id", "path", "version", "status", "parent_execution_id", "created_at",
                      "started_at", "finished_at", "error", "requested_by")
_SELECT_EXECUTION = f"SELECT {', '.join(_EXECUTION_COLUMNS)} FROM execution"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**31 else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def projection(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The projection updates a batch of events implies, by statement, in log order."""
    out: dict[str, list[dict[str, Any]]] = {
        _UPSERT_REQUESTED: [], _UPDATE_EVALUATED: [], _UPSERT_STARTED: [], _UPSERT_FINISHED: []}
    for e in events:
        name, data, ts = e.get("name"), e.get("data"), e.get("timestamp")
        data = data if isinstance(data, dict) else {}
        ts = ts if isinstance(ts, (int, float)) and not isinstance(ts, bool) else time.time()
        xid = e["execution_id"]
        if name == "playbook.execution.requested":
            catalog = data.get("catalog") if isinstance(data.get("catalog"), dict) else {}
            playbook = data.get("playbook") if isinstance(data.get("playbook"), dict) else {}
            meta = playbook.get("metadata") if isinstance(playbook.get("metadata"), dict) else {}
            out[_UPSERT_REQUESTED].append({
                "id": xid, "path": _str(catalog.get("path")) or _str(meta.get("path")),
                "version": _int(catalog.get("version")), "catalog_id": _int(catalog.get("id")),
                "parent": _str(data.get("parent_execution_id")), "ts": ts,
                # who started it (the gateway's caller); a child without one inherits its parent's
                "by": _str((data.get("requested_by") or {}).get("user_id"))
                if isinstance(data.get("requested_by"), dict) else None})
        elif name == "playbook.request.evaluated" and e.get("status") != "error":
            out[_UPDATE_EVALUATED].append({"id": xid, "path": _str(data.get("path")),
                                           "version": _int(data.get("version"))})
        elif name == "workflow.started":
            out[_UPSERT_STARTED].append({"id": xid, "ts": ts})
        elif name == "workflow.finished":
            status = data.get("status") if data.get("status") in FINAL else "FAILED"
            error = data.get("error")
            out[_UPSERT_FINISHED].append({"id": xid, "status": status, "ts": ts,
                                          "error": Jsonb(error) if error is not None else None})
    return {sql: params for sql, params in out.items() if params}


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _execution_row(row: tuple) -> dict[str, Any]:
    return {k: _iso(v) for k, v in zip(_EXECUTION_COLUMNS, row)}


def _diagnostic(d: Any) -> dict[str, Any]:
    return {"location": d.location, "message": d.message, "severity": d.severity}


class RecorderService:
    name = "event-recorder"

    def __init__(self, bus: Bus, *, pg_dsn: str, batch: int = 500, ack_wait: float = 30.0,
                 fetch_timeout: float = 0.1, pool_size: int = 4, drain_timeout: float = 5.0):
        self.bus = bus
        self.pg_dsn = pg_dsn
        self.batch = batch
        self.ack_wait = ack_wait
        self.fetch_timeout = fetch_timeout
        self.pool_size = pool_size
        self.drain_timeout = drain_timeout
        self.recorded = 0  # events written by this instance (duplicates included)
        self._pool: AsyncConnectionPool | None = None
        self._sub = None
        self._subs: list[Any] = []
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._floor = 0  # highest stream sequence acked (everything at or below is recorded)
        self._held: dict[int, Any] = {}  # recorded, not yet acked: stream sequence -> message

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._stopping.clear()
        self._pool = AsyncConnectionPool(self.pg_dsn, min_size=1, max_size=self.pool_size, open=False,
                                         configure=_configure, name="event-recorder")
        await self._pool.open(wait=True, timeout=30)
        async with self._pool.connection() as conn:
            await schema.migrate(conn)
        await self.bus.attach()
        self._sub = await self.bus.durable(
            EVENTS, DURABLE, FILTER, max_ack_pending=max(4 * self.batch, 1000), ack_wait=self.ack_wait,
            max_deliver=50, ack_policy=AckPolicy.ALL)
        info = await self.bus.js.consumer_info(EVENTS, DURABLE)
        self._floor = info.ack_floor.stream_seq if info.ack_floor else 0
        self._held.clear()
        for subject, handler in (
            (Q_CATALOG_REGISTER, self.catalog_register), (Q_CATALOG_GET, self.catalog_get),
            (Q_CATALOG_LIST, self.catalog_list), (Q_EXECUTION_GET, self.execution_get),
            (Q_EXECUTION_EVENTS, self.execution_events), (Q_EXECUTION_LIST, self.execution_list),
            (Q_RECORDER_PING, self.ping),
        ):
            await self._serve(subject, handler)
        await credentials.serve(self)  # D24: the credential store's subjects
        self._task = asyncio.create_task(self._consume(), name="event-recorder consume")

    async def stop(self) -> None:
        """Stop answering, record what is already in the stream (up to ``drain_timeout``), close."""
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be gone already
                pass
        self._subs.clear()
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.drain_timeout + 5)
            except asyncio.TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            except Exception:  # noqa: BLE001
                log.exception("consumer loop failed")
            self._task = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
            self._sub = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _serve(self, subject: str, handler) -> None:
        async def guarded(req: Any) -> Any:
            try:
                return await handler(req if isinstance(req, dict) else {})
            except (psycopg.OperationalError, PoolTimeout) as exc:
                raise BusError("unavailable", f"the event database is unavailable: {exc}") from exc

        # stop() removes the subscription: a stopped recorder must not stay in the queue group
        # answering with a closed pool.
        self._subs.append(await self.bus.serve(subject, guarded, queue=QUEUE))

    # ------------------------------------------------------------------ consuming
    async def _consume(self) -> None:
        """Record fetched batches in order; the next batch is fetched while one is being written."""
        batches: asyncio.Queue = asyncio.Queue(maxsize=1)
        fetcher = asyncio.create_task(self._fetch(batches), name="event-recorder fetch")
        try:
            while (msgs := await batches.get()) is not None:
                if not await self._record(msgs):
                    break
        finally:
            fetcher.cancel()
            await asyncio.gather(fetcher, return_exceptions=True)
            while not batches.empty():  # fetched, never written: hand them back
                for msg in batches.get_nowait() or ():
                    await _quietly(msg.nak())

    async def _fetch(self, batches: asyncio.Queue) -> None:
        drain_until: float | None = None
        while True:
            if self._stopping.is_set():
                drain_until = drain_until or time.monotonic() + self.drain_timeout
                if time.monotonic() > drain_until:
                    break
            try:
                msgs = await self._sub.fetch(self.batch, timeout=self.fetch_timeout)
            except asyncio.TimeoutError:  # nats' own TimeoutError is one, and fetch raises both
                if self._stopping.is_set():
                    break  # drained
                continue
            except Exception:  # noqa: BLE001 - connection hiccups: keep pulling
                if self._stopping.is_set():
                    break
                log.exception("fetch failed")
                await asyncio.sleep(0.5)
                continue
            await batches.put(msgs)
        await batches.put(None)

    async def _record(self, msgs: list) -> bool:
        """Write one fetched batch (retrying until it is written), then ack what is safe to ack.
        False when the service is stopping and the batch was handed back instead."""
        records: list[tuple[int, dict[str, Any]]] = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            try:
                events = loads(msg.data)  # one message holds the events of one decision (bus.batches)
                if not isinstance(events, list) or not all(isinstance(e, dict) and all(
                        isinstance(e.get(k), str) for k in ("event_id", "execution_id", "name")) for e in events):
                    raise ValueError("not a list of event envelopes")
            except Exception as exc:  # noqa: BLE001 - a malformed message is skipped, not retried forever
                log.error("skipping malformed message seq=%s on %s: %s", seq, msg.subject, exc)
                continue
            records += [(log_seq(seq, i), event) for i, event in enumerate(events)]
        delay = 0.1
        while True:
            try:
                await self.store(records)
                break
            except Exception as exc:  # noqa: BLE001 - database trouble: retry in place
                if self._stopping.is_set():
                    log.error("stopping with %d unrecorded events (%s): handing them back", len(msgs), exc)
                    for msg in msgs:
                        await _quietly(msg.nak())
                    return False
                log.warning("recording %d events failed (%s: %s); retrying in %.1fs",
                            len(records), type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.recorded += len(records)
        await self._ack(msgs)
        return True

    async def _ack(self, msgs: list) -> None:
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq > self._floor:
                self._held[seq] = msg
        if not self._held:
            return
        top = max(self._held)
        if any(s not in self._held for s in range(self._floor + 1, top)):
            # a gap: messages below `top` may be pending elsewhere (a recorder that died holding them)
            try:
                info = await self.bus.js.consumer_info(EVENTS, DURABLE, timeout=2)
            except Exception:  # noqa: BLE001 - ask again with the next batch
                return
            self._floor = max(self._floor, info.ack_floor.stream_seq if info.ack_floor else 0)
            for s in [s for s in self._held if s <= self._floor]:
                del self._held[s]
            if not self._held:
                return
            gap = any(s not in self._held for s in range(self._floor + 1, top))
            if gap and (info.num_ack_pending or 0) > len(self._held):
                log.info("holding the ack of %d recorded events until the messages below seq %s are "
                         "redelivered", len(self._held), top)
                return
        try:
            await self._held[top].ack_sync()
        except Exception as exc:  # noqa: BLE001 - they will be redelivered and recorded again: harmless
            log.warning("ack of seq %s failed: %s", top, exc)
            return
        self._floor = top
        self._held.clear()

    async def store(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        """Record ``(stream sequence, event)`` pairs and update the projection, in one transaction.
        Idempotent: an event id already recorded is skipped (D21)."""
        if not records:
            return
        rows = [schema.event_row(seq, event) for seq, event in records]
        events = [event for _, event in records]
        async with self._pool.connection() as conn:
            try:
                async with conn.transaction():
                    await self._insert(conn, rows)
                    await self._project(conn, events)
            except psycopg.DataError as exc:
                # one bad value must not block the log: store row by row, the bad ones without data
                log.error("batch rejected (%s); recording event by event", exc)
                async with conn.transaction():
                    await self._insert_one_by_one(conn, rows)
                    await self._project(conn, events)

    @staticmethod
    async def _insert(conn, rows: list[tuple]) -> None:
        async with conn.cursor() as cur:
            async with cur.copy(schema.COPY_STAGE) as copy:
                for row in rows:
                    await copy.write_row(row)
            await cur.execute(schema.INSERT_FROM_STAGE)

    @staticmethod
    async def _insert_one_by_one(conn, rows: list[tuple]) -> None:
        data_at = schema.STAGE_COLUMNS.index("data")
        for row in rows:
            try:
                async with conn.transaction():
                    await conn.execute(schema.INSERT_EVENT, row)
            except psycopg.DataError as exc:
                log.error("event %s: %s; recorded without its data", row[1], exc)
                bad = list(row)
                bad[data_at] = schema._json({"unrecordable": str(exc)})
                async with conn.transaction():
                    await conn.execute(schema.INSERT_EVENT, tuple(bad))

    @staticmethod
    async def _project(conn, events: list[dict[str, Any]]) -> None:
        async with conn.cursor() as cur:
            for sql, params in projection(events).items():
                await cur.executemany(sql, params)

    # ------------------------------------------------------------------ catalog
    async def catalog_register(self, req: dict[str, Any]) -> dict[str, Any]:
        content = req.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BusError("bad_request", "content (the playbook's YAML text) is required")
        result = validate_text(content)
        if not result.ok:
            raise BusError("invalid_playbook", f"invalid playbook: {len(result.errors)} error(s)",
                           details=[_diagnostic(d) for d in result.errors])
        meta = result.document["metadata"]
        for _ in range(20):
            try:
                async with self._connection() as conn:
                    cur = await conn.execute(
                        """INSERT INTO catalog (path, version, name, content)
                           SELECT %(path)s, coalesce(max(version), 0) + 1, %(name)s, %(content)s
                           FROM catalog WHERE path = %(path)s
                           RETURNING id, path, version, name, created_at""",
                        {"path": meta["path"], "name": meta.get("name"), "content": content})
                    row = await cur.fetchone()
                break
            except psycopg.errors.UniqueViolation:
                await asyncio.sleep(0.01)  # a concurrent registration took this version: next one
        else:
            raise BusError("conflict", f"could not allocate a version for {meta['path']}")
        return {"id": row[0], "path": row[1], "version": row[2], "name": row[3], "created_at": _iso(row[4]),
                "warnings": [_diagnostic(d) for d in result.warnings]}

    async def catalog_get(self, req: dict[str, Any]) -> dict[str, Any]:
        select = "SELECT id, path, version, name, content, created_at FROM catalog"
        if req.get("id") is not None:
            if _int(req["id"]) is None:
                raise BusError("bad_request", "id must be an integer")
            query, params, what = f"{select} WHERE id = %s", (req["id"],), f"catalog entry {req['id']}"
        elif isinstance(req.get("path"), str):
            if req.get("version") is not None:
                if _int(req["version"]) is None:
                    raise BusError("bad_request", "version must be an integer")
                query = f"{select} WHERE path = %s AND version = %s"
                params, what = (req["path"], req["version"]), f"{req['path']} version {req['version']}"
            else:
                query = f"{select} WHERE path = %s ORDER BY version DESC LIMIT 1"
                params, what = (req["path"],), f"playbook {req['path']}"
        else:
            raise BusError("bad_request", "give id, or path (and optionally version)")
        async with self._connection() as conn:
            row = await (await conn.execute(query, params)).fetchone()
        if row is None:
            raise BusError("not_found", f"{what} is not in the catalog")
        return dict(zip(("id", "path", "version", "name", "content", "created_at"), map(_iso, row)))

    async def catalog_list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        limit = min(max(_int(req.get("limit")) or 1000, 1), 10_000)
        where, params = ("WHERE path = %s", [req["path"]]) if req.get("path") else ("", [])
        async with self._connection() as conn:
            cur = await conn.execute(
                f"""SELECT id, path, version, name, created_at FROM catalog {where}
                    ORDER BY created_at DESC, id DESC LIMIT %s""", (*params, limit))
            rows = await cur.fetchall()
        return [dict(zip(("id", "path", "version", "name", "created_at"), map(_iso, r))) for r in rows]

    # ------------------------------------------------------------------ executions
    async def execution_get(self, req: dict[str, Any]) -> dict[str, Any]:
        xid = _execution_id(req)
        async with self._connection() as conn:
            proj = await (await conn.execute(f"{_SELECT_EXECUTION} WHERE execution_id = %s", (xid,))).fetchone()
            count = (await (await conn.execute(
                "SELECT count(*) FROM event WHERE execution_id = %s", (xid,))).fetchone())[0]
            if req.get("brief"):
                if proj is None:
                    raise BusError("not_found", f"execution {xid} is not known")
                return {**_execution_row(proj), "event_count": count}
            # the summary is a fold of the ``ctl`` events alone (bus.event_class): task progress and loop
            # bookkeeping change no step's status or result (a loop's result is on its loop.done)
            cur = await conn.execute(f"{schema.SELECT_EVENT} WHERE execution_id = %s AND NOT (name = ANY(%s))"
                                     " ORDER BY seq", (xid, NOT_SUMMARY))
            rows = await cur.fetchall()
        if not rows:
            raise BusError("not_found", f"execution {xid} is not known")
        events = [schema.row_event(r) for r in rows]
        out = summary(fold(events, xid))
        finished = [e for e in events if e["name"] == "workflow.finished"]
        p = _execution_row(proj) if proj else {}
        out.update({
            "path": p.get("path"), "version": p.get("version"),
            "error": (finished[-1]["data"] or {}).get("error") if finished else None,
            "parent_execution_id": p.get("parent_execution_id"), "created_at": p.get("created_at"),
            "started_at": p.get("started_at"), "finished_at": p.get("finished_at"),
            "event_count": count,
        })
        return out

    async def execution_events(self, req: dict[str, Any]) -> dict[str, Any]:
        xid = _execution_id(req)
        offset = max(_int(req.get("offset")) or 0, 0)
        limit = min(max(_int(req.get("limit")) if req.get("limit") is not None else 100, 0), MAX_PAGE)
        async with self._connection() as conn:
            total = (await (await conn.execute(
                "SELECT count(*) FROM event WHERE execution_id = %s", (xid,))).fetchone())[0]
            cur = await conn.execute(
                f"{schema.SELECT_EVENT} WHERE execution_id = %s ORDER BY seq OFFSET %s LIMIT %s",
                (xid, offset, limit))
            rows = await cur.fetchall()
        if not total:
            raise BusError("not_found", f"execution {xid} is not known")
        return {"events": [schema.row_event(r) for r in rows], "total": total, "offset": offset, "limit": limit}

    async def execution_list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        limit = min(max(_int(req.get("limit")) or 50, 1), MAX_PAGE)
        status = req.get("status")
        if status is not None and str(status).upper() not in STATUSES:
            raise BusError("bad_request", f"status must be one of {', '.join(STATUSES)}")
        user = req.get("user")
        if user is not None and not isinstance(user, str):
            raise BusError("bad_request", "user must be a user id")
        conditions = [(c, v) for c, v in (("status = %s", str(status).upper() if status else None),
                                          ("requested_by = %s", user)) if v is not None]
        where = f"WHERE {' AND '.join(c for c, _ in conditions)}" if conditions else ""
        async with self._connection() as conn:
            cur = await conn.execute(
                f"{_SELECT_EXECUTION} {where} ORDER BY created_at DESC NULLS LAST, execution_id LIMIT %s",
                (*[v for _, v in conditions], limit))
            rows = await cur.fetchall()
        return [_execution_row(r) for r in rows]

    async def ping(self, req: dict[str, Any]) -> dict[str, Any]:
        lag = None
        try:
            info = await self.bus.js.consumer_info(EVENTS, DURABLE, timeout=1)
            lag = (info.num_pending or 0) + (info.num_ack_pending or 0)
        except Exception:  # noqa: BLE001 - lag is best effort
            pass
        return {"ok": True, "lag": lag, "recorded": self.recorded}

    # ------------------------------------------------------------------ helpers
    def _connection(self):
        if self._pool is None:
            raise BusError("unavailable", "the event-recorder is stopping")
        return self._pool.connection(timeout=10)


def _execution_id(req: dict[str, Any]) -> str:
    xid = req.get("execution_id")
    if not isinstance(xid, str) or not xid:
        raise BusError("bad_request", "execution_id is required")
    return xid


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception:  # noqa: BLE001 - best effort (the message is redelivered after ack_wait anyway)
        pass


async def _configure(conn) -> None:
    await conn.execute(schema.CREATE_STAGE)
    await conn.commit()


__all__ = ["RecorderService", "DURABLE", "FILTER", "QUEUE", "projection"]
