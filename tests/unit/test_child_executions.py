"""`kind: playbook`: child executions on the in-process engine — results, failures, retries, loops
(D19 iter.parent), recursion depth, cancellation — and the pipeline's suspend/resume on its own."""
from __future__ import annotations

import asyncio

import pytest
import yaml

from noetl_mesh.core.local import run_local
from noetl_mesh.core.pipeline import run_pipeline
from noetl_mesh.core.state import summary
from noetl_mesh.tools.noop import NoopTool
from noetl_mesh.tools.python import PythonTool


def book(path, workflow, workload=None, **root):
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": path.split("/")[-1], "path": path},
            "workload": workload or {}, "workflow": yaml.safe_load(workflow), **root}


def run(doc, catalog=(), seed=None, tools=None):
    tools = tools or {"noop": NoopTool()}
    return asyncio.run(run_local(doc, tools=tools, seed=seed,
                                 catalog={b["metadata"]["path"]: b for b in catalog}))


GRANDCHILD = book("t/grandchild", """
- step: start
  tool: {kind: noop, result: "{{ workload.n * 2 }}"}
  next: {arcs: [{step: end}]}
- step: end
  tool:
    kind: noop
    result: "{{ start.result + 1 }}"
    spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {g: "{{ outcome.result }}"}}}}]}}
""", workload={"n": 0})

CHILD = book("t/child", """
- step: start
  tool:
    - {name: first, kind: noop, result: "{{ args.x }}"}
    - name: deeper
      kind: playbook
      path: t/grandchild
      workload: {n: "{{ first.result }}"}
  next: {arcs: [{step: end, args: {g: "{{ event.result.ctx.g }}"}}]}
- step: end
  tool: {kind: noop, result: "{{ args.g * 100 }}"}
""")

PARENT = book("t/parent", """
- step: start
  tool:
    - name: before
      kind: noop
      result: 7
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {seen: "{{ outcome.result }}"}}}}]}}
    - {name: call, kind: playbook, path: t/child, args: {x: "{{ before.result }}"}}
    - {name: after, kind: noop, result: "{{ [before.result, call.result.steps.end.result, ctx.seen] }}"}
  next: {arcs: [{step: end}]}
- step: end
  tool: {kind: noop, result: "{{ start.result }}"}
""")


def test_parent_child_grandchild_results_flow_back():
    r = run(PARENT, [CHILD, GRANDCHILD])
    s = summary(r.state)
    assert s["status"] == "COMPLETED"
    # the grandchild: 7*2 = 14, +1 = 15 into ctx.g; the child's end: 15*100; the parent's pipeline goes
    # on after the child with its earlier outcomes and its own set_ctx intact
    assert s["steps"]["end"]["result"] == [7, 1500, 7]
    assert len(r.executions) == 3
    child_id, grandchild_id = r.executions[1], r.executions[2]
    assert s["children"] == [child_id]
    child = summary(r.state_of(child_id))
    assert child["status"] == "COMPLETED" and child["parent_execution_id"] == r.execution_id
    assert child["children"] == [grandchild_id]
    assert summary(r.state_of(grandchild_id))["ctx"] == {"g": 15}
    # the parent's playbook task: started once, suspended once, processed once with the child's result
    call = [e for e in r.log if e.get("task") == "call"]
    assert [e["name"] for e in call] == ["task.started", "task.suspended", "task.processed"]
    outcome = call[-1]["data"]["outcome"]
    assert outcome["status"] == "ok" and outcome["result"]["execution_id"] == child_id
    assert outcome["result"]["status"] == "COMPLETED" and outcome["result"]["steps"]["end"]["result"] == 1500
    assert call[1]["status"] == "paused"
    # the resumed run does not start the step again
    assert [e["name"] for e in r.log if e["name"] == "step.started" and e["step"] == "start"] == ["step.started"]


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_same_outcome_under_random_interleavings(seed):
    r = run(PARENT, [CHILD, GRANDCHILD], seed=seed)
    assert summary(r.state)["steps"]["end"]["result"] == [7, 1500, 7]


