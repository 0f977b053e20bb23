"""noetl migrate, pagination by retry (docs/migrate.md, M6; lang/migrate/paginate.py): each rule on a
legacy step written for it, before and after; what the translation is unsure of needs a person, with
the place and the reason; a migrated playbook validates and migrates to itself. The migrated fixtures
run on the real tools in tests/integration/test_migrate_run.py."""
from __future__ import annotations

import textwrap

import pytest
import yaml

from noetl_mesh.lang.migrate import migrate_text
from noetl_mesh.lang.validate import validate_text

HEAD = "apiVersion: noetl.io/v1\nkind: Playbook\nmetadata: {name: t, path: t}\n"
WORKLOAD = "workload:\n  api_url: http://127.0.0.1:8765\n  table: cities\n"


def mig(steps: str, workload: str = WORKLOAD):
    m = migrate_text(HEAD + workload + "workflow:\n" + textwrap.indent(textwrap.dedent(steps), "  "))
    return m, yaml.safe_load(m.text)


def tasks(doc, step: int = 0) -> dict:
    return {t["name"]: t for t in doc["workflow"][step]["tool"]}


def rules(task) -> list:
    return task["spec"]["policy"]["rules"]


def test_page_numbers_by_retry_become_a_pipeline_that_jumps_back_while_there_are_more():
    m, doc = mig("""
        - step: fetch
          tool: http
          url: "{{ api_url }}/assessments"
          params: {page: 1, pageSize: 10}
          retry:
            on_success:
              while: "{{ response.paging.hasMore == true }}"
              max_attempts: 10
              next_call:
                params:
                  page: "{{ (response.paging.page | int) + 1 }}"
              collect: {strategy: append, path: data, into: pages}
        """)
    assert m.complete, [str(p) for p in m.problems]
    t = tasks(doc)
    assert list(t) == ["fetch_page_init", "fetch_page", "fetch_page_collect"]
    assert rules(t["fetch_page_init"]) == [{"else": {"then": {"do": "continue",
                                                               "set_iter": {"pages": [], "calls": 0, "page": 1}}}}]
    page = t["fetch_page"]
    assert page["params"] == {"page": "{{ iter.page }}", "pageSize": 10}  # only what the next call changes moves
    fail, more, last = rules(page)
    assert fail == {"when": "{{ outcome.status == 'error' }}", "then": {"do": "fail"}}
    # the legacy 'response' of on_success was the body: canonically outcome.result of the http task
    assert more["when"] == "{{ iter.calls + 1 < 10 and outcome.result.paging.hasMore == true }}"
    assert more["then"]["do"] == "jump" and more["then"]["to"] == "fetch_page"
    assert more["then"]["set_iter"]["page"] == "{{ outcome.result.paging.page | int + 1 }}"
    assert more["then"]["set_iter"]["calls"] == "{{ iter.calls + 1 }}"
    append = ("{{ iter.pages + (outcome.result.data if outcome.result.data is sequence and outcome.result.data is "
              "not string and outcome.result.data is not mapping else [outcome.result.data]) }}")
    assert more["then"]["set_iter"]["pages"] == append
    assert last == {"else": {"then": {"do": "continue", "set_iter": {"pages": append, "calls": "{{ iter.calls + 1 }}"}}}}
    assert t["fetch_page_collect"] == {"name": "fetch_page_collect", "kind": "noop", "result": {
        "status": "success", "data": "{{ iter.pages }}", "meta": {"iterations": "{{ iter.calls }}"}}}
    assert validate_text(m.text).ok
    again = migrate_text(m.text)
    assert not again.changed and not again.problems


