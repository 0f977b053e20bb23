"""The NATS side of every service: streams, subjects, consumers, publishing, request/reply.

Streams and subjects (their names: :mod:`noetl_mesh.contracts.subjects`; docs/architecture.md §3):

- ``NOETL_EVENTS`` (JetStream, limits retention, file storage): every event. Publishers write
  ``noetl.evt.<writer>.<class>.<execution_id>`` (writer: ``gateway``, ``admission``, ``router``,
  ``loop-coordinator`` or ``worker``, from the events' ``source``, so that NATS permissions let each
  service's user publish as itself only; class: ``ctl``, ``flat``, ``loop``, ``dispatch`` or ``info``,
  see :func:`batch_class`); the stream's subject transform stores it as
  ``noetl.pevt.<partition>.<class>.<execution_id>.<writer>`` with ``partition = hash(execution_id) % P``.
  Control-plane services read ``ctl`` events (and ``flat`` or ``loop`` ones) through one pinned durable
  consumer per partition (:mod:`.pinned`: per-execution serialisation across any number of replicas); the
  event-recorder reads everything. Readers keep only the events the subject's writer may write
  (:func:`admitted`).
- ``NOETL_COMMANDS`` (JetStream, work-queue retention): ``noetl.cmd.<pool>.<execution_id>.<lane>``, one durable
  consumer per lane of a pool (``lane-<pool>-p<lane>``), shared by that pool's workers, which take from the
  lanes in turn (``contracts.subjects.lane_of``: a lane per starting user).
- core NATS: ``noetl.q.<service>.<verb>`` request/reply reads (JSON in, JSON out, errors as
  ``{"error": {...}}``), and ``noetl.cancel.<execution_id>`` broadcasts.

An events message is a JSON *list* of events: the events of one decision (or of one worker flush)
travel and are stored together, so a decision lands whole or not at all and a step costs a few
messages instead of one per event. An event's place in the log is ``log_seq(stream sequence, index in
its message)``. Every published message carries a W3C ``traceparent`` header (OpenTelemetry
propagation), and every JetStream publish a ``Nats-Msg-Id`` (derived from the event or command ids)
so a republish after a crash is stored once (D21).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    SubjectTransform,
)
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from . import logs, metrics, tls, tracing
from ..lang.durations import rfc3339
from ..core.events import (CTL, DISPATCH, DISPATCH_EVENTS, FLAT, INFO, INFO_EVENTS, LOOP, LOOP_EVENTS,  # noqa: F401
                           batch_class, event_class, split_by_writer, writer_of)
from .micro import Endpoint
from .wire import NO_PLACEMENT, UNHANDLEABLE, dumps, handle_one, loads  # noqa: F401 - also read from here
from .payloads import DEFAULT_LIMIT, MARKER, PayloadMissing, PayloadStore

log = logging.getLogger("noetl.bus")


async def _process_pong(self: Client) -> None:
    """nats-py's handling of a PONG, keeping a flush that timed out from breaking the read loop: the
    flush cancels its future but leaves it queued, so the PONG that answers it later set the result of
    a cancelled future (``InvalidStateError``), logged with a traceback as the connection's error
    under load. Each PONG still answers the oldest PING, whether or not its waiter is still there."""
    if self._pongs:
        future = self._pongs.pop(0)
        if not future.done():
            future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


Client._process_pong = _process_pong  # type: ignore[method-assign]

from ..contracts.subjects import (  # noqa: F401 - the names of every stream and subject: contracts/subjects.py
    COMMAND_SUBJECTS, COMMANDS, EVENT_SUBJECTS, EVENTS, LEGACY_EVENT_SUBJECTS, LOST_COMMANDS, MAX_DELIVERIES,
    Q_CATALOG_GET, Q_CATALOG_LIST, Q_CATALOG_REGISTER, Q_CREDENTIAL_DELETE, Q_CREDENTIAL_GET, Q_CREDENTIAL_LIST,
    Q_CREDENTIAL_PUT, Q_CREDENTIAL_ROLES, Q_EXECUTION_EVENTS, Q_EXECUTION_GET, Q_EXECUTION_LIST, Q_EXECUTION_STATUS, Q_EXECUTION_WAITS,
    Q_EXECUTION_RESULT, Q_EXECUTION_SEED, Q_EXECUTION_STATE, Q_RECORDER_PING, TIMER_SUBJECTS, TREE_PREFIX, TREES, LIVE_ASK, LIVE_LIST, LIVE_WATCH, batch_subject_of, cancel_subject, control_filter,
    answerable, command_subject, credential_resolve_subject, lane_of, live_subject, pool_filter, timer_subject, timer_target,
    tree_subject)

_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")  # an id that may stand in a subject as one token
SCHEDULER_HEADER = "Nats-Scheduler"  # on a message the server wrote at a schedule's time: the schedule's subject
DEFAULT_PARTITIONS = 16
PING_INTERVAL = 5.0  # seconds between a connection's pings (NOETL_NATS_PING_INTERVAL); 2 unanswered: another node
# Subject classes (which events each control-plane service folds) live in the core: core/events.py.


BATCH_MAX = 1024  # events per message; also the factor of log_seq


def log_seq(stream_seq: int, index: int) -> int:
    """The log order of the ``index``-th event of the message at ``stream_seq``."""
    return stream_seq * BATCH_MAX + index


def batch_subject(events: list[dict[str, Any]], flat: bool = False) -> str:
    """``noetl.evt.<writer>.<class>.<execution_id>``: the writer named by the events' ``source``; the
    class the most demanding among the events (ctl > loop > dispatch > info), ``flat`` for a ctl message
    of an execution its writer knows is flat (core/events.py batch_class)."""
    first = events[0]
    writer = writer_of(first.get("source"))
    if writer is None:
        raise ValueError(f"event {first.get('name')!r} of execution {first.get('execution_id')}: source "
                         f"{first.get('source')!r} names no writer (gateway, admission, router, loop-coordinator, "
                         "worker:<pool>)")
    return batch_subject_of(writer, batch_class(events, flat), first["execution_id"])


def batches(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Group events by execution (a message belongs to one partition) and source (one writer per
    message), in order, at most BATCH_MAX each."""
    out: list[list[dict[str, Any]]] = []
    for e in events:
        if out and out[-1][0]["execution_id"] == e["execution_id"] and out[-1][0].get("source") == e.get("source") \
                and len(out[-1]) < BATCH_MAX:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def partition_from_subject(subject: str) -> int:
    return int(subject.split(".")[2])


