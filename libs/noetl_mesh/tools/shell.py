"""The ``shell`` tool (D33): commands run by a shell in a sandboxed task process of its own.

The worker's sandbox (:mod:`noetl_mesh.sandbox`) gives shell tasks a fork server of their own: the
same file view, limits and clean environment as a python task, plus programs from the system's binary
directories (and nothing it can write), processes that stay in the task's process group (killed whole
when the task ends), and, on a worker running as root, an unprivileged user whose processes the kernel
counts (``shell_max_processes``). The commands themselves run in :mod:`.shell_runner`.

Outcome (D8): ``result`` is ``{exit_code, stdout, stderr}``; ``shell`` carries ``exit_code``,
``stdout_truncated``, ``stderr_truncated``, ``commands_run`` and ``pid``. Errors: ``shell_exit`` (a
command exited with a status other than 0: ``error.exit_code``, ``error.stderr`` the end of its
standard error; the result is still there), ``limit_exceeded`` (the process limit, CPU time), ``timeout``
(the whole process group is killed; retryable), ``sandbox`` (the pool cannot sandbox), ``shell_crash``
(the task process died), ``invalid_task`` (no command, a bad ``env``).
"""
from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from typing import Any

from .. import limits
from ..sandbox.supervisor import SandboxUnavailable, Supervisor, TaskCrashed
from .base import ResultTooLarge, ToolContext, error, ok
from .base import task_timeout
from .python import limit_message, sandbox_error

__all__ = ["ShellTool", "BadTask", "commands_of", "environment_of"]

DEFAULT_TIMEOUT = 60.0  # KIND_DEFAULTS["shell"]["timeout"]
STDERR_TAIL = 2000  # characters of standard error an error message and error.stderr keep
_ANSWER_SLACK = 64 * 1024
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHELLS = {"sh": "/bin/sh", "bash": "/bin/bash"}


class BadTask(ValueError):
    pass


def commands_of(task: Mapping[str, Any]) -> list[str]:
    """The commands of a (rendered) shell task: ``command`` (a string, or a list) or ``cmds`` (a list,
    run in order); :class:`BadTask` saying what is wrong."""
    given = [k for k in ("command", "cmds") if task.get(k) is not None]
    if len(given) != 1:
        raise BadTask("a shell task takes one of 'command' (a string) or 'cmds' (a list of strings)"
                      + (", got both" if len(given) == 2 else ""))
    value = task[given[0]]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise BadTask(f"'{given[0]}' must render to a string or a non-empty list of strings, "
                      f"got {type(value).__name__}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, (str, int, float)) or isinstance(item, bool):
            raise BadTask(f"'{given[0]}[{i}]' must be a string, got {type(item).__name__}")
        text = str(item)
        if "\0" in text:
            raise BadTask(f"'{given[0]}[{i}]' holds a NUL character")
        out.append(text)
    return out


def environment_of(value: Any) -> dict[str, str]:
    """The ``env`` of a (rendered) shell task: a mapping of variable names to scalar values."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadTask(f"'env' must render to a mapping, got {type(value).__name__}")
    out = {}
    for key, v in value.items():
        if not isinstance(key, str) or not _NAME.fullmatch(key):
            raise BadTask(f"'env': {key!r} is not a variable name (letters, digits, _; not starting with a digit)")
        if isinstance(v, (dict, list)) or v is None:
            raise BadTask(f"'env.{key}' must be a string or a number, got {type(v).__name__}")
        text = ("true" if v else "false") if isinstance(v, bool) else str(v)
        if "\0" in text:
            raise BadTask(f"'env.{key}' holds a NUL character")
        out[key] = text
    return out


def _shell_of(value: Any) -> str:
    if value is None:
        return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    if not isinstance(value, str) or not (value in _SHELLS or value.startswith("/")):
        raise BadTask(f"'shell' must be sh, bash or an absolute path, got {value!r}")
    return _SHELLS.get(value, value)


def _tail(text: str) -> str:
    return text if len(text) <= STDERR_TAIL else "…" + text[-STDERR_TAIL:]


class ShellTool:
    """``kind: shell``."""

    kind = "shell"

    def __init__(self, sandbox: Supervisor | None = None) -> None:
        self.sandbox = sandbox if sandbox is not None else Supervisor()
        self._own = sandbox is None

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        try:
            commands = commands_of(task)
            env = environment_of(task.get("env"))
            shell = _shell_of(task.get("shell"))
        except BadTask as e:
            return error("invalid_task", f"shell task {ctx.task_name!r}: {e}", False, shell=_helper())
        timeout, said = task_timeout(ctx.timeout if ctx.timeout is not None else spec.get("timeout"), DEFAULT_TIMEOUT)
        output = int(limits.current().shell_max_output_bytes)
        request = {"commands": commands, "env": env, "shell": shell, "max_output": output}
        max_answer = limits.current().max_result_bytes + 12 * output + _ANSWER_SLACK
        try:
            resp = await self.sandbox.run("shell", request, timeout=timeout, max_answer=max_answer)
        except ResultTooLarge as e:
            return e.outcome(ctx, shell=_helper())
        except TimeoutError:
            return error("timeout", f"shell task exceeded its timeout of {said} (its processes killed)", True,
                         shell=_helper())
        except (SandboxUnavailable, TaskCrashed) as e:
            return sandbox_error(e, "shell_crash", shell=_helper())
        code = resp.get("exit_code")
        result = {"exit_code": code, "stdout": resp.get("stdout") or "", "stderr": resp.get("stderr") or ""}
        helper = _helper(resp)
        which = f"command {resp.get('commands_run')} of {len(commands)}" if len(commands) > 1 else "the command"
        if resp.get("fork_failed"):
            out = error("limit_exceeded", limit_message("shell_max_processes", f"shell task: {which} could not "
                                                        "start a process"), False, result=result, shell=helper)
        elif code == -signal.SIGXCPU:
            out = error("limit_exceeded", limit_message("task_max_cpu_seconds", f"shell task: {which}"), False,
                        result=result, shell=helper)
        elif code == 0:
            return ok(result, shell=helper)
        else:
            how = f"was killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exited with code {code}"
            stderr = result["stderr"].strip()
            message = f"shell task: {which} {how}" + (f"; its standard error ends: {_tail(stderr)}" if stderr else "")
            out = error("shell_exit", message, False, result=result, shell=helper)
        out["error"]["exit_code"] = code
        out["error"]["stderr"] = _tail(result["stderr"])
        return out

    async def close(self) -> None:
        if self._own:
            await self.sandbox.close()


def _helper(resp: Mapping[str, Any] | None = None) -> dict:
    resp = resp or {}
    return {"exit_code": resp.get("exit_code"), "stdout_truncated": bool(resp.get("stdout_truncated")),
            "stderr_truncated": bool(resp.get("stderr_truncated")), "commands_run": resp.get("commands_run", 0),
            "pid": resp.get("pid")}
