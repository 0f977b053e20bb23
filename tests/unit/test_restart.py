"""D32 restart from a step, on the in-process engine: the seed (core/restart.py), the new execution's
log and its replay, and every refusal."""
from __future__ import annotations

import asyncio

import pytest
import yaml

from noetl_mesh import limits
from noetl_mesh.core import restart
from noetl_mesh.core.local import restart_local, run_local
from noetl_mesh.core.state import fold, summary
from noetl_mesh.core.verify import verify
from noetl_mesh.testing.fakes import FakeHttp
from noetl_mesh.tools.noop import NoopTool


def play(workflow, workload=None, path="t/restart"):
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": path},
            "workload": workload or {}, "workflow": yaml.safe_load(workflow)}


def tools():
    return {"noop": NoopTool(), "http": FakeHttp()}


def run(doc, workload=None, seed=None, **kw):
    return asyncio.run(run_local(doc, tools=tools(), workload=workload, seed=seed, **kw))


def again(old, step, workload=None, seed=None, **kw):
    return asyncio.run(restart_local(old, step, workload=workload, tools=tools(), seed=seed, **kw))


def tasks(r, step):
    return sum(1 for e in r.log if e["name"] == "task.started" and e["step"] == step)


# c fails while workload.broken; a and b set ctx and pass results on
CHAIN = play("""
- step: a
  tool:
    kind: noop
    result: {rows: 3}
    spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {loaded: "{{ outcome.result.rows }}"}}}}]}}
  next: {arcs: [{step: b, args: {n: "{{ event.result.rows }}"}}]}
- step: b
  tool: {kind: noop, result: "{{ args.n * 10 }}"}
  next: {arcs: [{step: c, args: {total: "{{ event.result }}"}}]}
- step: c
  tool:
    kind: http
    url: "{{ 'error:500' if workload.broken else 'ok:' ~ (args.total + ctx.loaded) }}"
  next: {arcs: [{step: d}]}
- step: d
  tool: {kind: noop, result: "{{ c.result }} after {{ a.result.rows }}"}
""", workload={"broken": True, "day": "mon"})


def test_a_chain_restarted_from_its_failed_third_step_completes_without_the_first_two():
    old = run(CHAIN)
    assert old.state.status == "FAILED" and summary(old.state)["steps"]["c"]["status"] == "failed"
    new = again(old, "c", workload={"broken": False})
    s = summary(new.state)
    assert s["status"] == "COMPLETED", s
    # a and b ran once, in the old execution only; c and d in the new one
    assert [tasks(old, st) for st in "abcd"] == [1, 1, 1, 0]
    assert [tasks(new, st) for st in "abcd"] == [0, 0, 1, 1]
    assert not any(e["step"] in ("a", "b") for e in new.log if e["name"] in ("step.admitted", "task.started"))
    # what c and d read of a, b and ctx is what the old execution had
    assert s["steps"]["c"]["result"] == 33 and s["steps"]["d"]["result"] == "33 after 3"
    assert s["ctx"] == {"loaded": 3}
    assert s["steps"]["a"] == {"status": "done", "runs": 0, "result": {"rows": 3}, "restored": True}
    assert s["steps"]["b"]["restored"] and s["steps"]["c"] == {"status": "done", "runs": 1, "result": 33}
    # the request records where it came from; the token that started c comes again with its args
    first = new.log[0]
    assert first["name"] == "playbook.execution.requested"
    cut = next(e for e in old.log if e["name"] == "step.started" and e["step"] == "c")
    assert first["data"]["restarted_from"] == {"execution": old.execution_id, "step": "c", "upto_event": cut["event_id"]}
    assert s["restarted_from"]["execution"] == old.execution_id
    token = next(e for e in new.log if e["name"] == "token.enqueued")
    assert token["data"]["step"] == "c" and token["data"]["args"] == {"total": 30}
    assert token["data"]["place"] == "b#0->c"
    # the old execution is never changed; the new log verifies like any other
    assert summary(old.state)["status"] == "FAILED"
    assert verify(new.log).ok, verify(new.log).findings
    assert verify(old.log).ok


