"""Unit tests of the template engine (D6, D7). Pure Python, no I/O."""

from __future__ import annotations

import copy

import pytest

from noetl_mesh import limits
from noetl_mesh.lang import templates as T
from noetl_mesh.lang.templates import (
    TemplateError,
    check_syntax,
    evaluate,
    is_template,
    referenced_names,
    render,
    render_text,
    truthy,
)

WHERE = "workflow[2].step=fetch.tool[0].url"


@pytest.fixture(autouse=True)
def no_time_budget():
    """What a template means, not how long it may take (test_template_budget.py): a machine that stalls
    for half a second (it did, in CI) must not turn these into budget failures."""
    with limits.override(template_max_ms=60_000):
        yield


@pytest.fixture
def ctx():
    return {
        "workload": {
            "n": 2,
            "name": "alice",
            "items": [1, 2, 3],
            "keys": "the-keys-key",
            "values": {"v": 1},
            "flag": True,
            "ratio": 0.5,
            "nothing": None,
            "nested": {"a": {"b": {"c": 42}}},
        },
        "ctx": {"page": 3},
        "outcome": {"result": {"data": {"items": []}}},
        "_prev": {"rows": [10, 20]},
        "execution_id": "e-1",
        "plain": {"x": 1},
    }


# ------------------------------------------------------------------------------ detection / fast path


@pytest.mark.parametrize(
    "value, expected",
    [("{{ a }}", True), ("{% if a %}{% endif %}", True), ("{# c #}", True), ("plain", False), ("{ a }", False), ("", False)],
)
def test_is_template(value, expected):
    assert is_template(value) is expected


def test_plain_string_fast_path_does_not_compile():
    before = T._compile.cache_info()
    s = "just text, not a template: { single } braces %"
    assert render(s, {}) is s
    after = T._compile.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)


@pytest.mark.parametrize("value", [1, 2.5, True, False, None, b"bytes"])
def test_non_string_scalars_pass_through(value):
    assert render(value, {}) is value


# ------------------------------------------------------------------------------------- native values


@pytest.mark.parametrize(
    "source, expected, typ",
    [
        ("{{ [1,2] }}", [1, 2], list),
        ("{{ {'a': {'b': 1}} }}", {"a": {"b": 1}}, dict),
        ("{{ workload.n + 1 }}", 3, int),
        ("{{ workload.ratio * 2 }}", 1.0, float),
        ("{{ workload.flag }}", True, bool),
        ("{{ workload.n > 5 }}", False, bool),
        ("{{ 'x' ~ workload.n }}", "x2", str),
        ("{{ workload.nothing }}", None, type(None)),
        ("{{ none }}", None, type(None)),
        ("{{ None }}", None, type(None)),
        ("  {{ workload.n }}\n ", 2, int),
        ("{{- workload.n -}}", 2, int),
        ('{{ "}}" }}', "}}", str),
    ],
)
def test_single_expression_renders_native(ctx, source, expected, typ):
    out = render(source, ctx)
    assert out == expected
    assert type(out) is typ


def test_single_expression_dict_value_is_the_dict(ctx):
    assert render("{{ workload.nested }}", ctx) == {"a": {"b": {"c": 42}}}
    assert render("{{ _prev.rows }}", ctx) == [10, 20]


def test_tojson_native_is_plain_str(ctx):
    out = render("{{ plain | tojson }}", ctx)
    assert type(out) is str and out == '{"x": 1}'


def test_json_filters(ctx):
    assert render("{{ workload.values | to_json }}", ctx) == '{"v": 1}'
    assert render("""{{ '{"a": [1, 2]}' | from_json }}""", ctx) == {"a": [1, 2]}
    assert render("{{ 'false' | bool }}", ctx) is False
    assert render("{{ '7' | int + 1 }}", ctx) == 8


# ------------------------------------------------------------------------------------------- text


