"""`noetl lint` (docs/lint.md): every rule with a playbook that triggers it and a close one that does
not; the output formats (text, JSON, SARIF 2.1.0) and the exit codes."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import yaml

from noetl_mesh.cli import main
from noetl_mesh.lang import lint as lint_mod
from noetl_mesh.lang.graph import WorkflowGraph
from noetl_mesh.lang.lint import RULES, Finding, lint, lint_text, sarif_log
from noetl_mesh.lang.validate import validate_text

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
HEAD = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t, path: tests/t}\n"


def findings(body: str) -> list[Finding]:
    report = lint_text(HEAD + body)
    assert report.valid, [f.message for f in report.findings if f.code == "L000"]
    return report.findings


def only(body: str, code: str) -> Finding:
    """The one finding of ``code`` (there must be exactly one)."""
    found = [f for f in findings(body) if f.code == code]
    assert len(found) == 1, [(f.code, f.location, f.message) for f in findings(body)]
    return found[0]


def codes(body: str) -> list[str]:
    return [f.code for f in findings(body)]


def line_of(body: str, text: str) -> int:
    """1-based line of the first line of HEAD + body holding ``text``."""
    return next(i for i, line in enumerate((HEAD + body).splitlines(), 1) if text in line)


# ------------------------------------------------------------------------------------------ examples
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_have_no_findings(path):
    report = lint_text(path.read_text())
    assert report.valid and report.findings == []


def test_lint_over_every_example_reports_nothing(capsys):
    assert main(["lint", "--format", "json", *map(str, EXAMPLES)]) == 0
    assert json.loads(capsys.readouterr().out) == []


# ------------------------------------------------------------------------------ L000: validation first
def test_l000_an_invalid_playbook_is_reported_with_its_validation_errors():
    text = HEAD + "workflow:\n  - step: start\n    tool: {kind: htp}\n"
    report = lint_text(text)
    assert not report.valid and report.failed
    assert [(f.code, f.severity) for f in report.findings] == [("L000", "error")]
    f, (d,) = report.findings[0], validate_text(text).errors
    assert (f.location, f.message, f.line, f.column) == (d.location, d.message, d.line, d.column)
    assert (f.line, f.column) == (6, 12)


def test_l000_validator_warnings_are_passed_through_not_repeated():
    body = """
workflow:
  - step: start
    tool: {kind: noop}
  - step: lost
    tool: {kind: noop, result: "{{ args.x }}"}
"""
    f = only(body, "L000")
    assert codes(body) == ["L000"]  # lint does not add L503 or any rule of its own to an unreachable step
    assert (f.severity, f.location) == ("warning", "workflow[1].step=lost")
    assert "unreachable" in f.message and f.line == line_of(body, "step: lost")
    reached = body.replace("tool: {kind: noop}\n  - step: lost",
                           "tool: {kind: noop}\n    next: {arcs: [{step: lost}]}\n  - step: lost", 1)
    assert codes(reached) == ["L403"]  # once reached, its template is read


# ------------------------------------------------------------------------------------------ L101 joins
ONE_ROUTER = """
workload: {x: 1}
workflow:
  - step: start
    next:
      spec: {mode: exclusive}
      arcs: [{step: a, when: "{{ workload.x }}"}, {step: b}]
  - step: a
    tool: {kind: noop}
    next: {arcs: [{step: j}]}
  - step: b
    tool: {kind: noop}
    next: {arcs: [{step: j}]}
  - step: j
    tool: {kind: noop}
"""


def test_l101_a_join_fed_by_one_exclusive_router_never_joins():
    f = only(ONE_ROUTER, "L101")
    assert (f.severity, f.location) == ("warning", "workflow[3].step=j")
    assert f.line == line_of(ONE_ROUTER, "- step: j")
    assert "exclusive router 'start'" in f.message and "spec.join: any" in f.message


def test_l101_not_for_an_inclusive_fork_or_join_any():
    assert "L101" not in codes(ONE_ROUTER.replace("mode: exclusive", "mode: inclusive"))
    assert "L101" not in codes(ONE_ROUTER.replace("  - step: j\n", "  - step: j\n    spec: {join: any}\n"))


def test_l101_an_inclusive_fork_upstream_of_the_exclusive_choice_still_joins():
    body = """
