"""Restart from a step (D32): a new execution that goes on from one step of a finished one.

Pure, like the fold it builds on. :func:`seed` reads the old execution's events (in log order) up to
the first ``step.started`` of ``from_step`` and answers what the new execution starts with: the
playbook that ran, the workload, and the *seed* — the state folded up to there (``state.apply``),
reduced to what a new execution can hold:

- ``ctx`` as it stood;
- ``runs``: each step's last run that had ended *and* been routed, with its status, args, result
  and error (a big result stays the D23 reference the log holds: it is never read here);
- ``skipped``: how often admission had skipped each step;
- ``tokens``: the tokens that were waiting (on any place: a join's partial marking), plus the tokens
  of every run that had not been routed yet — ``from_step``'s own run first of all, and any run of
  another branch still in flight — so that those runs happen again, with the same args; in the order
  they had arrived;
- ``delayed``: tokens an arc had delayed (D29) that had not arrived, with their due time.

:func:`request` makes the data of the new execution's ``playbook.execution.requested`` from it (the
gateway publishes it); admission checks the seed against the playbook (:func:`check`), the fold
installs it when the request is evaluated (``state._evaluated``), and admission enqueues its tokens
(new ids) and sets the timers of its delayed ones: the new execution's own log holds everything its
state is made of (D22).
"""
from __future__ import annotations

from typing import Any, Iterable

from .. import limits
from ..lang.diagnostics import did_you_mean
from ..lang.normalize import deep_merge
from .state import ENTRY_PLACE, FINAL, ExecutionState, apply, graph_of

# Why a restart is refused (the gateway: 409 for not_finished, 422 for the others).
NOT_FINISHED, NO_PLAYBOOK, UNKNOWN_STEP, NEVER_STARTED = "not_finished", "no_playbook", "unknown_step", "never_started"
_UNFOLDABLE = (KeyError, TypeError, ValueError, AttributeError)  # a malformed event folds to nothing (as the recorder's)


