"""Execution state as a pure fold of events (D22).

``apply(state, event)`` updates one :class:`ExecutionState` in place; ``fold(events)`` builds one from
nothing. Nothing here does I/O, and nothing else in the engine changes execution state: the services
fold the events they receive (and the ones they emit) with this module, and replay from the event log
uses it too, so the state a service holds and the state rebuilt from the log are the same function of
the same events.

The net (D16): a *token* targets a step and lies in a *place* (an arc of the static graph, or
``entry``); admission consumes tokens into *step runs*; the router turns a run's terminal event into
new tokens. A run is *active* from its admission until its routing (``next.evaluated``), so at every
point of the event stream each token or run that can still feed a join is visible.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable

import orjson

from ..lang.graph import WorkflowGraph
from ..lang.validate import entry_step

ENTRY_PLACE = "entry"

# D18 statuses
PENDING, RUNNING, COMPLETED, FAILED, CANCELLED = "PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED"
FINAL = (COMPLETED, FAILED, CANCELLED)


@dataclass
class Token:
    id: str
    step: str  # the step it targets
    place: str  # Place.id of the arc it came by, or ENTRY_PLACE
    args: dict[str, Any]
    seq: int  # order of arrival, for first-in first-out consumption


@dataclass
class LoopState:
    items: list[Any]
    mode: str
    max_in_flight: int
    in_flight: set[int] = field(default_factory=set)
    next_index: int = 0
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, Any] = field(default_factory=dict)  # failed iterations
    done: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        return len(self.items)

    @property
    def finished(self) -> int:
        return self.done + self.failed


@dataclass
class StepRun:
    id: str
    step: str
    args: dict[str, Any]
    status: str = "running"  # running | done | failed | cancelled
    result: Any = None
    error: Any = None
    started: bool = False
    ended: bool = False
    routed: bool = False
    loop: LoopState | None = None
    restored: bool = False  # D32: carried over from the execution this one restarts, not run here

    @property
    def active(self) -> bool:
        """Active until routed: until then it may still put tokens on places (D16)."""
        return not self.routed


@dataclass
class Wait:
    """A pipeline run suspended at a ``playbook`` task until its child execution ends."""

    child: str  # the child's execution id
    step_run_id: str
    iteration: int | None
    step: str
    task: str | None
    path: str | None
    continuation: dict[str, Any]
    finished: dict[str, Any] | None = None  # the child's playbook.child.finished data, once it ended


@dataclass
class Timer:
    """D29: a timer an execution set (``timer.scheduled``) and, once its time came, ``fired``."""

    id: str
    kind: str  # token (a delayed arc) | wait (a wait task's time) | wait_timeout | step_timeout
    due: float  # epoch seconds
    data: dict[str, Any]  # token: {token_id, step, place, args}; wait*: {wait_id}; step_timeout: {run_id, seconds}
    fired: bool = False
    arrived: bool = False  # token: its token.enqueued is folded (until then it is on its way, also once fired)


@dataclass
class TaskWait:
    """D29 (b), D30: a pipeline run suspended at a ``wait`` task, until a time or a signal."""

    id: str
    step_run_id: str
    iteration: int | None
    step: str
    task: str | None
    kind: str  # time | signal
    spec: dict[str, Any]  # signal, due, timeout, timeout_at, roles, schema, assignee, form, suspended_at
    continuation: dict[str, Any]
    started_at: float = 0.0
    outcome: dict[str, Any] | None = None  # the wait task's outcome, once the time or a signal came
    ended: bool = False  # wait.ended: the run was resumed with the outcome
    refused: list[dict[str, Any]] = field(default_factory=list)  # D30: signals its schema refused (signal.checked)

    @property
    def signal(self) -> str | None:
        return self.spec.get("signal") if self.kind == "signal" else None

    def takes(self, signal: dict[str, Any]) -> bool:
        """D30: whether a signal (``signal.received``'s data) may be its outcome as it is: the gateway
        checked its sender and payload against this wait (``wait_id``), or the wait has neither a schema
        nor roles. Any other signal is checked in the control plane first (decide: ``signal.checked``):
        one sent before the wait began was checked against no wait's roles."""
        return signal.get("wait_id") == self.id or (self.spec.get("schema") is None and not self.spec.get("roles"))


@dataclass
class ExecutionState:
    execution_id: str
    status: str = PENDING
    request: dict[str, Any] = field(default_factory=dict)
    requested_at: float | None = None  # the request's timestamp (the start of the execution's trace)
    playbook: dict[str, Any] | None = None  # the normalised document
    graph: WorkflowGraph | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    keychain: list[dict[str, Any]] = field(default_factory=list)  # the playbook's declarations (D24)
    author: dict[str, Any] | None = None  # who wrote the playbook (D33: a pool's roles are checked on it too)
    ctx: dict[str, Any] = field(default_factory=dict)
    tokens: dict[str, Token] = field(default_factory=dict)  # pending tokens by id
    runs: dict[str, StepRun] = field(default_factory=dict)
    runs_of: dict[str, list[str]] = field(default_factory=dict)  # step -> run ids in order
    skipped: dict[str, int] = field(default_factory=dict)  # step -> times skipped by admission
    failed_unhandled: bool = False  # D15: an unhandled failure happened
    failure: dict[str, Any] | None = None
    cancel_requested: bool = False
    errors: list[Any] = field(default_factory=list)
    waits: dict[str, Wait] = field(default_factory=dict)  # suspended runs by child execution id
    children: dict[str, None] = field(default_factory=dict)  # every child execution requested, in order
    timers: dict[str, Timer] = field(default_factory=dict)  # D29, by timer id
    task_waits: dict[str, TaskWait] = field(default_factory=dict)  # D29 (b), D30: wait tasks, by wait id
    signals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # D30: accepted signals by name
    kept: dict[str, dict[str, Any]] = field(default_factory=dict)  # D30: a signal no wait has taken yet, by name
    refused_signals: list[dict[str, Any]] = field(default_factory=list)  # D30: kept signals a schema refused
    seen: set[str] = field(default_factory=set)  # event ids applied (D21)
    token_seq: int = 0
    events: int = 0

    # ------------------------------------------------------------ derived views
    @property
    def finished(self) -> bool:
        return self.status in FINAL

    @property
    def halted(self) -> bool:
        """No new work is scheduled (D15 fail_fast, cancellation, or the end)."""
        return self.finished or self.cancel_requested or (self.failed_unhandled and self._fail_fast_hit)

    _fail_fast_hit: bool = False

    def steps_by_name(self) -> dict[str, dict[str, Any]]:
        return {s["step"]: s for s in (self.playbook or {}).get("workflow", [])}

    def step_def(self, name: str) -> dict[str, Any]:
        for s in (self.playbook or {}).get("workflow", []):
            if s["step"] == name:
                return s
        raise KeyError(name)

    def active_runs(self) -> list[StepRun]:
        return [r for r in self.runs.values() if r.active]

    def last_run(self, step: str) -> StepRun | None:
        ids = self.runs_of.get(step)
        return self.runs[ids[-1]] if ids else None

    def step_results(self) -> dict[str, dict[str, Any]]:
        """Each step's last *finished* run, readable by name in templates (D6)."""
        out = {}
        for step, ids in self.runs_of.items():
            for rid in reversed(ids):
                run = self.runs[rid]
                if run.ended:
                    out[step] = {"status": run.status, "result": run.result, "error": run.error}
                    break
        return out

    def delayed_tokens(self) -> list[Timer]:
        """D29: tokens on their way (an arc's delay has not passed yet)."""
        return [t for t in self.timers.values() if t.kind == "token" and not t.arrived]

    def quiescent(self) -> bool:
        """D18: no token pending (delayed ones included) and no step run in flight."""
        return not self.tokens and not any(r.active for r in self.runs.values()) and not self.delayed_tokens()

    def open_waits(self) -> list[TaskWait]:
        """D30: wait tasks still waiting (the inbox)."""
        return [w for w in self.task_waits.values() if not w.ended]


def fold(events: Iterable[dict[str, Any]], execution_id: str | None = None) -> ExecutionState:
    state: ExecutionState | None = None
    for event in events:
        if state is None:
            state = ExecutionState(execution_id or event["execution_id"])
        apply(state, event)
    return state or ExecutionState(execution_id or "")


def apply(state: ExecutionState, event: dict[str, Any]) -> bool:
    """Fold one event into ``state``. Returns False when the event was already applied (D21)."""
    eid = event["event_id"]
    if eid in state.seen:
        return False
    state.seen.add(eid)
    state.events += 1
    handler = _HANDLERS.get(event["name"])
    if handler is not None:
        handler(state, event, event.get("data") or {})
    return True


# ---------------------------------------------------------------- handlers
def _requested(s: ExecutionState, e: dict, d: dict) -> None:
    s.request = d
    s.requested_at = e.get("timestamp")


def _evaluated(s: ExecutionState, e: dict, d: dict) -> None:
    if e["status"] == "error":
        s.errors = d.get("errors", [])
        return
    s.playbook = d["playbook"]
    s.workload = d.get("workload") or {}
    s.keychain = d.get("keychain") if isinstance(d.get("keychain"), list) else []
    s.author = d.get("authored_by") if isinstance(d.get("authored_by"), dict) else None
    s.graph = graph_of(s.playbook, d.get("digest"))
    if s.request.get("restarted_from") is not None:
        _restore(s, s.request.get("seed"))


def _restore(s: ExecutionState, seed: Any) -> None:
    """D32: a restart's initial state, from its request's seed (core/restart.py; admission checked it
    before evaluating the request): ctx, each earlier step's last finished run, the skip counts. Its
    tokens come as events (admission enqueues them)."""
    if not isinstance(seed, dict):
        return
    if isinstance(seed.get("ctx"), dict):
        s.ctx.update(seed["ctx"])
    for r in seed.get("runs") or ():
        if isinstance(r, dict) and isinstance(r.get("run_id"), str) and r["run_id"] not in s.runs:
            run = StepRun(r["run_id"], r.get("step"), r.get("args") or {}, status=r.get("status", "done"),
                          result=r.get("result"), error=r.get("error"), started=True, ended=True, routed=True,
                          restored=True)
            s.runs[run.id] = run
            s.runs_of.setdefault(run.step, []).append(run.id)
    for step, n in (seed.get("skipped") or {}).items() if isinstance(seed.get("skipped"), dict) else ():
        if isinstance(n, int):
            s.skipped[step] = n


_GRAPHS: dict[str, WorkflowGraph] = {}


def playbook_digest(doc: Any) -> str:
    return hashlib.blake2b(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS, default=str), digest_size=16).hexdigest()


