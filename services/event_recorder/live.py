"""What the recorder tells the console after each committed batch (pure; published by service.py).

The web console shows what is in the log; it learns that the log grew from these notices, sent on core
NATS once the batch's transaction has committed — so a page that reads the log after a notice always
finds the events the notice announced (subscribing to the events' own subjects would announce them
before they are recorded, and a page reading then would miss them). Per batch:

- one notice per execution in the batch, on ``noetl.live.x.<execution_id>``: ``{execution_id, count,
  names: {event name: count}, events: [the last few, compact], status?}``;
- one notice of the executions list, on ``noetl.live.list``, when the batch started, evaluated or
  finished an execution: ``{executions: [{execution_id, event}], more}``.

Both are bounded, whatever the batch: a 100,000-iteration loop's batch of 500 messages is one notice
with counts by name and the last :data:`LAST_EVENTS` events.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

LAST_EVENTS = 20  # compact events per notice (the newest of the batch)
MAX_NAMES = 64  # event names counted per notice
MAX_LISTED = 200  # executions per list notice
LISTED = ("playbook.execution.requested", "playbook.request.evaluated", "workflow.started", "workflow.finished")
SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")  # ids that can be one subject token
_COMPACT = ("seq", "event_id", "name", "step", "task", "iteration", "attempt", "status", "timestamp", "step_run_id")


def compact(event: dict[str, Any]) -> dict[str, Any]:
    """An event's envelope as the timeline lists it (no data; strings cut to 256 characters)."""
    out = {}
    for key in _COMPACT:
        value = event.get(key)
        out[key] = value[:256] if isinstance(value, str) else value if isinstance(value, (int, float, type(None))) else None
    return out


def notices(records: Iterable[tuple[int, dict[str, Any]]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """``(per execution id: its notice, the list notice or None)`` of a committed batch of ``(log_seq,
    event)``. Executions whose id cannot be a subject token get no notice (the console cannot ask for
    them either)."""
    per: dict[str, dict[str, Any]] = {}
    last: dict[str, list[dict[str, Any]]] = {}
    listed: list[dict[str, Any]] = []
    more = 0
    for seq, event in records:
        xid = event.get("execution_id")
        if not isinstance(xid, str) or not SUBJECT_TOKEN.match(xid):
            continue
        name = event.get("name") if isinstance(event.get("name"), str) else "?"
        n = per.get(xid)
        if n is None:
            n = per[xid] = {"execution_id": xid, "count": 0, "names": {}}
            last[xid] = []
        n["count"] += 1
        if name in n["names"] or len(n["names"]) < MAX_NAMES:
            n["names"][name] = n["names"].get(name, 0) + 1
        tail = last[xid]
        tail.append({**event, "seq": seq})
        if len(tail) > 2 * LAST_EVENTS:  # keep memory bounded on a big batch
            del tail[:-LAST_EVENTS]
        if name == "workflow.started":
            n["status"] = "RUNNING"
        elif name == "workflow.finished":
            data = event.get("data") if isinstance(event.get("data"), dict) else {}
            n["status"] = data.get("status") if isinstance(data.get("status"), str) else "FAILED"
        if name in LISTED:
            if len(listed) < MAX_LISTED:
                listed.append({"execution_id": xid, "event": name})
            else:
                more += 1
    for xid, n in per.items():
        n["events"] = [compact(e) for e in last[xid][-LAST_EVENTS:]]
    return per, ({"executions": listed, "more": more} if listed else None)


__all__ = ["notices", "compact", "LAST_EVENTS", "SUBJECT_TOKEN"]
