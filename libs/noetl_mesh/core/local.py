"""An in-process run of the whole control plane over one ordered event log: the reference semantics.

Each service (admission, router, loop-coordinator) keeps its own state, folded from the log in order,
exactly as the NATS services do: the log is a list of *messages* (a decision's events for one execution,
or one event a worker reported), and a service reads only the messages of the classes it consumes
(``decide.CONSUMES``; not its own ``flat`` ones), folding every event of each. Commands go to a queue that a
worker drains. The scheduler picks which service or worker moves next — in order, or at random
(``seed``) to explore the interleavings that replicas and a network produce. Tests use it to check the
semantics without I/O; the distributed stack must produce the same outcomes.
"""
from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from . import decide
from .events import FLAT, batch_class, make_event, new_execution_id, stable_id, writer_of
from .keychain import Resolver, dict_resolver
from .state import ExecutionState, apply, fold
from .worker import execute_command

SERVICES = ("admission", "router", "loop-coordinator")
_DECIDERS: dict[str, Callable[..., decide.Decision]] = {
    "admission": decide.admission,
    "router": decide.router,
    "loop-coordinator": decide.loops,
}


@dataclass
class LocalRun:
    """One run: the root execution and every child execution it started, over one ordered log."""

    execution_id: str  # the root execution
    events: list[dict[str, Any]] = field(default_factory=list)  # every execution's events, in log order
    messages: list[list[dict[str, Any]]] = field(default_factory=list)  # the same events as published
    classes: list[str] = field(default_factory=list)  # each message's subject class (events.batch_class)
    states: dict[str, dict[str, ExecutionState]] = field(default_factory=dict)  # service -> execution -> state
    cursors: dict[str, int] = field(default_factory=dict)
    commands: list[dict[str, Any]] = field(default_factory=list)
    playbook: Any = None
    fired: list[tuple[float, str]] = field(default_factory=list)  # (due, what) of each timer and signal, in order

    @property
    def log(self) -> list[dict[str, Any]]:
        """The root execution's events."""
        return self.log_of(self.execution_id)

    def log_of(self, execution_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["execution_id"] == execution_id]

    @property
    def state(self) -> ExecutionState:
        """The root execution's state rebuilt from its events (D22)."""
        return fold(self.log, self.execution_id)

    def state_of(self, execution_id: str) -> ExecutionState:
        return fold(self.log_of(execution_id), execution_id)

    @property
    def executions(self) -> list[str]:
        """Every execution of the run, in the order of their first event."""
        return list(dict.fromkeys(e["execution_id"] for e in self.events))


async def run_local(
    playbook: Any,
    *,
    workload: Mapping[str, Any] | None = None,
    tools: Mapping[str, Any] | None = None,
    seed: int | None = None,
    max_moves: int = 200_000,
    sleep: Callable[[float], Any] | None = None,
    credentials: Mapping[str, Any] | None = None,
    keychain_resolver: Resolver | None = None,
    catalog: Mapping[str, Any] | None = None,
    signals: Sequence[tuple[float, str, Any]] = (),
    request: Mapping[str, Any] | None = None,
) -> LocalRun:
    """Run one execution to its end. ``seed=None`` moves everything in a fixed order; an int picks
    the next mover at random among those that can move. Keychain ``credential`` entries resolve
    through ``keychain_resolver``, or else from ``credentials`` (``{stored name: data}``, in memory).
    ``catalog`` (``{path: playbook}``) resolves the child executions of ``playbook`` tasks; the root
    playbook is in it under its own ``metadata.path`` too.

    Time (D29, D30) runs on a fake clock: when nothing else can move, the earliest timer fires (its
    ``timer.fired`` enters the log as the NATS scheduler would write it), or the earliest of
    ``signals`` — ``(seconds after the start, name, payload[, the sender's roles: admin])`` — is sent
    to the root execution (as sent before its wait began: the control plane checks it); no
    test waits for real time. ``request``: the data of the root's ``playbook.execution.requested``
    (default ``{workload}``), e.g. a restart's (:func:`restart_local`)."""
    from ..tools import default_tools

    if keychain_resolver is None:
        keychain_resolver = dict_resolver(credentials or {})

    tools = tools if tools is not None else default_tools()
    rng = random.Random(seed)
    run = LocalRun(new_execution_id(), playbook=playbook)
    books = dict(catalog or {})
    if isinstance(playbook, dict) and isinstance(playbook.get("metadata"), dict):
        books.setdefault(playbook["metadata"].get("path"), playbook)
    for name in SERVICES:
        run.states[name] = {}
        run.cursors[name] = 0

    def send(events: list[dict[str, Any]], flat: str | None = None) -> None:
        """Publish: consecutive events of one execution travel as one message (as bus.batches);
        ``flat``: the execution its writer knows is flat (decide.flat)."""
        messages: list[list[dict[str, Any]]] = []
        for e in events:
            if not messages or messages[-1][0]["execution_id"] != e["execution_id"]:
                messages.append([e])
            else:
                messages[-1].append(e)
            run.events.append(e)
        for m in messages:
            run.messages.append(m)
            run.classes.append(batch_class(m, flat=m[0]["execution_id"] == flat))

    send([make_event("playbook.execution.requested", run.execution_id, event_id=f"req-{run.execution_id}",
                     source="gateway", data=dict(request) if request is not None else {"workload": dict(workload or {})})])

    def resolve(event: dict[str, Any]) -> Any:
        if event["execution_id"] == run.execution_id:
            inline = (event.get("data") or {}).get("playbook")
            return playbook if inline is None else inline
        path = ((event.get("data") or {}).get("catalog") or {}).get("path")
        return books[path] if path in books else [f"catalog: no playbook at path {path!r}"]

    async def no_sleep(_: float) -> None:
        return None

    def publish(command: dict[str, Any]) -> Callable[[dict[str, Any]], Any]:
        async def one(event: dict[str, Any]) -> None:  # a worker's event: a message of its own
            send([event], flat=command["execution_id"] if command.get("flat") else None)
        return one

    fake = _FakeTime()
    t0 = fake.time()
    # (due, order, what, event, flat): timers and signals; flat: the execution of a flat execution's timer
    clock: list[tuple[float, int, str, dict[str, Any], str | None]] = []
    for k, (after, name, payload, *roles) in enumerate(signals):
        heapq.heappush(clock, (t0 + after, k, f"signal {name}", make_event(
            "signal.received", run.execution_id, event_id=stable_id("signal", run.execution_id, name, k),
            source="gateway", timestamp=t0 + after,
            data={"signal": name, "payload": payload, "by": "local", "at": t0 + after,
                  "roles": roles[0] if roles else ["admin"]}), None))

    with fake:
        await _moves(run, max_moves, rng, seed, clock, fake, t0, send, resolve, tools, publish, sleep or no_sleep,
                     keychain_resolver, len(signals))
    return run