workflow:
  - step: start
    next: {spec: {mode: inclusive}, arcs: [{step: a}, {step: b}]}
  - step: a
    tool: {kind: noop}
    next: {arcs: [{step: j, when: "{{ event.result }}"}, {step: z}]}
  - step: b
    tool: {kind: noop}
    next: {arcs: [{step: j}]}
  - {step: z, tool: {kind: noop}}
  - {step: j, tool: {kind: noop}}
"""
    assert codes(body) == []
    # the same shape with an exclusive fork: nothing can make two tokens
    assert codes(body.replace("mode: inclusive", "mode: exclusive").replace("[{step: a}, {step: b}]",
                                                                          "[{step: a, when: '{{ 1 }}'}, {step: b}]")) == ["L101"]


def test_l101_two_inclusive_branches_that_meet_before_the_join_still_arrive_as_one_token():
    body = """
workflow:
  - step: start
    next: {arcs: [{step: fork, when: "{{ 1 }}"}, {step: c}]}
  - step: fork
    next: {spec: {mode: inclusive}, arcs: [{step: x}, {step: y}]}
  - {step: x, tool: {kind: noop}, next: {arcs: [{step: a}]}}
  - {step: y, tool: {kind: noop}, next: {arcs: [{step: a}]}}
  - {step: a, tool: {kind: noop}, next: {arcs: [{step: j}]}}
  - {step: c, tool: {kind: noop}, next: {arcs: [{step: j}]}}
  - {step: j, tool: {kind: noop}}
"""
    assert "exclusive router 'start'" in only(body, "L101").message  # a merges x and y first
    assert "L101" not in codes(body.replace("{step: y, tool: {kind: noop}, next: {arcs: [{step: a}]}}",
                                            "{step: y, tool: {kind: noop}, next: {arcs: [{step: j}]}}"))


# -------------------------------------------------------------------------------- L102 optional branches
OPTIONAL = """
workload: {x: 1}
workflow:
  - step: start
    next:
      spec: {mode: inclusive}
      arcs: [{step: a, when: "{{ workload.x }}"}, {step: b}]
  - step: a
    tool: {kind: noop}
    next: {arcs: [{step: j, args: {from_a: 1}}]}
  - step: b
    tool: {kind: noop}
    next: {arcs: [{step: j, args: {from_b: 2}}]}
  - step: j
    tool: {kind: noop, result: "{{ args.from_a }}"}
"""


def test_l102_a_join_reads_an_arg_only_an_optional_branch_passes():
    f = only(OPTIONAL, "L102")
    assert (f.severity, f.location) == ("warning", "workflow[3].step=j.tool.result")
    assert "args.from_a" in f.message and "arc start -> a has a 'when'" in f.message


def test_l102_not_when_guarded_when_the_branch_is_certain_or_for_what_every_branch_passes():
    assert codes(OPTIONAL.replace("{{ args.from_a }}", "{{ args.from_a | default(0) }}")) == []
    assert codes(OPTIONAL.replace('{step: a, when: "{{ workload.x }}"}', "{step: a}")) == []
    assert codes(OPTIONAL.replace("{from_b: 2}", "{from_a: 2}")) == []
    # a condition before the fork decides whether the join runs at all, not which branches it gets
    guarded_fork = OPTIONAL.replace(
        "  - step: start\n    next:\n      spec: {mode: inclusive}\n      arcs: [{step: a, when: \"{{ workload.x }}\"}, {step: b}]",
        "  - step: start\n    next: {arcs: [{step: fork, when: \"{{ workload.x }}\"}]}\n"
        "  - step: fork\n    next: {spec: {mode: inclusive}, arcs: [{step: a}, {step: b}]}")
    assert codes(guarded_fork) == []


def test_l102_a_join_reads_the_result_of_a_step_on_an_optional_branch():
    body = OPTIONAL.replace("{{ args.from_a }}", "{{ a.result }}")
    f = only(body, "L102")
    assert "step 'a' runs only on branches" in f.message
    assert codes(OPTIONAL.replace("{{ args.from_a }}", "{{ b.result }}")) == []  # b always runs
    assert codes(OPTIONAL.replace("{{ args.from_a }}", "{{ start.result }}")) == []  # before the fork


# ----------------------------------------------------------------------------------- L201/L501 cycles
ENDLESS = """
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: a}]}
  - step: a
    tool: {kind: noop}
    next: {arcs: [{step: b}]}
  - step: b
    tool: {kind: noop}
    next: {arcs: [{step: a}]}
