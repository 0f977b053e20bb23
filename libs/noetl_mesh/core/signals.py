"""Whether a signal may be sent to an execution (D30): pure, from the execution's summary.

The gateway asks :func:`check` before it publishes ``signal.received``; the fold (``state._signal``)
applies the same rule to what is published, so a request that raced past the check changes nothing:
the oldest open wait of the name takes a signal, a signal with no open wait is kept for the next wait
of that name (one at most), and anything else is refused.

A payload reaches a wait only once it has been checked against that wait's ``schema``: by the
gateway when the wait is open as the signal is sent (:func:`schema_refusal`, in a child process with a
time limit; the event names the wait it was checked for), else by the control plane when the signal
and the open wait meet (a signal kept before its wait began, or one sent while the gateway saw no
wait): admission or the loop-coordinator decides with :func:`early_refusal`, a bounded check that runs
no regular expression, and records the verdict (``signal.checked``), which the fold applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .access import allowed
from .events import stable_id
from .state import FINAL


MAX_MESSAGE = 500  # characters of a schema error kept (jsonschema's quote the value, which may be large)


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

    try:
        return _first_error(name, Draft202012Validator(schema, registry=_registry()), payload)
    except RecursionError:
        return Refusal(422, f"signal {name!r}: the wait's schema refers to itself without end", "body")
    except Exception as exc:  # noqa: BLE001 - a schema that cannot be evaluated (a $ref elsewhere, ...)
        return Refusal(422, f"signal {name!r}: the wait's schema cannot be evaluated "
                            f"({type(exc).__name__}: {str(exc)[:200]})", "body")


def _registry() -> Any:
    """The JSON Schema specifications' own documents and nothing else: a ``$ref`` to any other URL is
    unresolvable (an error), never fetched (jsonschema fetches remote references by default: a playbook
    author could make the checker call any address)."""
    from jsonschema_specifications import REGISTRY

    return REGISTRY


def _first_error(name: str, validator: Any, payload: Any) -> Refusal | None:
    first = next(validator.iter_errors(payload), None)
    if first is None:
        return None
    where = "body" + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in first.absolute_path)
    why = first.message if len(first.message) <= MAX_MESSAGE else first.message[:MAX_MESSAGE] + "…"
    return Refusal(422, f"signal {name!r}: the payload does not match the wait's schema: {why}", where)


# ------------------------------------------------------------------------------ the bounded check
class _Unchecked(Exception):
    """The bounded check cannot answer: the schema needs what it does not run, or the budget ran out."""


# keywords whose work the count below cannot bound: regular expressions (a backtracking pattern cannot be
# stopped inside Python), and the unevaluated* keywords (they walk the schema's subschemas on their own)
_NOT_RUN = {"pattern": "a pattern", "patternProperties": "patternProperties",
            "unevaluatedProperties": "unevaluatedProperties", "unevaluatedItems": "unevaluatedItems"}


def early_refusal(name: str, schema: Any, payload: Any, steps: int) -> Refusal | None:
    """:func:`schema_refusal`'s answer for a signal that meets its wait in the control plane, with its
    work bounded and nothing run that could not be bounded: every keyword evaluation is counted (with
    the length of the instance and of the keyword's value, more for ``enum``, ``const`` and
    ``uniqueItems``, which compare values), and past ``steps`` (``limits.signal_check_steps``) the check
    stops. A schema whose check needs a regular expression (``pattern``, ``patternProperties``) or the
    ``unevaluated*`` keywords, or would pass the budget, or cannot be evaluated (a ``$ref`` to another
    document), refuses the signal too, saying why: it is checked in full only where it can be stopped,
    at the gateway, when the signal is sent to a wait that has begun. Deterministic: the same schema and
    payload give the same answer (the decider records it; replay folds the record)."""
    from jsonschema import Draft202012Validator
    from jsonschema.validators import extend

    left = [steps - _nodes(payload, steps)]
    if left[0] < 0:
        return _unchecked(name, f"the payload has more than {steps} values")

    def charge(n: int) -> None:
        left[0] -= n
        if left[0] < 0:
            raise _Unchecked(f"its check would take more than {steps} steps")

    def counted(keyword: str, fn: Any) -> Any:
        def run(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
            if keyword in _NOT_RUN or (keyword == "additionalProperties" and "patternProperties" in schema):
                raise _Unchecked(f"its schema uses {_NOT_RUN.get(keyword, 'patternProperties')}")
            size = len(instance) if isinstance(instance, (list, dict)) else 1
            cost = 1 + size + (len(value) if isinstance(value, (list, dict)) else 0)
            if keyword == "enum" and isinstance(value, list):
                cost += len(value) * _nodes(instance, steps)
            elif keyword == "const":
                cost += _nodes(instance, steps)
            elif keyword == "uniqueItems" and isinstance(instance, list):
                cost += size * _nodes(instance, steps)
            charge(cost)
            return fn(validator, value, instance, schema)
        return run

    base = Draft202012Validator
    bounded = extend(base, {k: counted(k, fn) for k, fn in base.VALIDATORS.items()})
    try:
        return _first_error(name, bounded(schema, registry=_registry()), payload)
    except _Unchecked as exc:
        return _unchecked(name, str(exc))
    except RecursionError:
        return _unchecked(name, "its schema refers to itself without end")
    except Exception as exc:  # noqa: BLE001 - a schema the checker cannot evaluate (a $ref elsewhere, ...)
        return _unchecked(name, f"its schema cannot be evaluated ({type(exc).__name__}: {str(exc)[:200]})")


def _unchecked(name: str, why: str) -> Refusal:
    return Refusal(422, f"signal {name!r} came before its wait and could not be checked against the wait's "
                        f"schema when the wait began: {why}; send it again now that the wait has begun "
                        "(the gateway checks it in full)", "body")


def _nodes(value: Any, cap: int) -> int:
    """How many JSON values ``value`` holds (itself included; a long string counts once per KiB), counting
    no further than ``cap`` (then ``cap + 1``)."""
    count, todo = 0, [value]
    while todo and count <= cap:
        item = todo.pop()
        count += 1 + (len(item) >> 10 if isinstance(item, str) else 0)
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return count


def may_answer(wait: dict[str, Any] | None, started_by: str | None, *, user_id: str | None,
               roles: Iterable[str]) -> bool:
    """D30: the wait's ``roles`` (admins always), or without any, who may cancel the execution."""
    roles = set(roles)
    if wait is not None and wait.get("roles"):
        return bool(set(wait["roles"]) & roles) or "admin" in roles
    return started_by == user_id or allowed(roles, "execution.cancel.any")


def roles_refusal(name: str, step: str, wait: dict[str, Any], signal: dict[str, Any]) -> Refusal | None:
    """D30: a kept signal meeting a wait with ``roles``: refused unless the roles its sender's request
    carried when it was sent (``signal.received``'s ``roles``) include one of them, or ``admin``."""
    if not wait.get("roles"):
        return None
    sent = signal.get("roles")
    if isinstance(sent, list) and all(isinstance(r, str) for r in sent) and may_answer(wait, None, user_id=None, roles=sent):
        return None
    return Refusal(403, f"signal {name!r}: the wait at step {step!r} takes it from the roles "
                        f"{', '.join(map(str, wait['roles']))} only, and its sender had "
                        f"{', '.join(map(str, sent)) if isinstance(sent, list) and sent else 'none of them'}")


def signal_id(execution_id: str, name: str, summary: dict[str, Any]) -> str:
    """The event id of the next signal of ``name``: two requests that saw the same state make the same
    id, so JetStream stores only the first (``Nats-Msg-Id``) and the second is refused."""
    return stable_id("signal", execution_id, name, (summary.get("signals") or {}).get(name, 0))