async def restart_local(old: LocalRun, from_step: str, *, workload: Mapping[str, Any] | None = None,
                        execution_id: str | None = None, **kw: Any) -> LocalRun:
    """D32 in process: a new run that restarts ``execution_id`` (default the root) of ``old`` from
    ``from_step``, as the gateway makes it (core/restart.py), with ``workload`` merged over the old one;
    ``kw`` as :func:`run_local`'s."""
    from . import restart

    xid = execution_id or old.execution_id
    start = restart.seed(old.log_of(xid), from_step, status=old.state_of(xid).status, execution_id=xid)
    return await run_local(start["playbook"], request=restart.request(start, workload=dict(workload or {}) or None),
                           **kw)


class _FakeTime:
    """The clock of a local run: real time plus the jumps made when idle (D29). While a run goes, the
    engine's modules that read the time (events, pipeline) read this one."""

    def __init__(self) -> None:
        self.skew = 0.0
        self.saved: list[tuple[Any, Any]] = []

    def time(self) -> float:
        return time.time() + self.skew

    def jump(self, to: float) -> None:
        self.skew += max(0.0, to - self.time())

    def __getattr__(self, name: str) -> Any:  # perf_counter, monotonic, ... stay real
        return getattr(time, name)

    def __enter__(self) -> "_FakeTime":
        from . import events, pipeline
        self.saved = [(m, m.time) for m in (events, pipeline)]
        for module, _ in self.saved:
            module.time = self
        return self

    def __exit__(self, *exc: object) -> None:
        for module, real in self.saved:
            module.time = real


async def _moves(run, max_moves, rng, seed, clock, fake, t0, send, resolve, tools, publish, sleep, keychain_resolver,
                 n_signals) -> None:
    order = itertools.count(n_signals)  # ties of due times keep the order they were set in
    for _ in range(max_moves):
        movers = [s for s in SERVICES if run.cursors[s] < len(run.messages)]
        if run.commands:
            movers.append("worker")
        if not movers:
            while clock:  # idle: the clock jumps to the next timer or signal
                due, _, what, event, flat = heapq.heappop(clock)
                router_state = run.states["router"].get(event["execution_id"])
                if router_state is not None and router_state.finished:
                    continue  # a finished execution's timers were purged
                fake.jump(due)
                run.fired.append((round(due - t0, 3), what))
                send([event], flat)
                break
            else:
                break
            continue
        who = rng.choice(movers) if seed is not None else movers[0]
        if who == "worker":
            i = rng.randrange(len(run.commands)) if seed is not None else 0
            command = run.commands.pop(i)
            if not _cancelled(run, command):
                await execute_command(command, tools, publish(command), sleep=sleep,
                                      keychain_resolver=keychain_resolver)
            continue
        message, cls = run.messages[run.cursors[who]], run.classes[run.cursors[who]]
        run.cursors[who] += 1
        if cls not in decide.CONSUMES[who] or cls == FLAT and writer_of(message[0].get("source")) == who:
            continue  # not on its subjects: another class, or its own flat message (subjects.control_filter)
        eid = message[0]["execution_id"]
        state = run.states[who].get(eid)
        if state is None:
            state = run.states[who][eid] = ExecutionState(eid)
        foreign, own, timers = [], [], []
        for event in message:
            if not apply(state, event):
                continue  # a duplicate, already folded (D21)
            if who == "admission" and event["name"] == "playbook.execution.requested":
                decision = decide.admission(state, event, resolve(event))
            else:
                decision = _DECIDERS[who](state, event)
            foreign += decision.foreign
            own += decision.events
            run.commands.extend(decision.commands)
            timers += decision.timers
        flat = eid if decide.flat(state) else None  # as the shell decides it (infra/control.py)
        for timer in timers:
            heapq.heappush(clock, (timer["due"], next(order), f"timer {timer['event']['data']['kind']}",
                                   timer["event"], flat if timer["execution_id"] == flat else None))
        send(foreign + own, flat)  # as the shell publishes them: other executions' first
    else:
        raise RuntimeError(f"execution did not settle within {max_moves} moves")


def _cancelled(run: LocalRun, command: dict[str, Any]) -> bool:
    state = run.states["router"].get(command["execution_id"])
    return state is not None and state.finished
