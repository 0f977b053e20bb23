"""What the web console shows of a playbook and of an execution: pure, bounded views.

- :func:`net` is the playbook as a net (D16): its steps as nodes and its arcs as edges (places), with
  what the console draws distinctly: joins, loops, back-edges, the entry step, each arc's ``when`` and
  ``args``. It reads the normalised document and the static graph the engine itself uses
  (``state.graph_of``), so a back-edge or a join is exactly what the execution core treats as one.
- :func:`execution_view` is an :class:`~.state.ExecutionState` — built by the engine's own fold
  (``state.apply``, D22) — as the console shows it at one point of the log: each step's status and run
  count, the tokens waiting on places, each step's last runs with their args, results and errors, ctx,
  the waits, the children. Every value is bounded (:func:`preview`): a 100,000-item result is a few
  KiB of preview plus its size, and a loop is counts (``loops``), never its iterations.

No I/O here: the event-recorder builds the state and calls these; tests call them with event lists.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import orjson

from .state import FINAL, ExecutionState, graph_of, wait_view
from ..lang.validate import entry_step

PREVIEW_BYTES = 2048  # a value's JSON longer than this is shown as its first bytes and its size
MAX_RUNS = 20  # the last runs shown per step (their total is given)
MAX_TOKENS = 500  # places listed with their waiting tokens
MAX_KEYS = 200  # ctx and workload keys shown
MAX_CHILDREN = 100
MAX_WAITS = 100
PREVIEW = "$preview"  # the key that marks a previewed value: {"$preview": text, "$size": bytes, "$items": n}


def _json(value: Any) -> bytes:
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


def preview(value: Any, limit: int = PREVIEW_BYTES) -> Any:
    """``value`` itself when its JSON fits in ``limit`` bytes, else ``{"$preview": <its first
    ``limit`` bytes of JSON, as text>, "$size": <bytes>, "$items": <length of a list or mapping>}``."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and len(value) * 4 + 2 <= limit:  # at most 4 bytes a character, quotes
        return value
    data = _json(value)
    if len(data) <= limit:
        return value
    out: dict[str, Any] = {PREVIEW: data[:limit].decode("utf-8", "ignore"), "$size": len(data)}
    if isinstance(value, (list, dict, tuple)):
        out["$items"] = len(value)
    return out


def _bounded_mapping(value: Any, limit: int) -> Any:
    """A mapping with each value previewed and at most :data:`MAX_KEYS` keys (``$more``: how many not shown)."""
    if not isinstance(value, Mapping):
        return preview(value, limit)
    keys = list(value)
    out = {str(k): preview(value[k], limit) for k in keys[:MAX_KEYS]}
    if len(keys) > MAX_KEYS:
        out["$more"] = len(keys) - MAX_KEYS
    return out


