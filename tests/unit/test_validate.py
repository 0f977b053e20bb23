"""Every validation rule (D1, D2, D4, D12, D17; docs/dsl.md, "Validation") with a playbook that breaks it."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from noetl_mesh.lang.validate import PlaybookError, entry_step, load_playbook, validate, validate_text

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))

BASE = {
    "apiVersion": "noetl.io/v2",
    "kind": "Playbook",
    "metadata": {"name": "t", "path": "tests/t"},
    "workflow": [
        {"step": "start", "tool": [{"name": "a", "kind": "noop"}], "next": {"arcs": [{"step": "end"}]}},
        {"step": "end", "tool": {"kind": "noop"}},
    ],
}


def doc(**changes):
    d = copy.deepcopy(BASE)
    d.update(changes)
    return d


def step(i, d=None):
    d = d or copy.deepcopy(BASE)
    return d, d["workflow"][i]


def errors(d):
    return [(e.location, e.message) for e in validate(d).errors]


def assert_error(d, location, fragment):
    found = errors(d)
    assert any(loc == location and fragment in msg for loc, msg in found), found


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    result = validate_text(path.read_text())
    assert result.ok, [str(e) for e in result.errors]
    assert result.playbook is not None


def test_base_is_valid_and_normalised():
    result = validate(BASE)
    assert result.ok
    tasks = result.playbook.workflow[1].tool
    assert [t.name for t in tasks] == ["end_task"]  # D4 single-object shape
    assert result.document["workflow"][1]["tool"] == [{"kind": "noop", "name": "end_task"}]
    assert BASE["workflow"][1]["tool"] == {"kind": "noop"}  # input untouched


def test_unnamed_tasks_get_positional_names():
    d, s = step(0)
    s["tool"] = [{"kind": "noop"}, {"name": "x", "kind": "noop"}, {"kind": "noop"}]
    assert [t.name for t in validate(d).playbook.workflow[0].tool] == ["task_0", "x", "task_2"]


# --------------------------------------------------------------------------- D2 root
@pytest.mark.parametrize(
    "key,value,location,fragment",
    [
        ("apiVersion", "noetl.io/v1", "apiVersion", "noetl.io/v2"),
        ("kind", "Workflow", "kind", "Playbook"),
        ("metadata", {"name": "x"}, "metadata.path", "missing required key 'path'"),
        ("workflow", [], "workflow", "at least 1"),
    ],
)
def test_root_rules(key, value, location, fragment):
    assert_error(doc(**{key: value}), location, fragment)


def test_missing_root_keys_are_each_reported():
    found = errors({"kind": "Playbook"})
    locs = {loc for loc, _ in found}
    assert {"apiVersion", "metadata", "workflow"} <= locs


def test_root_vars_rejected():
    assert_error(doc(vars={"a": 1}), "vars", "root 'vars'")


def test_unknown_root_key_suggests():
    assert_error(doc(workfow=[]), "workfow", "did you mean 'workflow'")


def test_not_a_mapping():
    assert errors([1, 2])[0][1].startswith("a playbook is a YAML mapping")


def test_yaml_syntax_error_has_line():
    result = validate_text("apiVersion: x\nworkflow: [\n")
    assert not result.ok and "line" in result.errors[0].location


# --------------------------------------------------------------------------- D1 steps
def test_duplicate_step_names():
    d = copy.deepcopy(BASE)
    d["workflow"].append({"step": "end", "tool": {"kind": "noop"}})
    assert_error(d, "workflow[2].step=end.step", "duplicate step name 'end'")


def test_step_level_when_rejected():
    d, s = step(1)
    s["when"] = "{{ true }}"
    assert_error(d, "workflow[1].step=end.when", "spec.policy.admit")


@pytest.mark.parametrize("key", ["case", "eval", "expr"])
def test_legacy_step_keys_rejected(key):
    d, s = step(1)
    s[key] = []
    assert_error(d, f"workflow[1].step=end.{key}", "(D1)")


def test_next_as_list_rejected():
    d, s = step(0)
    s["next"] = [{"step": "end"}]
    assert_error(d, "workflow[0].step=start.next", "router object")


def test_arc_to_unknown_step():
    d, s = step(0)
    s["next"]["arcs"][0]["step"] = "ned"
    assert_error(d, "workflow[0].step=start.next.arcs[0].step", "unknown step 'ned' (did you mean 'end'?)")


def test_step_without_tool_or_next():
    d, s = step(1)
    del s["tool"]
    assert_error(d, "workflow[1].step=end", "'tool', a 'next'")


def test_unknown_step_key_suggests():
    d, s = step(1)
    s["loops"] = {}
    assert_error(d, "workflow[1].step=end.loops", "did you mean 'loop'")


def test_loop_needs_in_and_iterator():
    d, s = step(1)
    s["loop"] = {"in": "{{ workload.x }}"}
    assert_error(d, "workflow[1].step=end.loop.iterator", "missing required key 'iterator'")
    s["loop"] = {"iterator": "x"}
    assert_error(d, "workflow[1].step=end.loop.in", "missing required key 'in'")


def test_loop_iterator_reserved():
    d, s = step(1)
    s["loop"] = {"in": [1], "iterator": "index"}
    assert_error(d, "workflow[1].step=end.loop.iterator", "reserved")


@pytest.mark.parametrize("name", ["workload", "ctx", "iter", "args", "event", "outcome", "_prev", "keychain"])
def test_reserved_step_names(name):
    d = copy.deepcopy(BASE)
    d["workflow"][1]["step"] = name
    d["workflow"][0]["next"]["arcs"][0]["step"] = name
    assert_error(d, f"workflow[1].step={name}.step", "reserved")


def test_entry_step_must_exist():
    assert_error(doc(executor={"spec": {"entry_step": "begin"}}), "executor.spec.entry_step", "not a step")


def test_step_policy_rules_rejected():
    d, s = step(1)
    s["spec"] = {"policy": {"rules": [{"else": {"then": {"do": "retry"}}}]}}
    assert_error(d, "workflow[1].step=end.spec.policy.rules", "belong in a task's spec.policy")


# --------------------------------------------------------------------------- D1 tasks
def test_unknown_tool_kind_suggests():
    d, s = step(0)
    s["tool"][0]["kind"] = "pyhton"
    assert_error(d, "workflow[0].step=start.tool[0].kind", "unknown tool kind 'pyhton' (did you mean 'python'?)")


def test_missing_kind():
    d, s = step(0)
    del s["tool"][0]["kind"]
    assert_error(d, "workflow[0].step=start.tool[0]", "needs a 'kind'")


def test_misspelt_tool_field_is_an_error():
    d, s = step(0)
    s["tool"] = [{"name": "get", "kind": "http", "url": "http://x", "headrs": {}}]
    assert_error(d, "workflow[0].step=start.tool[0].headrs", "unknown key 'headrs' (did you mean 'headers'?)")


def test_tool_field_aliases_accepted():
    d, s = step(0)
    s["tool"] = [
        {"name": "get", "kind": "http", "endpoint": "http://x", "data": "b"},
        {"name": "py", "kind": "python", "code": "result = 1", "input": {"a": 1}},
        {"name": "dq", "kind": "duckdb", "query": "select 1"},
    ]
    result = validate(d)
    assert result.ok, result.errors
    http = result.playbook.workflow[0].tool[0]
    assert http.url == "http://x" and http.body == "b"


def test_missing_required_tool_field():
    d, s = step(0)
    s["tool"] = [{"name": "py", "kind": "python"}]
    assert_error(d, "workflow[0].step=start.tool[0].code", "missing required key 'code'")


def test_label_task_shape_rejected_in_list_and_single():
    d, s = step(0)
    s["tool"] = [{"fetch": {"kind": "http", "url": "x"}}]
    assert_error(d, "workflow[0].step=start.tool[0]", "'- name: fetch'")
    d, s = step(0)
    s["tool"] = {"fetch": {"kind": "http", "url": "x"}}
    assert_error(d, "workflow[0].step=start.tool", "not supported")


def test_duplicate_task_names():
    d, s = step(0)
    s["tool"] = [{"name": "a", "kind": "noop"}, {"name": "a", "kind": "noop"}]
    assert_error(d, "workflow[0].step=start.tool[1].name", "duplicate task name 'a'")


def test_duplicate_synthetic_task_name():
    d, s = step(0)
    s["tool"] = [{"kind": "noop"}, {"name": "task_0", "kind": "noop"}]
    assert_error(d, "workflow[0].step=start.tool[1].name", "duplicate task name 'task_0'")


def test_reserved_task_name():
    d, s = step(0)
    s["tool"][0]["name"] = "outcome"
    assert_error(d, "workflow[0].step=start.tool[0].name", "reserved")


@pytest.mark.parametrize("policy", [[{"when": "x"}], {"retry": 3}, "retry"])
def test_task_policy_must_be_object_with_rules(policy):
    d, s = step(0)
    s["tool"][0]["spec"] = {"policy": policy}
    assert_error(d, "workflow[0].step=start.tool[0].spec.policy", "object with a 'rules' list")


def test_jump_to_unknown_task():
    d, s = step(0)
    s["tool"] = [
        {"name": "a", "kind": "noop", "spec": {"policy": {"rules": [{"else": {"then": {"do": "jump", "to": "bb"}}}]}}},
        {"name": "b", "kind": "noop"},
    ]
    assert_error(
        d, "workflow[0].step=start.tool[0].spec.policy.rules[0].else.then.to", "unknown task 'bb' (did you mean 'b'?)"
    )


def test_bad_directive():
    d, s = step(0)
    s["tool"][0]["spec"] = {"policy": {"rules": [{"when": "{{ true }}", "then": {"do": "retyr"}}]}}
    assert_error(d, "workflow[0].step=start.tool[0].spec.policy.rules[0].then.do", "retyr")


def test_set_ctx_in_parallel_loop_rejected():
    d, s = step(1)
    s["loop"] = {"in": [1, 2], "iterator": "x", "spec": {"mode": "parallel"}}
    s["tool"] = {"kind": "noop", "spec": {"policy": {"rules": [{"else": {"then": {"set_ctx": {"a": 1}}}}]}}}
    assert_error(d, "workflow[1].step=end.tool.spec.policy.rules[0].else.then.set_ctx", "D12")
    s["loop"]["spec"]["mode"] = "sequential"
    assert validate(d).ok


def test_workbook_reference():
    d = doc(workbook=[{"name": "load", "kind": "noop", "result": 1}])
    d["workflow"][1]["tool"] = [{"name": "lod", "kind": "workbook"}]
    assert_error(d, "workflow[1].step=end.tool[0].name", "no workbook task named 'lod' (did you mean 'load'?)")
    d["workflow"][1]["tool"] = [{"name": "x", "kind": "workbook", "task": "load"}]
    assert validate(d).ok


def test_template_syntax_error_located():
    d, s = step(0)
    s["next"]["arcs"][0]["when"] = "{{ event.name == }}"
    assert_error(d, "workflow[0].step=start.next.arcs[0].when", "syntax")


def test_python_code_is_not_a_template():
    d, s = step(0)
    s["tool"] = [{"name": "p", "kind": "python", "code": "result = f'{{x}}' + '{{'"}]
    assert validate(d).ok


def test_all_errors_collected_across_steps():
    d = copy.deepcopy(BASE)
    d["vars"] = {}
    d["workflow"][0]["when"] = "x"
    d["workflow"][0]["tool"][0]["kind"] = "nope"
    d["workflow"][1]["next"] = {"arcs": [{"step": "nowhere"}]}
    locs = {loc for loc, _ in errors(d)}
    assert {
        "vars",
        "workflow[0].step=start.when",
        "workflow[0].step=start.tool[0].kind",
        "workflow[1].step=end.next.arcs[0].step",
    } <= locs


def test_load_playbook_raises_with_every_error():
    d = doc(vars={})
    d["workflow"][1]["next"] = {"arcs": [{"step": "nowhere"}]}
    with pytest.raises(PlaybookError) as info:
        load_playbook(d)
    assert len([x for x in info.value.diagnostics if x.severity == "error"]) == 2
    assert "nowhere" in str(info.value)


# --------------------------------------------------------------------------- warnings
def test_unknown_spec_key_is_a_warning():
    d, s = step(0)
    s["spec"] = {"policy": {"lifecycle": {"timeout_s": 5}}, "priorty": 1}
    result = validate(d)
    assert result.ok
    assert [(w.location, "priorty" in w.message) for w in result.warnings] == [("workflow[0].step=start.spec.priorty", True)]


def test_keychain_entries_warn_only_of_keys_their_kind_does_not_read():
    d = doc(keychain=[{"name": "a", "kind": "static", "token": "x", "region": "eu"},
                      {"name": "b", "kind": "env", "var": "HOME"},
                      {"name": "c", "kind": "credential", "credential": "pg"},
                      {"name": "d", "kind": "env", "varr": "HOME"},
                      {"name": "e", "kind": "credential", "credentail": "pg"}])
    result = validate(d)
    assert result.ok
    assert [(w.location, "did you mean" in w.message) for w in result.warnings] == [
        ("keychain[3].varr", True), ("keychain[4].credentail", True)]


def test_d17_admit_without_else_warning():
    d, s = step(1)
    s["spec"] = {"policy": {"admit": {"rules": [{"when": "{{ ctx.x }}", "then": {"allow": True}}]}}}
    result = validate(d)
    assert result.ok and any("D17" in w.message for w in result.warnings)
    s["spec"]["policy"]["admit"]["rules"].append({"else": {"then": {"allow": False}}})
    assert not any("D17" in w.message for w in validate(d).warnings)


def test_unreachable_step_warning():
    d = copy.deepcopy(BASE)
    d["workflow"].append({"step": "orphan", "tool": {"kind": "noop"}})
    result = validate(d)
    assert result.ok
    assert any(w.location == "workflow[2].step=orphan" and "unreachable" in w.message for w in result.warnings)


# --------------------------------------------------------------------------- D3
def test_entry_step_rules():
    assert entry_step(BASE) == "start"
    d = copy.deepcopy(BASE)
    d["workflow"][0]["step"] = "begin"
    assert entry_step(d) == "begin"  # first step
    d["executor"] = {"spec": {"entry_step": "end"}}
    assert entry_step(d) == "end"


def test_example_yaml_round_trip_unchanged():
    text = EXAMPLES[0].read_text()
    before = yaml.safe_load(text)
    validate(before)
    assert before == yaml.safe_load(text)