def test_a_cursor_the_first_call_does_not_send_starts_null():
    m, doc = mig("""
        - step: events
          tool:
            kind: http
            url: "{{ api_url }}/events"
            params: {limit: 10}
            retry:
              on_success:
                while: "{{ response.next_cursor is not none }}"
                next_call: {params: {cursor: "{{ response.next_cursor }}"}}
                collect: {path: events, into: events}
        """)
    assert m.complete, [str(p) for p in m.problems]
    t = tasks(doc)
    init = rules(t["events_page_init"])[0]["else"]["then"]["set_iter"]
    assert init == {"events": [], "calls": 0, "cursor": None}  # a null param is not sent (docs/tools.md)
    assert t["events_page"]["params"] == {"limit": 10, "cursor": "{{ iter.cursor }}"}
    assert rules(t["events_page"])[1]["when"] == "{{ iter.calls + 1 < 100 and outcome.result.next_cursor is not none }}"


def test_on_error_becomes_the_first_rule_with_the_legacy_defaults():
    m, doc = mig("""
        - step: fetch
          tool: http
          url: "{{ api_url }}/assessments"
          retry:
            on_error: {when: "{{ error.status in [500, 503] }}", initial_delay: 0.5}
            on_success: {while: "{{ response.more }}"}
        """)
    assert m.complete, [str(p) for p in m.problems]
    first = rules(tasks(doc)["fetch_page"])[0]
    # the legacy runtime asked on_error's condition only of a call that failed
    assert first == {"when": "{{ outcome.status == 'error' and outcome.http.status in [500, 503] }}",
                     "then": {"do": "retry", "attempts": 3, "backoff": "exponential", "delay": 0.5, "jitter": True}}


def test_an_on_error_condition_true_of_a_successful_call_does_not_retry_it():
    from noetl_mesh.lang.templates import truthy

    m, doc = mig("""
        - step: fetch
          tool: http
          url: "{{ api_url }}/assessments"
          retry:
            on_error: {when: "{{ error.status != 404 }}"}
            on_success: {while: "{{ response.more }}"}
        """)
    when = rules(tasks(doc)["fetch_page"])[0]["when"]
    ok = {"outcome": {"status": "ok", "result": {"more": False}, "error": None, "http": {"status": 200}}}
    failed = {"outcome": {"status": "error", "result": None, "error": {"kind": "http_error"}, "http": {"status": 503}}}
    assert truthy(when, ok) is False  # was 'outcome.http.status != 404': true, the page called again
    assert truthy(when, failed) is True


def test_on_error_without_the_defaults_keeps_what_it_says():
    m, doc = mig("""
        - step: fetch
          tool: http
          url: "{{ api_url }}/assessments"
          retry:
            on_error: {retry_when: "{{ status_code >= 500 }}", max_attempts: 2, backoff_multiplier: 1,
                       jitter: false, max_delay: 5}
            on_success: {while: "{{ response.more }}"}
        """)
    assert m.complete, [str(p) for p in m.problems]
    assert rules(tasks(doc)["fetch_page"])[0] == {
        "when": "{{ outcome.status == 'error' and outcome.http.status >= 500 }}",
        "then": {"do": "retry", "attempts": 2, "backoff": "none", "delay": 1.0, "max_delay": 5}}


def test_a_cursor_loop_over_a_table_reads_the_rows_so_far_and_the_call_number_from_iter():
    m, doc = mig("""
        - step: read
          tool:
            name: batch
            kind: postgres
            auth: pg
            command: "SELECT id FROM {{ table }} WHERE id > {{ rows[-1].id if rows else 0 }} LIMIT 2 -- {{ _retry.index }}"
            retry:
              on_success:
                while: "{{ response.command_0.rows | length > 0 }}"
                collect: {path: command_0.rows, into: rows}
        - step: end
          tool: python
          args: {ids: "{{ read.data }}"}
          code: "result = [r['id'] for r in ids]"
        """)
    assert m.complete, [str(p) for p in m.problems]
    t = tasks(doc)
    assert list(t) == ["batch_init", "batch", "batch_collect"]
    assert t["batch"]["command"] == ("SELECT id FROM {{ workload.table }} WHERE id > {{ iter.rows[-1].id if iter.rows "
                                     "else 0 }} LIMIT 2 -- {{ iter.calls + 1 }}")
    assert rules(t["batch"])[1]["when"] == "{{ iter.calls + 1 < 100 and outcome.result.rows | length > 0 }}"
    assert doc["workflow"][1]["tool"]["args"] == {"ids": "{{ read.result.data }}"}  # the pages, as before
    assert any("(the pages so far, the call's number)" in f.message for f in m.changes)


