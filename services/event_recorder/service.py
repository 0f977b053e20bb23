"""event-recorder: the only service that owns Postgres.

It reads every event of ``NOETL_EVENTS`` through a durable pull consumer per partition and writes them
in batches (one transaction per batch: the events, then the ``execution`` projection), acknowledging a
batch only once it is committed. Recorder replicas share the partitions as the control plane does
(feeds.py), so that writes scale out. It also keeps the playbook catalog, and answers the read queries of the gateway
over NATS request/reply (``noetl.q.catalog.*``, ``noetl.q.execution.*``, ``noetl.q.recorder.ping``).

Starting. Queries are answered at once; the database is tried once at start and then, while it is
unreachable, again and again in the background (backoff up to 5 s, each attempt logged), queries
meanwhile answering ``unavailable``. Once it is up and migrated the consumer is bound and recording
starts.

Consumption and acknowledgement. Each partition's durable uses ``AckPolicy.ALL``: acking a message
acks every message of the partition with a lower stream sequence, which feeds.py only does when
nothing below it is unrecorded. A batch that cannot be written because of the database (down, busy:
``schema.transient``) is retried in place, with backoff, before anything newer is taken: a ``nak``
followed by further batches would let a later cumulative ack cover the nak'ed messages. A batch Postgres refuses because of
a row is split until the row is alone, and that row is recorded as rejected (``schema.rejected``):
nothing loops forever on a value. Recording is idempotent (``ON CONFLICT (event_id) DO NOTHING``,
D21), so redeliveries are harmless.

Replies. Every reply is at most ``limits.max_reply_bytes``: pages of events are cut by bytes, and what
is still too big has its biggest values replaced by D23 references (``replies.py``), or is a
``too_large`` error. Error kinds answered: ``bad_request``, ``not_found``, ``invalid_playbook``,
``conflict``, ``too_large``, ``unavailable`` (and ``internal`` for a defect).

Execution state for ``noetl.q.execution.get`` is rebuilt from the recorded events with the engine's
own fold (D22); the ``execution`` table is only a projection for lists and filters.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import orjson
import psycopg
from nats.js.api import AckPolicy
from psycopg.types.json import Jsonb, set_json_loads
from psycopg_pool import AsyncConnectionPool

from noetl_mesh import limits
from noetl_mesh.core import restart, timeline, view
from noetl_mesh.core.events import carried_roles, event_class
from noetl_mesh.core.state import ExecutionState, summary
from noetl_mesh.infra import logs, metrics
from noetl_mesh.infra.membership import Membership
from noetl_mesh.infra.payloads import PayloadMissing, is_ref
from noetl_mesh.infra.micro import Consumer
from noetl_mesh.infra.bus import (
    unsubscribe_all,
    EVENTS,
    Q_CATALOG_GET,
    Q_CATALOG_LIST,
    Q_CATALOG_REGISTER,
    Q_EXECUTION_EVENTS,
    Q_EXECUTION_GET,
    Q_EXECUTION_LIST,
    Q_EXECUTION_RESULT,
    Q_EXECUTION_SEED,
    Q_EXECUTION_STATE,
    Q_EXECUTION_STATUS,
    Q_EXECUTION_WAITS,
    Q_RECORDER_PING,
    LIVE_ASK,
    LIVE_LIST,
    LIVE_WATCH,
    Bus,
    BusError,
    admitted,
    dumps,
    live_subject,
    log_seq,
)
from noetl_mesh.contracts.subjects import Q_EXECUTION_STATS, Q_EXECUTION_TIMELINE
from noetl_mesh.lang.validate import validate_text
from noetl_mesh.limits import LimitExceeded

from . import feeds, folds, live, replies, schema
from .feeds import DURABLE, Feed

log = logging.getLogger("noetl.event-recorder")

LOOP_ENDS = ("loop.done", "step.failed")  # a loop run's terminal events: they carry its counts
MAX_FILTER_NAMES = 50
QUEUE = "event-recorder"
FILTER = "noetl.pevt.>"


STATUSES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED")
MAX_PAGE = 1000
_EXECUTION_COLUMNS = ("execution_id", "path", "version", "status", "parent_execution_id", "created_at",
                      "started_at", "finished_at", "error", "requested_by", "restarted_from")
MAX_RESTARTS = 100  # an execution's restarts listed with it (D32), oldest first
MAX_STATS_DAYS = 366  # the longest time range of the overview (noetl.q.execution.stats)
MAX_STATS_ROWS = 20  # playbooks and error kinds listed by the overview
_SELECT_BRIEF = f"SELECT {', '.join(_EXECUTION_COLUMNS)}, event_count FROM execution WHERE execution_id = %s"
_N_EXECUTION = len(_EXECUTION_COLUMNS)
# an execution's status in one statement (so one snapshot of the log, and one round trip): its row (NULLs
# when the projection lacks it), its event count, the executions restarted from it (D32), then on each row
# one of its ``ctl`` events in log order (the summary is a fold of these alone: task progress and loop
# bookkeeping change no step's status or result); a single row of NULL events when it has none
_SELECT_STATUS = f"""SELECT {', '.join('p.' + c for c in _EXECUTION_COLUMNS)},
    COALESCE(p.event_count, (SELECT count(*) FROM event WHERE execution_id = %(x)s)),
    ARRAY(SELECT execution_id FROM execution WHERE restarted_from = %(x)s ORDER BY created_at, execution_id
          LIMIT %(n)s),
    e.*
FROM (SELECT 1) AS one
LEFT JOIN execution p ON p.execution_id = %(x)s
LEFT JOIN LATERAL ({schema.SELECT_EVENT} WHERE execution_id = %(x)s AND {schema.STATE_EVENTS_SQL}
                   ORDER BY seq LIMIT %(m)s) e ON true