def writer_from_subject(subject: str) -> str | None:
    """The writer of a stored events message (``noetl.pevt.<P>.<class>.<execution_id>.<writer>``); None
    for a message stored under the layout of earlier versions, which had no writer token."""
    parts = subject.split(".")
    return parts[5] if len(parts) == 6 else None


def admitted(subject: str, events: list[Any], reader: str, headers: Mapping[str, str] | None) -> list[dict[str, Any]]:
    """The events of a stored message that its subject's writer may write (core/events.py MAY_WRITE);
    the others are dropped and logged, once per message. Messages of the earlier layout (no writer
    token: stored before ``setup`` migrated the stream, which captures no such subject since) pass.
    The writer ``timer`` is the NATS scheduler (D29): its messages, and only its, carry the
    ``Nats-Scheduler`` header, which no client can set on a message it publishes to a subject of its own."""
    writer = writer_from_subject(subject)
    if writer is None and len(subject.split(".")) == 5:
        return events
    if (writer == "timer") != (SCHEDULER_HEADER in (headers or {})):
        log.error("%s: dropped the %d events of %s: %s", reader, len(events), subject,
                  "a timer's message not written by the scheduler" if writer == "timer"
                  else f"a scheduled message that writes as {writer!r}, not as 'timer'")
        return []
    kept, dropped = split_by_writer(writer or "", events)
    if dropped:
        log.error("%s: dropped %d of %d events of %s: %s", reader, len(dropped), len(events), subject,
                  "; ".join(f"{_describe(e)}: {why}" for e, why in dropped[:10]))
    return kept


def _describe(event: Any) -> str:
    if not isinstance(event, dict):
        return repr(event)[:80]
    return f"{event.get('name')!r} ({event.get('event_id')}, source {event.get('source')!r})"


async def unsubscribe_all(subs: list[Any]) -> None:
    """Unsubscribe each subscription of ``subs`` (one whose connection is gone already is skipped) and
    empty the list."""
    for sub in subs:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - the connection may be gone already
            pass
    subs.clear()


