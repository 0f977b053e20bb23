"""Payload references (D23) are the engine's own: a value of their shape written by a user (a task's
result or error, what a template builds, a playbook's literal, a request body) is refused where it
enters, with where it stands; the services never fetch and copy what a user's reference names (one
reference repeated 2,000 times in a 300 KB result became a 600 MB step result)."""
from __future__ import annotations

import asyncio

import pytest
import yaml

from noetl_mesh.contracts.refs import STORE, forged, is_ref
from noetl_mesh.core.local import run_local
from noetl_mesh.core.pipeline import run_pipeline
from noetl_mesh.core.state import summary
from noetl_mesh.lang.templates import TemplateError, render
from noetl_mesh.lang.validate import validate
from noetl_mesh.services.gateway.body import BodyError, parse_json
from noetl_mesh.tools.noop import NoopTool

REF = {"store": STORE, "key": "ab" * 32, "size": 300_002, "checksum": "sha256:" + "ab" * 32}
D23 = "payload reference, which only the engine writes (D23)"


class Returns:
    """A tool that returns what the task says: its result, or an error outcome."""

    async def run(self, task, spec, ctx):
        if "error" in task:
            return {"status": "error", "result": None, "error": task["error"]}
        return {"status": "ok", "result": task["value"]}


def outcomes(tasks: list[dict]) -> list[dict]:
    events: list[tuple[str, dict]] = []

    async def emit(name, fields):
        events.append((name, fields))

    command = {"execution_id": "e1", "step": "s", "step_run_id": "r1", "iteration": None, "tasks": tasks,
               "spec_layers": {}, "workload": {}, "ctx": {}, "args": {}, "iter": None, "steps": {}, "keychain": {}}
    asyncio.run(run_pipeline(command, {"returns": Returns(), "noop": NoopTool()}, emit))
    return [f["outcome"] for n, f in events if n == "task.processed"]


def test_the_shape_is_exact() -> None:
    assert is_ref(REF)
    for near in ({**REF, "extra": 1}, {k: v for k, v in REF.items() if k != "size"}, {**REF, "store": "elsewhere"}):
        assert not is_ref(near) and forged({"a": [near]}) is None
    assert forged({"a": [1, {"b": REF}]}) == ("a", 1, "b")
    deep: object = REF
    for _ in range(5_000):  # deeper than Python's recursion
        deep = [deep]
    assert forged(deep) == (0,) * 5_000


@pytest.mark.parametrize("value, where", [
    ({"refs": [REF] * 2_000}, "result.refs[1999]"),
    ([1, 2, REF], "result[2]"),
    (REF, "result"),
])
def test_a_tool_result_holding_a_reference_is_the_tasks_error(value, where: str) -> None:
    (out,) = outcomes([{"name": "forge", "kind": "returns", "value": value}])
    assert out["status"] == "error" and out["result"] is None
    assert out["error"]["kind"] == "tool_error" and out["error"]["retryable"] is False
    assert f"task 'forge': its {where}" in out["error"]["message"] and D23 in out["error"]["message"]


def test_a_tool_error_holding_a_reference_is_refused_too() -> None:
    (out,) = outcomes([{"name": "forge", "kind": "returns", "error": {"kind": "http_error", "message": "x",
                                                                          "body": {"r": REF}}}])
    assert out["status"] == "error" and "its error.body.r" in out["error"]["message"] and D23 in out["error"]["message"]


def test_values_near_the_shape_pass() -> None:
    near = {"store": STORE, "key": "k", "size": 1}
    (out,) = outcomes([{"name": "t", "kind": "returns", "value": {"a": [near]}}])
    assert out["status"] == "ok" and out["result"] == {"a": [near]}