FAILING = book("t/failing", """
- step: start
  tool: {kind: noop, result: "{{ args.missing.value }}"}
""")


def test_child_failure_is_the_tasks_error_and_fails_the_parent_unhandled():
    parent = book("t/p", """
- step: start
  tool: {kind: playbook, path: t/failing}
""")
    r = run(parent, [FAILING])
    s = r.state
    assert s.status == "FAILED"
    failed = next(e for e in r.log if e["name"] == "step.failed")
    err = failed["data"]["error"]
    assert err["kind"] == "child_failed" and "t/failing" in err["message"] and "FAILED" in err["message"]
    assert err["cause"]["kind"] == "template_error" and err["child_execution_id"] == r.executions[1]
    assert failed["data"]["result"]["status"] == "FAILED"  # D11: the child's result also on failure


def test_policy_retries_a_failed_child_with_a_new_execution_then_routes_the_error():
    parent = book("t/p", """
- step: start
  tool:
    kind: playbook
    path: t/failing
    spec:
      policy:
        rules:
          - when: "{{ outcome.error.kind == 'child_failed' and _attempt < 3 }}"
            then: {do: retry, attempts: 3}
          - else: {then: {do: continue, set_ctx: {gave_up: "{{ _attempt }}"}}}
  next: {arcs: [{step: end}]}
- step: end
  tool: {kind: noop}
""")
    r = run(parent, [FAILING])
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["ctx"] == {"gave_up": 3}
    assert len(s["children"]) == 3 and len(set(s["children"])) == 3  # one child execution per attempt
    processed = [e for e in r.log if e["name"] == "task.processed"]
    assert [e["attempt"] for e in processed if e["step"] == "start"] == [1, 2, 3]
    assert len({e["action_id"] for e in processed if e["step"] == "start"}) == 1  # D21: one visit


def test_missing_catalog_path_is_a_clear_child_failure():
    parent = book("t/p", """
- step: start
  tool: {kind: playbook, path: "t/{{ workload.name }}"}
""", workload={"name": "nowhere"})
    r = run(parent)
    err = next(e for e in r.log if e["name"] == "step.failed")["data"]["error"]
    assert err["kind"] == "child_failed" and "no playbook at path 't/nowhere'" in err["message"]


def test_loop_iterations_each_call_a_child_that_sees_iter_parent():
    child = book("t/c", """
- step: start
  loop: {in: "{{ [1, 2] }}", iterator: n}
  tool: {kind: noop, result: "{{ iter.parent.city ~ '-' ~ iter.n ~ '-' ~ iter.parent.index }}"}
""")
    parent = book("t/p", """
- step: start
  loop: {in: "{{ ['a', 'b', 'c'] }}", iterator: city, spec: {mode: parallel, max_in_flight: 3}}
  tool:
    - {name: call, kind: playbook, path: t/c}
    - {name: pick, kind: noop, result: "{{ call.result.steps.start.result }}"}
""")
    r = run(parent, [child], seed=7)
    s = summary(r.state)
    assert s["status"] == "COMPLETED"
    assert s["steps"]["start"]["result"] == [["a-1-0", "a-2-0"], ["b-1-1", "b-2-1"], ["c-1-2", "c-2-2"]]
    assert len(s["children"]) == 3


SELF = book("t/self", """
- step: start
  tool: {kind: playbook, path: t/self}
""", executor={"spec": {"policy": {"limits": {"max_depth": 3}}}})


def test_recursion_depth_is_bounded_and_reported():
    r = run(SELF)
    assert r.state.status == "FAILED"
    assert len(r.executions) == 4  # depths 0..3: the call from depth 3 is refused, no execution made
    deepest = r.state_of(r.executions[-1])
    err = next(e for e in r.log_of(deepest.execution_id) if e["name"] == "step.failed")["data"]["error"]
    assert err["kind"] == "recursion_limit" and "would nest child executions 4 deep; the limit is 3" in err["message"]
    # every level above fails with child_failed, whose cause chain ends at the limit
    top = next(e for e in r.log if e["name"] == "step.failed")["data"]["error"]
    assert top["kind"] == "child_failed" and "recursion_limit" in str(top)
    assert all(r.state_of(x).status == "FAILED" for x in r.executions)


