"""admission: evaluates execution requests (playbook resolution, validation, workload merge) and step
admission (D17); fires joins (D16); creates step runs and sends their commands to worker pools."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from noetl_mesh import limits
from noetl_mesh.core import decide
from noetl_mesh.lang.documents import load_document
from noetl_mesh.core.state import ExecutionState
from nats.js.errors import NotFoundError

from noetl_mesh.infra.bus import COMMANDS, LOST_COMMANDS, MAX_DELIVERIES, Q_CATALOG_GET, BusError, loads, pull_loop
from noetl_mesh.infra.control import PartitionedService
from noetl_mesh.infra.payloads import PayloadMissing
from noetl_mesh.infra.micro import Consumer

log = logging.getLogger("noetl.admission")


class AdmissionService(PartitionedService):
    name = "admission"
    classes = decide.CONSUMES[name]

    def __init__(self, bus: Any, ack_wait: float | None = None):
        super().__init__(bus, ack_wait)
        self.resolving: dict[str, asyncio.Future] = {}  # a child's request's event id -> its playbook, being fetched
        self.counting = True  # children are counted in their trees (D19): off when NOETL_TREES cannot be used

    async def start(self) -> None:
        await super().start()
        why = await self.bus.trees_unusable()
        if why:  # a stack set up by an earlier version: children run, uncounted, rather than wait for ever
            self.counting = False
            log.error("admission: child executions are NOT counted in their trees (max_tree_executions, D19): %s. "
                      "Run `noetl setup` and `noetl nats-credentials` (then reload NATS), and restart admission", why)
        # Admission sent the command, so admission reports it lost: a command that ran out of
        # deliveries ends its step runs failed instead of leaving the execution RUNNING forever. The
        # server's advisories are kept in a stream, so none is missed while no admission runs.
        await self.bus.ensure_lost_commands()
        sub = await self.bus.durable(LOST_COMMANDS, "admission", MAX_DELIVERIES, max_ack_pending=100,
                                     ack_wait=30.0, max_deliver=20)
        lost = Consumer(name="lost-commands", stream=LOST_COMMANDS, subject=MAX_DELIVERIES, durable="admission")
        self.consumers.append(lost)
        self.tasks.append(asyncio.create_task(pull_loop(sub, self._on_max_deliveries, self.stop_event, counts=lost),
                                              name="admission-lost-commands"))

    async def _on_max_deliveries(self, msg) -> None:
        advisory = loads(msg.data)
        seq = advisory.get("stream_seq")
        try:
            stored = await self.bus.js.get_msg(COMMANDS, seq)
        except NotFoundError:  # already reported (and deleted), or acknowledged after all
            await msg.ack()
            return
        try:
            command = await self.bus.expand(stored.data, loads(stored.data))  # D23
        except PayloadMissing:  # a chunk by reference, gone: its iterations are named by their range
            command = {**loads(stored.data), "chunk": None}
        await self.bus.publish_all(decide.lost_command(command, advisory.get("deliveries", 0)))
        await self.bus.js.delete_msg(COMMANDS, seq)
        await msg.ack()  # an error above leaves it to be retried (pull_loop naks with a delay)

    async def decide(self, state: ExecutionState, event: dict[str, Any]) -> decide.Decision:
        playbook = None
        if event["name"] == "playbook.execution.requested" and state.playbook is None:
            fetching = self.resolving.pop(event["event_id"], None)
            playbook = await (fetching if fetching is not None else self.evaluate(event))
        if isinstance(playbook, decide.Written):
            return decide.admission(state, event, playbook.doc, author=playbook.author)
        return decide.admission(state, event, playbook)

    def prepare(self, request: dict[str, Any]) -> None:
        """A child's request names its playbook by catalog path: ask the catalog while the log is asked
        whether the request comes first (control.py)."""
        data = request.get("data") or {}
        if data.get("playbook") is None and data.get("catalog") and request["event_id"] not in self.resolving:
            self.resolving[request["event_id"]] = asyncio.ensure_future(self.evaluate(request))

    def unprepare(self, event: dict[str, Any]) -> None:
        fetching = self.resolving.pop(event["event_id"], None)
        if fetching is not None:  # not needed after all (the execution was cancelled first, or failed)
            fetching.cancel()
            fetching.add_done_callback(_quietly)

    async def evaluate(self, request: dict[str, Any]) -> Any:
        """What decide.admission takes for a request: its playbook (:meth:`resolve`), or errors; a
        child's (D19) also counts in its tree, and fails past ``max_tree_executions``."""
        data = request.get("data") or {}
        if not data.get("parent") or not self.counting:
            return await self.resolve(data)
        total, playbook = await asyncio.gather(
            self.bus.count_child(data.get("root_execution_id") or data.get("parent_execution_id") or "",
                                 request["execution_id"]),
            self.resolve(data))
        over = limits.exceeded("max_tree_executions", total, f"child execution {request['execution_id']}")
        return [over] if over else playbook

    async def resolve(self, request: dict[str, Any]) -> Any:
        """The playbook of a request: inline (a mapping or YAML text), else from the catalog.
        Returns a list of error strings when it cannot be had."""
        inline = request.get("playbook")
        if isinstance(inline, str):
            return _document(inline)
        if inline is not None:
            return inline
        ref = request.get("catalog")
        if not ref:
            return ["the request names no playbook (inline, catalog path or catalog id)"]
        try:
            entry = await self.bus.request(Q_CATALOG_GET, ref, expand=True)  # a big entry's text is a reference
        except BusError as exc:
            if exc.kind in ("unavailable", "timeout"):
                raise  # transient: the message is retried later, nothing is decided
            return [f"catalog: {exc.message}"]
        doc = _document(entry["content"], "catalog: ")
        return doc if isinstance(doc, list) else decide.Written(doc, entry.get("registered_by"))


def _quietly(future: asyncio.Future) -> None:
    """Retrieve an unused lookup's outcome, so that its failure is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


def _document(text: str, prefix: str = "") -> Any:
    """A playbook's text through the safe loader (lang/documents.py): the value, or its errors."""
    doc, diagnostics = load_document(text)
    if diagnostics:
        return [f"{prefix}{d}" for d in diagnostics]
    if isinstance(doc, list):  # decide reads a list as errors
        return [f"{prefix}a playbook is a YAML mapping, got a list"]
    return doc