@pytest.mark.parametrize(
    "source, expected",
    [
        ("page-{{ ctx.page }}", "page-3"),
        ("{{ workload.n }}{{ ctx.page }}", "23"),
        ("{{ workload.n }} and {{ ctx.page }}", "2 and 3"),
        ("{% for i in workload.items %}{{ i }},{% endfor %}", "1,2,3,"),
        ("{# comment #}{{ workload.n }}", "2"),
        ("line {{ workload.name }}\n", "line alice\n"),
    ],
)
def test_text_rendering(ctx, source, expected):
    out = render(source, ctx)
    assert out == expected and type(out) is str


def test_render_text_is_always_text(ctx):
    assert render_text("{{ workload.n + 1 }}", ctx) == "3"
    assert render_text("{{ [1, 2] }}", ctx) == "[1, 2]"
    assert render_text("no template", ctx) == "no template"


# -------------------------------------------------------------------------------------- recursion


def test_recursive_render_and_no_mutation(ctx):
    value = {
        "url": "https://x/{{ workload.name }}",
        "params": {"page": "{{ ctx.page }}", "size": 50, "tags": ["{{ workload.n }}", "lit", {"deep": "{{ workload.flag }}"}]},
        "{{ key_not_rendered }}": "{{ execution_id }}",
    }
    snapshot = copy.deepcopy(value)
    out = render(value, ctx, "step")
    assert out == {
        "url": "https://x/alice",
        "params": {"page": 3, "size": 50, "tags": [2, "lit", {"deep": True}]},
        "{{ key_not_rendered }}": "e-1",
    }
    assert value == snapshot  # input untouched
    assert out is not value and out["params"] is not value["params"]
    assert out["params"]["tags"] is not value["params"]["tags"]


def test_nested_error_where_extends_dict_keys(ctx):
    value = {"headers": {"Authorization": "Bearer {{ keychain.token }}"}}
    with pytest.raises(TemplateError) as ei:
        render(value, ctx, WHERE)
    err = ei.value
    assert err.where == WHERE + ".headers.Authorization"
    assert err.template == "Bearer {{ keychain.token }}"
    assert "keychain" in err.reason
    assert str(err).startswith(WHERE + ".headers.Authorization: ")


def test_nested_error_where_extends_list_index(ctx):
    value = {"rows": ["a", "b", "c", "{{ missing_name }}"]}
    with pytest.raises(TemplateError) as ei:
        render(value, ctx, "step=s")
    assert ei.value.where == "step=s.rows[3]"


# ---------------------------------------------------------------------------------------- undefined


def test_undefined_name_error_message(ctx):
    with pytest.raises(TemplateError) as ei:
        render("{{ workloadd.x }}", ctx, WHERE)
    err = ei.value
    assert err.where == WHERE
    assert err.template == "{{ workloadd.x }}"
    assert str(err) == f"{WHERE}: undefined name 'workloadd' in template \"{{{{ workloadd.x }}}}\""


def test_undefined_attribute_names_the_missing_link(ctx):
    with pytest.raises(TemplateError) as ei:
        render("{{ outcome.result.data.paging.hasMore }}", ctx, "w")
    assert "'paging'" in ei.value.reason


def test_undefined_in_text_is_error(ctx):
    with pytest.raises(TemplateError, match="'nope'"):
        render("page-{{ nope }}", ctx)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("{{ outcome.result.data.paging.hasMore | default(false) }}", False),
        ("{{ outcome.result.data.paging.hasMore | default(7) }}", 7),
        ("{{ nothing_at_all.x.y | default('d') }}", "d"),
        ("{{ workload.nested.a.b.c | default(0) }}", 42),
        ("{{ workload.nested.a.x.c is defined }}", False),
        ("{{ workload.nested.a.b.c is defined }}", True),
        ("{{ a.b.c is defined }}", False),
        ("{{ a.b.c is not defined }}", True),
        ("{{ outcome['result']['zz']['k'] | default([]) }}", []),
        ("{% if workload.missing is defined %}yes{% else %}no{% endif %}", "no"),
    ],
)
def test_default_and_defined_on_chains(ctx, source, expected):
    assert render(source, ctx) == expected


