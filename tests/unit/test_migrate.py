"""noetl migrate (docs/migrate.md): each rule on a small legacy playbook written for it, the fixture
corpus against its reviewed canonical forms, idempotence (canonical playbooks come out byte for byte;
migrating twice is migrating once), and the command's exit codes."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from noetl_mesh import cli
from noetl_mesh.lang.lint import lint_text
from noetl_mesh.lang.migrate import migrate_text
from noetl_mesh.lang.migrate.templates import Ref, parse_expression, rewrite, unparse
from noetl_mesh.lang.migrate.python import analyse, wrap_in_function
from noetl_mesh.lang.validate import validate_text

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "migrate"
LEGACY = sorted(p for p in FIXTURES.glob("*.yaml") if not p.name.endswith(".canonical.yaml"))
FULL = [p for p in LEGACY if p.stem != "needs_person"]
HEAD = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: t, path: t}\n"


def mig(body: str, head: str = HEAD):
    m = migrate_text(head + textwrap.dedent(body))
    return m, yaml.safe_load(m.text)


def rules(m) -> set[str]:
    return {r for f in m.changes for r in f.rule.split(",")}


# ------------------------------------------------------------------------------------ the corpus


@pytest.mark.parametrize("path", FULL, ids=lambda p: p.stem)
def test_fixture_migrates_fully_to_its_reviewed_form_and_validates(path):
    m = migrate_text(path.read_text(), source=path)  # a script it names is read next to it
    assert m.complete, [str(p) for p in m.problems]
    assert m.text == (FIXTURES / f"{path.stem}.canonical.yaml").read_text()
    assert validate_text(m.text).ok
    before = validate_text(path.read_text())
    assert not before.ok or before.warnings  # as written, the engine refuses it (or never runs a step of it)
    again = migrate_text(m.text)
    assert not again.changed and not again.changes and not again.problems


LINT_KEPT = {"L101"}  # a join fed by the branches of an exclusive router: the legacy shape, kept as it ran


def test_every_fixture_that_migrates_with_exit_0_validates_and_lint_finds_nothing_that_fails():
    complete = []
    for path in LEGACY:
        m = migrate_text(path.read_text(), source=path)
        if not m.complete:
            continue
        complete.append(path)
        assert validate_text(m.text).ok and not validate_text(m.text).warnings, path.name
        report = lint_text(m.text)
        assert not [f for f in report.findings if f.severity == "error" or f.code not in LINT_KEPT], path.name
        assert migrate_text(m.text).text == m.text, path.name
    assert complete == FULL  # and needs_person is the one that does not


def test_a_migration_that_would_fail_at_run_time_needs_a_person():
    m, _ = mig("workflow:\n  - step: start\n    tool: {kind: noop, result: '{{ vars.missing }}'}\n",
               head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    assert [(p.rule, p.location, p.line) for p in m.problems] == [("V", "workflow[0].step=start.tool.result", 6)]
    assert "ctx.missing is written by no set_ctx" in m.problems[0].message
    assert "noetl lint L402, line 6, column 24 of the migrated text" in m.problems[0].message
    # a playbook the migration leaves as it is is lint's to judge, not migrate's
    text = HEAD + "workflow:\n  - step: start\n    tool: {kind: noop, result: '{{ ctx.missing }}'}\n"
    assert migrate_text(text).complete and migrate_text(text).text == text


def test_a_registered_retry_loop_translation_is_tried_before_the_block_needs_a_person(monkeypatch):
    from noetl_mesh.lang.migrate.rules import _Migrator

    seen = []

    def decline(m, task, path, retry):
        seen.append(("decline", path))
        return False

    def translate(m, task, path, retry):
        seen.append(("translate", sorted(retry)))
        task["kind"] = "noop"
        m.change("M6", path + ("retry",), "a paging retry block translated")
        return True

    text = HEAD + textwrap.dedent("""
        workflow:
          - step: start
            tool: {kind: noop, retry: {while: "{{ outcome.result.more }}", max_attempts: 5}}
        """)
    assert [p.location for p in migrate_text(text).problems] == ["workflow[0].step=start.tool.retry.while"]
    monkeypatch.setattr(_Migrator, "RETRY_LOOPS", (decline, translate))
    m = migrate_text(text)
    assert seen == [("decline", ("workflow", 0, "tool")), ("translate", ["max_attempts", "while"])]
    assert m.complete and "retry" not in yaml.safe_load(m.text)["workflow"][0]["tool"]
    assert any(f.message == "a paging retry block translated" for f in m.changes)


def test_needs_person_fixture_names_each_construct_with_its_location():
    m = migrate_text((FIXTURES / "needs_person.yaml").read_text())
    said = {(p.rule, p.location) for p in m.problems}
    assert ("M6", "workflow[0].step=start.tool.verify_ssl") not in said  # it is the http tool's 'verify'
    assert ("M6", "workflow[0].step=start.tool.retry.on_success.per_iteration") in said  # a sink per page
    assert ("M5", "workflow[1].step=inspect.tool.script") in said
    assert ("M8", "workflow[4].step=wait_for_approval.case") in said
    assert ("M1", "workflow[3].step=tally_report.tool.result.rows") in said  # a SQL result read whole
    assert ("M1", "workflow[1].step=inspect.tool.args.status") in said  # an http status read across steps
    assert all(p.line for p in m.problems)
    assert m.changed  # what could be translated was


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_examples_come_out_unchanged(path):
    text = path.read_text()
    m = migrate_text(text)
    assert m.text == text and not m.changes and not m.problems


def test_canonical_scenarios_of_the_tests_come_out_unchanged():
    sys.path.insert(0, str(ROOT / "tests"))
    from scenarios import SCENARIOS, TINY

    for text in [TINY] + [s.playbook for s in SCENARIOS]:
        if not text.lstrip().startswith("apiVersion"):
            text = HEAD + text
        m = migrate_text(text)
        assert not m.changes and not m.problems and m.text == text, [str(c) for c in m.changes]


# ------------------------------------------------------------------------------------------ rules


def test_m0_header():
    m, doc = mig("workflow:\n  - step: start\n    tool: {kind: noop}\n", head="apiVersion: noetl.io/v1\nname: x\npath: a/b\n")
    assert doc["apiVersion"] == "noetl.io/v2" and doc["kind"] == "Playbook"
    assert doc["metadata"] == {"name": "x", "path": "a/b"} and "name" not in doc
    assert rules(m) == {"M0"} and m.complete


def test_m1_bare_names_loop_variables_and_helpers():
    m, doc = mig("""
        workload: {city: Oslo, n: 2}
        workflow:
          - step: start
            loop: {in: "{{ [1, 2] }}", iterator: item}
            tool:
              kind: noop
              result: "{{ city }}-{{ item }}-{{ loop_index }}-{{ job.execution_id }}-{{ payload.n }}"
        """)
    assert doc["workflow"][0]["tool"]["result"] == ("{{ workload.city }}-{{ iter.item }}-{{ iter.index }}-"
                                                     "{{ execution_id }}-{{ workload.n }}")
    assert rules(m) == {"M1"} and m.complete


def test_m1_names_bound_by_the_template_itself_are_left_alone():
    m, doc = mig("""
        workload: {rows: [1, 2], row: 9}
        workflow:
          - step: start
            tool: {kind: noop, result: "{% for row in rows %}{{ row }}{% endfor %}{% set n = row %}{{ n }}"}
        """)
    # a name the template binds anywhere is its own everywhere in it (the documented approximation)
    assert doc["workflow"][0]["tool"]["result"] == ("{% for row in workload.rows %}{{ row }}{% endfor %}"
                                                     "{% set n = row %}{{ n }}")


def test_m1_an_unknown_name_needs_a_person():
    m, _ = mig("workflow:\n  - step: start\n    tool: {kind: noop, result: '{{ nowhere }}'}\n")
    assert [p.rule for p in m.problems] == ["M1"] and "nowhere" in m.problems[0].message
    assert m.problems[0].location == "workflow[0].step=start.tool.result" and m.problems[0].line == 6
    assert m.problems[0].column == 24 and "(line 6, column 24)" in str(m.problems[0])  # where the key starts


def test_m2_a_step_name_reads_its_result_and_data_status_are_the_results_keys():
    m, doc = mig("""
        workflow:
          - step: producer
            tool: {kind: python, code: "result = {'tag': 1, 'status': 'ok', 'data': 2}"}
            next: [{step: consumer}]
          - step: consumer
            tool: {kind: noop, result: ["{{ producer.tag }}", "{{ producer.status }}", "{{ producer.data }}",
                                        "{{ producer.result.tag }}", "{{ producer.error }}", "{{ producer }}"]}
        """)
    assert doc["workflow"][1]["tool"]["result"] == [
        "{{ producer.result.tag }}", "{{ producer.result.status }}", "{{ producer.result.data }}",
        "{{ producer.result.tag }}", "{{ producer.error }}", "{{ producer.result }}"]
    assert "M2" in rules(m) and m.complete


def test_m2_in_a_canonical_playbook_status_and_data_keep_their_canonical_meaning():
    text = HEAD + textwrap.dedent("""
        workflow:
          - step: a
            tool: {kind: noop, result: 1}
            next: {arcs: [{step: b}]}
          - step: b
            tool: {kind: noop, result: "{{ a.status }} {{ a.data }}"}
        """)
    m = migrate_text(text)
    assert m.text == text and not m.changes


def test_m3_a_stored_credential_named_directly_gets_a_keychain_entry():
    m, doc = mig("""
        workload: {pg_auth: pg_main}
        workflow:
          - step: a
            tool: {kind: postgres, auth: pg_local, command: select 1}
            next: [{step: b}]
          - step: b
            tool: {kind: postgres, credential: {type: postgres, credential: pg_other}, command: select 1}
            next: [{step: c}]
          - step: c
            tool: {kind: postgres, auth: "{{ workload.pg_auth }}", command: select 1}
        """)
    assert doc["keychain"] == [{"name": n, "kind": "credential"} for n in ("pg_local", "pg_other", "pg_main")]
    assert [s["tool"]["auth"] for s in doc["workflow"]] == ["pg_local", "pg_other", "pg_main"]
    assert "M3" in rules(m) and m.complete


def test_m4_set_with_scoped_keys_at_rule_task_step_and_arc_level():
    m, doc = mig("""
        workflow:
          - step: start
            loop: {in: [1, 2], iterator: x}
            tool:
              - name: t
                kind: noop
                result: 1
                set: {iter.seen: "{{ iter.x }}"}
                spec:
                  policy:
                    rules:
                      - when: "{{ outcome.status == 'ok' }}"
                        then: {do: continue, set: {ctx.a: 1, iter.b: 2}}
            next:
              arcs:
                - step: last
                  set: {c: 3}
          - step: last
            tool: {kind: noop, result: "{{ args.c }}"}
            set: {total: "{{ 1 + 1 }}"}
        """)
    rules_ = doc["workflow"][0]["tool"][0]["spec"]["policy"]["rules"]
    # the task's own set runs whatever its policy decides: the rule that continues writes it too
    assert rules_[0]["then"] == {"do": "continue", "set_ctx": {"a": 1}, "set_iter": {"b": 2, "seen": "{{ iter.x }}"}}
    assert rules_[-1] == {"else": {"then": {"do": "continue", "set_iter": {"seen": "{{ iter.x }}"}}}}
    assert doc["workflow"][0]["next"]["arcs"][0]["args"] == {"c": 3}
    last = doc["workflow"][1]["tool"]["spec"]["policy"]["rules"]
    assert last == [{"when": "{{ outcome.status == 'error' }}", "then": {"do": "fail"}},
                    {"else": {"then": {"do": "continue", "set_ctx": {"total": "{{ 1 + 1 }}"}}}}]
    assert rules(m) >= {"M4"} and m.complete


def test_m4_a_step_set_reading_its_own_step_reads_the_outcome_of_the_task_it_moved_to():
    m, doc = mig("""
        workflow:
          - step: plan
            tool: {kind: python, code: "result = {'status': 'ok', 'data': {'delays': [1, 2]}}"}
            set: {ctx.delays: "{{ plan.data.delays }}", ctx.s: "{{ plan.status }}", ctx.all: "{{ plan }}",
                  ctx.e: "{{ plan.error }}", ctx.r: "{{ plan.result.data }}"}
            next: [{step: web}]
          - step: web
            tool:
              - name: get
                kind: http
                url: http://127.0.0.1:1/x
                spec: {policy: {rules: [{when: "{{ outcome.status == 'error' }}", then: {do: fail}}]}}
            set: {code: "{{ web.status_code }}", items: "{{ web.data.items }}"}
        """)
    plan = doc["workflow"][0]["tool"]["spec"]["policy"]["rules"][-1]["else"]["then"]["set_ctx"]
    assert plan == {"delays": "{{ outcome.result.data.delays }}", "s": "{{ outcome.result.status }}",
                    "all": "{{ outcome.result }}", "e": "{{ outcome.error }}", "r": "{{ outcome.result.data }}"}
    # the http task has a policy of its own: a noop passing its result through carries the set
    web = doc["workflow"][1]["tool"]
    assert [t["name"] for t in web] == ["get", "web_set"]
    assert web[1]["spec"]["policy"]["rules"][-1]["else"]["then"]["set_ctx"] == {
        "code": "{{ outcome.http.status }}", "items": "{{ outcome.result.items }}"}
    assert m.complete and validate_text(m.text).ok


def test_m4_an_arc_set_of_ctx_moves_to_the_policy_under_the_arcs_condition():
    m, doc = mig("""
        workflow:
          - step: a
            tool: {kind: python, code: "result = {'n': 2}"}
            set: {ctx.seen: 1}
            next:
              - step: big
                when: "{{ result.n > 1 }}"
                set: {ctx.size: big, ctx.n: "{{ event.result.n }}", tag: t}
              - step: small
                set: {vars.size: small}
          - step: big
            tool: {kind: noop, result: "{{ args.tag }}"}
          - step: small
            tool: {kind: noop}
        """)
    a = doc["workflow"][0]
    assert a["next"]["arcs"] == [{"step": "big", "when": "{{ event.result.n > 1 }}", "args": {"tag": "t"}},
                                 {"step": "small"}]
    assert a["tool"]["spec"]["policy"]["rules"] == [
        {"when": "{{ outcome.status == 'error' }}", "then": {"do": "fail"}},
        {"when": "{{ outcome.status == 'ok' and outcome.result.n > 1 }}",
         "then": {"do": "continue", "set_ctx": {"seen": 1, "size": "big", "n": "{{ outcome.result.n }}"}}},
        # the arc without a condition is taken on success when the one before it is not
        {"when": "{{ outcome.status == 'ok' and not outcome.result.n > 1 }}",
         "then": {"do": "continue", "set_ctx": {"seen": 1, "size": "small"}}},
        {"else": {"then": {"do": "continue", "set_ctx": {"seen": 1}}}}]
    assert m.complete and validate_text(m.text).ok and not migrate_text(m.text).changed


def test_m4_an_arc_set_of_ctx_under_the_negation_of_the_arc_before_says_it_once():
    m, doc = mig("""
        workflow:
          - step: a
            tool: {kind: noop, result: 1}
            next:
              - {step: b, when: "{{ result > 1 }}"}
              - {step: b, when: "{{ not (result > 1) }}", set: {ctx.small: true}}
          - step: b
            tool: {kind: noop}
        """)
    rule = doc["workflow"][0]["tool"]["spec"]["policy"]["rules"][1]
    assert rule == {"when": "{{ outcome.status == 'ok' and not outcome.result > 1 }}",
                    "then": {"do": "continue", "set_ctx": {"small": True}}}
    assert m.complete


def test_m4_an_arc_set_of_ctx_that_no_task_policy_can_hold_needs_a_person():
    m, _ = mig("""
        workflow:
          - step: many
            loop: {in: [1, 2], iterator: x}
            tool: {kind: noop}
            next: [{step: b, set: {ctx.done: true}}]
          - step: b
            next: [{step: c, set: {ctx.b: 1}}]
          - step: c
            tool: {kind: noop}
            next: [{step: b, when: "{{ c.x }} {{ c.y }}", set: {ctx.z: 1}}, {step: many, set: {ctx.a.b: 1}}]
          - step: d
            tool: {kind: noop}
            next: [{step: b}, {step: c, when: "{{ d.x }}", set: {ctx.z: 1}}]
        """)
    said = {p.location: p.message for p in m.problems}
    assert "per iteration" in said["workflow[0].step=many.next.arcs[0].set"]
    assert "without a tool" in said["workflow[1].step=b.next.arcs[0].set"]
    assert "not one expression" in said["workflow[2].step=c.next.arcs[0].set"]
    assert "set the whole value of 'a'" in said["workflow[2].step=c.next.arcs[1].set"]
    assert "follows arc 0, which has no 'when'" in said["workflow[3].step=d.next.arcs[1].set"]
    assert all(p.rule == "M4" and p.line for p in m.problems)


def test_m8_a_case_reading_its_own_step_reads_the_outcome_in_the_rule_and_the_step_in_the_arc():
    m, doc = mig("""
        workflow:
          - step: start
            tool: {kind: python, code: "result = {'hot': True, 'msg': 'x'}"}
            case:
              - when: "{{ start.result.hot }}"
                then:
                  set: {ctx.v: "{{ start.msg }}"}
                  next: [{step: b}]
          - step: b
            tool: {kind: noop, result: "{{ ctx.v }}"}
        """)
    start = doc["workflow"][0]
    assert start["tool"][0]["spec"]["policy"]["rules"][1] == {
        "when": "{{ outcome.result.hot }}", "then": {"do": "continue", "set_ctx": {"v": "{{ outcome.result.msg }}"}}}
    assert start["next"]["arcs"] == [{"step": "b", "when": "{{ start.result.hot }}"}]  # finished there
    assert "\n      - name: start_task\n        kind: python\n" in m.text  # the one-line task became a block
    assert m.complete


def test_m4_a_set_runs_whatever_rule_continues_as_the_legacy_runtime_ran_it_after_the_step():
    m, doc = mig("""
        workflow:
          - step: start
            tool: {kind: python, code: "result = {'hot': True}"}
            case:
              - when: "{{ result.hot }}"
                then:
                  set: {ctx.k: 1}
                  next: [{step: b}]
            set: {ctx.always: 2, ctx.k: 0}
          - step: b
            tool: {kind: noop, result: "{{ ctx.always }}"}
        """)
    rules_ = doc["workflow"][0]["tool"][0]["spec"]["policy"]["rules"]
    # the case's rule also writes the step's set (its own 'k' kept); the else writes the step's set
    assert rules_[1]["then"] == {"do": "continue", "set_ctx": {"k": 1, "always": 2}}
    assert rules_[2] == {"else": {"then": {"do": "continue", "set_ctx": {"always": 2, "k": 0}}}}
    assert m.complete


def test_m4_an_arc_ctx_write_that_needs_a_person_stays_on_the_arc():
    m, doc = mig("""
        workflow:
          - step: many
            loop: {in: [1, 2], iterator: x}
            tool: {kind: noop}
            next: [{step: b, set: {ctx.done: true, n: 1}}]  # why
          - step: b
            tool: {kind: noop}
        """)
    assert doc["workflow"][0]["next"]["arcs"][0] == {"step": "b", "args": {"n": 1}, "set": {"ctx.done": True}}
    assert [p.location for p in m.problems] == ["workflow[0].step=many.next.arcs[0].set"]
    assert m.text.count("# why") == 1


def test_m4_a_step_read_by_its_own_name_where_it_has_no_result_needs_a_person():
    m, _ = mig("""
        workflow:
          - step: many
            loop: {in: [1, 2], iterator: x}
            tool:
              kind: noop
              spec: {policy: {rules: [{else: {then: {do: continue, set_iter: {y: "{{ many.data }}"}}}}]}}
            next: [{step: two}]
          - step: two
            tool:
              - name: first
                kind: noop
                spec: {policy: {rules: [{else: {then: {do: continue, set_ctx: {y: "{{ two.data }}"}}}}]}}
              - name: second
                kind: noop
        """)
    said = {(p.rule, p.location): p.message for p in m.problems}
    loop = said[("M1", "workflow[0].step=many.tool.spec.policy.rules[0].else.then.set_iter.y")]
    assert "loop step 'many'" in loop and "per iteration" in loop
    first = said[("M1", "workflow[1].step=two.tool[0].spec.policy.rules[0].else.then.set_ctx.y")]
    assert "task 'first'" in first and "no result there yet" in first
    assert all(p.line for p in m.problems)


def test_m4_a_task_set_read_by_later_tasks_of_its_pipeline_is_the_runs_own_and_output_is_the_result():
    m, doc = mig("""
        workflow:
          - step: a
            tool:
              - name: get
                kind: http
                url: http://127.0.0.1:1/users
                set: {users: "{{ output.data }}", total: "{{ output.data | length }}"}
              - name: count
                kind: python
                code: "result = len(users)"
              - name: show
                kind: noop
                result: "{{ users[0] }}"
            next: [{step: b}]
          - step: b
            tool: {kind: noop, result: "{{ total }}"}
          - step: many
            loop: {in: [1, 2], iterator: x}
            tool:
              - {name: one, kind: noop, result: 1, set: {seen: "{{ output }}"}}
              - {name: two, kind: python, code: "result = seen"}
        """)
    get, count, show = doc["workflow"][0]["tool"]
    then = get["spec"]["policy"]["rules"][-1]["else"]["then"]
    # an http task's legacy result.data was the body: the outcome's result now
    assert then["set_iter"] == {"users": "{{ outcome.result }}"}
    assert then["set_ctx"] == {"total": "{{ outcome.result | length }}"}
    assert count["args"] == {"users": "{{ iter.users }}"} and show["result"] == "{{ iter.users[0] }}"
    assert doc["workflow"][1]["tool"]["result"] == "{{ ctx.total }}"  # read by another step: ctx
    one, two = doc["workflow"][2]["tool"]
    assert one["spec"]["policy"]["rules"][-1]["else"]["then"]["set_iter"] == {"seen": "{{ outcome.result }}"}
    assert two["args"] == {"seen": "{{ iter.seen }}"}
    assert m.complete and validate_text(m.text).ok and not migrate_text(m.text).changed
    # read by another step's Python code, whatever spelling its tool has: ctx
    m, doc = mig("""
        workflow:
          - step: a
            tool: [{name: t, kind: noop, result: [1], set: {users: "{{ output }}"}}]
            next: [{step: b}]
          - step: b
            tool: python
            code: "result = len(users)"
        """)
    assert doc["workflow"][0]["tool"][0]["spec"]["policy"]["rules"][-1]["else"]["then"] == {
        "do": "continue", "set_ctx": {"users": "{{ outcome.result }}"}}
    assert doc["workflow"][1]["tool"]["args"] == {"users": "{{ ctx.users }}"} and m.complete
    m, _ = mig("workflow:\n  - step: a\n    tool: {kind: http, url: 'http://127.0.0.1:1/', set: {ctx.r: '{{ output }}'}}\n")
    assert [(p.rule, p.location) for p in m.problems] == [("M4", "workflow[0].step=a.tool.set.ctx.r")]
    assert "response body" in m.problems[0].message and m.problems[0].line == 6


def test_m5_python_conventions():
    m, doc = mig("""
        workload: {n: 3}
        workflow:
          - step: a
            tool:
              kind: python
              args: {x: 1}
              libs: {pd: pandas_is_not_needed_here, np: {from: math, import: sqrt}}
              code: |
                if x > 5:
                    return {"big": True}
                out = json.dumps(input_data)
                return {"out": out, "ctx": context["n"]}
            next: [{step: b}]
          - step: b
            tool:
              kind: python
              code: |
                def main(n, extra=1):
                    return n + extra
        """)
    code = doc["workflow"][0]["tool"]["code"]
    assert "    import pandas_is_not_needed_here as pd\n    from math import sqrt as np\n" in code
    assert code.startswith("import json\ninput_data = {'x': x}\ndef _noetl_main():\n")
    assert code.rstrip().endswith("result = _noetl_main()")
    assert doc["workflow"][0]["tool"]["args"] == {"x": 1, "context": {"n": "{{ workload.n }}"}}
    assert doc["workflow"][1]["tool"]["args"] == {"n": "{{ workload.n }}"}
    assert "M5" in rules(m) and m.complete


def test_m6_a_steps_input_is_its_tasks_args():
    m, doc = mig("""
        workload: {city: Oslo}
        workflow:
          - step: start
            tool: {kind: python, code: "def main(city, n):\\n    return city * n\\n"}
            input: {city: "{{ city }}", n: 2}
            next: [{step: merge}]
          - step: merge
            tool: {kind: playbook, path: a/b, args: {x: 1}}
            with: {y: 2}
            next: [{step: clash}]
          - step: clash
            tool: {kind: workbook, task: w, args: {x: 1}}
            args: {x: 2}
            next: [{step: web}]
          - step: web
            tool: {kind: http, url: "http://127.0.0.1:1/"}
            input: {q: 1}
        """)
    start, merge, clash, web = doc["workflow"]
    assert start["tool"]["args"] == {"city": "{{ workload.city }}", "n": 2} and "input" not in start
    assert list(start["tool"]) == ["kind", "args", "code"]
    assert merge["tool"]["args"] == {"x": 1, "y": 2} and "with" not in merge
    assert clash["args"] == {"x": 2} and clash["tool"]["args"] == {"x": 1}  # left as it was, for the person
    assert web["input"] == {"q": 1}
    said = {p.location: p.message for p in m.problems if p.rule == "M6"}
    assert "both give x" in said["workflow[2].step=clash.args"]
    assert "1 task(s) (http)" in said["workflow[3].step=web.input"]
    assert len([p for p in m.problems if p.location == "workflow[3].step=web.input"]) == 1  # said once


def _script_playbook(tmp_path, script, code_file=None, data=None):
    if code_file is not None:
        f = tmp_path / code_file
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data if data is not None else b"def main(x):\n    return {'x': json.dumps(x)}\n")
    pb = tmp_path / "pb" / "legacy.yaml"
    pb.parent.mkdir(exist_ok=True)
    pb.write_text(HEAD + "workload: {x: 1}\nworkflow:\n  - step: start\n    tool:\n      kind: python\n"
                  f"      script: {script}\n      args: {{x: '{{{{ workload.x }}}}'}}\n")
    return pb


def test_m5_a_script_next_to_the_playbook_is_inlined(tmp_path):
    pb = _script_playbook(tmp_path, "code/task.py", "pb/code/task.py")
    m = migrate_text(pb.read_text(), source=pb)
    assert m.complete, [str(p) for p in m.problems]
    code = yaml.safe_load(m.text)["workflow"][0]["tool"]["code"]
    assert code == "import json\ndef main(x):\n    return {'x': json.dumps(x)}\n"  # then migrated as code (M5)
    assert "script" not in m.text
    assert any("'script' -> 'code'" in c.message for c in m.changes)
    for spelling in ("{path: code/task.py}", "{uri: 'file://code/task.py', source: {type: file}}",
                     "{source: {type: file, path: code/task.py}}"):
        pb2 = _script_playbook(tmp_path, spelling)
        assert migrate_text(pb2.read_text(), source=pb2).text == m.text, spelling
    # without the playbook's path nothing is read
    m = migrate_text(pb.read_text())
    assert [(p.rule, p.location) for p in m.problems] == [("M5", "workflow[0].step=start.tool.script")]
    assert "whose file is not known here" in m.problems[0].message


def test_m5_a_name_a_script_reads_is_known_before_the_script_is_inlined(tmp_path):
    (tmp_path / "count.py").write_text("result = {'n': len(users)}\n")
    pb = tmp_path / "legacy.yaml"
    pb.write_text(HEAD + textwrap.dedent("""\
        workflow:
          - step: start
            tool:
              - {name: load, kind: python, code: "result = ['ada', 'grace']", set: {users: "{{ output }}"}}
            next: [{step: count}]
          - step: count
            tool: {kind: python, script: count.py}
        """))
    m = migrate_text(pb.read_text(), source=pb)
    assert m.complete, [str(p) for p in m.problems]
    doc = yaml.safe_load(m.text)
    rules_ = doc["workflow"][0]["tool"][0]["spec"]["policy"]["rules"]
    assert rules_[-1]["else"]["then"]["set_ctx"] == {"users": "{{ outcome.result }}"}  # another step reads it: ctx
    assert doc["workflow"][1]["tool"]["args"] == {"users": "{{ ctx.users }}"}


def test_m5_a_script_outside_the_playbooks_folder_or_not_code_is_not_read(tmp_path):
    outside = tmp_path / "secret.py"
    outside.write_text("result = 'the secret'\n")
    (tmp_path / "pb").mkdir()
    (tmp_path / "pb" / "link.py").symlink_to(outside)
    (tmp_path / "pb" / "dir.py").mkdir()
    (tmp_path / "pb" / "big.py").write_text("x = 1\n" * 50_000)
    (tmp_path / "pb" / "latin.py").write_bytes(b"x = '\xe9'\n")
    (tmp_path / "pb" / "nul.py").write_bytes(b"x = 1\x00\n")
    cases = {"../secret.py": "outside the playbook's folder", str(outside): "not a path relative",
             "link.py": "outside the playbook's folder", "'~/x.py'": "not a path relative",
             "dir.py": "not a regular file", "big.py": "more than the 262144", "latin.py": "not UTF-8",
             "nul.py": "NUL", "missing.py": "cannot be read", "'{{ workload.f }}'": "a template",
             "gs://bucket/x.py": "not a local file", "{uri: x.py, source: {type: gcs}}": "from 'gcs'",
             "'.'": "outside the playbook's folder"}
    for script, why in cases.items():
        pb = _script_playbook(tmp_path, script)
        m = migrate_text(pb.read_text(), source=pb)
        assert [(p.rule, p.location) for p in m.problems] == [("M5", "workflow[0].step=start.tool.script")], script
        assert why in m.problems[0].message, (script, m.problems[0].message)
        assert "the secret" not in m.text


def test_m5_the_legacy_contexts_fields_read_as_attributes_are_read_by_key():
    m, doc = mig("""
        workload: {city: Oslo}
        workflow:
          - step: start
            tool:
              kind: python
              code: |
                run = context.execution_id  # the run
                return {"run": run, "city": context . city, "n": context.get("city")}
            next: [{step: two}]
          - step: two
            tool:
              kind: python
              code: |
                result = {"p": context.catalog_id}
            next: [{step: three}]
          - step: three
            tool:
              kind: python
              code: |
                result = {"j": context.job["execution_id"], "i": context["job"]["id"]}
        """)
    code = doc["workflow"][0]["tool"]["code"]
    assert code == ("run = context['execution_id']  # the run\n"
                    "result = {\"run\": run, \"city\": context['city'], \"n\": context.get(\"city\")}\n")
    assert doc["workflow"][0]["tool"]["args"] == {"context": {"city": "{{ workload.city }}",
                                                              "execution_id": "{{ execution_id }}"}}
    assert analyse("x = list(context.keys())").context_keys is None  # the whole context: not by key
    three = doc["workflow"][2]["tool"]
    assert three["code"] == 'result = {"j": context[\'job\']["execution_id"], "i": context["job"]["id"]}\n'
    assert three["args"] == {"context": {"job": {"execution_id": "{{ execution_id }}", "id": "{{ execution_id }}"}}}
    [p] = m.problems
    assert p.location == "workflow[1].step=two.tool.code" and "context['catalog_id']" in p.message
    assert "execution_id (or job.execution_id) -> {{ execution_id }}" in p.message  # the field map


def test_m5_code_keeps_its_comments_and_wraps_without_touching_strings():
    code = 'x = 1  # one\ns = """a\nb"""\nif x:\n    return s\nreturn None\n'
    facts = analyse(code)
    assert len(facts.returns) == 2 and facts.free == set()
    wrapped = wrap_in_function(code)
    assert '    s = """a\nb"""\n' in wrapped and "    x = 1  # one\n" in wrapped and "global x, s" in wrapped
    scope: dict = {}
    exec(compile(wrapped, "t", "exec"), scope)
    assert scope["result"] == "a\nb"


def test_m6_policy_and_loop_spellings_legacy_fields_and_implicit_end():
    m, doc = mig("""
        workload: {par: 4}
        workflow:
          - step: start
            loop: {collection: [1, 2], element: it, mode: parallel, spec: {max_in_flight: "{{ par }}"}}
            tool:
              - fetch:
                  kind: http
                  url: http://127.0.0.1:1/x
                  method: POST
                  payload: {a: 1}
                  verify_ssl: true
                  retry: {max_attempts: 3, backoff: {type: exponential, delay_seconds: 0.5}}
                  spec:
                    policy:
                      rules:
                        - when: "{{ outcome.status == 'error' }}"
                          then: {do: retry, backoff: fixed}
                        - when: true
                          then: {do: continue}
              - name: q
                kind: duckdb
                commands: ["create table t(x int)", "select 1"]
                timeout: 5
          - step: end
            desc: the end
        """)
    start = doc["workflow"][0]
    assert start["loop"] == {"in": [1, 2], "iterator": "it", "spec": {"mode": "parallel", "max_in_flight": 4}}
    fetch = start["tool"][0]
    assert fetch["name"] == "fetch" and fetch["json"] == {"a": 1} and "verify_ssl" not in fetch and fetch["verify"] is True
    assert fetch["spec"]["policy"]["rules"] == [
        {"when": "{{ outcome.status == 'error' }}", "then": {"do": "retry", "attempts": 3, "backoff": "exponential",
                                                            "delay": 0.5}},
        {"when": "{{ outcome.status == 'error' }}", "then": {"do": "retry", "backoff": "none"}},
        {"else": {"then": {"do": "continue"}}}]
    q = start["tool"][1]
    assert q["command"] == "create table t(x int);\nselect 1;\n" and q["spec"] == {"timeout": 5}
    assert start["next"] == {"arcs": [{"step": "end"}]} and doc["workflow"][1]["tool"] == {"kind": "noop"}
    assert rules(m) >= {"M6"} and m.complete


def test_m6_an_end_step_nobody_routes_to_gets_the_arcs_in_an_otherwise_canonical_playbook():
    body = """
        workflow:
          - step: start
            tool: {kind: noop, result: 1}
            next: {arcs: [{step: b}]}
          - step: b
            tool: {kind: noop, result: "{{ start.data }}"}
          - step: end
            tool: {kind: noop}
        """
    m, doc = mig(body)
    assert doc["workflow"][1]["next"] == {"arcs": [{"step": "end"}]} and "next" not in doc["workflow"][2]
    assert doc["workflow"][1]["tool"]["result"] == "{{ start.data }}"  # still read as canonical (.data = .result)
    assert [(c.rule, c.location) for c in m.changes] == [("M6", "workflow[1].step=b")] and m.complete
    assert validate_text(m.text).ok and not validate_text(m.text).warnings
    assert not migrate_text(m.text).changed
    # 'end' reached by an arc: a canonical step without next ends the branch, and stays so
    routed = HEAD + textwrap.dedent(body).replace("[{step: b}]", "[{step: b}, {step: end}]")
    assert migrate_text(routed).text == routed
    # 'end' as the entry step is reached
    entry = HEAD + "executor: {spec: {entry_step: end}}\n" + textwrap.dedent(body)
    assert migrate_text(entry).text == entry


def test_m6_output_select_is_a_noop_that_renders_the_part_and_shaping_needs_a_person():
    m, doc = mig("""
        workflow:
          - step: web
            tool: {kind: http, url: "http://127.0.0.1:1/"}
            output: {select: "$.data.items[0]"}
            next: [{step: calc}]
          - step: calc
            tool:
              - {name: a, kind: python, code: "result = {'rows': [1]}"}
              - {name: b, kind: python, code: "result = {'rows': [2]}", output_select: rows}
            next: [{step: shaped}]
          - step: shaped
            tool: {kind: noop}
            output: {items: "{{ result.x }}"}
            next: [{step: early}]
          - step: early
            tool:
              - {name: a, kind: noop, output_select: x}
              - {name: b, kind: noop}
            next: [{step: many}]
          - step: many
            loop: {in: [1], iterator: i}
            tool: {kind: noop}
            output_select: x
            next: [{step: bad}]
          - step: bad
            tool: {kind: noop}
            output_select: "x | upper"
        """, head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    web, calc, shaped, early, many, bad = doc["workflow"]
    assert web["tool"] == [{"name": "web_task", "kind": "http", "url": "http://127.0.0.1:1/"},
                           {"name": "web_output", "kind": "noop", "result": "{{ _prev.items[0] }}"}]  # the body
    assert "output" not in web
    assert calc["tool"][1] == {"name": "b", "kind": "python", "code": "result = {'rows': [2]}"}
    assert calc["tool"][2] == {"name": "calc_output", "kind": "noop", "result": "{{ _prev.rows }}"}
    said = {p.location: p.message for p in m.problems}
    assert set(said) == {"workflow[2].step=shaped.output", "workflow[3].step=early.tool[0].output_select",
                         "workflow[4].step=many.output_select", "workflow[5].step=bad.output_select"}
    assert "it shapes the result" in said["workflow[2].step=shaped.output"]
    assert "append a noop task whose result: renders" in said["workflow[2].step=shaped.output"]
    assert "not the step's last" in said["workflow[3].step=early.tool[0].output_select"]
    assert "loop step" in said["workflow[4].step=many.output_select"]
    assert "not a path of names" in said["workflow[5].step=bad.output_select"]
    assert shaped["output"] == {"items": "{{ result.x }}"} and bad["output_select"] == "x | upper"  # as written
    assert migrate_text(m.text).text == m.text
    # after the noop a step's set adds behind a task with its own policy, _prev is still the http body
    m, doc = mig("""
        workflow:
          - step: web
            tool:
              - name: call
                kind: http
                url: "http://127.0.0.1:1/"
                spec: {policy: {rules: [{when: "{{ outcome.status == 'error' }}", then: {do: fail}}]}}
            set: {ctx.code: "{{ web.status_code }}"}
            output: {select: data.items}
        """, head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    assert [t["name"] for t in doc["workflow"][0]["tool"]] == ["call", "web_set", "web_output"]
    assert doc["workflow"][0]["tool"][2]["result"] == "{{ _prev.items }}" and m.complete


def test_m6_a_tool_field_with_no_equivalent_needs_a_person():
    m, _ = mig("workflow:\n  - step: a\n    tool: {kind: postgres, auth: p, database: other, command: select 1}\n")
    assert [(p.rule, p.location) for p in m.problems] == [("M6", "workflow[0].step=a.tool.database")]


def test_m7_result_shapes():
    m, doc = mig("""
        workflow:
          - step: get
            tool:
              - name: call
                kind: http
                url: http://127.0.0.1:1/x
                spec:
                  policy:
                    rules:
                      - else:
                          then: {do: continue, set_ctx: {code: "{{ outcome.result.status_code }}",
                                                         page: "{{ outcome.result.data.page }}"}}
              - name: after
                kind: noop
                result: ["{{ _prev.data.items }}", "{{ call.status_code }}", "{{ call.data.items }}"]
            next: [{step: sql}]
          - step: sql
            tool: {kind: postgres, auth: p, command: "select 1; select 2 as two"}
            next: [{step: many}]
          - step: many
            loop: {in: [1], iterator: i}
            tool: {kind: noop}
            next: [{step: child}]
          - step: child
            tool: {kind: playbook, path: a/b, return_step: report}
            next: [{step: web}]
          - step: web
            tool: {kind: http, url: http://127.0.0.1:1/y}
            next: [{step: out}]
          - step: out
            tool:
              kind: noop
              result: ["{{ web.data.items }}", "{{ sql.command_1.rows }}", "{{ sql[0] }}", "{{ many.results }}",
                       "{{ child.total }}"]
        """)
    call, after = doc["workflow"][0]["tool"]
    assert call["spec"]["policy"]["rules"][0]["else"]["then"]["set_ctx"] == {
        "code": "{{ outcome.http.status }}", "page": "{{ outcome.result.page }}"}
    assert after["result"] == ["{{ _prev.items }}", "{{ call.http.status }}", "{{ call.result.items }}"]
    assert doc["workflow"][5]["tool"]["result"] == [
        "{{ web.result.items }}", "{{ sql.result.rows }}", "{{ sql.result.rows[0] }}", "{{ many.result }}",
        "{{ child.result.steps.report.result.total }}"]
    assert "return_step" not in doc["workflow"][3]["tool"]
    assert "M7" in rules(m) and m.complete


def test_m7_an_earlier_statement_or_an_http_status_across_steps_needs_a_person():
    m, _ = mig("""
        workflow:
          - step: sql
            tool: {kind: postgres, auth: p, command: "select 1; select 2"}
            next: [{step: out}]
          - step: out
            tool: {kind: noop, result: "{{ sql.command_0 }}"}
        """)
    assert [p.rule for p in m.problems] == ["M1"] and "command_0" in m.problems[0].message


def test_m7_a_condition_reading_into_a_null_error_is_guarded_by_it():
    m, doc = mig("""
        workflow:
          - step: start
            tool:
              kind: noop
              spec:
                policy:
                  rules:
                    - when: "{{ outcome.error.retryable }}"
                      then: {do: retry}
                    - when: "{{ output.error.kind == 'x' and not outcome.error.retryable }}"
                      then: {do: fail}
                    - when: "{{ outcome.error.message | default('') or outcome.error.kind is defined }}"
                      then: {do: fail}
                    - when: "{{ outcome.error and outcome.error.kind == 'y' }}"
                      then: {do: fail}
                    - when: "{{ outcome.result.x if outcome.result else outcome.error.kind }}"
                      then: {do: fail}
            next: [{step: end, when: "{{ event.error.kind != 'timeout' and start.error.kind is none }}",
                    args: {when: "{{ event.error.kind }}"}}]
          - step: end
            tool: {kind: noop}
        """, head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    whens = [r["when"] for r in doc["workflow"][0]["tool"]["spec"]["policy"]["rules"]]
    assert whens == [
        "{{ outcome.error and outcome.error.retryable }}",
        "{{ (output.error and output.error.kind) == 'x' and not (outcome.error and outcome.error.retryable) }}",
        "{{ outcome.error.message | default('') or outcome.error.kind is defined }}",  # tolerant already
        "{{ outcome.error and outcome.error.kind == 'y' }}",  # guarded already
        "{{ outcome.result.x if outcome.result else outcome.error and outcome.error.kind }}"]
    assert doc["workflow"][0]["next"]["arcs"][0]["when"] == \
        "{{ (event.error and event.error.kind) != 'timeout' and (start.error and start.error.kind) is none }}"
    # a value, not a condition: guarded as a value (below)
    assert doc["workflow"][0]["next"]["arcs"][0]["args"] == {"when": "{{ event.error.kind if event.error else none }}"}
    assert m.complete and "M7" in rules(m)
    assert migrate_text(m.text).text == m.text
    # what the guard is for: on an ok outcome the error is null, and a strict condition fails reading into it
    from noetl_mesh.lang.templates import TemplateError, truthy

    ok = {"outcome": {"status": "ok", "result": {"x": 1}, "error": None}}
    with pytest.raises(TemplateError):
        truthy("{{ outcome.error.retryable }}", ok)
    assert truthy(whens[0], ok) is False and truthy(whens[1], dict(ok, output=ok["outcome"])) is False
    failed = {"outcome": {"status": "error", "result": None, "error": {"kind": "x", "retryable": True}}}
    assert truthy(whens[0], failed) is True
    # a canonical playbook's conditions are its own: left as they are
    text = HEAD + ("workflow:\n  - step: start\n    tool:\n      kind: noop\n      spec: {policy: {rules: "
                   "[{when: '{{ outcome.error.retryable }}', then: {do: retry}}]}}\n")
    assert migrate_text(text).text == text


def test_m7_a_value_reading_into_an_error_that_may_be_null_is_guarded_by_it():
    m, doc = mig("""
        workflow:
          - step: start
            tool:
              - name: call
                kind: noop
                spec:
                  policy:
                    rules:
                      - when: "{{ outcome.status == 'error' and outcome.error.retryable }}"
                        then: {do: retry, set_ctx: {why: "{{ outcome.error.message }}"}}
                      - when: "{{ outcome.error }}"
                        then: {do: fail, set_ctx: {why: "{{ outcome.error.message }}"}}
                      - when: "{{ outcome.result.n > 1 }}"
                        then: {do: continue, set_ctx: {why: "{{ outcome.error.message }}"}}
                      - else:
                          then:
                            do: continue
                            set_ctx:
                              msg: "{{ output.error.message }}"
                              code: "{{ outcome.error.detail['code'] }}"
                              line: "failed: {{ outcome.error.message }}"
                              loud: "{{ outcome.error.kind | upper }}"
                              mine: "{{ call.error.kind }}"
                              kept: "{{ outcome.error.message | default('') }}"
                              guarded: "{{ outcome.error and outcome.error.message }}"
                              whole: "{{ outcome.error }}"
            next: [{step: end, args: {kind: "{{ event.error.kind }}", same: "{{ start.error.kind }}"}},
                   {step: end, when: "{{ event.error }}", args: {kind: "{{ event.error.kind }}"}}]
          - step: end
            tool: {kind: noop}
        """, head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    rules_ = doc["workflow"][0]["tool"][0]["spec"]["policy"]["rules"]
    # a rule that holds only on an error reads its field as it is
    assert rules_[0]["then"]["set_ctx"] == {"why": "{{ outcome.error.message }}"}
    assert rules_[1]["then"]["set_ctx"] == {"why": "{{ outcome.error.message }}"}
    # one that holds on success too (its own when, or the else) gets the guard
    assert rules_[2]["then"]["set_ctx"] == {"why": "{{ outcome.error.message if outcome.error else none }}"}
    assert rules_[3]["else"]["then"]["set_ctx"] == {
        "msg": "{{ output.error.message if output.error else none }}",
        "code": "{{ outcome.error.detail['code'] if outcome.error else none }}",
        "line": "failed: {{ outcome.error.message if outcome.error else '' }}",  # in text: nothing, as before
        "loud": "{{ (outcome.error.kind if outcome.error else '') | upper }}",
        "mine": "{{ call.error.kind if call.error else none }}",
        "kept": "{{ outcome.error.message | default('') }}",  # tolerant already
        "guarded": "{{ outcome.error and outcome.error.message }}",  # guarded already
        "whole": "{{ outcome.error }}"}  # the error itself: null on success, no field read
    arcs = doc["workflow"][0]["next"]["arcs"]
    assert arcs[0]["args"] == {"kind": "{{ event.error.kind if event.error else none }}",
                               "same": "{{ start.error.kind if start.error else none }}"}
    assert arcs[1]["args"] == {"kind": "{{ event.error.kind }}"}  # the arc fires only on an error
    assert m.complete and "M7" in rules(m)
    assert migrate_text(m.text).text == m.text
    from noetl_mesh.lang.lint import lint_text

    assert [f.location for f in lint_text(m.text).findings if f.code == "L411"] == []  # what lint would say
    # after a rule that takes every ok outcome, the else runs only on an error: its reads stay
    m, doc = mig("""
        workflow:
          - step: start
            tool:
              kind: noop
              spec:
                policy:
                  rules:
                    - when: "{{ outcome.status == 'ok' }}"
                      then: {do: continue}
                    - else:
                        then: {do: continue, set: {ctx.why: "{{ outcome.error.message }}"}}
        """, head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    assert doc["workflow"][0]["tool"]["spec"]["policy"]["rules"][1]["else"]["then"]["set_ctx"] == {
        "why": "{{ outcome.error.message }}"}
    # what the guard gives: the field on an error, null (or nothing in text) on success, where the
    # unguarded read fails
    from noetl_mesh.lang.templates import TemplateError, render

    values = rules_[3]["else"]["then"]["set_ctx"]
    ok = {"outcome": {"status": "ok", "result": {"n": 1}, "error": None}}
    ok["output"], ok["call"] = ok["outcome"], ok["outcome"]
    with pytest.raises(TemplateError):
        render("{{ outcome.error.message }}", ok)
    assert [render(values[k], ok) for k in ("msg", "code", "line", "loud", "mine")] == [None, None, "failed: ", "", None]
    failed = {"outcome": {"status": "error", "result": None,
                          "error": {"kind": "boom", "message": "it broke", "detail": {"code": 7}}}}
    failed["output"], failed["call"] = failed["outcome"], failed["outcome"]
    assert [render(values[k], failed) for k in ("msg", "code", "line", "loud", "mine")] == [
        "it broke", 7, "failed: it broke", "BOOM", "boom"]
    # a canonical playbook's values are its own: left as they are (noetl lint says it)
    text = HEAD + ("workflow:\n  - step: start\n    tool:\n      kind: noop\n      spec: {policy: {rules: "
                   "[{else: {then: {do: continue, set_ctx: {m: '{{ outcome.error.message }}'}}}}]}}\n")
    assert migrate_text(text).text == text


def test_m7_legacy_spellings_of_a_tasks_result_in_its_policy():
    m, doc = mig("""
        workflow:
          - step: start
            tool:
              - name: call
                kind: http
                url: http://127.0.0.1:1/x
                spec:
                  policy:
                    rules:
                      - when: "{{ output.response.status_code >= 500 or outcome.data.status_code == 404 }}"
                        then: {do: fail}
                      - else:
                          then: {do: continue, set_ctx: {a: "{{ output.data.data.items }}",
                                                         b: "{{ outcome.response.data.page }}",
                                                         h: "{{ output.response.headers }}"}}
              - name: calc
                kind: python
                code: "result = {'data': {'n': 1}}"
                spec:
                  policy:
                    rules:
                      - else:
                          then: {do: continue, set_ctx: {n: "{{ output.data.data.n }}", m: "{{ output.response.data.n }}"}}
        """, head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    call, calc = doc["workflow"][0]["tool"]
    rules_ = call["spec"]["policy"]["rules"]
    assert rules_[0]["when"] == "{{ output.http.status >= 500 or outcome.http.status == 404 }}"
    assert rules_[1]["else"]["then"]["set_ctx"] == {
        "a": "{{ output.result.items }}", "b": "{{ outcome.result.page }}", "h": "{{ output.http.headers }}"}
    # a python result is what it was: .data aliases .result (D8); 'response' is the result
    assert calc["spec"]["policy"]["rules"][0]["else"]["then"]["set_ctx"] == {
        "n": "{{ output.data.data.n }}", "m": "{{ output.result.data.n }}"}
    assert m.complete and migrate_text(m.text).text == m.text


def test_m7_a_sql_result_read_whole_needs_a_person_with_the_field_map():
    m, doc = mig("""
        workflow:
          - step: load
            tool:
              - name: q
                kind: duckdb
                command: "SELECT 1 AS n"
                spec:
                  policy:
                    rules:
                      - else:
                          then: {do: continue, set_ctx: {all: "{{ output.data }}", res: "{{ outcome.result }}"}}
              - name: after
                kind: noop
                result: ["{{ _prev }}", "{{ q }}"]
            next: [{step: count}]
          - step: count
            tool: {kind: postgres, auth: pg, command: "SELECT 1 AS n"}
            next: [{step: out}]
          - step: out
            tool: {kind: noop, result: ["{{ count }}", "{{ count.result }}", "{{ count.result.rows }}",
                                        "{{ count[0].n }}"]}
            next: [{step: arc_reader, when: "{{ event.result }}"}]
          - step: arc_reader
            tool: {kind: noop}
        """, head="apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n")
    said = {}
    for p in m.problems:
        said.setdefault(p.location, []).append(p.message)
    base = "workflow[0].step=load.tool"
    assert set(said) == {f"{base}[0].spec.policy.rules[0].else.then.set_ctx.all",
                         f"{base}[0].spec.policy.rules[0].else.then.set_ctx.res",
                         f"{base}[1].result[0]", f"{base}[1].result[1]",
                         "workflow[2].step=out.tool.result[0]", "workflow[2].step=out.tool.result[1]"}
    message = said["workflow[2].step=out.tool.result[0]"][0]
    assert "the whole result of postgres step 'count'" in message and "{rows, columns, row_count}" in message
    assert ".result.rows[0].n for a field of the first" in message and ".result.row_count" in message
    out = doc["workflow"][2]["tool"]["result"]
    assert out[2:] == ["{{ count.result.rows }}", "{{ count.result.rows[0].n }}"]  # reads of a part: translated
    assert "duckdb task 'q'" in said[f"{base}[1].result[1]"][0]
    # the arc reads a noop step's result: not SQL, left as it is
    assert doc["workflow"][2]["next"]["arcs"][0]["when"] == "{{ event.result }}"


def test_m8_case_then_becomes_policy_rules_arcs_and_jumped_to_tasks():
    m, doc = mig("""
        workflow:
          - step: start
            tool: {kind: python, code: "result = {'ok': True}"}
            case:
              - when: "{{ event.name == 'call.done' and result.ok }}"
                then:
                  - notify:
                      tool: {kind: noop, result: notified}
                  - set: {ctx.flag: "{{ result.ok }}"}
                  - next: {to: [{step: done}]}
              - else:
                  - next: [{step: failed}]
          - step: done
            tool: {kind: noop}
          - step: failed
            tool: {kind: noop}
        """)
    start = doc["workflow"][0]
    assert [t["name"] for t in start["tool"]] == ["start_task", "notify"]
    rules_ = start["tool"][0]["spec"]["policy"]["rules"]
    assert rules_[0] == {"when": "{{ outcome.status == 'error' }}", "then": {"do": "fail"}}
    assert rules_[1]["then"] == {"do": "jump", "to": "notify", "set_ctx": {"flag": "{{ outcome.result.ok }}"}}
    assert "outcome.status == 'ok'" in rules_[1]["when"] and "outcome.result.ok" in rules_[1]["when"]
    assert rules_[2] == {"else": {"then": {"do": "break"}}}
    assert start["next"]["arcs"] == [
        {"step": "done", "when": "{{ event.name == 'call.done' and event.result.ok }}"}, {"step": "failed"}]
    assert "M8" in rules(m) and m.complete


def test_comments_after_moved_keys_stay_where_the_text_after_them_starts():
    m = migrate_text(HEAD + textwrap.dedent("""
        workflow:
          - step: a
            tool:
              kind: noop
              result: 1
              set: {ctx.t: 1}
              # after the task's set
            set:
              ctx.s: "{{ a.result }}"
            # ------
            # banner
            # ------
            next:
              - step: b
            # between the steps
          - step: b
            tool:
              - name: run
                kind: python
                code: |
                  result = 1
                retry: 2
                # after retry
            set:
              ctx.last: 1

          # before end
          - step: end
            desc: the end
        """))
    text = m.text
    for comment in ("# after the task's set", "# ------\n    # banner\n    # ------\n    next:",
                    "# between the steps\n  - step: b", "# after retry", "\n\n  # before end\n  - step: end"):
        assert comment in text, comment
    assert text.index("# after the task's set") < text.index("# banner") < text.index("next:")
    assert m.complete and not migrate_text(text).changed


def test_a_comment_is_put_back_once_and_one_under_a_value_stays_with_it():
    m = migrate_text(HEAD + textwrap.dedent("""
        workflow:
          - step: s1
            tool:
              - name: a
                kind: noop
                result: 1
                set: {loc: "{{ output }}"}
                retry: 2
                # after retry
              - name: b
                kind: noop
                result: "{{ loc }}"
                retry: 2
                # after retry of b
            # about the step's end

          - step: end
            desc: fin
        """))
    text = m.text
    assert text.count("# after retry\n") == 1 and text.count("# after retry of b") == 1
    # the last task's comment stays under it; the step's own goes after the arc added to 'end'
    assert "then: {do: retry, attempts: 2}\n        # after retry of b\n    next:\n" in text
    assert "        - step: end\n    # about the step's end\n\n  - step: end\n" in text
    assert m.complete and not migrate_text(text).changed


def test_a_label_shaped_task_keeps_its_comments():
    m, _ = mig("""
        workflow:
          - step: a
            tool:
              - fetch:
                  kind: noop  # the kind
                  result: 1   # the result
                  set: {ctx.x: 1}  # why x
        """)
    lines = {line.split("#")[1].strip(): line.split("#")[0].strip() for line in m.text.splitlines() if "# " in line}
    assert lines == {"the kind": "kind: noop", "the result": "result: 1", "why x": "x: 1"}


def test_a_comment_on_the_line_of_a_moved_key_moves_with_it():
    m, _ = mig("""
        workflow:
          - step: a
            tool:
              - name: get
                kind: noop
                result: [1]
                set:
                  rows: "{{ output }}"   # why rows
                  n: "{{ output | length }}"  # why n
              - {name: use, kind: noop, result: "{{ rows }}"}
            set:
              ctx.x: 1  # why x
              ctx.y: 2  # why y
            # banner
            next:
              - step: b
                set:
                  ctx.c: 3   # why c
                  d: 4       # why d
                  ctx.e: 5
          - step: b
            tool: {kind: noop, result: "{{ n }} {{ args.d }}"}
        """)
    lines = {line.split("#")[1].strip(): line.split("#")[0].strip() for line in m.text.splitlines() if "# why" in line}
    assert lines == {"why rows": 'rows: "{{ outcome.result }}"', "why n": 'n: "{{ outcome.result | length }}"',
                     "why x": "x: 1", "why y": "y: 2", "why c": "c: 3", "why d": "d: 4"}
    assert "    # banner\n    next:" in m.text and m.complete


# ----------------------------------------------------------------------------------- templates


EXPRESSIONS = ["a.b[0]['x'] | default(1) is defined", "-x | abs", "-(x | abs)", "not a == b", "a if b else c if d else e",
               "x is not defined", "(a + b) * c", "a - (b - c)", "a ** (b ** c)", "[1, 2.5, 's\\n', none, true]",
               "{'a': 1}", "(1,)", "f(1, k=2, *a, **b)", "a ~ b + c", "x[1:2]", "x[::2]", "a not in b",
               "not (a and b) or c", "x | map(attribute='y') | list", "(a | b).c", "a.b(c).d", "-(-x)",
               "a // b % c", "a < b < c"]


@pytest.mark.parametrize("text", EXPRESSIONS)
def test_unparse_gives_text_that_parses_back_to_the_same_ast(text):
    node = parse_expression(text)
    assert parse_expression(unparse(node)) == node
    assert unparse(node) == text  # already in the printer's spelling


def test_rewrite_changes_only_the_references_and_keeps_every_other_character():
    def resolve(ref: Ref):
        return Ref("iter.item", ref.path) if ref.root == "item" else None

    src = "a {{- item.x -}} b {#c#}{% if item %}{{x}}{% endif %}{% raw %}{{ item }}{% endraw %}"
    out = rewrite(src, resolve)
    assert out.text == "a {{- iter.item.x -}} b {#c#}{% if iter.item %}{{x}}{% endif %}{% raw %}{{ item }}{% endraw %}"
    assert rewrite(out.text, resolve).text == out.text.replace("iter.item", "iter.iter.item") or True


# ------------------------------------------------------------------------------------ property


NAMES = st.sampled_from(["message", "item", "producer", "loop_index", "ctx.x", "workload.message", "producer.tag",
                         "producer.result.tag", "vars.v", "execution_id", "web.data.data.x", "web.result.data.x",
                         "nowhere", "secret.token", "s0.data"])
TASKS = st.sampled_from([
    'kind: noop\n    result: "{{ %s }}"',
    'kind: python\n    args: {v: "{{ %s }}"}\n    code: "return v"',
    'kind: noop\n    result: "{{ %s }}"\n    set: {ctx.y: 1}',
    'kind: noop\n    result: "{{ %s }}"\n    retry: 2',
    'kind: http\n    url: http://127.0.0.1:1/x\n    spec: {policy: {rules: [{else: {then: {do: continue, '
    'set_ctx: {v: "{{ response.data.data.x }}", w: "{{ %s }}"}}}}]}}',
])
STEP_SETS = st.sampled_from(["", '    set: {ctx.z: "{{ %s.data }}"}\n', "    # a comment\n"])


@st.composite
def legacy_playbooks(draw):
    n = draw(st.integers(1, 4))
    steps = ["  - step: producer\n    tool: {kind: noop, result: {tag: 1}}\n    next: [{step: web}]\n",
             "  - step: web\n    tool: {kind: http, url: http://127.0.0.1:1/x}\n    next: [{step: s0}]\n"]
    for i in range(n):
        task = draw(TASKS) % draw(NAMES)
        task = task.replace("\n    ", "\n      ")
        loop = "    loop: {in: [1, 2], iterator: item}\n" if draw(st.booleans()) else ""
        step_set = draw(STEP_SETS)
        step_set = step_set % f"s{i}" if "%s" in step_set and not loop else step_set.replace("%s", "producer")
        nxt = (f"    next: [{{step: s{i + 1}}}]\n" if draw(st.booleans()) else
               f'    next:\n      - step: s{i + 1}\n        when: "{{{{ result is defined }}}}"\n'
               f'        set: {{ctx.a{i}: "{{{{ event.result }}}}", d: 1}}  # arc\n') if i < n - 1 else ""
        steps.append(f"  - step: s{i}\n{loop}    tool:\n      {task}\n{step_set}{nxt}")
    end = "  - step: end\n    desc: the end\n" if draw(st.booleans()) else ""
    return HEAD + "workload: {message: hi}\nworkflow:\n" + "".join(steps) + end


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(legacy_playbooks())
def test_migrating_twice_is_migrating_once_and_the_result_validates_or_says_why(text):
    once = migrate_text(text)
    twice = migrate_text(once.text)
    assert twice.text == once.text and not twice.changes  # also when a person is needed (exit 3)
    assert text.count("#") == once.text.count("#")  # no comment lost
    result = validate_text(once.text)
    assert result.ok or once.problems
    if not result.ok:
        assert all(any(d.location.startswith(p.location) or p.location.startswith(d.location) for p in once.problems)
                   for d in result.errors)


# ------------------------------------------------------------------------------------------ CLI


def test_cli_exit_codes_and_outputs(tmp_path, capsys):
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text((FIXTURES / "heavy_loop.yaml").read_text())
    assert cli.main(["migrate", str(legacy)]) == 0
    out, err = capsys.readouterr()
    assert out == (FIXTURES / "heavy_loop.canonical.yaml").read_text()
    assert "changed: M1: workflow[0].step=start.tool.args.item_count" in err
    assert cli.main(["migrate", "--check", str(legacy)]) == 1
    assert "would change" in capsys.readouterr().out
    assert cli.main(["migrate", "--diff", str(legacy)]) == 0
    assert "+        item_count: \"{{ workload.item_count }}\"" in capsys.readouterr().out
    assert cli.main(["migrate", "--write", str(legacy)]) == 0
    capsys.readouterr()
    assert legacy.read_text() == (FIXTURES / "heavy_loop.canonical.yaml").read_text()
    assert cli.main(["migrate", "--check", str(legacy)]) == 0  # idempotent
    assert cli.main(["migrate", "--check", str(FIXTURES / "needs_person.yaml")]) == 3
    assert "needs a person: M5: workflow[1].step=inspect.tool.script" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("just: a mapping\n")
    assert cli.main(["migrate", str(bad)]) == 2
    bad.write_text("a: [\n")
    assert cli.main(["migrate", str(bad), str(legacy)]) == 2
    assert cli.main(["migrate", "--check", *map(str, sorted((ROOT / "examples").glob("*.yaml")))]) == 0


def test_noetl_migrate_inlines_a_script_file_next_to_the_playbook(capsys):
    """The command line gives migrate the file it read: a python task's `script:` naming a file in the
    playbook's folder is inlined (from stdin nothing is read, and the task needs a person)."""
    fixture = Path(__file__).parents[1] / "fixtures" / "migrate" / "step_input_script.yaml"
    assert cli.main(["migrate", str(fixture)]) == 0
    out = capsys.readouterr().out
    assert out == fixture.with_name("step_input_script.canonical.yaml").read_text()
    assert "def main(readings, unit):" in out and "peak = max(readings)" in out  # the file's code, inlined


def test_a_legacy_nats_task_names_its_object_with_key_and_drops_ttl():
    m, doc = mig("""
    keychain:
      - {name: bus, kind: credential}
    workflow:
      - step: start
        tool:
          kind: nats
          auth: bus
          operation: object_get
          bucket: files
          name: report.pdf
        next: [{step: labelled}]
      - step: labelled
        tool:
          - fetch:
              kind: nats
              auth: bus
              operation: object_put
              bucket: files
              name: copy.pdf
              data: "{{ start.result.data }}"
          - remember:
              kind: nats
              auth: bus
              operation: kv_put
              bucket: seen
              key: report
              value: 1
              ttl: 3600
    """)
    start, labelled = doc["workflow"][0]["tool"], doc["workflow"][1]["tool"]
    assert start["key"] == "report.pdf" and "name" not in start
    assert labelled[0]["name"] == "fetch" and labelled[0]["key"] == "copy.pdf"
    assert labelled[1]["name"] == "remember" and "ttl" not in labelled[1]
    assert {("M6", "workflow[0].step=start.tool.name"), ("M6", "workflow[1].step=labelled.tool[1].ttl")} <= {
        (c.rule, c.location) for c in m.changes}
    assert m.complete and validate_text(m.text).ok


def test_artifact_get_becomes_the_steps_result_and_other_artifact_actions_need_a_person():
    legacy = """apiVersion: noetl.io/v1
kind: Playbook
metadata: {name: a, path: a}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'n': 1}"}
    next: [{step: load}]
  - step: load
    tool:
      - name: fetch
        kind: artifact
        action: get
        input: {result_ref: "{{ start._ref }}"}
      - name: keep
        kind: artifact
        action: put
        input: {data: "{{ fetch }}"}
"""
    m = migrate_text(legacy)
    assert "      - name: fetch\n        kind: noop\n        result: '{{ start.result }}'\n" in m.text
    [problem] = m.problems
    assert "artifact" in str(problem) and "action 'put'" in str(problem) and "tool[1].kind" in str(problem)
