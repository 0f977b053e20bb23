"""The tool contract (D8): what the pipeline calls and what a tool hands back.

A tool gets the task with its fields already rendered (D7; ``name``, ``kind``, ``spec`` and python's
``code`` untouched), the task's effective spec (D5) and a :class:`ToolContext`, and returns a *partial*
outcome: ``status``, ``result``, ``error`` (``{kind, message, retryable}``) and its kind helper
(``http``, ``pg``, ``py``). The pipeline adds ``meta`` and turns an exception escaping a tool into an
error outcome of kind ``tool_error``.

Result limit: a result whose JSON is bigger than ``limits.current().max_result_bytes`` is an error of
kind ``result_too_large`` (:func:`result_too_large`). The pipeline checks every outcome's result
(:func:`json_size`); a tool that reads its result in parts stops as soon as the parts pass the limit
(:class:`ResultBudget`), so an oversized value is never held whole.

Kept free of heavy imports (orjson only): the python tool's child process imports this package.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

__all__ = ["Tool", "ToolContext", "ok", "error", "timeout_seconds", "json_size", "result_too_large",
           "ResultTooLarge", "ResultBudget"]


@dataclass(slots=True)
class ToolContext:
    """Who is calling and under which limits.

    ``timeout`` is the effective spec's ``timeout`` (seconds, or ``{connect, read}`` for http), None
    when not set. ``cancel`` is set by the worker to abort the call. ``prev`` is the previous task's
    result (``_prev``), ``keychain`` the execution's resolved keychain (D24).
    """

    execution_id: str
    step: str
    task_name: str
    timeout: float | Mapping[str, float] | None = None
    cancel: "asyncio.Event | None" = None
    step_run_id: str | None = None
    iteration: int | None = None
    attempt: int = 1
    action_id: str | None = None
    keychain: Mapping[str, Any] = field(default_factory=dict)
    prev: Any = None


class Tool(Protocol):
    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:  # pragma: no cover
        ...


def ok(result: Any, **helpers: Any) -> dict:
    """A successful partial outcome."""
    out = {"status": "ok", "result": result, "error": None}
    out.update(helpers)
    return out


def error(kind: str, message: str, retryable: bool = False, result: Any = None, **helpers: Any) -> dict:
    """An error partial outcome (D8)."""
    out = {"status": "error", "result": result, "error": {"kind": kind, "message": message, "retryable": retryable}}
    out.update(helpers)
    return out


def task_timeout(value: Any, default: float | None) -> tuple[float, str]:
    """A task's timeout: its ``spec.timeout``, at most ``task_max_seconds`` (none, or 0, is that limit
    too: no task holds a worker's slot for good); and how to say it."""
    from .. import limits

    ceiling = float(limits.current().task_max_seconds)
    seconds = timeout_seconds(value, default)
    if seconds is None or seconds > ceiling:
        return ceiling, f"{ceiling:g}s (task_max_seconds, NOETL_LIMIT_TASK_MAX_SECONDS)"
    return seconds, f"{seconds:g}s"


def timeout_seconds(value: Any, default: float | None) -> float | None:
    """A single timeout in seconds from a number, a numeric string, or ``{connect, read, ...}`` (the
    largest part); ``default`` when missing or unusable; None or a non-positive value means none."""
    if value is None or isinstance(value, bool):
        return default
    if isinstance(value, (int, float)):
        return float(value) if value > 0 else None
    if isinstance(value, str):
        try:
            v = float(value.strip().removesuffix("s"))
        except ValueError:
            return default
        return v if v > 0 else None
    if isinstance(value, Mapping):
        parts = [timeout_seconds(v, None) for v in value.values()]
        parts = [p for p in parts if p is not None]
        return max(parts) if parts else default
    return default


# ------------------------------------------------------------------------------------- result limit


async def bounded(work: Any, cancel: Any, timeout: float | None) -> tuple[str, Any]:
    """Run the coroutine ``work`` until it ends (``("done", its future)``: read its result there), the
    execution's ``cancel`` event is set (``("cancelled", None)``) or ``timeout`` seconds pass (``("timeout",
    None)``; None: no bound). Work that is given up is cancelled and awaited, its own error dropped."""
    import asyncio

    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
    try:
        done, _ = await asyncio.wait({task} if waiter is None else {task, waiter}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        if waiter is not None:
            waiter.cancel()
        raise
    if waiter is not None:
        waiter.cancel()
    if task in done:
        return "done", task
    task.cancel()  # (psycopg cancels a running query on the server)
    try:
        await task
    except BaseException:  # noqa: BLE001 - the abandoned work's own error is not the story
        pass
    return ("cancelled" if waiter is not None and waiter in done else "timeout"), None


def json_size(value: Any) -> int:
    """The size in bytes of ``value`` as JSON (as the bus serialises it: compact, UTF-8)."""
    try:
        return len(orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS))
    except (TypeError, ValueError):  # e.g. an integer past 64 bits
        import json

        return len(json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":")).encode())


def result_too_large(step: str, task: str, size: int | None, *, read: str | None = None, **helpers: Any) -> dict:
    """The error outcome of a result over ``max_result_bytes``: ``size`` its JSON size, or None when
    reading stopped past the limit (``read`` says what was being read)."""
    from .. import limits

    if size is None:
        limit = limits.current().max_result_bytes
        what = f"the result of task {task!r} is more than {limits.amount(limit, 'bytes')}" + (
            f" ({read}; reading stopped there)" if read else "")
    else:
        what = f"the result of task {task!r}" + (f" ({read})" if read else "")
    message = str(limits.LimitExceeded("max_result_bytes", size, f"step {step!r}", what=what))
    return error("result_too_large", message, False, **helpers)


class ResultTooLarge(Exception):
    """Raised by a tool's reader when the result passes the limit: ``size`` its JSON size when known,
    else None (reading stopped); ``read`` what was being read."""

    def __init__(self, size: int | None = None, read: str | None = None):
        super().__init__(f"result over the limit ({size if size is not None else 'reading stopped'})")
        self.size, self.read = size, read

    def outcome(self, ctx: ToolContext, **helpers: Any) -> dict:
        return result_too_large(ctx.step, ctx.task_name, self.size, read=self.read, **helpers)


class ResultBudget:
    """The running size of a result read in parts (rows, chunks of a body) against
    ``max_result_bytes``: :meth:`add` raises :class:`ResultTooLarge` once the parts pass it."""

    __slots__ = ("limit", "size", "read")

    def __init__(self, read: str | None = None, limit: int | None = None):
        if limit is None:
            from .. import limits

            limit = limits.current().max_result_bytes
        self.limit, self.size, self.read = limit, 0, read

    def add_bytes(self, n: int) -> None:
        self.size += n
        if self.size > self.limit:
            raise ResultTooLarge(None, self.read)

    def add(self, part: Any) -> None:
        """Count ``part`` at its JSON size."""
        self.add_bytes(json_size(part))
