"""The audit log: the JetStream stream ``NOETL_AUDIT`` (subjects ``noetl.audit.<area>.<verb>.<user id>``,
file storage, max age ``audit_retention``, 90 days), written by the sessions service and the gateway,
read by admins through ``noetl.q.audit.list``.

A record (:func:`noetl_mesh.core.access.audit_record`)::

    {"audit_id": "…", "at": "2025-01-31T12:00:00.000Z", "action": "session.login", "outcome": "ok",
     "actor": {"user_id", "username", "kind", "session_id" | "token_id"}, "client_ip": "203.0.113.7",
     "target": {…} | null, "details": {…} | null}

The subject's last token is the actor's user id (``-`` when unknown), so filters by action, by user or
both are subject filters the server applies. The gateway records its own actions with :func:`record`
(e.g. ``credential.read``, ``credential.written``, ``execution.cancelled``).
"""
from __future__ import annotations

import time
from typing import Any

import orjson
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from noetl_mesh import limits
from noetl_mesh.core.access import ACTION, ID, AccessError, audit_record, audit_subject, epoch

from noetl_mesh.contracts.subjects import AUDIT as STREAM
from noetl_mesh.contracts.subjects import AUDIT_SUBJECTS

SUBJECTS = list(AUDIT_SUBJECTS)
MAX_RECORDS = 1000  # per query


async def ensure_stream(js, replicas: int = 1) -> None:
    try:
        await js.stream_info(STREAM)
    except NotFoundError:
        try:
            await js.add_stream(StreamConfig(
                name=STREAM, subjects=SUBJECTS, storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
                max_age=float(limits.current().audit_retention), duplicate_window=120,
                description="noetl audit log: logins, sessions, users, tokens, credentials, cancels",
                num_replicas=replicas))
        except Exception:  # noqa: BLE001 - created meanwhile by another replica
            await js.stream_info(STREAM)


async def publish(js, rec: dict[str, Any]) -> None:
    """Store one record (waits for the PubAck; the audit id de-duplicates a retry)."""
    actor = rec.get("actor") or {}
    await js.publish(audit_subject(rec["action"], actor.get("user_id")), orjson.dumps(rec), stream=STREAM,
                     headers={"Nats-Msg-Id": rec["audit_id"]})


async def record(bus, action: str, *, actor: dict[str, Any] | None, client_ip: str | None = None,
                 target: dict[str, Any] | None = None, outcome: str = "ok",
                 details: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record an action (the gateway's helper): ``actor`` is the validated principal, ``target`` what
    was acted on (e.g. ``{"credential": "pg1"}``), never a secret value. Returns the record."""
    rec = audit_record(action, actor=actor, now=time.time(), client_ip=client_ip, target=target,
                       outcome=outcome, details=details)
    await publish(bus.js, rec)
    return rec


def subject_filter(user: Any = None, action: Any = None) -> str:
    """``user``: a user id; ``action``: ``area.verb`` or ``area`` (every verb of the area)."""
    if user is not None and (not isinstance(user, str) or not ID.match(user)):
        raise AccessError("bad_request", "user: a user id (32 lower-case hex characters)")
    if action is None:
        area_verb = "*.*"
    elif isinstance(action, str) and ACTION.match(action):
        area_verb = action
    elif isinstance(action, str) and ACTION.match(action + ".x"):
        area_verb = action + ".*"
    else:
        raise AccessError("bad_request", "action: <area>.<verb> or <area>, e.g. session.login or user")
    return f"noetl.audit.{area_verb}.{user or '*'}"


def since_epoch(value: Any) -> float | None:
    if value in (None, ""):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return epoch(value)
    except (TypeError, ValueError):
        raise AccessError("bad_request", "since: an ISO 8601 time or seconds since the epoch") from None


async def query(js, *, user: Any = None, action: Any = None, since: Any = None, limit: Any = 100) -> list[dict]:
    """Records newest first. Reads backwards in windows of stream sequences (each window forwards with
    next-by-subject gets, so the server skips what the filter excludes), a window four times the
    previous, until ``limit`` records, the start of the stream or a record older than ``since``."""
    filt = subject_filter(user, action)
    start_at = since_epoch(since)
    try:
        limit = min(max(int(limit), 1), MAX_RECORDS)
    except (TypeError, ValueError):
        raise AccessError("bad_request", "limit: an integer") from None
    state = (await js.stream_info(STREAM)).state
    if not state.messages:
        return []
    out: list[dict] = []
    end, size = state.last_seq, max(2 * limit, 64)
    while end >= state.first_seq and len(out) < limit:
        start = max(state.first_seq, end - size + 1)
        window, seq = [], start
        while seq <= end:
            try:
                msg = await js.get_msg(STREAM, seq=seq, subject=filt, next=True)
            except NotFoundError:
                break
            if msg.seq > end:
                break
            window.append(msg)
            seq = msg.seq + 1
        for msg in reversed(window):
            try:
                rec = orjson.loads(msg.data or b"")
                at = epoch(rec.get("at")) or 0.0
            except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                continue  # not a record (published by hand?): skipped
            if not isinstance(rec.get("action"), str) or not rec.get("audit_id"):
                continue  # not a record either: e.g. the server's answer to an API request, which a user
                # may have it store at any subject (docs/nats-security.md)
            if start_at is not None and at < start_at:
                return out
            out.append(rec)
            if len(out) >= limit:
                return out
        end, size = start - 1, size * 4
    return out
