"""An execution's timeline, as the web console draws it (a Gantt chart): pure, bounded.

Each step run is a span from its admission to its terminal event (``step.done``, ``step.failed``,
``loop.done``), with when its worker started it (``step.started``); under it its tasks' attempts
(``task.started`` to ``task.processed``, a wait task's suspension and the wait itself), and for a loop its
iterations. What the console draws never grows with the size of the execution:

- at most :data:`MAX_RUNS` runs (the last ones; ``runs_total`` counts them all);
- a loop of at most :data:`MAX_ITERATIONS` iterations lists each iteration (and its tasks); a bigger one
  is counts: how many iterations ended done and ended failed in each of ``buckets`` equal slices of the
  window (the execution's span, or the ``from``–``to`` the console zoomed to), plus how many before and
  after it;
- at most :data:`MAX_TASKS` task attempts in all (``tasks_total`` says when some were left out).

Times are epoch seconds (to the microsecond Postgres keeps). The event-recorder reads the rows with a
few indexed queries (services/event_recorder/service.py ``execution_timeline``) and calls
:func:`build`; tests call it with rows made by hand.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

MAX_RUNS = 500  # step runs on the chart (the last ones)
MAX_ITERATIONS = 100  # a loop run with more iterations than this is drawn as counts per time slice
MAX_LISTED_ITERATIONS = 1000  # iterations listed one by one, over every loop run
MAX_TASKS = 1500  # task attempts listed, over every run
MAX_BUCKETS = 400
DEFAULT_BUCKETS = 120
TERMINAL = ("step.done", "step.failed", "loop.done")
RUN_EVENTS = ("step.admitted", *TERMINAL)
TASK_EVENTS = ("task.started", "task.processed", "task.suspended", "step.started")


def _t(value: Any) -> float | None:
    return round(float(value), 6) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def loop_status(status: str, counts: Mapping[str, Any] | None) -> str:
    """A loop run that ended ``loop.done`` after failed iterations (``best_effort``): ``failed`` when every
    iteration failed, ``partial`` when some did (as core/view.py draws it)."""
    if status == "done" and counts and _int(counts.get("failed")) > 0:
        return "failed" if not _int(counts.get("done")) else "partial"
    return status


def run_spans(rows: Iterable[Sequence[Any]]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Step runs from ``(seq, name, step, step_run_id, timestamp, data)`` rows of :data:`RUN_EVENTS`
    in log order (``data``: a terminal's ``{done, failed, total}`` of a loop, ``{kind}`` of an error):
    the runs in admission order, and the same by id."""
    runs: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    for _seq, name, step, run_id, ts, data in rows:
        if not isinstance(run_id, str):
            continue
        run = by_id.get(run_id)
        if name == "step.admitted":
            if run is None:
                run = by_id[run_id] = {"run_id": run_id, "step": step, "status": "running", "admitted_at": _t(ts),
                                       "started_at": None, "ended_at": None}
                runs.append(run)
            continue
        if run is None or run.get("end_event"):
            continue  # a terminal of a run carried over by a restart (D32), or a second one
        data = data if isinstance(data, Mapping) else {}
        run["ended_at"] = _t(ts)
        run["end_event"] = name
        if name == "step.failed":
            run["status"] = "failed"
            if isinstance(data.get("kind"), str):
                run["error_kind"] = data["kind"]
        else:
            run["status"] = loop_status("done", data if name == "loop.done" else None)
        if name == "loop.done" or data.get("total") is not None:  # a loop's step.failed has its counts
            run["counts"] = {k: _int(data.get(k)) for k in ("total", "done", "failed")}
    return runs, by_id