def test_default_depth_limit_is_inherited_by_children():
    own_limit = book("t/self", """
- step: start
  tool: {kind: playbook, path: t/self}
""", executor={"spec": {"policy": {"limits": {"max_depth": 50}}}})
    root = book("t/root", """
- step: start
  tool: {kind: playbook, path: t/self}
""", executor={"spec": {"policy": {"limits": {"max_depth": 2}}}})
    r = run(root, [own_limit])
    assert len(r.executions) == 3  # the root's limit binds the whole tree (a child cannot raise it)


def test_parent_failure_cancels_a_running_child():
    slow = book("t/slow", "\n".join(
        f"- step: s{i}\n  tool: {{kind: noop}}\n  next: {{arcs: [{{step: s{i + 1}}}]}}" for i in range(30))
        + "\n- step: s30\n  tool: {kind: noop}\n")
    parent = book("t/p", """
- step: start
  tool: {kind: noop}
  next: {spec: {mode: inclusive}, arcs: [{step: call}, {step: boom}]}
- step: call
  tool: {kind: playbook, path: t/slow}
- step: boom
  tool: {kind: noop, result: "{{ nope.nothing }}"}
""")
    r = run(parent, [slow])
    assert r.state.status == "FAILED"
    child = r.state_of(r.executions[1])
    assert child.status == "CANCELLED"
    cancel = next(e for e in r.log_of(child.execution_id) if e["name"] == "execution.cancelled")
    assert r.execution_id in cancel["data"]["reason"]
    assert r.state.runs[r.state.runs_of["call"][0]].status == "cancelled"


def test_workbook_task_of_kind_playbook_runs_a_child():
    parent = book("t/p", """
- step: start
  tool: {kind: workbook, name: run_child, args: {x: 5}}
""", workbook=[{"name": "run_child", "kind": "playbook", "path": "t/child"}])
    r = run(parent, [CHILD, GRANDCHILD])
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["start"]["result"]["steps"]["end"]["result"] == 1100


# ------------------------------------------------------------------------------------------ pipeline alone
def _command(tasks, **kw):
    return {"execution_id": "e1", "step": "s", "step_run_id": "r1", "iteration": None, "tasks": tasks,
            "ctx": {}, "workload": {}, "args": {}, "steps": {}, **kw}


async def _collect(command, tools=None):
    events = []

    async def emit(name, fields):
        events.append((name, fields))

    result = await run_pipeline(command, tools or {"noop": NoopTool()}, emit)
    return result, events


TASKS = [
    {"name": "a", "kind": "noop", "result": 1,
     "spec": {"policy": {"rules": [{"else": {"then": {"do": "continue", "set_iter": {"k": 9}}}}]}}},
    {"name": "call", "kind": "playbook", "path": "x/{{ a.result }}", "args": {"v": "{{ iter.k }}"}},
    {"name": "b", "kind": "noop", "result": "{{ [a.result, call.result, iter.k] }}"},
]


def test_pipeline_suspends_at_a_playbook_task_and_resumes_with_the_childs_outcome():
    result, events = asyncio.run(_collect(_command(TASKS)))
    assert result.status == "suspended" and result.suspend["task"] == "call"
    child = result.suspend["child"]
    assert child["path"] == "x/1" and child["args"] == {"v": 9} and child["iter_parent"] is None
    assert [n for n, _ in events] == ["task.started", "task.processed", "task.started"]
    cont = result.suspend["continuation"]
    assert cont["outcomes"]["a"]["result"] == 1 and cont["iter"] == {"k": 9}

    resumed, events = asyncio.run(_collect(_command(TASKS, resume={
        "continuation": cont, "outcome": {"status": "ok", "result": "child!", "error": None}})))
    assert resumed.status == "ok" and resumed.result == [1, "child!", 9]
    assert [(n, f["task"]) for n, f in events] == [("task.processed", "call"), ("task.started", "b"),
                                                   ("task.processed", "b")]
    assert events[0][1]["action_id"] == result.suspend["action_id"]


