"""Timers, waits and signals (D29, D30) on the in-process engine with its fake clock, the duration
and instant syntax, their validation, and the gateway's signal rule."""
from __future__ import annotations

import asyncio

import pytest
import yaml

from noetl_mesh.core.local import run_local
from noetl_mesh.core.signals import check, schema_refusal, signal_id
from noetl_mesh.core.state import summary
from noetl_mesh.lang.durations import DurationError, parse_duration, parse_instant
from noetl_mesh.lang.validate import validate


def book(workflow: str) -> dict:
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "t"},
            "workflow": yaml.safe_load(workflow)}


def run(doc, signals=()):
    return asyncio.run(run_local(doc, signals=signals))


@pytest.mark.parametrize("text, seconds", [
    (90, 90.0), (1.5, 1.5), ("500ms", 0.5), ("5s", 5.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86400.0),
    ("1h30m", 5400.0), ("PT5M", 300.0), ("P1DT2H", 93600.0), ("pt1.5s", 1.5), ("0", 0.0),
])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["5x", "", "5s5", "-1", "P", "PT", True, None, [], "nan", "1e400", "x" * 65])
def test_bad_durations_say_why(bad):
    with pytest.raises(DurationError):
        parse_duration(bad)


def test_instants_need_a_time_zone():
    assert parse_instant("1970-01-01T00:01:00Z") == 60.0
    assert parse_instant("1970-01-01T01:01:00+01:00") == 60.0
    with pytest.raises(DurationError, match="no time zone"):
        parse_instant("2026-01-01T00:00:00")


def test_validation_checks_the_new_fields_before_anything_runs():
    doc = book("""
- step: start
  spec: {policy: {lifecycle: {timeout_s: 5x}}}
  tool:
    - {name: a, kind: wait, duration: 2s, signal: x}
    - {name: b, kind: wait, signal: x, timout: 3}
    - {name: c, kind: wait, until: "2026-01-01T00:00:00"}
    - {name: d, kind: wait, duration: 9d}
    - {name: e, kind: wait, duration: "{{ workload.d }}"}
    - {name: f, kind: wait, duration: 1s, roles: [admin]}
    - {name: g, kind: wait, signal: x, schema: {type: 3}}
  next: {spec: {delay: 10y}, arcs: [{step: end, spec: {delay: PT5M}}]}
- step: end
  tool: {kind: wiat}
""")
    errors = {d.location.split("step=start.")[-1].split("step=end.")[-1]: d.message for d in validate(doc).errors}
    assert "is not a duration" in errors["spec.policy.lifecycle.timeout_s"]
    assert "is not a duration" in errors["next.spec.delay"]
    assert "exactly one of 'duration', 'until' or 'signal', got duration and signal" in errors["tool[0]"]
    assert "did you mean 'timeout'" in errors["tool[1].timout"]
    assert "has no time zone" in errors["tool[2].until"]
    assert "max_timer_seconds" in errors["tool[3].duration"]
    assert "tool[4].duration" not in errors  # templated: checked when rendered
    assert "only for a wait on a 'signal'" in errors["tool[5]"]
    assert "not a valid JSON Schema" in errors["tool[6]"]
    assert "did you mean 'wait'" in errors["tool.kind"]


def test_an_arc_delay_holds_the_token_and_the_execution_until_it_passes():
    r = run(book("""
- step: start
  tool: {kind: noop}
  next: {arcs: [{step: end, spec: {delay: 2m}}]}
- step: end
  tool: {kind: noop}
"""))
    assert r.state.status == "COMPLETED" and r.fired == [(pytest.approx(120, abs=1), "timer token")]
    names = [e["name"] for e in r.log]
    assert names.index("timer.fired") < names.index("token.enqueued", names.index("timer.scheduled"))


def test_a_join_waits_for_a_delayed_branch():
    r = run(book("""
- step: start
  tool: {kind: noop}
  next: {spec: {mode: inclusive}, arcs: [{step: fast}, {step: slow, spec: {delay: 10s}}]}
- step: fast
  tool: {kind: noop, result: f}
  next: {arcs: [{step: join}]}
- step: slow
  tool: {kind: noop, result: s}
  next: {arcs: [{step: join}]}
- step: join
  tool: {kind: noop, result: "{{ fast.result ~ slow.result }}"}
"""))
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["join"] == {"status": "done", "runs": 1, "result": "fs"}


def test_wait_for_a_duration_and_until_an_instant():
    r = run(book("""
- step: start
  tool:
    - {name: a, kind: wait, duration: 5s}
    - {name: b, kind: wait, until: "2000-01-01T00:00:00Z"}
"""))
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["start"]["result"] == {"waited": 0.0}  # until: in the past
    assert [w for _, w in r.fired] == ["timer wait", "timer wait"]
    assert [e["name"] for e in r.log].count("wait.ended") == 2


def test_a_step_timeout_fails_the_run_with_kind_timeout_and_arcs_route_it():
    r = run(book("""
- step: start
  spec: {policy: {lifecycle: {timeout_s: 3}}}
  tool: {kind: wait, duration: 1h}
  next: {arcs: [{step: ok}, {step: late, when: "{{ event.error.kind == 'timeout' }}"}]}
- step: ok
  tool: {kind: noop}
- step: late
  tool: {kind: noop, result: late}
"""))
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["start"]["status"] == "failed"
    assert "ok" not in s["steps"] and s["steps"]["late"]["result"] == "late"
    failed = next(e for e in r.log if e["name"] == "step.failed")
    assert failed["source"] == "router" and failed["data"]["error"]["kind"] == "timeout"


