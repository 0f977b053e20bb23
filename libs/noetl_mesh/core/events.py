"""The event envelope with its correlation ids (D20) and stable ids (D21): docs/dsl.md, "Events and ids".

Events are plain dicts on the wire and in the log; :func:`make_event` is the one place that shapes
them. Ids are derived, never random, wherever a redelivery must reproduce the same event: a control-
plane event's id is a hash of the event that caused it and its position among the outputs; a
worker's event id is a hash of its ``action_id``, attempt and name.
"""
from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from ..contracts.subjects import CONTROL_PLANE  # noqa: F401 - the writers of an engine stop, read from here too

# D20: which entity each event name speaks about.
ENTITY = {
    "playbook.execution.requested": "playbook",
    "playbook.request.evaluated": "playbook",
    "playbook.processed": "playbook",
    "workflow.started": "workflow",
    "workflow.finished": "workflow",
    "execution.cancelled": "workflow",
    "token.enqueued": "next",
    "next.evaluated": "next",
    "step.admitted": "step",
    "step.skipped": "step",
    "step.scheduled": "step",
    "step.started": "step",
    "step.done": "step",
    "step.failed": "step",
    "task.started": "task",
    "task.processed": "task",
    "task.suspended": "task",  # a playbook task waits for its child execution (not in D20's list)
    "playbook.child.finished": "playbook",  # a child execution ended (to its parent; not in D20's list)
    "ctx.patched": "workflow",
    "loop.started": "loop",
    "loop.iteration.started": "loop",
    "loop.iteration.done": "loop",
    "loop.iteration.failed": "loop",
    "loop.done": "loop",
    # D29, D30 (not in D20's list)
    "timer.scheduled": "timer",  # a timer was set: a delayed token, a wait's time, a timeout
    "timer.fired": "timer",  # its time came (written by the NATS scheduler, writer ``timer``)
    "wait.started": "task",  # a run waits for a time or a signal (a `wait` task)
    "wait.ended": "task",  # the wait is over: how, and the task's outcome
    "signal.received": "workflow",  # a signal sent to the execution
    "signal.checked": "task",  # a signal that met its wait unchecked, checked against the wait's schema
}
TERMINAL_STEP_EVENTS = ("step.done", "step.failed", "loop.done")  # D13
ALIASES = {"call.done": "step.done", "call.error": "step.failed"}  # D13: accepted in `when`

# Subject classes: which events a control-plane service must fold. ``ctl`` events change what
# admission and the router decide; ``loop`` events only the loop-coordinator's; ``info`` events
# (task progress, scheduling notes) no service decides on: only the recorder reads them.
# ``dispatch`` events are the loop-coordinator's own bookkeeping: it folds them when it makes them and
# reads them back only to rebuild a state, so they do not come back to it one by one.
# ``flat`` messages are the ``ctl`` messages of a flat execution (a playbook without loop steps,
# decide.flat), once its writer knows it is one: the loop-coordinator has nothing to decide for such an
# execution, so it does not read them. It still reads the message with ``playbook.request.evaluated``,
# which tells it the execution is flat, and the messages of writers that cannot know (the gateway's
# requests, cancels and signals; other executions' notices).
CTL, LOOP, DISPATCH, INFO, FLAT = "ctl", "loop", "dispatch", "info", "flat"
LOOP_EVENTS = frozenset({"loop.iteration.done", "loop.iteration.failed"})
DISPATCH_EVENTS = frozenset({"loop.started", "loop.iteration.started"})
INFO_EVENTS = frozenset({"task.started", "task.processed", "step.started", "step.scheduled", "playbook.processed"})
_CLASS_RANK = {INFO: 0, DISPATCH: 1, LOOP: 2, CTL: 3}


def event_class(name: str) -> str:
    if name in LOOP_EVENTS:
        return LOOP
    if name in DISPATCH_EVENTS:
        return DISPATCH
    return INFO if name in INFO_EVENTS else CTL


