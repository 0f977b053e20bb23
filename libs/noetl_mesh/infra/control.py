"""The shell shared by the control-plane services (admission, router, loop-coordinator).

Each service reads the events of its classes (``decide.CONSUMES``) of every partition through its own
durable consumers (one per partition, ``<service>-all-p<N>``), each read by one pinned reader at a time,
in batches, in stream order, and acknowledged cumulatively, one ack for many events (:mod:`.pinned`), so
the events of one execution are handled strictly in log order and never concurrently, however many
replicas run. The durables of earlier versions (``<service>-p<N>``, one ack per event: the ack policy of
a consumer cannot change) hand over at start: the new durable starts after the old one's ack floor, and
the old one is deleted. Replicas share the partitions out through NATS KV membership
(:mod:`.membership`), so normally one replica reads a partition and its cache stays valid.

Each replica keeps the execution states it has folded (:mod:`noetl_mesh.core.state`) in a cache. The
cache is valid while this replica's reader saw every delivery of the partition in order; each resync
of the reader (another reader may have held messages, a redelivery, a handler failing) drops the
partition's cached states, which are rebuilt from the stream on demand (D22). A handler that fails
after folding (its decision not published: a stream without a leader for a moment) forgets that
execution's state at once, so that the redelivery decides again instead of folding to nothing.
A rebuild for the event at stream sequence S folds the execution's events before S plus the events
this service itself emitted for causes before S — exactly what the replica that handled those causes
held, since a service folds its own decisions at once (:mod:`noetl_mesh.core.decide`).

Before folding, every event must be one its message's writer may write (the writer is in the subject,
where NATS permissions put it; core/events.py ``MAY_WRITE``): the others are dropped, logged once per
message (:func:`bus.admitted`), on live deliveries and on rebuilds alike.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import AckPolicy

from ..core.decide import Decision, flat
from ..core.events import engine_stopped, event_class
from ..core.state import FINAL, ExecutionState, apply
from . import logs, metrics, tracing
from ..contracts.subjects import control_filter
from .bus import CTL, EVENTS, Q_EXECUTION_STATUS, UNHANDLEABLE, Bus, admitted, loads, partition_from_subject
from .membership import Membership
from .micro import Consumer
from .nats_auth import durable_prefix
from .pinned import PinnedReader

log = logging.getLogger("noetl.control")
FETCH_TIMEOUT = 1.0  # a reader's long poll; a stopped reader is gone within it (plus a linger)
READER_RESTART = 0.5  # seconds before a failed reader is replaced
FAILING_FOR = 5.0  # seconds a reader's failure keeps the replica not ready (one failing over and over, always)
MAX_DELIVER = 50  # deliveries of an event before the server gives up on it (retried after min(30, n/2) s: ~10 min)
IDLE = ExecutionState("")  # in the cache, for an execution this service will decide nothing more for


class PartitionedService:
    name = "control"
    classes: tuple[str, ...] = (CTL,)  # the event classes this service consumes (decide.CONSUMES)
    rebuild_classes: tuple[str, ...] = ()  # classes it only reads back when rebuilding (its own)
    cache_size = 10_000

    def __init__(self, bus: Bus, ack_wait: float | None = None):
        self.bus = bus
        self.ack_wait = ack_wait or float(os.environ.get("NOETL_CONTROL_ACK_WAIT", 30))
        self.cache: collections.OrderedDict[str, ExecutionState] = collections.OrderedDict()
        self.partition_of: dict[str, int] = {}
        self.stop_event = asyncio.Event()
        self.tasks: list[asyncio.Task] = []  # readers that are stopping (and, on stop, all of them)
        self.readers: dict[int, tuple[asyncio.Task, asyncio.Event]] = {}  # owned partition -> reader
        self.failed: dict[int, tuple[float, str]] = {}  # partition -> when and why its reader last failed
        self.membership: Membership | None = None
        self.handled = 0
        self.rebuilds = 0
        self.started = False  # consumers created and membership joined (readiness)
        self._m_decision = metrics.DECISION.labels(self.name)
        self._m_rebuilds = metrics.REBUILDS.labels(self.name)
        self._m_handled: dict[str, Any] = {}
        self._m_pending: dict[int, Any] = {}
        # what `nats micro stats` and `noetl ps` show of this replica (infra/micro.py)
        self.prefix = durable_prefix(self.name)  # of its partitions' durables: <prefix>-p<N>
        self.events = Consumer(name="events", stream=EVENTS, durable=self.prefix, partitions=[],
                               subject=",".join(f"noetl.pevt.*.{c}.*.*" for c in self.classes))
        self.consumers: list[Consumer] = [self.events]

    # --------------------------------------------------------------- the service's slice of the core
    async def decide(self, state: ExecutionState, event: dict[str, Any]) -> Decision:
        raise NotImplementedError

    async def after(self, state: ExecutionState, outputs: list[dict[str, Any]], cancel_runs: list[str]) -> None:
        """Side effects beyond publishing (router: cancel broadcasts)."""

    def prepare(self, request: dict[str, Any]) -> None:
        """Start fetching what deciding a child's ``request`` will need from elsewhere, while the log is
        asked whether the request is its execution's first message (admission: the playbook)."""

    def unprepare(self, event: dict[str, Any]) -> None:
        """Drop what :meth:`prepare` fetched for ``event`` and its decision did not use."""

    def idle(self, state: ExecutionState) -> bool:
        """Whether no later event of the execution can need a decision of this service: its events are
        then acknowledged without being folded, and its state is dropped from the cache (kept as
        :data:`IDLE`). A finished execution needs nothing more of any service (its finishing event's
        decision has been made by then); the loop-coordinator adds a playbook without loops. Without
        this, each replica kept up to ``cache_size`` finished executions' whole states (the soak: the
        router and admission grew ~9 MB a minute at 8 executions/s)."""
        return state.status in FINAL

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.bus.attach()
        await asyncio.gather(*(self._durable(p) for p in range(self.bus.partitions)))  # side by side: ~0.2 s sooner
        # replicas share the partitions out (infra/membership.py): each reads its own, so its cache
        # stays valid; until the group is known, or without it, a replica reads every partition
        self.membership = Membership(self.bus.js, self.name, self.bus.partitions, self._read,
                                     replicas=self.bus.replicas)
        await self.membership.start()
        self._read(self.membership.owned)
        self.started = True

    async def _durable(self, p: int) -> None:
        """Partition ``p``'s durable (any execution; every writer but this service); the earlier
        version's hands over."""
        start = await self.bus.handover_consumer(
            EVENTS, f"{self.name}-p{p}", {f"{self.prefix}-p{p}": control_filter(self.name, p, self.classes)},
            pinned=True, ack_wait=self.ack_wait, max_deliver=MAX_DELIVER, ack_policy=AckPolicy.ALL)
        if start is not None:
            log.warning("%s-p%d, the durable of an earlier version, acknowledged each event: %s-p%d, which "
                        "acknowledges cumulatively, starts after its ack floor (seq %d); it is deleted",
                        self.name, p, self.prefix, p, start - 1)

    async def ready(self) -> dict[str, Any]:
        """Its consumers bound: a live reader for every partition it owns."""
        dead = sorted(p for p, (task, _) in self.readers.items() if task.done())
        now = time.monotonic()
        failing = {p: why for p, (when, why) in self.failed.items() if now - when < FAILING_FOR and p in self.readers}
        ok = self.started and not self.stop_event.is_set() and bool(self.readers) and not dead and not failing
        out: dict[str, Any] = {"ok": ok, "partitions": len(self.readers)}
        if dead:
            out["error"] = f"readers of partitions {dead} stopped"
        elif failing:
            out["error"] = "readers failing: " + "; ".join(f"partition {p}: {why}" for p, why in sorted(failing.items()))
        elif not ok:
            out["error"] = "stopping" if self.stop_event.is_set() else "consumers not bound yet"
        return out

    def _read(self, owned: set[int]) -> None:
        """Run a reader per owned partition (again, if one ended); a partition no longer owned finishes
        its message, gives back what arrived late, and its reader stops."""
        for p in [p for p, (task, _) in self.readers.items() if task.done()]:
            del self.readers[p]
        for p in [p for p in self.readers if p not in owned]:
            task, stop = self.readers.pop(p)
            stop.set()
            self.tasks.append(task)
            self._m_pending.pop(p, None)
            metrics.forget_pending(self.name, f"{self.prefix}-p{p}", p)
        for p in sorted(owned):
            if p not in self.readers and not self.stop_event.is_set():
                stop = asyncio.Event()
                self.readers[p] = (asyncio.create_task(self._reader(p, stop), name=f"{self.prefix}-p{p}"), stop)
        self.tasks = [t for t in self.tasks if not t.done()]
        self.events.own(self.readers)

    async def _reader(self, p: int, stop: asyncio.Event) -> None:
        """Read partition ``p`` until ``stop``. A reader that fails outside a handler (a pull request the
        connection refused while NATS reconnects) is replaced after a moment, never left dead: a dead
        one would hold its partition's executions until the partition changed hands."""
        while not stop.is_set():
            # a subscription (inbox) per reader: a delivery meant for an earlier reader of this
            # partition can never reach this one's handler; a new reader resyncs first
            try:
                await PinnedReader(self.bus, EVENTS, f"{self.prefix}-p{p}", self.handle, stop, expires=FETCH_TIMEOUT,
                                   counts=self.events, on_resync=lambda: self._drop_partition(p)).run()
            except Exception as exc:  # noqa: BLE001
                log.exception("%s-p%d: the reader failed; starting another", self.prefix, p)
                self.failed[p] = (time.monotonic(), f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(READER_RESTART)

    @property
    def owned(self) -> set[int]:
        return set(self.readers)

    async def stop(self) -> None:
        """Finish the messages in hand and give back the rest, then leave the group, so the other
        replicas take over without waiting out ``ack_wait``."""
        self.stop_event.set()
        for task, stop in self.readers.values():
            stop.set()
            self.tasks.append(task)
        self.readers.clear()
        self.events.own(())
        if self.tasks:  # a throw-away stack's readers go at once: nobody takes over
            _, late = await asyncio.wait(self.tasks, timeout=self.bus.grace(2 * FETCH_TIMEOUT + 2))
            for t in late:  # stuck in a handler: cancelled, its message nak'ed (pull_loop)
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        if self.membership is not None:
            await self.membership.stop()

    # --------------------------------------------------------------- one event
    async def handle(self, msg: Msg) -> None:
        """One delivery; its log records name its execution and trace (the subject names the execution:
        ``noetl.pevt.<P>.<class>.<execution_id>.<writer>``)."""
        parts = msg.subject.split(".")
        with logs.bind(parts[4] if len(parts) >= 5 else None):
            await self._handle_delivery(msg)

    async def _handle_delivery(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        p = partition_from_subject(msg.subject)
        seq = msg.metadata.sequence
        pending = self._m_pending.get(p)
        if pending is None:
            pending = self._m_pending[p] = metrics.PENDING.labels(self.name, f"{self.prefix}-p{p}", str(p))
        pending.set(msg.metadata.num_pending)
        # one decision's events, one execution; only those the subject's writer may write
        events = admitted(msg.subject, await self.bus.expand(msg.data, loads(msg.data)), self.name, msg.headers)
        if not events:
            return
        eid = events[0]["execution_id"]
        exemplar = await self._handle(msg, p, seq, eid, events)
        self._m_decision.observe(time.perf_counter() - t0, exemplar)

    async def _handle(self, msg: Msg, p: int, seq: Any, eid: str, events: list[dict[str, Any]]) -> dict | None:
        """Fold, decide, publish (the reader acks once it returns); the trace id of the decision's span
        (an exemplar), if exported."""
        state = self.cache.get(eid)
        if state is IDLE:
            for event in events:
                self._count(event["name"])
            self.handled += 1
            return None
        first = events[0]
        ended: bool | None = None  # the execution had finished before this message (None: not known)
        try:
            if state is None and first["name"] == "playbook.execution.requested" and (
                    not (first.get("data") or {}).get("parent") or await self._first(eid, p, seq.stream, first)):
                # a request is its execution's first event: nothing before it to fold. A child's request
                # may follow its cancellation (the parent's router and admission race): one lookup says.
                state = ExecutionState(eid)
            elif state is None:
                state = await self._rebuild(eid, p, seq.stream)
            self.cache[eid] = state
            self.partition_of[eid] = p
            self.cache.move_to_end(eid)
            ended = state.status in FINAL  # before this message: the decision folds into the state at once
            exemplar = await self._decide_and_publish(msg, state, eid, events)
        except BaseException as exc:
            # the state has folded events whose decision is not published: forget it, so that the
            # redelivery rebuilds it and decides again (were it kept, it would fold to nothing). A
            # message that cannot be folded or decided on, or whose decision cannot be published, is
            # dropped (wire.handle_one): the next event's rebuild skips it, as every rebuild does, so
            # that live and rebuilt states agree; and its execution, which cannot go on, is stopped.
            self.cache.pop(eid, None)
            self.partition_of.pop(eid, None)
            # no retry can cure it, or this was its last: the server delivers it no more after this
            last = isinstance(exc, Exception) and getattr(getattr(msg, "metadata", None), "num_delivered", 0) >= MAX_DELIVER
            if (isinstance(exc, UNHANDLEABLE) or last) and not ended and (ended is False or not await self._recorded_final(eid)):
                await self._stop(eid, events, exc, last=last and not isinstance(exc, UNHANDLEABLE))
            raise
        finally:
            self.unprepare(first)
        if self.idle(state):
            self.cache[eid] = IDLE
        self.handled += 1
        self._evict()
        return exemplar

    async def _decide_and_publish(self, msg: Msg, state: ExecutionState, eid: str,
                                  events: list[dict[str, Any]]) -> dict | None:
        outputs, commands, foreign, timers, cancel_runs = [], [], [], [], []
        exemplar = None
        for event in events:
            if apply(state, event):
                self._count(event["name"])
                decision = await self.decide(state, event)
                outputs += decision.events
                commands += decision.commands
                foreign += decision.foreign
                timers += decision.timers
                cancel_runs += decision.cancel_runs
        if outputs or commands or foreign:  # most events need nothing from this service: no span, no publish
            with tracing.consume_span(f"{self.name} {events[-1]['name']}", msg.headers, service=self.name,
                                      execution_id=eid, **{tracing.EVENT: events[-1]["name"]}):
                # other executions' events first (a child's request, a parent's notice): if this
                # service dies in between, the redelivered cause decides again and sends both
                await self.bus.publish_all(foreign + outputs, commands, timers=timers,
                                           flat=eid if flat(state) else None)
                await self.after(state, outputs, cancel_runs)
                exemplar = metrics.exemplar()
            for out in outputs:
                if out["name"] == "workflow.started":
                    metrics.EXECUTIONS_STARTED.labels(self.name).inc()
                elif out["name"] == "workflow.finished":
                    status = str((out.get("data") or {}).get("status") or "unknown")
                    metrics.EXECUTIONS_FINISHED.labels(self.name, status).inc()
        return exemplar

    async def _stop(self, eid: str, events: list[dict[str, Any]], exc: BaseException, last: bool = False) -> None:
        """End execution ``eid`` FAILED with an ``engine_error`` naming what this service could not do
        (D18), instead of leaving it RUNNING for ever: an error no retry cures, or (``last``) any error
        on the event's last delivery. A failure to say so is a transient one: the message is then
        retried (wire.handle_one), and says it again."""
        names = ", ".join(dict.fromkeys(repr(e.get("name")) for e in events))
        steps = ", ".join(dict.fromkeys(repr(e["step"]) for e in events if e.get("step")))
        tried = f" in {MAX_DELIVER} deliveries" if last else ""
        message = (f"the engine could not go on with this execution: the {self.name} could not handle "
                   f"{names}{f' of step {steps}' if steps else ''}{tried}: {type(exc).__name__}: {exc}")[:2000]
        message = message.encode("utf-8", "backslashreplace").decode()  # lone surrogates cannot be sent
        log.error("%s: stopping execution %s: %s", self.name, eid, message)
        tries = 3 if last else 1  # the last delivery: no other chance comes
        for attempt in range(1, tries + 1):
            try:
                await self.bus.publish_all([engine_stopped(eid, self.name, message)])
                return
            except UNHANDLEABLE as again:  # not the message's fault: retry it
                raise RuntimeError(f"could not stop execution {eid}: {again}") from again
            except Exception:  # noqa: BLE001 - NATS away for a moment
                if attempt == tries:
                    raise
                await asyncio.sleep(1.0)

    async def _recorded_final(self, eid: str) -> bool:
        """Whether the recorder has execution ``eid`` finished: asked when its state could not be rebuilt
        here, so that a finished execution gets no stray stop (False when the recorder does not say)."""
        try:
            got = await self.bus.request(Q_EXECUTION_STATUS, {"execution_id": eid}, timeout=5)
        except Exception:  # noqa: BLE001 - not known: stop it (a finished execution ignores a stop)
            return False
        return isinstance(got, dict) and got.get("status") in FINAL

    async def _first(self, eid: str, p: int, seq: int, request: dict[str, Any]) -> bool:
        """Whether a child's request is its execution's first message in the log (one lookup); what
        deciding it needs from elsewhere is fetched meanwhile (:meth:`prepare`): two round trips at once."""
        self.prepare(request)
        return await self.bus.first_seq(eid, p) == seq

    def _count(self, name: str) -> None:
        counter = self._m_handled.get(name)
        if counter is None:
            counter = self._m_handled[name] = metrics.EVENTS_HANDLED.labels(self.name, event_class(name))
        counter.inc()

    async def _rebuild(self, execution_id: str, partition: int, before_seq: int) -> ExecutionState:
        self.rebuilds += 1
        self._m_rebuilds.inc()
        events = await self.bus.execution_events(execution_id, partition, self.classes + self.rebuild_classes)
        state = ExecutionState(execution_id)
        later_own = []
        for s, event in events:
            if s < before_seq:
                _fold(state, event)
            elif event["source"] == self.name:
                later_own.append(event)
        for event in later_own:  # our own decisions on causes before S (folded at once when made)
            if event.get("parent_id") in state.seen:
                _fold(state, event)
        return state

    def _drop_partition(self, p: int) -> None:
        for eid in [e for e, part in self.partition_of.items() if part == p]:
            self.cache.pop(eid, None)
            self.partition_of.pop(eid, None)

    def _evict(self) -> None:
        while len(self.cache) > self.cache_size:
            eid, _ = self.cache.popitem(last=False)
            self.partition_of.pop(eid, None)


def _fold(state: ExecutionState, event: dict[str, Any]) -> None:
    """Fold one event of a rebuild. One that cannot be folded was dropped when it was delivered
    (wire.handle_one); it is skipped here too, so that it cannot stop every later event of its execution."""
    try:
        apply(state, event)
    except UNHANDLEABLE as exc:
        log.error("rebuilding %s: skipping event %s (%s), which cannot be folded: %s: %s", state.execution_id,
                  event.get("event_id"), event.get("name"), type(exc).__name__, exc)
