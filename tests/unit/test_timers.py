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
    for service in ("admission", "router"):  # a flat execution: the loop-coordinator reads none of its timers
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


# --------------------------------------------------------------------- a signal that came before its wait
APPROVAL = """
- step: start
  tool:
    - {name: nap, kind: wait, duration: 10s}
    - name: ok
      kind: wait
      signal: approve
      timeout: 1h
      schema: {type: object, required: [ok], properties: {ok: {type: boolean}}}
  next: {arcs: [{step: done}]}
- step: done
  tool: {kind: noop, result: "{{ start.result.payload }}"}
"""


def timed_out(r) -> bool:
    """The approval wait ended by its timeout (no signal was delivered to it), so the step failed."""
    ended = [e["data"]["outcome"] for e in r.log if e["name"] == "wait.ended"]
    return summary(r.state)["status"] == "FAILED" and ended[-1]["error"]["kind"] == "timeout"


def test_an_early_signal_the_schema_refuses_is_not_delivered_and_the_wait_goes_on():
    """The signal comes before its wait (during the nap): when the wait begins it is checked against the
    wait's schema, refused (recorded, with the schema's error), and the wait takes the next valid one."""
    r = run(book(APPROVAL), signals=[(1, "approve", {"ok": "yes"}), (20, "approve", {"ok": True})])
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["done"]["result"] == {"ok": True}
    checked = [e for e in r.log if e["name"] == "signal.checked"]
    assert [(e["status"], e["data"]["accepted"]) for e in checked] == [("error", False), ("success", True)]
    assert checked[0]["data"]["location"] == "body['ok']" and "'yes' is not of type 'boolean'" in checked[0]["data"]["error"]
    refused = s["refused_signals"]
    assert [(x["signal"], x["step"], x["task"], x["location"]) for x in refused] == [("approve", "start", "ok", "body['ok']")]
    assert "is not of type 'boolean'" in refused[0]["error"]
    ended = [e["data"]["outcome"] for e in r.log if e["name"] == "wait.ended"]
    assert ended[-1]["result"]["payload"] == {"ok": True}  # never the refused payload
    names = [e["name"] for e in r.log]  # refused when the wait began, before anything resumed it
    assert names.index("signal.checked") > names.index("wait.started") and s["signals"] == {"approve": 2}


def test_an_early_signal_the_schema_accepts_is_delivered_when_its_wait_begins():
    r = run(book(APPROVAL), signals=[(1, "approve", {"ok": False})])
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["done"]["result"] == {"ok": False}
    assert [e["data"]["accepted"] for e in r.log if e["name"] == "signal.checked"] == [True]
    assert "refused_signals" not in s and "kept_signals" not in s


def test_an_early_signal_is_checked_only_within_bounds():
    """The control plane runs no regular expression and stops past signal_check_steps: such an early
    signal is refused, saying why, even when it would match; one sent to the open wait is checked in full
    by the gateway (schema_refusal)."""
    pattern = APPROVAL.replace("properties: {ok: {type: boolean}}", "properties: {ok: {type: string, pattern: '^(a+)+$'}}")
    r = run(book(pattern), signals=[(1, "approve", {"ok": "aaa"})])
    s = summary(r.state)
    assert timed_out(r)  # it waited on, for a signal that never came, until its timeout
    assert "its schema uses a pattern" in s["refused_signals"][0]["error"]
    from noetl_mesh.core.state import fold

    upto = next(i for i, e in enumerate(r.log) if e["name"] == "signal.checked")  # while it waits: in the inbox
    waiting = summary(fold(r.log[:upto + 1], r.execution_id))
    assert [w["status"] for w in waiting["waits"]] == ["ended", "waiting"]
    assert waiting["waits"][1]["refused_signals"][0]["error"] == s["refused_signals"][0]["error"]
    from noetl_mesh import limits

    with limits.override(signal_check_steps=5):
        r = run(book(APPROVAL), signals=[(1, "approve", {"ok": True})])
    assert "more than 5 steps" in summary(r.state)["refused_signals"][0]["error"]


def test_a_signal_unchecked_by_the_gateway_never_reaches_a_wait_with_a_schema():
    """A signal sent while the gateway saw no open wait (it was kept, unchecked) that finds the wait open
    in the log (the wait began meanwhile) is checked like an early one; the wait takes a signal as it is
    only when the gateway checked it for that wait (``wait_id``)."""
    from noetl_mesh.core.events import make_event
    from noetl_mesh.core.state import fold

    r = run(book(APPROVAL), signals=[(12, "approve", {"ok": 3})])  # after the nap: the wait is open
    s = summary(r.state)
    assert timed_out(r) and "is not of type 'boolean'" in s["refused_signals"][0]["error"]
    log = run(book(APPROVAL)).log  # no signal: cut where the wait has begun
    started = next(i for i, e in enumerate(log) if e["name"] == "wait.started" and e["data"]["kind"] == "signal")
    log, wait_id = log[:started + 1], log[started]["data"]["wait_id"]
    xid = log[0]["execution_id"]
    checked = make_event("signal.received", xid, event_id="sig-checked", source="gateway",
                         data={"signal": "approve", "payload": {"ok": True}, "by": "u", "at": "t", "wait_id": wait_id})
    state = fold(log + [checked], xid)
    assert state.task_waits[wait_id].outcome["result"]["payload"] == {"ok": True} and not state.kept
    other = dict(checked, event_id="sig-other", data={**checked["data"], "wait_id": "another wait"})
    state = fold(log + [other], xid)
    assert state.task_waits[wait_id].outcome is None and "approve" in state.kept  # for the decider to check


