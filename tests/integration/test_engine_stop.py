"""An execution the engine cannot go on with fails alone, clearly (dsl.md D18, "When the engine cannot
go on"): a control-plane service that cannot decide on one of its events, or cannot publish a decision,
ends it FAILED with an engine_error instead of leaving it RUNNING for ever, and every other execution
runs on. The fault is made by wrapping a decider for one step name only."""
from __future__ import annotations

import pytest
import yaml

from noetl_mesh.core import decide
from noetl_mesh.core.verify import verify

pytestmark = pytest.mark.integration

POISONED = "poisoned"


def book(name: str, workflow: str) -> dict:
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": name, "path": f"tests/stop/{name}"},
            "workflow": yaml.safe_load(workflow)}


CHAIN = book("chain", f"""
- step: start
  tool: {{kind: noop}}
  next: {{arcs: [{{step: {POISONED}}}]}}
- step: {POISONED}
  tool: {{kind: noop, result: 1}}
  next: {{arcs: [{{step: after}}]}}
- step: after
  tool: {{kind: noop}}
""")
HELLO = book("hello", "- step: start\n  tool: {kind: noop, result: 1}\n")


def finished(events: list[dict]) -> dict:
    return next(e for e in events if e["name"] == "workflow.finished")["data"]


def test_a_decision_that_cannot_be_published_fails_its_execution(stack, monkeypatch) -> None:
    real = decide.router

    def router(state, event):
        d = real(state, event)
        if event["name"] == "step.done" and event.get("step") == POISONED:
            d.events[0].setdefault("data", {})["n"] = 2 ** 70  # JSON on the wire cannot hold it
        return d

    monkeypatch.setattr(decide, "router", router)
    status, events = stack.execute(CHAIN, timeout=60)
    assert status["status"] == "FAILED", status
    error = finished(events)["error"]
    assert error["kind"] == "engine_error", error
    assert "router" in error["message"] and "'step.done'" in error["message"] and f"'{POISONED}'" in error["message"]
    assert "TypeError" in error["message"], error
    names = [(e["name"], e.get("step")) for e in events]
    assert ("step.started", "after") not in names  # nothing after the step the router could not route
    assert not verify(events).findings, verify(events).findings
    other, _ = stack.execute(HELLO, timeout=60)  # the partition reads on
    assert other["status"] == "COMPLETED"


def test_an_event_admission_cannot_decide_on_fails_its_execution(stack, monkeypatch) -> None:
    real = decide.admission

    def admission(state, event, *a, **kw):
        if event["name"] == "token.enqueued" and (event.get("data") or {}).get("step") == POISONED:
            raise KeyError("a key admission needed")
        return real(state, event, *a, **kw)

    monkeypatch.setattr(decide, "admission", admission)
    status, events = stack.execute(CHAIN, timeout=60)
    assert status["status"] == "FAILED", status
    error = finished(events)["error"]
    assert error["kind"] == "engine_error" and "admission" in error["message"] and "KeyError" in error["message"]
    assert not any(e["name"] == "step.admitted" and e.get("step") == POISONED for e in events)
    assert not verify(events).findings, verify(events).findings
    other, _ = stack.execute(HELLO, timeout=60)
    assert other["status"] == "COMPLETED"


def test_a_finish_that_cannot_be_published_fails_its_execution(stack, monkeypatch) -> None:
    """The router's own decision folds into its state at once: a finish it could not publish left the
    state it held finished, and the execution RUNNING for ever, a cancellation dropped the same way."""
    real = decide.router

    def router(state, event):
        d = real(state, event)
        if (state.playbook or {}).get("metadata", {}).get("name") == "last":
            for e in d.events:
                if e["name"] == "workflow.finished" and e["data"]["status"] == "COMPLETED":
                    e["data"]["n"] = 2 ** 70
        return d

    monkeypatch.setattr(decide, "router", router)
    status, events = stack.execute(book("last", "- step: start\n  tool: {kind: noop}\n"), timeout=60)
    assert status["status"] == "FAILED", status
    error = finished(events)["error"]
    assert error["kind"] == "engine_error" and "router" in error["message"], error
    assert [e["data"]["status"] for e in events if e["name"] == "workflow.finished"] == ["FAILED"]
    assert not verify(events).findings, verify(events).findings