@pytest.mark.parametrize(
    "source",
    [
        "{{ workload.missing == 1 }}",
        "{{ workload.missing != 1 }}",
        "{{ workload.missing > 1 }}",
        "{{ workload.missing + 1 }}",
        "{{ workload.missing.deeper }}",
        "{{ workload.missing ~ 'x' }}",
        "{{ 1 in workload.missing }}",
        "{{ workload.missing | length }}",
        "{{ workload.missing | int }}",
        "{{ not workload.missing }}",
        "{{ 'a' if workload.missing else 'b' }}",
        "{% for x in workload.missing %}{{ x }}{% endfor %}",
        "{{ [workload.missing, 1] }}",
        "{{ {'k': workload.missing} }}",
        "{{ dict(k=workload.missing) }}",
        "{{ workload.missing() }}",
    ],
)
def test_other_uses_of_undefined_fail(ctx, source):
    with pytest.raises(TemplateError) as ei:
        render(source, ctx, "w")
    assert "missing" in ei.value.reason


def test_truthy_of_undefined_fails(ctx):
    with pytest.raises(TemplateError):
        truthy("{{ workload.missing }}", ctx)


# ------------------------------------------------------------------------------ mapping precedence


def test_mapping_key_wins_over_method(ctx):
    assert render("{{ workload.items }}", ctx) == [1, 2, 3]
    assert render("{{ workload.keys }}", ctx) == "the-keys-key"
    assert render("{{ workload.values }}", ctx) == {"v": 1}
    assert render("{{ workload.items | length }}", ctx) == 3


def test_mapping_methods_when_no_such_key(ctx):
    assert render("{{ plain.get('x', 9) }}", ctx) == 1
    assert render("{{ plain.get('zz', 9) }}", ctx) == 9
    assert render("{{ plain.keys() | list }}", ctx) == ["x"]


def test_mutating_methods_are_blocked(ctx):
    with pytest.raises(TemplateError, match="SecurityError"):
        render("{{ plain.update({'y': 2}) }}", ctx)
    with pytest.raises(TemplateError, match="SecurityError"):
        render("{{ workload['items'].append(4) }}", ctx)
    assert ctx["plain"] == {"x": 1} and ctx["workload"]["items"] == [1, 2, 3]


# ------------------------------------------------------------------------------------------ sandbox


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ x.__init__.__globals__ }}",
        "{{ plain.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ lipsum.__globals__ }}",
        "{{ self.__dict__ }}",
        "{{ self._TemplateReference__context }}",
        "{{ range.__self__ }}",
        "{{ dict.__init__.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ ''|attr('__class__') }}",
        "{{ ''['__class__'] }}",
        "{{ '{0.__class__}'.format('') }}",
        "{{ ''.__class__ | default('safe') }}",
        "{% import 'os' as os %}",
        "{% from 'os' import path %}",
        "{% include '/etc/passwd' %}",
        "{% extends '/etc/passwd' %}",
        "x {{ 1 }} {% include 'other' %}",
        "{{ 'a' * 100000000 }}",
        "{{ (2 ** 1000) ** 100000 }}",
    ],
)
def test_sandbox_escapes_raise_template_error(ctx, source):
    with pytest.raises(TemplateError) as ei:
        render(source, ctx, "w")
    assert ei.value.where == "w"
    # nothing leaked: the result never got out, and the message is not a class/module dump
    assert "<class" not in str(ei.value) and "builtins" not in str(ei.value)


def test_safe_globals_kept(ctx):
    assert render("{{ range(3) | list }}", ctx) == [0, 1, 2]
    assert render("{{ dict(a=1) }}", ctx) == {"a": 1}
    assert render("{% set ns = namespace(n=0) %}{% for i in [1,2] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", ctx) == "3"


# ------------------------------------------------------------------------------------------- errors


def test_evaluation_errors_are_wrapped_with_type(ctx):
    with pytest.raises(TemplateError) as ei:
        render("{{ 1 / 0 }}", ctx, "w")
    assert ei.value.reason.startswith("ZeroDivisionError:")
    with pytest.raises(TemplateError) as ei:
        render("{{ workload.name + 1 }}", ctx, "w")
    assert ei.value.reason.startswith("TypeError:")