def test_replay_folds_the_early_signal_verdicts_to_every_services_state():
    r = run(book(APPROVAL), signals=[(1, "approve", {"ok": "yes"}), (20, "approve", {"ok": True})])
    for service in ("admission", "router"):  # a flat execution: the loop-coordinator reads none of its verdicts
        live = r.states[service][r.execution_id]
        assert live.refused_signals == r.state.refused_signals and live.kept == r.state.kept == {}


def test_a_log_from_before_waits_were_named_replays_as_it_ran():
    """An older log: the gateway checked the signal against the open wait but did not name it; the wait
    ended with it (wait.ended carries the outcome). Replay ends the wait with it and keeps nothing."""
    from noetl_mesh.core.state import fold

    r = run(book(APPROVAL), signals=[(12, "approve", {"ok": True})])
    log = [dict(e, data={k: v for k, v in e["data"].items() if k != "wait_id"}) if e["name"] == "signal.received"
           else e for e in r.log if e["name"] != "signal.checked"]
    state = fold(log, r.execution_id)
    assert state.status == "COMPLETED" and not state.kept


def test_the_bounded_check_agrees_with_the_full_one_or_refuses_saying_why():
    from noetl_mesh.core.signals import early_refusal

    schema = WAITING["waits"][0]["schema"]
    for payload in ({"ok": 1}, {"no": 1}, [1], {"ok": {"deep": [1]}}):
        assert early_refusal("a", schema, payload, 50_000) == schema_refusal("a", schema, payload)
    nested = {"type": "object", "properties": {"n": {"type": "array", "items": {"enum": [1, 2, 3]}}}}
    assert early_refusal("a", nested, {"n": [1, 4]}, 50_000).location == "body['n'][1]"
    # work that grows exponentially with a small schema ($refs doubling 40 times) stops at the budget
    doubling = {f"a{i}": {"allOf": [{"$ref": f"#/$defs/a{i + 1}"}] * 2} for i in range(40)}
    bomb = {"$defs": {**doubling, "a40": {"type": "integer"}}, "$ref": "#/$defs/a0"}
    assert "more than 50000 steps" in early_refusal("a", bomb, 1, 50_000).message
    assert "more than 100 values" in early_refusal("a", {}, list(range(200)), 100).message
    assert "refers to itself without end" in early_refusal("a", {"$ref": "#"}, 1, 50_000).message
    for uses in ({"patternProperties": {"^x": {}}}, {"additionalProperties": False, "patternProperties": {"(a+)+$": {}}},
                 {"unevaluatedProperties": False}):
        assert "its schema uses" in early_refusal("a", uses, {"x": 1}, 50_000).message, uses


def test_no_schema_check_fetches_a_reference_from_elsewhere():
    """A ``$ref`` to a URL is an error, never a request (jsonschema fetches remote references unless
    told not to: a playbook author could make the gateway or the control plane call any address)."""
    import http.server
    import threading

    from noetl_mesh.core.signals import early_refusal

    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = {"$ref": f"http://127.0.0.1:{server.server_port}/schema.json"}
        no = schema_refusal("a", remote, 1)
        assert no.status == 422 and "cannot be evaluated" in no.message and "Unresolvable" in no.message
        assert "cannot be evaluated" in early_refusal("a", remote, 1, 50_000).message
        assert asked == []
    finally:
        server.shutdown()
        server.server_close()


def test_an_early_signal_from_outside_the_waits_roles_is_not_delivered():
    """A signal sent before its wait began was checked only against who may cancel the execution: when
    the wait begins, the roles its request carried are checked against the wait's, and a sender outside
    them is refused like a payload the schema refuses (the starter cannot approve their own gate)."""
    gate = APPROVAL.replace("      timeout: 1h\n", "      timeout: 1h\n      roles: [approver]\n")
    r = run(book(gate), signals=[(1, "approve", {"ok": True}, ["developer"])])
    s = summary(r.state)
    assert timed_out(r)  # never delivered: it waited on until its timeout
    checked = [e for e in r.log if e["name"] == "signal.checked"]
    assert [e["data"]["accepted"] for e in checked] == [False]
    assert "takes it from the roles approver only, and its sender had developer" in s["refused_signals"][0]["error"]
    for roles in (["approver"], ["admin"], ["developer", "approver"]):
        ok = run(book(gate), signals=[(1, "approve", {"ok": True}, roles)])
        assert summary(ok.state)["status"] == "COMPLETED", roles
    # without a schema the roles are checked all the same
    bare = gate.replace("      schema: {type: object, required: [ok], properties: {ok: {type: boolean}}}\n", "")
    assert timed_out(run(book(bare), signals=[(1, "approve", {"ok": True}, ["developer"])]))
    assert summary(run(book(bare), signals=[(1, "approve", {}, ["approver"])]).state)["status"] == "COMPLETED"