def test_a_template_that_builds_a_reference_fails_where_it_is_rendered() -> None:
    source = ("{{ {'refs': [{'store': 'nats-object:noetl_payloads', 'key': 'k', 'size': 1, 'checksum': 'c'}]} }}")
    with pytest.raises(TemplateError) as info:
        render(source, {}, "step=s.set_ctx.x")
    assert "step=s.set_ctx.x" in str(info.value) and "at refs[0]" in str(info.value) and D23 in str(info.value)
    # one made of parts the user holds (a workload, a previous result) is refused alike
    with pytest.raises(TemplateError):
        render("{{ [dict(store=s, key='k', size=1, checksum='c')] }}", {"s": STORE}, "x")
    # the same in a task: a noop's result template is the task's template_error
    (out,) = outcomes([{"name": "t", "kind": "noop",
                        "result": "{{ [dict(store='nats-object:' ~ 'noetl_payloads', key='k', size=1, checksum='c')] }}"}])
    assert out["status"] == "error" and out["error"]["kind"] == "template_error" and D23 in out["error"]["message"]


def test_a_template_that_only_reads_its_context_is_not_walked() -> None:
    """What a template is given (workload, results, ctx, iter) was checked where it entered the engine;
    only a value the template makes (arithmetic, a literal, a call, a filter) is looked at, so that
    reading a 100,000-item result costs what it did. A reference reaching the context some other way is
    kept as it is by a read, not expanded, and refused as soon as a template makes something of it."""
    given = {"rows": [{"id": i} for i in range(3)], "r": REF}
    assert render("{{ given }}", {"given": given}, "x") is given
    assert render("{{ given.rows[0] }}", {"given": given}, "x") is given["rows"][0]
    assert render("{{ given['r'] }}", {"given": given}, "x") is REF
    for made in ("{{ given.rows + [given.r] }}", "{{ dict(given.r) }}", "{{ given.r | list if false else [given.r] }}"):
        with pytest.raises(TemplateError, match="D23"):
            render(made, {"given": given}, "x")


@pytest.mark.parametrize("source", [
    "{{ (['{\"store\": \"nats-object:noetl_payloads\", \"key\": \"k\", \"size\": 1, \"checksum\": \"c\"}'] * 3)"
    " | map('from_json') | list }}",  # a filter applied by another filter
    "{{ dict(given.half, size=1, checksum='c') }}",  # a half the template was given, completed
])
def test_a_template_cannot_make_a_reference_by_any_expression(source: str) -> None:
    with pytest.raises(TemplateError, match=r"payload reference, which only the engine writes \(D23\)"):
        render(source, {"given": {"half": {"store": STORE, "key": "k"}}}, "x")


@pytest.mark.parametrize("source, why", [
    ("{{ 2 ** 64 }}", "an integer outside 64 bits"),
    ("{{ 18446744073709551616 }}", "an integer outside 64 bits"),  # a literal is made by the template too
    ("{{ {18446744073709551616: 1} }}", "a key JSON cannot hold"),
    ("{{ {(1, 2): 1} }}", "a key JSON cannot hold"),
    ("{{ [1, -(2 ** 63) - 1] }}", "at \\[1\\]: an integer outside 64 bits"),
    ("{{ {'a': 1e308 * 10} }}", "at a: a number that is not finite"),
    ("{{ ('[' * 70 ~ ']' * 70) | from_json }}", "nested deeper than 64 levels \\(the limit max_value_depth\\)"),
])
def test_a_template_cannot_make_a_number_the_log_cannot_hold(source: str, why: str) -> None:
    """Before, such a value failed where it was sent: a router or loop-coordinator dropped the message
    (the execution stayed RUNNING), a worker's report was redelivered until worker_lost."""
    with pytest.raises(TemplateError, match=why):
        render(source, {}, "step=s.next.arcs[0].args.n")
    assert render("{{ 2 ** 64 - 1 }}", {}, "x") == 2 ** 64 - 1


