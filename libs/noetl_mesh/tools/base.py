"""The tool contract (D8): what the pipeline calls and what a tool hands back.

A tool gets the task with its fields already rendered (D7; ``name``, ``kind``, ``spec`` and python's
``code`` untouched), the task's effective spec (D5) and a :class:`ToolContext`, and returns a *partial*
outcome: ``status``, ``result``, ``error`` (``{kind, message, retryable}``) and its kind helper
(``http``, ``pg``, ``py``). The pipeline adds ``meta`` and turns an exception escaping a tool into an
error outcome of kind ``tool_error``.

Kept free of heavy imports: the python tool's child process imports this package.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

__all__ = ["Tool", "ToolContext", "ok", "error", "timeout_seconds"]


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