def batch_class(events: list[dict[str, Any]], flat: bool = False) -> str:
    """A message of events goes to the most demanding class among them (ctl > loop > dispatch > info):
    a service that consumes a class folds every event of its messages. ``flat``: the writer knows the
    execution is flat, and its ``ctl`` message (but the one that says so) is ``flat``."""
    cls = max((event_class(e["name"]) for e in events), key=_CLASS_RANK.__getitem__)
    if flat and cls == CTL and not any(e["name"] == "playbook.request.evaluated" for e in events):
        return FLAT
    return cls


# Writers: who may write which event name (docs/architecture.md §1). A message's writer travels in its
# subject (``noetl.evt.<writer>.<class>.<execution_id>``), where the NATS permissions of each service's
# user let it publish only as itself; the readers check every event's name and ``source`` against the
# subject's writer (:func:`refused`), so a writer that lies in the content is caught too.
MAY_WRITE: dict[str, frozenset[str]] = {
    "gateway": frozenset({"playbook.execution.requested", "execution.cancelled", "signal.received"}),
    "admission": frozenset({
        "timer.scheduled", "wait.started", "wait.ended", "signal.checked",  # step runs' waits and timeouts
        "playbook.request.evaluated", "workflow.started", "token.enqueued",  # the entry token
        "step.admitted", "step.skipped", "step.scheduled",
        "step.started", "step.done", "step.failed",  # tool-less steps; an admit rule that cannot be evaluated
        "loop.iteration.failed",  # with step.failed: the runs of a lost command
        "playbook.execution.requested", "playbook.child.finished",  # a child's request; past the depth limit
        "execution.cancelled",  # an execution it cannot go on with (engine_stopped)
    }),
    "router": frozenset({
        "timer.scheduled", "step.failed",  # delayed arcs; a step run's timeout
        "token.enqueued", "next.evaluated", "workflow.finished", "playbook.processed",
        "playbook.child.finished", "execution.cancelled",  # to a parent; to the children of a finished parent
    }),
    "loop-coordinator": frozenset({
        "timer.scheduled", "wait.started", "wait.ended", "signal.checked",  # loop iterations' waits, loop steps' timeouts
        "step.started", "step.failed", "loop.started", "loop.iteration.started", "loop.done",
        "playbook.execution.requested", "playbook.child.finished", "execution.cancelled",  # iterations' children
    }),
    "worker": frozenset({
        "task.started", "task.processed", "task.suspended", "ctx.patched",
        "step.started", "step.done", "step.failed", "loop.iteration.done", "loop.iteration.failed",
    }),
    # Written by the NATS server itself when a timer's time comes: the message a control-plane service
    # scheduled (``noetl.sched.<execution>.<timer>``, targeting ``noetl.evt.timer.<ctl or flat>.<execution>``).
    # No NATS user may publish as ``timer``; a timer.fired event only fires a timer its execution set.
    "timer": frozenset({"timer.fired"}),
    "scheduler": frozenset({"playbook.execution.requested"}),  # a schedule's firing (core/schedules.py)
}
WORKER_SOURCE = "worker:"  # a worker's events have source ``worker:<pool>``; every other writer its name


def writer_of(source: Any) -> str | None:
    """The writer an event's ``source`` names (``worker:<pool>`` -> ``worker``); None for anything else."""
    if not isinstance(source, str):
        return None
    if source.startswith(WORKER_SOURCE):
        return "worker" if len(source) > len(WORKER_SOURCE) else None
    return source if source in MAY_WRITE else None


def writers_of(name: str) -> tuple[str, ...]:
    """The writers that may write the event ``name``."""
    return tuple(w for w, names in MAY_WRITE.items() if name in names)


def refused(writer: str, event: Any) -> str | None:
    """Why ``writer`` (a message's, from its subject) may not have written ``event``; None when it may."""
    if not isinstance(event, dict):
        return f"not an event: {type(event).__name__}"
    if writer not in MAY_WRITE:
        return f"{writer!r} is not a writer"
    source = event.get("source")
    if writer_of(source) != writer:
        return f"source {source!r} is not the writer {writer!r} of the subject"
    if event.get("name") not in MAY_WRITE[writer]:
        return f"{writer} may not write {event.get('name')!r}"
    return None


def split_by_writer(writer: str, events: list[Any]) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
    """The events ``writer`` may have written, and the others with the reason each is refused."""
    kept: list[dict[str, Any]] = []
    dropped: list[tuple[Any, str]] = []
    for event in events:
        why = refused(writer, event)
        if why is None:
            kept.append(event)
        else:
            dropped.append((event, why))
    return kept, dropped


