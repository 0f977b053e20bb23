"""admission: evaluates execution requests (playbook resolution, validation, workload merge) and step
admission (D17); fires joins (D16); creates step runs and sends their commands to worker pools."""
from __future__ import annotations

from typing import Any

import yaml

from noetl_mesh.core import decide
from noetl_mesh.core.state import ExecutionState
from noetl_mesh.infra.bus import Q_CATALOG_GET, BusError
from noetl_mesh.infra.control import PartitionedService


class AdmissionService(PartitionedService):
    name = "admission"

    async def decide(self, state: ExecutionState, event: dict[str, Any]) -> decide.Decision:
        playbook = None
        if event["name"] == "playbook.execution.requested" and state.playbook is None:
            playbook = await self.resolve(event.get("data") or {})
        return decide.admission(state, event, playbook)

    async def resolve(self, request: dict[str, Any]) -> Any:
        """The playbook of a request: inline (a mapping or YAML text), else from the catalog.
        Returns a list of error strings when it cannot be had."""
        inline = request.get("playbook")
        if isinstance(inline, str):
            try:
                return yaml.safe_load(inline)
            except yaml.YAMLError as exc:
                return [f"YAML syntax error: {exc}"]
        if inline is not None:
            return inline
        ref = request.get("catalog")
        if not ref:
            return ["the request names no playbook (inline, catalog path or catalog id)"]
        try:
            entry = await self.bus.request(Q_CATALOG_GET, ref)
        except BusError as exc:
            if exc.kind in ("unavailable", "timeout"):
                raise  # transient: the message is retried later, nothing is decided
            return [f"catalog: {exc.message}"]
        return yaml.safe_load(entry["content"])