def test_an_unhandled_timeout_fails_the_execution_and_timers_of_a_finished_execution_do_nothing():
    r = run(book("""
- step: start
  spec: {policy: {lifecycle: {timeout_s: 1}}}
  tool: {kind: wait, duration: 1h}
"""))
    assert r.state.status == "FAILED"
    assert r.fired == [(pytest.approx(1, abs=0.5), "timer step_timeout")]  # the wait's timer never fired


def test_signals_resume_waits_early_ones_are_kept_and_a_timeout_ends_a_wait():
    doc = book("""
- step: start
  tool:
    - {name: nap, kind: wait, duration: 10s}
    - {name: a, kind: wait, signal: a}
    - {name: b, kind: wait, signal: b, timeout: 5s}
  next: {arcs: [{step: ok}, {step: timed_out, when: "{{ event.error.kind == 'timeout' }}"}]}
- step: ok
  tool: {kind: noop}
- step: timed_out
  tool: {kind: noop, result: "{{ start.result }}"}
""")
    r = run(doc, signals=[(1, "a", {"n": 1}), (30, "b", 2)])  # a: before its wait; b: after its timeout
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and "timed_out" in s["steps"] and "ok" not in s["steps"]
    ended = [e["data"]["outcome"] for e in r.log if e["name"] == "wait.ended"]
    assert ended[1]["result"]["payload"] == {"n": 1} and ended[2]["error"]["kind"] == "timeout"
    assert "b" not in s["signals"]  # the execution had ended: nothing more is sent to it


def test_loop_iterations_wait_for_their_own_signals():
    r = run(book("""
- step: start
  loop: {in: "{{ [1, 2, 3] }}", iterator: x, spec: {mode: parallel}}
  tool: [{name: w, kind: wait, signal: "go-{{ iter.x }}"}, {name: r, kind: noop, result: "{{ w.result.payload }}"}]
"""), signals=[(5, "go-2", "b"), (6, "go-1", "a"), (7, "go-3", "c")])
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["start"]["result"] == ["a", "b", "c"]


def test_replay_folds_timers_and_signals_to_the_services_state():
    r = run(book("""
- step: start
  tool: [{name: a, kind: wait, signal: a}]
  next: {arcs: [{step: end, spec: {delay: 1s}}]}
- step: end
  tool: {kind: noop}
"""), signals=[(0, "a", 1)])
    assert r.state.status == "COMPLETED"
    for service in ("admission", "router", "loop-coordinator"):
        live = r.states[service][r.execution_id]
        assert {k: (t.fired, t.kind) for k, t in live.timers.items()} == \
            {k: (t.fired, t.kind) for k, t in r.state.timers.items()}
        assert live.signals == r.state.signals


WAITING = {"execution_id": "x", "status": "RUNNING", "requested_by": "u1", "signals": {},
           "waits": [{"wait_id": "w1", "step": "s", "kind": "signal", "signal": "approve", "status": "waiting",
                      "roles": ["operator"], "schema": {"type": "object", "required": ["ok"]}}]}


def test_the_signal_rule():
    wait, no = check(WAITING, "approve", {"ok": 1}, user_id="u2", roles=["operator"])
    assert wait["wait_id"] == "w1" and no is None
    _, no = check(WAITING, "approve", {"ok": 1}, user_id="u1", roles=["developer"])
    assert no.status == 403 and "operator" in no.message  # the wait's roles, not the starter
    schema = WAITING["waits"][0]["schema"]
    no = schema_refusal("approve", schema, {"ok": {"deep": [1]}, "other": 2})
    assert no is None
    no = schema_refusal("approve", {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}}}},
                        {"n": [1, "two"]})
    assert no.status == 422 and no.location == "body['n'][1]" and "'two' is not of type 'integer'" in no.message
    early, no = check(WAITING, "later", 1, user_id="u1", roles=["developer"])
    assert early is None and no is None  # kept; the starter may send it (default: who may cancel)
    _, no = check(WAITING, "later", 1, user_id="u2", roles=["developer"])
    assert no.status == 403
    kept = {**WAITING, "kept_signals": ["later"]}
    assert check(kept, "later", 1, user_id="u1", roles=["admin"])[1].status == 409
    resumed = {**WAITING, "waits": [{**WAITING["waits"][0], "status": "ended"}]}
    assert check(resumed, "approve", {"ok": 1}, user_id="u1", roles=["admin"])[1].status == 409
    assert check({**WAITING, "status": "COMPLETED"}, "approve", {}, user_id="u1", roles=["admin"])[1].status == 409
    assert signal_id("x", "a", WAITING) != signal_id("x", "a", {"signals": {"a": 1}})  # the next one's id


def test_a_loop_step_timeout_cancels_the_child_executions_of_its_iterations():
    child = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "c", "path": "c"},
             "workflow": [{"step": "start", "tool": {"kind": "wait", "duration": "1h"}}]}
    r = asyncio.run(run_local(book("""
- step: start
  spec: {policy: {lifecycle: {timeout_s: 5}}}
  loop: {in: "{{ [1, 2] }}", iterator: x, spec: {mode: parallel}}
  tool: {kind: playbook, path: c}
  next: {arcs: [{step: after, when: "{{ event.error.kind == 'timeout' }}"}]}
- step: after
  tool: {kind: wait, duration: 1m}
"""), catalog={"c": child}))
    assert r.state.status == "COMPLETED"
    names = [e["name"] for e in r.log]
    children = [e for e in r.log if e["name"] == "playbook.child.finished"]
    assert [(e["iteration"], e["data"]["status"]) for e in children] == [(0, "CANCELLED"), (1, "CANCELLED")]
    # cancelled at the timeout, not at the end of the execution a minute later
    assert all(names.index("playbook.child.finished") < names.index("wait.ended") for e in children)