ORDER BY e.seq"""  # past folds.SMALL events, the status is a large fold (folds.py)
# the username of who started an execution: its request event's, else (a child: started by its parent on
# that user's behalf) its nearest ancestor's, up the parent chain (at most 64 levels, as the depth limit)
_STARTER_NAME = """WITH RECURSIVE up(id, parent, depth) AS (
    SELECT execution.execution_id, execution.parent_execution_id, 0
    UNION ALL
    SELECT x.execution_id, x.parent_execution_id, up.depth + 1 FROM execution x JOIN up ON x.execution_id = up.parent
    WHERE up.depth < 64)
  SELECT e.data->'requested_by'->>'username' FROM up JOIN event e ON e.execution_id = up.id
  WHERE e.name = 'playbook.execution.requested' AND e.data->'requested_by'->>'username' IS NOT NULL
  ORDER BY up.depth, e.seq LIMIT 1"""
RETRY_CAP = 5.0  # seconds between attempts to reach the database, at most
# Requests of one subject a recorder answers at once: a large fold (folds.py) waits for its turn, or
# yields between its chunks, while the others are answered (one at a time, one user's large fold held up
# everyone's status reads). Each takes a database connection only while it reads.
REPLIES_AT_ONCE = 8
DRAIN_QUIET = 0.25  # seconds without a delivery that end a stopping recorder's drain
BATCH_BYTES = 8 * 1024 * 1024  # a batch stops growing at this many bytes of messages
# A batch is written this long after its first message arrives (unless a whole batch is there already):
# the messages that come meanwhile go in the same transaction and the same acks. A step's events are
# recorded up to 5 ms later; nothing an execution does waits for its recording (docs/performance.md:
# the 1,000 x 5 burst spent 9 % less CPU per step, the recorder's acks 1.3 -> 0.9 per step).
LINGER = 0.005
YIELD_EVERY = 16  # messages decoded (x16: rows built or copied) between two chances for queries to be answered


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _registrant(who: Any) -> dict[str, Any] | None:
    """Who registers a catalog version, as the gateway says ({user_id, username, roles}: the roles the
    request carried, which a pool checks as it checks a starter's, D33); None when unknown."""
    if not isinstance(who, dict) or not isinstance(who.get("user_id"), str):
        return None
    out: dict[str, Any] = {k: schema.text(who[k]) for k in ("user_id", "username") if isinstance(who.get(k), str)}
    roles = carried_roles(who.get("roles"))
    if roles is not None:
        out["roles"] = [schema.text(r) for r in roles]
    return out


async def _owned(conn: Any, path: str) -> str:
    """Why a new version of ``path`` is refused: whose the path is."""
    cur = await conn.execute("SELECT registered_by FROM catalog WHERE path = %s ORDER BY version LIMIT 1", (path,))
    first = await cur.fetchone()
    owner = first[0] if first else None
    if not isinstance(owner, dict) or not owner.get("user_id"):
        return (f"catalog path {path!r} was registered before registrants were recorded: only a user with "
                "catalog.any (an admin) may register versions of it")
    return (f"catalog path {path!r} is {owner.get('username') or owner['user_id']}'s (who registered its first "
            "version): only they, or a user with catalog.any (an admin), may register versions of it")


def _execution_row(row: tuple) -> dict[str, Any]:
    return {k: _iso(v) for k, v in zip(_EXECUTION_COLUMNS, row)}


def _diagnostic(d: Any) -> dict[str, Any]:
    out = {"location": d.location, "message": d.message, "severity": d.severity}
    for key in ("line", "column"):  # where in the YAML text
        if getattr(d, key, None) is not None:
            out[key] = getattr(d, key)
    return out


class RecorderService:
    name = "event-recorder"

    def __init__(self, bus: Bus, *, pg_dsn: str, batch: int = 500, ack_wait: float = 30.0,
                 pool_size: int = 4, drain_timeout: float = 5.0):
        self.bus = bus
        self.pg_dsn = pg_dsn
        self.batch = batch
        self.ack_wait = ack_wait
        self.pool_size = pool_size
        self.drain_timeout = drain_timeout
        self.recorded = 0  # events written by this instance (duplicates included)
        self.rejected = 0  # of which recorded as rejected (schema.rejected)
        self._pool: AsyncConnectionPool | None = None
        self._db_error = "not tried yet"  # why the database could not be opened, while it cannot
        self._subs: list[Any] = []
        self._queue: asyncio.Queue = asyncio.Queue()  # (feed, message) pairs, in each feed's delivery order
        self.feeds: dict[int, Feed] = {}  # the partitions this replica reads now
        self._closing: list[asyncio.Task] = []  # feeds of partitions handed over, stopping
        self.membership: Membership | None = None
        self.interest = live.Interest()  # which notices the gateways' console streams show
        self.large = folds.Large()  # large folds for replies: one at a time, their answers kept (folds.py)
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        # what `nats micro stats` and `noetl ps` show: messages recorded; failed: events recorded as rejected
        self.events = Consumer(name="events", stream=EVENTS, subject=FILTER, durable=DURABLE, partitions=[])
        self.consumers = [self.events]
        self._m_batch = metrics.RECORDER_BATCH.labels(self.name)
        self._m_lag = metrics.RECORDER_LAG.labels(self.name)
        self._m_pending: dict[int, Any] = {}
        self._m_rejected = metrics.RECORDER_REJECTED.labels(self.name)
        self._m_handled: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Answer queries; open the database now, or keep trying in the background; then consume."""
        self._stopping.clear()
        self._queue = asyncio.Queue()
        await self.bus.attach()
        # ask the gateways what their console streams show; until they have said, send every notice
        self.interest = live.Interest(everything_until=time.monotonic() + live.WARMUP)
        self._subs.append(await self.bus.nc.subscribe(LIVE_WATCH, cb=self._watching))
        await self.bus.nc.publish(LIVE_ASK, b"{}")
        for subject, handler in (
            (Q_CATALOG_REGISTER, self.catalog_register), (Q_CATALOG_GET, self.catalog_get),
            (Q_CATALOG_LIST, self.catalog_list), (Q_EXECUTION_GET, self.execution_get),
            (Q_EXECUTION_EVENTS, self.execution_events), (Q_EXECUTION_LIST, self.execution_list),
            (Q_EXECUTION_WAITS, self.execution_waits), (Q_EXECUTION_STATE, self.execution_state),
            (Q_EXECUTION_RESULT, self.execution_result), (Q_EXECUTION_STATUS, self.execution_status),
            (Q_EXECUTION_SEED, self.execution_seed), (Q_EXECUTION_TIMELINE, self.execution_timeline),
            (Q_EXECUTION_STATS, self.execution_stats), (Q_RECORDER_PING, self.ping),
        ):
            await self._serve(subject, handler)
        if await self._open_database():  # the usual case: up, so everything is bound when start returns
            await self._bind()
            self._task = asyncio.create_task(self._consume(), name="event-recorder consume")
        else:
            self._task = asyncio.create_task(self._wait_for_database(), name="event-recorder database")

    async def _open_database(self) -> bool:
        """One attempt to connect, migrate and open the pool; False (the reason in ``_db_error``) when
        the database cannot be reached or migrated."""
        pool = None
        try:
            conn = await asyncio.wait_for(psycopg.AsyncConnection.connect(self.pg_dsn), 10)
            async with conn:
                await schema.migrate(conn)
            pool = AsyncConnectionPool(self.pg_dsn, min_size=1, max_size=self.pool_size, open=False,
                                       configure=_configure, name="event-recorder")
            await pool.open(wait=True, timeout=10)
        except Exception as exc:  # noqa: BLE001 - down, refusing, not migratable: reported and retried
            self._db_error = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
            if pool is not None:
                await pool.close()
            return False
        self._pool = pool
        return True

    async def _wait_for_database(self) -> None:
        delay, attempt = 0.5, 1
        while True:
            log.warning("the event database is unreachable (attempt %d: %s); next attempt in %.1fs",
                        attempt, self._db_error, delay)
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
                return
            except asyncio.TimeoutError:
                pass
            attempt += 1
            if await self._open_database():
                break
            delay = min(delay * 2, RETRY_CAP)
        if self._stopping.is_set():
            return
        log.warning("the event database is up (attempt %d): recording", attempt)
        try:
            await self._bind()
        except Exception:  # noqa: BLE001 - NATS failed us: ping says consumer false
            log.exception("could not bind the events consumer")
            return
        await self._consume()

    async def _migrate(self) -> None:
        try:
            async with self._connection() as conn:
                await schema.migrate(conn)
        except Exception as exc:  # noqa: BLE001 - the next retry tries again
            log.warning("could not migrate the event database: %s", exc)

    async def _bind(self) -> None:
        """The partitions' durables, and this replica's share of them."""
        await self._durables()
        self.membership = Membership(self.bus.js, self.name, self.bus.partitions, self._read,
                                     replicas=self.bus.replicas)
        await self.membership.start()
        self._read(self.membership.owned)

    async def _durables(self) -> None:
        """Create (or update) each partition's durable. An events stream read by the single durable of
        an earlier version hands over: the partitions' durables start after its ack floor (what it
        recorded past that is recorded again, idempotently) and it is deleted."""
        start = await self.bus.handover_consumer(
            EVENTS, DURABLE, {feeds.durable(p): feeds.subject(p) for p in range(self.bus.partitions)},
            pinned=True, max_ack_pending=max(4 * self.batch, 1000), ack_wait=self.ack_wait, max_deliver=50,
            ack_policy=AckPolicy.ALL)
        if start is not None:
            log.warning("the events stream was read by the single durable %r of an earlier version: its partitions' "
                        "durables start after its ack floor (seq %d); it is deleted", DURABLE, start - 1)

    async def _open(self, p: int, feed: Feed) -> None:
        try:
            await feed.open()
        except Exception as exc:  # noqa: BLE001 - NATS trouble: the next membership beat opens it again
            log.warning("cannot read partition %d yet (%s: %s)", p, type(exc).__name__, exc)
            if self.feeds.get(p) is feed:
                del self.feeds[p]

    def _read(self, owned: set[int]) -> None:
        """A feed per owned partition; a partition no longer owned finishes what it delivered, acks or
        gives it back, and its feed stops."""
        if self._stopping.is_set():
            return
        for p in [p for p in self.feeds if p not in owned]:
            self._closing.append(asyncio.create_task(self.feeds.pop(p).close(self.drain_timeout),
                                                     name=f"event-recorder close p{p}"))
            self._m_pending.pop(p, None)
            metrics.forget_pending(self.name, feeds.durable(p), p)
        for p in sorted(owned - set(self.feeds)):
            feed = self.feeds[p] = Feed(self.bus, p, self._queue, limit=2 * self.batch)
            self._closing.append(asyncio.create_task(self._open(p, feed), name=f"event-recorder open p{p}"))
        for task in [t for t in self._closing if t.done()]:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s failed: %r", task.get_name(), task.exception())
        self._closing = [t for t in self._closing if not t.done()]
        self.events.own(self.feeds)

    async def stop(self) -> None:
        """Stop answering, record what is already in the stream (up to ``drain_timeout``), hand the
        partitions back, close."""
        await unsubscribe_all(self._subs)
        self._stopping.set()
        self._queue.put_nowait(None)  # wake the writer
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.drain_timeout + 5)
            except asyncio.TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            except Exception:  # noqa: BLE001
                log.exception("consumer loop failed")
            self._task = None
        await unsubscribe_all(self._subs)  # what a late start of the database subscribed meanwhile
        for feed in self.feeds.values():
            feed.closing = True  # ask for nothing more
        while not self._queue.empty():  # delivered, never written: each feed gives its own back
            item = self._queue.get_nowait()
            if item is not None:
                await item[0].give_back([item[1]])
        self._closing += [asyncio.create_task(feed.close(0)) for feed in self.feeds.values()]
        self.feeds.clear()
        self.events.own(())
        await asyncio.gather(*self._closing, return_exceptions=True)
        self._closing.clear()
        if self.membership is not None:
            await self.membership.stop()
            self.membership = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    # ------------------------------------------------------------------ answering
    async def _serve(self, subject: str, handler) -> None:
        async def guarded(req: Any) -> Any:
            try:
                reply = await handler(req if isinstance(req, dict) else {})
            except BusError:
                raise
            except Exception as exc:
                if schema.transient(exc):
                    raise BusError("unavailable", f"the event database is unavailable: {exc}") from exc
                if isinstance(exc, UnicodeError) or (isinstance(exc, psycopg.Error) and (
                        isinstance(exc, psycopg.DataError) or (exc.sqlstate or "")[:2] in ("22", "23", "54"))):
                    raise BusError("bad_request", f"{subject}: Postgres refuses a value of the request: {exc}") from exc
                raise
            return await self._bounded(subject, reply)

        # stop() removes the subscription: a stopped recorder must not stay in the queue group
        # answering with a closed pool.
        self._subs.append(await self.bus.serve(subject, guarded, queue=QUEUE, concurrency=REPLIES_AT_ONCE))

    async def _bounded(self, subject: str, reply: Any) -> orjson.Fragment:
        """The reply's JSON within ``max_reply_bytes``: as it is, with its biggest values as D23
        references, or a ``too_large`` error naming the limit."""
        budget = limits.current().max_reply_bytes
        data = dumps(reply)
        size = len(data)
        if size > budget:
            try:
                data = dumps(await replies.fit(reply, budget, self.bus.payloads.put))
            except Exception as exc:  # noqa: BLE001 - the object store
                raise BusError("unavailable", f"{subject}: the reply is {size:,} bytes, over max_reply_bytes, "
                                              f"and the payload store cannot take its values: {exc}") from exc
        if len(data) > budget:
            raise BusError("too_large", str(LimitExceeded("max_reply_bytes", size, where=subject)))
        return orjson.Fragment(data)

    # ------------------------------------------------------------------ consuming
    async def _consume(self) -> None:
        """Record batches of what the feeds deliver, in their delivery order; when stopping, what keeps
        arriving for up to ``drain_timeout``, until the feeds have been quiet for a moment."""
        drain_until: float | None = None
        while True:
            if self._stopping.is_set():
                drain_until = drain_until or time.monotonic() + self.drain_timeout
            try:  # a throw-away stack's recorder does not drain: nobody reads its database afterwards
                first = await asyncio.wait_for(self._queue.get(), self.bus.grace(DRAIN_QUIET) if drain_until else 0.25)
            except asyncio.TimeoutError:
                if drain_until:
                    break  # drained
                for feed in list(self.feeds.values()):  # a request lost while NATS was away has expired
                    await feed.request()
                    await feed.tend()  # acks held back by a gap below them: tried again while it is quiet
                continue
            if first is None:  # stop() wakes the writer
                continue
            if not drain_until and self._queue.qsize() < self.batch - 1:  # (``first`` is out of it)
                await asyncio.sleep(LINGER)  # let the batch fill: fewer transactions and acks
            batch, size = [first], len(first[1].data)
            while len(batch) < self.batch and size < BATCH_BYTES and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is not None:
                    batch.append(item)
                    size += len(item[1].data)
            for feed in list(self.feeds.values()):  # the queue has room again
                await feed.request()
            by_feed = _by_feed(batch)
            if not await self._record([msg for _, msg in batch]):  # stopping, the database down
                await asyncio.gather(*(feed.give_back(msgs) for feed, msgs in by_feed.items()))
                break
            await asyncio.gather(*(feed.settle(msgs) for feed, msgs in by_feed.items()))
            for feed in by_feed:
                if self.feeds.get(feed.partition) is feed:
                    self._measure_pending(feed)
            if drain_until and time.monotonic() > drain_until:
                break

    def _measure_pending(self, feed: Feed) -> None:
        gauge = self._m_pending.get(feed.partition)
        if gauge is None:
            gauge = self._m_pending[feed.partition] = metrics.PENDING.labels(self.name, feed.durable, str(feed.partition))
        gauge.set(feed.num_pending)

    async def _record(self, msgs: list) -> bool:
        """Write one fetched batch (retrying while the database fails), then ack what is safe to ack.
        False when the service is stopping and the batch was handed back instead."""
        records: list[tuple[int, dict[str, Any]]] = []
        started, rejected, skipped = time.perf_counter_ns(), self.rejected, 0
        for n, msg in enumerate(msgs):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)  # queries are answered on this loop too: let them in between
            seq = msg.metadata.sequence.stream
            try:
                events = schema.decode(msg.data)  # one message holds the events of one decision (bus.batches)
                if not isinstance(events, list) or not all(isinstance(e, dict) and all(
                        isinstance(e.get(k), str) for k in ("event_id", "execution_id", "name")) for e in events):
                    raise ValueError("not a list of event envelopes")
            except Exception as exc:  # noqa: BLE001 - a malformed message is skipped, not retried forever
                log.error("skipping malformed message seq=%s on %s: %s", seq, msg.subject, exc)
                skipped += 1
                continue
            # what its subject's writer may not write is not part of the log (the control plane drops it
            # too, so the recorded log folds to the services' state, D22); the others keep their place
            with logs.bind(_execution_of(msg.subject)):  # a drop is logged with its execution
                kept = {id(e) for e in admitted(msg.subject, events, "event-recorder", msg.headers)}
            records += [(log_seq(seq, i), event) for i, event in enumerate(events) if id(event) in kept]
        delay = 0.1
        while True:
            try:
                await self.store(records)
                break
            except Exception as exc:  # noqa: BLE001 - only the database's failures reach here: retry in place
                if self._stopping.is_set():
                    log.error("stopping with %d unrecorded events (%s): handing them back", len(msgs), exc)
                    return False
                log.warning("recording %d events failed (%s: %s); retrying in %.1fs",
                            len(records), type(exc).__name__, exc, delay)
                if isinstance(exc, psycopg.errors.UndefinedTable):  # a database recreated empty: migrate it
                    await self._migrate()
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_CAP)
        self.recorded += len(records)
        failed = self.rejected - rejected + skipped
        self.events.record(started, n=len(msgs), failed=failed, error=f"{self.rejected - rejected} events recorded "
                           f"as rejected, {skipped} malformed messages skipped" if failed else None)
        self._measure(msgs, records)
        await self._announce(records)
        return True

    async def _watching(self, msg: Any) -> None:
        """A gateway's announcement of what its console streams show (live.Interest)."""
        try:
            self.interest.announce(_json_loads(msg.data), time.monotonic())
        except Exception as exc:  # noqa: BLE001 - a bad announcement is ignored
            log.debug("ignored a live watch announcement: %s", exc)

    async def _announce(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        """Tell the console what was just committed (live.py), of what someone watches; best effort,
        never in the way of recording."""
        try:
            now = time.monotonic()
            per, listed = live.notices(records, lambda key: self.interest.wants(key, now))
            for xid, notice in per.items():
                await self.bus.nc.publish(live_subject(xid), dumps(notice))
            if listed is not None:
                await self.bus.nc.publish(LIVE_LIST, dumps(listed))
        except Exception as exc:  # noqa: BLE001 - a notice lost costs a page's freshness only
            log.debug("live notices not sent: %s", exc)

    def _measure(self, msgs: list, records: list[tuple[int, dict[str, Any]]]) -> None:
        if not msgs:  # an empty fetch
            return
        self._m_batch.observe(len(records))
        oldest = min(msg.metadata.timestamp.timestamp() for msg in msgs)
        self._m_lag.observe(max(0.0, time.time() - oldest))
        for _, event in records:
            name = event.get("name")
            counter = self._m_handled.get(name)
            if counter is None:
                counter = self._m_handled[name] = metrics.EVENTS_HANDLED.labels(self.name, event_class(str(name)))
            counter.inc()

    async def store(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        """Record ``(log_seq, event)`` pairs and update the projection, in one transaction. Idempotent:
        an event id already recorded is skipped (D21). A batch Postgres refuses because of its data is
        recorded in parts, the refused events as rejected; only a failure of the database itself
        (``schema.transient``) is raised, for the caller to retry."""
        if not records:
            return
        try:
            await self._write(records)
        except Exception as exc:  # noqa: BLE001 - classified: the database's failures go up
            if schema.transient(exc):
                raise
            log.error("Postgres refused a batch of %d events (%s: %s): recording it in parts",
                      len(records), type(exc).__name__, exc)
            await self._store_parts(records, exc)

    async def _store_parts(self, records: list[tuple[int, dict[str, Any]]], exc: Exception) -> None:
        """Halve the refused batch until each refused event is alone, and record it as rejected."""
        if len(records) == 1:
            await self._reject(records[0], exc)
            return
        half = len(records) // 2
        for part in (records[:half], records[half:]):
            try:
                await self._write(part)
            except Exception as part_exc:  # noqa: BLE001
                if schema.transient(part_exc):
                    raise
                await self._store_parts(part, part_exc)

    async def _reject(self, record: tuple[int, dict[str, Any]], exc: Exception) -> None:
        seq, event = record
        reason = f"{type(exc).__name__}: {exc}"
        log.error("event %.200r of execution %.200r (%.100r) cannot be recorded as sent: %s; recorded as rejected",
                  event.get("event_id"), event.get("execution_id"), event.get("name"), reason)
        try:
            await self._write([(seq, schema.rejected(event, reason))])
        except Exception as again:  # noqa: BLE001
            if schema.transient(again):
                raise
            log.error("event %.200r cannot be recorded even as rejected (%s: %s): skipped",
                      event.get("event_id"), type(again).__name__, again)
            return
        self.rejected += 1
        self._m_rejected.inc()

    async def _write(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        """One transaction: COPY the rows into the staging table; then, in one round trip, update the
        projection and insert the events with their counters (schema.INSERT_EVENTS)."""
        if self._pool is None:
            raise psycopg.OperationalError("the event-recorder's connection pool is closed")
        rows = []
        for start in range(0, len(records), 16 * YIELD_EVERY):  # answering queries in between (see _record)
            rows += [schema.event_row(seq, event) for seq, event in records[start:start + 16 * YIELD_EVERY]]
            await asyncio.sleep(0)
        async with self._pool.connection() as conn:
            async with conn.transaction():
                async with conn.cursor() as cur:
                    async with cur.copy(schema.COPY_STAGE) as copy:
                        for n, row in enumerate(rows):
                            await copy.write_row(row)
                            if n % (16 * YIELD_EVERY) == 16 * YIELD_EVERY - 1:
                                await asyncio.sleep(0)
                    async with conn.pipeline():  # one round trip: the projection, then the events and counters
                        for sql, params in schema.projection([event for _, event in records]).items():
                            await cur.executemany(sql, params)
                        await cur.execute(schema.INSERT_EVENTS)

    # ------------------------------------------------------------------ catalog
    async def catalog_register(self, req: dict[str, Any]) -> dict[str, Any]:
        content = req.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BusError("bad_request", "content (the playbook's YAML text) is required")
        _storable("content", content)
        result = validate_text(content)
        if not result.ok:
            raise BusError("invalid_playbook", f"invalid playbook: {len(result.errors)} error(s)",
                           details=[_diagnostic(d) for d in result.errors])
        meta = result.document["metadata"]
        for key in ("path", "name"):  # YAML escapes ("\0", "\ud800") make them without one in the text
            if isinstance(meta.get(key), str):
                _storable(f"metadata.{key}", meta[key])
        by = _registrant(req.get("registered_by"))
        # a path is its first version's registrant's: others add versions with catalog.any (the gateway
        # says so); a request with no registrant comes from a stack without users (noetl run)
        any_path = by is None or req.get("any_path") is True
        for _ in range(20):
            try:
                async with self._connection() as conn:
                    cur = await conn.execute(
                        """INSERT INTO catalog (path, version, name, content, registered_by)
                           SELECT %(path)s, coalesce(max(version), 0) + 1, %(name)s, %(content)s, %(by)s
                           FROM catalog WHERE path = %(path)s
                           HAVING %(any)s OR count(*) = 0 OR %(uid)s = (SELECT registered_by->>'user_id' FROM catalog
                                                                      WHERE path = %(path)s ORDER BY version LIMIT 1)
                           RETURNING id, path, version, name, created_at""",
                        {"path": meta["path"], "name": meta.get("name"), "content": content, "by": Jsonb(by),
                         "any": any_path, "uid": (by or {}).get("user_id")})
                    row = await cur.fetchone()
                    if row is None:
                        raise BusError("forbidden", await _owned(conn, meta["path"]))
                break
            except psycopg.errors.UniqueViolation:
                await asyncio.sleep(0.01)  # a concurrent registration took this version: next one
        else:
            raise BusError("conflict", f"could not allocate a version for {meta['path']}")
        return {"id": row[0], "path": row[1], "version": row[2], "name": row[3], "created_at": _iso(row[4]),
                "warnings": [_diagnostic(d) for d in result.warnings]}

    async def catalog_get(self, req: dict[str, Any]) -> dict[str, Any]:
        select = "SELECT id, path, version, name, content, created_at, registered_by FROM catalog"
        if req.get("id") is not None:
            if _int(req["id"]) is None:
                raise BusError("bad_request", "id must be an integer")
            query, params, what = f"{select} WHERE id = %s", (req["id"],), f"catalog entry {req['id']}"
        elif isinstance(req.get("path"), str):
            path = schema.text(req["path"])  # as stored: a path Postgres cannot hold is in no entry
            if req.get("version") is not None:
                if _int(req["version"]) is None:
                    raise BusError("bad_request", "version must be an integer")
                query = f"{select} WHERE path = %s AND version = %s"
                params, what = (path, req["version"]), f"{path} version {req['version']}"
            else:
                query = f"{select} WHERE path = %s ORDER BY version DESC LIMIT 1"
                params, what = (path,), f"playbook {path}"
        else:
            raise BusError("bad_request", "give id, or path (and optionally version)")
        async with self._autocommit() as conn:  # one statement: a child's admission waits on this answer
            row = await (await conn.execute(query, params)).fetchone()
        if row is None:
            raise BusError("not_found", f"{what} is not in the catalog")
        return dict(zip(("id", "path", "version", "name", "content", "created_at", "registered_by"), map(_iso, row)))

    async def catalog_list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        limit = min(max(_int(req.get("limit")) or 1000, 1), 10_000)
        path = req.get("path")
        where, params = ("WHERE path = %s", [schema.text(path)]) if isinstance(path, str) and path else ("", [])
        async with self._connection() as conn:
            cur = await conn.execute(
                f"""SELECT id, path, version, name, created_at FROM catalog {where}
                    ORDER BY created_at DESC, id DESC LIMIT %s""", (*params, limit))
            rows = await cur.fetchall()
        return [dict(zip(("id", "path", "version", "name", "created_at"), map(_iso, r))) for r in rows]

    # ------------------------------------------------------------------ executions
    async def execution_get(self, req: dict[str, Any]) -> dict[str, Any]:
        xid = _execution_id(req)
        if req.get("brief"):  # what a client polls: one row, one statement (its count is on the row)
            async with self._autocommit() as conn:
                proj = await (await conn.execute(_SELECT_BRIEF, (xid,))).fetchone()
                if proj is None:
                    raise BusError("not_found", f"execution {xid} is not known")
                count = proj[-1] if proj[-1] is not None else await _event_count(conn, xid)  # recorded before it
            return {**_execution_row(proj[:-1]), "event_count": count}
        large = self.large.known(xid)  # then the statement reads no event: its answer is likely kept
        async with self._autocommit() as conn:  # one statement: one snapshot of the log (_SELECT_STATUS)
            rows = await (await conn.execute(_SELECT_STATUS, {"x": xid, "n": MAX_RESTARTS,
                                                              "m": 0 if large else folds.SMALL + 1})).fetchall()
        first = rows[0]
        proj, count, restarts = (first[:_N_EXECUTION] if first[0] is not None else None,
                                 first[_N_EXECUTION], first[_N_EXECUTION + 1])
        rows = [r[_N_EXECUTION + 2:] for r in rows if r[_N_EXECUTION + 2] is not None]
        if not rows and not (large and proj and count):
            raise BusError("not_found", f"execution {xid} is not known")
        if large or len(rows) > folds.SMALL:
            out, error = await self._large_status(xid, count, req.get("reader"))
        else:
            events = await self._readable([schema.row_event(r) for r in rows])
            out, error = summary(_fold(xid, events)), _error(events)
        if restarts:
            out["restarts"] = restarts
        p = _execution_row(proj) if proj else {}
        out.update({
            "path": p.get("path"), "version": p.get("version"),
            "error": error,
            "parent_execution_id": p.get("parent_execution_id"), "created_at": p.get("created_at"),
            "started_at": p.get("started_at"), "finished_at": p.get("finished_at"),
            "requested_by": p.get("requested_by"),  # who started it: D30's default signal rule reads it
            "event_count": count,
        })
        return out

    async def _large_status(self, xid: str, count: int, reader: Any) -> tuple[dict[str, Any], Any]:
        """The summary and error of an execution with more than ``folds.SMALL`` state events: a large fold
        (one at a time, streamed), kept by its event count."""
        async def make() -> tuple[Any, tuple]:
            ends: list[dict[str, Any]] = []
            async with self._snapshot() as conn:
                now = await _event_count(conn, xid)
                state, _ = await folds.stream(
                    conn, f"{schema.SELECT_EVENT} WHERE execution_id = %s AND {schema.STATE_EVENTS_SQL}"
                          " ORDER BY seq", (xid,), xid, self._readable,
                    seen=lambda e: ends.append(e) if e["name"] == "workflow.finished" else None)
            return (summary(state), _error(ends)), ("status", xid, now)

        (out, error), _ = await self.large.answer(("status", xid, count), xid, count, "the status", reader, make)
        return {**out}, error

    async def execution_events(self, req: dict[str, Any]) -> dict[str, Any]:
        """A page of the execution's events: at most ``limit`` and at most what fits in the reply
        budget; ``next_offset`` is where the next page starts (None after the last event). Optional
        filters (``names``, ``step``, ``task``, ``iteration``, ``step_run_id``) select among the events;
        ``offset``, ``total`` and ``next_offset`` then count the selected ones, and ``log_total`` is the
        whole log's."""
        xid = _execution_id(req)
        offset = max(_int(req.get("offset")) or 0, 0)
        limit = min(max(_int(req.get("limit")) if req.get("limit") is not None else 100, 0), MAX_PAGE)
        where, params = _event_filters(req)
        async with self._snapshot() as conn:
            log_total = await _event_count(conn, xid)
            total = log_total if not where else (await (await conn.execute(
                f"SELECT count(*) FROM event WHERE execution_id = %s{where}", (xid, *params))).fetchone())[0]
            cur = await conn.execute(
                f"{schema.SELECT_EVENT} WHERE execution_id = %s{where} ORDER BY seq OFFSET %s LIMIT %s",
                (xid, *params, offset, limit))
            rows = await cur.fetchall()
        if not log_total:
            raise BusError("not_found", f"execution {xid} is not known")
        events, n = await replies.page([schema.row_event(r) for r in rows], limits.current().max_reply_bytes,
                                       self.bus.payloads.put)
        end = offset + n
        out = {"events": events, "total": total, "offset": offset, "limit": limit,
               "next_offset": end if end < total else None}
        if where:
            out["log_total"] = log_total
        return out

    async def execution_state(self, req: dict[str, Any]) -> dict[str, Any]:
        """The console's view of the execution (core/view.py) as it stood after event ``upto`` (a
        count: the first ``upto`` events of the log) or after the event of log sequence ``seq``; by
        default after the last one. The state is the engine's fold (``state.apply``, D22) of the
        ``ctl`` events (and ``step.started``) up to that point — what admission and the router hold —
        and each loop run's iterations are counted in the log up to the same point. ``net``: also the
        playbook's net. At most ``max_state_events`` events are folded (``too_large`` past it)."""
        xid = _execution_id(req)
        upto, seq = req.get("upto"), req.get("seq")
        if upto is not None and (_int(upto) is None or upto < 0):
            raise BusError("bad_request", "upto must be a count of events (an integer from 0)")
        if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or abs(seq) >= 2**63):
            raise BusError("bad_request", "seq must be an event's log sequence (an integer)")
        net = bool(req.get("net"))
        async with self._autocommit() as conn:
            total = await _event_count(conn, xid)
        if not total:
            raise BusError("not_found", f"execution {xid} is not known")
        if upto is not None and upto >= total:
            upto = None  # after every event: the view of the whole log
        if total <= folds.SMALL:
            return await self._state_view(xid, upto, seq, net)
        whole = upto is None and seq is None  # only such a view is kept (folds.py)

        async def make() -> tuple[Any, tuple | None]:
            view = await self._state_view(xid, upto, seq, net)
            return view, ("state", xid, view["total"], net) if whole else None

        view, kept = await self.large.answer(("state", xid, total, net) if whole else None, xid, total,
                                             "the view of the state", req.get("reader"), make)
        if not kept:
            return view
        async with self._autocommit() as conn:  # the log has not moved; restarts are other executions'
            return _with_restarts(view, await _restarts(conn, xid))

    async def _state_view(self, xid: str, upto: Any, seq: Any, net: bool) -> dict[str, Any]:
        bound_limit = limits.current().max_state_events
        async with self._snapshot() as conn:
            proj = await (await conn.execute(
                f"SELECT {', '.join(_EXECUTION_COLUMNS)}, ({_STARTER_NAME}) FROM execution WHERE execution_id = %s",
                (xid,))).fetchone()
            starter = proj[-1] if proj else None
            proj = proj[:-1] if proj else None
            total = await _event_count(conn, xid)
            if not total:
                raise BusError("not_found", f"execution {xid} is not known")
            bound, position = None, total
            if upto is not None and upto < total:
                position = upto
                bound = -(2**62) if upto == 0 else (await (await conn.execute(
                    "SELECT seq FROM event WHERE execution_id = %s ORDER BY seq OFFSET %s LIMIT 1",
                    (xid, upto - 1))).fetchone())[0]
            elif seq is not None:
                bound = seq
                position = (await (await conn.execute(
                    "SELECT count(*) FROM event WHERE execution_id = %s AND seq <= %s", (xid, seq))).fetchone())[0]
            upto_sql, upto_params = ("", ()) if bound is None else (" AND seq <= %s", (bound,))
            ends: list[dict[str, Any]] = []
            state, n = await folds.stream(
                conn, f"{schema.SELECT_EVENT} WHERE execution_id = %s AND {schema.STATE_EVENTS_SQL}{upto_sql}"
                      " ORDER BY seq LIMIT %s", (xid, *upto_params, bound_limit + 1), xid, self._readable,
                seen=lambda e: ends.append(e) if e["name"] in LOOP_ENDS else None)
            if n > bound_limit:
                raise BusError("too_large", str(LimitExceeded(
                    "max_state_events", None, f"execution {xid}", what="the events folded for a view of the state")))
            restarts = await _restarts(conn, xid)
            loop_runs = [rid for step, ids in state.runs_of.items()
                         if isinstance((state.steps_by_name().get(step) or {}).get("loop"), dict) for rid in ids]
            counts: dict[str, dict[str, Any]] = {}
            totals: dict[str, int] = {}
            if loop_runs:
                counts, totals = await _loop_counts(conn, xid, loop_runs, upto_sql, upto_params)
            at = None
            if bound is not None and position:
                row = await (await conn.execute(
                    f"{schema.SELECT_EVENT} WHERE execution_id = %s AND seq <= %s ORDER BY seq DESC LIMIT 1",
                    (xid, bound))).fetchone()
                at = live.compact(schema.row_event(row)) if row else None
        loop_set = set(loop_runs)
        ended = {e["step_run_id"]: e["data"] for e in ends if e.get("step_run_id") in loop_set
                 and isinstance(e["data"], dict) and "total" in e["data"]}
        out = view.fitted(state, limits.current().max_reply_bytes - 64 * 1024, loops=counts, loop_totals=totals,
                          ended_counts=ended)
        p = _execution_row(proj) if proj else {}
        out.update({"position": position, "total": total, "at": at, "path": p.get("path"), "version": p.get("version"),
                    "created_at": p.get("created_at"), "started_at": p.get("started_at"),
                    "finished_at": p.get("finished_at"),
                    # a child's: its parent's starter's, on whose behalf it runs (username from up the chain)
                    "requested_by": out.get("requested_by") or ({"user_id": p["requested_by"], "username": starter}
                                                                 if p.get("requested_by") else None),
                    "parent_execution_id": out.get("parent_execution_id") or p.get("parent_execution_id")})
        if restarts:
            out["restarts"] = restarts
        if net:
            out["net"] = view.net(state.playbook)
        return out

    async def execution_timeline(self, req: dict[str, Any]) -> dict[str, Any]:
        """The execution's timeline (core/timeline.py): its step runs, their tasks' attempts, waits and
        loop iterations with their times, bounded whatever the execution's size. A loop of more than
        ``timeline.MAX_ITERATIONS`` iterations is counts per slice of the window (``from``, ``to``: epoch
        seconds, default the execution's span; ``buckets`` slices), read from the loop events' partial
        index; task events are read only in the stretches of the log where the other runs ran."""
        xid = _execution_id(req)
        buckets = _int(req.get("buckets")) or timeline.DEFAULT_BUCKETS
        if not 1 <= buckets <= timeline.MAX_BUCKETS:
            raise BusError("bad_request", f"buckets must be from 1 to {timeline.MAX_BUCKETS}")
        bounds = []
        for key in ("from", "to"):
            value = req.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not -1e11 < value < 1e11):
                raise BusError("bad_request", f"{key} must be a time in epoch seconds")
            bounds.append(value)
        now = time.time()
        cap = limits.current().max_state_events
        async with self._autocommit() as conn:
            total = await _event_count(conn, xid)
        async with self.large.fold(xid, total, "the timeline", req.get("reader")), self._snapshot() as conn:
            proj = await (await conn.execute(
                "SELECT status, extract(epoch FROM created_at)::float8, extract(epoch FROM finished_at)::float8"
                " FROM execution WHERE execution_id = %s", (xid,))).fetchone()
            first = await (await conn.execute(
                "SELECT extract(epoch FROM \"timestamp\")::float8 FROM event WHERE execution_id = %s ORDER BY seq"
                " LIMIT 1", (xid,))).fetchone()
            if first is None:
                raise BusError("not_found", f"execution {xid} is not known")
            # the runs: their admissions and terminal events, through the state events' partial index
            cur = await conn.execute(
                "SELECT seq, name, step, step_run_id, extract(epoch FROM \"timestamp\")::float8,"
                " CASE WHEN name = 'step.failed' THEN jsonb_build_object('kind', data->'error'->'kind',"
                " 'total', data->'total', 'done', data->'done', 'failed', data->'failed')"
                " WHEN name = 'loop.done' THEN jsonb_build_object('total', data->'total', 'done', data->'done',"
                " 'failed', data->'failed') END"
                f" FROM event WHERE execution_id = %s AND {schema.STATE_EVENTS_SQL} AND name = ANY(%s)"
                " ORDER BY seq LIMIT %s", (xid, list(timeline.RUN_EVENTS), cap + 1))
            rows = await cur.fetchall()
            if len(rows) > cap:
                raise BusError("too_large", str(LimitExceeded(
                    "max_state_events", None, f"execution {xid}", what="the step events of a timeline")))
            runs, by_id = timeline.run_spans(rows)
            shown = runs[-timeline.MAX_RUNS:]
            ids = [r["run_id"] for r in shown]
            seqs: dict[str, list[Any]] = {}
            for seq, name, _step, run_id, _ts, _data in rows:
                if run_id in by_id:
                    span = seqs.setdefault(run_id, [seq, None])
                    if name in timeline.TERMINAL:
                        span[1] = seq
            start = first[0]
            end = proj[2] if proj and proj[2] is not None else None
            lo = max(bounds[0], start) if bounds[0] is not None else start
            hi = min(bounds[1], end or now) if bounds[1] is not None else (end or now)
            if hi <= lo:
                hi = lo + 0.001
            # loops: counters kept with the events, and each run's loop.started (the loop events' index)
            loops: dict[str, dict[str, Any]] = {}
            if ids:
                cur = await conn.execute(
                    "SELECT step_run_id, extract(epoch FROM \"timestamp\")::float8,"
                    " CASE WHEN jsonb_typeof(data->'total') = 'number' THEN (data->>'total')::numeric"
                    " WHEN jsonb_typeof(data->'items') = 'array' THEN jsonb_array_length(data->'items') END"
                    f" FROM event WHERE execution_id = %s AND {schema.LOOP_EVENTS_SQL} AND name = 'loop.started'"
                    " AND step_run_id = ANY(%s)", (xid, ids))
                for rid, ts, total in await cur.fetchall():
                    loops[rid] = {"started_at": ts, "total": int(total) if total is not None and 0 <= total < 2**31
                                  else None, "started": 0, "done": 0, "failed": 0}
                for rid in ids:  # a loop that failed before its loop.started (a bad `in`): none to draw
                    if rid not in loops and (by_id[rid].get("counts") or {}).get("total") is not None:
                        loops[rid] = {"started_at": None, "total": by_id[rid]["counts"]["total"], "started": 0,
                                      "done": 0, "failed": 0}
            if loops:
                cur = await conn.execute(
                    "SELECT step_run_id, started, done, failed, extract(epoch FROM first_at)::float8,"
                    " extract(epoch FROM last_at)::float8 FROM loop_progress WHERE execution_id = %s"
                    " AND step_run_id = ANY(%s)", (xid, list(loops)))
                for rid, a, d, f, t0, t1 in await cur.fetchall():
                    loops[rid].update({"started": a, "done": d, "failed": f, "first_at": t0, "last_at": t1})
            listed, big, budget = [], [], timeline.MAX_LISTED_ITERATIONS
            for rid, loop in loops.items():
                n = max(loop["started"] or 0, (loop["done"] or 0) + (loop["failed"] or 0))
                if n <= timeline.MAX_ITERATIONS and n <= budget:
                    listed.append(rid)
                    budget -= n
                elif n:
                    big.append(rid)
            iterations: dict[str, list[dict[str, Any]]] = {}
            if listed:
                cur = await conn.execute(
                    "SELECT step_run_id, iteration, name, extract(epoch FROM \"timestamp\")::float8 FROM event"
                    f" WHERE execution_id = %s AND {schema.LOOP_EVENTS_SQL} AND name <> 'loop.started'"
                    " AND step_run_id = ANY(%s)", (xid, listed))
                iterations = timeline.iteration_spans(await cur.fetchall())
            counts: dict[str, dict[str, list[int]]] = {}
            if big:  # the iterations that ended, counted per slice, never read one by one (the loop events' index)
                cur = await conn.execute(
                    "SELECT step_run_id, name, width_bucket(extract(epoch FROM \"timestamp\")::float8, %s, %s, %s),"
                    f" count(*) FROM event WHERE execution_id = %s AND {schema.LOOP_EVENTS_SQL}"
                    " AND name IN ('loop.iteration.done', 'loop.iteration.failed') AND step_run_id = ANY(%s)"
                    " GROUP BY 1, 2, 3",
                    (lo, hi, buckets, xid, big))
                counts = timeline.histogram(await cur.fetchall(), buckets)
            # tasks: of the runs that are not big loops, in the stretches of the log where they ran
            small = [rid for rid in ids if rid not in big]
            tasks: dict[str, list[dict[str, Any]]] = {}
            total, cut = 0, False
            if small:
                stretches = timeline.ranges([tuple(seqs[rid]) for rid in small])
                where = " OR ".join("seq >= %s" if b is None else "seq BETWEEN %s AND %s" for _, b in stretches)
                params = [v for a, b in stretches for v in ((a,) if b is None else (a, b))]
                limit = 3 * timeline.MAX_TASKS + len(small)
                cur = await conn.execute(
                    "SELECT step_run_id, name, task, iteration, attempt, task_run_id,"
                    " extract(epoch FROM \"timestamp\")::float8, status FROM event"
                    f" WHERE execution_id = %s AND ({where}) AND name = ANY(%s) AND step_run_id = ANY(%s)"
                    " ORDER BY seq LIMIT %s", (xid, *params, list(timeline.TASK_EVENTS), small, limit))
                found = await cur.fetchall()
                cut = len(found) >= limit
                tasks, total = timeline.task_spans(found, by_id)
            waits: list[dict[str, Any]] = []
            if ids:
                cur = await conn.execute(
                    "SELECT step_run_id, iteration, task, kind, signal, extract(epoch FROM started_at)::float8,"
                    " extract(epoch FROM ended_at)::float8 FROM wait WHERE execution_id = %s AND step_run_id = ANY(%s)"
                    " ORDER BY started_at LIMIT %s", (xid, ids, 4 * timeline.MAX_ITERATIONS))
                keys = ("step_run_id", "iteration", "task", "kind", "signal", "started_at", "ended_at")
                waits = [dict(zip(keys, r)) for r in await cur.fetchall()]
        return timeline.build(
            execution={"execution_id": xid, "status": proj[0] if proj else None, "start": start, "end": end},
            runs=runs, loops=loops, iterations=iterations, counts=counts, tasks=tasks, tasks_total=total,
            waits=waits, window=(lo, hi), buckets=buckets, now=now, tasks_cut=cut)

    async def execution_stats(self, req: dict[str, Any]) -> dict[str, Any]:
        """The console's overview of the executions created in ``[since, until)`` (epoch seconds; default
        the last 24 hours, at most :data:`MAX_STATS_DAYS` days), from the ``execution`` projection: how
        many per status in each of ``buckets`` slices, the totals, the playbooks whose finished executions
        took longest (percentiles of their durations, the slowest one), and the failed ones by error kind
        (with the latest one's message). A few aggregate queries, whatever the number of executions."""
        now = time.time()
        until = req.get("until") if req.get("until") is not None else now
        since = req.get("since") if req.get("since") is not None else until - 86_400
        for key, value in (("since", since), ("until", until)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e11 < value < 1e11:
                raise BusError("bad_request", f"{key} must be a time in epoch seconds")
        if until <= since or until - since > MAX_STATS_DAYS * 86_400:
            raise BusError("bad_request", f"since must come before until, at most {MAX_STATS_DAYS} days before")
        buckets = _int(req.get("buckets")) or 48
        if not 1 <= buckets <= 400:
            raise BusError("bad_request", "buckets must be from 1 to 400")
        window = "created_at >= to_timestamp(%s) AND created_at < to_timestamp(%s)"
        async with self._snapshot() as conn:
            cur = await conn.execute(
                "SELECT width_bucket(extract(epoch FROM created_at)::float8, %s, %s, %s), status, count(*)"
                f" FROM execution WHERE {window} GROUP BY 1, 2", (since, until, buckets, since, until))
            slices: list[dict[str, int]] = [{} for _ in range(buckets)]
            totals: dict[str, int] = {}
            for bucket, status, n in await cur.fetchall():
                if 1 <= bucket <= buckets:
                    slices[bucket - 1][status] = n
                totals[status] = totals.get(status, 0) + n
            cur = await conn.execute(
                "SELECT path, count(*), avg(d), percentile_cont(0.5) WITHIN GROUP (ORDER BY d),"
                " percentile_cont(0.95) WITHIN GROUP (ORDER BY d), max(d), (array_agg(execution_id ORDER BY d DESC))[1],"
                " count(*) FILTER (WHERE status = 'FAILED')"
                " FROM (SELECT path, execution_id, status, extract(epoch FROM finished_at - started_at)::float8 AS d"
                f" FROM execution WHERE {window} AND finished_at IS NOT NULL AND started_at IS NOT NULL) f"
                " GROUP BY path ORDER BY 5 DESC, 6 DESC LIMIT %s", (since, until, MAX_STATS_ROWS))
            slowest = [{"path": path, "count": n, "avg_seconds": avg, "p50_seconds": p50, "p95_seconds": p95,
                        "max_seconds": top, "slowest_execution": xid, "failed": failed}
                       for path, n, avg, p50, p95, top, xid, failed in await cur.fetchall()]
            cur = await conn.execute(
                "SELECT coalesce(error->>'kind', 'unknown'), count(*), extract(epoch FROM max(finished_at))::float8,"
                " (array_agg(execution_id ORDER BY finished_at DESC NULLS LAST))[1],"
                " left((array_agg(error->>'message' ORDER BY finished_at DESC NULLS LAST))[1], 500),"
                " count(DISTINCT path)"
                f" FROM execution WHERE {window} AND status = 'FAILED' GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT %s",
                (since, until, MAX_STATS_ROWS))
            failures = [{"kind": kind, "count": n, "last_at": last, "latest_execution": xid, "latest_message": message,
                         "playbooks": paths} for kind, n, last, xid, message, paths in await cur.fetchall()]
        width = (until - since) / buckets
        return {"since": since, "until": until, "buckets": buckets, "bucket_seconds": width,
                "by_status": [{"from": since + i * width, **counts} for i, counts in enumerate(slices)],
                "totals": totals, "slowest": slowest, "failures": failures}

    async def execution_seed(self, req: dict[str, Any]) -> dict[str, Any]:
        """D32: what a restart of the execution from ``from_step`` starts with (core/restart.py): the
        state folded up to the step's first ``step.started`` (its ``ctl`` events before it, through the
        partial index ``event_state``, at most ``max_state_events``). ``conflict`` for an execution not
        finished, ``invalid_restart`` for a step it has not or that never started, ``too_large`` past
        the limit. Values the log holds by reference (D23) stay references."""
        xid = _execution_id(req)
        step = req.get("from_step")
        if not isinstance(step, str) or not step or len(step) > 1024:
            raise BusError("bad_request", "from_step (a step's name) is required")
        bound = limits.current().max_state_events
        async with self._autocommit() as conn:
            total = await _event_count(conn, xid)
        try:
            async with self.large.fold(xid, total, "a restart's seed", req.get("reader")), self._snapshot() as conn:
                row = await (await conn.execute("SELECT status FROM execution WHERE execution_id = %s",
                                                (xid,))).fetchone()
                if row is None:
                    raise BusError("not_found", f"execution {xid} is not known")
                restart.finished(xid, row[0])
                cut = await (await conn.execute(
                    f"{schema.SELECT_EVENT} WHERE execution_id = %s AND name = 'step.started' AND step = %s"
                    " ORDER BY seq LIMIT 1", (xid, schema.text(step)))).fetchone()
                if cut is None:  # nothing to fold but what says why: the request, its evaluation, the skips
                    cur = await conn.execute(
                        f"{schema.SELECT_EVENT} WHERE execution_id = %s AND (name IN ('playbook.execution.requested',"
                        " 'playbook.request.evaluated') OR (name = 'step.skipped' AND step = %s)) ORDER BY seq LIMIT %s",
                        (xid, schema.text(step), bound + 1))
                else:
                    cur = await conn.execute(
                        f"{schema.SELECT_EVENT} WHERE execution_id = %s AND {schema.STATE_EVENTS_SQL} AND seq < %s"
                        " ORDER BY seq LIMIT %s", (xid, cut[0], bound + 1))
                rows = await cur.fetchall()
                events = [e for e in map(schema.row_event, [*rows, *([cut] if cut else [])])
                          if isinstance(e["data"], dict) and not schema.is_rejected(e)]
                del rows
                out = restart.seed(await self._readable(events), step, status=row[0], execution_id=xid,
                                   max_events=bound)
        except restart.Refused as exc:
            kind = "conflict" if exc.kind == restart.NOT_FINISHED else "invalid_restart"
            raise BusError(kind, exc.message, details={"reason": exc.kind}) from None
        except LimitExceeded as exc:
            raise BusError("too_large", str(exc)) from None
        out["status"] = row[0]
        return out

    async def _readable(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``events`` with what a fold must read of them read back when a message carried it by reference
        (D23): a request or its evaluation stored whole as one reference (fields each under the limit,
        together over it), a restart's seed, down to its runs and tokens (a result inside one stays the
        reference the log holds), and a playbook too big to travel inline. Unchanged when such a value has
        expired."""
        for event in events:
            data = event["data"]
            try:
                if event["name"] in ("playbook.execution.requested", "playbook.request.evaluated") and is_ref(data):
                    data = event["data"] = await self.bus.payloads.expand(data)
                if event["name"] == "playbook.execution.requested" and isinstance(data, dict) and "seed" in data:
                    event["data"] = {**data, "seed": await self._skeleton(data["seed"])}
                elif event["name"] == "playbook.request.evaluated" and isinstance(data, dict) \
                        and is_ref(data.get("playbook")):
                    event["data"] = {**data, "playbook": await self.bus.payloads.expand(data["playbook"])}
            except PayloadMissing as exc:
                log.warning("execution %s: %s of event %s cannot be read back: %s", event["execution_id"],
                            "the seed" if "seed" in data else "the playbook", event["event_id"], exc)
        return events

    async def _skeleton(self, seed: Any) -> Any:
        get = self.bus.payloads.get
        if is_ref(seed):
            seed = await get(seed)
        if not isinstance(seed, dict):
            return seed
        seed = {k: (await get(v) if is_ref(v) else v) for k, v in seed.items()}
        for key in ("runs", "tokens", "delayed"):
            if isinstance(seed.get(key), list):
                seed[key] = [await get(item) if is_ref(item) else item for item in seed[key]]
        return seed

    async def execution_result(self, req: dict[str, Any]) -> dict[str, Any]:
        """One step run's outcome as its terminal event carries it: ``{run_id, step, event, result,
        error}`` (a big result travels by reference: the gateway expands it for a download)."""
        xid = _execution_id(req)
        run_id = req.get("run_id")
        if not isinstance(run_id, str) or not run_id or len(run_id) > 256:
            raise BusError("bad_request", "run_id is required")
        async with self._connection() as conn:
            row = await (await conn.execute(
                "SELECT step, name, data FROM event WHERE execution_id = %s AND step_run_id = %s"
                " AND name IN ('step.done', 'step.failed', 'loop.done') ORDER BY seq LIMIT 1",
                (xid, schema.text(run_id)))).fetchone()
        if row is None:
            raise BusError("not_found", f"execution {xid} has no ended step run {run_id}")
        data = row[2] if isinstance(row[2], dict) else {}
        return {"execution_id": xid, "run_id": run_id, "step": row[0], "event": row[1],
                "result": data.get("result"), "error": data.get("error")}

    async def execution_list(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        """Projection rows, newest first: optional ``status``, ``user`` (a user id), ``path`` (a
        playbook), ``id_prefix`` (the start of an execution id), ``since`` and ``until`` (created at, epoch
        seconds). Each row also has
        ``requested_by_name``: the username its request event recorded; a child's is its nearest
        ancestor's (it was started on that user's behalf)."""
        limit = min(max(_int(req.get("limit")) or 50, 1), MAX_PAGE)
        offset = max(_int(req.get("offset")) or 0, 0)
        status = req.get("status")
        if status is not None and str(status).upper() not in STATUSES:
            raise BusError("bad_request", f"status must be one of {', '.join(STATUSES)}")
        for key in ("user", "path", "id_prefix"):
            if req.get(key) is not None and not isinstance(req.get(key), str):
                raise BusError("bad_request", f"{key} must be a string")
        for key in ("since", "until"):
            value = req.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not -1e11 < value < 1e11):
                raise BusError("bad_request", f"{key} must be a time in epoch seconds")
        conditions = [(c, v) for c, v in (
            ("status = %s", str(status).upper() if status else None), ("requested_by = %s", req.get("user")),
            ("path = %s", schema.text(req["path"]) if req.get("path") else None),
            ("starts_with(execution_id, %s)", schema.text(req["id_prefix"]) if req.get("id_prefix") else None),
            ("created_at >= to_timestamp(%s)", req.get("since")), ("created_at < to_timestamp(%s)", req.get("until")),
        ) if v is not None]
        where = f"WHERE {' AND '.join(c for c, _ in conditions)}" if conditions else ""
        async with self._connection() as conn:
            cur = await conn.execute(
                f"SELECT {', '.join(_EXECUTION_COLUMNS)}, ({_STARTER_NAME}) FROM execution {where}"
                " ORDER BY created_at DESC NULLS LAST, execution_id OFFSET %s LIMIT %s",
                (*[v for _, v in conditions], offset, limit))
            rows = await cur.fetchall()
        return [{**_execution_row(r[:-1]), "requested_by_name": r[-1]} for r in rows]

    async def execution_status(self, req: dict[str, Any]) -> dict[str, Any]:
        """One execution's projection row, in brief: ``{execution_id, status, requested_by}`` (the
        credentials service asks whether an execution still runs); ``not_found`` when not recorded."""
        xid = req.get("execution_id")
        if not isinstance(xid, str) or not xid:
            raise BusError("bad_request", "execution_id must be a string")
        async with self._autocommit() as conn:
            row = await (await conn.execute("SELECT status, requested_by FROM execution WHERE execution_id = %s",
                                            (schema.text(xid),))).fetchone()
        if row is None:
            raise BusError("not_found", f"execution {xid} is not recorded")
        return {"execution_id": xid, "status": row[0], "requested_by": row[1]}

    async def execution_waits(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        """D30: waits in progress of running executions, oldest first (``execution_id``, ``kind``
        filter); each with its execution's path and who started it (the gateway filters by role)."""
        limit = min(max(_int(req.get("limit")) or 100, 1), MAX_PAGE)
        conditions = [(c, v) for c, v in (("w.execution_id = %s", req.get("execution_id")), ("w.kind = %s", req.get("kind")))
                      if v is not None]
        if any(not isinstance(v, str) for _, v in conditions):
            raise BusError("bad_request", "execution_id and kind must be strings")
        where = "".join(f" AND {c}" for c, _ in conditions)
        async with self._connection() as conn:
            cur = await conn.execute(
                "SELECT w.wait_id, w.execution_id, w.step, w.task, w.iteration, w.kind, w.signal, w.spec, w.started_at, "
                "x.path, x.requested_by FROM wait w JOIN execution x USING (execution_id) "
                f"WHERE w.ended_at IS NULL AND x.status = 'RUNNING'{where} ORDER BY w.started_at, w.wait_id LIMIT %s",
                (*[v for _, v in conditions], limit))
            rows = await cur.fetchall()
        keys = ("wait_id", "execution_id", "step", "task", "iteration", "kind", "signal", "spec", "started_at", "path",
                "requested_by")
        return [{k: _iso(v) for k, v in zip(keys, row)} for row in rows]

    async def ping(self, req: dict[str, Any]) -> dict[str, Any]:
        """The real state: ``ok`` when the database answers and the consumer is bound."""

        async def lag() -> int | None:  # of the partitions this replica reads
            try:
                infos = await asyncio.gather(*(self.bus.js.consumer_info(EVENTS, feeds.durable(p), timeout=0.8)
                                               for p in self.feeds))
                return sum((info.num_pending or 0) + (info.num_ack_pending or 0) for info in infos)
            except Exception:  # noqa: BLE001 - lag is best effort
                return None

        db, pending = await asyncio.gather(self._database_ok(), lag())
        consumer = self._consuming()
        return {"ok": db and consumer, "database": db, "consumer": consumer, "lag": pending,
                "recorded": self.recorded, "rejected": self.rejected}

    async def ready(self) -> dict[str, Any]:
        """Readiness (the metrics port): Postgres reachable and the events consumer bound."""
        db = await self._database_ok()
        consumer = self._consuming()
        out: dict[str, Any] = {"ok": db and consumer, "database": db, "consumer": consumer}
        if not db:
            out["error"] = f"the event database is not reachable ({self._db_error})" if self._pool is None \
                else "the event database does not answer"
        elif not consumer:
            out["error"] = "the events consumer is not bound"
        return out

    async def _database_ok(self) -> bool:
        if self._pool is None:
            return False
        try:
            async with self._pool.connection(timeout=0.5) as conn:
                await asyncio.wait_for(conn.execute("SELECT 1"), 0.5)
            return True
        except Exception:  # noqa: BLE001 - any failure means "not reachable"
            return False

    def _consuming(self) -> bool:
        return self.membership is not None and self._task is not None and not self._task.done()

    # ------------------------------------------------------------------ helpers
    def _connection(self):
        if self._pool is None:
            if self._stopping.is_set():
                raise BusError("unavailable", "the event-recorder is stopping")
            raise BusError("unavailable", f"the event database is not reachable yet ({self._db_error}); "
                                          "the event-recorder keeps trying")
        return self._pool.connection(timeout=5)

    @contextlib.asynccontextmanager
    async def _autocommit(self):
        """A connection for a reply that reads with one statement (each then sees one moment): in
        autocommit, so no BEGIN and COMMIT travel around it (a client polling a status pays three
        round trips to Postgres otherwise, not one)."""
        async with self._connection() as conn:
            await conn.set_autocommit(True)
            try:
                yield conn
            finally:
                if not conn.closed:
                    await conn.set_autocommit(False)

    @contextlib.asynccontextmanager
    async def _snapshot(self):
        """A connection whose reads all see the log at one moment (a read-only REPEATABLE READ
        transaction): a reply that counts the events and then reads them never mixes two moments (a
        count from before a batch committed beside the events of that batch)."""
        async with self._connection() as conn:
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield conn


