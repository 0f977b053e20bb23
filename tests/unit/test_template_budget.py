"""The template budget (D7): each render has template_max_ms of time and may build template_max_output
characters or items; going over is a TemplateError naming the limit. Every known way to make Jinja
spin or allocate, with the exact input, is refused quickly and without building the big value."""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc

import pytest
import yaml

from noetl_mesh import limits
from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.lang import templates as T
from noetl_mesh.lang.templates import TemplateError, check_syntax, evaluate, referenced_names, render, shared_budget, truthy
from noetl_mesh.tools.noop import NoopTool

GENEROUS_S = 10.0  # CPU seconds of the rendering thread: an attack is refused within this (normally milliseconds,
# or just over template_max_ms); CPU time, not wall-clock time, so another process's load does not count
MAX_MS = 200
MAX_OUTPUT = 100_000
SMALL_PEAK = 8_000_000  # bytes; every attack below would allocate a gigabyte or loop for hours


@pytest.fixture(autouse=True)
def small_budget():
    with limits.override(template_max_ms=MAX_MS, template_max_output=MAX_OUTPUT):
        yield


def attempt(source, fn=render, context=None):
    """Render; (result, TemplateError or None, seconds, peak bytes allocated)."""
    tracemalloc.start()
    t0 = time.thread_time()
    try:
        out, err = fn(source, context or {}, "w"), None
    except TemplateError as e:
        out, err = None, e
    elapsed = time.thread_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, err, elapsed, peak


def refused(source, limit, fn=render, context=None, or_limit=None):
    """The render fails with ``limit`` (or ``or_limit``: which comes first depends on the machine)."""
    out, err, elapsed, peak = attempt(source, fn, context)
    assert err is not None, f"rendered: {str(out)[:100]!r}"
    assert any(name in err.reason and f"NOETL_LIMIT_{name.upper()}" in err.reason
               for name in (limit, or_limit) if name), err.reason
    assert err.where == "w" and err.template == source
    assert elapsed < GENEROUS_S, elapsed
    assert peak < SMALL_PEAK, peak
    return err


# ------------------------------------------------------------------------------------------ time

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
NESTED_NATIVE = "{{ range(100000) | map('string') | select('in', range(100000) | map('string') | join) | list | length }}"
TIME_ATTACKS = {
    "nested range loops (text)": NESTED_LOOPS,
    "nested range loops writing": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "nested range loops (native)": NESTED_NATIVE,
    "loop filter that rejects all": "{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}{% endfor %}{% endfor %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "exponential recursive loop": "{% for a in [1] recursive %}{% if loop.depth < 40 %}{{ loop([1, 1]) }}{% endif %}{% endfor %}",
    "exponential caller": "{% macro m(n) %}{% if n %}{% call m(n - 1) %}{{ caller() }}{% endcall %}"
                          "{% call m(n - 1) %}{% endcall %}{% endif %}{% endmacro %}{% call m(40) %}{% endcall %}",
    "select over a big input": "{% for i in range(100000) %}{{ range(100000) | select('odd') | sum }}{% endfor %}",
    "map over a big input": "{% for i in range(100000) %}{{ range(100000) | map('abs') | sum }}{% endfor %}",
    "sort by attribute": "{% for i in range(100000) %}{{ range(50000) | sort(attribute='real') | first }}{% endfor %}",
}


@pytest.mark.parametrize("source", TIME_ATTACKS.values(), ids=TIME_ATTACKS.keys())
def test_time_attacks_end_at_the_time_budget(source):
    err = refused(source, "template_max_ms")
    assert err.reason.startswith("the time one template render takes is ")
    assert f"over the limit template_max_ms = {MAX_MS} ms" in err.reason


@pytest.mark.parametrize("fn", [render, truthy, evaluate], ids=["render", "truthy", "evaluate"])
def test_time_budget_through_every_entry_point(fn):
    refused(NESTED_LOOPS, "template_max_ms", fn=fn)
    refused("range(100000) | map('string') | select('in', range(100000) | map('string') | join) | list",
            "template_max_ms", fn=evaluate)


