"""The ``python`` tool (D25, D33): user code in a sandboxed task process of its own.

Each task runs in a fresh process forked by the worker's sandbox (:mod:`noetl_mesh.sandbox`): its args
bound as variables, ``result`` or ``main(...)`` its result, under ``spec.timeout`` (the process is
killed: ``error.kind = "timeout"``, retryable) and the task process limits (docs/limits.md). A crash, a
hang or a leak in user code never takes the worker down, and nothing one task leaves behind reaches
another.

Outcome (D8): ``result`` is ``main(...)``'s return value or the variable ``result``; ``py`` carries
``exception_type`` (bare class name, None on success), ``stdout`` (what the code printed, at most 64 KiB;
``stdout_truncated`` says when more was printed) and ``pid``. Errors: ``python_error`` (the code raised),
``sandbox`` (the code reached for something the sandbox refuses: a file outside its view, the network,
another process; or the pool cannot sandbox), ``limit_exceeded`` (memory or CPU time, naming the limit),
``python_crash`` (the process died), ``result_too_large`` (the answer passed ``limits.max_result_bytes``:
reading stops there and the process is killed).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import limits
from ..sandbox.supervisor import SandboxUnavailable, Supervisor, TaskCrashed
from .base import ResultTooLarge, ToolContext, error, ok, task_timeout

__all__ = ["PythonTool", "sandbox_error"]

DEFAULT_TIMEOUT = 60.0  # KIND_DEFAULTS["python"]["timeout"]
MAX_STDOUT = 64 * 1024
_ANSWER_SLACK = 64 * 1024  # an answer's envelope, error message and traceback, beyond result and stdout


def limit_message(name: str, what: str) -> str:
    """``what`` stopped by the task process limit ``name``, with its value and how to change it."""
    limit = limits.by_name(name)
    value = getattr(limits.current(), name)
    return (f"{what}: the task process passed its limit {name} = {limits.amount(value, limit.unit)} "
            f"(set {limit.env} on the worker to change it)")


def sandbox_error(e: SandboxUnavailable | TaskCrashed, crash_kind: str, **helpers: Any) -> dict:
    """The outcome of a task that could not run (no sandbox) or whose process ended without answering."""
    if isinstance(e, SandboxUnavailable):
        return error("sandbox", str(e), False, **helpers)
    if e.limit:
        return error("limit_exceeded", limit_message(e.limit, e.message), False, **helpers)
    message = e.message
    if e.stderr.strip():
        message += f"; its last output: {e.stderr.strip()[-1000:]}"
    return error(crash_kind, message, False, **helpers)


class PythonTool:
    """``kind: python`` (D25)."""

    kind = "python"

    def __init__(self, sandbox: Supervisor | None = None, *, max_stdout: int = MAX_STDOUT) -> None:
        self.sandbox = sandbox if sandbox is not None else Supervisor()
        self._own = sandbox is None
        self.max_stdout = max_stdout

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        code = task.get("code")
        if not isinstance(code, str):
            return error("python_error", "python task needs 'code' (a string)", py=_py(None))
        args = task["args"] if "args" in task else task.get("input")
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            return error(
                "python_error", f"python task 'args' must render to a mapping, got {type(args).__name__}", py=_py(None)
            )
        timeout, said = task_timeout(ctx.timeout if ctx.timeout is not None else spec.get("timeout"), DEFAULT_TIMEOUT)
        request = {
            "code": code,
            "args": dict(args),
            "filename": f"<{ctx.step}.{ctx.task_name}>",
            "max_stdout": self.max_stdout,
        }
        max_answer = limits.current().max_result_bytes + 6 * self.max_stdout + _ANSWER_SLACK
        try:
            resp = await self.sandbox.run("python", request, timeout=timeout, max_answer=max_answer)
        except ResultTooLarge as e:
            return e.outcome(ctx, py=_py(None))
        except TimeoutError:
            return error("timeout", f"python task exceeded its timeout of {said} (process killed)", True, py=_py(None))
        except (SandboxUnavailable, TaskCrashed) as e:
            return sandbox_error(e, "python_crash", py=_py(None if isinstance(e, SandboxUnavailable) else "ChildProcessError"))
        stdout = resp.get("stdout") or ""
        py = _py(None, stdout, resp.get("stdout_truncated", False), resp.get("pid"))
        if resp.get("ok"):
            return ok(resp.get("result"), py=py)
        py["exception_type"] = resp.get("exception_type")
        message = resp.get("message") or ""
        if resp.get("limit"):
            out = error("limit_exceeded", limit_message(resp["limit"], f"python task: {resp.get('exception_type')}"),
                        False, py=py)
        elif resp.get("sandbox"):
            out = error("sandbox", f"refused by the sandbox (D33): {message}", False, py=py)
        else:
            out = error("python_error", message, False, py=py)
        out["error"]["exception_type"] = resp.get("exception_type")
        if resp.get("traceback"):
            out["error"]["traceback"] = resp["traceback"]
        return out

    async def close(self) -> None:
        if self._own:
            await self.sandbox.close()


def _py(exception_type: str | None, stdout: str = "", truncated: bool = False, pid: int | None = None) -> dict:
    return {"exception_type": exception_type, "stdout": stdout, "stdout_truncated": truncated, "pid": pid}