def task_spans(rows: Iterable[Sequence[Any]], by_id: Mapping[str, dict[str, Any]],
               limit: int = MAX_TASKS) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Task attempts from ``(step_run_id, name, task, iteration, attempt, task_run_id, timestamp, status)``
    rows of :data:`TASK_EVENTS` in log order (a run's ``step.started`` sets its ``started_at``): each
    attempt ``{task, attempt, iteration, started_at, ended_at, suspended_at, status}``, by run; and how
    many attempts there were (at most ``limit`` are kept, in log order)."""
    out: dict[str, list[dict[str, Any]]] = {}
    spans: dict[tuple[str, str, int], dict[str, Any]] = {}
    total = 0
    for run_id, name, task, iteration, attempt, task_run_id, ts, status in rows:
        run = by_id.get(run_id)
        if run is None:
            continue
        if name == "step.started":
            if run["started_at"] is None:
                run["started_at"] = _t(ts)
            continue
        key = (run_id, task_run_id or f"{task}/{iteration}", _int(attempt))
        span = spans.get(key)
        if span is None:
            total += 1
            span = {"task": task, "attempt": _int(attempt) or None, "iteration": iteration, "started_at": None,
                    "ended_at": None, "suspended_at": None, "status": "running"}
            spans[key] = span
            if total <= limit:
                out.setdefault(run_id, []).append(span)
        if name == "task.started":
            span["started_at"] = span["started_at"] or _t(ts)
        elif name == "task.suspended":
            span["suspended_at"] = _t(ts)
            span["status"] = "waiting"
            span["started_at"] = span["started_at"] or _t(ts)
        else:  # task.processed
            span["ended_at"] = _t(ts)
            span["status"] = "done" if status == "success" else "failed"
            span["started_at"] = span["started_at"] or _t(ts)
    return out, total


def iteration_spans(rows: Iterable[Sequence[Any]]) -> dict[str, list[dict[str, Any]]]:
    """Iterations from ``(step_run_id, iteration, name, timestamp)`` rows of ``loop.iteration.*``: by run,
    in iteration order, each ``{iteration, started_at, ended_at, status}``."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for run_id, iteration, name, ts in rows:
        if not isinstance(run_id, str) or not isinstance(iteration, int):
            continue
        it = out.setdefault(run_id, {}).setdefault(iteration, {"iteration": iteration, "started_at": None,
                                                                  "ended_at": None, "status": "running"})
        if name == "loop.iteration.started":
            it["started_at"] = _t(ts)
        else:
            it["ended_at"] = _t(ts)
            it["status"] = "done" if name == "loop.iteration.done" else "failed"
    return {run: [its[i] for i in sorted(its)] for run, its in out.items()}


def histogram(rows: Iterable[Sequence[Any]], buckets: int) -> dict[str, dict[str, list[int]]]:
    """Per loop run, the iterations that ended done and failed in each slice, from ``(step_run_id, name,
    bucket, count)`` rows of ``loop.iteration.done``/``failed`` where ``bucket`` is Postgres'
    ``width_bucket`` over the window (0: before it, ``buckets + 1``: after it): ``{run: {done, failed:
    [before, slice 1..n, after]}}``."""
    out: dict[str, dict[str, list[int]]] = {}
    for run_id, name, bucket, count in rows:
        if not isinstance(run_id, str) or not isinstance(bucket, int) or not 0 <= bucket <= buckets + 1:
            continue
        key = name.rsplit(".", 1)[-1]
        if key not in ("done", "failed"):
            continue
        counts = out.setdefault(run_id, {k: [0] * (buckets + 2) for k in ("done", "failed")})
        counts[key][bucket] += int(count)
    return out


def build(*, execution: Mapping[str, Any], runs: list[dict[str, Any]], loops: Mapping[str, Mapping[str, Any]],
          iterations: Mapping[str, list[dict[str, Any]]], counts: Mapping[str, Mapping[str, list[int]]],
          tasks: Mapping[str, list[dict[str, Any]]], tasks_total: int, waits: Iterable[Mapping[str, Any]],
          window: tuple[float, float], buckets: int, now: float, tasks_cut: bool = False) -> dict[str, Any]:
    """The timeline: ``execution`` ``{execution_id, status, start, end}`` (``end`` None while it runs),
    the runs of :func:`run_spans` (the last :data:`MAX_RUNS`), ``loops`` ``{run: {total, started, done,
    failed, first_at, last_at, started_at}}`` (its counters and ``loop.started``), the iterations of the
    loops that list them, the :func:`histogram` of the others, :func:`task_spans`, and the waits
    (``{step_run_id, iteration, task, kind, signal, started_at, ended_at}``). ``tasks_cut``: the task events
    read were cut at their limit (``tasks_total`` is then a lower bound, ``tasks_more`` says so)."""
    finished = execution.get("end") is not None
    open_waits: dict[str, int] = {}
    wait_list: dict[str, list[dict[str, Any]]] = {}
    for w in waits:
        run_id = w.get("step_run_id")
        if not isinstance(run_id, str):
            continue
        wait_list.setdefault(run_id, []).append({k: w.get(k) for k in ("iteration", "task", "kind", "signal")} |
                                                {"started_at": _t(w.get("started_at")), "ended_at": _t(w.get("ended_at"))})
        if w.get("ended_at") is None:
            open_waits[run_id] = open_waits.get(run_id, 0) + 1
    shown = runs[-MAX_RUNS:]
    out_runs = []
    for run in shown:
        item = dict(run)
        rid = item["run_id"]
        loop = loops.get(rid)
        if item["ended_at"] is None:
            if finished:
                item["status"], item["ended_at"] = "cancelled", execution["end"]
            elif open_waits.get(rid):
                in_flight = None if loop is None else _int(loop.get("started")) - _int(loop.get("done")) - _int(loop.get("failed"))
                if loop is None or open_waits[rid] >= (in_flight or 0):
                    item["status"] = "waiting"
        if loop is not None:
            info = {k: loop.get(k) for k in ("total", "started", "done", "failed")}
            ended = item.get("counts")
            if ended:  # the coordinator's own counts, on the terminal event, win
                info.update({k: ended[k] for k in ("done", "failed") if ended.get(k) is not None})
                info["total"] = ended.get("total") or info["total"]
            info.update({"first_at": _t(loop.get("first_at")), "last_at": _t(loop.get("last_at")),
                         "started_at": _t(loop.get("started_at"))})
            if rid in iterations:
                info["iterations"] = iterations[rid]
            elif rid in counts:
                info["slices"] = counts[rid]
            item["loop"] = info
            if item["started_at"] is None:
                item["started_at"] = info["started_at"]
        item.pop("counts", None)
        if rid in tasks:
            item["tasks"] = tasks[rid]
        if rid in wait_list:
            item["waits"] = wait_list[rid][:MAX_ITERATIONS]
        out_runs.append(item)
    start, end = window
    return {
        "execution_id": execution.get("execution_id"), "status": execution.get("status"),
        "start": _t(execution.get("start")), "end": _t(execution.get("end")), "now": _t(now),
        "runs": out_runs, "runs_total": len(runs), "tasks_total": tasks_total, "tasks_more": tasks_cut,
        "window": {"from": _t(start), "to": _t(end), "buckets": buckets,
                   "width": _t((end - start) / buckets) if buckets else None},
        "limits": {"runs": MAX_RUNS, "iterations": MAX_ITERATIONS, "tasks": MAX_TASKS},
    }


def ranges(spans: Iterable[tuple[int, int | None]], most: int = 32) -> list[tuple[int, int | None]]:
    """The log sequence ranges ``[first, last]`` (``None``: to the end) that hold the given runs' events,
    merged, and merged again across the smallest gaps until at most ``most`` are left: a query reads those
    stretches of the log, never a big loop's events outside them."""
    merged: list[list[Any]] = []
    for lo, hi in sorted(spans, key=lambda s: s[0]):
        if merged and (merged[-1][1] is None or lo <= merged[-1][1] + 1):
            if merged[-1][1] is not None:
                merged[-1][1] = None if hi is None else max(merged[-1][1], hi)
            continue
        merged.append([lo, hi])
    while len(merged) > most:
        gaps = [(merged[i + 1][0] - merged[i][1], i) for i in range(len(merged) - 1)]
        _, i = min(gaps)
        merged[i][1] = merged[i + 1][1]
        del merged[i + 1]
    return [(lo, hi) for lo, hi in merged]


__all__ = ["build", "run_spans", "task_spans", "iteration_spans", "histogram", "ranges", "loop_status",
           "MAX_RUNS", "MAX_ITERATIONS", "MAX_LISTED_ITERATIONS", "MAX_TASKS", "MAX_BUCKETS", "DEFAULT_BUCKETS",
           "RUN_EVENTS", "TASK_EVENTS"]
