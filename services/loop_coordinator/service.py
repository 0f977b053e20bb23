"""loop-coordinator: renders loop collections, dispatches iterations (sequential, or parallel up to
max_in_flight), tracks them, and ends each loop step run exactly once (D19, D15)."""
from __future__ import annotations

from typing import Any

from noetl_mesh.core import decide
from noetl_mesh.core.state import ExecutionState
from noetl_mesh.infra.bus import DISPATCH
from noetl_mesh.infra.control import PartitionedService


class LoopCoordinatorService(PartitionedService):
    name = "loop-coordinator"
    classes = decide.CONSUMES[name]
    rebuild_classes = (DISPATCH,)

    async def decide(self, state: ExecutionState, event: dict[str, Any]) -> decide.Decision:
        return decide.loops(state, event)

    def idle(self, state: ExecutionState) -> bool:
        return super().idle(state) or decide.flat(state)