def _by_feed(batch: list[tuple[Feed, Any]]) -> dict[Feed, list[Any]]:
    """A batch's messages by feed, each feed's in their order."""
    groups: dict[Feed, list[Any]] = {}
    for feed, msg in batch:
        groups.setdefault(feed, []).append(msg)
    return groups


def _with_restarts(view: dict[str, Any], restarts: list[str]) -> dict[str, Any]:
    out = {k: v for k, v in view.items() if k != "restarts"}
    if restarts:
        out["restarts"] = restarts
    return out


async def _restarts(conn: Any, xid: str) -> list[str]:
    """D32: the executions restarted from this one, oldest first (at most ``MAX_RESTARTS``)."""
    cur = await conn.execute("SELECT execution_id FROM execution WHERE restarted_from = %s"
                             " ORDER BY created_at, execution_id LIMIT %s", (xid, MAX_RESTARTS))
    return [r[0] for r in await cur.fetchall()]


async def _event_count(conn: Any, xid: str) -> int:
    """The execution's number of events: its counter (kept with the events, schema.counters), or for an
    execution recorded before the counter existed, counted."""
    row = await (await conn.execute("SELECT event_count FROM execution WHERE execution_id = %s", (xid,))).fetchone()
    if row is not None and row[0] is not None:
        return row[0]
    return (await (await conn.execute("SELECT count(*) FROM event WHERE execution_id = %s", (xid,))).fetchone())[0]