@dataclass
class Bus:
    nc: Client
    js: JetStreamContext
    name: str
    partitions: int = DEFAULT_PARTITIONS
    replicas: int = 1  # of every stream, bucket and object store (the events stream's, once it exists)
    payload_limit: int = DEFAULT_LIMIT  # D23: bigger values travel as object-store references
    _payloads: PayloadStore | None = None
    endpoints: dict[str, Endpoint] = field(default_factory=dict)  # the subjects it answers (infra/micro.py)
    # set as a throw-away stack stops (noetl run: its NATS goes next): a stopping reader hands nothing back
    # and waits for no open pull request to expire
    throwaway: bool = False

    def grace(self, seconds: float) -> float:
        """How long a stopping reader waits to hand its work back (an open fetch ending, late deliveries
        nak'ed): ``seconds``, or none on a throw-away stack, whose NATS goes next."""
        return 0.0 if self.throwaway else seconds

    def endpoint(self, subject: str, queue: str) -> Endpoint:
        """The counters of a request subject this connection answers (what ``nats micro stats`` shows)."""
        if subject not in self.endpoints:
            self.endpoints[subject] = Endpoint(subject=subject, queue=queue)
        return self.endpoints[subject]

    @property
    def service(self) -> str:
        """The service this connection is for (its name without ``noetl-``): metrics and spans say it."""
        return self.name[6:] if self.name.startswith("noetl-") else self.name

    @property
    def payloads(self) -> PayloadStore:
        if self._payloads is None:
            self._payloads = PayloadStore(self.js, replicas=self.replicas, service=self.service)
        return self._payloads

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    async def connect(cls, url: str, name: str, creds: str | None = None) -> "Bus":
        """Connect, retrying for as long as it takes (NATS may start after the service): each failed
        attempt is one log line, never a traceback, and the next waits twice as long (0.5 s up to
        5 s). Once connected, the client reconnects by itself after a loss (every 0.5 s; one line at
        most every 10 s). ``creds``: the service's NATS credentials (an nkey seed file,
        infra/nats_auth.py); None connects without. Credentials the server refuses are not retried."""
        from .nats_auth import connect_options

        quiet = _QuietLog(name)
        servers = [u.strip() for u in url.split(",") if u.strip()]  # a cluster: any node will do
        # a connection whose server stopped answering (a node cut off the network, a machine gone without
        # closing its sockets) is given up after 2 unanswered pings, and the client moves to another node:
        # nats-py's default (a ping every 2 minutes) left a service on a cut-off node for up to 6 minutes
        ping = float(os.environ.get("NOETL_NATS_PING_INTERVAL") or PING_INTERVAL)
        options = connect_options(creds, url)  # a credentials or TLS setting that cannot be used raises here
        delay, attempt = 0.5, 1
        while True:
            try:  # each server tried twice (0.5 s apart): the retries, with their backoff, are ours
                nc = await nats.connect(
                    servers, name=name, max_reconnect_attempts=1, reconnect_time_wait=0.5,
                    ping_interval=ping, max_outstanding_pings=2,
                    error_cb=quiet.error,
                    disconnected_cb=quiet.disconnected, reconnected_cb=quiet.reconnected, **options)
                break
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
                if quiet.refused is not None:
                    raise NatsRefused(f"{name}: NATS at {url} refused the connection ({quiet.refused}): check its "
                                      f"credentials ({creds or 'none given'}; docs/nats-security.md)") from None
                why = quiet.last_error or exc
                if tls.is_verify_failure(why):  # a certificate does not change by waiting
                    raise NatsRefused(f"{name}: NATS at {url}: "
                                      f"{tls.verify_failure(why, os.environ.get(tls.NATS_CA), tls.NATS_CA)}") from None
                log.warning("%s: cannot reach NATS at %s (attempt %d: %s: %s); retrying in %.1fs", name, url,
                            attempt, type(why).__name__, tls.handshake_failure(why) or why, delay)
                quiet.last_error = None
                await asyncio.sleep(delay)
                delay, attempt = min(delay * 2, 5.0), attempt + 1
        nc.options["max_reconnect_attempts"] = -1  # connected: from now on the client reconnects forever itself
        quiet.connected = True
        if attempt > 1:
            log.warning("%s: connected to NATS at %s (attempt %d)", name, url, attempt)
        bus = cls(nc, nc.jetstream(timeout=10), name)
        bus.creds = creds
        return bus

    async def close(self) -> None:
        """Close the connection (services stop their own loops first; draining would only wait out
        pending pull requests)."""
        if not self.nc.is_closed:
            try:
                await self.nc.flush(timeout=5)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            await self.nc.close()

    async def setup(self, partitions: int = DEFAULT_PARTITIONS, max_age_s: float = 7 * 24 * 3600,
                    replicas: int | None = None) -> None:
        """Create the streams, the membership bucket and the payload store if missing, with ``replicas``
        copies each (default ``NOETL_REPLICAS`` or 1; 3 on a 3-node cluster); adopt the partition and
        replica counts of an existing events stream, and move one of the earlier subject layout to this
        one. Needs a user that may create streams (the ``admin`` user of infra/nats_auth.py); services
        only read what it made. Every step is idempotent, so a JetStream that does not answer yet (a
        cluster still placing its first streams, or a peer not online yet) is asked again, for up to a minute."""
        replicas = replicas or int(os.environ.get("NOETL_REPLICAS") or 1)
        deadline = time.monotonic() + 60
        while True:
            try:
                return await self._setup(partitions, max_age_s, replicas)
            except (asyncio.TimeoutError, NatsTimeout, ServiceUnavailableError, BadRequestError) as exc:
                if time.monotonic() > deadline or (isinstance(exc, BadRequestError) and exc.err_code != NO_PLACEMENT):
                    raise
                log.info("setup: JetStream did not answer or cannot place replicas yet (%s: %s); asking again",
                         type(exc).__name__, exc)
                await asyncio.sleep(0.5)

    async def _setup(self, partitions: int, max_age_s: float, replicas: int) -> None:
        try:
            info = await self.js.stream_info(EVENTS)
            self.partitions = _partitions_of(info.config)
            self.replicas = info.config.num_replicas or 1
            subjects = list(info.config.subjects or ())
            if subjects in ([EVENT_SUBJECTS], [EVENT_SUBJECTS, TIMER_SUBJECTS]):
                if subjects == [EVENT_SUBJECTS] or not info.config.allow_msg_schedules:
                    info.config.subjects = [EVENT_SUBJECTS, TIMER_SUBJECTS]  # a stream made before timers (D29)
                    info.config.allow_msg_schedules = info.config.allow_rollup_hdrs = True
                    await self.js.update_stream(info.config)
            else:
                await self._migrate_events(info.config)  # the earlier layout, or refused: not made by noetl
        except NotFoundError:
            info = None  # made last (below)
            self.partitions, self.replicas = partitions, replicas
        try:
            info_commands = await self.js.stream_info(COMMANDS)
            if set(info_commands.config.subjects or ()) != set(COMMAND_SUBJECTS):  # an earlier version's stream
                info_commands.config.subjects = list(COMMAND_SUBJECTS)
                await self.js.update_stream(info_commands.config)
        except NotFoundError:
            await self.js.add_stream(StreamConfig(
                name=COMMANDS, subjects=list(COMMAND_SUBJECTS), storage=StorageType.FILE,
                retention=RetentionPolicy.WORK_QUEUE, duplicate_window=120, num_replicas=self.replicas,
            ))
        await self.ensure_lost_commands(max_age_s)
        await self._ensure_trees(max_age_s)
        from .membership import Membership

        await Membership(self.js, "setup", self.partitions, lambda _: None, replicas=self.replicas)._bucket()
        await self.payloads.bucket()
        from . import schedules

        await schedules.ensure(self.js, self.replicas)  # the schedules stream and bucket (D31)
        if info is not None:
            await self._refilter_durables()
        if info is None:  # last: services wait for it (attach), so everything else they use is there by then
            await self.js.add_stream(StreamConfig(
                name=EVENTS, subjects=[EVENT_SUBJECTS, TIMER_SUBJECTS], storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS, max_age=max_age_s, duplicate_window=120,
                subject_transform=_event_transform(partitions), num_replicas=replicas, allow_msg_schedules=True,
                allow_rollup_hdrs=True,
            ))

    async def _migrate_events(self, config: StreamConfig) -> None:
        """An events stream of the earlier layout (``noetl.evt.<class>.<execution_id>``, no writer)
        takes this one; its stored messages stay where they are: the recorder reads them, the control
        plane does not (an execution running across the change cannot be rebuilt: upgrade when none
        runs, docs/nats-security.md)."""
        if list(config.subjects or ()) != [LEGACY_EVENT_SUBJECTS]:
            raise ValueError(f"stream {EVENTS} has subjects {config.subjects}, neither {[EVENT_SUBJECTS, TIMER_SUBJECTS]} nor the "
                             f"earlier {LEGACY_EVENT_SUBJECTS!r}: it was not made by noetl; delete or rename it")
        log.warning("stream %s has the subject layout of an earlier version (no writer token): moving it to "
                    "%s; executions that were running across the change cannot be resumed", EVENTS, EVENT_SUBJECTS)
        config.subjects = [EVENT_SUBJECTS, TIMER_SUBJECTS]
        config.subject_transform = _event_transform(self.partitions)
        config.allow_msg_schedules = config.allow_rollup_hdrs = True
        await self.js.update_stream(config)

    async def _refilter_durables(self) -> None:
        """The control plane's durables of an earlier version read what it read then: each is given what
        its service reads now (``subjects.control_filter`` of the classes of ``decide.CONSUMES``, e.g.
        ``flat``) before any service of this version writes them, since a durable never goes back for
        messages stored before its filter took them in. Its position and every other setting stay."""
        from ..core.decide import CONSUMES
        from .nats_auth import durable_prefix

        async def one(service: str, p: int) -> None:
            name = f"{durable_prefix(service)}-p{p}"
            info = await self.consumer_info(EVENTS, name)
            wanted = control_filter(service, p, CONSUMES[service])
            config = (info or {}).get("config") or {}
            if not info or sorted(config.get("filter_subjects") or [config.get("filter_subject")]) == sorted(wanted):
                return
            await self._put_durable(EVENTS, name, {k: v for k, v in config.items() if k != "filter_subject"}
                                    | {"filter_subjects": wanted})
            log.info("setup: durable %s now reads %s", name, ", ".join(wanted))

        await asyncio.gather(*(one(s, p) for s in CONSUMES for p in range(self.partitions)))

    async def ensure_lost_commands(self, max_age_s: float = 7 * 24 * 3600) -> None:
        """The server's MAX_DELIVERIES advisories for the commands stream, kept in a stream until
        admission has handled them (a core-NATS advisory is lost when no admission is connected)."""
        await self._ensure_stream(StreamConfig(
            name=LOST_COMMANDS, subjects=[MAX_DELIVERIES], storage=StorageType.FILE,
            retention=RetentionPolicy.WORK_QUEUE, max_age=max_age_s, num_replicas=self.replicas,
        ))

    async def _ensure_trees(self, max_age_s: float) -> None:
        """The counters of child executions per root (D19, ``max_tree_executions``): a counter stream
        keeping the last total of each root, ``max_age_s`` after its last child, at most a million roots
        (the oldest forgotten first)."""
        await self._ensure_stream(StreamConfig(
            name=TREES, subjects=[TREE_PREFIX + "*"], storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
            allow_msg_counter=True, allow_direct=True, max_msgs_per_subject=1, max_msgs=1_000_000,
            discard=DiscardPolicy.OLD, max_age=max_age_s, duplicate_window=120, num_replicas=self.replicas,
        ))

    async def _ensure_stream(self, config: StreamConfig) -> None:
        """Create the stream of ``config`` unless it exists (an existing one keeps its settings)."""
        try:
            await self.js.stream_info(config.name)
        except NotFoundError:
            await self.js.add_stream(config)

    async def trees_unusable(self) -> str | None:
        """Why the trees' counters (D19) cannot be used by this connection, or None: the stream is
        missing (set up by an earlier version) or its NATS user may not read it (earlier permissions)."""
        try:
            await self.js.stream_info(TREES)
        except NotFoundError:
            return f"the stream {TREES} does not exist"
        except Exception as exc:  # noqa: BLE001 - refused (a timeout: the server said so to error_cb), or away
            return f"the stream {TREES} cannot be read ({type(exc).__name__}: {exc})"
        return None

    async def count_child(self, root_execution_id: str, child_execution_id: str) -> int:
        """D19: count the child ``child_execution_id`` in the tree of ``root_execution_id``; the tree's
        total. When that child was counted already (its request evaluated again within the stream's
        2-minute duplicate window), the total now, which may include children counted since: never
        less than when it was counted. Raises BusError ``unavailable`` when JetStream does not answer."""
        if not _SUBJECT_TOKEN.fullmatch(root_execution_id):
            raise ValueError(f"execution id {root_execution_id!r} cannot name a subject")
        try:
            reply = loads((await self.nc.request(tree_subject(root_execution_id), b"", timeout=5, headers={
                "Nats-Incr": "+1", "Nats-Msg-Id": f"child:{child_execution_id}"})).data)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise BusError("unavailable", f"counting the child executions of {root_execution_id}: {exc}") from exc
        if "error" in reply:
            raise BusError("unavailable", f"counting the child executions of {root_execution_id}: {reply['error']}")
        if not reply.get("duplicate"):
            return int(reply["val"])
        try:
            return int(loads((await self.js.get_last_msg(TREES, tree_subject(root_execution_id))).data)["val"])
        except Exception as exc:  # noqa: BLE001 - asked again on the redelivery
            raise BusError("unavailable", f"reading the count of {root_execution_id}'s tree: {exc}") from exc

    async def attach(self) -> None:
        """Read the partition count from the events stream (created by :meth:`setup`), waiting for it
        (and for JetStream) as long as it takes."""
        delay, waited, said = 0.1, 0.0, 0.0
        while True:
            try:
                config = (await self.js.stream_info(EVENTS)).config
                self.partitions, self.replicas = _partitions_of(config), config.num_replicas or 1
                return
            except NotFoundError:
                why = f"stream {EVENTS} does not exist yet (created by `noetl setup`, `noetl up` or `noetl run`, as the NATS admin)"
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
                why = f"JetStream does not answer ({type(exc).__name__}: {exc})"
            if waited - said >= 10 or (waited and not said):
                log.warning("%s: waiting: %s", self.name, why)
                said = waited
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 2.0)

    async def replica_count(self) -> int:
        """The events stream's replica count (which every stream and bucket of the stack takes), without
        waiting for the stream: ``NOETL_REPLICAS`` (or 1) while it does not exist."""
        try:
            self.replicas = (await self.js.stream_info(EVENTS)).config.num_replicas or 1
        except NotFoundError:
            self.replicas = int(os.environ.get("NOETL_REPLICAS") or 1)
        return self.replicas

    # ----------------------------------------------------------------- publishing
    async def publish_once(self, event: dict[str, Any]) -> bool:
        """Publish one event alone; False when JetStream already had its id (a duplicate, not stored)."""
        ack = await (await self.send_events([event]))
        return not bool((ack[0] if isinstance(ack, list) else ack).duplicate)

    async def publish_event(self, event: dict[str, Any]) -> int:
        """Publish one event alone and wait for it to be stored; returns its log_seq."""
        ack = await (await self.send_events([event]))
        return log_seq((ack[0] if isinstance(ack, list) else ack).seq, 0)

    async def publish_all(self, events: list[dict[str, Any]], commands: list[dict[str, Any]] = (),
                          timeout: float = 10.0, timers: list[dict[str, Any]] = (), flat: str | None = None) -> None:
        """Publish without waiting for each PubAck, then wait for every PubAck: on return, all are
        stored. Commands and timers go only once the events are stored: a command's work (a worker's
        report of it) must never be in the log before the events that decided it, and one connection's
        order does not hold when NATS restarts between two publishes, nor across two streams' leaders
        in a cluster. A rebuild folds the log in order (control.py), and would drop such a report as
        one about work it never heard of. ``flat``: an execution known to be flat (core/decide.py
        ``flat``), whose ctl messages and timers go as ``flat``."""
        futures = [await self.send_events(batch, flat=batch[0]["execution_id"] == flat) for batch in batches(events)]
        if futures and (commands or timers):
            await asyncio.wait_for(asyncio.gather(*futures), timeout)
            futures = []
        for c in commands:
            futures.append(await self.send_command(c))
        for t in timers:
            futures.append(await self.send_timer(t, flat=t["execution_id"] == flat))
        if futures:
            await asyncio.wait_for(asyncio.gather(*futures), timeout)

    async def send_events(self, events: list[dict[str, Any]], limit: int | None = None,
                          flat: bool = False) -> asyncio.Future:
        """Write the events of one execution to the connection, as one message or, when too big for
        one, several in order (values over ``limit`` bytes become references, D23); the returned
        future resolves when every PubAck is in."""
        limit = limit or self.payload_limit
        data = dumps(events)
        if len(data) <= min(limit, MAX_MESSAGE) and len(events) <= BATCH_MAX:  # the common case: one message
            return await self.js.publish_async(batch_subject(events, flat), data, stream=EVENTS,
                                               headers=tracing.inject({"Nats-Msg-Id": _msg_id(events)}))
        events = await self._fit(events, min(limit, MAX_MESSAGE))
        futures = []
        for chunk in _by_size(events, MAX_MESSAGE):
            futures.append(await self.js.publish_async(batch_subject(chunk, flat), dumps(chunk), stream=EVENTS,
                                                       headers=tracing.inject({"Nats-Msg-Id": _msg_id(chunk)})))
        return asyncio.gather(*futures)

    async def send_command(self, command: dict[str, Any], limit: int | None = None) -> asyncio.Future:
        limit = limit or self.payload_limit
        subject = command_subject(command["pool"], command["execution_id"], lane_of(command))  # before shrinking
        data = dumps(command)
        if len(data) > limit:
            command = {k: (v if k in COMMAND_IDENTITY else await self.payloads.shrink(v, limit))
                       for k, v in command.items()}
            data = dumps(command)
            if len(data) > MAX_MESSAGE:  # several fields each under the limit, together over the server's
                command = {k: (v if k in COMMAND_IDENTITY else await self.payloads.shrink(v, 1024))
                           for k, v in command.items()}
                data = dumps(command)
        return await self.js.publish_async(subject, data,
                                           stream=COMMANDS,
                                           headers=tracing.inject({"Nats-Msg-Id": command["command_id"]}))

    async def _fit(self, events: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
        if len(dumps(events)) <= limit:
            return events
        return [e if len(dumps(e)) <= limit else {**e, "data": await self.payloads.shrink(e.get("data"), limit)}
                for e in events]

    async def expand(self, raw: bytes, value: Any) -> Any:
        """A received message's value with its payload references resolved (D23)."""
        return await self.payloads.expand(value) if MARKER in raw else value

    async def send_timer(self, timer: dict[str, Any], flat: bool = False) -> asyncio.Future:
        """D29: a JetStream message schedule (``@at`` the due instant) whose body, the ``timer.fired``
        event, the server writes into the execution's log at that time. The schedule's subject is the
        timer's identity: setting the same timer again (a redelivered decision) replaces it."""
        eid, tid = timer["execution_id"], timer["timer_id"]
        headers = tracing.inject({"Nats-Schedule": f"@at {rfc3339(timer['due'])}",
                                  "Nats-Schedule-Target": timer_target(eid, FLAT if flat else CTL)})
        return await self.js.publish_async(timer_subject(eid, tid), dumps([timer["event"]]), stream=EVENTS,
                                           headers=headers)

    async def cancel_timers(self, execution_id: str, timer_ids: list[str], timeout: float = 10.0) -> None:
        """Cancel timers (D29): an empty message with ``Nats-Rollup: sub`` on a timer's subject replaces
        its schedule, so it never fires. (A stream purge would do it in one call, but a purge request's
        subject filter cannot be limited by permissions: no service may purge the events stream.)"""
        futures = [await self.js.publish_async(timer_subject(execution_id, tid), b"", stream=EVENTS,
                                               headers={"Nats-Rollup": "sub"}) for tid in timer_ids]
        if futures:
            await asyncio.wait_for(asyncio.gather(*futures), timeout)

    async def purge_commands(self, execution_id: str) -> None:
        """Drop the execution's queued commands (all pools): a finished execution's work is never run,
        also by workers that missed the cancel broadcast or start later."""
        await asyncio.gather(self.js.purge_stream(COMMANDS, subject=f"noetl.cmd.*.{execution_id}.*"),
                             self.js.purge_stream(COMMANDS, subject=f"noetl.cmd.*.{execution_id}"))  # earlier versions'

    async def broadcast(self, subject: str, payload: dict[str, Any]) -> None:
        await self.nc.publish(subject, dumps(payload), headers=tracing.inject({}))

    # ----------------------------------------------------------------- request/reply
    async def request(self, subject: str, payload: dict[str, Any], timeout: float = 10.0,
                      expand: bool = False) -> Any:
        """Ask and wait for the answer; an error answer raises :class:`BusError`. A reply over the
        reply budget carries its biggest values as D23 references: ``expand`` resolves them (for
        values the caller needs whole and that are bounded, such as a catalog entry's text; never for
        pages of events, whose references may stand for many large results). A reference whose object
        is gone is ``BusError("payload_missing")``."""
        try:
            msg = await self.nc.request(subject, dumps(payload), timeout=timeout, headers=tracing.inject({}))
        except nats.errors.NoRespondersError as exc:
            raise BusError("unavailable", f"no service answers {subject}") from exc
        except NatsTimeout as exc:
            raise BusError("timeout", f"{subject} did not answer within {timeout}s") from exc
        reply = loads(msg.data)
        if isinstance(reply, dict) and "error" in reply and set(reply) <= {"error"}:
            err = reply["error"]
            raise BusError(err.get("kind", "error"), err.get("message", ""), err.get("details"))
        if expand and MARKER in msg.data:
            try:
                reply = await self.payloads.expand(reply)
            except PayloadMissing as exc:
                raise BusError("payload_missing", str(exc)) from exc
        return reply

    def unanswerable(self, msg: Msg, subject: str, counts: Endpoint) -> bool:
        """Whether a request received on ``subject`` must go unanswered, its reply subject not an inbox
        (:func:`answerable`); said in the log and counted as a failed request of ``counts``."""
        if answerable(msg.reply):
            return False
        log.warning("%s: %s: a request whose reply subject is not an inbox (%r): not answered", self.name, subject,
                    (msg.reply or "")[:120])
        counts.record(time.perf_counter_ns(), error="bad_reply: the reply subject is not an inbox")
        return True

    async def serve(self, subject: str, handler: Callable[..., Awaitable[Any]], queue: str, *,
                    with_msg: bool = False, any_reply: bool = False, concurrency: int = 1):
        """Answer requests on ``subject`` (a queue group shares them among replicas). A handler's
        exception becomes an error reply, so the requester never just times out; :class:`NoReply`
        answers nothing (a reply subject that must not be answered). ``with_msg``: the handler is
        called with the request and the NATS message (its subject and reply subject). Requests, error
        replies and the time taken are counted (:meth:`endpoint`). A request whose reply subject is not
        an inbox is not answered (:func:`answerable`); ``any_reply``: the handler sees it all the same
        (to record it), and answers it with :class:`NoReply` only. ``concurrency``: how many requests
        are handled at once (a subscription's callback handles one at a time: a slow request would hold
        up every other on the subject); past it, the next waits for one to end."""
        counts = self.endpoint(subject, queue)

        async def on_msg(msg: Msg) -> None:
            started, error = time.perf_counter_ns(), None
            if not any_reply and self.unanswerable(msg, subject, counts):
                return
            t0 = time.perf_counter()
            outcome = "ok"
            with tracing.consume_span(f"{self.name} {subject}", msg.headers, service=self.service):
                try:
                    try:
                        request = loads(msg.data) if msg.data else {}
                    except ValueError as exc:  # e.g. an unpaired surrogate: the requester's, not ours
                        raise BusError("bad_request", f"{subject}: the request is not valid JSON: {exc}") from None
                    xid = request.get("execution_id") if isinstance(request, dict) else None
                    with logs.bind(xid if isinstance(xid, str) else None):
                        reply = await (handler(request, msg) if with_msg else handler(request))
                except NoReply as exc:
                    counts.record(started, error=str(exc))
                    return
                except BusError as exc:
                    outcome = exc.kind if exc.kind in ERROR_KINDS else "error"
                    reply = {"error": {"kind": exc.kind, "message": exc.message, "details": exc.details}}
                    error = f"{exc.kind}: {exc.message}"
                except Exception as exc:  # noqa: BLE001 - reply instead of leaving the caller to time out
                    log.exception("%s: %s failed", self.name, subject)
                    outcome = "internal"
                    reply = {"error": {"kind": "internal", "message": f"{type(exc).__name__}: {exc}"}}
                    error = f"internal: {type(exc).__name__}: {exc}"
                if self.unanswerable(msg, subject, counts):  # any_reply: the handler saw it, and answered
                    return
                await msg.respond(dumps(reply))
                exemplar = metrics.exemplar()
            metrics.REQUESTS.labels(self.service, subject, outcome).observe(time.perf_counter() - t0, exemplar)
            counts.record(started, error=error)

        if concurrency <= 1:
            return await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        room = asyncio.Semaphore(concurrency)
        handling: set[asyncio.Task] = set()

        async def dispatch(msg: Msg) -> None:
            await room.acquire()  # the subscription reads no further while every handler is busy
            task = asyncio.create_task(on_msg(msg))
            handling.add(task)
            task.add_done_callback(lambda t: (handling.discard(t), room.release()))

        return await self.nc.subscribe(subject, queue=queue, cb=dispatch)

    # ----------------------------------------------------------------- consumers
    async def durable(self, stream: str, name: str, filter_subject: str, *, max_ack_pending: int,
                      ack_wait: float = 30.0, max_deliver: int = 20, ack_policy: AckPolicy = AckPolicy.EXPLICIT):
        """Create or update a durable pull consumer and bind to it."""
        await self.consumer(stream, name, filter_subject, max_ack_pending=max_ack_pending, ack_wait=ack_wait,
                            max_deliver=max_deliver, ack_policy=ack_policy)
        return await self.js.pull_subscribe_bind(name, stream=stream)

    async def consumer(self, stream: str, name: str, filter_subject: str | list[str], *, max_ack_pending: int | None = None,
                       ack_wait: float = 30.0, max_deliver: int = 20, ack_policy: AckPolicy = AckPolicy.EXPLICIT,
                       pinned: bool = False, start_seq: int | None = None):
        """Create or update a durable pull consumer; ``pinned``: one partition's, read by one pinned
        reader at a time (infra/pinned.py; ``max_ack_pending`` defaults to its ``MAX_ACK_PENDING``). ``start_seq``:
        deliver from that stream sequence on (a durable taking over from another), else from the start.
        One that is not pinned has one filter, named in the API subject as well (``CONSUMER.CREATE.
        <stream>.<name>.<filter>``, sent here whatever the server's version): the server refuses a body
        with another filter, so a NATS user allowed only that subject reads only what its name and filter
        say (a worker, its own pool's commands)."""
        subjects = [filter_subject] if isinstance(filter_subject, str) else list(filter_subject)
        if not pinned and len(subjects) != 1:
            raise ValueError(f"durable {name}: one filter subject, not {subjects}")
        config = ConsumerConfig(
            durable_name=name, ack_policy=ack_policy,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=subjects if len(subjects) > 1 else None,
            max_ack_pending=max_ack_pending or 1, ack_wait=ack_wait, max_deliver=max_deliver,
            deliver_policy=DeliverPolicy.ALL if start_seq is None else DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
        )
        if not pinned:
            await self._put_durable(stream, name, {**config.as_dict(), "name": name}, filter_subject=subjects[0])
            return
        from .pinned import MAX_ACK_PENDING, consumer_config  # nats-py's ConsumerConfig has no priority groups
        await self._put_durable(stream, name, consumer_config(config.as_dict(), max_ack_pending or MAX_ACK_PENDING))

    async def _put_durable(self, stream: str, name: str, config: dict[str, Any], filter_subject: str | None = None) -> None:
        """Create or update a durable from its configuration as JSON (what nats-py's ConsumerConfig
        cannot say: priority groups); with ``filter_subject``, by the API subject that names it."""
        api = f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{filter_subject}" if filter_subject \
            else f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}"
        reply = loads((await self.nc.request(api, dumps({"stream_name": stream, "config": config}), timeout=5)).data)
        if "error" in reply:
            raise BusError("unavailable", f"consumer {name} of {stream}: {reply['error'].get('description', reply['error'])}")

    async def consumer_info(self, stream: str, name: str) -> dict[str, Any] | None:
        """A consumer's info (JSON, as the server sends it); None when there is no such consumer."""
        reply = loads((await self.nc.request(f"$JS.API.CONSUMER.INFO.{stream}.{name}", b"", timeout=5)).data)
        if "error" in reply:
            if (reply["error"] or {}).get("code") == 404:
                return None
            raise BusError("unavailable", f"consumer {name} of {stream}: {reply['error']}")
        return reply

    async def handover_consumer(self, stream: str, earlier: str, durables: dict[str, str | list[str]],
                                **config: Any) -> int | None:
        """Create (or update) each of ``durables`` (name -> filter subjects), side by side; when
        ``earlier`` (a durable of an earlier version whose configuration they cannot be given to, such
        as another ack policy) exists, they start after its ack floor, and it is deleted once they
        exist. What ``earlier``'s readers handled past its floor is delivered again (folded or recorded
        again to nothing, D21). A durable that exists already keeps where it started (its deliver
        policy cannot change). The stream sequence they start at when they took over from ``earlier``,
        else None."""
        old = await self.consumer_info(stream, earlier)
        start = int((old.get("ack_floor") or {}).get("stream_seq") or 0) + 1 if old else None

        async def one(name: str, filter_subject: str | list[str]) -> None:
            try:
                await self.consumer(stream, name, filter_subject, start_seq=start, **config)
            except BusError:  # made with another start (by another replica): keep that
                info = await self.consumer_info(stream, name)
                if info is None:
                    raise
                kept = (info.get("config") or {}).get("opt_start_seq")
                await self.consumer(stream, name, filter_subject, start_seq=int(kept) if kept else None, **config)

        await asyncio.gather(*(one(name, subjects) for name, subjects in durables.items()))
        if old:
            try:
                await self.js.delete_consumer(stream, earlier)
            except Exception as exc:  # noqa: BLE001 - another replica deleted it first
                log.info("earlier durable %r not deleted: %s", earlier, exc)
        return start

    async def first_seq(self, execution_id: str, partition: int) -> int | None:
        """The stream sequence of the execution's first message (any class), None when it has none."""
        try:
            return (await self.js.get_msg(EVENTS, seq=1, subject=f"noetl.pevt.{partition}.*.{execution_id}.*",
                                          next=True)).seq
        except NotFoundError:
            return None

    async def pending_request(self, execution_id: str) -> dict[str, Any] | None:
        """An execution accepted and not recorded yet, from the log: ``{execution_id, status: PENDING,
        requested_by}`` (a brief summary, as the recorder's) when its first message is its request, else
        None. The recorder answers a moment after a start is accepted (longer on a loaded machine); a
        cancel in between must not call the execution unknown."""
        if not _SUBJECT_TOKEN.fullmatch(execution_id):  # it goes into a subject filter: no dots or wildcards
            return None
        try:
            msg = await self.js.get_msg(EVENTS, seq=1, subject=f"noetl.pevt.*.*.{execution_id}.*", next=True)
            events = admitted(msg.subject, loads(msg.data), self.name, msg.headers)
        except (NotFoundError, *UNHANDLEABLE):
            return None
        first = events[0] if events else None
        if not isinstance(first, dict) or first.get("name") != "playbook.execution.requested":
            return None
        by = (first.get("data") or {}).get("requested_by")
        return {"execution_id": execution_id, "status": "PENDING",
                "requested_by": by.get("user_id") if isinstance(by, dict) else None}

    async def execution_events(self, execution_id: str, partition: int,
                               classes: tuple[str, ...] = (CTL,)) -> list[tuple[int, dict]]:
        """The events of the given classes of one execution now in the stream, in order, with seqs (only
        those their message's writer may write, :func:`admitted`)."""
        subjects = [f"noetl.pevt.{partition}.{c}.{execution_id}.*" for c in classes]
        last = 0
        for subject in subjects:
            try:
                last = max(last, (await self.js.get_last_msg(EVENTS, subject)).seq)
            except NotFoundError:
                pass
        if not last:
            return []
        sub = await self.js.pull_subscribe(subjects[0], stream=EVENTS, config=ConsumerConfig(
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=10.0,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=subjects if len(subjects) > 1 else None))
        out: list[tuple[int, dict]] = []
        seq = 0
        try:
            while seq < last:
                for msg in await sub.fetch(512, timeout=5):
                    seq = msg.metadata.sequence.stream
                    try:
                        events = admitted(msg.subject, await self.expand(msg.data, loads(msg.data)), self.name,
                                          msg.headers)
                    except UNHANDLEABLE as exc:  # dropped when it was delivered: it cannot stop every later event
                        log.error("reading %s back: skipping stream seq %d, which cannot be read: %s: %s",
                                  execution_id, seq, type(exc).__name__, exc)
                        continue
                    out += [(seq, e) for e in events]
        finally:
            await sub.unsubscribe()
            try:  # gone now, not after inactive_threshold: rebuilds in a burst must not pile consumers up
                await self.js.delete_consumer(EVENTS, sub._consumer)
            except Exception:  # noqa: BLE001 - it expires anyway
                pass
        return out


MAX_MESSAGE = 768 * 1024  # below the server's default max_payload (1 MiB)
# a command's fields that identify and shape it, and the users it acts for (bounded: the credentials
# service checks them as they are stored, D24): never moved to the object store
COMMAND_IDENTITY = frozenset({"command_id", "pool", "execution_id", "step", "step_run_id", "iteration", "iterations",
                              "tasks", "spec_layers", "loop_mode", "workbook", "flat",
                              "requested_by", "authored_by", "called_by"})


def _by_size(events: list[dict[str, Any]], limit: int) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = [[]]
    size = 0
    for e in events:
        n = len(dumps(e)) if len(events) > 1 else 0
        if out[-1] and (size + n > limit or len(out[-1]) >= BATCH_MAX):  # log_seq needs < BATCH_MAX
            out.append([])
            size = 0
        out[-1].append(e)
        size += n
    return out


def _msg_id(events: list[dict[str, Any]]) -> str:
    if len(events) == 1:
        return events[0]["event_id"]
    return f"{events[0]['event_id']}+{len(events)}-{events[-1]['event_id']}"


class NatsRefused(ValueError):
    """The server refused our credentials: a mistake in the settings, not something to wait out."""


class _QuietLog:
    """nats-py's callbacks for one connection: a line per state change, and connection errors at most
    once every 10 s (the client retries forever; its default callback prints a traceback each time)."""

    def __init__(self, name: str):
        self.name, self.last = name, 0.0
        self.connected = False
        self.refused: str | None = None  # an authorization error before the first connection
        self.last_error: Exception | None = None  # before the first connection: said by Bus.connect

    async def error(self, exc: Exception) -> None:
        if not self.connected:
            if "authorization violation" in str(exc).lower():
                self.refused = str(exc)
            self.last_error = exc
            return
        if "permissions violation" in str(exc).lower():  # never expected: every one is worth a line
            log.error("%s: NATS refused: %s (this connection's user may not do that: docs/nats-security.md)",
                      self.name, exc)
            return
        now = time.monotonic()
        if now - self.last >= 10:
            self.last = now
            log.warning("%s: NATS: %s: %s (retrying)", self.name, type(exc).__name__, exc)

    async def disconnected(self) -> None:  # also on a normal close
        log.info("%s: disconnected from NATS", self.name)

    async def reconnected(self) -> None:
        self.last = 0.0
        log.warning("%s: reconnected to NATS after losing the connection", self.name)


# the error kinds of request/reply answers (docs/architecture.md §5); others count as "error" in metrics
ERROR_KINDS = frozenset({
    "bad_request", "not_found", "invalid_playbook", "conflict", "too_large", "unavailable", "internal", "forbidden",
    "unauthenticated", "locked", "invalid_schedule", "timeout", "payload_missing", "unsupported", "too_many"})


class NoReply(Exception):
    """Raised by a request handler (:meth:`Bus.serve`): answer nothing; the message says why (counted)."""


class BusError(Exception):
    def __init__(self, kind: str, message: str, details: Any = None):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.details = kind, message, details


def _event_transform(partitions: int) -> SubjectTransform:
    """``noetl.evt.<writer>.<class>.<execution_id>`` -> ``noetl.pevt.<partition>.<class>.<execution_id>.<writer>``:
    the partition hashes the execution id, so one execution's messages are in one partition."""
    dest = (f"noetl.pevt.{{{{partition({partitions},3)}}}}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}"
            f".{{{{wildcard(1)}}}}")
    return SubjectTransform(src=EVENT_SUBJECTS, dest=dest)


def _partitions_of(config: StreamConfig) -> int:
    dest = config.subject_transform.dest if config.subject_transform else ""
    try:
        return int(dest.split("partition(")[1].split(",")[0])
    except (IndexError, ValueError):
        return DEFAULT_PARTITIONS


def strays(sub) -> list[Msg]:
    """The deliveries in a pull subscription's queue that no fetch returned (sent by the server as a
    fetch gave up, or after its reader stopped fetching): its reader holds them, so it must start
    them or hand them back. Status messages are dropped, as a fetch drops them."""
    queue = getattr(getattr(sub, "_sub", None), "_pending_queue", None)
    out = []
    while queue is not None and not queue.empty():
        msg = queue.get_nowait()
        sub._sub._pending_size -= len(msg.data)
        if msg.reply and msg.reply.startswith("$JS.ACK"):  # a delivery, not a status message
            out.append(msg)
    return out


async def hand_back(msg: Msg) -> None:
    """Nak a delivery: redelivered at once, to whoever reads next (failing that, after ack_wait)."""
    try:
        await msg.nak()
    except Exception:  # noqa: BLE001 - then it is redelivered after ack_wait
        pass


async def release(sub, linger: float) -> None:
    """Close a stopped reader's pull subscription without keeping a message from anyone: a pull
    request still open at the server can deliver until it expires (``linger``), so what reaches the
    subscription's queue now or until then is handed back."""
    async def drain() -> None:
        for msg in strays(sub):
            await hand_back(msg)

    try:
        await drain()
        await asyncio.sleep(linger)
        await drain()
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass


async def pull_loop(sub, handle: Callable[[Msg], Awaitable[None]], stop: asyncio.Event, *, batch: int = 1,
                    timeout: float = 1.0, counts: Any = None) -> None:
    """Fetch and handle messages until ``stop`` is set. Handler errors are logged and the message is
    nak'ed with a delay (never terminated, never retried in a tight loop). ``counts`` (a
    :class:`micro.Consumer`) counts the messages handled and those that failed."""
    while not stop.is_set():
        try:
            msgs = await sub.fetch(batch, timeout=timeout)
        except (NatsTimeout, asyncio.TimeoutError):  # an empty fetch (both kinds occur)
            continue
        except Exception as exc:  # noqa: BLE001 - connection hiccups: keep pulling
            if stop.is_set():
                return
            log.warning("fetch failed (%s: %s); retrying", type(exc).__name__, exc)
            await asyncio.sleep(0.5)
            continue
        for msg in msgs:
            started = time.perf_counter_ns()
            error = await handle_one(msg, handle)
            if counts is not None:
                counts.record(started, error=error)