def graph_of(doc: dict[str, Any], digest: str | None = None) -> WorkflowGraph:
    """The static graph of a playbook (immutable, so shared by every execution of the same one)."""
    graph = _GRAPHS.get(digest) if digest else None
    if graph is None:
        graph = WorkflowGraph.build(
            (st["step"], [a["step"] for a in (st.get("next") or {}).get("arcs", [])]) for st in doc["workflow"]
        )
        if digest:
            if len(_GRAPHS) > 256:
                _GRAPHS.clear()
            _GRAPHS[digest] = graph
    return graph


def _started(s: ExecutionState, e: dict, d: dict) -> None:
    if s.status == PENDING:
        s.status = RUNNING


def _token(s: ExecutionState, e: dict, d: dict) -> None:
    if s.timers and e.get("source") == "router":
        for timer in s.timers.values():  # a delayed token arrives (D29)
            if timer.kind == "token" and timer.data.get("token_id") == d.get("token_id"):
                timer.arrived = True
    s.token_seq += 1
    s.tokens[d["token_id"]] = Token(d["token_id"], d["step"], d.get("place", ENTRY_PLACE), d.get("args") or {}, s.token_seq)


def _consume(s: ExecutionState, d: dict) -> None:
    for tid in d.get("tokens", ()):
        s.tokens.pop(tid, None)