"""


def test_l201_a_cycle_of_arcs_without_when_never_ends_and_l501_the_steps_before_it():
    f = only(ENDLESS, "L201")
    assert (f.severity, f.location) == ("error", "workflow[2].step=b.next.arcs[0]")
    assert "a -> b -> a" in f.message and "max_steps" in f.message
    assert f.line == len((HEAD + ENDLESS).splitlines())  # b's arc back to a, the last line
    before = only(ENDLESS, "L501")
    assert (before.severity, before.location) == ("warning", "workflow[0].step=start")
    longer = ENDLESS.replace("    next: {arcs: [{step: a}]}\n  - step: a",
                             "    next: {arcs: [{step: pre}]}\n  - {step: pre, next: {arcs: [{step: a}]}}\n  - step: a", 1)
    assert only(longer, "L501").location == "workflow[0].step=start"  # the first step of the way in only


def b_next(arcs: str) -> str:
    """ENDLESS with step b's ``next`` replaced (and a step ``end`` when an arc goes there)."""
    head, _ = ENDLESS.rsplit("next: {arcs: [{step: a}]}", 1)
    return head + arcs + ("\n  - {step: end, tool: {kind: noop}}\n" if "end" in arcs else "\n")


def test_l201_not_when_an_arc_of_the_cycle_has_a_when_or_an_arc_leaves_it_first():
    assert sorted(codes(b_next("next: {arcs: [{step: a}]}"))) == ["L201", "L501"]  # the variants' base
    assert codes(b_next("next: {arcs: [{step: a, when: '{{ event.result }}'}]}")) == []
    assert codes(b_next("next: {arcs: [{step: end, when: '{{ event.result }}'}, {step: a}]}")) == []
    admitted = ENDLESS.replace("  - step: a\n", "  - step: a\n    spec: {policy: {admit: {rules: [{when: "
                               "'{{ ctx.go | default(true) }}', then: {allow: true}}, {else: {then: {allow: false}}}]}}}\n")
    assert "L201" not in codes(admitted)


def test_l201_an_inclusive_router_that_also_leaves_still_loops_forever():
    assert "L201" in codes(b_next("next: {spec: {mode: inclusive}, arcs: [{step: end}, {step: a}]}"))


def test_l201_exits_2_from_the_command_line(tmp_path, capsys):
    bad = tmp_path / "endless.yaml"
    bad.write_text(HEAD + ENDLESS)
    assert main(["lint", str(bad)]) == 2
    out = capsys.readouterr().out
    assert f"{bad}:{only(ENDLESS, 'L201').line}:" in out and "error L201" in out


# ------------------------------------------------------------------------------------ L301 ctx races
RACE = """
workflow:
  - step: start
    next: {spec: {mode: inclusive}, arcs: [{step: a}, {step: b}]}
  - step: a
    tool:
      kind: noop
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {total: 1}}}}]}}
    next: {arcs: [{step: j}]}
  - step: b
    tool:
      kind: noop
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {total: 2}}}}]}}
    next: {arcs: [{step: j}]}
  - step: j
    tool: {kind: noop, result: "{{ ctx.total }}"}
"""


def test_l301_concurrent_branches_write_one_ctx_key():
    f = only(RACE, "L301")
    assert f.severity == "warning"
    assert f.location == "workflow[2].step=b.tool.spec.policy.rules[0].else.then.set_ctx.total"
    assert "steps 'a' and 'b'" in f.message and "'start'" in f.message


def test_l301_not_for_exclusive_branches_different_keys_or_writes_in_sequence():
    exclusive = RACE.replace("{mode: inclusive}, arcs: [{step: a}, {step: b}]",
                             "{mode: exclusive}, arcs: [{step: a, when: '{{ 1 }}'}, {step: b}]")
    assert "L301" not in codes(exclusive)
    assert "L301" not in codes(RACE.replace("set_ctx: {total: 2}", "set_ctx: {other: 2}"))
    after_join = RACE.replace("  - step: j\n    tool: {kind: noop, result: \"{{ ctx.total }}\"}",
                              "  - step: j\n    tool:\n      kind: noop\n"
                              "      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {total: 3}}}}]}}")
    assert [f.location for f in findings(after_join) if f.code == "L301"] == [
        "workflow[2].step=b.tool.spec.policy.rules[0].else.then.set_ctx.total"]  # j runs after both