def test_syntax_error_from_render(ctx):
    with pytest.raises(TemplateError) as ei:
        render("{{ a } }}", ctx, WHERE)
    assert str(ei.value) == f"{WHERE}: template syntax error: unexpected '}}' in \"{{{{ a }} }}}}\""


def test_template_error_is_plain_exception_with_fields():
    err = TemplateError("{{ x }}", "here", "boom")
    assert isinstance(err, Exception)
    assert (err.template, err.where, err.reason) == ("{{ x }}", "here", "boom")
    assert str(TemplateError("{{ x }}", "", "boom")) == 'boom in template "{{ x }}"'


# ------------------------------------------------------------------------------------- check_syntax


def test_check_syntax_fine():
    assert check_syntax({"a": "{{ x }}", "b": ["{% if y %}1{% endif %}", 3, None], "c": "plain"}, "root") == []


def test_check_syntax_reports_each_location():
    value = {"url": "{{ a } }}", "list": ["ok", "{{ b", {"deep": "{% if %}"}], "fine": "{{ c }}"}
    problems = check_syntax(value, "step=s")
    wheres = [w for w, _ in problems]
    assert wheres == ["step=s.url", "step=s.list[1]", "step=s.list[2].deep"]
    assert all(m.startswith("template syntax error:") for _, m in problems)
    assert "unexpected '}'" in problems[0][1] and '"{{ a } }}"' in problems[0][1]


def test_check_syntax_rejects_loading_tags():
    problems = check_syntax(["{% include 'x' %}", "{% import 'os' as os %}"], "w")
    assert [w for w, _ in problems] == ["w[0]", "w[1]"]


def test_check_syntax_does_not_render():
    # an undefined name is not a syntax problem
    assert check_syntax("{{ nowhere.to.be.found }}") == []


# -------------------------------------------------------------------------------------------- truthy


@pytest.mark.parametrize("s", ["false", "False", " FALSE ", "no", "No", "0", "", "  ", "none", "None", "null", "NULL"])
def test_truthy_false_strings(ctx, s):
    assert truthy(s, ctx) is False


@pytest.mark.parametrize("s", ["true", "yes", "1", "anything", "off-by-one"])
def test_truthy_true_strings(ctx, s):
    assert truthy(s, ctx) is True


@pytest.mark.parametrize(
    "value, expected",
    [
        ("{{ workload.n > 1 }}", True),
        ("{{ workload.n > 5 }}", False),
        ("{{ 'False' }}", False),
        ("{{ workload.nothing }}", False),
        ("{{ workload.items }}", True),
        ("{{ [] }}", False),
        ("{{ 0 }}", False),
        ("{{ outcome.result.data.paging.hasMore | default(false) }}", False),
        ("{% if workload.flag %}no{% else %}yes{% endif %}", False),
        (True, True),
        (False, False),
        (None, False),
        (0, False),
        (2, True),
    ],
)
def test_truthy_values(ctx, value, expected):
    assert truthy(value, ctx) is expected


# -------------------------------------------------------------------------------------------- evaluate


def test_evaluate_bare_and_wrapped(ctx):
    assert evaluate("workload.n > 1", ctx) is True
    assert evaluate("{{ workload.n > 1 }}", ctx) is True
    assert evaluate("workload.items | length", ctx) == 3
    assert evaluate("[workload.n, ctx.page]", ctx) == [2, 3]
    assert evaluate("page-{{ ctx.page }}", ctx) == "page-3"
    assert evaluate(5, ctx) == 5


def test_evaluate_bare_errors(ctx):
    with pytest.raises(TemplateError) as ei:
        evaluate("nope + 1", ctx, "when")
    assert ei.value.where == "when" and "'nope'" in ei.value.reason
    with pytest.raises(TemplateError, match="syntax"):
        evaluate("a b", ctx, "when")


# --------------------------------------------------------------------------------------------- cache


def test_compiled_templates_are_cached(ctx):
    src = "{{ workload.n * 1000 + 7 }}  "  # unique to this test
    before = T._compile.cache_info()
    assert render(src, ctx) == 2007
    mid = T._compile.cache_info()
    assert render(src, ctx) == 2007
    after = T._compile.cache_info()
    assert mid.misses == before.misses + 1
    assert after.hits == mid.hits + 1 and after.misses == mid.misses
    assert T._compile(src, "auto") is T._compile(src, "auto")
    assert after.maxsize is not None and 1000 <= after.maxsize <= 100_000