def _admitted(s: ExecutionState, e: dict, d: dict) -> None:
    _consume(s, d)
    run = StepRun(d["run_id"], d["step"], d.get("args") or {})
    s.runs[run.id] = run
    s.runs_of.setdefault(run.step, []).append(run.id)


def _skipped(s: ExecutionState, e: dict, d: dict) -> None:
    _consume(s, d)
    s.skipped[e["step"]] = s.skipped.get(e["step"], 0) + 1


def _step_started(s: ExecutionState, e: dict, d: dict) -> None:
    run = s.runs.get(e["step_run_id"])
    if run is not None:
        run.started = True


def _ctx_patched(s: ExecutionState, e: dict, d: dict) -> None:
    s.ctx.update(d.get("patch") or {})  # D12: in event order, last writer wins per key


def _loop_started(s: ExecutionState, e: dict, d: dict) -> None:
    run = s.runs.get(e["step_run_id"])
    if run is not None:
        run.loop = LoopState(list(d.get("items") or []), d.get("mode", "sequential"), int(d.get("max_in_flight", 1)))


def _iteration_started(s: ExecutionState, e: dict, d: dict) -> None:
    run = s.runs.get(e["step_run_id"])
    if run is not None and run.loop is not None and not run.ended:
        i = e["iteration"]
        run.loop.in_flight.add(i)
        run.loop.next_index = max(run.loop.next_index, i + 1)


