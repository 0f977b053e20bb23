"""The worker side of one step run: a task pipeline under task policies (D6-D12, D21).

Pure logic: no I/O of its own. The tools (kind -> :class:`~noetl_mesh.tools.base.Tool`), the event
sink (``emit``), the clock-free ``sleep`` and the jitter source ``rng`` are injected, so the control
flow is tested with fake tools and a fake sleep.

One call of :func:`run_pipeline` runs one pipeline run: a step run outside loops, or one iteration of a
loop step (D9: ``max_steps`` counts per pipeline run). It emits ``task.started`` / ``task.processed``
around every attempt and ``ctx.patched`` whenever a rule's ``set_ctx`` applies; the worker shell wraps
them into event envelopes (D20) and turns the returned :class:`PipelineResult` into the terminal step
or iteration event. Every task's result is bounded by ``limits.max_result_bytes`` (its JSON size): a
bigger one makes the outcome an error of kind ``result_too_large`` that the task's policy routes (D9).
"""
from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import limits
from ..contracts import refs
from ..lang.durations import DurationError, parse_duration, parse_instant
from ..lang.model import KIND_DEFAULTS
from ..lang.normalize import effective_spec, normalize_workbook
from ..lang.templates import TemplateError, render, shared_budget, truthy, within_depth
from ..tools.base import ToolContext, result_too_large
from ..tools.noop import NoopTool
from .events import action_id as _action_id
from .events import stable_id

__all__ = ["Emit", "Note", "PipelineResult", "run_pipeline", "DEFAULT_MAX_STEPS", "retry_delay"]

Emit = Callable[[str, dict], Awaitable[None]]
Note = Callable[[str, dict], None]  # told of decisions the events do not carry (policy directives), for traces

DEFAULT_MAX_STEPS = 10_000  # D9
DEFAULT_RETRY_ATTEMPTS = 2  # a retry rule without `attempts`
DEFAULT_MAX_DELAY = 60.0  # D9

# Task fields that are never rendered: identity, layering, documentation; python's code is source (D25).
_NOT_RENDERED = frozenset({"name", "kind", "spec", "desc"})
_NOT_RENDERED_PY = _NOT_RENDERED | {"code"}
_ARGS_KEYS = ("args", "input", "with")  # a workbook call's args and their aliases (model.WorkbookTask)
# Scope names that are not task outcomes (never saved in nor restored from a continuation).
_RESERVED = frozenset({"workload", "ctx", "iter", "args", "execution_id", "keychain", "_prev", "_task",
                       "_attempt", "outcome", "output"})

_SIGNAL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\Z")  # D30: a signal's name is one URL path segment
_SCALARS = frozenset({bool, int, float})  # results whose JSON is a few bytes (ints: at most 4,300 digits)
_OK_DIRECTIVE = {"do": "continue"}  # D9: no policy, ok outcome
_ERROR_DIRECTIVE = {"do": "fail"}  # D9: no policy, error outcome
_NO_MATCH_DIRECTIVE = {"do": "continue"}  # D9: a policy with no match and no else


@dataclass(slots=True)
class PipelineResult:
    """What a pipeline run ended with.

    ``status`` ``ok`` or ``error``. ``result`` is the result of the last task executed (D11), also when
    the run failed; ``error`` the failing outcome's error (``None`` when ok). ``iter`` is the final
    iteration scope (the command's ``iter`` with ``set_iter`` writes, or the scratch scope outside
    loops); ``ctx_patch`` the union of this run's ``set_ctx`` patches (last writer wins per key, D12);
    ``visits`` the number of task visits started (retries excluded, D9).

    ``status`` ``suspended``: the run stopped at a ``playbook`` task to wait for a child execution;
    ``suspend`` holds ``{child, continuation, task, action_id, attempt}`` — the child to start and what
    a resume command needs to go on from that task (see :func:`run_pipeline`).
    """

    status: str
    result: Any
    error: dict | None
    iter: dict
    ctx_patch: dict = field(default_factory=dict)
    visits: int = 0
    suspend: dict | None = None


class _Suspend:
    """What a ``playbook`` or ``wait`` task hands back instead of an outcome: the child execution to
    start, or what to wait for (D29 b, D30)."""

    __slots__ = ("child", "wait")

    def __init__(self, child: dict | None = None, wait: dict | None = None) -> None:
        self.child = child
        self.wait = wait


