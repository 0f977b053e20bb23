"""The pipeline executor (D6-D12, D21) with scripted fake tools and a recording sleep. No I/O."""
from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from noetl_mesh.core.events import action_id
from noetl_mesh.core.pipeline import PipelineResult, retry_delay, run_pipeline
from noetl_mesh.tools.noop import NoopTool

OK = {"status": "ok"}


def err(kind: str = "boom", retryable: bool = False, result: Any = None) -> dict:
    return {"status": "error", "result": result, "error": {"kind": kind, "message": kind, "retryable": retryable}}


class Scripted:
    """Per task name, a list of partial outcomes handed out in order (the last one repeats).

    Without a script a task succeeds with its rendered ``value`` field as result. An Exception in the
    script is raised.
    """

    def __init__(self, script: dict[str, list[Any]] | None = None) -> None:
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.calls: list[dict] = []

    async def run(self, task: dict, spec: dict, ctx: Any) -> dict:
        self.calls.append({"task": ctx.task_name, "attempt": ctx.attempt, "fields": task, "spec": spec, "ctx": ctx})
        seq = self.script.get(ctx.task_name)
        if not seq:
            return {"status": "ok", "result": task.get("value")}
        item = seq.pop(0) if len(seq) > 1 else seq[0]
        if isinstance(item, BaseException):
            raise item
        out = dict(item)
        if out.get("status") == "ok" and "result" not in out:
            out["result"] = task.get("value")
        return out

    def names(self) -> list[str]:
        return [c["task"] for c in self.calls]


def t(name: str, policy: list | None = None, kind: str = "fake", **fields: Any) -> dict:
    task = {"name": name, "kind": kind, **fields}
    if policy is not None:
        task["spec"] = {"policy": {"rules": policy}}
    return task


def when(cond: str, **then: Any) -> dict:
    return {"when": cond, "then": then}


def else_(**then: Any) -> dict:
    return {"else": {"then": then}}


def command(tasks: list[dict], **kw: Any) -> dict:
    base = {
        "execution_id": "e1",
        "step": "s",
        "step_run_id": "r1",
        "iteration": None,
        "tasks": tasks,
        "spec_layers": {"executor": None, "step": None, "loop": None},
        "workload": {"w": 1},
        "ctx": {},
        "args": {},
        "iter": None,
        "steps": {},
        "keychain": {},
        "loop_mode": None,
    }
    base.update(kw)
    return base


class Run:
    def __init__(self, res: PipelineResult, events: list, sleeps: list, tool: Scripted) -> None:
        self.res, self.events, self.sleeps, self.tool = res, events, sleeps, tool

    def names(self, event: str = "task.started") -> list:
        return [(f["task"], f["attempt"]) for n, f in self.events if n == event]

    def outcomes(self) -> list[dict]:
        return [f["outcome"] for n, f in self.events if n == "task.processed"]


def run(cmd: dict, script: dict | None = None, *, rng=None, tools: dict | None = None, cancel=None) -> Run:
    tool = Scripted(script)
    events: list = []
    sleeps: list = []

    async def emit(name: str, fields: dict) -> None:
        events.append((name, copy.deepcopy(fields)))

    async def sleep(d: float) -> None:
        sleeps.append(d)

    kw = {"rng": rng} if rng is not None else {}
    registry = {"fake": tool, "noop": NoopTool()}
    registry.update(tools or {})
    res = asyncio.run(run_pipeline(cmd, registry, emit, sleep=sleep, cancel=cancel, **kw))
    return Run(res, events, sleeps, tool)


# ------------------------------------------------------------------------------------ D9 policy


def test_first_matching_rule_wins():
    r = run(
        command(
            [
                t("a", [
                    when("{{ false }}", do="fail"),
                    when("{{ outcome.status == 'ok' }}", do="continue", set_ctx={"first": True}),
                    when("{{ true }}", do="fail", set_ctx={"second": True}),
                ], value=1),
                t("b", value=2),
            ]
        )
    )
    assert r.res.status == "ok"
    assert r.res.ctx_patch == {"first": True}
    assert r.tool.names() == ["a", "b"]


def test_else_applies_when_nothing_matches():
    r = run(command([t("a", [when("{{ false }}", do="continue"), else_(do="fail")], value=1), t("b")]))
    assert r.res.status == "error"
    assert r.res.error == {"kind": "policy_fail", "message": "task a failed by policy", "retryable": False}
    assert r.tool.names() == ["a"]


