"""admission: evaluates execution requests (playbook resolution, validation, workload merge) and step
admission (D17); fires joins (D16); creates step runs and sends their commands to worker pools."""
from __future__ import annotations

import logging
from typing import Any

import yaml

from noetl_mesh.core import decide
from noetl_mesh.core.state import ExecutionState
from noetl_mesh.infra.bus import COMMANDS, Q_CATALOG_GET, BusError, loads
from noetl_mesh.infra.control import PartitionedService

log = logging.getLogger("noetl.admission")
MAX_DELIVERIES = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{COMMANDS}.*"


class AdmissionService(PartitionedService):
    name = "admission"
    classes = decide.CONSUMES[name]

    async def start(self) -> None:
        await super().start()
        # Admission sent the command, so admission reports it lost: a command that ran out of
        # deliveries ends its step runs failed instead of leaving the execution RUNNING forever.
        self.advisories = await self.bus.nc.subscribe(MAX_DELIVERIES, queue=self.name, cb=self._on_max_deliveries)

    async def stop(self) -> None:
        await self.advisories.unsubscribe()
        await super().stop()

    async def _on_max_deliveries(self, msg) -> None:
        advisory = loads(msg.data)
        seq = advisory.get("stream_seq")
        try:
            stored = await self.bus.js.get_msg(COMMANDS, seq)
            command = await self.bus.expand(stored.data, loads(stored.data))  # D23
            await self.bus.publish_all(decide.lost_command(command, advisory.get("deliveries", 0)))
            await self.bus.js.delete_msg(COMMANDS, seq)
        except Exception:  # noqa: BLE001 - an advisory is best effort; log what could not be reported
            log.exception("could not report the lost command at %s seq %s", COMMANDS, seq)

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
