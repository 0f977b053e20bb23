"""worker pool: pulls the commands of its pool, runs step pipelines, reports events.

It reads every lane of its pool's queue (a lane per user who starts executions) and starts what it
fetched in the lanes' turns (:mod:`.lanes`): one user's backlog does not hold up another's commands.

A command is acknowledged only after its terminal event is stored, so a worker that dies mid-task
leaves it to be redelivered (after ``ack_wait``) to another worker; the rerun reproduces the event
ids of what was already reported (D21). A worker that is stopped (SIGTERM) fetches nothing more, lets
its running commands finish for ``NOETL_SHUTDOWN_GRACE`` seconds (default 10), and hands back the
rest, and whatever it had fetched but not started, with a ``nak``: they are redelivered at once to
another worker, not after ``ack_wait``. Long tasks keep their lease with in-progress acks. A
``noetl.cancel.<execution>`` broadcast aborts the execution's running commands and drops its queued
ones (D15, D18). While a command runs, its secrets are masked in every log record of the process
(D24: ``keychain.install_log_masking``; httpx and httpcore, which log request URLs, stay at WARNING).
The pool's sandbox policy (D33) is read once at start, with this worker's NATS servers closed to tasks
whatever it allows (:func:`sandbox_policy`), logged, and handed to the tools.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from typing import Any

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from noetl_mesh import limits
from noetl_mesh.core import standing as users
from noetl_mesh.core.keychain import bus_resolver, install_log_masking
from noetl_mesh.core.decide import lost_command
from noetl_mesh.core.worker import execute_command
from noetl_mesh.infra import logs, metrics, tracing
from noetl_mesh.contracts.subjects import (LANES, Q_USERS_STANDING, command_parts, lane_durable, lane_filter,
                                           cancel_subject, pool_durable)
from noetl_mesh.infra.bus import COMMANDS, UNHANDLEABLE, Bus, BusError, hand_back, loads, pool_filter, release, strays
from noetl_mesh.infra.micro import Consumer
from noetl_mesh.infra.payloads import PayloadMissing, is_ref
from noetl_mesh.sandbox import policy as sandbox
from noetl_mesh.sandbox.net import host_addresses, resolve_endpoints
from noetl_mesh.sandbox import supervisor as supervision
from noetl_mesh.sandbox.supervisor import Supervisor
from noetl_mesh.tools import close_tools, default_tools
from noetl_mesh.tools.postgres import forget_libpq_env

from noetl_mesh.infra.lanes import Slots

log = logging.getLogger("noetl.worker")
LANE_WAIT = 1.0  # seconds a lane's fetch waits for a command while this worker has a slot free
LANE_LOOK = 0.1  # ... and while every slot is taken: a look whether the lane holds one, after a slot frees
HOLD = 1.0  # seconds a fetched command waits for a slot here before it is handed back to the pool ...
HAND_BACKS = 2  # ... at most this many times (each is a delivery: max_deliver counts it)
WATCH = 0.5  # seconds between looks at what reached a lane's subscription while the lane waits


def payload_limit(command: dict) -> int | None:
    """D23: the playbook's ``executor.spec.policy.limits.max_payload_bytes``, if it sets one."""
    executor = (command.get("spec_layers") or {}).get("executor") or {}
    return ((executor.get("policy") or {}).get("limits") or {}).get("max_payload_bytes")


def sandbox_policy(nc: Any, allow_net: str | None = None, roles: str | None = None) -> sandbox.Policy:
    """D33: the pool's policy from the environment (``allow_net``, when given, over
    NOETL_SANDBOX_ALLOW_NET: the stack runners' ``--allow-net``; ``roles`` over NOETL_POOL_ROLES), with
    the address and port of every NATS server the client ``nc`` is connected to or knows of (its own
    and the discovered ones) closed whatever the policy allows, and the addresses of this host's own
    interfaces closed unless it opens them. :class:`sandbox.PolicyError` (naming the variable) on a
    bad setting."""
    env = dict(os.environ)
    if allow_net is not None:
        env[sandbox.ENV["allow"]] = allow_net
    if roles is not None:
        env[sandbox.ENV["roles"]] = roles
    policy = sandbox.from_env(env)
    urls = [u for u in (nc.connected_url, *nc.servers) if u is not None and u.hostname]
    return policy.with_engine_endpoints(resolve_endpoints((u.hostname, u.port or 4222) for u in urls)) \
        .with_host_addresses(host_addresses())


class Unsendable(RuntimeError):
    """A run's report that cannot be encoded: running the command again would only repeat it."""


