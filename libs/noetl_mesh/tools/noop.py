"""The ``noop`` tool (D10): its result is its rendered ``result:`` field when given, otherwise the
previous task's result. The pipeline runs noop tasks inline for speed; this class keeps the tool
registry uniform (and is what a custom registry may replace)."""
from __future__ import annotations

from .base import ToolContext, ok


class NoopTool:
    kind = "noop"

    async def run(self, task: dict, spec: dict, ctx: ToolContext) -> dict:
        return ok(task["result"] if "result" in task else ctx.prev)

    async def close(self) -> None:
        return None