def test_native_result_not_shared_between_renders(ctx):
    a = render("{{ [1, 2] }}", ctx)
    a.append(3)
    assert render("{{ [1, 2] }}", ctx) == [1, 2]


# ---------------------------------------------------------------------------------- referenced_names


def test_referenced_names():
    value = {
        "a": "{{ workload.x + ctx.y }}",
        "b": ["{% for i in iter.rows %}{{ i }}{{ _prev.v }}{% endfor %}", 1, {"c": "{% set t = 1 %}{{ t }}{{ fetch.data }}"}],
        "d": "plain {not_a_template}",
        "e": "{{ broken",
    }
    assert referenced_names(value) == {"workload", "ctx", "iter", "_prev", "fetch"}
    assert referenced_names("no template") == set()


# ------------------------------------------------- constructs the budget's hooks go through (D7)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("{% for i in [1, 2, 3] if i != 2 %}{{ i }}{{ loop.cycle('a', 'b') }}{% else %}none{% endfor %}", "1a3b"),
        ("{% for i in [] %}x{% else %}none{% endfor %}", "none"),
        ("{% for i in workload['items'] %}{{ loop.index }}/{{ loop.length }}{% if not loop.last %},{% endif %}{% endfor %}",
         "1/3,2/3,3/3"),
        ("{% for n in [{'c': [{'c': []}]}] recursive %}<{{ loop(n.c) }}>{% endfor %}", "<<>>"),
        ("{% macro m(a, b=2) %}{{ a }}-{{ b }}-{{ varargs | length }}{% endmacro %}{{ m(1) }} {{ m(1, 3, 4) }}",
         "1-2-0 1-3-1"),
        ("{% macro w() %}[{{ caller() }}]{% endmacro %}{% call w() %}in{% endcall %}", "[in]"),
        ("{% set t %}a{{ workload.n }}b{% endset %}{{ t | upper }}", "A2B"),
        ("{% filter upper %}x{{ workload.name }}{% endfilter %}", "XALICE"),
        ("{% set ns = namespace(s='') %}{% for i in range(3) %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.s }}", "012"),
        ("{{ workload.name[1:3] }}{{ workload['items'][::-1] }}", "li[3, 2, 1]"),
        ("{{ workload.n + 1 }} {{ 1 + workload.n }} {{ workload.n - 0.5 }} {{ workload.n * 3 }} {{ 2 ** 10 }}",
         "3 3 1.5 6 1024"),
        ("{{ 'a' + 'b' }} {{ [1] + [2] }} {{ 'ab' * 2 }} {{ '%s=%03d' % ('k', 7) }} {{ 7 % 3 }}", "ab [1, 2] abab k=007 1"),
        ("{{ '{}|{:>4}|{:.1f}'.format('a', 'b', 2.25) }} {{ '{x}'.format_map({'x': 1}) }}", "a|   b|2.2 1"),
        ("{{ 'x' | center(5) }}|{{ 'a\nb' | indent(2, first=true) }}|{{ '%d-%s' | format(1, 'z') }}", "  x  |  a\n  b|1-z"),
        ("{{ [1, 2] | join(',') }} {{ [[1], [2]] | sum(start=[]) }} {{ [1, 2] | sum }} {{ 'abc' | list }}",
         "1,2 [1, 2] 3 ['a', 'b', 'c']"),
        ("{{ {'a': 1} | tojson }} {{ [1, 2] | batch(1) | list }} {{ 'a-b' | replace('-', '+') }}",
         '{"a": 1} [[1], [2]] a+b'),
        ("{{ 'x'.ljust(3, '.') }} {{ '-'.join(['a', 'b']) }} {{ '7'.zfill(3) }} {{ 'ab'.replace('', '.') }}",
         "x.. a-b 007 .a.b."),
    ],
)
def test_constructs_render_as_jinja_renders_them(ctx, source, expected):
    assert render(source, ctx) == expected