def test_replace_keeps_the_last_page_only():
    m, doc = mig("""
        - step: poll
          tool: http
          url: "{{ api_url }}/job"
          retry:
            on_success:
              while: "{{ response.state != 'done' and iteration < 5 }}"
              collect: {strategy: replace}
        """)
    assert m.complete, [str(p) for p in m.problems]
    page = tasks(doc)["poll_page"]
    more = rules(page)[1]
    assert more["when"] == "{{ iter.calls + 1 < 100 and (outcome.result.state != 'done' and iter.calls + 1 < 5) }}"
    assert more["then"]["set_iter"]["pages"] == "{{ outcome.result }}"
    assert rules(tasks(doc)["poll_page_init"])[0]["else"]["then"]["set_iter"] == {"pages": None, "calls": 0}


def test_inside_a_loop_each_iteration_pages_on_its_own():
    m, doc = mig("""
        - step: each
          loop: {collection: "{{ paths }}", element: path}
          tool:
            kind: http
            url: "{{ api_url }}{{ path }}"
            retry:
              on_success: {while: "{{ response.more }}", next_call: {params: {after: "{{ response.last }}"}}}
        """, workload="workload:\n  api_url: http://x\n  paths: [/a, /b]\n")
    assert m.complete, [str(p) for p in m.problems]
    assert doc["workflow"][0]["loop"] == {"in": "{{ workload.paths }}", "iterator": "path"}
    assert tasks(doc)["each_page"]["url"] == "{{ workload.api_url }}{{ iter.path }}"


STEP = """
- step: fetch
  tool:
    kind: {kind}
    url: http://127.0.0.1:8765/x
    command: SELECT 1
    retry:
      on_success:
{on_success}
"""


@pytest.mark.parametrize("kind,on_success,where,says", [
    ("http", "per_iteration: {sink: {table: t}}", "retry.on_success.per_iteration", "has no translation"),
    ("http", "collect: {strategy: merge}", "retry.on_success.collect.strategy", "append and replace do"),
    ("http", "next_call: {headers: {x: '1'}}", "retry.on_success.next_call", "headers, url and body"),
    ("http", "max_attempts: '{{ n }}'", "retry.on_success.max_attempts", "a number of calls"),
    ("http", "while: 'more: {{ response.more }}'", "retry.on_success.while", "not one '{{ expression }}'"),
    ("http", "next_call: {params: {index: 2}}", "retry.on_success.next_call.params.index", "not a free name"),
    ("http", "while: '{{ pages | length < 3 }}'", "retry.on_success.while", "'pages' read here has no translation"),
    ("http", "while: '{{ _retry.count2 }}'", "retry.on_success.while", "_retry' read other than"),
    ("duckdb", "collect: {path: rows}", "retry.on_success", "duckdb result's keys"),
    ("python", "collect: {path: rows}", "retry.on_success", "only an http or postgres"),
    ("postgres", "next_call: {params: {x: 1}}", "retry.on_success.next_call", "let the next query read"),
])
def test_what_the_translation_is_unsure_of_needs_a_person_where_it_is(kind, on_success, where, says):
    body = on_success if "while" in on_success else on_success + "\n while: '{{ response.more }}'"
    body = textwrap.indent(body.replace("\n ", "\n"), " " * 8)
    step = STEP.replace("{kind}", kind).replace("{on_success}", body)
    if kind != "http":
        step = step.replace("    url: http://127.0.0.1:8765/x\n", "")
    if kind not in ("postgres", "duckdb"):
        step = step.replace("    command: SELECT 1\n", "")
    m, doc = mig(step)
    found = [p for p in m.problems if p.rule == "M6" and p.location == f"workflow[0].step=fetch.tool.{where}"]
    assert found and says in found[0].message, [str(p) for p in m.problems]
    assert "docs/migrate.md, M6" in found[0].message
    assert doc["workflow"][0]["tool"]["retry"]["on_success"]  # left as it was written
    assert migrate_text(m.text).text == m.text