class EventBatcher:
    """A run's events leave in a few messages: everything reported within ``linger`` seconds travels
    together (a quick step is one message), and the PubAcks are awaited once, at the end."""

    def __init__(self, bus: Bus, linger: float = 0.05, limit: int | None = None, flat: bool = False):
        self.bus, self.linger, self.limit = bus, linger, limit
        self.flat = flat  # the command's execution is flat: its ctl messages go as flat (core/decide.py)
        self.buffer: list[dict] = []
        self.acks: list[asyncio.Future] = []
        self.timer: asyncio.TimerHandle | None = None
        self.flushing: asyncio.Task | None = None

    async def add(self, event: dict) -> None:
        self.buffer.append(event)
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.linger, self._flush_soon)

    def _flush_soon(self) -> None:
        self.timer = None
        if self.buffer and (self.flushing is None or self.flushing.done()):
            self.flushing = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        events, self.buffer = self.buffer, []
        if events:
            if self.acks:  # in order: a step's end must not be stored while what it reported before is lost
                await asyncio.wait_for(asyncio.gather(*self.acks), 30)
            try:
                self.acks.append(await self.bus.send_events(events, self.limit, flat=self.flat))
            except UNHANDLEABLE as exc:  # it cannot be encoded: sending it again would fail again
                raise Unsendable(f"{type(exc).__name__}: {exc}") from exc

    def abandon(self) -> None:
        """Stop a cancelled run's pending flush (nothing more of it is published)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.flushing is not None and not self.flushing.done():
            self.flushing.cancel()

    async def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.flushing is not None:
            await self.flushing
        await self.flush()
        await asyncio.wait_for(asyncio.gather(*self.acks), 30)


_CANCEL_FIELDS = frozenset({"execution_id", "status", "runs", "only_runs"})  # contracts.messages.CancelNotice
STANDING_TTL = users.STANDING_TTL  # how long a pool keeps a user's standing (D33), how often it looks again
TERMINALS = {"step.done": ("run", "success"), "step.failed": ("run", "error"),
             "loop.iteration.done": ("iteration", "success"), "loop.iteration.failed": ("iteration", "error"),
             "task.suspended": (None, "suspended")}


class RunObserver:
    """The metrics and spans of one command, from the events it publishes (and the pipeline's notes):
    a task's duration by tool kind and status, a run's (or iteration's) from the command's start to
    its terminal event; when spans are exported, a span per task attempt (under the run's) and span
    events for retries and policy directives on the run's span."""

    def __init__(self, service: str, pool: str, command: dict, run_span: Any, started: float):
        self.service, self.pool, self.started = service, pool, started
        self.kinds = {t.get("name"): str(t.get("kind")) for t in command.get("tasks") or () if isinstance(t, dict)}
        self.chunk = bool(command.get("chunk"))
        self.run_span = run_span
        self.tracing = tracing.exporting()
        self.step, self.eid = command.get("step"), command.get("execution_id")
        self.iteration_spans: dict[Any, Any] = {}
        self.task_spans: dict[tuple, Any] = {}

    def _run_of(self, iteration: Any) -> Any:
        """The span of the run (or, in a chunk, the iteration) an event belongs to."""
        if not self.chunk:
            return self.run_span
        s = self.iteration_spans.get(iteration)
        if s is None:
            with tracing.otel_context_of(self.run_span):
                s = self.iteration_spans[iteration] = tracing.start_span(
                    f"iteration {self.step}[{iteration}]", service=self.service,
                    start_time=int(time.time_ns() - (time.perf_counter() - self.started) * 1e9),
                    **{tracing.EXECUTION_ID: self.eid, tracing.STEP: self.step, tracing.ITERATION: iteration})
        return s

    def event(self, event: dict) -> None:
        name = event["name"]
        if name == "task.processed":
            outcome = (event.get("data") or {}).get("outcome") or {}
            kind = self.kinds.get(event.get("task"), "unknown")
            status = str(outcome.get("status") or "unknown")
            exemplar = None
            if self.tracing:
                s = self.task_spans.pop((event.get("iteration"), event.get("action_id"), event.get("attempt")), None)
                if s is not None:
                    s.set_attribute(tracing.STATUS, status)
                    if status != "ok":
                        error = outcome.get("error") or {}
                        s.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR,
                                                          str(error.get("kind") or "error")))
                    exemplar = {"trace_id": format(s.get_span_context().trace_id, "032x")}
                    s.end()
            duration = ((outcome.get("meta") or {}).get("duration_ms") or 0) / 1000.0
            metrics.TASK_DURATION.labels(self.service, self.pool, kind, status).observe(duration, exemplar)
        elif name == "task.started":
            if self.tracing:
                run = self._run_of(event.get("iteration"))
                attempt = event.get("attempt") or 1
                if attempt > 1:
                    run.add_event("retry", {tracing.TASK: event.get("task") or "", tracing.ATTEMPT: attempt})
                with tracing.otel_context_of(run):
                    key = (event.get("iteration"), event.get("action_id"), attempt)
                    self.task_spans[key] = tracing.start_span(
                        f"task {event.get('task')}", service=self.service,
                        **{tracing.EXECUTION_ID: self.eid, tracing.STEP: self.step, tracing.TASK: event.get("task"),
                           tracing.ATTEMPT: attempt, tracing.TOOL_KIND: self.kinds.get(event.get("task"), "unknown"),
                           **({tracing.ITERATION: event["iteration"]} if event.get("iteration") is not None else {})})
        elif name in TERMINALS:
            kind, status = TERMINALS[name]
            kind = kind or ("run" if event.get("iteration") is None else "iteration")
            exemplar = None
            if self.tracing:
                run = self._run_of(event.get("iteration"))
                run.set_attribute(tracing.STATUS, status)
                if name == "task.suspended":  # its task waits (a child, a signal): its span ends here
                    s = self.task_spans.pop((event.get("iteration"), event.get("action_id"), event.get("attempt")),
                                            None)
                    if s is not None:
                        s.set_attribute(tracing.STATUS, "suspended")
                        s.end()
                if status == "error":
                    error = (event.get("data") or {}).get("error") or {}
                    run.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR,
                                                        str(error.get("kind") or "error")))
                exemplar = {"trace_id": format(run.get_span_context().trace_id, "032x")}
                if self.chunk:
                    self.iteration_spans.pop(event.get("iteration"), None)
                    run.end()
            metrics.STEP_DURATION.labels(self.service, self.pool, kind, status).observe(
                time.perf_counter() - self.started, exemplar)

    def note(self, what: str, fields: dict) -> None:
        """A policy directive (pipeline ``note``): a span event on the run's span."""
        if not self.tracing:
            return
        attributes = {tracing.TASK: fields.get("task") or "", tracing.ATTEMPT: fields.get("attempt") or 1,
                      "noetl.policy.do": str(fields.get("do"))}
        for key in ("to", "delay", "exhausted"):
            if fields.get(key) is not None:
                attributes[f"noetl.policy.{key}"] = fields[key]
        self._run_of(fields.get("iteration")).add_event(what, attributes)

    def close(self) -> None:
        """End what a cancelled or failed command left open."""
        for s in [*self.task_spans.values(), *self.iteration_spans.values()]:
            s.end()
        self.task_spans.clear()
        self.iteration_spans.clear()


