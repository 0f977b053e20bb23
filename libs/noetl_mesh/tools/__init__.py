"""Tools: what a task of each ``kind`` does (D8, D10, D25, D27, D28).

``default_tools()`` gives the built-in registry kind -> tool instance (noop, python, http, duckdb,
postgres, shell, nats); ``close_tools()`` releases what they hold (the sandbox's task processes, http connections).
Under the worker pool's sandbox policy (D33): python, duckdb and shell share one sandbox
(:mod:`noetl_mesh.sandbox`), http, postgres and nats reach only the destinations it allows.

This module imports nothing heavy at import time: the sandbox's task processes import this package.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..sandbox.policy import Policy
    from ..sandbox.supervisor import Supervisor
    from .base import Tool, ToolContext

__all__ = ["Tool", "ToolContext", "default_tools", "close_tools"]


def default_tools(
    *,
    http_trust_env: bool = True,
    sandbox: "Supervisor | None" = None,
    policy: "Policy | None" = None,
) -> dict[str, Any]:
    """kind -> tool instance for ``noop``, ``python``, ``http``, ``duckdb``, ``postgres``, ``shell`` and ``nats``. ``sandbox``:
    the worker's (its policy, secrets and lifetime); by default one of ``policy``, closed with the
    tools. ``policy``: the pool's (D33; default: the sandbox's, else the safe default, nothing opened)."""
    from ..sandbox.supervisor import Supervisor
    from .duckdb import DuckdbTool
    from .http import HttpTool
    from .nats import NatsTool
    from .noop import NoopTool
    from .postgres import PostgresTool
    from .python import PythonTool
    from .shell import ShellTool

    own = sandbox is None
    sandbox = sandbox or Supervisor(policy)
    policy = policy if policy is not None else sandbox.policy
    python, duckdb = PythonTool(sandbox), DuckdbTool(sandbox)
    python._own = own  # the sandbox is closed once, with the python tool, when the tools made it
    return {
        "noop": NoopTool(),
        "python": python,
        "http": HttpTool(trust_env=http_trust_env, policy=policy),
        "duckdb": duckdb,
        "postgres": PostgresTool(policy=policy),
        "shell": ShellTool(sandbox),
        "nats": NatsTool(policy=policy),
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
