"""One command, run: the events a worker reports for a step run or a loop iteration.

The worker service is a thin shell around :func:`execute`: it pulls a command, calls this with the
tools and a ``publish`` coroutine, and acknowledges the command once the terminal event is stored.
Event ids are derived from the command and the task visit (D21), so a command redelivered after a
worker crash reproduces the ids of what was already reported and the log keeps each event once.

Keychain (D24): the command carries the playbook's keychain *declarations*; they are resolved here when
the command starts (``keychain_resolver`` fetches the stored credentials; the worker service binds it to
the command it holds) and every event published is masked with the resolved secret values (in every
encoded form, see ``keychain.Masker``), so no secret reaches a stream or the event log. The engine's own
fields are never masked: names and ids travel in the envelope, and in ``data`` an outcome's ``status``
and an error's ``kind`` and ``retryable`` (:data:`STRUCTURAL`: policies and arcs route on them). Secrets
that the ``secrets`` tool fetches mid-command (only credentials the keychain declares) are masked from
then on. ``on_secrets`` hears the command's secrets whenever they change (the service masks its logs
with them).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Mapping

from ..tools.secrets import SecretsTool
from .events import make_event, stable_id
from .keychain import Masker, Resolver, masker, resolve, secrets_of
from .pipeline import Note, run_pipeline

Publish = Callable[[dict[str, Any]], Awaitable[None]]


async def execute_command(
    command: Mapping[str, Any],
    tools: Mapping[str, Any],
    publish: Publish,
    *,
    source: str = "worker",
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    keychain_resolver: Resolver | None = None,
    on_secrets: Callable[[list[str]], Any] | None = None,
    note: Note | None = None,
) -> list[dict[str, Any]]:
    """Run a command: one step run or iteration, or a chunk of loop iterations run concurrently
    (each exactly as if it had come alone, with its own ids).

    ``keychain_resolver(execution_id, declarations) -> {name: entry}`` resolves the ``credential``
    entries of the command's keychain (``static`` and ``env`` entries are resolved here); without it
    credential entries stay unresolved. Every event is published masked (D24): with the keychain's
    values, and with the values the ``secrets`` tool fetches, from the fetch on (a ``secrets`` tool over
    the resolver is provided when ``tools`` has none), and those the resolver fetched by name earlier in
    the execution (``known_secrets``: this worker only). ``on_secrets(secrets)`` is called with the
    command's secrets when it starts and whenever they change."""
    execution_id = command["execution_id"]
    declarations = command.get("keychain")
    keychain = await resolve(declarations, execution_id, keychain_resolver)
    secrets = secrets_of(keychain)
    command = {**command, "keychain": keychain}
    fetched: set[str] = set()  # values the secrets tool fetches during this command
    if keychain_resolver is not None and "secrets" not in tools:
        tools = {**tools, "secrets": SecretsTool(keychain_resolver, sink=fetched, keychain=declarations)}
    known = getattr(keychain_resolver, "known_secrets", None)  # fetched earlier in the execution (same worker)

    def current() -> list[str]:
        extra = fetched.union(known(execution_id)) if known is not None else fetched
        return secrets + [s for s in extra if s not in secrets] if extra else secrets

    heard: list[list[str]] = [[]]

    def current_masker() -> Masker:
        now = current()
        if on_secrets is not None and now != heard[0]:
            heard[0] = now
            on_secrets(now)
        return masker(now)

    if secrets or keychain_resolver is not None:
        current_masker()
        raw_publish = publish

        async def publish(event: dict[str, Any]) -> None:  # noqa: F811 - the masking wrapper
            await raw_publish(_masked(event, current_masker()))

    terminals = await _execute_all(command, tools, publish, source=source, sleep=sleep, note=note)
    final = current_masker()
    return [_masked(t, final) for t in terminals] if final else terminals


# What the engine routes on inside an event's data (and inside an outcome): never masked.
STRUCTURAL = (("status",), ("error", "kind"), ("error", "retryable"), ("outcome", "status"),
              ("outcome", "error", "kind"), ("outcome", "error", "retryable"))


def _mask_keeping_structure(value: Any, mask: Masker) -> Any:
    """``mask(value)`` with the :data:`STRUCTURAL` fields of ``value`` as they were."""
    masked = mask(value)
    if masked is value or not isinstance(value, dict) or not isinstance(masked, dict):
        return masked
    for path in STRUCTURAL:
        original, here = value, masked
        for key in path[:-1]:
            original = original.get(key) if isinstance(original, dict) else None
            nxt = here.get(key) if isinstance(here, dict) else None
            if not isinstance(original, dict) or not isinstance(nxt, dict):
                break
            here[key] = nxt = dict(nxt)
            here = nxt
        else:
            if isinstance(original, dict) and path[-1] in original and isinstance(here, dict):
                kept = original[path[-1]]
                if isinstance(kept, (str, bool)) or kept is None:
                    here[path[-1]] = kept
    return masked


