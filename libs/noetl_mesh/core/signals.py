"""Whether a signal may be sent to an execution (D30): pure, from the execution's summary.

The gateway asks :func:`check` before it publishes ``signal.received``; the fold (``state._signal``)
applies the same rule to what is published, so a request that raced past the check changes nothing:
the oldest open wait of the name takes a signal, a signal with no open wait is kept for the next wait
of that name (one at most), and anything else is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .access import allowed
from .events import stable_id
from .state import FINAL


@dataclass(frozen=True)
class Refusal:
    status: int  # the HTTP status: 403, 409 or 422
    message: str
    location: str | None = None


def check(summary: dict[str, Any], name: str, payload: Any, *, user_id: str | None,
          roles: Iterable[str]) -> tuple[dict[str, Any] | None, Refusal | None]:
    """The open wait the signal goes to (None: kept for a later wait), or why it is refused. The wait's
    ``schema`` is checked apart, by :func:`schema_refusal` (its cost is bounded by the caller)."""
    execution_id = summary.get("execution_id")
    if summary.get("status") in FINAL:
        return None, Refusal(409, f"execution {execution_id} is already {summary['status']}")
    roles = list(roles)
    waits = [w for w in summary.get("waits") or () if w.get("kind") == "signal" and w.get("signal") == name]
    open_ = [w for w in waits if w.get("status") == "waiting"]
    wait = open_[0] if open_ else None
    if not may_answer(wait, summary.get("requested_by"), user_id=user_id, roles=roles):
        if wait is not None and wait.get("roles"):
            return wait, Refusal(403, f"signal {name!r}: the wait at step {wait.get('step')!r} takes it from the "
                                      f"roles {', '.join(wait['roles'])} only")
        return wait, Refusal(403, f"signal {name!r}: only who may cancel execution {execution_id} may signal it "
                                  "(execution.cancel.any, or having started it)")
    if wait is None:
        if name in (summary.get("kept_signals") or ()):
            return None, Refusal(409, f"signal {name!r} was already sent and waits for its wait to begin")
        if waits:
            return None, Refusal(409, f"signal {name!r}: its wait at step {waits[-1].get('step')!r} has already "
                                      f"{'resumed' if waits[-1].get('status') != 'waiting' else 'begun'}")
        return None, None  # early: kept until a wait of that name begins
    return wait, None


def schema_refusal(name: str, schema: Any, payload: Any) -> Refusal | None:
    """422 naming where and why ``payload`` breaks the wait's JSON Schema (the first error found), or
    None. Its cost depends on the schema's patterns and combinators, which a playbook author writes:
    the gateway runs it in a child process with a time limit (``limits.signal_check_seconds``)."""
    from jsonschema import Draft202012Validator

    first = next(Draft202012Validator(schema).iter_errors(payload), None)
    if first is None:
        return None
    where = "body" + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in first.absolute_path)
    return Refusal(422, f"signal {name!r}: the payload does not match the wait's schema: {first.message}", where)


def may_answer(wait: dict[str, Any] | None, started_by: str | None, *, user_id: str | None,
               roles: Iterable[str]) -> bool:
    """D30: the wait's ``roles`` (admins always), or without any, who may cancel the execution."""
    roles = set(roles)
    if wait is not None and wait.get("roles"):
        return bool(set(wait["roles"]) & roles) or "admin" in roles
    return started_by == user_id or allowed(roles, "execution.cancel.any")


def signal_id(execution_id: str, name: str, summary: dict[str, Any]) -> str:
    """The event id of the next signal of ``name``: two requests that saw the same state make the same
    id, so JetStream stores only the first (``Nats-Msg-Id``) and the second is refused."""
    return stable_id("signal", execution_id, name, (summary.get("signals") or {}).get(name, 0))
