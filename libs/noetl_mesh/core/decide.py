"""What happens next: pure decisions from (state, event) to new events and commands.

Three slices, one per control-plane service, each the only writer of its events:

- :func:`admission` — evaluates execution requests and step admission (D17), fires joins (D16),
  creates step runs and their commands;
- :func:`router` — evaluates arcs on terminal step events (D13, D14), handles unhandled failures
  (D15), detects completion and cancellation (D18);
- :func:`loops` — renders loop collections, dispatches iterations and ends loop steps (D19, D15).

Child executions (``kind: playbook``): a worker's pipeline suspends at the task (``task.suspended``);
admission requests the child (an event in the child's stream); the child's router, when it finishes,
tells the parent (``playbook.child.finished`` in the parent's stream), and the parent's admission sends
the resume command. A decision's events for *other* executions are its ``foreign`` events; the shell
publishes them before the decision's own events, so a redelivered cause that re-decides republishes
them (same ids, stored once) and none is lost between the two.

Each function takes the state *after* the event was folded in and returns a :class:`Decision`. The
caller folds the decision's events into its own state at once (``Decision.apply``) before handling the
next event, so a service never decides twice on the same tokens. Every id is derived from the cause
(D21), so a redelivered event yields the same events, which the bus and the log store once.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import limits
from ..contracts import refs
from ..lang.durations import parse_duration
from ..lang.normalize import deep_merge
from ..lang.templates import TemplateError, render, shared_budget, truthy, within_depth
from . import restart as restart_seed
from .events import (ALIASES, CTL, ENGINE_ERROR, FLAT, LOOP, TERMINAL_STEP_EVENTS, carried_roles, engine_error,
                     make_event, stable_id)
from .state import (CANCELLED, COMPLETED, ENTRY_PLACE, FAILED, ExecutionState, StepRun, TaskWait, Wait, apply,
                    graph_of, open_wait, playbook_digest)

DEFAULT_POOL = "default"
# The event classes (events.batch_class) each decider folds: a service consumes the messages of these
# classes, every event of such a message included. The loop-coordinator's own ``dispatch`` events are
# folded when it makes them (and read back on rebuilds); it reads no ``flat`` message (:func:`flat`).
CONSUMES = {"admission": (CTL, FLAT), "router": (CTL, FLAT), "loop-coordinator": (CTL, LOOP)}
DEFAULT_MAX_DEPTH = 10  # child executions nest at most this deep (a root execution is at depth 0)


@dataclass
class Decision:
    events: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    foreign: list[dict[str, Any]] = field(default_factory=list)  # events of other executions (children, parent)
    # D29: timers to set: {timer_id, execution_id, due, event}; the shell schedules ``event`` (a
    # ``timer.fired``) with the NATS scheduler, which writes it into the execution's log at ``due``
    timers: list[dict[str, Any]] = field(default_factory=list)
    cancel_runs: list[str] = field(default_factory=list)  # step runs whose running tasks must stop (timeouts)


class _Out:
    """Collects the outputs of one decision, giving each a stable id and folding it in at once."""

    def __init__(self, state: ExecutionState, cause: dict[str, Any], source: str):
        self.state, self.cause, self.source = state, cause, source
        self.decision = Decision()

    def event(self, name: str, *, status: str = "success", data: dict | None = None, **kw: Any) -> dict:
        n = len(self.decision.events)
        event = make_event(
            name,
            self.state.execution_id,
            event_id=stable_id(self.cause["event_id"], self.source, n),
            source=self.source,
            status=status,
            data=data,
            parent_id=self.cause["event_id"],
            **kw,
        )
        self.decision.events.append(event)
        apply(self.state, event)
        return event

    def command(self, command: dict) -> None:
        self.decision.commands.append(command)

    def timer(self, kind: str, due: float, data: dict, key: str, **kw: Any) -> str:
        """D29: set a timer (``timer.scheduled`` now, ``timer.fired`` when ``due`` comes)."""
        state = self.state
        tid = stable_id("timer", state.execution_id, self.cause["event_id"], key)
        scheduled = self.event("timer.scheduled", data={"timer_id": tid, "kind": kind, "due": due, "data": data}, **kw)
        fired = make_event("timer.fired", state.execution_id, event_id=stable_id("fired", tid), source="timer",
                           data={"timer_id": tid, "kind": kind}, parent_id=scheduled["event_id"], **kw)
        self.decision.timers.append({"timer_id": tid, "execution_id": state.execution_id, "due": due,
                                     "event": fired})
        return tid

    def foreign(self, name: str, execution_id: str, key: str, *, status: str = "success", data: dict | None = None,
                **kw: Any) -> dict:
        """An event for another execution (not folded here); its id derives from ``key`` (D21)."""
        event = make_event(name, execution_id, event_id=stable_id(key, name), source=self.source, status=status,
                           data=data, parent_id=self.cause["event_id"], **kw)
        self.decision.foreign.append(event)
        return event


# =============================================================== admission
@dataclass(frozen=True)
class Written:
    """A catalog playbook as the shell fetched it: the document and who registered that version."""
    doc: Any
    author: Any = None


def admission(state: ExecutionState, event: dict[str, Any], playbook: Any = None, author: Any = None) -> Decision:
    """``playbook``: for ``playbook.execution.requested``, the resolved document (the shell fetched
    it from the catalog or took it inline) or a list of error strings when it could not; ``author``:
    who registered the catalog version (an inline playbook's author is its requester)."""
    out = _Out(state, event, "admission")
    name = event["name"]
    if name == "playbook.execution.requested":
        _evaluate_request(out, playbook, author)
    elif name == "task.suspended" and event.get("iteration") is None:  # an iteration's: the loop-coordinator's
        _suspended(out, event)
    elif name == "playbook.child.finished":
        _child_finished(out, event, iterations=False)
    if (name in WAKES or name == "task.suspended") and state.task_waits:
        _resume_waits(out, iterations=False)
    if state.status == "RUNNING" and state.tokens and not state.halted:
        _admit_pending(out)
    return out.decision


def _evaluate_request(out: _Out, resolved: Any, author: Any = None) -> None:
    from ..lang.validate import entry_step

    state = out.state
    if state.playbook is not None or state.cancel_requested or state.finished:
        return  # already evaluated (a redelivery), or a child cancelled before its request arrived
    kind = None  # the failure's kind, when not the playbook's fault (a limit)
    if isinstance(resolved, list):
        errors = [str(e) for e in resolved]
        kind = "limit_exceeded" if any(isinstance(e, limits.LimitExceeded) for e in resolved) else None
    elif resolved is None:
        errors = ["no playbook given"]
    else:
        digest, doc, errors = _validated(resolved)
    restart = state.request.get("restarted_from")
    if not errors and restart is not None:  # D32: the seed must fit the playbook before the fold takes it
        errors = ([] if isinstance(restart, dict) else ["restarted_from is not a mapping"]) \
            or restart_seed.check(state.request.get("seed"), doc, digest)
    if errors:
        out.event("playbook.request.evaluated", status="error", data={"errors": errors, **({"kind": kind} if kind else {})})
        return
    overrides = state.request.get("workload") or {}
    workload = deep_merge(doc.get("workload") or {}, overrides)  # D26: maps merge, others replace
    encoded = orjson.dumps(workload, default=str, option=orjson.OPT_NON_STR_KEYS)
    over = limits.exceeded("max_workload_bytes", len(encoded), "workload")
    if over:
        out.event("playbook.request.evaluated", status="error", data={"errors": [str(over)], "kind": over.kind})
        return
    # each side was checked, but a merge can join two halves of a payload reference (D23)
    if refs.MARKER in encoded and (at := refs.forged(workload)) is not None:
        out.event("playbook.request.evaluated", status="error",
                  data={"errors": [refs.refusal(f"the workload (the playbook's merged with the request's) at {refs.shown(at)}")]})
        return
    out.event(
        "playbook.request.evaluated",
        data={"playbook": doc, "digest": digest, "workload": workload, "keychain": _keychain_declarations(doc),
              "path": doc["metadata"]["path"], "version": (state.request.get("catalog") or {}).get("version"),
              "parent_execution_id": state.request.get("parent_execution_id"),
              "authored_by": _author(state, author)},
    )
    if restart is not None:
        out.event("workflow.started", data={"entry_step": entry_step(doc), "restarted_from": restart})
        _enqueue_seed(out)
        return
    out.event("workflow.started", data={"entry_step": entry_step(doc)})
    _enqueue(out, entry_step(doc), ENTRY_PLACE, state.request.get("args") or {}, cause_key="entry")


def _enqueue_seed(out: _Out) -> None:
    """D32: a restart's tokens — those that were waiting, and those of the runs that happen again
    (``from_step``'s among them) — with new ids, in the order they had arrived; a token an arc had
    delayed arrives at its due time, by a timer (at once when that has passed)."""
    state = out.state
    seed = state.request.get("seed") or {}
    for i, t in enumerate(seed.get("tokens") or ()):
        _enqueue(out, t["step"], t.get("place", ENTRY_PLACE), t.get("args") or {}, cause_key=f"restart:{i}")
    for i, t in enumerate(seed.get("delayed") or ()):
        tid = stable_id("token", state.execution_id, out.cause["event_id"], f"restart-delayed:{i}")
        due = max(float(t["due"]), float(out.cause.get("timestamp") or 0))  # passed: at once
        out.timer("token", due, {"token_id": tid, "step": t["step"], "place": t.get("place", ENTRY_PLACE),
                                 "args": t.get("args") or {}}, key=f"restart-delayed:{i}", step=t["step"])


def _keychain_declarations(doc: dict) -> list[dict]:
    """D24: the playbook's keychain *declarations*, never resolved values (the worker resolves them)."""
    return [dict(d) for d in doc.get("keychain") or [] if isinstance(d, dict)]


def _validated(doc: Any) -> tuple[str, dict | None, list[str]]:
    from ..lang.validate import validate_cached

    result = validate_cached(doc)
    document = copy.deepcopy(result.document) if result.ok else None
    return playbook_digest(doc), document, [str(d) for d in result.errors]


def _enqueue(out: _Out, step: str, place: str, args: dict, cause_key: str) -> None:
    tid = stable_id("token", out.state.execution_id, out.cause["event_id"], cause_key)
    out.event("token.enqueued", step=step, data={"token_id": tid, "step": step, "place": place, "args": args})


def _admit_pending(out: _Out) -> None:
    """Consume every token that can be consumed now, in arrival order, until nothing changes."""
    state = out.state
    progress = True
    while progress and not state.halted:
        progress = False
        for token in sorted(state.tokens.values(), key=lambda t: t.seq):
            if token.id not in state.tokens:
                continue
            if _try_fire(out, token.step, token):
                progress = True
                break


def _is_join(state: ExecutionState, step: str) -> bool:
    spec = state.step_def(step).get("spec") or {}
    return state.graph.is_join(step) and spec.get("join", "all") != "any"


def _try_fire(out: _Out, step: str, token) -> bool:
    """D16: a non-join step (or a back-edge token) fires per token; a join fires when each forward
    place holds a token or can no longer receive one."""
    state = out.state
    graph = state.graph
    forward = graph.forward_places.get(step, [])
    if not _is_join(state, step) or token.place not in {p.id for p in forward}:
        _fire(out, step, [token.id], token.args)
        return True
    marked: dict[str, list] = {}
    for t in state.tokens.values():
        if t.step == step:
            marked.setdefault(t.place, []).append(t)
    active = [t.step for t in state.tokens.values() if t.step != step]
    active += [r.step for r in state.runs.values() if r.active]
    delayed = state.delayed_tokens()  # D29: tokens on their way count as arriving
    active += [t.data.get("step") for t in delayed if t.data.get("step") != step]
    coming = {t.data.get("place") for t in delayed if t.data.get("step") == step}
    for place in forward:
        if place.id not in marked and (place.id in coming or graph.can_still_feed(step, place, active)):
            return False  # wait: this branch may still arrive
    order = {name: i for i, name in enumerate(graph.order)}
    consumed = []
    for place in sorted(forward, key=lambda p: (order[p.source], p.index)):
        if place.id in marked:
            consumed.append(min(marked[place.id], key=lambda t: t.seq))
    args: dict[str, Any] = {}
    for t in consumed:  # D16: merged in the workflow order of their source steps, later keys win
        args.update(t.args)
    _fire(out, step, [t.id for t in consumed], args)
    return True


def _fire(out: _Out, step: str, token_ids: list[str], args: dict) -> None:
    state = out.state
    sdef = state.step_def(step)
    try:
        allow, why = _admit(state, sdef, args)
    except TemplateError as exc:  # not a denial: the step run fails, and its arcs can route the error
        _fail_admission(out, step, token_ids, args, sdef,
                        {"kind": "template_error", "message": str(exc), "retryable": False})
        return
    if not allow:
        out.event("step.skipped", step=step, data={"tokens": token_ids, "reason": why})
        return
    run_id = stable_id("run", state.execution_id, *sorted(token_ids))
    out.event("step.admitted", step=step, step_run_id=run_id,
              data={"run_id": run_id, "step": step, "tokens": token_ids, "args": args})
    run = state.runs[run_id]
    if not sdef.get("tool"):  # D13: a step without tool is done at once
        out.event("step.started", step=step, step_run_id=run_id, status="in_progress")
        out.event("step.done", step=step, step_run_id=run_id, data={"result": None})
        return
    if sdef.get("loop"):
        return  # the loop-coordinator takes it from here (D19)
    pool = step_spec(state, sdef).get("pool") or DEFAULT_POOL
    out.event("step.scheduled", step=step, step_run_id=run_id, status="in_progress", data={"pool": pool})
    _step_timeout(out, run, sdef)
    out.command(build_command(state, run, pool=pool))


def _step_timeout(out: _Out, run: StepRun, sdef: dict) -> None:
    """D29 (c): a step run with ``spec.policy.lifecycle.timeout_s`` gets a timer when it is scheduled."""
    seconds = ((step_spec(out.state, sdef).get("policy") or {}).get("lifecycle") or {}).get("timeout_s")
    if seconds is None:
        return
    seconds = parse_duration(seconds)
    out.timer("step_timeout", float(out.cause["timestamp"]) + seconds, {"run_id": run.id, "seconds": seconds},
              key=f"timeout:{run.id}", step=run.step, step_run_id=run.id)


# =============================================================== waits (D29 b, D30)
WAKES = frozenset({"wait.started", "signal.received", "signal.checked", "timer.fired"})  # a wait may resume after them


def _suspended(out: _Out, event: dict) -> None:
    """A run suspended at a ``wait`` task (D29 b, D30) or a ``playbook`` task (a child execution)."""
    if (event.get("data") or {}).get("wait") is not None:
        _start_wait(out, event)
    else:
        _start_child(out, event)


def _start_wait(out: _Out, event: dict) -> None:
    """A run suspended at a ``wait`` task: record the wait and set its timers. A signal that came
    before it is taken at once (the fold does it); the resume follows in :func:`_resume_waits`."""
    state = out.state
    data = event.get("data") or {}
    spec = dict(data.get("wait") or {})
    wid = spec.pop("wait_id", None)
    run = state.runs.get(event.get("step_run_id") or "")
    i = event.get("iteration")
    if not isinstance(wid, str) or wid in state.task_waits or run is None or run.ended or state.halted:
        return
    if i is not None and (run.loop is None or i not in run.loop.in_flight):
        return  # a late report of an iteration that ended
    kind = "signal" if spec.get("signal") is not None else "time"
    ids = {"step": run.step, "step_run_id": run.id, "iteration": i, "task": event.get("task")}
    out.event("wait.started", status="paused", action_id=event.get("action_id"),
              data={"wait_id": wid, "kind": kind, "spec": spec, "continuation": data.get("continuation") or {}}, **ids)
    wait = state.task_waits.get(wid)
    if wait is None or wait.outcome is not None:
        return
    if kind == "time":
        out.timer("wait", float(spec["due"]), {"wait_id": wid}, key=f"wait:{wid}", **ids)
    elif spec.get("timeout_at") is not None:
        out.timer("wait_timeout", float(spec["timeout_at"]), {"wait_id": wid}, key=f"wait-timeout:{wid}", **ids)


def _check_kept_signals(out: _Out, *, iterations: bool) -> None:
    """D30: a kept signal that meets an open wait with roles or a schema it was not checked against (it
    came before the wait began, or while the gateway saw no open wait) is checked here: its sender's
    roles when it was sent (the signal records them) against the wait's, then its payload,
    ``signal_check_steps`` and without running a regular expression (signals.early_refusal), and the
    verdict recorded: ``signal.checked`` (the fold delivers an accepted signal, drops a refused one; the
    wait goes on waiting)."""
    from .signals import early_refusal, roles_refusal

    state = out.state
    for name, signal in list(state.kept.items()):
        wait = open_wait(state, name)
        if wait is None or wait.ended or (wait.iteration is not None) != iterations or wait.takes(signal):
            continue
        run = state.runs.get(wait.step_run_id)
        if run is None or run.ended:
            continue
        refusal = roles_refusal(name, wait.step, wait.spec, signal)
        if refusal is None and wait.spec.get("schema") is not None:
            refusal = early_refusal(name, wait.spec.get("schema"), signal.get("payload"),
                                    limits.current().signal_check_steps)
        data = {"signal": name, "wait_id": wait.id, "accepted": refusal is None}
        if refusal is not None:
            data.update(error=refusal.message, location=refusal.location)
        out.event("signal.checked", status="success" if refusal is None else "error", step=wait.step,
                  step_run_id=wait.step_run_id, iteration=wait.iteration, task=wait.task, data=data)


def _resume_waits(out: _Out, *, iterations: bool) -> None:
    """Resume every wait whose time, signal or timeout came (admission: step runs' waits; the
    loop-coordinator: loop iterations')."""
    state = out.state
    if state.halted:
        return
    _check_kept_signals(out, iterations=iterations)
    for wait in list(state.task_waits.values()):
        if wait.outcome is None or wait.ended or (wait.iteration is not None) != iterations:
            continue
        run = state.runs.get(wait.step_run_id)
        if run is None or run.ended:
            continue
        if iterations and (run.loop is None or wait.iteration not in run.loop.in_flight):
            continue
        out.event("wait.ended", status="success" if wait.outcome.get("status") == "ok" else "error",
                  step=wait.step, step_run_id=wait.step_run_id, iteration=wait.iteration, task=wait.task,
                  data={"wait_id": wait.id, "outcome": wait.outcome})
        _send_resume(out, run, wait.iteration, wait.continuation, wait.outcome, key=wait.id)


def _fail_admission(out: _Out, step: str, token_ids: list[str], args: dict, sdef: dict, error: dict) -> None:
    """An admit rule that cannot be evaluated fails the step run (D17): admitted (marked, so that no
    loop starts), started and failed at once; the router routes ``step.failed`` like any other."""
    state = out.state
    run_id = stable_id("run", state.execution_id, *sorted(token_ids))
    out.event("step.admitted", step=step, step_run_id=run_id,
              data={"run_id": run_id, "step": step, "tokens": token_ids, "args": args, "admit_error": error})
    out.event("step.started", step=step, step_run_id=run_id, status="in_progress")
    counts = {"total": 0, "done": 0, "failed": 0} if sdef.get("loop") else {}
    out.event("step.failed", status="error", step=step, step_run_id=run_id, data={"error": error, **counts})


def _admit(state: ExecutionState, sdef: dict, args: dict) -> tuple[bool, str]:
    """D17: first matching rule wins; no rules, or no match and no else, -> allow. A rule whose
    template fails raises TemplateError (the step run fails with it, it is not a denial)."""
    rules = (((sdef.get("spec") or {}).get("policy") or {}).get("admit") or {}).get("rules") or []
    if not rules:
        return True, ""
    context = {"workload": state.workload, "ctx": state.ctx, "args": args, "execution_id": state.execution_id,
               **_step_scope(state)}
    where = f"step={sdef['step']}.spec.policy.admit"
    with shared_budget():  # the rules of one admission share one template budget
        for i, rule in enumerate(rules):
            if "else" in rule:
                return _allow(rule["else"]["then"], context, f"{where}.rules[{i}].else"), f"rules[{i}] (else)"
            if truthy(rule["when"], context, f"{where}.rules[{i}].when"):
                return _allow(rule["then"], context, f"{where}.rules[{i}]"), f"rules[{i}]"
    return True, "no rule matched"


def _allow(then: dict, context: dict, where: str) -> bool:
    value = then.get("allow", True)
    return truthy(value, context, where) if isinstance(value, str) else bool(value)


# =============================================================== child executions
def depth_limit(state: ExecutionState) -> int:
    """How deep child executions may nest below the root: the smallest of the limit the parent chain
    passed down and this playbook's ``executor.spec.policy.limits.max_depth`` (default 10)."""
    limits = ((((state.playbook or {}).get("executor") or {}).get("spec") or {}).get("policy") or {}).get("limits")
    candidates = [v for v in (state.request.get("max_depth"), (limits or {}).get("max_depth"))
                  if isinstance(v, int) and not isinstance(v, bool)]
    return min(candidates) if candidates else DEFAULT_MAX_DEPTH


def _start_child(out: _Out, event: dict) -> None:
    """A run suspended at a ``playbook`` task: request the child execution (in the child's stream),
    or, when it would nest deeper than allowed, end the wait at once with a ``recursion_limit`` error."""
    state = out.state
    child = (event.get("data") or {}).get("child") or {}
    wait = state.waits.get(child.get("execution_id"))
    if wait is None or wait.finished is not None or state.halted:
        return
    depth = int(state.request.get("depth") or 0) + 1
    limit = depth_limit(state)
    if depth > limit:
        out.event("playbook.child.finished", status="error", step=wait.step, step_run_id=wait.step_run_id,
                  iteration=wait.iteration,
                  data={"child_execution_id": wait.child, "status": FAILED, "started": False, "result": None,
                        "error": {"kind": "recursion_limit", "retryable": False,
                                  "message": f"step {wait.step!r} task {wait.task!r}: calling playbook "
                                             f"{wait.path!r} would nest child executions {depth} deep; the limit "
                                             f"is {limit} (executor.spec.policy.limits.max_depth)"}})
        _resume(out, wait)
        return
    out.foreign("playbook.execution.requested", wait.child, f"request:{wait.child}", status="in_progress", data={
        "catalog": {"path": wait.path, "version": child.get("version")},
        "workload": child.get("workload") or {},
        "args": child.get("args") or {},
        "iter_parent": child.get("iter_parent"),  # D19
        "parent_execution_id": state.execution_id,
        "root_execution_id": state.request.get("root_execution_id") or state.execution_id,  # its tree's count
        "requested_by": requester(state),  # the root's requester: what its pools check (D33)
        "called_by": _kept(callers(state) + [state.author or {}]),  # and the authors above ({}: unknown)
        "parent": {"execution_id": state.execution_id, "step": wait.step, "step_run_id": wait.step_run_id,
                   "iteration": wait.iteration, "task": wait.task},
        "depth": depth,
        "max_depth": limit,
    })


def child_outcome(wait: Wait) -> dict[str, Any]:
    """The ``playbook`` task's outcome (D8) from how its child ended: the child's result (its status,
    ctx and step results) either way; an error of kind ``child_failed`` / ``child_cancelled`` (the
    child's own error under ``cause``) unless it completed."""
    d = wait.finished or {}
    status, cause = d.get("status"), d.get("error")
    if status == COMPLETED:
        return {"status": "ok", "result": d.get("result"), "error": None}
    if d.get("started") is False and isinstance(cause, dict):  # never started (recursion limit)
        return {"status": "error", "result": None, "error": cause}
    cause = cause if isinstance(cause, dict) else ({"message": str(cause)} if cause else {})
    message = cause.get("message") or cause.get("kind") or "no error reported"
    return {"status": "error", "result": d.get("result"), "error": {
        "kind": "child_cancelled" if status == CANCELLED else "child_failed",
        "message": f"child execution {wait.child} of playbook {wait.path!r} ended {status}: {message}",
        "retryable": bool(cause.get("retryable")), "child_execution_id": wait.child, "cause": cause or None}}


def _child_finished(out: _Out, event: dict, *, iterations: bool) -> None:
    """Resume the run that waited for this child (admission: step runs; the loop-coordinator: loop
    iterations, the only waits its fold records besides step runs')."""
    state = out.state
    wait = state.waits.get((event.get("data") or {}).get("child_execution_id"))
    if wait is not None and wait.finished is not None and not state.halted \
            and (wait.iteration is not None) == iterations:
        _resume(out, wait)


def _resume(out: _Out, wait: Wait) -> None:
    """The child ended: a command that resumes the suspended run with the child's outcome."""
    state = out.state
    run = state.runs.get(wait.step_run_id)
    if run is None or run.ended:
        return
    _send_resume(out, run, wait.iteration, wait.continuation, child_outcome(wait), key=wait.child)


def _send_resume(out: _Out, run: StepRun, iteration: int | None, continuation: dict, outcome: dict, key: str) -> None:
    """A command that resumes a suspended run with its task's outcome (a child's end, a wait's)."""
    state = out.state
    sdef = state.step_def(run.step)
    pool = step_spec(state, sdef).get("pool") or DEFAULT_POOL
    iterations = None if iteration is None else range(iteration, iteration + 1)
    command = build_command(state, run, pool=pool, iterations=iterations)
    command["command_id"] = stable_id("resume", key)  # not the suspended command's id (dedup window)
    command["resume"] = {"continuation": continuation, "outcome": outcome}
    out.command(command)


def _cancel_children(out: _Out, waits: list[Wait], reason: str) -> None:
    """Children whose parent run will not resume are cancelled (their own router ends them)."""
    for wait in waits:
        if wait.finished is None:
            out.foreign("execution.cancelled", wait.child, f"cancel:{wait.child}", data={"reason": reason})


def _child_result(state: ExecutionState) -> dict[str, Any]:
    """What a parent's ``playbook`` task gets as result: the child's status, final ctx and step results."""
    from .state import summary

    s = summary(state)
    return {"execution_id": s["execution_id"], "status": s["status"], "ctx": s["ctx"], "steps": s["steps"]}


# =============================================================== router
def router(state: ExecutionState, event: dict[str, Any]) -> Decision:
    out = _Out(state, event, "router")
    name = event["name"]
    if state.finished:
        return out.decision
    if len(state.runs) > limits.current().max_step_runs:  # an arc cycle would hold every fold's memory
        _finish(out, FAILED, error={"kind": "limit_exceeded", "retryable": False, "message": str(
            limits.LimitExceeded("max_step_runs", len(state.runs)))})
        return out.decision
    if name == "playbook.request.evaluated" and event["status"] == "error":  # a limit's refusal says so
        kind = "limit_exceeded" if (event.get("data") or {}).get("kind") == "limit_exceeded" else "invalid_playbook"
        _finish(out, FAILED, error={"kind": kind, "message": "; ".join(state.errors)})
        return out.decision
    if name == "execution.cancelled":
        stopped = engine_error(event)  # a service could not go on with it: FAILED, not CANCELLED (D18)
        if stopped is not None:
            _finish(out, FAILED, error=stopped)
        else:
            _finish(out, CANCELLED, error={"kind": "cancelled", "message": (event.get("data") or {}).get("reason") or "cancelled"})
        return out.decision
    if name in TERMINAL_STEP_EVENTS:
        run = state.runs.get(event["step_run_id"])
        if run is not None and run.ended and not run.routed and _terminal_of(run, event):
            _route(out, run, event)
    elif name == "timer.fired":
        _timer_fired(out, event)
    if state.status == "RUNNING" and state.halted and not state.cancel_requested:
        _finish(out, FAILED, error=(state.failure or {}).get("error"))
    elif state.status == "RUNNING" and name in ("next.evaluated", "step.skipped", "timer.fired", *TERMINAL_STEP_EVENTS) \
            and state.quiescent():  # only these end activity; between workflow.started and its token nothing does
        # D18: only an unhandled failure under fail_fast fails the execution (and that halts it at once,
        # above); a best_effort failure ended its branch, and the execution completes
        _finish(out, COMPLETED)
    return out.decision


def _terminal_of(run: StepRun, event: dict) -> bool:
    """Route only on the event that ended the run (not on a late duplicate of another kind)."""
    return (run.status == "done") == (event["name"] in ("step.done", "loop.done"))


def _route(out: _Out, run: StepRun, event: dict) -> None:
    """D13/D14: evaluate the arcs of the step in the arc context; fire tokens; D15 on failure."""
    state = out.state
    sdef = state.step_def(run.step)
    router_def = sdef.get("next") or {}
    mode = (router_def.get("spec") or {}).get("mode", "exclusive")
    data = event.get("data") or {}
    ev = {"name": EventName(event["name"]), "step": run.step, "result": data.get("result"),
          "error": data.get("error")}
    for key in ("total", "done", "failed"):
        if key in data:
            ev[key] = data[key]
    success = event["name"] in ("step.done", "loop.done")
    context = {"workload": state.workload, "ctx": state.ctx, "args": run.args, "execution_id": state.execution_id,
               "event": ev, **_step_scope(state)}
    fired: list[tuple[int, dict]] = []
    error = None
    with shared_budget():  # every arc of one routing decision shares one template budget
        for i, arc in enumerate(router_def.get("arcs") or []):
            where = f"step={run.step}.next.arcs[{i}]"
            try:
                if arc.get("when") is None:
                    matches = success  # D14: an arc without `when` matches only success events
                else:
                    matches = truthy(arc["when"], context, f"{where}.when")
                if matches:
                    fired.append((i, within_depth(render(arc.get("args") or {}, context, f"{where}.args"),
                                                  f"{where}.args")))
            except TemplateError as exc:
                error = {"kind": "template_error", "message": str(exc), "retryable": False}
                fired = []
                break
            if fired and mode == "exclusive":
                break
    unhandled = (not success or error is not None) and not fired
    fail_fast = unhandled and _failure_mode(state, sdef) == "fail_fast"
    default_delay = (router_def.get("spec") or {}).get("delay")
    for i, args in fired:
        arc = router_def["arcs"][i]
        place = state.graph.by_arc[(run.step, i)].id
        delay = (arc.get("spec") or {}).get("delay", default_delay)
        seconds = parse_duration(delay) if delay is not None else 0.0
        if seconds > 0:  # D29 (a): the token is enqueued when the delay has passed
            tid = stable_id("token", state.execution_id, out.cause["event_id"], f"{run.id}:{i}")
            out.timer("token", float(event.get("timestamp") or 0) + seconds,
                      {"token_id": tid, "step": arc["step"], "place": place, "args": args},
                      key=f"arc:{run.id}:{i}", step=arc["step"])
        else:
            _enqueue(out, arc["step"], place, args, cause_key=f"{run.id}:{i}")
    out.event("next.evaluated", step=run.step, step_run_id=run.id,
              data={"arcs": [i for i, _ in fired], "unhandled": unhandled, "fail_fast": fail_fast,
                    "error": error or (data.get("error") if unhandled else None)})


def _timer_fired(out: _Out, event: dict) -> None:
    """D29: a delayed arc's token is enqueued; a step run still going at its timeout fails with error
    kind ``timeout`` (its running tasks are cancelled) and is routed like any failure."""
    state = out.state
    timer = state.timers.get((event.get("data") or {}).get("timer_id"))
    if timer is None or state.halted:
        return
    if timer.kind == "token":
        d = timer.data
        out.event("token.enqueued", step=d.get("step"),
                  data={"token_id": d.get("token_id"), "step": d.get("step"), "place": d.get("place"),
                        "args": d.get("args") or {}})
    elif timer.kind == "step_timeout":
        run = state.runs.get(timer.data.get("run_id"))
        if run is None or run.ended:
            return
        _cancel_children(out, [w for w in state.waits.values() if w.step_run_id == run.id],
                         f"step {run.step!r} timed out")
        counts = {}
        if run.loop is not None or state.step_def(run.step).get("loop"):
            loop = run.loop
            counts = {"total": loop.total if loop else 0, "done": loop.done if loop else 0,
                      "failed": loop.failed if loop else 0}
        failed = out.event("step.failed", status="error", step=run.step, step_run_id=run.id, data={
            "result": None, **counts,
            "error": {"kind": "timeout", "retryable": False,
                      "message": f"step {run.step!r} ran longer than its timeout_s ({timer.data.get('seconds'):g} s)"}})
        out.decision.cancel_runs.append(run.id)
        _route(out, run, failed)


def _failure_mode(state: ExecutionState, sdef: dict) -> str:
    return ((step_spec(state, sdef).get("policy") or {}).get("failure") or {}).get("mode", "fail_fast")


def _finish(out: _Out, status: str, error: Any = None) -> None:
    state = out.state
    cancelled = [r.id for r in state.runs.values() if r.active and not r.ended]
    _cancel_children(out, [w for w in state.waits.values() if w.iteration is None],
                     f"parent execution {state.execution_id} ended {status}")
    out.event("workflow.finished", status="success" if status == COMPLETED else "error",
              data={"status": status, "cancelled_runs": cancelled, "error": error})
    out.event("playbook.processed", status="success" if status == COMPLETED else "error",
              data={"status": status})
    parent = state.request.get("parent")
    if isinstance(parent, dict) and parent.get("execution_id"):  # a child execution tells its parent
        out.foreign("playbook.child.finished", parent["execution_id"], f"finished:{state.execution_id}",
                    status="success" if status == COMPLETED else "error", step=parent.get("step"),
                    step_run_id=parent.get("step_run_id"), iteration=parent.get("iteration"),
                    data={"child_execution_id": state.execution_id, "status": status, "error": error,
                          # the engine could not go on with it: its values may be what could not be sent
                          "result": None if isinstance(error, dict) and error.get("kind") == ENGINE_ERROR
                          else _child_result(state)})


class EventName(str):
    """D13: ``call.done``/``call.error`` compare equal to ``step.done``/``step.failed`` in `when`."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str.__eq__(self, ALIASES.get(other, other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__


# =============================================================== loops
def flat(state: ExecutionState) -> bool:
    """A flat execution: its playbook is evaluated and has no loop step. The loop-coordinator decides
    only on loop steps (their runs, iterations, waits, timeouts and children), so a flat execution
    needs nothing more from it, and its writers send its ``ctl`` messages as ``flat`` (events.batch_class),
    which the loop-coordinator does not read; a command says so to the worker that runs it."""
    return state.playbook is not None and not any(s.get("loop") for s in state.playbook.get("workflow") or ())


def loops(state: ExecutionState, event: dict[str, Any]) -> Decision:
    out = _Out(state, event, "loop-coordinator")
    if state.halted:
        if event["name"] == "workflow.finished":  # the router cancels step runs' children, this iterations'
            _cancel_children(out, [w for w in state.waits.values() if w.iteration is not None],
                             f"parent execution {state.execution_id} ended {state.status}")
        return out.decision
    name = event["name"]
    if name == "playbook.child.finished":
        _child_finished(out, event, iterations=True)
        return out.decision
    if name == "task.suspended":
        if event.get("iteration") is not None:
            _suspended(out, event)  # a child is recorded only while the iteration is in flight (state._suspended)
        if state.task_waits:
            _resume_waits(out, iterations=True)
        return out.decision
    if name in WAKES:
        if state.task_waits:
            _resume_waits(out, iterations=True)
        return out.decision
    run = state.runs.get(event.get("step_run_id") or "")
    if run is None or run.ended:
        return out.decision
    sdef = state.step_def(run.step)
    if not sdef.get("loop") or not sdef.get("tool"):
        return out.decision
    if name == "step.admitted" and run.loop is None and not (event.get("data") or {}).get("admit_error"):
        _start_loop(out, run, sdef)
    elif name in ("loop.iteration.done", "loop.iteration.failed") and run.loop is not None:
        _continue_loop(out, run, sdef)
    return out.decision


def _start_loop(out: _Out, run: StepRun, sdef: dict) -> None:
    state = out.state
    loop = sdef["loop"]
    lspec = loop.get("spec") or {}
    mode = lspec.get("mode") or (lspec.get("policy") or {}).get("mode") or "sequential"
    context = {"workload": state.workload, "ctx": state.ctx, "args": run.args, "execution_id": state.execution_id,
               **_step_scope(state)}
    out.event("step.started", step=run.step, step_run_id=run.id, status="in_progress")
    _step_timeout(out, run, sdef)
    try:
        items = render(loop["in"], context, f"step={run.step}.loop.in")  # D19: rendered once, at admission
        if isinstance(items, dict):
            items = [{"key": k, "value": v} for k, v in items.items()]
        if not isinstance(items, (list, tuple)):
            raise TemplateError(str(loop["in"]), f"step={run.step}.loop.in",
                                f"loop.in must render to a list, got {type(items).__name__}")
        if len(items) > limits.current().max_loop_items:
            raise limits.LimitExceeded("max_loop_items", len(items), f"step={run.step}.loop.in")
    except (TemplateError, limits.LimitExceeded) as exc:
        kind = "limit_exceeded" if isinstance(exc, limits.LimitExceeded) else "template_error"
        out.event("step.failed", status="error", step=run.step, step_run_id=run.id,
                  data={"error": {"kind": kind, "message": str(exc), "retryable": False},
                        "total": 0, "done": 0, "failed": 0})
        return
    max_in_flight = int(lspec.get("max_in_flight", 16)) if mode == "parallel" else 1
    out.event("loop.started", step=run.step, step_run_id=run.id, status="in_progress",
              data={"items": list(items), "total": len(items), "mode": mode, "max_in_flight": max_in_flight,
                    "iterator": loop["iterator"]})  # total: readable without the items (a D23 reference)
    if not items:  # D19: an empty collection ends at once
        out.event("loop.done", step=run.step, step_run_id=run.id,
                  data={"result": [], "total": 0, "done": 0, "failed": 0})
        return
    _dispatch(out, run, sdef)


MAX_CHUNK = 32  # iterations in one command


def chunk_size(loop) -> int:
    """Iterations per command: a parallel loop ships them in chunks (one command, one report per
    chunk) so a large loop does not pay a message round per iteration; ``max_in_flight`` still counts
    iterations. A sequential loop runs one at a time (D19)."""
    return 1 if loop.mode != "parallel" else max(1, min(MAX_CHUNK, loop.max_in_flight // 8))


def _dispatch(out: _Out, run: StepRun, sdef: dict) -> None:
    state = out.state
    loop = run.loop
    pool = step_spec(state, sdef).get("pool") or DEFAULT_POOL
    size = chunk_size(loop)
    while loop.next_index < loop.total:
        free = loop.max_in_flight - len(loop.in_flight)
        k = min(size, free, loop.total - loop.next_index)
        if k <= 0 or (k < size and len(loop.in_flight) and k < loop.total - loop.next_index):
            break  # wait for room for a whole chunk (unless it is the last one)
        first = loop.next_index
        for i in range(first, first + k):
            out.event("loop.iteration.started", step=run.step, step_run_id=run.id, iteration=i,
                      status="in_progress", data={"index": i})
        out.command(build_command(state, run, pool=pool, iterations=range(first, first + k)))


def _continue_loop(out: _Out, run: StepRun, sdef: dict) -> None:
    state = out.state
    loop = run.loop
    counts = {"total": loop.total, "done": loop.done, "failed": loop.failed}
    if loop.failed and _failure_mode(state, sdef) == "fail_fast":
        # D15: stop dispatching at the first failed iteration and end the step failed
        first = min(loop.errors)
        cause = loop.errors[first] or {}
        _cancel_children(out, [w for w in state.waits.values() if w.step_run_id == run.id],
                         f"loop step {run.step!r} failed (iteration {first})")
        out.event("step.failed", status="error", step=run.step, step_run_id=run.id,
                  data={"error": {"kind": "iteration_failed", "retryable": False, "iteration": first,
                                  "message": f"iteration {first} failed: {cause.get('message', '')}".rstrip(": ")},
                        "result": _ordered(loop), **counts})
        return
    if loop.finished == loop.total:
        out.event("loop.done", step=run.step, step_run_id=run.id, data={"result": _ordered(loop), **counts})
        return
    _dispatch(out, run, sdef)


def _ordered(loop) -> list[Any]:
    return [loop.results.get(i) for i in range(loop.total)]  # D11: by iter.index, null when failed


# =============================================================== commands
def lost_command(command: dict[str, Any], deliveries: int, *, error: dict[str, Any] | None = None,
                 source: str = "admission") -> list[dict[str, Any]]:
    """The events that end the work of a command no worker could finish (delivered ``deliveries``
    times, each time without an acknowledgement: its workers died or hung). Each step run or loop
    iteration it carried fails with ``worker_lost``, retryable (or with ``error``: a worker that cannot
    even read the command), and the router handles that failure like any other (D15). Ids derive from
    the command, so a repeated advisory changes nothing (D21)."""
    error = error or {"kind": "worker_lost", "retryable": True,
                      "message": f"command {command['command_id']} was delivered {deliveries} times and never "
                                 "finished (its workers died or hung)"}
    common = {"source": source, "status": "error", "step": command["step"],
              "step_run_id": command["step_run_id"]}
    entries = _entries(command)
    out = []
    for entry in entries:
        i = entry.get("iteration")
        name = "step.failed" if i is None else "loop.iteration.failed"
        out.append(make_event(name, command["execution_id"], event_id=stable_id(entry["command_id"], name, "lost"),
                              iteration=i, data={"error": error, "result": None}, **common))
    return out


def _entries(command: dict[str, Any]) -> list[dict[str, Any]]:
    """The step run or iterations a command carries: its chunk, else (a chunk sent by reference that
    cannot be read any more: ``chunk`` is not a list) its ``iterations`` range, else its one run."""
    chunk = command.get("chunk")
    if isinstance(chunk, list) and chunk:
        return chunk
    span = command.get("iterations")
    if isinstance(span, list) and len(span) == 2 and all(isinstance(i, int) for i in span) \
            and 0 <= span[0] < span[1] <= span[0] + MAX_CHUNK:
        return [{"iteration": i, "command_id": stable_id("cmd", command["step_run_id"], i)} for i in range(*span)]
    return [{"iteration": command.get("iteration"), "command_id": command["command_id"]}]


def step_spec(state: ExecutionState, sdef: dict) -> dict:
    """The step's effective spec without the task level (D5, D9)."""
    executor = (state.playbook.get("executor") or {}).get("spec")
    loop = (sdef.get("loop") or {}).get("spec")
    return deep_merge(executor, sdef.get("spec"), loop)


def _step_scope(state: ExecutionState) -> dict[str, Any]:
    """D6: each finished earlier step is readable by its name."""
    return state.step_results()


def build_command(state: ExecutionState, run: StepRun, *, pool: str, iterations: range | None = None) -> dict:
    """A step run's command; for loop iterations, ``chunk`` lists each one's index, scope and id."""
    sdef = state.step_def(run.step)
    loop = sdef.get("loop")
    chunk = None
    loop_mode = None
    if iterations is not None:
        parent = state.request.get("iter_parent")
        chunk = [{"iteration": i, "command_id": stable_id("cmd", run.id, i),
                  "iter": {loop["iterator"]: run.loop.items[i], "index": i, "parent": parent}}
                 for i in iterations]
        loop_mode = run.loop.mode
    single = chunk[0] if chunk and len(chunk) == 1 else None
    return {
        "command_id": single["command_id"] if single else stable_id("cmd", run.id, *(iterations or [None])),
        "pool": pool,
        "execution_id": state.execution_id,
        "step": run.step,
        "step_run_id": run.id,
        "iteration": single["iteration"] if single else None,
        "chunk": chunk if chunk and not single else None,
        # a chunk's iterations [first, end): what its failure names when the chunk, sent by reference, is gone
        "iterations": [iterations.start, iterations.stop] if chunk and not single else None,
        "tasks": sdef.get("tool") or [],
        "workbook": state.playbook.get("workbook") or [],  # root workbook tasks, for `kind: workbook`
        "spec_layers": {"executor": (state.playbook.get("executor") or {}).get("spec"),
                        "step": sdef.get("spec"), "loop": (loop or {}).get("spec")},
        "workload": state.workload,
        "ctx": dict(state.ctx),
        "args": run.args,
        "iter": single["iter"] if single else None,
        "steps": _step_scope(state),
        "keychain": [dict(d) for d in state.keychain if isinstance(d, dict)]
        if isinstance(state.keychain, list) else [],  # declarations (D24): the worker resolves them
        "loop_mode": loop_mode,
        "flat": flat(state),
        "requested_by": requester(state),
        "authored_by": state.author,
        "called_by": callers(state),
    }


def requester(state: ExecutionState) -> dict[str, Any] | None:
    """Who started the execution (a child: who started its root): ids, name, and the roles the request
    carried; the worker checks that user's standing now, and a pool that names the roles it serves
    checks them (D33)."""
    return _who(state.request.get("requested_by"))


MAX_CALLERS = 32  # authors kept above a child, the nearest (a playbook may set max_depth higher)


def _kept(authors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most :data:`MAX_CALLERS` authors: past that, the nearest, behind one author not known
    (``{}``), so that a pool or a credential that names roles refuses a deeper tree rather than forget
    who wrote its top."""
    return authors if len(authors) <= MAX_CALLERS else [{}, *authors[-(MAX_CALLERS - 1):]]


def callers(state: ExecutionState) -> list[dict[str, Any]]:
    """D33: who wrote the playbooks above this child execution, root first (each parent's author): a
    pool checks them as it checks the child's own author, so that a playbook cannot have another's
    playbook called, with arguments of its choosing, under a starter and author its pool would refuse
    it."""
    got = state.request.get("called_by")  # an author not known ({}) stays: a pool with roles refuses it
    return _kept([_who(w) or {} for w in got[-(MAX_CALLERS + 1):]]) if isinstance(got, list) else []


def _author(state: ExecutionState, fetched: Any) -> dict[str, Any] | None:
    """D33: who wrote the playbook a request runs: the registrant of the catalog version the shell
    fetched (``fetched``); the one the request names when the gateway resolved the catalog or a restart
    runs an earlier execution's playbook (``authored_by``, null when unknown); else, for a playbook sent
    inline, its requester."""
    if state.request.get("playbook") is None:
        return _who(fetched)
    if "authored_by" in state.request:
        return _who(state.request.get("authored_by"))
    return requester(state)


def _who(who: Any) -> dict[str, Any] | None:
    if not isinstance(who, dict) or not isinstance(who.get("user_id"), str):
        return None
    out: dict[str, Any] = {k: who[k] for k in ("user_id", "username") if isinstance(who.get(k), str)}
    roles = carried_roles(who.get("roles"))
    if roles is not None:
        out["roles"] = roles
    return out


__all__ = ["Decision", "Written", "admission", "router", "loops", "build_command", "lost_command", "step_spec", "graph_of",
           "EventName", "child_outcome", "depth_limit", "DEFAULT_MAX_DEPTH"]