def test_else_position_does_not_matter():
    r = run(command([t("a", [else_(do="break"), when("{{ true }}", do="fail")], value=1), t("b")]))
    assert r.res.status == "error"  # the when rule matched; else only applies when nothing does


def test_no_policy_ok_continues_error_fails():
    r = run(command([t("a", value=1), t("b", value=2)]))
    assert (r.res.status, r.res.result, r.res.error) == ("ok", 2, None)
    r = run(command([t("a"), t("b")]), {"a": [err("kaput", result="partial")]})
    assert r.res.status == "error"
    assert r.res.error["kind"] == "kaput"
    assert r.res.result == "partial"
    assert r.tool.names() == ["a"]


def test_policy_without_match_or_else_continues_even_on_error():
    r = run(command([t("a", [when("{{ false }}", do="fail")]), t("b", value="B")]), {"a": [err()]})
    assert r.res.status == "ok"
    assert r.res.result == "B"
    assert r.tool.names() == ["a", "b"]


def test_output_is_an_alias_of_outcome_and_data_of_result():
    r = run(command([t("a", [when("{{ output.data == 5 and outcome.result == 5 }}", do="break")], value=5), t("b")]))
    assert r.res.status == "ok"
    assert r.tool.names() == ["a"]


# ------------------------------------------------------------------------------------- retry


def test_retry_attempts_is_total_and_exhaustion_fails_with_last_outcome():
    r = run(
        command([t("a", [when("{{ outcome.status == 'error' }}", do="retry", attempts=3)]), t("b")]),
        {"a": [err("e1", result=1), err("e2", result=2), err("e3", result=3), OK]},
    )
    assert r.names() == [("a", 1), ("a", 2), ("a", 3)]
    assert r.res.status == "error"
    assert r.res.error["kind"] == "e3"
    assert r.res.result == 3
    assert r.res.visits == 1
    assert r.sleeps == [0.0, 0.0]


def test_retry_until_success_then_continue():
    r = run(
        command([t("a", [when("{{ outcome.status == 'error' }}", do="retry", attempts=5)], value="A"), t("b", value="B")]),
        {"a": [err(), err(), OK]},
    )
    assert r.names() == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    assert r.res.status == "ok"
    assert r.res.result == "B"


def test_retry_default_attempts_is_two():
    r = run(command([t("a", [when("{{ true }}", do="retry")])]), {"a": [err()]})
    assert r.names() == [("a", 1), ("a", 2)]
    assert r.res.status == "error"


def test_retry_exhausted_on_ok_outcome():
    r = run(command([t("a", [when("{{ true }}", do="retry", attempts=2)], value=7)]))
    assert r.res.status == "error"
    assert r.res.error["kind"] == "retries_exhausted"
    assert r.res.result == 7


@pytest.mark.parametrize(
    "backoff,expected",
    [("none", [2.0, 2.0, 2.0, 2.0]), ("linear", [2.0, 4.0, 6.0, 8.0]), ("exponential", [2.0, 4.0, 8.0, 16.0])],
)
def test_backoff_delays(backoff, expected):
    rule = when("{{ true }}", do="retry", attempts=5, backoff=backoff, delay=2)
    r = run(command([t("a", [rule])]), {"a": [err()]})
    assert r.sleeps == expected
    assert len(r.tool.calls) == 5


def test_backoff_capped_by_max_delay_default_and_explicit():
    rule = when("{{ true }}", do="retry", attempts=5, backoff="exponential", delay=10, max_delay=25)
    assert run(command([t("a", [rule])]), {"a": [err()]}).sleeps == [10.0, 20.0, 25.0, 25.0]
    rule = when("{{ true }}", do="retry", attempts=4, backoff="exponential", delay=40)
    assert run(command([t("a", [rule])]), {"a": [err()]}).sleeps == [40.0, 60.0, 60.0]


def test_jitter_uses_injected_rng_in_half_to_one_and_a_half():
    rule = when("{{ true }}", do="retry", attempts=4, delay=4, jitter=True)
    values = iter([0.0, 0.5, 0.999999])
    r = run(command([t("a", [rule])]), {"a": [err()]}, rng=lambda: next(values))
    assert r.sleeps[0] == 2.0
    assert r.sleeps[1] == 4.0
    assert 5.99 < r.sleeps[2] < 6.0
    for d in r.sleeps:
        assert 2.0 <= d < 6.0