def test_l301_a_step_reached_on_two_branches_without_a_join_runs_twice_at_once():
    body = """
workflow:
  - step: start
    next: {spec: {mode: inclusive}, arcs: [{step: a}, {step: b}]}
  - {step: a, tool: {kind: noop}, next: {arcs: [{step: w}]}}
  - {step: b, tool: {kind: noop}, next: {arcs: [{step: w}]}}
  - step: w
    spec: {join: any}
    tool:
      kind: noop
      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {last: 1}}}}]}}
"""
    f = only(body, "L301")
    assert "step 'w' can run twice at the same time" in f.message
    assert "L301" not in codes(body.replace("    spec: {join: any}\n", ""))  # a join merges the branches
    # a writer before w on one branch still races with w's run from the other branch
    before = body.replace("  - {step: a, tool: {kind: noop}, next: {arcs: [{step: w}]}}",
                          "  - step: a\n    tool:\n      kind: noop\n"
                          "      spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {last: 0}}}}]}}\n"
                          "    next: {arcs: [{step: w}]}")
    assert "L301" in codes(before.replace("    spec: {join: any}\n", "    spec: {join: any}\n", 1))


# ------------------------------------------------------------------------------ L401-L410 templates
def task_template(template: str, extra: str = "") -> str:
    return f"""
keychain: [{{name: api, kind: credential}}]
workload: {{a: 1}}
workflow:
  - step: start
    tool:
      - name: first
        kind: noop
        result: "{template}"
{extra}"""


def test_l401_a_misspelt_namespace_with_did_you_mean():
    f = only(task_template("{{ wrokload.a }}"), "L401")
    assert (f.severity, f.location) == ("error", "workflow[0].step=start.tool[0].result")
    assert "did you mean 'workload'?" in f.message
    assert codes(task_template("{{ workload.a }}")) == []


def test_l401_guarded_is_a_warning_and_a_namespace_of_another_context_is_named():
    assert only(task_template("{{ wrokload.a | default(1) }}"), "L401").severity == "warning"
    f = only(task_template("{{ event.result }}"), "L401")
    assert "'event' is not available in task fields" in f.message and "arc when/args" in f.message
    arc = """
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: end, when: "{{ iter.x }}"}]}
  - {step: end, tool: {kind: noop}}
"""
    assert "not available in arc when/args" in only(arc, "L401").message
    assert codes(arc.replace("iter.x", "event.result")) == []


def test_l401_never_crashes_on_any_template_and_respects_jinja_scoping():
    for template in ("{% for x in workload.a %}{{ x.y }}{{ loop.index }}{% endfor %}",
                     "{% set n = namespace(v=1) %}{{ n.v }}{{ range(3) | list }}",
                     "{% macro m(q) %}{{ q }}{% endmacro %}{{ m(1) }}",
                     "{{ (workload.a | string).upper() }}{{ workload['a'] }}{{ ctx[workload.a] | default(1) }}",
                     "{% filter upper %}x{% endfilter %}{{ 'a' in ctx }}{{ workload.get('a') }}"):
        assert codes(task_template(template.replace('"', "'"))) == [], template


def test_l402_ctx_keys_nothing_writes_or_only_later_steps_write():
    f = only(task_template("{{ ctx.total }}"), "L402")
    assert (f.severity, f.location) == ("error", "workflow[0].step=start.tool[0].result")
    assert only(task_template("{{ ctx.total | default(0) }}"), "L402").severity == "warning"
    for tested in ("{% if ctx.total is defined %}{{ ctx.total }}{% endif %}", "{{ ctx.total if 'total' in ctx }}"):
        assert [(f.code, f.severity) for f in findings(task_template(tested))] == [("L402", "warning")], tested
    written = "        spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {total: 1}}}}]}}\n"
    assert codes(task_template("{{ ctx.total }}", written)) == []
    later = task_template("{{ ctx.total }}", "    next: {arcs: [{step: later}]}\n  - step: later\n    tool:\n"
                                             "      kind: noop\n" + written[2:])
    f = only(later, "L402")
    assert f.severity == "warning" and "only by 'later'" in f.message


ARGS = """
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: use, args: {n: 1}}]}
  - step: use
    tool: {kind: noop, result: "{{ args.n }}"}
"""


def test_l403_args_no_arc_passes():
    f = only(ARGS.replace("args.n", "args.m"), "L403")
    assert (f.severity, f.location) == ("error", "workflow[1].step=use.tool.result")
    assert "no arc into step 'use' passes 'm'" in f.message and "did you mean 'n'?" not in f.message
    assert codes(ARGS) == []