def _masked(event: dict[str, Any], mask: Masker) -> dict[str, Any]:
    """The event with its ``data`` (outcomes, results, errors, ctx patches) masked but for the
    :data:`STRUCTURAL` fields; the envelope holds only ids and names from the playbook, which routing
    needs intact. In ``task.suspended`` only the values are masked: the child's id, path and version and
    the continuation's position and task names are what the control plane acts on (a keychain value
    that happens to be part of a name must not break it)."""
    data = event.get("data")
    if data is None:
        return event
    if event["name"] == "task.suspended":
        cont = data.get("continuation") or {}
        cont = {**cont, **{k: mask(cont.get(k)) for k in ("iter", "ctx_patch")},
                "last": _mask_keeping_structure(cont.get("last"), mask),
                "outcomes": {n: _mask_keeping_structure(v, mask) for n, v in (cont.get("outcomes") or {}).items()}}
        if "wait" in data:  # D30: what a person sees in the inbox is masked, the signal's name is not
            wait = data["wait"] or {}
            wait = {**wait, **{k: mask(wait[k]) for k in ("assignee", "form") if k in wait}}
            return {**event, "data": {**data, "wait": wait, "continuation": cont}}
        child = data.get("child") or {}
        child = {**child, **{k: mask(child.get(k)) for k in ("workload", "args", "iter_parent")}}
        return {**event, "data": {**data, "child": child, "continuation": cont}}
    masked = _mask_keeping_structure(data, mask)
    return event if masked is data else {**event, "data": masked}


async def _execute_all(command: Mapping[str, Any], tools: Mapping[str, Any], publish: Publish, *, source: str,
                       sleep: Callable[[float], Awaitable[Any]], note: Note | None) -> list[dict[str, Any]]:
    chunk = command.get("chunk")
    if not chunk:
        return [await execute(command, tools, publish, source=source, sleep=sleep, note=note)]
    subs = [{**command, "chunk": None, **entry} for entry in chunk]
    return list(await asyncio.gather(*(execute(sub, tools, publish, source=source, sleep=sleep, note=note)
                                       for sub in subs)))


async def execute(
    command: Mapping[str, Any],
    tools: Mapping[str, Any],
    publish: Publish,
    *,
    source: str = "worker",
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    note: Note | None = None,
) -> dict[str, Any]:
    """Run the command's pipeline, publishing every event; return the terminal event. ``note``: see
    :func:`pipeline.run_pipeline`."""
    execution_id = command["execution_id"]
    step, run_id, iteration = command["step"], command["step_run_id"], command.get("iteration")
    cid = command["command_id"]
    ids = {"step": step, "step_run_id": run_id, "iteration": iteration}

    def event(name: str, *, status: str = "success", task: str | None = None, data: dict | None = None,
              key: Any = None, **kw: Any) -> dict[str, Any]:
        return make_event(name, execution_id, event_id=stable_id(cid, name, key), source=source, status=status,
                          task=task, data=data, **ids, **kw)

    if iteration is None and not command.get("resume"):
        await publish(event("step.started", status="in_progress"))

    async def emit(name: str, fields: dict[str, Any]) -> None:
        aid, attempt = fields.get("action_id"), fields.get("attempt")
        if name == "ctx.patched":
            await publish(event(name, task=fields.get("task"), data={"patch": fields["patch"]},
                                key=(aid, attempt, "ctx"), action_id=aid))
            return
        status = "in_progress" if name == "task.started" else (
            "success" if (fields.get("outcome") or {}).get("status") == "ok" else "error")
        data = {"outcome": fields["outcome"]} if "outcome" in fields else {}
        await publish(event(name, status=status, task=fields.get("task"), data=data, key=(aid, attempt),
                            action_id=aid, attempt=attempt, task_run_id=aid))

    result = await run_pipeline(dict(command), tools, emit, sleep=sleep, note=note)
    if result.suspend is not None:
        # A `playbook` task: the run waits for its child without holding this worker (the command is
        # acknowledged); the control plane starts the child and, when it ends, sends a resume command.
        s = result.suspend
        what = {"wait": s["wait"]} if "wait" in s else {"child": s["child"]}
        suspended = event("task.suspended", status="paused", task=s["task"], key=(s["action_id"], s["attempt"]),
                          data={**what, "continuation": s["continuation"]},
                          action_id=s["action_id"], attempt=s["attempt"], task_run_id=s["action_id"])
        await publish(suspended)
        return suspended
    ok = result.status == "ok"
    if iteration is None:
        name = "step.done" if ok else "step.failed"
    else:
        name = "loop.iteration.done" if ok else "loop.iteration.failed"
    terminal = event(name, status="success" if ok else "error",
                     data={"result": result.result, "error": result.error, "iter": result.iter})
    await publish(terminal)
    return terminal