def test_retry_delay_template_and_units():
    rule = when("{{ true }}", do="retry", attempts=3, delay="{{ outcome.error.retryable and 1.5 or 0 }}")
    assert run(command([t("a", [rule])]), {"a": [err(retryable=True)]}).sleeps == [1.5, 1.5]
    rule = when("{{ true }}", do="retry", attempts=2, delay="250ms")
    assert run(command([t("a", [rule])]), {"a": [err()]}).sleeps == [0.25]


def test_retry_delay_function():
    assert retry_delay({"backoff": "linear", "max_delay": 5}, 3, lambda: 0.0, 2.0) == 5.0
    assert retry_delay({"backoff": "exponential", "jitter": True}, 1, lambda: 0.25, 2.0) == 1.5


def test_retries_keep_action_id_and_raise_attempt_visits_get_new_ids():
    r = run(
        command(
            [t("a", [when("{{ outcome.status == 'error' }}", do="retry", attempts=3),
                     when("{{ iter.loops | default(0) < 1 }}", do="jump", to="a", set_iter={"loops": 1})])],
        ),
        {"a": [err(), OK]},
    )
    started = [f for n, f in r.events if n == "task.started"]
    assert [(f["attempt"]) for f in started] == [1, 2, 1]
    assert started[0]["action_id"] == started[1]["action_id"] == action_id("e1", "r1", None, "a", 0)
    assert started[2]["action_id"] == action_id("e1", "r1", None, "a", 1)
    assert started[0]["action_id"] != started[2]["action_id"]
    outs = r.outcomes()
    assert [o["meta"]["attempt"] for o in outs] == [1, 2, 1]
    assert outs[0]["meta"]["action_id"] == started[0]["action_id"]


# ---------------------------------------------------------------------------- jump, break, fail


def test_jump_forward_skips_tasks():
    r = run(command([t("a", [when("{{ true }}", do="jump", to="c")], value=1), t("b", value=2), t("c", value=3)]))
    assert r.tool.names() == ["a", "c"]
    assert r.res.result == 3
    assert r.res.visits == 2


def test_jump_backward_loops_with_set_iter_counter():
    tasks = [
        t("a", [else_(do="continue", set_iter={"n": "{{ (iter.n | default(0)) + 1 }}"})], value="{{ iter.n | default(0) }}"),
        t("b", [when("{{ iter.n < 3 }}", do="jump", to="a")], value="{{ iter.n }}"),
    ]
    r = run(command(tasks))
    assert r.tool.names() == ["a", "b"] * 3
    assert r.res.status == "ok"
    assert r.res.result == 3
    assert r.res.iter == {"n": 3}
    assert r.res.visits == 6


def test_jump_cycle_is_stopped_by_max_steps():
    cmd = command([t("a", [when("{{ true }}", do="jump", to="a")], value=1)],
                  spec_layers={"executor": {"max_steps": 50}, "step": {"max_steps": 5}, "loop": None})
    r = run(cmd)
    assert r.res.status == "error"
    assert r.res.error["kind"] == "max_steps_exceeded"
    assert r.res.visits == 5
    assert len(r.tool.calls) == 5
    assert r.res.result == 1


def test_max_steps_from_loop_layer_wins():
    cmd = command([t("a", [when("{{ true }}", do="jump", to="a")])],
                  spec_layers={"executor": None, "step": {"max_steps": 5}, "loop": {"max_steps": 2}})
    assert run(cmd).res.visits == 2


def test_retries_do_not_count_toward_max_steps():
    cmd = command(
        [t("a", [when("{{ outcome.status == 'error' }}", do="retry", attempts=4)], value="A"), t("b", value="B")],
        spec_layers={"executor": None, "step": {"max_steps": 2}, "loop": None},
    )
    r = run(cmd, {"a": [err(), err(), err(), OK]})
    assert r.res.status == "ok"
    assert r.res.result == "B"
    assert r.res.visits == 2
    assert len(r.tool.calls) == 5


def test_max_steps_exact_limit_is_allowed():
    cmd = command([t("a"), t("b"), t("c")], spec_layers={"executor": None, "step": {"max_steps": 3}, "loop": None})
    assert run(cmd).res.status == "ok"