def test_l403_a_back_edge_that_does_not_pass_the_key_fires_the_step_without_it():
    body = ARGS.replace("tool: {kind: noop, result: \"{{ args.n }}\"}",
                        "tool: {kind: noop, result: \"{{ args.n }}\"}\n    next: {arcs: [{step: use, when: '{{ event.result < 3 }}'}]}")
    f = only(body, "L403")
    assert f.severity == "warning" and "use -> use (arc 0)" in f.message
    assert codes(body.replace("when: '{{ event.result < 3 }}'", "when: '{{ event.result < 3 }}', args: {n: 2}")) == []


def test_l403_a_join_that_never_joins_fires_per_token_with_that_arc_s_args():
    body = ONE_ROUTER.replace("next: {arcs: [{step: j}]}\n  - step: b",
                              "next: {arcs: [{step: j, args: {n: 1}}]}\n  - step: b", 1)
    body = body.replace("  - step: j\n    tool: {kind: noop}",
                        "  - step: j\n    tool: {kind: noop, result: \"{{ args.n }}\"}")
    f = only(body, "L403")
    assert f.severity == "warning" and "b -> j (arc 0)" in f.message
    assert "L403" not in codes(body.replace("mode: exclusive", "mode: inclusive"))  # a joining join: L102's case


def test_l403_the_entry_step_reads_args_from_its_caller():
    assert codes("""
workflow:
  - step: start
    tool: {kind: noop, result: "{{ args.temps }}"}
""") == []


def test_l404_iter_keys():
    f = only(task_template("{{ iter.page }}"), "L404")
    assert f.severity == "error" and "outside a loop" in f.message
    set_iter = "        spec: {policy: {rules: [{else: {then: {do: continue, set_iter: {page: 1}}}}]}}\n"
    assert codes(task_template("{{ iter.page }}", set_iter)) == []
    loop = """
workload: {cities: [a, b]}
workflow:
  - step: start
    loop: {in: "{{ workload.cities }}", iterator: city}
    tool: {kind: noop, result: "{{ iter.cty }} {{ iter.index }}"}
"""
    assert "did you mean 'city'?" in only(loop, "L404").message
    assert codes(loop.replace("iter.cty", "iter.city")) == []


def test_l405_workload_keys_the_playbook_does_not_have():
    f = only(task_template("{{ workload.b }}"), "L405")
    assert (f.severity, f.location) == ("info", "workflow[0].step=start.tool[0].result")
    assert codes(task_template("{{ workload.b | default(2) }}")) == []


def test_l406_keychain_entries():
    f = only(task_template("{{ keychain.apx.value }}"), "L406")
    assert f.severity == "error" and "did you mean 'api'?" in f.message
    assert codes(task_template("{{ keychain.api.value }}")) == []


def test_l407_a_step_that_cannot_have_run_before():
    body = """
workflow:
  - step: start
    tool: {kind: noop, result: "{{ later.result }}"}
    next: {arcs: [{step: later}]}
  - step: later
    tool: {kind: noop, result: "{{ start.result }}"}
"""
    f = only(body, "L407")
    assert (f.severity, f.location) == ("warning", "workflow[0].step=start.tool.result")
    assert codes(body.replace("{{ later.result }}", "{{ later.result | default(none) }}")) == []


def test_l408_a_task_read_before_it_runs():
    body = """
workflow:
  - step: start
    tool:
      - {name: first, kind: noop, result: "{{ second.result }}"}
      - {name: second, kind: noop, result: "{{ first.result }}"}
"""
    f = only(body, "L408")
    assert (f.severity, f.location) == ("warning", "workflow[0].step=start.tool[0].result")
    jump = body.replace("result: \"{{ first.result }}\"}",
                        "result: \"{{ first.result }}\", spec: {policy: {rules: [{when: '{{ _attempt < 2 }}', then: {do: jump, to: first}}]}}}")
    assert codes(jump) == []


def test_l409_a_when_that_is_not_a_template_is_constant():
    body = """
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: end, when: "event.result > 1"}]}
  - {step: end, tool: {kind: noop}}
"""
    f = only(body, "L409")
    assert (f.severity, f.location) == ("warning", "workflow[0].step=start.next.arcs[0].when")
    assert "always true" in f.message
    assert "always false" in only(body.replace("event.result > 1", "false"), "L409").message
    assert codes(body.replace("event.result > 1", "{{ event.result > 1 }}")) == []