def test_a_changed_workload_is_merged_over_the_old_one_for_the_new_execution_only():
    old = run(CHAIN)
    new = again(old, "c", workload={"broken": False})
    assert summary(new.state)["workload"] == {"broken": False, "day": "mon"}  # day: the old execution's
    assert summary(old.state)["workload"] == {"broken": True, "day": "mon"}
    same = again(old, "c")  # the same workload: c fails again
    assert summary(same.state)["status"] == "FAILED" and tasks(same, "c") == 1 and tasks(same, "a") == 0


def test_replay_of_the_new_log_alone_is_the_state_every_service_holds():
    old = run(CHAIN)
    for seed in (None, 1, 2, 3):
        new = again(old, "c", workload={"broken": False}, seed=seed)
        replayed = fold(new.log)
        for service in ("admission", "router"):
            held = new.states[service][new.execution_id]
            assert summary(held) == summary(replayed)
            assert held.ctx == replayed.ctx and set(held.runs) == set(replayed.runs)
            assert [r.restored for r in held.runs.values()] == [r.restored for r in replayed.runs.values()]
        # and the log holds nothing of the old execution's but the request's seed
        assert {e["execution_id"] for e in new.log} == {new.execution_id}


FORK = play("""
- step: start
  tool: {kind: noop, result: go}
  next: {spec: {mode: inclusive}, arcs: [{step: left, args: {side: L}}, {step: right, args: {side: R}}]}
- step: left
  tool: {kind: http, url: "{{ 'error:503' if workload.broken else 'ok:\\"left\\"' }}"}
  next: {arcs: [{step: join, args: {l: "{{ event.result }}"}}]}
- step: right
  tool: {kind: noop, result: "{{ args.side }}"}
  next: {arcs: [{step: join, args: {r: "{{ event.result }}"}}]}
- step: join
  tool: {kind: noop, result: "{{ args }}"}
""", workload={"broken": True})


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3, 4, 5, 6, 7])
def test_a_fork_join_restarted_from_one_branch_takes_the_other_as_it_stood(seed):
    old = run(FORK, seed=seed)
    assert old.state.status == "FAILED"
    right_routed = right_done_first(old)
    new = again(old, "left", workload={"broken": False}, seed=seed)
    s = summary(new.state)
    assert s["status"] == "COMPLETED", s
    assert s["steps"]["join"]["result"] == {"l": "left", "r": "R"}  # the join fired once, with both
    assert s["steps"]["join"]["runs"] == 1 and tasks(new, "left") == 1 and tasks(new, "start") == 0
    # the other branch: taken as it was at the cut: done (its token on the join's place), or run again
    assert tasks(new, "right") == (0 if right_routed else 1)
    assert s["steps"]["right"].get("restored", False) == right_routed
    assert verify(new.log).ok, verify(new.log).findings


def right_done_first(r):
    cut = next(i for i, e in enumerate(r.log) if e["name"] == "step.started" and e["step"] == "left")
    return any(e["name"] == "next.evaluated" and e["step"] == "right" for e in r.log[:cut])