CORRELATION_KEYS = (
    "workflow_run_id", "step_run_id", "task_run_id", "parent_id", "action_id", "attempt", "iteration",
)


def stable_id(*parts: Any) -> str:
    """A short stable hex id of its parts (D21)."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=12)
    return h.hexdigest()


def new_execution_id() -> str:
    return uuid.uuid4().hex


def carried_roles(roles: Any) -> list[str] | None:
    """The roles a request carried, as they travel on with what it made (an execution's
    ``requested_by``, a catalog version's registrant, a schedule's maker: a pool admits no more than
    these, D33): the texts of a list, at most 16 of at most 64 characters each; None when there is no
    list (the request carried none)."""
    if not isinstance(roles, list):
        return None
    return [r[:64] for r in roles[:16] if isinstance(r, str)]


def execution_requested(execution_id: str, data: dict[str, Any], source: str = "gateway",
                        timestamp: float | None = None) -> dict[str, Any]:
    """The event that asks for a new execution (``data``: playbook, catalog, workload,
    parent_execution_id, requested_by; or a restart's, core/restart.py); one id per execution, so a
    request published twice is one request."""
    return make_event("playbook.execution.requested", execution_id, event_id=stable_id("request", execution_id),
                      source=source, status="in_progress", data=data, timestamp=timestamp)


def cancel_requested(execution_id: str, reason: str | None, requested_by: Any, source: str = "gateway") -> dict[str, Any]:
    """The event that asks for an execution's cancellation; one per execution."""
    return make_event("execution.cancelled", execution_id, event_id=stable_id("cancel", execution_id),
                      source=source, data={"reason": reason, "requested_by": requested_by})


ENGINE_ERROR = "engine_error"


def engine_stopped(execution_id: str, source: str, message: str) -> dict[str, Any]:
    """How a control-plane service ends an execution it cannot go on with, instead of leaving it
    RUNNING for ever: an event of it that the service cannot fold or decide on, or a decision it cannot
    publish (D18). A cancellation carrying an ``engine_error`` (so every service stops the execution's
    work as for any cancellation), which the router finishes ``FAILED``. One per execution."""
    error = {"kind": ENGINE_ERROR, "message": message}
    return make_event("execution.cancelled", execution_id, event_id=stable_id("engine-stop", execution_id),
                      source=source, status="error", data={"reason": message, "error": error})


def engine_error(event: dict[str, Any]) -> dict[str, Any] | None:
    """The ``engine_error`` an ``execution.cancelled`` carries: only a control-plane service's may."""
    error = (event.get("data") or {}).get("error")
    if event.get("source") in CONTROL_PLANE and isinstance(error, dict) and error.get("kind") == ENGINE_ERROR:
        return error
    return None


def action_id(execution_id: str, step_run_id: str, iteration: int | None, task: str, visit: int) -> str:
    """D21: stable across retries and redeliveries of one task visit."""
    return stable_id("action", execution_id, step_run_id, iteration, task, visit)


def make_event(
    name: str,
    execution_id: str,
    *,
    event_id: str,
    source: str,
    status: str = "success",
    step: str | None = None,
    task: str | None = None,
    data: dict[str, Any] | None = None,
    entity_id: str | None = None,
    timestamp: float | None = None,
    **correlation: Any,
) -> dict[str, Any]:
    """Shape one event. ``status`` is ``in_progress | success | error | paused`` (D20)."""
    unknown = set(correlation) - set(CORRELATION_KEYS)
    if unknown:
        raise TypeError(f"unknown correlation keys {sorted(unknown)}")
    event = {
        "event_id": event_id,
        "execution_id": execution_id,
        "timestamp": time.time() if timestamp is None else timestamp,
        "source": source,
        "name": name,
        "entity": ENTITY.get(name, "workflow"),
        "entity_id": entity_id or correlation.get("step_run_id") or execution_id,
        "status": status,
        "step": step,
        "task": task,
        "data": data or {},
    }
    for key in CORRELATION_KEYS:
        event[key] = correlation.get(key)
    return event