def test_l410_fields_of_events_outcomes_and_step_results():
    body = """
workflow:
  - step: start
    tool:
      kind: noop
      spec: {policy: {rules: [{when: "{{ outcome.stauts == 'ok' }}", then: {do: continue}}]}}
    next: {arcs: [{step: end, args: {r: "{{ event.reslt }}"}}]}
  - {step: end, tool: {kind: noop, result: "{{ start.reslt }}"}}
"""
    found = [(f.location, f.severity) for f in findings(body) if f.code == "L410"]
    assert found == [("workflow[0].step=start.tool.spec.policy.rules[0].when", "error"),
                     ("workflow[0].step=start.next.arcs[0].args.r", "error"),
                     ("workflow[1].step=end.tool.result", "error")]
    fixed = body.replace("stauts", "status").replace("reslt", "result")
    assert codes(fixed) == []


def test_l411_a_field_of_the_error_read_where_there_may_be_no_error():
    body = """
workflow:
  - step: start
    tool:
      - name: call
        kind: noop
        spec:
          policy:
            rules:
              - when: "{{ outcome.error.retryable }}"
                then: {do: retry, attempts: 2}
              - when: "{{ outcome.result.n > 1 }}"
                then: {do: continue, set_ctx: {why: "failed: {{ output.error.message }}"}}
              - else:
                  then: {do: continue, set_ctx: {code: "{{ outcome.error.detail['code'] }}"}}
    next:
      arcs:
        - {step: end, when: "{{ event.error.kind != 'timeout' }}", args: {kind: "{{ event.error.kind }}"}}
        - {step: end, args: {kind: "{{ event.error.kind }}"}}
  - step: end
    tool: {kind: noop, result: "{{ ctx.why }} {{ ctx.code }} {{ args.kind }}"}
"""
    found = [(f.location, f.severity, f.message) for f in findings(body) if f.code == "L411"]
    assert [(loc, sev) for loc, sev, _ in found] == [
        ("workflow[0].step=start.tool[0].spec.policy.rules[0].when", "warning"),
        ("workflow[0].step=start.tool[0].spec.policy.rules[1].then.set_ctx.why", "warning"),
        ("workflow[0].step=start.tool[0].spec.policy.rules[2].else.then.set_ctx.code", "warning"),
        ("workflow[0].step=start.next.arcs[0].when", "warning"),
        ("workflow[0].step=start.next.arcs[0].args.kind", "warning"),
        ("workflow[0].step=start.next.arcs[1].args.kind", "error")]  # an arc without when: only step.done
    # the guarded spelling is the hint: a condition's and a value's
    assert "'{{ outcome.error and outcome.error.retryable }}'" in found[0][2]
    assert "'{{ output.error.message if output.error else none }}'" in found[1][2]
    assert "'{{ outcome.error.detail.code if outcome.error else none }}'" in found[2][2]
    # guarded, each the way the finding says (or another), they are all gone
    fixed = (body.replace('"{{ outcome.error.retryable }}"', '"{{ outcome.error and outcome.error.retryable }}"')
             .replace("{{ output.error.message }}", "{{ output.error.message if output.error else '' }}")
             .replace("{{ outcome.error.detail['code'] }}", "{{ outcome.error.detail['code'] | default(none) }}")
             .replace("{{ event.error.kind != 'timeout' }}", "{{ not event.error or event.error.kind != 'timeout' }}")
             .replace('args: {kind: "{{ event.error.kind }}"}}\n        - {step: end, args',
                      'args: {kind: "{% if event.error %}{{ event.error.kind }}{% endif %}"}}\n        - {step: end, args')
             .replace('args: {kind: "{{ event.error.kind }}"}}\n  - step: end',
                      'args: {kind: "{{ event.error.kind is defined }}"}}\n  - step: end'))
    assert [f.location for f in findings(fixed) if f.code == "L411"] == []