async def _loop_counts(conn: Any, xid: str, runs: list[str], upto_sql: str,
                       upto_params: tuple) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """Each loop run's iterations (view.loop_counts) and number of items: after the last event from the
    counters, up to a point of the log (time travel) counted through the partial index ``event_loops``."""
    if upto_sql:
        cur = await conn.execute(
            "SELECT step_run_id, name, count(*), extract(epoch FROM min(\"timestamp\"))::float8,"
            " extract(epoch FROM max(\"timestamp\"))::float8 FROM event WHERE execution_id = %s"
            f" AND {schema.LOOP_EVENTS_SQL} AND name <> 'loop.started' AND step_run_id = ANY(%s){upto_sql}"
            " GROUP BY step_run_id, name", (xid, runs, *upto_params))
        counts = view.loop_counts(await cur.fetchall())  # first and last: of the ended iterations (the rate)
    else:
        cur = await conn.execute(
            "SELECT step_run_id, started, done, failed, extract(epoch FROM first_at)::float8,"
            " extract(epoch FROM last_at)::float8 FROM loop_progress WHERE execution_id = %s AND step_run_id = ANY(%s)",
            (xid, runs))
        counts = {r: {"started": a, "done": d, "failed": f, "first_at": t0, "last_at": t1}
                  for r, a, d, f, t0, t1 in await cur.fetchall()}
    cur = await conn.execute(
        "SELECT step_run_id, CASE WHEN jsonb_typeof(data->'total') = 'number' THEN (data->>'total')::numeric"
        " WHEN jsonb_typeof(data->'items') = 'array' THEN jsonb_array_length(data->'items') END"
        f" FROM event WHERE execution_id = %s AND {schema.LOOP_EVENTS_SQL} AND name = 'loop.started'"
        f" AND step_run_id = ANY(%s){upto_sql}", (xid, runs, *upto_params))
    totals = {rid: int(n) for rid, n in await cur.fetchall() if n is not None and 0 <= n < 2**31}
    return counts, totals