def _iteration_ended(s: ExecutionState, e: dict, d: dict) -> None:
    run = s.runs.get(e["step_run_id"])
    if run is None or run.loop is None or run.ended:
        return
    i = e["iteration"]
    loop = run.loop
    if i not in loop.in_flight:  # a duplicate or late report
        return
    loop.in_flight.discard(i)
    if s.waits or s.task_waits:
        _drop_waits(s, run.id, i)
    if e["name"] == "loop.iteration.done":
        loop.done += 1
        loop.results[i] = d.get("result")
    else:
        loop.failed += 1
        loop.results[i] = None  # D11: null for a failed iteration
        loop.errors[i] = d.get("error")


def _terminal(s: ExecutionState, e: dict, d: dict) -> None:
    run = s.runs.get(e["step_run_id"])
    if run is None or run.ended:
        return
    run.ended = True
    if s.waits or s.task_waits:
        _drop_waits(s, run.id)
    run.status = "done" if e["name"] in ("step.done", "loop.done") else d.get("status", "failed")
    run.result = d.get("result")
    run.error = d.get("error")


def _suspended(s: ExecutionState, e: dict, d: dict) -> None:
    """A run waits for a child. Every fold lists the child; the wait itself is recorded where it is
    acted on: a step run's by every service, a loop iteration's only by a fold that tracks the loop
    (the loop-coordinator's: it requests, resumes and cancels iterations' children)."""
    child = d.get("child") if isinstance(d.get("child"), dict) else {}
    cid = child.get("execution_id")
    if not isinstance(cid, str) or cid in s.children:
        return
    s.children[cid] = None
    run = s.runs.get(e["step_run_id"])
    if run is None or run.ended:
        return
    i = e.get("iteration")
    if i is not None and (run.loop is None or i not in run.loop.in_flight):
        return  # not this fold's to act on, or a late report of an iteration that ended
    s.waits[cid] = Wait(cid, run.id, i, run.step, e.get("task"), child.get("path"), d.get("continuation") or {})


def _child_finished(s: ExecutionState, e: dict, d: dict) -> None:
    wait = s.waits.get(d.get("child_execution_id"))
    if wait is not None and wait.finished is None:
        wait.finished = d


def _drop_waits(s: ExecutionState, run_id: str, iteration: Any = ...) -> None:
    for cid in [c for c, w in s.waits.items()
                if w.step_run_id == run_id and (iteration is ... or w.iteration == iteration)]:
        del s.waits[cid]
    for wid in [i for i, w in s.task_waits.items()
                if w.step_run_id == run_id and (iteration is ... or w.iteration == iteration)]:
        del s.task_waits[wid]


# ---------------------------------------------------------------- timers, waits, signals (D29, D30)
def _timer_scheduled(s: ExecutionState, e: dict, d: dict) -> None:
    tid = d.get("timer_id")
    if isinstance(tid, str) and tid not in s.timers:
        s.timers[tid] = Timer(tid, str(d.get("kind")), float(d.get("due") or 0), d.get("data") or {})


def _timer_fired(s: ExecutionState, e: dict, d: dict) -> None:
    """Only a timer this execution set fires, and only once; a wait's time or timeout gives the wait
    task its outcome (the deciders resume the run)."""
    timer = s.timers.get(d.get("timer_id"))
    if timer is None or timer.fired:
        return
    timer.fired = True
    if timer.kind in ("wait", "wait_timeout"):
        wait = s.task_waits.get(timer.data.get("wait_id"))
        if wait is not None and wait.outcome is None:
            wait.outcome = wait_outcome(wait, timer.kind)