def test_recursive_macro_is_a_template_error():
    _, err, elapsed, _ = attempt("{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    assert err is not None and ("RecursionError" in err.reason or "template_max_ms" in err.reason)
    assert elapsed < GENEROUS_S


def test_the_thread_is_clean_after_a_timeout():
    refused(NESTED_LOOPS, "template_max_ms")
    # no exception left pending for this thread: plain Python code runs on undisturbed
    deadline = time.monotonic() + 3 * MAX_MS / 1000
    n = 0
    while time.monotonic() < deadline:
        n += 1
    assert n > 0
    assert render("{{ 1 + 1 }}", {}) == 2


def test_renders_that_end_just_around_the_limit_never_leak_the_watchdog():
    """Renders that finish right when the watchdog fires: each one returns or raises TemplateError, and
    nothing arrives after it returned (the exit protocol of the watchdog)."""
    escaped = []
    with limits.override(template_max_ms=3):
        for n in range(300):
            try:
                render("{% for i in range(" + str(2000 + n * 20) + ") %}{% endfor %}", {})
            except TemplateError:
                pass
            except BaseException as e:  # noqa: BLE001 - exactly what must never happen
                escaped.append(e)
        try:
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                pass
        except BaseException as e:  # noqa: BLE001
            escaped.append(e)
    assert escaped == []


def test_a_slow_render_in_one_thread_leaves_another_thread_alone():
    results, errors = [], []

    def small():
        for _ in range(200):
            results.append(render("{{ workload.n + 1 }}", {"workload": {"n": 1}}))

    def bomb():
        try:
            render(NESTED_LOOPS, {}, "bomb")
        except TemplateError as e:
            errors.append(e)

    threads = [threading.Thread(target=bomb), threading.Thread(target=small), threading.Thread(target=bomb)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GENEROUS_S)
    assert not any(t.is_alive() for t in threads)
    assert results == [2] * 200
    assert len(errors) == 2 and all("template_max_ms" in e.reason and e.where == "bomb" for e in errors)


# ------------------------------------------------------------------------------------------ size

SIZE_ATTACKS = {
    "% width": "{{ '%0999999999d' % 1 }}",
    "% precision": "{{ '%.999999999f' % 1.0 }}",
    "% * width": "{{ '%*d' % (999999999, 1) }}",
    "% mapping key": "{{ '%(a)0999999999d' % {'a': 1} }}",
    "% nested key": "{{ '%(a(b)s)0999999999d' % {'a(b)s': 1} }}",
    "% of bytes, bytes key": "{{ '%(a)0999999999d'.encode() % {'a'.encode(): 1} }}",
    "% * width and precision": "{{ '%*.*f' % (5, 999999999, 1.0) }}",
    "% of a big list": "{% set s = 'x' * 50000 %}{{ '%s' % ([[s] * 1000]) }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "format nested width": "{{ '{0:{1}}'.format(1, 999999999) }}",
    "format !r width": "{{ '{!r:>999999999}'.format(1) }}",
    "format repeated field": "{% set s = 'x' * 50000 %}{{ ('{0}' * 1000).format(s) }}",
    "format_map": "{{ '{a:>999999999}'.format_map({'a': 1}) }}",
    "center filter": "{{ 'x'|center(999999999) }}",
    "indent filter": "{{ 'x'|indent(999999999) }}",
    "indent filter, many lines": "{{ ('\\n' * 50000) | indent(100, blank=true) }}",
    "indent of a number": "{{ 44 | indent(999999999) }}",
    "indent of a number, found by the property test": "{{ [(100000 ~ -1), (44 | indent(999999999))[1:]] }}",
    "format of a list": "{{ ['%0999999999d'] | format(1) }}",
    "urlize of a list": "{{ ['a.b ' * 10] | urlize(target='t' * 90000) }}",
    "format filter * width": "{{ '%*d'|format(999999999, 1) }}",
    "format filter width": "{{ '%0999999999d'|format(1) }}",
    "namespace ~ doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "namespace + doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list + doubling": "{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "[s]*N|join": "{% set s = 'x' * 1000 %}{{ ([s] * 100000) | join }}",
    "join separator": "{{ (['x'] * 50000) | join('y' * 1000) }}",
    "join of big lists": "{% set s = ['x' * 1000] * 90 %}{{ ([s] * 90) | join }}",
    "* on strings": "{{ 'x' * 999999999 }}",
    "* on lists": "{{ [1, 2] * 999999999 }}",
    "replace with an empty pattern": "{{ 'abc' | replace('', 'x' * 90000) }}",
    "replace growing": "{{ ('x' * 90000) | replace('x', 'yy') }}",
    "wordwrap separator": "{{ ('x' * 1000) | wordwrap(1, wrapstring='y' * 1000) }}",
    "truncate end": "{{ ('x' * 90000) | truncate(10, end='y' * 90000) }}",
    "batch fill": "{{ [0] | batch(999999999, 'x') | list }}",
    "slice count": "{{ [0] | slice(999999999) | list }}",
    "sum over lists": "{{ ([[0] * 1000] * 1000) | sum(start=[]) }}",
    "list of a big string": "{{ ('x' * 90000) | list | list }}",
    "string of a big list": "{% set s = 'x' * 1000 %}{{ ([s] * 1000) | string }}",
    "tojson": "{% set s = 'x' * 1000 %}{{ ([s] * 1000) | tojson }}",
    "tojson indent": "{{ [[[[1]]]] | tojson(indent=999999999) }}",
    "to_json": "{% set s = 'x' * 1000 %}{{ ([s] * 1000) | to_json }}",
    "pprint": "{% set s = 'x' * 1000 %}{{ ([s] * 1000) | pprint }}",
    "escape": "{{ ('<' * 50000) | e }}",
    "urlencode": "{{ ('é' * 20000) | urlencode }}",
    "urlize target": "{{ ('a.b ' * 1000) | urlize(target='t' * 1000) }}",
    "xmlattr": "{% set s = '<' * 30000 %}{{ {'a': s} | xmlattr }}",
    "title": "{{ ('ß' * 60000) | title | length }}",
    "map center": "{{ range(100000) | map('center', 1000) | list | length }}",
    "text of a big list": "x{% set s = 'x' * 1000 %}{{ [s] * 1000 }}",
    "~ of a big list": "{% set s = 'x' * 1000 %}{{ 'x' ~ [s] * 1000 }}",
    "str.center": "{{ 'x'.center(999999999) }}",
    "str.ljust": "{{ 'x'.ljust(999999999) }}",
    "str.rjust": "{{ 'x'.rjust(999999999, '*') }}",
    "str.zfill": "{{ '1'.zfill(999999999) }}",
    "str.expandtabs": "{{ ('\\t' * 1000).expandtabs(999999999) }}",
    "str.replace": "{{ 'abc'.replace('', 'x' * 90000) }}",
    "str.join": "{{ 'y'.join(['x' * 50000] * 100) }}",
    "str.join separator": "{{ ('y' * 100000).join(['x'] * 1000) }}",
    "str.translate": "{{ ('x' * 1000).translate({120: 'y' * 1000}) }}",
    "Markup.center": "{{ ('x' | tojson).center(999999999) }}",
    "bytes.center": "{{ 'x'.encode().center(999999999) }}",
    "int.to_bytes": "{{ (1).to_bytes(999999999, 'big') }}",
}


@pytest.mark.parametrize("source", SIZE_ATTACKS.values(), ids=SIZE_ATTACKS.keys())
def test_size_attacks_are_refused_before_building(source):
    refused(source, "template_max_output")


LOOP_SIZE_ATTACKS = {
    "constant text in loops": "{% for i in range(100000) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}",
    "macro output": "{% macro m() %}{% for i in range(100000) %}xxxxxxxxxx{% endfor %}{% endmacro %}{{ m() }}",
    "slices written in a loop": "{% set s = 'x' * 10000 %}{% for i in range(100000) %}{{ s[1:] }}{% endfor %}",
    "numbers written in a loop": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "a context string written in a loop": "{% for i in range(100000) %}{{ text }}{% endfor %}",
}


@pytest.mark.parametrize("source", LOOP_SIZE_ATTACKS.values(), ids=LOOP_SIZE_ATTACKS.keys())
def test_output_piling_up_in_loops_is_bounded(source):
    refused(source, "template_max_output", context={"text": "x" * 10_000}, or_limit="template_max_ms")


@pytest.mark.parametrize("source", ["{{ dict(d) }}", "{{ d.copy() }}", "{{ d.items() | list }}", "{{ d | dictsort }}"])
def test_copies_of_context_values_count(source):
    d = {str(i): i for i in range(1001)}
    with limits.override(template_max_output=1000):
        _, err, _, _ = attempt(source, context={"d": d})
    assert err is not None and "template_max_output" in err.reason


@pytest.mark.parametrize("source", ["{{ text | urlize | length }}", "{{ text | striptags | length }}",
                                    "{{ text | wordwrap(3) | length }}", "{{ text | title | length }}",
                                    "{{ text | filesizeformat }}", "{{ text | wordcount }}", "{{ text | indent | length }}"])
def test_filters_on_a_big_input_end_in_time(source):
    """Library code the hooks do not reach is stopped by the watchdog; sizes are checked when known."""
    text = "a <b>c</b> d.e http://x.y " * (MAX_OUTPUT // 25)
    _, err, elapsed, _ = attempt(source, context={"text": text})
    assert err is None or "template_max" in err.reason or err.reason.startswith("ValueError"), err.reason
    assert elapsed < GENEROUS_S


INT_ATTACKS = {
    "power": "{{ 7 ** 100000 }}",
    "power of a power": "{{ (2 ** 1000) ** 100000 }}",
    "squaring in a loop": "{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "product in a loop": "{% set ns = namespace(x=1) %}{% for i in range(1, 100000) %}{% set ns.x = ns.x * i %}{% endfor %}",
    "doubling in a loop": "{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = ns.x + ns.x %}{% endfor %}",
    "subtracting in a loop": "{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = ns.x - (0 - ns.x) %}{% endfor %}",
    "sum": "{% set b = 10 ** 29 %}{{ ([b] * 20) | sum }}",
}


@pytest.mark.parametrize("source", INT_ATTACKS.values(), ids=INT_ATTACKS.keys())
def test_big_integers_are_refused(source):
    with limits.override(template_max_int_digits=30):
        err = refused(source, "template_max_int_digits")
    assert "an integer this template builds" in err.reason


def test_the_literal_list_join_form_is_a_plain_error():
    # `[s]*N|join` parses as `[s] * (N|join)`: a TypeError, not a budget matter.
    _, err, elapsed, peak = attempt("{% set s = 'x' * 1000 %}{{ [s]*100000|join }}")
    assert err is not None and err.reason.startswith("TypeError:")
    assert elapsed < GENEROUS_S and peak < SMALL_PEAK


def test_error_message_names_the_limit_and_how_to_change_it():
    err = refused("{{ 'x'|center(999999999) }}", "template_max_output")
    assert err.reason == (
        "what this template builds (at |center) is 999,999,999 characters or items, over the limit "
        f"template_max_output = {MAX_OUTPUT:,} characters or items (set NOETL_LIMIT_TEMPLATE_MAX_OUTPUT to change it)")
    assert str(err).startswith("w: what this template builds (at |center)")


def test_raising_the_limit_lets_a_big_value_through():
    source = "{{ 'x' | center(150000) | length }}"
    refused(source, "template_max_output")
    with limits.override(template_max_output=200_000):
        assert render(source, {}) == 150000


# ------------------------------------------------------------------------- what counts, per call

def test_legitimate_templates_fit_easily():
    ctx = {"rows": [{"id": i, "email": f"u{i}@example.com"} for i in range(1000)], "n": 3}
    assert render("{{ rows | map(attribute='email') | join(',') | length }}", ctx) > 10_000
    assert len(render("{% for r in rows %}{{ r.id }}:{{ r.email }}\n{% endfor %}", ctx)) > 10_000
    assert render("{{ rows | tojson | from_json | length }}", ctx) == 1000
    assert render("{{ '%05d-%s' % (n, 'x') }}", ctx) == "00003-x"
    assert render("{{ '{:>6}|{:.2f}'.format('ab', 3.14159) }}", ctx) == "    ab|3.14"
    assert render("{{ 2 ** 64 * 10 ** 100 > 0 }}", ctx) is True


def test_context_values_passed_through_are_not_counted():
    big = ["x" * 1000] * 1000  # a million characters, from a previous step's result
    assert render("{{ big }}", {"big": big}) is big
    assert render("{{ big | default([]) | length }}", {"big": big}) == 1000
    refused("{{ big | join }}", "template_max_output", context={"big": big})  # joining them builds


def test_values_of_a_mapping_share_the_budget_of_the_call():
    half = "{{ 'x' * 60000 }}"
    assert len(render(half, {})) == 60000
    assert len(render(half, {})) == 60000  # each call has its own budget
    with pytest.raises(TemplateError) as ei:
        render({"a": half, "b": [half]}, {}, "task")
    assert ei.value.where == "task.b[0]" and "template_max_output" in ei.value.reason


def test_shared_budget_spreads_one_budget_over_several_calls():
    half = "{{ 'x' * 60000 }}"
    with shared_budget():
        render(half, {})
        with pytest.raises(TemplateError, match="template_max_output"):
            render(half, {})
    with shared_budget():
        render("{{ 1 }}", {})
        _burn(2 * MAX_MS / 1000)
        with pytest.raises(TemplateError, match="template_max_ms"):
            truthy("{{ true }}", {})
    assert render(half, {}) == "x" * 60000  # outside, a fresh budget per call


def _burn(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_the_time_budget_counts_cpu_not_waiting():
    """A render whose thread waits (here a context function that sleeps; on a loaded machine, for a
    core) is not charged for the wait; one that computes is."""
    wait = 2 * MAX_MS / 1000
    assert render("{{ nap() }}", {"nap": lambda: time.sleep(wait) or "rested"}) == "rested"
    with pytest.raises(TemplateError, match="template_max_ms"):
        render("{{ spin() }}", {"spin": lambda: _burn(wait)})


# ------------------------------------------------------------------------------- compile-time

@pytest.mark.parametrize("template", [
    "{{ 'x'|center(999999999) }}",
    "{{ '%0999999999d' % 1 }}",
    "a {{ 'x'|center(999999998) }} b",
    "a {{ '%0999999998d' % 1 }} b",
    "{{ 'x' * 999999997 }}",
    "{{ 'x' ~ ('y'|center(999999996)) }}",
    "{{ (2 ** 1000) ** 100001 }}",
    "{% if 'x'|indent(999999995) %}{% endif %}",
])
def test_compiling_evaluates_nothing(template, monkeypatch):
    """Validation (check_syntax at the gateway and admission) compiles; Jinja would fold constants."""
    calls = []
    for name in ("center", "indent"):
        real = T._ENV.filters[name]
        monkeypatch.setitem(T._ENV.filters, name, lambda *a, _real=real, **k: calls.append(a) or _real(*a, **k))
    tracemalloc.start()
    t0 = time.thread_time()
    assert check_syntax({"when": template}, "arc") == []
    assert referenced_names(template) == set()
    elapsed = time.thread_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert calls == []
    assert elapsed < GENEROUS_S and peak < SMALL_PEAK, (elapsed, peak)


# ------------------------------------------------------------------- through the execution core

def play(workflow):
    return {"apiVersion": "noetl.io/v2", "kind": "Playbook", "metadata": {"name": "t", "path": "t/t"},
            "workload": {}, "workflow": yaml.safe_load(workflow)}


def run(doc):
    t0 = time.process_time()  # this process's CPU time: what the budgets bound, whatever else the machine runs
    r = asyncio.run(run_local(doc, tools={"noop": NoopTool()}))
    return summary(r.state), r, time.process_time() - t0


POISONED_TASK = """
- step: start
  tool:
    - name: bomb
      kind: noop
      result: "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
      spec:
        policy:
          rules:
            - when: "{{ outcome.error.kind == 'template_error' }}"
              then: {do: jump, to: recover, set_ctx: {why: "{{ outcome.error.message }}"}}
    - name: skipped
      kind: noop
      result: never
    - name: recover
      kind: noop
      result: recovered
"""

POISONED_ARC = """
- step: start
  tool: {kind: noop, result: 1}
  next:
    arcs:
      - step: never
        when: "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
- step: never
  tool: {kind: noop}
"""

POISONED_ADMISSION = """
- step: start
  next: {arcs: [{step: gated}]}
- step: gated
  spec:
    policy:
      admit:
        rules:
          - when: "{{ '%0999999999d' % 1 }}"
            then: {allow: true}
  tool: {kind: noop, result: ran}
"""

HEALTHY = """
- step: start
  tool: {kind: noop, result: 1}
  next: {arcs: [{step: b, args: {x: "{{ event.result + 1 }}"}}]}
- step: b
  tool: {kind: noop, result: "{{ args.x * 10 }}"}
"""


def test_a_poisoned_task_fails_alone_and_its_policy_routes_it():
    s, r, elapsed = run(play(POISONED_TASK))
    assert elapsed < GENEROUS_S
    assert s["status"] == "COMPLETED"
    assert s["steps"]["start"]["result"] == "recovered"
    assert "template_max_ms" in s["ctx"]["why"] and "start.bomb.result" in s["ctx"]["why"]
    s2, _, elapsed2 = run(play(HEALTHY))  # the next execution is unaffected
    assert s2["status"] == "COMPLETED" and s2["steps"]["b"]["result"] == 20 and elapsed2 < GENEROUS_S


def test_an_arc_condition_over_budget_ends_routing_with_a_template_error():
    s, r, elapsed = run(play(POISONED_ARC))
    assert elapsed < GENEROUS_S
    assert s["status"] == "FAILED" and "never" not in s["steps"]
    evaluated = next(e for e in r.log if e["name"] == "next.evaluated")
    error = evaluated["data"]["error"]
    assert error["kind"] == "template_error" and "template_max_ms" in error["message"]
    assert "step=start.next.arcs[0].when" in error["message"]
    s2, _, _ = run(play(HEALTHY))
    assert s2["status"] == "COMPLETED"


def test_an_admission_rule_over_budget_fails_the_step_with_a_template_error():
    s, r, elapsed = run(play(POISONED_ADMISSION))
    assert elapsed < GENEROUS_S
    assert s["status"] == "FAILED" and s["steps"]["gated"]["status"] == "failed"
    assert "ran" not in str(s["steps"]["gated"].get("result"))
    failed = next(e for e in r.log if e["name"] == "step.failed")
    assert failed["data"]["error"]["kind"] == "template_error"
    assert "template_max_output" in failed["data"]["error"]["message"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_watchdog_that_ended_is_replaced_by_the_next_render():
    # Whatever ends the watchdog thread (here: the exception it raises in other threads), the next
    # render starts another one, and time is enforced again.
    render("{{ 1 }}", {})
    thread = T._wd_thread
    assert thread is not None and thread.is_alive()
    T._set_async_exc(thread.ident, SystemExit)
    thread.join(GENEROUS_S)
    assert not thread.is_alive()
    refused(NESTED_LOOPS, "template_max_ms")
    assert T._wd_thread is not None and T._wd_thread is not thread and T._wd_thread.is_alive()


SPLIT_ARCS = """
- step: start
  tool: {kind: noop, result: 1}
  next:
    spec: {mode: inclusive}
    arcs:
      - step: a
        args: {text: "{{ 'x' * 60000 }}"}
      - step: b
        args: {text: "{{ 'y' * 60000 }}"}
- step: a
  tool: {kind: noop}
- step: b
  tool: {kind: noop}
"""

SPLIT_TASK = """
- step: start
  tool:
    - {name: first, kind: http, url: "{{ 'x' * 60000 }}", body: "{{ 'y' * 60000 }}"}
"""


def test_the_arcs_of_one_routing_decision_share_one_budget():
    # Each arc alone builds 60,000 characters (under template_max_output); together they do not fit.
    s, r, _ = run(play(SPLIT_ARCS))
    assert s["status"] == "FAILED" and "a" not in s["steps"] and "b" not in s["steps"]
    error = next(e for e in r.log if e["name"] == "next.evaluated")["data"]["error"]
    assert error["kind"] == "template_error" and "template_max_output" in error["message"]
    assert "next.arcs[1]" in error["message"]


class _Recording:
    def __init__(self):
        self.calls = []

    async def run(self, task, spec, ctx):
        self.calls.append(task)
        return {"status": "ok", "result": len(str(task))}


def test_the_fields_of_one_task_share_one_budget():
    # Each field alone is under template_max_output; together they are not, and the tool is not called.
    http = _Recording()
    r = asyncio.run(run_local(play(SPLIT_TASK), tools={"noop": NoopTool(), "http": http}))
    s = summary(r.state)
    assert s["status"] == "FAILED" and http.calls == []
    failed = next(e for e in r.log if e["name"] == "step.failed")["data"]["error"]
    assert failed["kind"] == "template_error" and "template_max_output" in failed["message"]


def test_a_garbage_collection_inside_a_render_is_not_the_templates_time():
    """A full collection of a big process's heap that falls inside a render does not count against
    template_max_ms (it is the process's work, not the template's); a template's own loop still does."""
    import gc

    heap = [{"i": i} for i in range(2_000_000)]  # a big process: its full collection takes a while
    t0 = time.thread_time()
    gc.collect()
    collection_ms = (time.thread_time() - t0) * 1000
    budget = max(1, int(collection_ms / 3))  # the collection alone is three budgets long

    def collect():
        gc.collect()
        return "collected"

    with limits.override(template_max_ms=budget):
        assert render("{{ collect() }}", {"collect": collect}, "w") == "collected"
        refused(NESTED_LOOPS, "template_max_ms")
    del heap