def test_pipeline_resume_with_an_error_outcome_applies_the_tasks_policy():
    tasks = [dict(TASKS[1], spec={"policy": {"rules": [
        {"when": "{{ outcome.status == 'error' }}", "then": {"do": "jump", "to": "b"}}]}}), TASKS[2]]
    result, _ = asyncio.run(_collect(_command(tasks)))
    assert result.status == "error"  # the path renders `a.result`: a template error, not a suspension
    ok_tasks = [dict(t) for t in tasks]
    ok_tasks[0]["path"] = "x/y"
    del ok_tasks[0]["args"]
    ok_tasks[1]["result"] = "{{ call.error.kind }}"
    result, _ = asyncio.run(_collect(_command(ok_tasks)))
    assert result.status == "suspended"
    resumed, _ = asyncio.run(_collect(_command(ok_tasks, resume={
        "continuation": result.suspend["continuation"],
        "outcome": {"status": "error", "result": None, "error": {"kind": "child_failed", "message": "x"}}})))
    assert resumed.status == "ok" and resumed.result == "child_failed"


def test_pipeline_rejects_bad_playbook_fields_as_error_outcomes():
    bad = [{"name": "call", "kind": "playbook", "path": "p", "args": "{{ [1, 2] }}"}]
    result, events = asyncio.run(_collect(_command(bad)))
    assert result.status == "error" and result.error["kind"] == "invalid_task"
    assert "call.args must be a mapping, got list" in result.error["message"]
    resumed, _ = asyncio.run(_collect(_command(bad, resume={"continuation": {"task": "other", "pc": 0},
                                                            "outcome": {}})))
    assert resumed.status == "error" and resumed.error["kind"] == "invalid_resume"


def test_a_python_task_before_a_child_keeps_its_result_across_the_suspension():
    tools = {"noop": NoopTool(), "python": PythonTool()}
    tasks = [{"name": "py", "kind": "python", "code": "def main():\n    return {'n': 41}"},
             {"name": "call", "kind": "playbook", "path": "p"},
             {"name": "out", "kind": "noop", "result": "{{ py.result.n + call.result }}"}]

    async def go():
        try:
            first, _ = await _collect(_command(tasks), tools)
            cont = first.suspend["continuation"]
            return await _collect(_command(tasks, resume={
                "continuation": cont, "outcome": {"status": "ok", "result": 1, "error": None}}), tools)
        finally:
            await tools["python"].close()

    resumed, _ = asyncio.run(go())
    assert resumed.result == 42


SLOW = book("t/slow", "\n".join(
    f"- step: s{i}\n  tool: {{kind: noop}}\n  next: {{arcs: [{{step: s{i + 1}}}]}}" for i in range(8))
    + "\n- step: s8\n  tool: {kind: noop}\n")


@pytest.mark.parametrize("seed", [None, 1, 2, 3, 4, 5, 6])
def test_a_failing_fail_fast_loop_leaves_no_child_running(seed):
    """Iteration 0 waits for a child while iteration 1 fails: the loop step fails (fail_fast) and the
    child is cancelled; an iteration that suspends after the step failed gets no child at all."""
    parent = book("t/p", """
- step: start
  loop: {in: "{{ [0, 1, 2] }}", iterator: x, spec: {mode: parallel, max_in_flight: 16}}
  tool:
    - {name: boom, kind: noop, result: "{{ nope.x if iter.x == 1 else 1 }}"}
    - {name: call, kind: playbook, path: t/slow}
""")
    r = run(parent, [SLOW], seed=seed)
    assert r.state.status == "FAILED"
    children = [x for x in r.executions if x != r.execution_id]
    statuses = [r.state_of(x).status for x in children]
    assert all(s in ("COMPLETED", "CANCELLED") for s in statuses), statuses  # none left running
    if seed is None:  # in order: iteration 0 suspends, iteration 1 fails, the waiting child is cancelled
        assert statuses == ["CANCELLED"]
        reason = next(e for e in r.log_of(children[0]) if e["name"] == "execution.cancelled")["data"]["reason"]
        assert "loop step 'start' failed (iteration 1)" in reason