def test_the_seed_of_a_join_holds_its_partial_marking():
    # left comes after two more steps: right is done and routed, its token on the join's place, when
    # left starts
    doc = play("""
- step: start
  tool: {kind: noop, result: go}
  next: {spec: {mode: inclusive}, arcs: [{step: pre}, {step: right, args: {side: R}}]}
- step: pre
  tool: {kind: noop, result: pre}
  next: {arcs: [{step: pre2}]}
- step: pre2
  tool: {kind: noop, result: pre2}
  next: {arcs: [{step: left, args: {from: "{{ event.result }}"}}]}
- step: left
  tool: {kind: http, url: "{{ 'error:503' if workload.broken else 'ok:\\"left\\"' }}"}
  next: {arcs: [{step: join, args: {l: "{{ event.result }}"}}]}
- step: right
  tool: {kind: noop, result: "{{ args.side }}"}
  next: {arcs: [{step: join, args: {r: "{{ event.result }}"}}]}
- step: join
  tool: {kind: noop, result: "{{ args }}"}
""", workload={"broken": True})
    old = run(doc)
    assert right_done_first(old)
    start = restart.seed(old.log, "left", status="FAILED")
    tokens = start["state"]["tokens"]
    assert [(t["step"], t["place"]) for t in tokens] == [("join", "right#0->join"), ("left", "pre2#0->left")]
    assert tokens[0]["args"] == {"r": "R"} and tokens[1]["args"] == {"from": "pre2"}
    assert sorted(r["step"] for r in start["state"]["runs"]) == ["pre", "pre2", "right", "start"]
    new = again(old, "left", workload={"broken": False})
    s = summary(new.state)
    assert s["status"] == "COMPLETED" and s["steps"]["join"]["result"] == {"l": "left", "r": "R"}
    assert [tasks(new, st) for st in ("start", "pre", "pre2", "right", "left", "join")] == [0, 0, 0, 0, 1, 1]


LOOP = play("""
- step: prep
  tool: {kind: noop, result: [1, 2, 3, 4]}
  next: {arcs: [{step: each}]}
- step: each
  loop: {in: "{{ prep.result }}", iterator: x}
  tool: {kind: http, url: "{{ 'error:500' if iter.x == workload.bad else 'ok:' ~ (iter.x * 2) }}"}
  next: {arcs: [{step: sum, when: "{{ event.name == 'loop.done' }}"}]}
- step: sum
  tool: {kind: noop, result: "{{ each.result | sum }}"}
""", workload={"bad": 3})


def test_a_loop_step_is_restarted_whole():
    old = run(LOOP)
    assert old.state.status == "FAILED"
    assert sum(1 for e in old.log if e["name"] == "loop.iteration.done") == 2  # 1 and 2; 3 failed
    new = again(old, "each", workload={"bad": None})
    s = summary(new.state)
    assert s["status"] == "COMPLETED" and s["steps"]["sum"]["result"] == 20
    started = [e["iteration"] for e in new.log if e["name"] == "loop.iteration.started"]
    assert started == [0, 1, 2, 3]  # every iteration again, those that had passed too
    assert tasks(new, "prep") == 0


def test_a_step_after_a_child_execution_does_not_call_the_child_again():
    child = play("""
- step: twice
  tool: {kind: noop, result: "{{ args.n * 2 }}"}
""", path="t/child")
    parent = play("""
- step: call
  tool: {kind: playbook, path: t/child, args: {n: 21}}
  next: {arcs: [{step: use}]}
- step: use
  tool: {kind: http, url: "{{ 'error:500' if workload.broken else 'ok:' ~ call.result.steps.twice.result }}"}
""", workload={"broken": True})
    old = run(parent, catalog={"t/child": child})
    assert old.state.status == "FAILED" and len(old.executions) == 2
    new = again(old, "use", workload={"broken": False}, catalog={"t/child": child})
    s = summary(new.state)
    assert s["status"] == "COMPLETED" and s["steps"]["use"]["result"] == 42
    assert new.executions == [new.execution_id]  # no child this time
    assert "children" not in s


def test_a_restart_from_the_step_whose_child_failed_calls_a_new_child():
    child = play("""
- step: check
  tool: {kind: http, url: "{{ 'error:500' if workload.broken else 'ok:1' }}"}
""", workload={"broken": True}, path="t/flaky")
    parent = play("""
- step: call
  tool: {kind: playbook, path: t/flaky, workload: {broken: "{{ workload.broken }}"}}
""", workload={"broken": True})
    old = run(parent, catalog={"t/flaky": child})
    assert old.state.status == "FAILED"
    new = again(old, "call", workload={"broken": False}, catalog={"t/flaky": child})
    assert summary(new.state)["status"] == "COMPLETED" and len(new.executions) == 2
    assert summary(new.state)["children"] == [new.executions[1]]


