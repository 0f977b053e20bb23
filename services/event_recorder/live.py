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

Only what someone watches is sent (:class:`Interest`): gateways say which executions (and whether the
list) their open console streams show, on ``noetl.watch.live``, when a stream opens, again every
:data:`ANNOUNCE_EVERY` s, and at once when a recorder that starts asks (``noetl.live.ask``); a key not
said again for its ``ttl`` is dropped. A starting recorder sends everything for its first
:data:`WARMUP` s, while the gateways answer. Most executions
are watched by nobody, and their notices were most of a busy recorder's work besides writing.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

LAST_EVENTS = 20  # compact events per notice (the newest of the batch)
MAX_NAMES = 64  # event names counted per notice
MAX_LISTED = 200  # executions per list notice
LISTED = ("playbook.execution.requested", "playbook.request.evaluated", "workflow.started", "workflow.finished")
SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")  # ids that can be one subject token
LIST = "*"  # the key of the executions list
ANNOUNCE_EVERY = 5.0  # seconds between a gateway's announcements of everything it watches
TTL = 3 * ANNOUNCE_EVERY  # seconds a key stays watched after it was last announced
MAX_TTL = 60.0  # a longer ttl asked for is cut to this
WARMUP = 2.0  # seconds a starting recorder sends every notice, while the gateways answer its ask
MAX_WATCHED = 100_000  # keys a recorder keeps (more: the oldest are dropped)
MAX_KEYS = 10_000  # keys read from one announcement


class Interest:
    """The keys someone watches (execution ids, and :data:`LIST`), each until its expiry; everything
    until ``everything_until`` (a recorder's first while)."""

    def __init__(self, everything_until: float = 0.0):
        self.keys: dict[str, float] = {}
        self.everything_until = everything_until

    def announce(self, message: Any, now: float) -> int:
        """``{"keys": [...], "ttl": seconds}`` from a gateway: the keys it names are watched until
        ``now + ttl``; what is not a key is ignored. The number of keys taken."""
        if not isinstance(message, dict) or not isinstance(message.get("keys"), list):
            return 0
        ttl = message.get("ttl")
        ttl = min(float(ttl), MAX_TTL) if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0 else TTL
        taken = 0
        for key in message["keys"][:MAX_KEYS]:
            if isinstance(key, str) and (key == LIST or SUBJECT_TOKEN.match(key)):
                self.keys.pop(key, None)  # re-inserted last: the dict stays in announcement order
                self.keys[key] = now + ttl
                taken += 1
        if len(self.keys) > MAX_WATCHED:
            self._prune(now)
        return taken

    def _prune(self, now: float) -> None:
        self.keys = {k: t for k, t in self.keys.items() if t > now}
        while len(self.keys) > MAX_WATCHED:  # the least recently announced go first
            del self.keys[next(iter(self.keys))]

    def wants(self, key: str, now: float) -> bool:
        return now < self.everything_until or self.keys.get(key, 0.0) > now


_COMPACT = ("seq", "event_id", "name", "step", "task", "iteration", "attempt", "status", "timestamp", "step_run_id")


def compact(event: dict[str, Any]) -> dict[str, Any]:
    """An event's envelope as the timeline lists it (no data; strings cut to 256 characters)."""
    out = {}
    for key in _COMPACT:
        value = event.get(key)
        out[key] = value[:256] if isinstance(value, str) else value if isinstance(value, (int, float, type(None))) else None
    return out


def notices(records: Iterable[tuple[int, dict[str, Any]]],
            wants: Callable[[str], bool] | None = None) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """``(per execution id: its notice, the list notice or None)`` of a committed batch of ``(log_seq,
    event)``, for the keys ``wants`` (default: all). Executions whose id cannot be a subject token get no
    notice (the console cannot ask for them either)."""
    wants = wants or (lambda key: True)
    listing = wants(LIST)
    wanted: dict[str, bool] = {}
    per: dict[str, dict[str, Any]] = {}
    last: dict[str, list[dict[str, Any]]] = {}
    listed: list[dict[str, Any]] = []
    more = 0
    for seq, event in records:
        xid = event.get("execution_id")
        if not isinstance(xid, str):
            continue
        watched = wanted.get(xid)
        if watched is None:
            watched = wanted[xid] = bool(SUBJECT_TOKEN.match(xid)) and wants(xid)
        name = event.get("name") if isinstance(event.get("name"), str) else "?"
        if listing and name in LISTED and SUBJECT_TOKEN.match(xid):
            if len(listed) < MAX_LISTED:
                listed.append({"execution_id": xid, "event": name})
            else:
                more += 1
        if not watched:
            continue
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
    for xid, n in per.items():
        n["events"] = [compact(e) for e in last[xid][-LAST_EVENTS:]]
    return per, ({"executions": listed, "more": more} if listed else None)


__all__ = ["notices", "compact", "Interest", "LAST_EVENTS", "SUBJECT_TOKEN", "LIST", "ANNOUNCE_EVERY", "TTL"]