def test_break_ends_successfully_with_that_result():
    r = run(command([t("a", value=1), t("b", [when("{{ true }}", do="break")], value=2), t("c", value=3)]))
    assert r.res.status == "ok"
    assert r.res.result == 2
    assert r.tool.names() == ["a", "b"]


def test_fail_on_ok_outcome():
    r = run(command([t("a", [when("{{ outcome.result > 1 }}", do="fail")], value=5), t("b")]))
    assert r.res.status == "error"
    assert r.res.result == 5
    assert r.res.error == {"kind": "policy_fail", "message": "task a failed by policy", "retryable": False}


def test_fail_on_error_outcome_keeps_its_error():
    r = run(command([t("a", [when("{{ true }}", do="fail")])]), {"a": [err("http_error")]})
    assert r.res.error["kind"] == "http_error"


def test_jump_to_unknown_task_fails():
    r = run(command([t("a", [when("{{ true }}", do="jump", to="zzz")])]))
    assert r.res.status == "error"
    assert r.res.error["kind"] == "policy_error"


# ------------------------------------------------------------------------------- set_iter / set_ctx


def test_set_ctx_and_set_iter_apply_before_directive_and_are_visible_next():
    tasks = [
        t("a", [when("{{ true }}", do="continue", set_ctx={"token": "{{ outcome.result }}"},
                     set_iter={"seen": "{{ outcome.result | upper }}"})], value="xyz"),
        t("b", value="{{ ctx.token }}/{{ iter.seen }}"),
    ]
    r = run(command(tasks, ctx={"keep": 1}))
    assert r.res.result == "xyz/XYZ"
    assert r.res.ctx_patch == {"token": "xyz"}
    assert r.res.iter == {"seen": "XYZ"}


def test_set_ctx_applies_even_when_directive_fails_or_breaks():
    r = run(command([t("a", [when("{{ true }}", do="fail", set_ctx={"why": "{{ outcome.result }}"})], value="v")]))
    assert r.res.status == "error"
    assert r.res.ctx_patch == {"why": "v"}
    r = run(command([t("a", [when("{{ true }}", do="break", set_iter={"k": 1})]), t("b")]))
    assert r.res.iter == {"k": 1}


def test_set_iter_before_retry_is_visible_to_the_retry():
    rule = when("{{ outcome.status == 'error' }}", do="retry", attempts=3,
                set_iter={"tries": "{{ (iter.tries | default(0)) + 1 }}"})
    r = run(command([t("a", [rule], value="{{ iter.tries | default(0) }}")]), {"a": [err(), err(), OK]})
    assert [c["fields"]["value"] for c in r.tool.calls] == [0, 1, 2]
    assert r.res.result == 2


def test_ctx_patched_events_last_writer_wins():
    tasks = [
        t("a", [when("{{ true }}", set_ctx={"k": 1, "x": "a"})]),
        t("b", [when("{{ true }}", set_ctx={"k": "{{ ctx.k + 1 }}"})]),
    ]
    r = run(command(tasks, ctx={"k": 0, "other": True}))
    patched = [f for n, f in r.events if n == "ctx.patched"]
    assert patched == [
        {"task": "a", "patch": {"k": 1, "x": "a"}, "action_id": action_id("e1", "r1", None, "a", 0)},
        {"task": "b", "patch": {"k": 2}, "action_id": action_id("e1", "r1", None, "b", 1)},
    ]
    assert r.res.ctx_patch == {"k": 2, "x": "a"}


def test_set_iter_outside_a_loop_uses_a_scratch_scope_and_loop_scope_is_copied():
    r = run(command([t("a", [when("{{ true }}", set_iter={"x": 1})]), t("b", value="{{ iter.x }}")]))
    assert r.res.result == 1
    assert r.res.iter == {"x": 1}
    it = {"row": {"id": 7}, "index": 2, "parent": None}
    cmd = command([t("a", [when("{{ true }}", set_iter={"done": "{{ iter.row.id }}"})], value="{{ iter.index }}")],
                  iter=it, iteration=2)
    snapshot = copy.deepcopy(cmd)
    r = run(cmd)
    assert r.res.iter == {"row": {"id": 7}, "index": 2, "parent": None, "done": 7}
    assert r.res.result == 2
    assert cmd == snapshot  # the command is not mutated
    assert r.events[0][1]["iteration"] == 2
    assert r.events[0][1]["action_id"] == action_id("e1", "r1", 2, "a", 0)


# ------------------------------------------------------------------------------ D10 noop, D11 result