# ------------------------------------------------------------------------------------------ the net
def net(doc: Mapping[str, Any] | None, arg_limit: int = 512) -> dict[str, Any]:
    """The playbook's net: ``{"entry", "nodes": [...], "edges": [...]}``.

    A node: ``{id, kinds (its tasks' kinds), tasks, loop ({mode, max_in_flight, iterator} or null),
    join (fires once per set of tokens, D16), join_any (spec.join: any), entry, router (exclusive or
    inclusive), desc}``. An edge: ``{id (the place, source#index->target), source, target, index, when,
    args, back (a back-edge: its source is reachable from its target), delay}``. ``doc`` is a
    normalised playbook (``ValidationResult.document``, or ``playbook.request.evaluated``'s)."""
    steps = [s for s in (doc or {}).get("workflow") or () if isinstance(s, Mapping) and isinstance(s.get("step"), str)]
    if not steps:
        return {"entry": None, "nodes": [], "edges": []}
    graph = graph_of({"workflow": steps})
    entry = entry_step(doc)
    back = {p.id for places in graph.back_places.values() for p in places}
    nodes, edges = [], []
    for s in steps:
        name = s["step"]
        tools = s.get("tool") if isinstance(s.get("tool"), list) else ([s["tool"]] if isinstance(s.get("tool"), Mapping) else [])
        loop = s.get("loop") if isinstance(s.get("loop"), Mapping) else None
        lspec = (loop or {}).get("spec") or {}
        spec = s.get("spec") if isinstance(s.get("spec"), Mapping) else {}
        router = s.get("next") if isinstance(s.get("next"), Mapping) else {}
        rspec = router.get("spec") if isinstance(router.get("spec"), Mapping) else {}
        nodes.append({
            "id": name,
            "kinds": [t.get("kind") for t in tools if isinstance(t, Mapping)],
            "tasks": [t.get("name") for t in tools if isinstance(t, Mapping)],
            "loop": None if loop is None else {
                "mode": lspec.get("mode", "sequential"),
                "max_in_flight": lspec.get("max_in_flight", 16) if lspec.get("mode") == "parallel" else 1,
                "iterator": loop.get("iterator")},
            "join": graph.is_join(name) and spec.get("join", "all") != "any",
            "join_any": graph.is_join(name) and spec.get("join") == "any",
            "entry": name == entry,
            "router": rspec.get("mode", "exclusive"),
            "desc": s.get("desc") if isinstance(s.get("desc"), str) else None,
        })
        for i, arc in enumerate(router.get("arcs") or ()):
            place = graph.by_arc.get((name, i))
            if place is None or not isinstance(arc, Mapping):
                continue  # an arc to an unknown step: the validator reports it
            aspec = arc.get("spec") if isinstance(arc.get("spec"), Mapping) else {}
            edges.append({"id": place.id, "source": name, "target": place.target, "index": i,
                          "when": preview(arc.get("when"), arg_limit), "args": preview(arc.get("args"), arg_limit),
                          "back": place.id in back, "delay": aspec.get("delay", rspec.get("delay"))})
    return {"entry": entry, "nodes": nodes, "edges": edges}


# ------------------------------------------------------------------------------------ the execution
def loop_counts(rows: Iterable[tuple[str, str, int, float | None, float | None]]) -> dict[str, dict[str, Any]]:
    """Iteration counts per loop run from ``(step_run_id, event name, count, first timestamp, last
    timestamp)`` rows (each iteration's event is stored once: its id is derived, D21) (``loop.iteration.started``/``done``/``failed``): ``{run_id:
    {started, done, failed, first_at, last_at}}``."""
    out: dict[str, dict[str, Any]] = {}
    for run_id, name, count, first, last in rows:
        if not isinstance(run_id, str):
            continue
        c = out.setdefault(run_id, {"started": 0, "done": 0, "failed": 0, "first_at": None, "last_at": None})
        key = name.rsplit(".", 1)[-1]
        if key in c:
            c[key] = int(count)
        if key in ("done", "failed"):
            c["first_at"] = first if c["first_at"] is None else min(c["first_at"], first or c["first_at"])
            c["last_at"] = last if c["last_at"] is None else max(c["last_at"], last or c["last_at"])
    return out


def loop_progress(counts: Mapping[str, Any] | None, total: int | None, ended: Mapping[str, Any] | None,
                  mode: str | None = None, max_in_flight: int | None = None, over: bool = False) -> dict[str, Any]:
    """A loop run's progress: ``{total, done, failed, in_flight, rate}`` (``rate``: iterations ended
    per second between the first and the last one). ``ended``: the counts its terminal event
    (``loop.done`` / ``step.failed``) carries, which are the loop-coordinator's own and win; ``over``: the
    run has ended (also without them: cancelled), so nothing is in flight any more."""
    c = dict(counts or {})
    done, failed, started = int(c.get("done") or 0), int(c.get("failed") or 0), int(c.get("started") or 0)
    if ended:
        total = ended.get("total", total)
        done, failed = int(ended.get("done") or done), int(ended.get("failed") or failed)
    first, last = c.get("first_at"), c.get("last_at")
    span = (last - first) if isinstance(first, (int, float)) and isinstance(last, (int, float)) else 0
    finished = done + failed
    return {"total": total, "done": done, "failed": failed,
            "in_flight": 0 if ended or over else max(0, started - finished),
            "rate": round(finished / span, 1) if span > 0 and finished > 1 else None,
            "mode": mode, "max_in_flight": max_in_flight}