def test_l411_not_where_there_is_certainly_an_error():
    body = """
workflow:
  - step: start
    tool:
      kind: noop
      spec:
        policy:
          rules:
            - when: "{{ outcome.status == 'error' and outcome.error.kind == 'x' }}"
              then: {do: fail, set_ctx: {why: "{{ outcome.error.message }}"}}
            - when: "{{ outcome.error }}"
              then: {do: continue, set_ctx: {why: "{{ outcome.error.message }}"}}
            - else:
                then: {do: continue}
    next: {arcs: [{step: other}]}
  - step: other
    tool:
      kind: noop
      spec:
        policy:
          rules:
            - when: "{{ outcome.status == 'ok' }}"
              then: {do: continue}
            - else:
                then: {do: continue, set_ctx: {why: "{{ outcome.error.message }}"}}
    next:
      arcs:
        - {step: end, when: "{{ event.name == 'step.failed' }}", args: {kind: "{{ event.error.kind }}"}}
        - {step: end}
        - {step: end, when: "{{ event.error.kind == 'timeout' }}"}
  - step: end
    tool: {kind: noop, result: "{{ ctx.why }} {{ args.kind | default('') }}"}
"""
    assert [f.location for f in findings(body) if f.code == "L411"] == []
    # an inclusive router tries every arc: the one without 'when' takes nothing from the last
    inclusive = body.replace("    next:\n      arcs:", "    next:\n      spec: {mode: inclusive}\n      arcs:")
    assert [f.location for f in findings(inclusive) if f.code == "L411"] == ["workflow[1].step=other.next.arcs[2].when"]


# ---------------------------------------------------------------------------- L502/L503 dead arcs
DEAD = """
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: a}, {step: b}]}
  - {step: a, tool: {kind: noop}}
  - {step: b, tool: {kind: noop}}
"""


def test_l502_l503_an_arc_after_one_without_when_never_fires_and_its_target_never_runs():
    arc = only(DEAD, "L502")
    assert (arc.severity, arc.location) == ("warning", "workflow[0].step=start.next.arcs[1]")
    step = only(DEAD, "L503")
    assert (step.severity, step.location) == ("warning", "workflow[2].step=b")


def test_l502_not_for_inclusive_routers_or_arcs_with_when():
    assert codes(DEAD.replace("next: {arcs:", "next: {spec: {mode: inclusive}, arcs:")) == []
    assert codes(DEAD.replace("{step: b}", "{step: b, when: \"{{ event.name == 'step.failed' }}\"}")) == []


# --------------------------------------------------------------------------------- L601 wide loops
def wide(max_in_flight: int, items: str = '"{{ args.items }}"') -> str:
    return f"""
workload: {{cities: [a, b, c]}}
workflow:
  - step: start
    loop: {{in: {items}, iterator: x, spec: {{mode: parallel, max_in_flight: {max_in_flight}}}}}
    tool: {{kind: noop}}
"""


def test_l601_a_parallel_loop_wider_than_one_worker():
    f = only(wide(12), "L601")
    assert (f.severity, f.location) == ("info", "workflow[0].step=start.loop.spec.max_in_flight")
    assert "12 commands at once" in f.message and "runs 8 at a time by default" in f.message
    assert "pool 'default'" in f.message


def test_l601_not_when_chunks_fit_or_the_collection_is_small():
    assert "L601" not in codes(wide(16))  # 8 commands of 2 iterations
    assert "L601" not in codes(wide(8))
    assert "L601" not in codes(wide(12, '"{{ workload.cities }}"'))  # 3 items
    assert "L601" not in codes(wide(12, "[1, 2, 3]"))
    assert "L601" in codes(wide(300))  # chunks of 32: 10 commands


def test_the_default_worker_concurrency_is_the_one_lint_assumes():
    from noetl_mesh.services.worker.service import WorkerService
    from noetl_mesh.stack import Settings

    assert inspect.signature(WorkerService.__init__).parameters["concurrency"].default == lint_mod.WORKER_CONCURRENCY
    assert Settings(nats_url="").concurrency == lint_mod.WORKER_CONCURRENCY


# ----------------------------------------------------------------------- L602 waits (raw task mapping)
def wait_doc(**fields) -> tuple[dict, WorkflowGraph]:
    """A playbook with a ``kind: wait`` task, linted as a raw mapping: the rule reads the task's keys
    (D30) whether or not the validator of this version knows the kind yet."""
    doc = yaml.safe_load(HEAD + """
workflow:
  - step: start
    tool: {kind: noop}
    next: {arcs: [{step: approve}]}
  - step: approve
    tool: [{name: ask, kind: wait, signal: approved}]
""")
    doc["workflow"][1]["tool"][0].update(fields)
    graph = WorkflowGraph.build((s["step"], [a["step"] for a in (s.get("next") or {}).get("arcs", [])])
                                for s in doc["workflow"])
    return doc, graph


def test_l602_a_wait_on_a_signal_without_timeout():
    found = [f for f in lint(*wait_doc()) if f.code == "L602"]
    assert [(f.severity, f.location) for f in found] == [("warning", "workflow[1].step=approve.tool[0]")]
    assert "'approved'" in found[0].message and "timeout" in found[0].message