def test_a_restarted_child_is_a_root_of_its_own():
    child = play("""
- step: one
  tool: {kind: noop, result: 1}
  next: {arcs: [{step: two}]}
- step: two
  tool: {kind: http, url: "{{ 'error:500' if workload.broken else 'ok:2' }}"}
""", workload={"broken": True}, path="t/kid")
    parent = play("""
- step: call
  tool: {kind: playbook, path: t/kid}
""")
    old = run(parent, catalog={"t/kid": child})
    kid = old.executions[1]
    new = again(old, "two", workload={"broken": False}, execution_id=kid, catalog={"t/kid": child})
    s = summary(new.state)
    assert s["status"] == "COMPLETED" and "parent_execution_id" not in s
    assert not any(e["name"] == "playbook.child.finished" for e in new.events)  # nobody to tell
    assert new.log[0]["data"]["restarted_from"]["execution"] == kid


def test_a_restart_of_a_restart_carries_the_first_results_over_again():
    old = run(CHAIN)
    second = again(old, "c")  # still broken
    third = again(second, "c", workload={"broken": False})
    s = summary(third.state)
    assert s["status"] == "COMPLETED" and s["steps"]["a"]["restored"] and s["steps"]["d"]["result"] == "33 after 3"
    with pytest.raises(restart.Refused) as refused:
        restart.seed(second.log, "b", status="FAILED")
    assert refused.value.kind == restart.NEVER_STARTED
    assert f"carried over from execution {old.execution_id}" in refused.value.message


# ----------------------------------------------------------------------------------------- refusals
def test_refusals_name_what_is_wrong():
    old = run(CHAIN)

    def refused(step, status="FAILED", log=None):
        with pytest.raises(restart.Refused) as exc:
            restart.seed(log or old.log, step, status=status)
        return exc.value

    running = refused("c", status="RUNNING")
    assert running.kind == restart.NOT_FINISHED and "is RUNNING" in running.message
    unknown = refused("cc")
    assert unknown.kind == restart.UNKNOWN_STEP and "did you mean 'c'" in unknown.message
    assert "its steps: a, b, c, d" in unknown.message
    never = refused("d")
    assert never.kind == restart.NEVER_STARTED and "step 'd' never started" in never.message
    skipped = run(play("""
- step: a
  tool: {kind: noop}
  next: {arcs: [{step: b}]}
- step: b
  spec: {policy: {admit: {rules: [{else: {then: {allow: false}}}]}}}
  tool: {kind: noop}
"""))
    assert "admission skipped it" in refused("b", status="COMPLETED", log=skipped.log).message
    invalid = [{"event_id": "r", "execution_id": "x", "name": "playbook.execution.requested", "data": {}},
               {"event_id": "e", "execution_id": "x", "name": "playbook.request.evaluated", "status": "error",
                "data": {"errors": ["bad"]}}]
    assert refused("a", log=invalid).kind == restart.NO_PLAYBOOK


def test_a_completed_execution_may_be_restarted_too():
    ok = run(CHAIN, workload={"broken": False})
    new = again(ok, "d")
    assert summary(new.state)["status"] == "COMPLETED" and tasks(new, "d") == 1 and tasks(new, "c") == 0


def test_the_fold_of_a_restart_is_bounded():
    old = run(CHAIN)
    with pytest.raises(limits.LimitExceeded) as exc:
        restart.seed(old.log, "c", status="FAILED", max_events=5)
    assert "max_state_events" in str(exc.value)
    with limits.override(max_state_events=5):
        with pytest.raises(limits.LimitExceeded):
            restart.seed(old.log, "c", status="FAILED")