def wait_outcome(wait: TaskWait, how: str, signal: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``wait`` task's outcome (D8): its time came, its signal came, or its timeout passed."""
    if how == "wait":
        waited = float(wait.spec.get("due") or 0) - float(wait.spec.get("suspended_at") or 0)
        return {"status": "ok", "result": {"waited": round(max(0.0, waited), 3)}, "error": None}
    if how == "signal":
        return {"status": "ok", "error": None, "result": {k: (signal or {}).get(k) for k in ("signal", "payload", "by", "at")}}
    return {"status": "error", "result": None, "error": {
        "kind": "timeout", "retryable": False,
        "message": f"step {wait.step!r} task {wait.task!r}: no signal {wait.signal!r} within {wait.spec.get('timeout')}"}}


def _wait_started(s: ExecutionState, e: dict, d: dict) -> None:
    wid = d.get("wait_id")
    run = s.runs.get(e.get("step_run_id") or "")
    if not isinstance(wid, str) or wid in s.task_waits or run is None or run.ended:
        return
    wait = TaskWait(wid, run.id, e.get("iteration"), run.step, e.get("task"), str(d.get("kind")),
                    d.get("spec") or {}, d.get("continuation") or {}, float(e.get("timestamp") or 0))
    s.task_waits[wid] = wait
    name = wait.signal
    if name is not None and name in s.kept and wait.takes(s.kept[name]):  # D30: a signal that came first
        wait.outcome = wait_outcome(wait, "signal", s.kept.pop(name))  # (with a schema: signal.checked decides)


def open_wait(s: ExecutionState, name: str) -> TaskWait | None:
    """D30: the wait a signal of ``name`` goes to: the oldest that has no outcome yet."""
    return next((w for w in s.task_waits.values() if w.signal == name and w.outcome is None), None)


def _signal(s: ExecutionState, e: dict, d: dict) -> None:
    """D30: the oldest open wait for the name takes the signal if it was checked against that wait's
    schema (or the wait has none); otherwise the signal is kept: for the next wait of that name, or for
    the check of the open wait's schema in the control plane (``signal.checked``). One kept at most:
    the gateway refuses a second."""
    name = d.get("signal")
    if not isinstance(name, str):
        return
    s.signals.setdefault(name, []).append(d)
    wait = open_wait(s, name)
    if wait is not None and wait.takes(d):
        wait.outcome = wait_outcome(wait, "signal", d)
        return
    s.kept.setdefault(name, d)


def _signal_checked(s: ExecutionState, e: dict, d: dict) -> None:
    """D30: the control plane's verdict on a kept signal against the wait's schema: accepted, it is the
    wait's outcome; refused, it is dropped (recorded on the wait and the execution) and the wait goes on
    waiting for another."""
    wait = s.task_waits.get(d.get("wait_id"))
    name = d.get("signal")
    if wait is None or wait.outcome is not None or wait.signal != name or name not in s.kept:
        return
    signal = s.kept.pop(name)
    if d.get("accepted"):
        wait.outcome = wait_outcome(wait, "signal", signal)
        return
    refusal = {"signal": name, "wait_id": wait.id, "step": wait.step, "task": wait.task, "iteration": wait.iteration,
               "by": signal.get("by"), "at": signal.get("at"), "error": d.get("error"), "location": d.get("location")}
    wait.refused.append(refusal)
    s.refused_signals.append(refusal)


def _wait_ended(s: ExecutionState, e: dict, d: dict) -> None:
    wait = s.task_waits.get(d.get("wait_id"))
    if wait is not None:
        wait.ended = True
        if wait.outcome is None:
            wait.outcome = d.get("outcome")
            # a log written before signals named the wait they were checked for (the gateway had
            # checked it): the signal the wait ended with is no longer kept
            result = (wait.outcome or {}).get("result")
            kept = s.kept.get(wait.signal) if wait.signal else None
            if kept is not None and isinstance(result, dict) and result.get("at") == kept.get("at") \
                    and result.get("by") == kept.get("by"):
                del s.kept[wait.signal]


def _next_evaluated(s: ExecutionState, e: dict, d: dict) -> None:
    run = s.runs.get(e["step_run_id"])
    if run is not None:
        run.routed = True
    if d.get("unhandled"):
        s.failed_unhandled = True
        s.failure = s.failure or {"step": e["step"], "error": d.get("error")}
        if d.get("fail_fast"):
            s._fail_fast_hit = True


def _cancel(s: ExecutionState, e: dict, d: dict) -> None:
    s.cancel_requested = True


def _finished(s: ExecutionState, e: dict, d: dict) -> None:
    s.status = d["status"]
    for rid in d.get("cancelled_runs", ()):
        run = s.runs.get(rid)
        if run is not None and not run.ended:
            run.ended, run.routed, run.status = True, True, "cancelled"
    s.tokens.clear()


_HANDLERS = {
    "playbook.execution.requested": _requested,
    "playbook.request.evaluated": _evaluated,
    "workflow.started": _started,
    "token.enqueued": _token,
    "step.admitted": _admitted,
    "step.skipped": _skipped,
    "step.started": _step_started,
    "ctx.patched": _ctx_patched,
    "loop.started": _loop_started,
    "loop.iteration.started": _iteration_started,
    "loop.iteration.done": _iteration_ended,
    "loop.iteration.failed": _iteration_ended,
    "step.done": _terminal,
    "step.failed": _terminal,
    "loop.done": _terminal,
    "next.evaluated": _next_evaluated,
    "task.suspended": _suspended,
    "playbook.child.finished": _child_finished,
    "execution.cancelled": _cancel,
    "workflow.finished": _finished,
    "timer.scheduled": _timer_scheduled,
    "timer.fired": _timer_fired,
    "wait.started": _wait_started,
    "wait.ended": _wait_ended,
    "signal.received": _signal,
    "signal.checked": _signal_checked,
}

__all__ = [
    "ExecutionState", "StepRun", "Token", "LoopState", "Wait", "TaskWait", "Timer", "wait_outcome", "apply", "fold", "graph_of", "entry_step",
    "ENTRY_PLACE", "PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "FINAL",
]


def summary(state: ExecutionState) -> dict[str, Any]:
    """The D26 shape of an execution (without ``events``): status, workload, ctx, and per step its run
    count and the status and result of its last run (``skipped`` with 0 runs when admission denied it)."""
    steps: dict[str, dict[str, Any]] = {}
    for step in [s["step"] for s in (state.playbook or {}).get("workflow", [])]:
        run = state.last_run(step)
        if run is not None:
            status = run.status if run.ended else "cancelled" if state.finished else "running"
            ran = [rid for rid in state.runs_of[step] if not state.runs[rid].restored]
            steps[step] = {"status": status, "runs": len(ran), "result": run.result}
            if run.restored:  # D32: its result was carried over; it did not run in this execution
                steps[step]["restored"] = True
        elif state.skipped.get(step):
            steps[step] = {"status": "skipped", "runs": 0, "result": None}
    out = {"execution_id": state.execution_id, "status": state.status, "workload": state.workload,
           "ctx": state.ctx, "steps": steps}
    if state.request.get("parent_execution_id"):
        out["parent_execution_id"] = state.request["parent_execution_id"]
    if state.children:
        out["children"] = list(state.children)
    if state.task_waits:
        out["waits"] = [wait_view(w) for w in state.task_waits.values()]
    if state.signals:
        out["signals"] = {name: len(sent) for name, sent in state.signals.items()}
    if state.kept:
        out["kept_signals"] = list(state.kept)
    if state.refused_signals:  # D30: kept signals their wait's schema refused when they met
        out["refused_signals"] = list(state.refused_signals)
    if state.request.get("schedule"):  # started by a schedule's firing (D31)
        out["schedule"] = state.request["schedule"]
    if isinstance(state.request.get("restarted_from"), dict):  # D32
        out["restarted_from"] = state.request["restarted_from"]
    return out


def wait_view(wait: TaskWait) -> dict[str, Any]:
    """A wait task as the API shows it (D30's inbox): what it waits for, never its continuation."""
    out = {"wait_id": wait.id, "step": wait.step, "task": wait.task, "iteration": wait.iteration,
           "kind": wait.kind, "status": "ended" if wait.ended else "resolved" if wait.outcome else "waiting",
           "started_at": wait.started_at, **wait.spec}
    if wait.refused:
        out["refused_signals"] = list(wait.refused)
    return out
