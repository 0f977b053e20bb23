"""router: evaluates arcs on terminal step events (D13, D14), moves tokens into places, handles
unhandled failures (D15), detects completion and cancellation (D18)."""
from __future__ import annotations

from typing import Any

from noetl_mesh.core import decide
from noetl_mesh.core.state import ExecutionState
from noetl_mesh.infra import tracing
from noetl_mesh.infra.bus import cancel_subject
from noetl_mesh.infra.control import PartitionedService


class RouterService(PartitionedService):
    name = "router"
    classes = decide.CONSUMES[name]

    async def decide(self, state: ExecutionState, event: dict[str, Any]) -> decide.Decision:
        return decide.router(state, event)

    async def after(self, state: ExecutionState, outputs: list[dict[str, Any]], cancel_runs: list[str]) -> None:
        if cancel_runs and not state.finished:  # D29: timed-out step runs stop their running tasks
            await self.bus.broadcast(cancel_subject(state.execution_id),
                                     {"execution_id": state.execution_id, "runs": cancel_runs, "only_runs": True})
        for out in outputs:
            if out["name"] == "workflow.finished":
                # workers abort the execution's in-flight commands (D15, D18); its queued ones are purged
                await self.bus.broadcast(cancel_subject(state.execution_id),
                                         {"execution_id": state.execution_id, "status": out["data"]["status"],
                                          "runs": out["data"]["cancelled_runs"]})
                if out["data"]["status"] != "COMPLETED":  # a completed execution has nothing queued
                    await self.bus.purge_commands(state.execution_id)
                pending = [t.id for t in state.timers.values() if not t.fired]
                if pending:  # D29: its pending timers never fire (one that did would fold to nothing)
                    await self.bus.cancel_timers(state.execution_id, pending)
                # the execution's root span: from its request to now (its trace's root; a child's links
                # to its parent's)
                parent = (state.request.get("parent") or {}).get("execution_id") \
                    or state.request.get("parent_execution_id")
                catalog = state.request.get("catalog") or {}
                tracing.execution_root(self.name, state.execution_id, start_time=state.requested_at,
                                       status=out["data"]["status"], path=catalog.get("path")
                                       or ((state.playbook or {}).get("metadata") or {}).get("path"),
                                       parent_execution_id=parent if isinstance(parent, str) else None)