def test_l602_not_with_a_timeout_a_step_lifecycle_timeout_or_a_duration():
    assert [f for f in lint(*wait_doc(timeout="1h")) if f.code == "L602"] == []
    doc, graph = wait_doc()
    doc["workflow"][1]["spec"] = {"policy": {"lifecycle": {"timeout_s": 3600}}}
    assert [f for f in lint(doc, graph) if f.code == "L602"] == []
    doc, graph = wait_doc()
    del doc["workflow"][1]["tool"][0]["signal"]
    doc["workflow"][1]["tool"][0]["duration"] = "5s"
    assert [f for f in lint(doc, graph) if f.code == "L602"] == []


# ------------------------------------------------------------------------------------- output formats
def test_every_rule_is_documented():
    doc = (Path(__file__).parents[2] / "docs" / "lint.md").read_text()
    for code, (severity, _) in RULES.items():
        assert f"### {code}" in doc, code
        section = doc.split(f"### {code}", 1)[1].split("\n### ", 1)[0]
        assert severity in section, code


def test_text_output_and_exit_codes(tmp_path, capsys):
    warn = tmp_path / "warn.yaml"
    warn.write_text(HEAD + DEAD)
    assert main(["lint", str(warn)]) == 0  # warnings only
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{warn}:{only(DEAD, 'L502').line}:") and " warning L502: " in out[0]
    assert out[-1] == f"{warn}: 2 warning(s)"
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text(HEAD + "workflow: []\n")
    assert main(["lint", str(warn), str(invalid), str(tmp_path / "missing.yaml")]) == 2
    out = capsys.readouterr().out
    assert f"{invalid}:" in out and "error L000" in out and "invalid:" in out
    assert "cannot read file" in out


def test_json_output_is_a_list_of_findings(tmp_path, capsys):
    warn = tmp_path / "warn.yaml"
    warn.write_text(HEAD + DEAD)
    assert main(["lint", "--format", "json", str(warn)]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [(f["file"], f["code"], f["severity"], f["location"]) for f in found] == [
        (str(warn), "L502", "warning", "workflow[0].step=start.next.arcs[1]"),
        (str(warn), "L503", "warning", "workflow[2].step=b")]
    assert all(isinstance(f["line"], int) and isinstance(f["column"], int) and f["message"] for f in found)


def test_sarif_output_is_a_sarif_2_1_0_log(tmp_path, capsys):
    files = {"dead.yaml": DEAD, "wide.yaml": wide(12), "bad.yaml": "workflow: []\n"}
    for name, body in files.items():
        (tmp_path / name).write_text(HEAD + body)
    paths = [str(tmp_path / n) for n in files]
    assert main(["lint", "--format", "sarif", *paths]) == 2  # bad.yaml is invalid
    log = json.loads(capsys.readouterr().out)
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-schema-2.1.0.json")
    assert len(log["runs"]) == 1
    driver = log["runs"][0]["tool"]["driver"]
    assert driver["name"] == "noetl lint"
    assert [r["id"] for r in driver["rules"]] == list(RULES)
    for rule in driver["rules"]:
        assert rule["helpUri"] == f"docs/lint.md#{rule['id'].lower()}"
        assert rule["shortDescription"]["text"]
        assert rule["defaultConfiguration"]["level"] in ("error", "warning", "note")
    results = log["runs"][0]["results"]
    assert {(r["ruleId"], r["level"]) for r in results} == {("L502", "warning"), ("L503", "warning"),
                                                            ("L601", "note"), ("L000", "error")}
    for r in results:
        assert driver["rules"][r["ruleIndex"]]["id"] == r["ruleId"]
        assert r["message"]["text"]
        (location,) = r["locations"]
        physical = location["physicalLocation"]
        assert physical["artifactLocation"]["uri"].startswith("file:///")
        assert physical["artifactLocation"]["uri"].endswith(".yaml")
        region = physical["region"]
        assert isinstance(region["startLine"], int) and region["startLine"] >= 1
        assert isinstance(region["startColumn"], int) and region["startColumn"] >= 1


def test_sarif_relative_paths_stay_relative_uri_references():
    log = sarif_log([("dir with space/x.yaml", lint_text(HEAD + DEAD))])
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in log["runs"][0]["results"]}
    assert uris == {"dir%20with%20space/x.yaml"}
