"""An execution a control-plane service cannot go on with (dsl.md D18, "When the engine cannot go on"):
the router finishes it FAILED with the engine_error; only a control-plane service's cancellation may
carry one; `noetl verify` expects FAILED; a child tells its parent its status and error, not its values."""
from __future__ import annotations

from noetl_mesh.core import decide
from noetl_mesh.core.events import engine_stopped, make_event
from noetl_mesh.core.state import ExecutionState, apply
from noetl_mesh.core.verify import verify

REQUEST = make_event("playbook.execution.requested", "c1", event_id="request", source="admission",
                     data={"catalog": {"path": "t/child"}, "parent_execution_id": "p1", "depth": 1,
                           "parent": {"execution_id": "p1", "step": "s", "step_run_id": "r"}})


def finish(*events):
    state = ExecutionState("c1")
    out = []
    for e in events:
        apply(state, e)
        out = decide.router(state, e)
    return state, out


def test_the_router_finishes_a_stopped_execution_failed_with_its_error():
    stop = engine_stopped("c1", "admission", "the engine could not go on with this execution: KeyError: 'x'")
    state, decision = finish(REQUEST, stop)
    done = next(e for e in decision.events if e["name"] == "workflow.finished")
    assert done["data"]["status"] == "FAILED"
    assert done["data"]["error"] == {"kind": "engine_error",
                                     "message": "the engine could not go on with this execution: KeyError: 'x'"}
    to_parent = next(e for e in decision.foreign if e["name"] == "playbook.child.finished")
    assert to_parent["data"]["status"] == "FAILED" and to_parent["data"]["result"] is None  # no values: they may be the fault
    assert to_parent["data"]["error"]["kind"] == "engine_error"
    report = verify([REQUEST, stop, *decision.events], "c1")
    assert report.ok, report.findings


def test_only_a_control_plane_service_says_the_engine_stopped():
    """The gateway writes a user's cancellation: an ``error`` in it is not the engine's."""
    forged = make_event("execution.cancelled", "c1", event_id="cancel", source="gateway",
                        data={"reason": "x", "error": {"kind": "engine_error", "message": "x"}})
    _, decision = finish(REQUEST, forged)
    done = next(e for e in decision.events if e["name"] == "workflow.finished")
    assert done["data"]["status"] == "CANCELLED" and done["data"]["error"]["kind"] == "cancelled"


def test_one_stop_per_execution():
    a, b = engine_stopped("c1", "router", "a"), engine_stopped("c1", "loop-coordinator", "b")
    assert a["event_id"] == b["event_id"]  # de-duplicated by NATS when two services stop it at once