def test_noop_passes_previous_result_through():
    r = run(command([t("a", value={"x": 1}), t("n", kind="noop")]))
    assert r.res.result == {"x": 1}
    assert r.res.status == "ok"


def test_noop_first_has_none_and_explicit_result_is_rendered():
    r = run(command([t("n", kind="noop")]))
    assert r.res.result is None
    r = run(command([t("a", value=3), t("n", kind="noop", result="{{ a.result * 2 }}")]))
    assert r.res.result == 6
    r = run(command([t("n", kind="noop", result=None), t("m", kind="noop")]))
    assert r.res.result is None


def test_noop_template_error_goes_through_policy():
    r = run(command([t("n", [when("{{ outcome.error.kind == 'template_error' }}", do="break")],
                       kind="noop", result="{{ missing }}")]))
    assert r.res.status == "ok"
    assert r.outcomes()[0]["error"]["kind"] == "template_error"


def test_noop_uses_the_registered_tool_when_it_is_not_the_builtin():
    custom = Scripted({"n": [{"status": "ok", "result": "custom"}]})
    r = run(command([t("n", kind="noop")]), tools={"noop": custom})
    assert r.res.result == "custom"


def test_step_result_is_last_executed_task():
    r = run(command([t("a", value=1), t("b", [when("{{ true }}", do="jump", to="d")], value=2),
                     t("c", value=3), t("d", value=4)]))
    assert r.res.result == 4
    assert run(command([])).res == PipelineResult("ok", None, None, {}, {}, 0)


# ---------------------------------------------------------------------------------- D6 namespaces


def test_finished_tasks_readable_by_name_with_data_alias():
    tasks = [
        t("a", value={"n": 2}),
        t("b", value="{{ a.result.n }}-{{ a.data.n }}-{{ a.status }}-{{ a.meta.attempt }}"),
        t("c", [when("{{ true }}", do="continue")], value="{{ b.error is none }}"),
    ]
    r = run(command(tasks))
    assert r.tool.calls[1]["fields"]["value"] == "2-2-ok-1"
    assert r.res.result is True


def test_earlier_steps_readable_and_shadowed_by_task_names():
    steps = {"start": {"status": "done", "result": {"k": "v"}}, "b": {"status": "done", "result": "step-b"}}
    tasks = [
        t("x", value="{{ start.result.k }}{{ start.data.k }}{{ b.result }}"),
        t("b", value="task-b"),
        t("y", value="{{ b.result }}"),
    ]
    r = run(command(tasks, steps=steps))
    assert r.tool.calls[0]["fields"]["value"] == "vvstep-b"
    assert r.res.result == "task-b"


def test_prev_task_attempt_locals():
    fields = {"prev": "{{ _prev }}", "me": "{{ _task }}", "att": "{{ _attempt }}"}
    rule = when("{{ outcome.status == 'error' }}", do="retry", attempts=2)
    r = run(command([t("a", value="A", **fields), t("b", [rule], value="B", **fields)]), {"b": [err(), OK]})
    seen = [(c["fields"]["prev"], c["fields"]["me"], c["fields"]["att"]) for c in r.tool.calls]
    assert seen == [(None, "a", 1), ("A", "b", 1), ("A", "b", 2)]


def test_namespaces_workload_args_execution_id_keychain():
    cmd = command([t("a", value="{{ workload.w }}|{{ args.p }}|{{ execution_id }}|{{ keychain.api.token }}")],
                  args={"p": "P"}, keychain={"api": {"token": "T"}})
    assert run(cmd).res.result == "1|P|e1|T"


def test_name_kind_spec_and_python_code_are_not_rendered():
    custom = Scripted()
    tasks = [{"name": "p", "kind": "python", "code": "x = '{{ not_rendered }}'", "args": {"v": "{{ workload.w }}"},
              "spec": {"note": "{{ nope }}"}}]
    r = run(command(tasks), tools={"python": custom})
    fields = custom.calls[0]["fields"]
    assert fields["code"] == "x = '{{ not_rendered }}'"
    assert fields["args"] == {"v": 1}
    assert r.res.status == "ok"


# ------------------------------------------------------------------------------------- errors