def _run_status(state: ExecutionState, run: Any, loop: Mapping[str, Any] | None, waits: Mapping[str, int]) -> str:
    """A run's status as the console draws it. Besides the engine's (running, done, failed, cancelled):
    ``waiting``, a run that is not ended and waits for a signal or a time (D29, D30) — every iteration in
    flight, for a loop — and a loop run that ended ``loop.done`` after failed iterations (``best_effort``)
    is ``failed`` when every iteration failed, ``partial`` when some did."""
    if run.ended:
        if run.status == "done" and loop and (loop.get("failed") or 0) > 0:
            return "failed" if not loop.get("done") else "partial"
        return run.status
    if state.finished:
        return "cancelled"
    open_waits = waits.get(run.id, 0)
    if open_waits and (loop is None or open_waits >= (loop.get("in_flight") or 0)):
        return "waiting"
    return "running"


def _step_status(state: ExecutionState, step: str, waiting: set[str], last: str | None) -> str:
    """``last``: the status of its last run (:func:`_run_status`), None when it has not run."""
    if last is not None:
        return last
    if step in waiting:
        return "waiting"  # a token is on one of its places, not consumed yet (a join waiting for the others)
    if state.skipped.get(step):
        return "skipped"
    return "idle"


def execution_view(state: ExecutionState, *, loops: Mapping[str, Mapping[str, Any]] | None = None,
                   loop_totals: Mapping[str, int] | None = None, ended_counts: Mapping[str, Mapping[str, Any]] | None = None,
                   limit: int = PREVIEW_BYTES, max_runs: int = MAX_RUNS) -> dict[str, Any]:
    """The state as the console shows it. ``loops``: :func:`loop_counts` of the log up to the same
    point; ``loop_totals``: each loop run's number of items (its ``loop.started``); ``ended_counts``:
    the counts on loop runs' terminal events. Every value bounded by ``limit`` bytes of preview."""
    loops, loop_totals, ended_counts = loops or {}, loop_totals or {}, ended_counts or {}
    defs = state.steps_by_name()
    order = list(defs)
    tokens_by_place: dict[str, dict[str, Any]] = {}
    for token in state.tokens.values():
        slot = tokens_by_place.setdefault(token.place, {"place": token.place, "step": token.step, "count": 0})
        slot["count"] += 1
    waiting = {t["step"] for t in tokens_by_place.values()}
    open_waits: dict[str, int] = {}  # step run -> its waits not ended (D29, D30)
    for w in state.task_waits.values():
        if not w.ended:
            open_waits[w.step_run_id] = open_waits.get(w.step_run_id, 0) + 1
    steps: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {}
    for step in order:
        ids = state.runs_of.get(step, [])
        active = sum(1 for rid in ids if not state.runs[rid].routed)
        ran = sum(1 for rid in ids if not state.runs[rid].restored)  # D32: not the runs a restart carried over
        sdef = defs.get(step) or {}
        loop = sdef.get("loop") if isinstance(sdef.get("loop"), Mapping) else None
        lspec = (loop or {}).get("spec") or {}
        mode = lspec.get("mode", "sequential")

        def progress(rid: str) -> dict[str, Any] | None:
            if loop is None:
                return None
            return loop_progress(loops.get(rid), loop_totals.get(rid), ended_counts.get(rid), mode,
                                 lspec.get("max_in_flight", 16) if mode == "parallel" else 1,
                                 over=state.runs[rid].ended or state.finished)

        last = _run_status(state, state.runs[ids[-1]], progress(ids[-1]), open_waits) if ids else None
        steps[step] = {"status": _step_status(state, step, waiting, last), "runs": ran,
                       "skipped": state.skipped.get(step, 0), "active": active,
                       "tokens": sum(t["count"] for t in tokens_by_place.values() if t["step"] == step)}
        if not ids:
            continue
        if state.runs[ids[-1]].restored:  # D32: its last run was carried over from the restarted execution
            steps[step]["restored"] = True
        shown = []
        for rid in ids[-max_runs:]:
            run = state.runs[rid]
            counts = progress(rid)
            item: dict[str, Any] = {"run_id": rid, "status": _run_status(state, run, counts, open_waits),
                                    "ended": run.ended, "routed": run.routed, "args": preview(run.args, limit),
                                    "result": preview(run.result, limit), "error": preview(run.error, limit)}
            if run.restored:
                item["restored"] = True
            if counts is not None:
                item["loop"] = counts
            shown.append(item)
        runs[step] = {"total": len(ids), "shown": shown}
    out: dict[str, Any] = {
        "execution_id": state.execution_id, "status": state.status, "finished": state.status in FINAL,
        "cancel_requested": state.cancel_requested, "failure": preview(state.failure, limit),
        "errors": preview(state.errors, limit) if state.errors else [],
        "workload": _bounded_mapping(state.workload, limit), "ctx": _bounded_mapping(state.ctx, limit),
        "steps": steps, "runs": runs,
        "tokens": sorted(tokens_by_place.values(), key=lambda t: t["place"])[:MAX_TOKENS],
        "timers": {"pending": sum(1 for t in state.timers.values() if not t.fired),
                   "delayed_tokens": len(state.delayed_tokens())},
        "waits": [{k: preview(v, limit) for k, v in wait_view(w).items()}
                  for w in list(state.task_waits.values())[:MAX_WAITS]],
        "children": list(state.children)[:MAX_CHILDREN], "children_total": len(state.children),
        "signals": {name: len(sent) for name, sent in state.signals.items()},
        "kept_signals": list(state.kept), "refused_signals": preview(state.refused_signals[-MAX_WAITS:], limit),
        "folded": state.events,
    }
    request = state.request if isinstance(state.request, dict) else {}
    if request.get("parent_execution_id"):
        out["parent_execution_id"] = request["parent_execution_id"]
    if isinstance(request.get("restarted_from"), Mapping):  # D32: the execution and step this one goes on from
        out["restarted_from"] = {k: request["restarted_from"].get(k) for k in ("execution", "step", "upto_event")}
    who = request.get("requested_by")
    if isinstance(who, Mapping):  # ids and names only (the gateway's auth.requested_by)
        out["requested_by"] = {k: who.get(k) for k in ("user_id", "username") if isinstance(who.get(k), str)}
    return out


FITS = ((PREVIEW_BYTES, MAX_RUNS), (512, 5), (128, 1), (32, 1))  # (preview bytes, runs per step), tried in turn


def fitted(state: ExecutionState, budget: int, **kw: Any) -> dict[str, Any]:
    """:func:`execution_view` within ``budget`` bytes of JSON: smaller previews and fewer runs per step
    until it fits (``trimmed`` says how far it went); a view that still does not fit (thousands of
    steps) keeps only the steps' statuses."""
    for i, (limit, runs) in enumerate(FITS):
        out = execution_view(state, limit=limit, max_runs=runs, **kw)
        out["trimmed"] = i
        if len(_json(out)) <= budget:
            return out
    out = {**out, "runs": {}, "tokens": out["tokens"][:20], "ctx": {"$more": len(state.ctx)},
           "workload": {"$more": len(state.workload or {})}, "trimmed": len(FITS)}
    return out


__all__ = ["net", "execution_view", "fitted", "preview", "loop_counts", "loop_progress", "PREVIEW", "PREVIEW_BYTES"]