class WorkerService:
    name = "worker"

    def __init__(self, bus: Bus, *, pool: str = "default", concurrency: int = 8, ack_wait: float = 30.0,
                 tools: dict[str, Any] | None = None, grace: float | None = None, allow_net: str | None = None,
                 warm: str | None = None, roles: str | None = None):
        self.bus, self.pool, self.concurrency, self.ack_wait = bus, pool, concurrency, ack_wait
        self.allow_net = allow_net  # D33: over NOETL_SANDBOX_ALLOW_NET when given (see sandbox_policy)
        self.roles = roles  # D33: over NOETL_POOL_ROLES when given
        self.warm = warm  # over NOETL_SANDBOX_WARM when given (see _start_sandbox)
        self.policy: sandbox.Policy | None = None
        # seconds a stopping worker lets its running commands finish before handing them back
        self.grace = grace if grace is not None else float(os.environ.get("NOETL_SHUTDOWN_GRACE") or 10)
        self.tools = tools
        self.sandbox: Supervisor | None = None  # made at start when the worker makes its own tools
        self._sandbox_start: asyncio.Task | None = None
        self.keychain = bus_resolver(self.bus.request, pool)  # D24: per-execution TTL cache, bound per command
        self.log_masking = install_log_masking()  # D24: the running commands' secrets never reach a log
        self.running: dict[asyncio.Task, str] = {}
        self.lane_of: dict[asyncio.Task, int] = {}  # each command running, its lane (whose slot it holds)
        self.finished: collections.OrderedDict[str, None] = collections.OrderedDict()  # cancelled/finished executions
        self.run_of: dict[asyncio.Task, str | None] = {}  # the step run of each running command
        self.guarded: dict[asyncio.Task, dict] = {}  # running commands, their users checked again (_recheck)
        self.revoked: dict[asyncio.Task, str] = {}  # those stopped for it, and why
        self._rechecking: asyncio.Task | None = None
        self.stopped_runs: collections.OrderedDict[str, None] = collections.OrderedDict()  # timed out (D29)
        self.stop_event = asyncio.Event()
        self.loop_task: asyncio.Task | None = None
        self.cancel_sub = None
        self.done = 0
        self._m_in_flight = metrics.IN_FLIGHT.labels(self.name, pool)
        # the lag of each lane (consumer lane-<pool>-p<N>, partition N), and of pool-<pool> ("-")
        # its consumers, one per lane and pool-<pool> (what earlier versions sent, one lane more): (durable,
        # filter, the lag metric's partition label)
        self.durables = [(lane_durable(pool, n), lane_filter(pool, n), str(n)) for n in range(LANES)] \
            + [(pool_durable(pool), pool_filter(pool), "-")]
        self._m_pending = {label: metrics.PENDING.labels(self.name, durable, label)
                           for durable, _, label in self.durables}
        self._m_outcome = {o: metrics.COMMANDS.labels(self.name, pool, o)
                           for o in ("acked", "retried", "dropped", "payload_missing", "cancelled", "forbidden")}
        self._standing = users.StandingCache(
            lambda uid: self.bus.request(Q_USERS_STANDING, {"user_id": uid}, timeout=5))  # the sessions service's word
        # what `nats micro stats` and `noetl ps` show of this worker (infra/micro.py)
        self.commands = Consumer(name="commands", stream=COMMANDS, subject=lane_filter(pool, "*"),  # type: ignore[arg-type]
                                 durable=f"lane-{pool}", lanes=LANES)  # lane_durable: <durable>-p<lane>
        self.unlaned = Consumer(name="commands-unlaned", stream=COMMANDS, subject=pool_filter(pool),
                                durable=pool_durable(pool))
        self.consumers = [self.commands, self.unlaned]
        self.slots = Slots(concurrency, LANES + 1, limits.current().lane_reserve)
        self.subs: list = []
        self._busy_lanes: set[int] = set()  # the lanes whose last fetch found commands

    async def start(self) -> None:
        await self.bus.attach()
        dropped = forget_libpq_env()  # a task's postgres connection must not take the worker's PG* settings
        if dropped:
            log.info("worker %s: libpq's %s left out of its environment (D33)", self.pool, ", ".join(sorted(dropped)))
        self.policy = await asyncio.to_thread(sandbox_policy, self.bus.nc, self.allow_net, self.roles)  # names resolve
        log.info("worker %s: %s; closed whatever it allows: NATS %s", self.pool, self.policy.describe(),
                 ", ".join(f"{a}:{p}" for a, p, _ in self.policy.engine) or "none known")
        if self.tools is None:
            # D33: user code runs sandboxed; a worker that cannot sandbox says so as it starts, and refuses it
            self.sandbox = Supervisor(self.policy, secret_paths=self._secret_paths())
            self._sandbox_start = asyncio.create_task(self._start_sandbox(), name="sandbox-start")
            self.tools = default_tools(sandbox=self.sandbox)
        self.subs = [await self.bus.durable(COMMANDS, durable, subjects, max_ack_pending=10_000,
                                            ack_wait=self.ack_wait, max_deliver=10)
                     for durable, subjects, _ in self.durables]
        self.cancel_sub = await self.bus.nc.subscribe("noetl.cancel.*", cb=self._on_cancel)
        self.loop_task = asyncio.create_task(self._pull(), name=f"worker-{self.pool}")
        self._rechecking = asyncio.create_task(self._recheck(), name=f"worker-{self.pool}-standing")

    async def _start_sandbox(self) -> None:
        """The fork servers start beside the worker's first fetch (a task waits for its own if it must):
        python's first, then those of the other kinds in NOETL_SANDBOX_WARM (default: every kind; a
        duckdb server costs ~60 MB and saves the first duckdb task ~0.2 s of starting it)."""
        from noetl_mesh.sandbox.supervisor import PRELOAD

        assert self.sandbox is not None
        try:
            await self.sandbox.start()
        except Exception as exc:  # noqa: BLE001 - each task reports it again
            log.error("worker %s: the sandbox's fork server did not start: %s", self.pool, exc)
            return
        unavailable = self.sandbox.describe().startswith("sandbox UNAVAILABLE")
        (log.error if unavailable else log.info)("worker %s: %s", self.pool, self.sandbox.describe())
        warm = self.warm if self.warm is not None else os.environ.get("NOETL_SANDBOX_WARM")
        kinds = [k for k in (PRELOAD if warm is None else [k.strip() for k in warm.split(",")])
                 if k in PRELOAD and k != "python" and not unavailable]

        async def start(kind: str) -> None:
            try:
                await self.sandbox.start(kind)
            except Exception as exc:  # noqa: BLE001 - its first task starts it again, and says why
                log.warning("worker %s: the %s fork server did not start ahead: %s", self.pool, kind, exc)

        await asyncio.gather(*(start(kind) for kind in kinds))  # side by side: each mostly imports

    def _secret_paths(self) -> list[str]:
        """What the sandbox must never show a task: this worker's NATS credentials and the stack's home."""
        from noetl_mesh.home import home_dir

        creds = getattr(self.bus, "creds", None) or os.environ.get("NOETL_NATS_CREDS")
        return [p for p in (creds, creds and os.path.dirname(os.path.abspath(creds)), home_dir()) if p]

    async def ready(self) -> dict[str, Any]:
        """Bound to its pool's commands and pulling."""
        ok = self.loop_task is not None and not self.loop_task.done() and not self.stop_event.is_set()
        return {"ok": ok, "pool": self.pool, "in_flight": len(self.running),
                **({} if ok else {"error": "not pulling commands"})}

    async def stop(self) -> None:
        """Fetch nothing more; let the running commands finish for ``grace`` seconds; hand back (nak)
        those still running and whatever was fetched but not started, for another worker at once."""
        self.stop_event.set()
        for task in (self.loop_task, self._rechecking):
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        grace = self.bus.grace(self.grace)  # none on a throw-away stack (noetl run's): its NATS goes next
        if self.running and grace:
            log.info("worker %s: stopping; %d commands running, waiting up to %gs for them", self.pool,
                     len(self.running), grace)
            await asyncio.wait(list(self.running), timeout=grace)
        if self.running and not self.bus.throwaway:
            log.warning("worker %s: handing back %d running commands for redelivery", self.pool, len(self.running))
        for task in list(self.running):  # still running: _run naks its command
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        # a fetch cancelled mid-way may still deliver: nak it
        await asyncio.gather(*(release(sub, linger=self.bus.grace(LANE_WAIT + 0.2)) for sub in self.subs))
        if self.cancel_sub is not None:
            await self.cancel_sub.unsubscribe()
        await close_tools(self.tools or {})
        if self.sandbox is not None:
            if self._sandbox_start is not None:
                self._sandbox_start.cancel()
                await asyncio.gather(self._sandbox_start, return_exceptions=True)
            await self.sandbox.close()

    async def _pull(self) -> None:
        """Read every lane of the pool's queue (and the earlier versions' consumer, one lane more)."""
        await asyncio.gather(*(self._lane(lane, sub) for lane, sub in enumerate(self.subs)))

    async def _lane(self, lane: int, sub: Any) -> None:
        """Fetch the lane's commands and start each in the lane's turn for a slot (:class:`Slots`).
        While a slot is free a fetch waits for commands, as many as the free slots shared among the
        lanes that found some last time; while every slot is taken, the lane looks for one (briefly)
        after each slot that frees, unless its last fetch found some: so a lane that fills while the
        worker is busy gets its turn at the next slot but one. A fetch's answer can arrive after the
        fetch gave up (a slow network, a busy process): whatever reaches the lane's subscription is
        taken up within :data:`WATCH` seconds, never left unleased to be redelivered elsewhere."""
        while not self.stop_event.is_set():
            if self.slots.free <= 0 and lane not in self._busy_lanes:
                try:
                    await asyncio.wait_for(self.slots.released(), WATCH)
                except asyncio.TimeoutError:
                    if late := strays(sub):
                        await self._admit(lane, late, sub)
                    continue
            free = self.slots.free
            busy = len(self._busy_lanes | {lane})
            try:
                msgs = await sub.fetch(max(1, free // busy), timeout=LANE_WAIT if free > 0 else LANE_LOOK)
            except (NatsTimeout, asyncio.TimeoutError):  # an empty fetch (both kinds occur)
                msgs = strays(sub)
            except Exception as exc:  # noqa: BLE001 - NATS away or restarting: keep pulling
                if self.stop_event.is_set():
                    return
                log.warning("fetching commands failed (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(0.5)
                continue
            (self._busy_lanes.add if msgs else self._busy_lanes.discard)(lane)
            if msgs:
                await self._admit(lane, list(msgs), sub)

    async def _admit(self, lane: int, held: list[Msg], sub: Any) -> None:
        """Start the fetched commands, each once its lane's turn gives it a slot; keep the leases of
        those not started meanwhile (and of any late answer the lane's subscription gets). One that
        waits longer than :data:`HOLD` seconds is handed back (nak: another worker with a slot free
        gets it at once), :data:`HAND_BACKS` times at most: then it waits here. Stopped meanwhile:
        hand them back for another worker at once."""
        lease: asyncio.Task | None = None
        taking: asyncio.Future | None = None
        try:
            while held:
                if not self.slots.try_take(lane):
                    lease = lease or asyncio.create_task(self._keep_leases(held))
                    taking = asyncio.ensure_future(self.slots.take(lane))
                    until = time.monotonic() + HOLD
                    while not taking.done():
                        await asyncio.wait({taking}, timeout=WATCH)
                        held.extend(strays(sub))
                        back = [m for m in held if m.metadata.num_delivered <= HAND_BACKS]
                        if not taking.done() and back and time.monotonic() >= until:
                            taking.cancel()  # (a slot granted meanwhile goes on to the next lane)
                            await asyncio.gather(taking, return_exceptions=True)
                            await asyncio.shield(asyncio.gather(*(hand_back(m) for m in back)))
                            held[:] = [m for m in held if m not in back]
                            break
                    if not taking.done() or taking.cancelled():
                        taking = None
                        continue
                    taking.result()  # a slot, in the lane's turn
                    taking = None
                msg = held.pop(0)
                task = asyncio.create_task(self._run(msg, lane))
                self.running[task] = ""
                self.lane_of[task] = lane
                task.add_done_callback(self._forget)
        except BaseException:
            if taking is not None and taking.done() and not taking.cancelled() and taking.exception() is None:
                self.slots.release(lane)  # granted, and not used: the next lane's
            elif taking is not None:
                taking.cancel()
            held.extend(strays(sub))
            await asyncio.shield(asyncio.gather(*(hand_back(m) for m in held)))  # handed back at once
            raise
        finally:
            if lease is not None:
                lease.cancel()

    async def _keep_leases(self, held: list[Msg]) -> None:
        """Keep the leases of these commands (running, or held for a slot; the list may change)."""
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            for msg in list(held):
                try:
                    await msg.in_progress()
                except Exception as exc:  # noqa: BLE001 - NATS away: the server redelivers it after ack_wait
                    log.warning("keeping the lease of a command failed (%s: %s)", type(exc).__name__, exc)

    def _forget(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        self.run_of.pop(task, None)
        self.slots.release(self.lane_of.pop(task, None))

    async def _run(self, msg: Msg, lane: int | None = None) -> None:
        supervision.LANE.set(lane)  # its task processes are shared between lanes as its slots are
        started = time.perf_counter()
        self._m_in_flight.inc()
        parts = command_parts(msg.subject)  # its log records name its execution
        if parts is not None:
            logs.set_execution(parts[1])
        try:
            lane = parts[2] if parts is not None else None
            self._m_pending["-" if lane is None else str(lane)].set(msg.metadata.num_pending)
            await self._run_command(msg, started)
        finally:
            self._m_in_flight.dec()

    async def _run_command(self, msg: Msg, started: float) -> None:
        started_ns = time.perf_counter_ns()  # the micro stats' clock (infra/micro.py)
        try:
            command = loads(msg.data)
            eid = command["execution_id"]
        except Exception:  # noqa: BLE001 - a malformed command can never succeed: drop it, loudly
            log.error("dropping a malformed command at %s: %r", msg.subject, msg.data[:200])
            self.commands.record(started_ns, error=f"dropped a malformed command at {msg.subject}")
            await msg.term()
            self._m_outcome["dropped"].inc()
            return
        self.running[asyncio.current_task()] = eid
        self.run_of[asyncio.current_task()] = command.get("step_run_id")
        if eid in self.finished or command.get("step_run_id") in self.stopped_runs:
            await msg.ack()
            self._m_outcome["cancelled"].inc()
            return
        logs.set_execution(eid)  # this task's log records (each command runs in a task of its own)
        heartbeat = asyncio.create_task(self._keep_leases([msg]))
        batcher: EventBatcher | None = None
        observer: RunObserver | None = None
        try:
            if (refusal := await self._refusal(command)) is not None:  # D33: not this pool's to run
                log.warning("command %s: %s", command.get("command_id"), refusal)
                self.commands.record(started_ns, error=f"forbidden: {refusal}")
                await self._fail(command, {"kind": "forbidden", "message": refusal, "retryable": False})
                await msg.ack()
                self._m_outcome["forbidden"].inc()
                return
            self.guarded[asyncio.current_task()] = command
            step = command["step"]
            attributes = {tracing.STEP: step, tracing.POOL: self.pool, tracing.STEP_RUN_ID: command.get("step_run_id")}
            if command.get("iteration") is not None:
                attributes[tracing.ITERATION] = command["iteration"]
            with tracing.consume_span(f"step {step}" if not command.get("chunk") else f"step {step} (chunk)",
                                      msg.headers, service=self.name, execution_id=eid,
                                      **{k: v for k, v in attributes.items() if v is not None}) as run_span:
                command = await self.bus.expand(msg.data, command)  # D23: references -> values
                batcher = EventBatcher(self.bus, limit=payload_limit(command), flat=command.get("flat") is True)
                observer = RunObserver(self.name, self.pool, command, run_span, started)

                async def publish(event: dict, add=batcher.add, seen=observer.event) -> None:
                    seen(event)
                    await add(event)

                # D24: credentials are resolved for this command only, named by its place in the stream
                grant = {"seq": msg.metadata.sequence.stream, "subject": msg.subject}
                await execute_command(command, self.tools, publish, source=f"worker:{self.pool}",
                                      keychain_resolver=self.keychain.bound(grant), note=observer.note,
                                      on_secrets=functools.partial(self.log_masking.track, asyncio.current_task()))
                await batcher.close()
            self.done += 1
            self.commands.record(started_ns)
            await msg.ack()  # every event is stored; a lost ack only means a redelivery (D21)
            self._m_outcome["acked"].inc()
        except PayloadMissing as exc:  # D23: a reference past the retention; no redelivery will help
            log.error("command %s: %s", command.get("command_id"), exc)
            self.commands.record(started_ns, error=f"payload_missing: {exc}")
            await self._fail(command, {"kind": "payload_missing", "message": str(exc), "retryable": False})
            await msg.ack()
            self._m_outcome["payload_missing"].inc()
        except asyncio.CancelledError:
            if (why := self.revoked.get(asyncio.current_task())) is not None:  # its users lost their standing
                log.warning("command %s: stopped while it ran: %s", command.get("command_id"), why)
                self.commands.record(started_ns, error=f"forbidden: {why}")
                await self._fail(command, {"kind": "forbidden", "message": f"{why}; stopped while it ran",
                                           "retryable": False})
                await msg.ack()
                self._m_outcome["forbidden"].inc()
                return
            if eid in self.finished or command.get("step_run_id") in self.stopped_runs:  # cancelled by the control plane: nothing more to report
                await msg.ack()
                self._m_outcome["cancelled"].inc()
            else:  # the worker is stopping: hand the command back now, not after ack_wait
                try:
                    await asyncio.wait_for(asyncio.shield(msg.nak()), 2)
                except BaseException:  # noqa: BLE001 - then it is redelivered after ack_wait
                    pass
                raise
        except Unsendable as exc:  # its report cannot be encoded: running it again would only repeat it
            log.exception("command %s: its report cannot be sent", command.get("command_id"))
            self.commands.record(started_ns, error=f"engine_error: {exc}")
            await self._fail(command, {"kind": "engine_error", "retryable": False, "message": (
                f"the worker could not send this step's report: {exc}")[:2000]})
            await msg.ack()
            self._m_outcome["dropped"].inc()
        except Exception as exc:  # noqa: BLE001 - e.g. NATS down while publishing: let it be redelivered
            log.exception("command %s failed", command.get("command_id"))
            self.commands.record(started_ns, error=f"retrying command {command.get('command_id')}: "
                                                f"{type(exc).__name__}: {exc}")
            await msg.nak(delay=2.0)
            self._m_outcome["retried"].inc()
        finally:
            self.log_masking.forget(asyncio.current_task())
            self.guarded.pop(asyncio.current_task(), None)
            self.revoked.pop(asyncio.current_task(), None)
            heartbeat.cancel()
            if batcher is not None:
                batcher.abandon()
            if observer is not None:
                observer.close()

    async def _refusal(self, command: dict) -> str | None:
        """Why this worker does not run the command, or None (D33). Whoever started its execution (a
        child: its root's starter), whoever wrote the playbook it runs (registered that catalog
        version, or sent it inline) and, for a child, whoever wrote each playbook above it must each
        still be an active user: a disabled or removed user's executions run no further task. On a pool that names the roles it serves
        (``NOETL_POOL_ROLES``), each must also hold one of them, the starter within the roles its
        request carried, an author within the roles its registration carried (an API token's may be fewer
        than its owner's). Their standing is the sessions
        service's word now, kept for :data:`STANDING_TTL` seconds; a pool that names no roles runs the
        command when that service does not answer (logged), one that does hands it back to be retried."""
        roles = self.policy.roles if self.policy is not None else None
        need = None if roles is None else (
            f"pool {self.pool!r} runs only playbooks started and written by users with the role "
            f"{' or '.join(sorted(roles))} (NOETL_POOL_ROLES on its workers, D33)")
        for did, who in users.command_users(command):
            uid = who.get("user_id") if isinstance(who, dict) else None
            if not isinstance(uid, str):
                if need is None:
                    continue  # no user to check (a stack without users: noetl run)
                return f"{need}; this one was {did} by no user known" + (
                    " (a catalog version registered before authors were recorded: register it again)"
                    if did == "written" else "")
            try:
                standing = await self._standing_of(uid)
            except BusError as exc:
                if exc.kind not in ("unavailable", "timeout"):
                    return f"the standing of the user who {did} this execution cannot be checked: {exc}"
                if need is not None:
                    raise  # handed back, retried
                log.warning("command %s: the standing of %s is unknown (%s): run, as the pool names no roles",
                            command.get("command_id"), uid, exc)
                continue
            if why := users.user_refusal(did, who, standing, None):
                return f"this execution was {why}: it runs no further task (D33)"
            if need is not None and (why := users.user_refusal(did, who, standing, roles)):
                return f"{need}; this one was {why}"
        return None

    async def _recheck(self) -> None:
        """D33: the users of every running command are checked again each :data:`STANDING_TTL`
        seconds, as when it started (:meth:`_refusal`): a command whose starter or author has been
        disabled or removed since (or, on a pool that names roles, no longer holds one) is stopped, its
        task process killed, and its run fails ``forbidden``. While the sessions service does not
        answer, the command goes on."""
        while not self.stop_event.is_set():
            await asyncio.sleep(STANDING_TTL)
            for task, command in list(self.guarded.items()):
                if task.done() or task in self.revoked:
                    continue
                try:
                    refusal = await self._refusal(command)
                except BusError:
                    continue
                except Exception:  # noqa: BLE001 - the check goes on for the others, and next time
                    log.exception("worker %s: checking the users of command %s again", self.pool,
                                  command.get("command_id"))
                    continue
                if refusal is not None and task in self.guarded and not task.done():
                    self.revoked[task] = refusal
                    task.cancel()

    async def _standing_of(self, uid: str) -> dict:
        """The user's standing, kept :data:`STANDING_TTL` seconds; a :class:`BusError` when the sessions
        service does not answer (kept a second)."""
        return await self._standing.get(uid, STANDING_TTL)

    async def _fail(self, command: dict, error: dict) -> None:
        """End the command's step run or iterations failed without running them. A chunk of iterations
        sent by reference (D23) is read first: each of its iterations fails."""
        if is_ref(command.get("chunk")):
            try:
                command = {**command, "chunk": await self.bus.payloads.expand(command["chunk"])}
            except PayloadMissing:  # its iterations are named by their range (lost_command)
                log.error("command %s: its chunk is unreadable too; its iterations %s fail", command.get("command_id"),
                          command.get("iterations"))
                command = {**command, "chunk": None}
        await self.bus.publish_all(lost_command(command, 0, error=error, source=f"worker:{self.pool}"))


    async def _on_cancel(self, msg: Msg) -> None:
        try:
            notice = loads(msg.data)
        except Exception:  # noqa: BLE001 - not the router's
            notice = None
        # the router's notice only: a server's delivery (a reply to ack) or any other body at this subject
        # is not one (a push consumer a compromised worker made could deliver its commands here)
        if msg.reply or not isinstance(notice, dict) or not set(notice) <= _CANCEL_FIELDS \
                or msg.subject != cancel_subject(str(notice.get("execution_id"))):
            log.warning("worker %s: ignoring a message at %s that is not a cancel notice", self.pool, msg.subject)
            return
        eid = notice["execution_id"]
        if notice.get("only_runs"):  # D29: step runs that timed out; the execution goes on
            runs = set(notice.get("runs") or ())
            for run in runs:
                self.stopped_runs[run] = None
            while len(self.stopped_runs) > 10_000:
                self.stopped_runs.popitem(last=False)
            for task, run in list(self.run_of.items()):
                if run in runs:
                    task.cancel()
            return
        self.finished[eid] = None
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)
        for task, task_eid in list(self.running.items()):
            if task_eid == eid:
                task.cancel()