def test_template_error_in_inputs_is_an_error_outcome_through_policy():
    rule = when("{{ outcome.error.kind == 'template_error' and not outcome.error.retryable }}", do="continue",
                set_ctx={"msg": "{{ outcome.error.message }}"})
    r = run(command([t("a", [rule], value="{{ nope.x }}"), t("b", value="B")]))
    assert r.res.status == "ok"
    assert r.tool.names() == ["b"]  # the tool was not called for a
    assert "s.a.value" in r.res.ctx_patch["msg"] and "nope" in r.res.ctx_patch["msg"]
    r = run(command([t("a", value="{{ nope }}")]))
    assert r.res.status == "error"
    assert r.res.error["kind"] == "template_error"


def test_tool_exception_becomes_tool_error():
    r = run(command([t("a")]), {"a": [RuntimeError("bug")]})
    assert r.res.status == "error"
    assert r.res.error == {"kind": "tool_error", "message": "RuntimeError: bug", "retryable": False}
    assert r.names("task.processed") == [("a", 1)]


def test_unknown_kind_is_tool_error_and_malformed_partial_is_normalised():
    r = run(command([t("a", kind="nope")]))
    assert r.res.error["kind"] == "tool_error"
    r = run(command([t("a")]), {"a": [{"status": "error", "error": "just text"}]})
    assert r.res.error == {"kind": "tool_error", "message": "just text", "retryable": False}
    r = run(command([t("a")]), {"a": [{"error": {"kind": "x"}}]})
    assert r.res.error == {"kind": "x", "message": "", "retryable": False}


def test_template_error_in_policy_fails_the_pipeline():
    r = run(command([t("a", [when("{{ outcome.nothing.deeper }}", do="continue")]), t("b")]))
    assert r.res.status == "error"
    assert r.res.error["kind"] == "template_error"
    assert r.tool.names() == ["a"]


# ----------------------------------------------------------------------------- events, spec, cancel


def test_event_order_and_fields():
    tasks = [t("a", [when("{{ true }}", set_ctx={"k": 1})], value=1), t("b", value=2)]
    r = run(command(tasks))
    assert [n for n, _ in r.events] == ["task.started", "task.processed", "ctx.patched", "task.started",
                                        "task.processed"]
    started = r.events[0][1]
    assert started == {"task": "a", "attempt": 1, "action_id": action_id("e1", "r1", None, "a", 0), "iteration": None}
    processed = r.events[1][1]
    assert set(processed) == {"task", "attempt", "action_id", "iteration", "outcome"}
    out = processed["outcome"]
    assert out["status"] == "ok" and out["result"] == 1 and out["error"] is None
    assert set(out["meta"]) == {"attempt", "duration_ms", "action_id"}
    assert "data" not in out  # the alias exists for templates only


def test_effective_spec_and_timeout_reach_the_tool():
    layers = {"executor": {"timeout": 9, "x": {"a": 1}}, "step": {"x": {"b": 2}}, "loop": {"y": 1}}
    custom = Scripted()
    task = {"name": "h", "kind": "http", "url": "u", "spec": {"timeout": 3}}
    run(command([task], spec_layers=layers), tools={"http": custom})
    call = custom.calls[0]
    assert call["spec"] == {"timeout": 3, "x": {"a": 1, "b": 2}, "y": 1}
    assert call["ctx"].timeout == 3
    custom = Scripted()
    run(command([{"name": "h", "kind": "http", "url": "u"}]), tools={"http": custom})
    assert custom.calls[0]["ctx"].timeout == 30.0  # KIND_DEFAULTS


def test_cancel_stops_a_running_tool():
    class Slow:
        cancelled = False

        async def run(self, task, spec, ctx):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                Slow.cancelled = True
                raise
            return OK

    async def main():
        cancel = asyncio.Event()
        events = []

        async def emit(n, f):
            events.append(n)

        async def trigger():
            await asyncio.sleep(0.05)
            cancel.set()

        trig = asyncio.ensure_future(trigger())
        res = await run_pipeline(command([t("a", kind="slow"), t("b")]), {"slow": Slow(), "fake": Scripted()},
                                 emit, cancel=cancel)
        await trig
        return res, events

    res, events = asyncio.run(main())
    assert res.status == "error" and res.error["kind"] == "cancelled"
    assert Slow.cancelled
    assert events == ["task.started", "task.processed"]


def test_cancel_set_before_start():
    ev = asyncio.Event()
    ev.set()
    r = run(command([t("a")]), cancel=ev)
    assert r.res.error["kind"] == "cancelled"
    assert r.tool.calls == []