def test_chunked_parallel_loop_with_suspending_iterations():
    child = book("t/c", """
- step: start
  tool: {kind: noop, result: "{{ args.n * 10 }}"}
""")
    parent = book("t/p", """
- step: start
  loop: {in: "{{ range(40) | list }}", iterator: n, spec: {mode: parallel, max_in_flight: 64}}
  tool:
    - {name: call, kind: playbook, path: t/c, args: {n: "{{ iter.n }}"}}
    - {name: out, kind: noop, result: "{{ call.result.steps.start.result }}"}
""")
    for seed in (None, 3):
        r = run(parent, [child], seed=seed)
        s = summary(r.state)
        assert s["status"] == "COMPLETED" and s["steps"]["start"]["result"] == [n * 10 for n in range(40)]
        assert len(s["children"]) == 40
    # max_in_flight 64 ships 8 iterations per command (decide.chunk_size): each suspended iteration of
    # a chunk came back as its own resume command
    suspended = [e for e in r.log if e["name"] == "task.suspended"]
    assert len({e["iteration"] for e in suspended}) == 40


def test_a_child_cancelled_before_its_request_never_starts():
    """The parent's router may cancel a child before the parent's admission's request reaches the
    child's log: the child ends CANCELLED and the late request starts nothing."""
    from noetl_mesh.core import decide
    from noetl_mesh.core.events import make_event
    from noetl_mesh.core.state import ExecutionState, apply

    cancel = make_event("execution.cancelled", "c1", event_id="cancel", source="router", data={"reason": "parent ended"})
    request = make_event("playbook.execution.requested", "c1", event_id="request", source="admission",
                         data={"catalog": {"path": "t/child"}, "parent_execution_id": "p1", "depth": 1,
                               "parent": {"execution_id": "p1", "step": "s", "step_run_id": "r"}})
    router, admission = ExecutionState("c1"), ExecutionState("c1")
    apply(router, cancel)
    finished = decide.router(router, cancel).events
    assert [e["data"]["status"] for e in finished if e["name"] == "workflow.finished"] == ["CANCELLED"]
    for e in [cancel, *finished, request]:
        apply(admission, e)
    late = decide.admission(admission, request, CHILD)
    assert late.events == [] and late.commands == [] and admission.status == "CANCELLED"
    apply(router, request)
    assert decide.router(router, request).events == []


def test_keychain_values_inside_names_do_not_break_a_suspension():
    """D24 masks every keychain value in what workers publish; the child's path and the task names a
    continuation holds are not values: a keychain value that is part of them must not alter them."""
    child = book("t/sales/report", """
- step: start
  tool: {kind: noop, result: 1}
""")
    parent = book("t/p", """
- step: start
  tool:
    - {name: load_sales, kind: noop, result: "{{ keychain.wh.password | length }}"}
    - {name: call, kind: playbook, path: t/sales/report, args: {pw: "{{ keychain.wh.password }}"}}
    - {name: after, kind: noop, result: "{{ load_sales.result + call.result.steps.start.result }}"}
""", keychain=[{"name": "wh", "kind": "static", "database": "sales", "password": "s3cr3t-pw"}])
    r = run(parent, [child])
    s = summary(r.state)
    assert s["status"] == "COMPLETED" and s["steps"]["start"]["result"] == 10
    suspended = next(e for e in r.log if e["name"] == "task.suspended")["data"]
    assert suspended["child"]["path"] == "t/sales/report" and list(suspended["continuation"]["outcomes"]) == ["load_sales"]
    assert suspended["child"]["args"] == {"pw": "***"}  # values are masked: the child gets ***
    # (a static entry is part of the playbook, so of its evaluated event: only what workers publish is masked)
    assert "s3cr3t-pw" not in str([e for e in r.events if e["source"].startswith("worker")])
