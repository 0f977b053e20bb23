"""Tools: what a task of each ``kind`` does (D8, D10, D25, D27, D28).

``default_tools()`` gives the built-in registry kind -> tool instance (noop, python, http, duckdb,
postgres), the http and postgres tools under the worker pool's sandbox policy (D33);
``close_tools()`` releases what they hold (python child processes, http connections).

This module imports nothing heavy at import time: the python tool's child process
(``python -m noetl_mesh.tools.python_runner``) imports this package, and must start fast.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..sandbox.policy import Policy
    from .base import Tool, ToolContext

__all__ = ["Tool", "ToolContext", "default_tools", "close_tools"]


def default_tools(
    *,
    python_pool_size: int = 2,
    python_max_tasks: int = 200,
    http_trust_env: bool = True,
    policy: "Policy | None" = None,
) -> dict[str, Any]:
    """kind -> tool instance for ``noop``, ``python``, ``http``, ``duckdb`` and ``postgres``. ``policy``:
    the destinations http and postgres tasks may reach (D33; the worker passes its pool's; None: the
    default, nothing opened)."""
    from .duckdb import DuckdbTool
    from .http import HttpTool
    from .noop import NoopTool
    from .postgres import PostgresTool
    from .python import PythonTool

    return {
        "noop": NoopTool(),
        "python": PythonTool(pool_size=python_pool_size, max_tasks_per_child=python_max_tasks),
        "http": HttpTool(trust_env=http_trust_env, policy=policy),
        "duckdb": DuckdbTool(),
        "postgres": PostgresTool(policy=policy),
    }


async def close_tools(tools: Mapping[str, Any]) -> None:
    """Await ``close()`` of every tool that has one (each instance once)."""
    seen: set[int] = set()
    for tool in tools.values():
        if id(tool) in seen:
            continue
        seen.add(id(tool))
        close = getattr(tool, "close", None)
        if close is not None:
            await close()


def __getattr__(name: str) -> Any:  # PEP 562: Tool / ToolContext without importing at startup
    if name in ("Tool", "ToolContext"):
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
