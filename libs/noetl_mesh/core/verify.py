"""Checks of one execution's event log: what must hold however the services, workers and NATS were
killed or restarted while it ran (``noetl verify``). Pure: a list of events in log order in, findings
out.

What is checked (each finding names its check):

- ``finished``: the execution ended (exactly one ``workflow.finished``), with a final status;
- ``replay``: folding the log (D22) gives the status that ``workflow.finished`` recorded;
- ``ids``: no event id twice (D21: a redelivery is stored once);
- ``runs``: every step run was admitted once and ended exactly once (``step.done``, ``step.failed`` or
  ``loop.done``) — at most once if the end of the execution cancelled it;
- ``tokens``: no token consumed twice, and none left pending by a ``COMPLETED`` execution;
- ``loops``: a loop started once, every iteration was dispatched at most once and ended at most once,
  and a ``loop.done`` accounts for every iteration (done + failed = total, one end per index, the
  result has one entry per item);
- ``tasks``: a task attempt was reported processed at most once;
- ``after_finish``: no command started running after the execution had finished (its queued work is
  dropped; a run already in flight may still report).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from .events import TERMINAL_STEP_EVENTS, engine_error
from .state import FINAL, fold


@dataclass
class Finding:
    check: str
    message: str
    step: str | None = None
    step_run_id: str | None = None
    iteration: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class Report:
    execution_id: str
    status: str | None
    events: int
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def as_dict(self) -> dict[str, Any]:
        return {"execution_id": self.execution_id, "status": self.status, "events": self.events, "ok": self.ok,
                "findings": [f.as_dict() for f in self.findings]}


def verify(events: Iterable[dict[str, Any]], execution_id: str | None = None) -> Report:
    """Check one execution's events (in log order; the execution's own events only)."""
    log = [e for e in events if execution_id is None or e.get("execution_id") == execution_id]
    xid = execution_id or (log[0]["execution_id"] if log else "")
    finished = [e for e in log if e["name"] == "workflow.finished"]
    status = (finished[0].get("data") or {}).get("status") if finished else None
    report = Report(xid, status, len(log))
    add = report.findings.append

    # finished, replay
    if not finished:
        add(Finding("finished", "the execution has not finished (no workflow.finished)"))
    elif len(finished) > 1:
        add(Finding("finished", f"workflow.finished recorded {len(finished)} times"))
    if finished and status not in FINAL:
        add(Finding("finished", f"workflow.finished has status {status!r}, not one of {', '.join(FINAL)}"))
    if finished:
        expected, why = _expected_status(log)
        if expected != status:
            add(Finding("replay", f"the log before workflow.finished implies {expected} ({why}), "
                                  f"but workflow.finished says {status!r}"))

    # ids
    for eid, n in Counter(e["event_id"] for e in log).items():
        if n > 1:
            add(Finding("ids", f"event id {eid} recorded {n} times"))

    end = next((i for i, e in enumerate(log) if e["name"] == "workflow.finished"), len(log))
    cancelled = set((finished[0].get("data") or {}).get("cancelled_runs") or ()) if finished else set()
    _runs(log, cancelled, add)
    _tokens(log, status, add)
    _loops(log, cancelled, add)
    _tasks(log, add)
    _after_finish(log, end, add)
    return report


def _expected_status(log: list[dict]) -> tuple[str, str]:
    """D18 from the events before the finish: the first cancellation, unhandled fail_fast failure or
    refused request decides; otherwise the execution completed, and then nothing may still be active."""
    before: list[dict] = []
    for e in log:
        if e["name"] == "workflow.finished":
            break
        before.append(e)
        if e["name"] == "execution.cancelled":
            if engine_error(e) is not None:
                return "FAILED", "the engine could not go on with it"
            return "CANCELLED", "a cancellation"
        if e["name"] == "playbook.request.evaluated" and e.get("status") == "error":
            return "FAILED", "the request was refused"
        if e["name"] == "next.evaluated" and (e.get("data") or {}).get("fail_fast"):
            return "FAILED", f"an unhandled failure of step {e.get('step')!r} under fail_fast"
    state = fold(before)
    if not state.quiescent():
        return "RUNNING", "tokens pending or step runs active"
    return "COMPLETED", "no failure under fail_fast, nothing pending"


def _runs(log: list[dict], cancelled: set[str], add) -> None:
    admitted = Counter(e["step_run_id"] for e in log if e["name"] == "step.admitted")
    ends: dict[str, list[dict]] = defaultdict(list)
    step_of = {e["step_run_id"]: e.get("step") for e in log if e["name"] == "step.admitted"}
    for e in log:
        if e["name"] in TERMINAL_STEP_EVENTS and e.get("step_run_id"):
            ends[e["step_run_id"]].append(e)
    for run, n in admitted.items():
        if n > 1:
            add(Finding("runs", f"step run admitted {n} times", step_of.get(run), run))
        got = [e["name"] for e in ends.get(run, [])]
        if len(got) > 1:
            add(Finding("runs", f"step run ended {len(got)} times ({', '.join(got)})", step_of.get(run), run))
        elif not got and run not in cancelled and any(e["name"] == "workflow.finished" for e in log):
            add(Finding("runs", "step run never ended and was not cancelled", step_of.get(run), run))
    for run, evs in ends.items():
        if run not in admitted:
            add(Finding("runs", f"{evs[0]['name']} of a step run that was never admitted", evs[0].get("step"), run))


def _tokens(log: list[dict], status: str | None, add) -> None:
    enqueued = {(e.get("data") or {}).get("token_id"): e.get("step") for e in log if e["name"] == "token.enqueued"}
    consumed: Counter = Counter()
    for e in log:
        if e["name"] in ("step.admitted", "step.skipped"):
            consumed.update((e.get("data") or {}).get("tokens") or ())
    for token, n in consumed.items():
        if n > 1:
            add(Finding("tokens", f"token {token} consumed {n} times", enqueued.get(token)))
    if status == "COMPLETED":
        for token, step in enqueued.items():
            if token not in consumed:
                add(Finding("tokens", f"token {token} for step {step!r} still pending after completion", step))


def _loops(log: list[dict], cancelled: set[str], add) -> None:
    started: dict[str, list[dict]] = defaultdict(list)
    dispatched: dict[str, Counter] = defaultdict(Counter)
    ended: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    done: dict[str, list[dict]] = defaultdict(list)
    for e in log:
        run = e.get("step_run_id")
        name = e["name"]
        if name == "loop.started":
            started[run].append(e)
        elif name == "loop.iteration.started":
            dispatched[run][e.get("iteration")] += 1
        elif name in ("loop.iteration.done", "loop.iteration.failed"):
            ended[run][e.get("iteration")].append(name)
        elif name == "loop.done":
            done[run].append(e)
    for run, evs in started.items():
        step = evs[0].get("step")
        if len(evs) > 1:
            add(Finding("loops", f"loop started {len(evs)} times", step, run))
        items = (evs[0].get("data") or {}).get("items") or []
        for i, n in dispatched[run].items():
            if n > 1:
                add(Finding("loops", f"iteration dispatched {n} times", step, run, i))
        for i, names in ended[run].items():
            if len(names) > 1:
                add(Finding("loops", f"iteration ended {len(names)} times ({', '.join(names)})", step, run, i))
            if not isinstance(i, int) or not 0 <= i < len(items):
                add(Finding("loops", f"iteration {i} is not an index of the {len(items)} items", step, run, i))
        if not done[run]:
            continue
        d = done[run][0].get("data") or {}
        missing = [i for i in range(len(items)) if not ended[run].get(i)]
        if missing:
            add(Finding("loops", f"loop.done but {len(missing)} iteration(s) never ended (first: {missing[0]})",
                        step, run, missing[0]))
        n_done = sum(1 for names in ended[run].values() if names and names[0] == "loop.iteration.done")
        n_failed = sum(1 for names in ended[run].values() if names and names[0] == "loop.iteration.failed")
        if (d.get("total"), d.get("done"), d.get("failed")) != (len(items), n_done, n_failed):
            add(Finding("loops", f"loop.done counts total={d.get('total')} done={d.get('done')} "
                                 f"failed={d.get('failed')}, the log has {len(items)} items, {n_done} done and "
                                 f"{n_failed} failed iterations", step, run))
        result = d.get("result")
        if isinstance(result, list) and len(result) != len(items):
            add(Finding("loops", f"loop result has {len(result)} entries for {len(items)} items", step, run))


def _tasks(log: list[dict], add) -> None:
    processed = Counter((e.get("action_id"), e.get("attempt")) for e in log
                        if e["name"] == "task.processed" and e.get("action_id"))
    step_of = {(e.get("action_id"), e.get("attempt")): (e.get("step"), e.get("task"), e.get("iteration"))
               for e in log if e["name"] == "task.processed"}
    for key, n in processed.items():
        if n > 1:
            step, task, iteration = step_of[key]
            add(Finding("tasks", f"task {task!r} attempt {key[1]} processed {n} times", step, None, iteration))


def _after_finish(log: list[dict], end: int, add) -> None:
    """A command's first report is a worker event of its (run, iteration) that no earlier event of
    the same pair precedes; after the finish, none may come."""
    seen: set[tuple[str, Any]] = set()
    for i, e in enumerate(log):
        if not str(e.get("source") or "").startswith("worker") or not e.get("step_run_id"):
            continue
        key = (e["step_run_id"], e.get("iteration"))
        if key in seen:
            continue
        seen.add(key)
        if i > end and e["name"] in ("step.started", "task.started", "loop.iteration.done", "loop.iteration.failed",
                                     "step.done", "step.failed"):
            add(Finding("after_finish", f"a command started running after the execution finished ({e['name']})",
                        e.get("step"), e["step_run_id"], e.get("iteration")))