class _PolicyError(Exception):
    """A task policy could not be applied (template error in a rule, jump to an unknown task...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _Cancelled(Exception):
    pass


# ------------------------------------------------------------------------------------------- helpers


def _err(kind: str, message: str, retryable: bool = False) -> dict:
    return {"kind": kind, "message": message, "retryable": retryable}


def _view(outcome: dict) -> dict:
    """An outcome as templates see it: ``data`` is an alias of ``result`` (D8)."""
    v = dict(outcome)
    v["data"] = outcome.get("result")
    return v


def _step_view(entry: Any) -> Any:
    if isinstance(entry, dict) and "result" in entry and "data" not in entry:
        v = dict(entry)
        v["data"] = entry["result"]
        return v
    return entry


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNIT = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}


def _seconds(value: Any, what: str) -> float:
    """A delay in seconds from a number or a string such as ``"1.5"``, ``"500ms"``, ``"5s"``, ``"2m"``."""
    if isinstance(value, bool):
        raise _PolicyError("policy_error", f"{what}: expected seconds, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _UNIT[m.group(2)]
    if value is None:
        return 0.0
    raise _PolicyError("policy_error", f"{what}: expected seconds, got {value!r}")


def retry_delay(then: Mapping[str, Any], attempt: int, rng: Callable[[], float], delay: float) -> float:
    """D9: the delay before attempt ``attempt + 1`` (``attempt`` is the one that just ended, 1-based).

    ``delay`` × 1 (``none``), × n (``linear``), × 2^(n-1) (``exponential``), capped by ``max_delay``
    (default 60 s); with ``jitter: true`` the capped delay is multiplied by a factor in [0.5, 1.5)
    drawn from ``rng`` (so jitter spreads a capped delay too, like the usual capped backoff + jitter).
    """
    backoff = then.get("backoff") or "none"
    if backoff == "linear":
        d = delay * attempt
    elif backoff == "exponential":
        d = delay * (2 ** (attempt - 1))
    else:
        d = delay
    max_delay = then.get("max_delay")
    cap = DEFAULT_MAX_DELAY if max_delay is None else float(max_delay)
    if d > cap:
        d = cap
    if then.get("jitter"):
        d *= 0.5 + rng()
    return d


def _compile_policy(task: Mapping[str, Any]) -> tuple[list[tuple[int, Any, dict]], dict | None] | None:
    """``(when rules [(index, when, then)], else then)`` of a task's ``spec.policy``; None without one.

    The policy is read from the task's own ``spec`` (D9: ``task.spec.policy.rules``; control
    rules on a step's spec are a validation error).
    """
    spec = task.get("spec")
    if not spec:
        return None
    policy = spec.get("policy")
    if not isinstance(policy, Mapping):
        return None
    rules = policy.get("rules")
    if rules is None:
        return None
    whens: list[tuple[int, Any, dict]] = []
    else_then: dict | None = None
    for i, rule in enumerate(rules):
        if "else" in rule:
            if else_then is None:
                body = rule["else"] or {}
                else_then = dict(body.get("then") or {})
        else:
            whens.append((i, rule.get("when"), dict(rule.get("then") or {})))
    return whens, else_then


# ------------------------------------------------------------------------------------------ pipeline


async def run_pipeline(
    command: Mapping[str, Any],
    tools: Mapping[str, Any],
    emit: Emit,
    *,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    rng: Callable[[], float] = random.random,
    cancel: asyncio.Event | None = None,
    note: Note | None = None,
) -> PipelineResult:
    """Run the command's task pipeline (D9) and return how it ended.

    ``note(what, fields)``: told of what the events do not say, for the shell's traces: ``"policy"``
    when a task's policy chose a directive (``task``, ``attempt``, ``iteration``, ``do``, ``to``,
    ``delay`` of a retry).

    ``cancel``: when given and set, the running tool call is abandoned (its task cancelled) and the
    pipeline ends failed with error kind ``cancelled``; tools also see it as ``ToolContext.cancel``.

    Child executions (``kind: playbook``): the task's inputs are rendered, then the run *suspends*
    instead of waiting, so the worker frees its slot (docs/dsl.md, "Child executions": a parent never
    holds a worker while its child runs). The result is ``status="suspended"`` with the child request
    and a continuation: the position (task, visit, attempt, action id), the run's ``set_iter``/``set_ctx`` writes, the
    previous result and the outcomes of the tasks that ran. When the child ends, the control plane
    sends a command with ``resume: {continuation, outcome}``; this function then restores the run and
    goes on as if the task had just returned ``outcome`` (its policy applies: retry starts a new child).
    """
    return await _Run(command, tools, emit, sleep, rng, cancel, note).run()


class _Run:
    """The state of one pipeline run. Plain attributes; the hot loop copies what it needs to locals."""

    __slots__ = (
        "tools", "emit", "sleep", "rng", "cancel", "execution_id", "step", "step_run_id", "iteration",
        "tasks", "layers", "max_steps", "ctx", "iter", "scope", "ctx_patch", "visits", "last", "specs",
        "workbook", "resume", "last_task", "note",
    )

    def __init__(
        self,
        command: Mapping[str, Any],
        tools: Mapping[str, Any],
        emit: Emit,
        sleep: Callable[[float], Awaitable[Any]],
        rng: Callable[[], float],
        cancel: asyncio.Event | None,
        note: "Note | None" = None,
    ) -> None:
        self.tools, self.emit, self.sleep, self.rng, self.cancel = tools, emit, sleep, rng, cancel
        self.note = note
        self.execution_id = command["execution_id"]
        self.step = command["step"]
        self.step_run_id = command.get("step_run_id")
        self.iteration = command.get("iteration")
        self.tasks: list[dict] = command.get("tasks") or []
        # Root workbook tasks by name (validated documents arrive as a list; a mapping is accepted too).
        self.workbook: dict[str, dict] = {
            t["name"]: t for t in normalize_workbook(command.get("workbook")) if t.get("name") is not None
        }
        layers = command.get("spec_layers") or {}
        self.layers = (layers.get("executor"), layers.get("step"), layers.get("loop"))

        # D9: max_steps from the step's effective spec (D5 without the task level: inner layer wins).
        self.max_steps = DEFAULT_MAX_STEPS
        for layer in self.layers:
            if layer and layer.get("max_steps") is not None:
                self.max_steps = int(layer["max_steps"])

        # D6: one mutable render scope for the whole run (the template engine copies it per render).
        self.ctx = dict(command.get("ctx") or {})  # D12: this run's set_ctx patches apply here at once
        it = command.get("iter")
        self.iter = dict(it) if it else {}  # a scratch scope outside loops, so set_iter works there too
        scope: dict[str, Any] = {}
        for sname, entry in (command.get("steps") or {}).items():
            scope[sname] = _step_view(entry)  # {{ start.result }}; task names set later shadow these
        scope["workload"] = command.get("workload") or {}
        scope["ctx"] = self.ctx
        scope["iter"] = self.iter
        scope["args"] = command.get("args") or {}
        scope["execution_id"] = self.execution_id
        scope["keychain"] = command.get("keychain") or {}
        scope["_prev"] = None
        scope["_task"] = None
        scope["_attempt"] = 1
        self.scope = scope
        self.ctx_patch: dict[str, Any] = {}
        self.visits = 0
        self.last: dict | None = None  # the last outcome (D11)
        self.last_task: str | None = None  # the task that produced it
        self.specs: dict[str, dict] = {}  # effective task specs, once per task per run
        self.resume: Mapping[str, Any] | None = command.get("resume")

    def finish(self, status: str, error: dict | None) -> PipelineResult:
        """D11: the result of the last task executed, also when the run failed."""
        result = self.last["result"] if self.last is not None else None
        return PipelineResult(status, result, error, self.iter, self.ctx_patch, self.visits)

    async def run(self) -> PipelineResult:
        tasks, scope, emit, cancel = self.tasks, self.scope, self.emit, self.cancel
        step, iteration = self.step, self.iteration
        index = {t["name"]: i for i, t in enumerate(tasks)}
        policies: dict[str, Any] = {}
        pc = 0
        resumed = None
        if self.resume is not None:
            try:
                pc, resumed = self._restore(index, policies)
            except (KeyError, TypeError, ValueError) as e:
                return self.finish("error", _err("invalid_resume", f"step {step!r}: cannot resume: {e}"))
        while pc < len(tasks):
            task = tasks[pc]
            name = task["name"]
            kind = task.get("kind")
            if resumed is None:
                if self.visits >= self.max_steps:  # D9: so no jump cycle runs forever
                    return self.finish(
                        "error",
                        _err("max_steps_exceeded", f"step {step!r}: more than {self.max_steps} task visits (max_steps)"),
                    )
                aid = _action_id(self.execution_id, self.step_run_id, iteration, name, self.visits)  # D21
                self.visits += 1  # retries below keep the visit (and its action_id) and raise the attempt
                attempt = 1
            else:
                aid, attempt = resumed["action_id"], int(resumed["attempt"])
            if name in policies:
                policy = policies[name]
            else:
                policy = policies[name] = _compile_policy(task)
            tool = self.tools.get(kind)
            inline_noop = kind == "noop" and (tool is None or type(tool) is NoopTool)
            workbook = kind == "workbook"
            scope["_task"] = name
            while True:
                if resumed is not None:  # the child ended: its outcome is this attempt's outcome
                    scope["_attempt"] = attempt
                    outcome = dict(resumed["outcome"])
                    if outcome.get("result") is not None or outcome.get("error") is not None:
                        outcome = self._bounded(outcome, name)  # a child's result is a task's like any other
                    duration = max(0.0, time.time() - float(resumed.get("suspended_at") or time.time()))
                    resumed = None
                else:
                    if cancel is not None and cancel.is_set():
                        return self.finish("error", _err("cancelled", f"step {step!r} cancelled before task {name!r}"))
                    scope["_attempt"] = attempt
                    await emit("task.started", {"task": name, "attempt": attempt, "action_id": aid, "iteration": iteration})
                    t0 = time.perf_counter()
                    if inline_noop:
                        outcome = self._noop(task, name)
                    elif workbook:
                        outcome = await self._workbook(task, name, attempt, aid)
                    else:
                        outcome = await self._call_tool(task, kind, tool, name, attempt, aid)
                    if outcome.__class__ is _Suspend:
                        return self._suspended(outcome, pc, name, aid, attempt, policies)
                    if outcome["result"] is not None or outcome.get("error") is not None:
                        outcome = self._bounded(outcome, name)
                    duration = time.perf_counter() - t0
                outcome["meta"] = {
                    "attempt": attempt,
                    "duration_ms": round(duration * 1000.0, 3),
                    "action_id": aid,
                }
                await emit(
                    "task.processed",
                    {"task": name, "attempt": attempt, "action_id": aid, "iteration": iteration, "outcome": outcome},
                )
                self.last = outcome
                self.last_task = name
                view = _view(outcome)
                scope[name] = view  # D6: a finished task is readable by name
                if cancel is not None and cancel.is_set() and (outcome["error"] or {}).get("kind") == "cancelled":
                    return self.finish("error", outcome["error"])

                # D9: choose the directive; set_iter / set_ctx of the chosen rule apply first.
                try:
                    if policy is None:
                        then = _OK_DIRECTIVE if outcome["status"] == "ok" else _ERROR_DIRECTIVE
                    else:
                        then = await self._apply_policy(policy, view, name, aid)
                    do = then.get("do") or "continue"
                    if do != "retry":
                        if policy is not None and self.note is not None:
                            self.note("policy", {"task": name, "attempt": attempt, "iteration": iteration, "do": do,
                                                 "to": then.get("to")})
                        break
                    attempts = then.get("attempts")
                    attempts = DEFAULT_RETRY_ATTEMPTS if attempts is None else int(attempts)
                    if attempt >= attempts:
                        # D9: attempts ran out: the last outcome stands and the pipeline fails.
                        if self.note is not None:
                            self.note("policy", {"task": name, "attempt": attempt, "iteration": iteration,
                                                 "do": "retry", "exhausted": True})
                        return self.finish(
                            "error",
                            outcome["error"] or _err("retries_exhausted", f"task {name!r}: {attempts} attempts exhausted"),
                        )
                    delay = self._delay(then, attempt, view, name)
                    if self.note is not None:
                        self.note("policy", {"task": name, "attempt": attempt, "iteration": iteration, "do": "retry",
                                             "delay": delay})
                    await self.sleep(delay)
                    attempt += 1
                except _PolicyError as e:
                    return self.finish("error", _err(e.kind, e.message))

            scope["_prev"] = outcome["result"]
            if do == "continue":
                pc += 1
            elif do == "jump":
                target = then.get("to")
                if target not in index:
                    return self.finish("error", _err("policy_error", f"task {name!r}: jump to unknown task {target!r}"))
                pc = index[target]
            elif do == "break":
                return self.finish("ok", None)
            elif do == "fail":
                if outcome["status"] == "error" and outcome["error"]:
                    return self.finish("error", outcome["error"])
                return self.finish("error", _err("policy_fail", f"task {name} failed by policy"))
            else:
                return self.finish("error", _err("policy_error", f"task {name!r}: unknown directive {do!r}"))
        return self.finish("ok", None)

    def _bounded(self, outcome: dict, name: str) -> dict:
        """The outcome as it can be sent, for every kind, whatever the tool checked: a
        ``result_too_large`` error in its place (the tool's own details kept) when its result's JSON is
        over ``max_result_bytes``; a ``tool_error`` when its result or error is not JSON the bus can
        encode (an integer past 64 bits, say) or holds a payload reference (D23: only the engine writes
        one, contracts/refs.py)."""
        result, error, limit = outcome["result"], outcome.get("error"), limits.current().max_result_bytes
        if error is not None and (wrong := refs.unsendable(error, limits.current().max_value_depth)) is not None:
            return {**outcome, "status": "error", "result": None,
                    "error": _err("tool_error", f"task {name!r}: its {refs.shown(('error', *wrong[0]))}: {wrong[1]}")}
        if result is None or (result.__class__ in _SCALARS and (result.__class__ is not int or refs.INT_MIN <= result <= refs.INT_MAX)) \
                or (result.__class__ is str and 6 * len(result) + 2 <= limit):
            return outcome  # cannot be over (a character is at most 6 bytes of JSON)
        depth = limits.current().max_value_depth
        try:
            data = refs.encoded_within(result, depth)  # as the bus encodes it
        except (TypeError, ValueError, RecursionError) as e:  # it could not be published either
            why = f"it nests lists and mappings deeper than {depth} levels (the limit max_value_depth)" \
                if refs.nested_too_deep(e) else f"it is not JSON-serialisable: {e}"
            return {**outcome, "status": "error", "result": None, "error": _err("tool_error", f"task {name!r}: the result: {why}")}
        if len(data) > limit:
            return {**outcome, **result_too_large(self.step, name, len(data))}
        if refs.MARKER in data and (at := refs.forged(result)) is not None:
            return {**outcome, "status": "error", "result": None,
                    "error": _err("tool_error", refs.refusal(f"task {name!r}: its {refs.shown(('result', *at))}"))}
        return outcome

    def _suspended(self, suspend: _Suspend, pc: int, name: str, aid: str, attempt: int,
                   policies: Mapping[str, Any]) -> PipelineResult:
        """Stop at a ``playbook`` task: the child to start and how to go on when it ends."""
        scope = self.scope
        # the outcomes of the tasks that ran (every visited task's name is a key of ``policies``), each
        # once: without the ``data`` alias, and the last one (``_prev`` is its result) by name
        outcomes = {n: {k: v for k, v in scope[n].items() if k != "data"}
                    for n in policies if n != name and n in scope and n not in _RESERVED}
        continuation = {
            "pc": pc, "task": name, "action_id": aid, "attempt": attempt, "visits": self.visits,
            "iter": self.iter, "ctx_patch": self.ctx_patch, "outcomes": outcomes, "suspended_at": time.time(),
        }
        if self.last is not None:
            if self.last_task in outcomes:
                continuation["last_task"] = self.last_task
            else:  # the playbook task itself ran before (a jump back to it)
                continuation["last"] = self.last
        result = self.finish("suspended", None)
        result.suspend = {"continuation": continuation, "task": name, "action_id": aid, "attempt": attempt,
                          **({"wait": suspend.wait} if suspend.wait is not None else {"child": suspend.child})}
        return result

    def _restore(self, index: Mapping[str, int], policies: dict[str, Any]) -> tuple[int, dict]:
        """Put a suspended run back where it stopped (see :meth:`_suspended`)."""
        resume = self.resume or {}
        cont = resume["continuation"]
        name = cont["task"]
        pc = int(cont["pc"])
        if index.get(name) != pc:
            raise ValueError(f"task {name!r} is not at position {pc} of the step's pipeline")
        self.visits = int(cont["visits"])
        self.iter.update(cont.get("iter") or {})
        patch = cont.get("ctx_patch") or {}
        self.ctx.update(patch)  # D12: the run's own writes win over the ctx the command carries
        self.ctx_patch.update(patch)
        scope = self.scope
        outcomes = cont.get("outcomes") or {}
        for task_name, outcome in outcomes.items():
            if task_name in index and task_name not in _RESERVED:
                scope[task_name] = _view(outcome)
                policies[task_name] = _compile_policy(self.tasks[index[task_name]])
        self.last = outcomes.get(cont["last_task"]) if cont.get("last_task") else cont.get("last")
        self.last_task = cont.get("last_task")
        scope["_prev"] = self.last["result"] if self.last is not None else None
        outcome = resume["outcome"]
        if not isinstance(outcome, Mapping):
            raise TypeError("the resume outcome is not a mapping")
        return pc, {"outcome": _normalise(outcome), "action_id": cont["action_id"],
                    "attempt": cont.get("attempt", 1), "suspended_at": cont.get("suspended_at")}

    def _child(self, rendered: Mapping[str, Any], name: str, attempt: int, aid: str, where: str,
               caller_args: dict | None) -> dict | _Suspend:
        """``kind: playbook`` with its fields rendered: the child execution to request, or an error
        outcome when the fields are unusable."""
        path = rendered.get("path")
        if not isinstance(path, str) or not path.strip():
            return {"status": "error", "result": None,
                    "error": _err("invalid_task", f"{where}.path must be a catalog path, got {path!r}")}
        args = next((rendered[k] for k in ("args", "input") if k in rendered), None)
        workload = rendered.get("workload")
        for key, value in (("args", args), ("workload", workload)):
            if value is not None and not isinstance(value, Mapping):
                return {"status": "error", "result": None,
                        "error": _err("invalid_task", f"{where}.{key} must be a mapping, got {type(value).__name__}")}
        args = {**(args or {}), **(caller_args or {})}
        version = rendered.get("version")
        if version is not None and not isinstance(version, (int, str)):
            return {"status": "error", "result": None,
                    "error": _err("invalid_task", f"{where}.version must be a number, got {version!r}")}
        return _Suspend({
            "execution_id": stable_id("child", self.execution_id, aid, attempt),  # D21: a redelivery asks again
            "path": path.strip(), "version": version, "workload": dict(workload or {}), "args": args,
            # D19: the calling iteration's scope becomes iter.parent in the child's loops
            "iter_parent": dict(self.iter) if self.iteration is not None else None,
        })

    def _wait(self, rendered: Mapping[str, Any], attempt: int, aid: str, where: str) -> dict | _Suspend:
        """``kind: wait`` with its fields rendered (D29 b, D30): what to wait for, with instants
        computed now (a templated duration or instant is checked here), or an error outcome."""
        now = time.time()
        maximum = limits.current().max_timer_seconds
        wait: dict[str, Any] = {"wait_id": stable_id("wait", self.execution_id, aid, attempt), "suspended_at": now}
        try:
            if rendered.get("signal") is not None:
                signal = rendered["signal"]
                if not isinstance(signal, str) or not _SIGNAL_NAME.match(signal):
                    raise DurationError(f"signal must be a name of letters, digits, '.', '-', '_' (at most 128), "
                                        f"got {str(signal)[:80]!r}")
                wait["signal"] = signal
                for key in ("roles", "schema", "assignee", "form"):
                    if rendered.get(key) is not None:
                        wait[key] = rendered[key]
                if rendered.get("timeout") is not None:
                    seconds = parse_duration(rendered["timeout"], maximum=maximum)
                    wait["timeout"], wait["timeout_at"] = rendered["timeout"], now + seconds
            elif rendered.get("until") is not None:
                due = parse_instant(rendered["until"])
                if due - now > maximum:
                    raise DurationError(f"until {rendered['until']!r} is more than max_timer_seconds ({maximum:g} s) away")
                wait["due"] = max(now, due)
            else:
                wait["due"] = now + parse_duration(rendered.get("duration"), maximum=maximum)
        except DurationError as e:
            return {"status": "error", "result": None, "error": _err("invalid_task", f"{where}: {e}")}
        return _Suspend(wait=wait)

    def _noop(self, task: dict, name: str, where: str | None = None) -> dict:
        """D10, inline: the ``result:`` field (rendered) when given, else the previous task's result."""
        if "result" not in task:
            return {"status": "ok", "result": self.scope["_prev"], "error": None}
        try:
            value = render(task["result"], self.scope, f"{where or f'{self.step}.{name}'}.result")
        except TemplateError as e:
            return {"status": "error", "result": None, "error": _err("template_error", str(e))}
        return {"status": "ok", "result": value, "error": None}

    async def _apply_policy(self, policy: tuple[list[tuple[int, Any, dict]], dict | None], view: dict,
                            name: str, aid: str) -> dict:
        """D9: first rule whose ``when`` is truthy, else ``else``, else continue; then its set_iter and
        set_ctx, rendered with ``outcome`` (alias ``output``) in scope."""
        scope = self.scope
        whens, else_then = policy
        where = f"{self.step}.{name}.spec.policy.rules"
        scope["outcome"] = view
        scope["output"] = view  # D8 alias
        patch = None
        try:
            then = None
            for i, when, rule_then in whens:
                if truthy(when, scope, f"{where}[{i}].when"):
                    then = rule_then
                    break
            if then is None:
                then = else_then if else_then is not None else _NO_MATCH_DIRECTIVE
            set_iter = then.get("set_iter")
            if set_iter:
                self.iter.update(within_depth(render(set_iter, scope, f"{where}.set_iter"), f"{where}.set_iter"))
            set_ctx = then.get("set_ctx")
            if set_ctx:
                patch = within_depth(render(set_ctx, scope, f"{where}.set_ctx"), f"{where}.set_ctx")
        except TemplateError as e:
            raise _PolicyError("template_error", str(e)) from None
        finally:
            del scope["outcome"], scope["output"]
        if patch:
            # D12: visible at once to later tasks; recorded as an event (last writer wins per key).
            self.ctx.update(patch)
            self.ctx_patch.update(patch)
            await self.emit("ctx.patched", {"task": name, "patch": patch, "action_id": aid})
        return then

    def _delay(self, then: Mapping[str, Any], attempt: int, view: dict, name: str) -> float:
        raw = then.get("delay", 0.0)
        if isinstance(raw, str) and "{" in raw:
            scope = self.scope
            scope["outcome"] = view
            scope["output"] = view
            try:
                raw = render(raw, scope, f"{self.step}.{name}.spec.policy.delay")
            except TemplateError as e:
                raise _PolicyError("template_error", str(e)) from None
            finally:
                del scope["outcome"], scope["output"]
        return retry_delay(then, attempt, self.rng, _seconds(raw, f"{self.step}.{name} retry delay"))

    async def _workbook(self, task: dict, name: str, attempt: int, aid: str) -> dict:
        """``kind: workbook``: run the root workbook task named by ``task:`` (default: this task's name).

        The caller's ``args`` (alias ``input``, ``with``), rendered in the caller's context, are bound
        as ``args`` while the workbook task's own fields render (the rest of the caller's context stays
        visible). The workbook task runs as its own kind, with its own fields, and its ``spec`` layered
        under the caller's task ``spec`` (D5: the caller's is innermost); a python workbook task also
        gets the caller's args merged over its own ``args`` (D25: bound as variables).

        Policy: per the issue, "the caller's policy applying to its outcome": the calling task's
        ``spec.policy`` (compiled in :meth:`run` from the caller task) decides on this outcome, and a
        workbook task's own ``spec.policy`` is ignored. The outcome is recorded under the caller's name.
        A missing workbook task, or one that is itself ``kind: workbook`` (no nesting), is an error
        outcome of kind ``invalid_task`` that goes through the caller's policy like any error.
        """
        target = task.get("task") or name
        wb = self.workbook.get(target)
        if wb is None:
            return {"status": "error", "result": None,
                    "error": _err("invalid_task", f"task {name!r}: no workbook task named {target!r}")}
        wkind = wb.get("kind")
        if wkind == "workbook":
            return {"status": "error", "result": None,
                    "error": _err("invalid_task", f"task {name!r}: workbook task {target!r} is itself of kind "
                                                  "'workbook' (workbook tasks do not nest)")}
        raw_args = next((task[k] for k in _ARGS_KEYS if k in task), None)
        scope = self.scope
        try:
            args = render(raw_args, scope, f"{self.step}.{name}.args") if raw_args is not None else {}
        except TemplateError as e:
            return {"status": "error", "result": None, "error": _err("template_error", str(e))}
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            return {"status": "error", "result": None,
                    "error": _err("invalid_task", f"task {name!r}: args must be a mapping, got {type(args).__name__}")}
        args = dict(args)
        where = f"{self.step}.{name}.workbook.{target}"
        saved = scope["args"]
        scope["args"] = args
        try:
            tool = self.tools.get(wkind)
            if wkind == "noop" and (tool is None or type(tool) is NoopTool):
                return self._noop(wb, name, where)
            return await self._call_tool(wb, wkind, tool, name, attempt, aid, where=where,
                                         caller_spec=task.get("spec"), caller_args=args)
        finally:
            scope["args"] = saved

    async def _call_tool(self, task: dict, kind: Any, tool: Any, name: str, attempt: int, aid: str, *,
                         where: str | None = None, caller_spec: Mapping[str, Any] | None = None,
                         caller_args: dict | None = None) -> dict:
        """Render the task's inputs and call its tool; always a normalised partial outcome (D8).

        For a workbook task (:meth:`_workbook`): ``where`` locates its fields in template errors,
        ``caller_spec`` is the calling task's spec (layered innermost) and ``caller_args`` the caller's
        rendered args (merged over a python task's own ``args``)."""
        if tool is None and kind not in ("playbook", "wait"):
            return {"status": "error", "result": None, "error": _err("tool_error", f"no tool for kind {kind!r}")}
        scope, step = self.scope, self.step
        where = where or f"{step}.{name}"
        skip = _NOT_RENDERED_PY if kind == "python" else _NOT_RENDERED
        rendered: dict[str, Any] = {}
        try:
            with shared_budget():  # one budget for all of one task's fields
                for key, value in task.items():
                    rendered[key] = value if key in skip else render(value, scope, f"{where}.{key}")
        except TemplateError as e:
            # An error outcome like any other: it goes through the task's policy (D9).
            return {"status": "error", "result": None, "error": _err("template_error", str(e))}
        if caller_args is not None and kind == "python":
            own = rendered.pop("args", None) if "args" in rendered else rendered.pop("input", None)
            if own is not None and not isinstance(own, Mapping):
                return {"status": "error", "result": None,
                        "error": _err("invalid_task", f"{where}.args must be a mapping, got {type(own).__name__}")}
            rendered["args"] = {**(own or {}), **caller_args}
        if kind == "playbook":  # a child execution: the control plane runs it, this run suspends
            return self._child(rendered, name, attempt, aid, where, caller_args)
        if kind == "wait":  # a durable wait: the control plane sets its timers, this run suspends
            return self._wait(rendered, attempt, aid, where)
        spec = self.specs.get(name)
        if spec is None:
            # D5: merge(KIND_DEFAULTS[kind], executor, step, loop, task.spec[, caller task.spec]).
            spec = self.specs[name] = effective_spec(KIND_DEFAULTS.get(kind), *self.layers, task.get("spec"))
            if caller_spec:
                spec = self.specs[name] = effective_spec(spec, None, None, None, caller_spec)
        tctx = ToolContext(
            execution_id=self.execution_id,
            step=step,
            task_name=name,
            timeout=spec.get("timeout"),
            cancel=self.cancel,
            step_run_id=self.step_run_id,
            iteration=self.iteration,
            attempt=attempt,
            action_id=aid,
            keychain=scope["keychain"],
            prev=scope["_prev"],
        )
        try:
            if self.cancel is None:
                partial = await tool.run(rendered, spec, tctx)
            else:
                partial = await _race(tool.run(rendered, spec, tctx), self.cancel)
                if partial is None:
                    return {"status": "error", "result": None, "error": _err("cancelled", f"task {name!r} cancelled")}
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a tool bug never crashes the pipeline
            return {"status": "error", "result": None, "error": _err("tool_error", f"{type(e).__name__}: {e}")}
        return _normalise(partial)


async def _race(coro: Awaitable[dict], cancel: asyncio.Event) -> dict | None:
    """The tool's outcome, or None when ``cancel`` was set first (the tool call is then cancelled)."""
    if cancel.is_set():
        coro.close()  # type: ignore[attr-defined]
        return None
    run = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait((run, waiter), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        run.cancel()
        waiter.cancel()
        raise
    if run.done():
        waiter.cancel()
        return run.result()
    run.cancel()
    try:
        await run
    except BaseException:  # noqa: BLE001 - the cancelled call's fate is irrelevant
        pass
    return None


def _normalise(partial: Any) -> dict:
    """A tool's partial outcome as a D8 envelope without ``meta``."""
    if not isinstance(partial, Mapping):
        return {
            "status": "error",
            "result": None,
            "error": _err("tool_error", f"tool returned {type(partial).__name__}, not an outcome mapping"),
        }
    out = dict(partial)
    error = out.get("error")
    status = out.get("status") or ("error" if error else "ok")
    if status not in ("ok", "error"):
        status = "error" if error else "ok"
    out["status"] = status
    out.setdefault("result", None)
    if status == "error":
        if not isinstance(error, Mapping):
            error = _err("tool_error", str(error) if error else "tool reported an error")
        else:
            error = dict(error)
            error.setdefault("kind", "tool_error")
            error.setdefault("message", "")
            error.setdefault("retryable", False)
        out["error"] = error
    else:
        out["error"] = None
    out.pop("meta", None)
    return out