def _fold(xid: str, events: list[dict[str, Any]]) -> ExecutionState:
    return folds.fold_into(ExecutionState(xid), events)


def _error(events: list[dict[str, Any]]) -> Any:
    """The error the last ``workflow.finished`` among ``events`` names (None if none does)."""
    finished = [e["data"] for e in events if e["name"] == "workflow.finished" and isinstance(e["data"], dict)]
    return finished[-1].get("error") if finished else None


def _event_filters(req: dict[str, Any]) -> tuple[str, list[Any]]:
    """The SQL conditions of an events query's filters (``names``, ``step``, ``task``, ``iteration``,
    ``step_run_id``), each checked."""
    where, params = "", []
    names = req.get("names")
    if names is not None:
        if not isinstance(names, list) or not names or len(names) > MAX_FILTER_NAMES or \
                not all(isinstance(n, str) and n for n in names):
            raise BusError("bad_request", f"names must be a list of 1 to {MAX_FILTER_NAMES} event names")
        where += " AND name = ANY(%s)"
        params.append([schema.text(n) for n in names])
    for key in ("step", "task", "step_run_id"):
        value = req.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise BusError("bad_request", f"{key} must be a string")
            where += f" AND {key} = %s"
            params.append(schema.text(value))
    if req.get("iteration") is not None:
        if _int(req["iteration"]) is None:
            raise BusError("bad_request", "iteration must be an integer")
        where += " AND iteration = %s"
        params.append(req["iteration"])
    return where, params


def _execution_of(subject: str) -> str | None:
    """The execution of a stored events message (``noetl.pevt.<P>.<class>.<execution_id>.<writer>``)."""
    parts = subject.split(".")
    return parts[4] if len(parts) >= 5 else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**31 else None


def _storable(what: str, value: str) -> None:
    reason = schema.unstorable(value)
    if reason:
        raise BusError("bad_request", f"{what} {reason}: Postgres cannot store it")


def _execution_id(req: dict[str, Any]) -> str:
    xid = req.get("execution_id")
    if not isinstance(xid, str) or not xid:
        raise BusError("bad_request", "execution_id is required")
    return schema.text(xid)  # as stored


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception:  # noqa: BLE001 - best effort (the message is redelivered after ack_wait anyway)
        pass


def _json_loads(data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:  # a number orjson cannot hold (jsonb keeps numerics of any size)
        return json.loads(data)


async def _configure(conn) -> None:
    set_json_loads(_json_loads, conn)
    await conn.execute(schema.CREATE_STAGE)
    await conn.commit()


__all__ = ["RecorderService", "DURABLE", "FILTER", "QUEUE"]