@pytest.mark.parametrize("extra,where,says", [
    ("on_error: {when: '{{ error.type == 1 }}'}", "retry.on_error.when", "only error.status and error.message"),
    ("on_error: {backoff_multiplier: 3}", "retry.on_error.backoff_multiplier", "by 1 (none) or 2"),
    ("on_error: {max_attempts: 2, codes: [500]}", "retry.on_error.codes", "'on_error.codes' has no translation"),
    ("on_error: {delay: 2}", "retry.on_error.delay", "'on_error.delay' has no translation"),  # the legacy ignored it
])
def test_unsure_of_on_error_leaves_the_task_as_it_was(extra, where, says):
    m, doc = mig(f"""
        - step: fetch
          tool:
            kind: http
            url: "http://x/{{{{ pages }}}}"
            retry:
              {extra}
              on_success: {{while: "{{{{ response.more }}}}"}}
        """)
    found = [p for p in m.problems if p.location == f"workflow[0].step=fetch.tool.{where}"]
    assert found and says in found[0].message, [str(p) for p in m.problems]
    assert doc["workflow"][0]["tool"]["url"] == "http://x/{{ pages }}"  # nothing half rewritten
    assert "name" not in doc["workflow"][0]["tool"]


def test_a_task_with_a_policy_of_its_own_needs_a_person():
    m, _ = mig("""
        - step: fetch
          tool:
            kind: http
            url: http://x
            eval: [{expr: "{{ true }}", do: fail}]
            retry: {on_success: {while: "{{ response.more }}"}}
        """)
    found = [p for p in m.problems if p.location == "workflow[0].step=fetch.tool.retry.on_success"]
    assert found and "a policy of its own" in found[0].message


def test_a_first_param_value_reading_the_call_number_and_also_replaced_needs_a_person():
    m, _ = mig("""
        - step: fetch
          tool:
            kind: http
            url: http://x
            params: {page: "{{ _retry.index }}"}
            retry:
              on_success: {while: "{{ response.more }}", next_call: {params: {page: "{{ response.next }}"}}}
        """)
    assert [(p.rule, p.location) for p in m.problems][:1] == [("M6", "workflow[0].step=fetch.tool.params.page")]


def test_a_loop_iterator_named_like_the_pages_needs_a_person():
    m, _ = mig("""
        - step: each
          loop: {in: "{{ workload.xs }}", iterator: pages}
          tool:
            kind: http
            url: http://x
            retry: {on_success: {while: "{{ response.more }}"}}
        """, workload="workload:\n  xs: [1]\n")
    assert any(p.location == "workflow[0].step=each.tool.retry.on_success.collect" for p in m.problems)


def test_a_paging_retry_in_a_pipeline_of_several_tasks_still_needs_a_person():
    m, _ = mig("""
        - step: fetch
          tool:
            - name: a
              kind: http
              url: http://x
              retry: {on_success: {while: "{{ response.more }}"}}
            - {name: b, kind: noop}
        """)
    assert ("M6", "workflow[0].step=fetch.tool[0].retry.on_success") in {(p.rule, p.location) for p in m.problems}


