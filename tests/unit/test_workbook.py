"""`kind: workbook`: a task that runs the root workbook task of that name with the caller's args, as
its own kind and fields, under the caller's policy (issue: "the caller's policy applying to its
outcome"), recorded under the caller's name."""
from __future__ import annotations

import asyncio

import yaml

from noetl_mesh.core import decide
from noetl_mesh.core.local import run_local
from noetl_mesh.core.pipeline import run_pipeline
from noetl_mesh.core.state import StepRun, summary
from noetl_mesh.testing.fakes import FakeHttp
from noetl_mesh.tools.noop import NoopTool


class FakePython:
    """Records what it was given; the result is the args it would bind as variables."""

    def __init__(self):
        self.seen = []

    async def run(self, task, spec, ctx):
        self.seen.append((dict(task), dict(spec)))
        return {"status": "ok", "result": dict(task.get("args") or {})}


def play(workflow, workbook=None, workload=None):
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "t/t"},
           "workload": workload or {}, "workflow": yaml.safe_load(workflow)}
    if workbook is not None:
        doc["workbook"] = yaml.safe_load(workbook) if isinstance(workbook, str) else workbook
    return doc


def run(doc, **tools):
    all_tools = {"noop": NoopTool(), **tools}
    r = asyncio.run(run_local(doc, tools=all_tools))
    return summary(r.state), r


def task_events(r, name):
    return [e for e in r.log if e["name"] == name]


def command(tasks, workbook, **extra):
    return {"execution_id": "e1", "step": "s", "step_run_id": "r1", "tasks": tasks, "workbook": workbook,
            "workload": {"base": "ok:"}, **extra}


def pipe(cmd, tools):
    events = []

    async def emit(name, data):
        events.append((name, data))

    async def no_sleep(_):
        return None

    res = asyncio.run(run_pipeline(cmd, tools, emit, sleep=no_sleep))
    return res, events


# ------------------------------------------------------------------------------------------ run_local


def test_workbook_noop_renders_result_with_caller_args():
    doc = play("""
- step: start
  tool:
    - {name: greet, kind: workbook, args: {who: "{{ workload.who }}", n: 2}}
    - {name: after, kind: noop, result: "{{ greet.result }}!"}
""", workbook="""
- {name: greet, kind: noop, result: "hello {{ args.who }} x{{ args.n }} ({{ workload.who }})"}
""", workload={"who": "ann"})
    s, r = run(doc)
    assert s["status"] == "COMPLETED"
    assert s["steps"]["start"]["result"] == "hello ann x2 (ann)!"
    processed = task_events(r, "task.processed")
    assert [e["task"] for e in processed] == ["greet", "after"]  # recorded under the caller's name


def test_workbook_task_referenced_by_task_field_and_with_alias():
    doc = play("""
- step: start
  tool:
    - {name: one, kind: workbook, task: fetch, with: {path: a}}
    - {name: two, kind: workbook, task: fetch, input: {path: "{{ one.result.p }}b"}}
""", workbook="""
- {name: fetch, kind: http, url: 'ok:{"p": "{{ args.path }}"}'}
""")
    http = FakeHttp()
    s, r = run(doc, http=http)
    assert s["status"] == "COMPLETED", s
    assert s["steps"]["start"]["result"] == {"p": "ab"}
    assert [t["url"] for t, _, _ in http.seen] == ['ok:{"p": "a"}', 'ok:{"p": "ab"}']
    assert [name for _, _, name in http.seen] == ["one", "two"]


def test_caller_retry_policy_retries_failing_workbook_task():
    doc = play("""
- step: start
  tool:
    - name: call
      kind: workbook
      task: flaky
      args: {n: 2}
      spec:
        policy:
          rules:
            - when: "{{ outcome.status == 'error' }}"
              then: {do: retry, attempts: 3, delay: 1}
""", workbook="""
- name: flaky
  kind: http
  url: "flaky:{{ args.n }}"
  spec:
    policy:
      rules:
        - else: {then: {do: break}}
""")
    http = FakeHttp()
    s, r = run(doc, http=http)
    assert s["status"] == "COMPLETED", s
    assert s["steps"]["start"]["result"] == "recovered"
    assert http.calls == {"flaky:2": 3}
    processed = task_events(r, "task.processed")
    assert [(e["task"], e["attempt"]) for e in processed] == [("call", 1), ("call", 2), ("call", 3)]
    assert len({e["action_id"] for e in processed}) == 1  # D21: retries keep the action_id


def test_caller_retry_exhausted_fails_and_workbook_policy_ignored():
    doc = play("""
- step: start
  tool:
    - name: call
      kind: workbook
      task: flaky
      spec: {policy: {rules: [{when: "{{ outcome.status == 'error' }}", then: {do: retry, attempts: 2}}]}}
""", workbook="""
- name: flaky
  kind: http
  url: "flaky:5"
  spec: {policy: {rules: [{else: {then: {do: continue}}}]}}
""")
    http = FakeHttp()
    s, _ = run(doc, http=http)
    assert s["status"] == "FAILED"
    assert s["steps"]["start"]["status"] == "failed"
    assert http.calls == {"flaky:5": 2}