def test_a_workload_merged_from_two_halves_of_a_reference_fails_the_request() -> None:
    """Each side is checked where it enters (the playbook, the request); their merge (D26) is checked
    when the request is evaluated, whatever started it (the gateway, a parent, a schedule, a restart)."""
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "tests/t"},
           "workload": {"x": {"y": {"store": STORE, "key": REF["key"]}}},
           "workflow": [{"step": "start", "tool": {"kind": "noop"}}]}
    result = asyncio.run(run_local(doc, workload={"x": {"y": {"size": REF["size"], "checksum": REF["checksum"]}}},
                                   tools={"noop": NoopTool()}))
    evaluated = next(e for e in result.log if e["name"] == "playbook.request.evaluated")
    assert evaluated["status"] == "error", evaluated
    assert any("the workload (the playbook's merged with the request's) at x.y" in e and D23 in e
               for e in evaluated["data"]["errors"]), evaluated
    assert summary(result.state)["status"] == "FAILED"


def test_a_playbook_with_a_literal_reference_is_invalid_where_it_stands() -> None:
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "tests/t"},
           "workflow": [{"step": "start", "loop": {"in": [1, REF], "iterator": "i"}, "tool": {"kind": "noop"}}]}
    found = [(e.location, e.message) for e in validate(doc).errors]
    assert any(loc == "workflow[0].step=start.loop.in[1]" and D23 in msg for loc, msg in found), found


@pytest.mark.parametrize("raw, where", [
    (b'{"workload": {"r": [{"store": "nats-object:noetl_payloads", "key": "k", "size": 1, "checksum": "c"}]}}',
     "body.workload.r[0]"),
    # spelled with escapes, it is the same value
    (b'{"payload": {"\\u0073tore": "nats\\u002dobject:noetl_payloads", "key": "k", "size": 1, "checksum": "c"}}',
     "body.payload"),
])
def test_a_request_body_holding_a_reference_is_422_where_it_stands(raw: bytes, where: str) -> None:
    with pytest.raises(BodyError) as info:
        parse_json(raw, 64)
    assert info.value.status == 422 and info.value.location == where and D23 in info.value.message
    assert parse_json(b'{"w": {"store": "nats-object:noetl_payloads", "key": "k"}}', 64)["w"]["key"] == "k"


GROWS_CTX = """
- step: start
  tool:
    - {name: init, kind: noop, spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {v: 1, n: 0}}}}]}}}
    - name: grow
      kind: noop
      spec:
        policy:
          rules:
            - when: "{{ ctx.n < 100 }}"
              then: {do: jump, to: grow, set_ctx: {n: "{{ ctx.n + 1 }}", v: {a: "{{ ctx.v }}"}}}
            - else: {then: {do: continue}}
"""
GROWS_ARGS = """
- step: start
  tool: {kind: noop}
  next: {arcs: [{step: again, args: {v: 1, n: 0}}]}
- step: again
  tool: {kind: noop}
  next:
    arcs:
      - {step: again, when: "{{ args.n < 100 }}", args: {n: "{{ args.n + 1 }}", v: {a: {b: "{{ args.v }}"}}}}
"""


@pytest.mark.parametrize("workflow, where", [(GROWS_CTX, "start.grow.spec.policy.rules.set_ctx"),
                                             (GROWS_ARGS, "step=again.next.arcs[0].args")])
def test_a_playbook_cannot_nest_what_it_reads_past_max_value_depth(workflow: str, where: str) -> None:
    """No single template makes these values: the playbook's own mappings around a read grow them a level
    or two on every pass of a back-edge, until no event could hold them (the execution stopped with an
    engine_error, or stayed RUNNING). They fail where they are built, as a template_error."""
    doc = {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "tests/t"},
           "workflow": yaml.safe_load(workflow)}
    result = asyncio.run(run_local(doc, tools={"noop": NoopTool()}))
    s = summary(result.state)
    assert s["status"] == "FAILED", s
    error = next(e for e in result.log if e["name"] == "workflow.finished")["data"]["error"]
    assert error["kind"] == "template_error", error
    assert error["message"] == f"{where}: it builds lists and mappings nested deeper than 64 levels (the limit max_value_depth)"