def test_the_step_s_retry_pages_its_only_task():
    m, doc = mig("""
        - step: fetch
          tool: {kind: http, url: http://x}
          retry: {on_success: {while: "{{ response.more }}"}}
        """)
    assert m.complete and "retry" not in doc["workflow"][0]
    assert [t["name"] for t in doc["workflow"][0]["tool"]] == ["fetch_page_init", "fetch_page", "fetch_page_collect"]


def test_a_bare_on_error_keeps_its_attempts_and_its_condition():
    # the legacy runtime retried a failed call by 'on_error' alone too; its max_attempts and when were lost
    m, doc = mig("""
        - step: fetch
          tool:
            kind: http
            url: http://x
            retry:
              on_error: {when: "{{ error.status == 503 }}", max_attempts: 5, initial_delay: 0.2}
        """)
    assert m.complete, [str(p) for p in m.problems]
    tool = doc["workflow"][0]["tool"]
    assert "retry" not in tool and "name" not in tool  # no pipeline: nothing pages
    assert rules(tool) == [{"when": "{{ outcome.status == 'error' and outcome.http.status == 503 }}",
                            "then": {"do": "retry", "attempts": 5, "backoff": "exponential", "delay": 0.2,
                                     "jitter": True}}]
    assert any(f.location == "workflow[0].step=fetch.tool.retry" and "attempts 5" in f.message for f in m.changes)
    assert validate_text(m.text).ok
    again = migrate_text(m.text)
    assert not again.changed and not again.problems


@pytest.mark.parametrize("retry,where,says", [
    ("{on_error: {max_attempts: 2}, max_attempts: 4}", "retry.max_attempts", "next to 'on_error'"),
    ("{on_error: {delay: 2}}", "retry.on_error.delay", "'on_error.delay' has no translation"),
    ("{on_error: 3}", "retry.on_error", "'on_error' must be a mapping"),
])
def test_a_bare_on_error_the_translation_is_unsure_of_stays_with_the_reason(retry, where, says):
    m, doc = mig(f"""
        - step: fetch
          tool: {{kind: http, url: "http://x", retry: {retry}}}
        """)
    found = [p for p in m.problems if p.rule == "M6" and p.location == f"workflow[0].step=fetch.tool.{where}"]
    assert found and says in found[0].message, [str(p) for p in m.problems]
    assert "retry" in doc["workflow"][0]["tool"] and "spec" not in doc["workflow"][0]["tool"]


def test_the_report_shows_only_spellings_the_user_wrote():
    from pathlib import Path

    path = Path(__file__).parents[1] / "fixtures" / "migrate" / "paginate_by_retry.yaml"
    m = migrate_text(path.read_text(), source=path)
    # the paging rules read the body as outcome.result at once: no in-between 'response.data.data...' line
    assert not [str(f) for f in m.changes if "response.data" in f.message]
    assert not [str(f) for f in m.changes if ".spec.policy" in f.location and f.rule in ("M1", "M7")]


def test_the_paging_rules_read_the_body_canonically_and_still_translate_bare_names():
    m, doc = mig("""
        - step: fetch
          tool: http
          url: "{{ api_url }}/assessments"
          retry:
            on_success:
              while: "{{ response.data.page < last_page }}"
              next_call: {params: {page: "{{ response.data.page + 1 }}"}}
        """, workload=WORKLOAD + "  last_page: 3\n")
    assert m.complete, [str(p) for p in m.problems]
    more = rules(tasks(doc)["fetch_page"])[1]
    # outcome.result.data is the body's 'data' here: M7 would have read it as a legacy result's
    assert more["when"] == "{{ iter.calls + 1 < 100 and outcome.result.data.page < workload.last_page }}"
    assert more["then"]["set_iter"]["page"] == "{{ outcome.result.data.page + 1 }}"
    assert [f.message for f in m.changes if f.rule == "M1" and ".spec.policy" in f.location] == [
        "{{ iter.calls + 1 < 100 and outcome.result.data.page < last_page }} -> "
        "{{ iter.calls + 1 < 100 and outcome.result.data.page < workload.last_page }}"]