@pytest.mark.parametrize("hostile, why", [
    ({"tokens": [{"token_id": "t", "step": "nowhere", "place": "entry", "args": {}}]}, "'nowhere' is not a step"),
    ({"tokens": [{"token_id": "t", "step": "c", "place": "a#0->b", "args": {}}]}, "is not a place of step 'c'"),
    ({"tokens": []}, "no token"),
    ({"runs": "x", "tokens": [{"token_id": "t", "step": "c", "args": {}}]}, "seed.runs is not a list"),
    ({"runs": [{"run_id": "r", "step": "a", "status": "running"}], "tokens": [{"token_id": "t", "step": "c"}]},
     "a run needs"),
    ({"ctx": [], "tokens": [{"token_id": "t", "step": "c"}]}, "seed.ctx is not a mapping"),
    ("seed", "not a mapping"),
])
def test_admission_refuses_a_seed_that_does_not_fit_the_playbook(hostile, why):
    r = asyncio.run(run_local(CHAIN, tools=tools(), request={
        "playbook": CHAIN, "restarted_from": {"execution": "x", "step": "c", "upto_event": "e"}, "seed": hostile}))
    state = r.state
    assert state.status == "FAILED" and not state.runs and state.ctx == {}
    assert any(why in e for e in state.errors), state.errors


def test_a_delayed_token_on_its_way_at_the_cut_arrives_in_the_new_execution():
    doc = play("""
- step: start
  tool: {kind: noop, result: 1}
  next: {spec: {mode: inclusive}, arcs: [{step: slow, spec: {delay: 60}}, {step: fast}]}
- step: slow
  tool: {kind: noop, result: slow}
- step: fast
  tool: {kind: http, url: "{{ 'error:500' if workload.broken else 'ok:1' }}"}
""", workload={"broken": True})
    old = run(doc)
    assert old.state.status == "FAILED"
    start = restart.seed(old.log, "fast", status="FAILED")
    assert [t["step"] for t in start["state"]["delayed"]] == ["slow"]
    new = again(old, "fast", workload={"broken": False})
    s = summary(new.state)
    assert s["status"] == "COMPLETED" and s["steps"]["slow"]["result"] == "slow" and tasks(new, "start") == 0


def test_the_console_view_marks_what_was_carried_over_and_where_from():
    from noetl_mesh.core import view

    old = run(CHAIN)
    new = again(old, "c", workload={"broken": False})
    shown = view.execution_view(new.state)
    assert shown["restarted_from"]["execution"] == old.execution_id and shown["restarted_from"]["step"] == "c"
    assert shown["steps"]["a"]["restored"] and shown["steps"]["a"]["runs"] == 0
    assert shown["runs"]["a"]["shown"][0]["restored"] and shown["runs"]["a"]["shown"][0]["result"] == {"rows": 3}
    assert "restored" not in shown["steps"]["c"] and shown["steps"]["c"]["runs"] == 1
    assert "restarted_from" not in view.execution_view(old.state)


def test_a_step_that_failed_before_it_started_is_restarted_from_its_failure():
    """A worker that refuses a command (D33: the pool does not serve its user) ends the run with
    ``step.failed`` and no ``step.started``: the cut is that failure, the same state as at a start."""
    old = run(CHAIN)
    unstarted = [e for e in old.log if not (e.get("step") == "c" and e["name"] in ("step.started", "task.started",
                                                                                  "task.processed"))]
    failure = next(e for e in unstarted if e["name"] == "step.failed" and e["step"] == "c")
    seed = restart.seed(unstarted, "c", status="FAILED")
    assert seed["upto_event"] == failure["event_id"]
    started = restart.seed(old.log, "c", status="FAILED")
    assert {**seed, "upto_event": None} == {**started, "upto_event": None}