def test_workbook_mapping_form_is_normalised_into_the_command():
    doc = play("""
- step: start
  tool: {kind: workbook, name: greet, args: {who: bob}}
""", workbook={"greet": {"kind": "noop", "result": "hi {{ args.who }}"}})
    s, r = run(doc)
    assert s["status"] == "COMPLETED", s
    assert s["steps"]["start"]["result"] == "hi bob"
    state = r.state
    assert state.playbook["workbook"] == [{"name": "greet", "kind": "noop", "result": "hi {{ args.who }}"}]
    cmd = decide.build_command(state, StepRun("run-x", "start", {}), pool="default")
    assert cmd["workbook"] == [{"name": "greet", "kind": "noop", "result": "hi {{ args.who }}"}]


def test_build_command_without_workbook_carries_empty_list():
    s, r = run(play("""
- step: start
  tool: {kind: noop, result: 1}
"""))
    cmd = decide.build_command(r.state, StepRun("run-x", "start", {}), pool="default")
    assert cmd["workbook"] == []


# ---------------------------------------------------------------------------------------- run_pipeline


def test_python_workbook_gets_caller_args_merged_and_spec_layered():
    py = FakePython()
    tasks = [{"name": "calc", "kind": "workbook", "task": "add", "args": {"b": "{{ workload.base }}", "c": 3},
              "spec": {"timeout": 9, "extra": {"y": 2}}}]
    workbook = [{"name": "add", "kind": "python", "code": "result = a + {{ not rendered }}",
                 "args": {"a": 1, "b": 0, "from_caller": "{{ args.c }}"},
                 "spec": {"timeout": 5, "extra": {"x": 1, "y": 1}}}]
    cmd = command(tasks, workbook, spec_layers={"step": {"extra": {"z": 0}}})
    res, events = pipe(cmd, {"python": py})
    assert res.status == "ok", res
    assert res.result == {"a": 1, "b": "ok:", "c": 3, "from_caller": 3}
    task, spec = py.seen[0]
    assert task["code"] == "result = a + {{ not rendered }}"  # D25: code is source
    assert "input" not in task
    assert spec["timeout"] == 9  # D5: the caller's task spec is innermost
    assert spec["extra"] == {"x": 1, "y": 2, "z": 0}
    assert [n for n, _ in events] == ["task.started", "task.processed"]
    assert events[1][1]["task"] == "calc"


def test_missing_workbook_task_is_invalid_task_through_caller_policy():
    tasks = [{"name": "call", "kind": "workbook", "task": "nope",
              "spec": {"policy": {"rules": [
                  {"when": "{{ outcome.error.kind == 'invalid_task' }}",
                   "then": {"do": "continue", "set_ctx": {"msg": "{{ outcome.error.message }}"}}}]}}},
             {"name": "after", "kind": "noop", "result": "{{ call.status }}"}]
    res, events = pipe(command(tasks, [{"name": "other", "kind": "noop"}]), {"noop": NoopTool()})
    assert res.status == "ok"
    assert res.result == "error"
    assert "nope" in res.ctx_patch["msg"]

    # without a policy the error fails the pipeline (D9)
    res, _ = pipe(command([{"name": "call", "kind": "workbook"}], []), {})
    assert res.status == "error"
    assert res.error["kind"] == "invalid_task"
    assert "call" in res.error["message"]


def test_nested_workbook_is_invalid_task():
    tasks = [{"name": "a", "kind": "workbook"}]
    workbook = [{"name": "a", "kind": "workbook", "task": "b"}, {"name": "b", "kind": "noop", "result": 1}]
    res, _ = pipe(command(tasks, workbook), {})
    assert res.status == "error"
    assert res.error["kind"] == "invalid_task"
    assert "nest" in res.error["message"]


def test_caller_args_template_error_and_scope_restored():
    tasks = [{"name": "bad", "kind": "workbook", "task": "w", "args": {"x": "{{ missing_name }}"},
              "spec": {"policy": {"rules": [{"else": {"then": {"do": "continue"}}}]}}},
             {"name": "good", "kind": "workbook", "task": "w", "args": {"x": "{{ args.step_arg }}"}},
             {"name": "last", "kind": "noop", "result": "{{ good.result }}/{{ args.step_arg }}"}]
    workbook = [{"name": "w", "kind": "noop", "result": "{{ args.x }}"}]
    res, events = pipe(command(tasks, workbook, args={"step_arg": "S"}), {"noop": NoopTool()})
    assert res.status == "ok", res
    first = [d for n, d in events if n == "task.processed"][0]["outcome"]
    assert first["error"]["kind"] == "template_error"
    assert res.result == "S/S"  # the step's own args are back in scope after the workbook call