class Refused(ValueError):
    """A restart that cannot be made, and why (``kind``: one of the constants above)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


def seed(events: Iterable[dict[str, Any]], from_step: str, *, status: str | None = None,
         execution_id: str | None = None, max_events: int | None = None) -> dict[str, Any]:
    """What a restart of the execution from ``from_step`` starts with (module docstring). ``events``:
    the execution's events in log order — all of them, or those a state folds (``ctl``) up to and
    including the cut; ``status``: the execution's status (from its projection; the events up to the
    cut cannot tell: an execution not finished is refused before anything is folded). At most
    ``max_events`` (``max_state_events``) are folded. Raises :class:`Refused` or
    :class:`~noetl_mesh.limits.LimitExceeded`."""
    if status is not None:
        finished(execution_id, status)
    bound = limits.current().max_state_events if max_events is None else max_events
    state: ExecutionState | None = None
    arrived: dict[str, dict[str, Any]] = {}  # every token enqueued so far, in arrival order, by id
    consumed: dict[str, list[str]] = {}  # step run -> the tokens it consumed
    catalog: dict[str, Any] | None = None
    cut: dict[str, Any] | None = None
    folded = 0
    for event in events:
        if state is None:
            state = ExecutionState(execution_id or event["execution_id"])
        name = event.get("name")
        if event.get("step") == from_step and (name == "step.started" or (name == "step.failed" and _unstarted(state, event))):
            cut = event  # its first run's start; or its end, if it failed unstarted (a worker refused it)
            break
        folded += 1
        if folded > bound:
            raise limits.LimitExceeded("max_state_events", None, f"execution {state.execution_id}",
                                       what="the events folded for a restart")
        try:
            if not apply(state, event):
                continue
        except _UNFOLDABLE:
            continue
        data = event.get("data") if isinstance(event.get("data"), dict) else {}
        if name == "token.enqueued" and isinstance(data.get("token_id"), str):
            arrived[data["token_id"]] = {"step": data.get("step"), "place": data.get("place", ENTRY_PLACE),
                                         "args": data.get("args") or {}}
        elif name == "step.admitted" and isinstance(data.get("run_id"), str):
            consumed[data["run_id"]] = [t for t in data.get("tokens") or () if isinstance(t, str)]
        elif name == "playbook.request.evaluated" and event.get("status") != "error":
            catalog = {"path": data.get("path"), "version": data.get("version")}
    xid = execution_id or (state.execution_id if state else "")
    if state is None or not isinstance(state.playbook, dict):
        raise Refused(NO_PLAYBOOK, f"execution {xid} never ran a playbook (its request was refused): there is no "
                                   "step to restart from")
    steps = [s.get("step") for s in state.playbook.get("workflow") or () if isinstance(s, dict)]
    if from_step not in steps:
        raise Refused(UNKNOWN_STEP, f"execution {xid}'s playbook has no step {from_step!r}"
                                    f"{did_you_mean(from_step, steps)}; its steps: {', '.join(map(str, steps))}")
    run = state.runs.get(cut.get("step_run_id") or "") if cut is not None else None
    if run is None:
        raise Refused(NEVER_STARTED, _never_started(state, from_step))
    return {
        "execution_id": state.execution_id, "step": from_step, "upto_event": cut["event_id"],
        "playbook": state.playbook, "catalog": catalog, "workload": state.workload,
        "iter_parent": state.request.get("iter_parent"),
        "authored_by": state.author,  # D33: the restart runs the same playbook, written by the same author
        "called_by": _called_by(state),  # and, for a child, below the same authors (D24, D33)
        "state": _reduced(state, run.id, arrived, consumed),
    }


def _called_by(state: ExecutionState) -> list[Any]:
    """Who wrote the playbooks above a child execution, as its request carried them (admission reads
    them again as it reads any request's: decide.callers)."""
    got = state.request.get("called_by")
    return list(got) if isinstance(got, list) else []


def finished(execution_id: str | None, status: str | None) -> None:
    """Refuse (:class:`Refused`, ``not_finished``) an execution that has not finished: only a finished
    one is restarted, so that the old one is never changed and never runs next to its restart."""
    if status not in FINAL:
        which = f"execution {execution_id}" if execution_id else "the execution"
        raise Refused(NOT_FINISHED, f"{which} is {status}: only a finished execution (COMPLETED, FAILED or "
                                    "CANCELLED) can be restarted; wait for it, or cancel it first")


def _unstarted(state: ExecutionState, event: dict[str, Any]) -> bool:
    """Whether ``event`` ends a run that never started: a worker refused its command (D33), could not
    read it (D23), or none finished it."""
    run = state.runs.get(event.get("step_run_id") or "")
    return run is not None and not run.started


def _never_started(state: ExecutionState, step: str) -> str:
    why = f"step {step!r} never started in execution {state.execution_id}"
    restored = state.last_run(step)
    if restored is not None and restored.restored:
        restart = state.request.get("restarted_from") or {}
        return (f"{why}: its result was carried over from execution {restart.get('execution')}, restart that "
                "one from it")
    if state.skipped.get(step):
        return f"{why}: admission skipped it (D17); restart from a step before it"
    return f"{why}: no token reached it; restart from a step that started"


def _reduced(state: ExecutionState, cut_run: str, arrived: dict[str, dict[str, Any]],
             consumed: dict[str, list[str]]) -> dict[str, Any]:
    """The seed: the state at the cut, without ``cut_run`` and without any run that had not been
    routed (its tokens put back instead), each step's last finished run only."""
    runs: list[dict[str, Any]] = []
    back: set[str] = set()  # tokens of runs that happen again
    for step, ids in state.runs_of.items():
        last = None
        for rid in ids:
            run = state.runs[rid]
            if rid != cut_run and run.ended and run.routed and run.status in ("done", "failed"):
                last = run
            else:  # in flight, not routed yet, or cancelled by the end: it happens again
                back.update(consumed.get(rid) or ())
        if last is not None:
            runs.append({"run_id": last.id, "step": step, "status": last.status, "args": last.args,
                         "result": last.result, "error": last.error})
    waiting = set(state.tokens) | back
    tokens = [{"token_id": tid, **t} for tid, t in arrived.items() if tid in waiting]
    delayed = [{"token_id": t.data.get("token_id"), "step": t.data.get("step"), "place": t.data.get("place"),
                "args": t.data.get("args") or {}, "due": t.due} for t in state.delayed_tokens()]
    return {"ctx": dict(state.ctx), "runs": runs, "skipped": dict(state.skipped), "tokens": tokens,
            "delayed": delayed}


def request(seed: dict[str, Any], *, workload: dict[str, Any] | None = None,
            requested_by: dict[str, Any] | None = None) -> dict[str, Any]:
    """The data of the new execution's ``playbook.execution.requested``: the same playbook (the
    document that ran, not a newer catalog version), the old workload with ``workload`` merged over it
    (D26's rule: maps key by key, any other value replaces), ``restarted_from`` and the seed. The new
    execution is a root: a restarted child does not report to the parent that called it."""
    out = {
        "playbook": seed["playbook"], "catalog": seed.get("catalog"),
        "workload": deep_merge(seed.get("workload") or {}, workload) if workload else seed.get("workload") or {},
        "restarted_from": {"execution": seed["execution_id"], "step": seed["step"], "upto_event": seed["upto_event"]},
        "seed": seed["state"],
        "authored_by": seed.get("authored_by"),  # not whoever restarts it (D33)
    }
    if seed.get("called_by"):  # a restarted child is a root, still checked against the authors above it
        out["called_by"] = seed["called_by"]
    if requested_by is not None:
        out["requested_by"] = requested_by
    if seed.get("iter_parent") is not None:
        out["iter_parent"] = seed["iter_parent"]
    return out


def check(seed: Any, doc: dict[str, Any], digest: str | None = None) -> list[str]:
    """Admission's check of a request's seed against the playbook it names: every value of the shape
    :func:`seed` makes, every step one of the playbook's, every place an arc into its step (or the
    entry). The errors, empty when it may be folded."""
    if not isinstance(seed, dict):
        return ["the restart's seed is not a mapping"]
    graph = graph_of(doc, digest)
    steps = set(graph.order)
    places = {p.id: p.target for p in graph.places}
    errors: list[str] = []
    if not isinstance(seed.get("ctx", {}), dict):
        errors.append("seed.ctx is not a mapping")
    skipped = seed.get("skipped", {})
    if not isinstance(skipped, dict) or any(s not in steps or not _count(n) for s, n in skipped.items()):
        errors.append("seed.skipped is not a count per step of the playbook")
    for where in ("runs", "tokens", "delayed"):
        items = seed.get(where, [])
        if not isinstance(items, list):
            errors.append(f"seed.{where} is not a list")
            continue
        for i, item in enumerate(items):
            problem = _item_problem(where, item, steps, places)
            if problem:
                errors.append(f"seed.{where}[{i}]: {problem}")
                break
    if not errors and not seed.get("tokens") and not seed.get("delayed"):
        errors.append("the seed has no token: nothing would run")
    return errors


def _item_problem(where: str, item: Any, steps: set[str], places: dict[str, str]) -> str | None:
    if not isinstance(item, dict):
        return "not a mapping"
    if item.get("step") not in steps:
        return f"{item.get('step')!r} is not a step of the playbook"
    if where == "runs":
        if not isinstance(item.get("run_id"), str) or item.get("status") not in ("done", "failed"):
            return "a run needs a run_id and a status (done or failed)"
        if not isinstance(item.get("args", {}), dict):
            return "args is not a mapping"
        return None
    if not isinstance(item.get("token_id"), str) or not isinstance(item.get("args", {}), dict):
        return "a token needs a token_id and args (a mapping)"
    place = item.get("place", ENTRY_PLACE)
    if place != ENTRY_PLACE and places.get(place) != item["step"]:
        return f"{place!r} is not a place of step {item['step']!r}"
    if where == "delayed" and not isinstance(item.get("due"), (int, float)):
        return "a delayed token needs its due time"
    return None


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


__all__ = ["seed", "request", "check", "finished", "Refused", "NOT_FINISHED", "NO_PLAYBOOK", "UNKNOWN_STEP", "NEVER_STARTED"]
