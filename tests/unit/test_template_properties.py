"""Property tests of the template engine: templates generated from a grammar of Jinja constructs (loops,
macros, filters, methods, numbers, strings, concatenation, formatting) and random text always return
or raise TemplateError, within a few times template_max_ms and without allocating far beyond
template_max_output; attribute tricks never get out of the sandbox."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from noetl_mesh import limits
from noetl_mesh.lang.templates import TemplateError, render

MAX_MS = 250
pytestmark = pytest.mark.filterwarnings("ignore::SyntaxWarning")  # Python on `{{ 1[1:] }}`: "int is not subscriptable"
MAX_OUTPUT = 100_000
TIME_BOUND_S = 4 * MAX_MS / 1000
# Generous: the budget counts characters and items; an item can be a new small object of ~60 bytes,
# and compiling a template allocates too. The attacks the grammar can form would take gigabytes.
PEAK_BOUND = 64 * MAX_OUTPUT + 16_000_000

CONTEXT = {"s": "abc", "n": 3, "items": [1, 2, 3], "big": "x" * 1000, "d": {"a": 1, "b": [1, 2], "c": "<c>"}}
# Deterministic (same examples every run, nothing written to disk) and without shrinking: a failure is
# reported as found, so that a slow example cannot make the search run on for minutes.
PROFILE = settings(max_examples=120, deadline=None, database=None, derandomize=True,
                   phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NUMBERS = st.one_of(st.integers(-3, 50).map(str),
                    st.sampled_from(["1000", "100000", "999999999", "2 ** 31", "10 ** 6", "40", "1.5", "-1"]))
STRINGS = st.sampled_from(["'x'", "'ab'", "''", "'%s'", "'%05d'", "'%0999999999d'", "'%*d'", "'{}'", "'{:>999999999}'",
                           "'{0}{0}'", "'\\t'", "'<b>t</b>'", "'a.b http://c.d'", "'é'", "'\\n'", "s", "big"])
NAMES = st.sampled_from(["s", "n", "items", "big", "d", "d.b", "d.c", "range(n)", "range(100000)", "range(1000)",
                         "namespace(v=1)", "[s, n]", "{'k': s}", "x", "loop"])
FILTERS = st.one_of(
    st.sampled_from(["join", "sum", "list", "string", "tojson", "to_json", "pprint", "urlize", "striptags", "title",
                     "filesizeformat", "unique", "sort", "reverse", "upper", "e", "length", "first", "int", "abs",
                     "dictsort", "items", "from_json", "urlencode", "xmlattr", "trim", "wordcount", "bool",
                     "map('string')", "select('odd')", "reject", "default(1)", "batch(2)", "slice(3)",
                     "sum(start=[])", "join(', ')", "indent", "center", "wordwrap", "truncate"]),
    NUMBERS.map(lambda n: f"center({n})"), NUMBERS.map(lambda n: f"indent({n})"),
    NUMBERS.map(lambda n: f"wordwrap({n})"), NUMBERS.map(lambda n: f"truncate({n})"),
    NUMBERS.map(lambda n: f"batch({n}, 'x')"), NUMBERS.map(lambda n: f"slice({n})"),
    NUMBERS.map(lambda n: f"map('center', {n})"), NUMBERS.map(lambda n: f"format({n}, {n})"),
    st.tuples(STRINGS, STRINGS).map(lambda p: f"replace({p[0]}, {p[1]})"),
    STRINGS.map(lambda x: f"join({x})"),
)
METHODS = st.one_of(
    st.sampled_from(["split()", "upper()", "encode()", "strip()", "splitlines()", "title()", "copy()", "keys()"]),
    NUMBERS.map(lambda n: f"center({n})"), NUMBERS.map(lambda n: f"ljust({n})"), NUMBERS.map(lambda n: f"zfill({n})"),
    NUMBERS.map(lambda n: f"expandtabs({n})"), NUMBERS.map(lambda n: f"to_bytes({n}, 'big')"),
    st.tuples(STRINGS, STRINGS).map(lambda p: f"replace({p[0]}, {p[1]})"),
    STRINGS.map(lambda x: f"translate({{120: {x}}})"),
)
OPERATORS = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "~", "and", "or", "==", "in"])


def expressions():
    base = st.one_of(NUMBERS, STRINGS, NAMES)

    def extend(children):
        return st.one_of(
            st.tuples(children, OPERATORS, children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(children, FILTERS).map(lambda t: f"({t[0]} | {t[1]})"),
            st.tuples(children, METHODS).map(lambda t: f"{t[0]}.{t[1]}"),
            st.tuples(STRINGS, children).map(lambda t: f"({t[0]} % {t[1]})"),
            st.tuples(STRINGS, children).map(lambda t: f"{t[0]}.format({t[1]})"),
            st.tuples(children, children).map(lambda t: f"[{t[0]}, {t[1]}]"),
            st.tuples(children, children, children).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
            children.map(lambda c: f"{c}[1:]"),
        )

    return st.recursive(base, extend, max_leaves=8)


def templates():
    expr = expressions()

    def extend(body):
        return st.one_of(
            st.tuples(expr, body).map(lambda t: f"{{% for x in {t[0]} %}}{t[1]}{{% endfor %}}"),
            st.tuples(expr, body).map(lambda t: f"{{% for x in {t[0]} if x %}}{t[1]}{{% endfor %}}"),
            st.tuples(expr, body).map(lambda t: f"{{% if {t[0]} %}}{t[1]}{{% else %}}x{{% endif %}}"),
            st.tuples(expr, OPERATORS, NUMBERS).map(
                lambda t: f"{{% set ns = namespace(v={t[0]}) %}}{{% for i in range({t[2]}) %}}"
                          f"{{% set ns.v = ns.v {t[1]} ns.v %}}{{% endfor %}}{{{{ ns.v }}}}"),
            st.tuples(body, expr).map(lambda t: f"{{% macro m(a) %}}{t[0]}{{{{ a }}}}{{% endmacro %}}{{{{ m({t[1]}) }}}}"),
            st.tuples(body, NUMBERS).map(
                lambda t: f"{{% macro m(k) %}}{t[0]}{{% if k > 0 %}}{{{{ m(k - 1) }}}}{{{{ m(k - 1) }}}}{{% endif %}}"
                          f"{{% endmacro %}}{{{{ m({t[1]}) }}}}"),
            st.tuples(body, body).map(lambda t: f"{{% macro w() %}}{{{{ caller() }}}}{{{{ caller() }}}}{{% endmacro %}}"
                                                f"{{% call w() %}}{t[0]}{{% endcall %}}{t[1]}"),
            st.tuples(expr, body).map(lambda t: f"{{% for x in {t[0]} recursive %}}{t[1]}"
                                                f"{{% if loop.depth < 30 %}}{{{{ loop([x, x]) }}}}{{% endif %}}{{% endfor %}}"),
            st.tuples(body, body).map(lambda t: t[0] + t[1]),
        )

    leaf = st.one_of(expr.map(lambda e: f"{{{{ {e} }}}}"), st.sampled_from(["x", " ", "-", "{{ x }}", "{{ loop.index }}"]))
    return st.recursive(leaf, extend, max_leaves=6)


def bounded(source):
    """Render under the test budget: returns the outcome; fails on anything but a value or TemplateError."""
    tracemalloc.start()
    t0 = time.thread_time()  # the CPU time of this thread, what the budget bounds (another process's load is not in it)
    try:
        render(source, CONTEXT, "w")
        outcome = "value"
    except TemplateError as e:
        outcome = e.reason
    used = time.thread_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert used < TIME_BOUND_S, (used, outcome, source)
    assert peak < PEAK_BOUND, (peak, outcome, source)
    return outcome


@pytest.fixture(autouse=True)
def budget():
    with limits.override(template_max_ms=MAX_MS, template_max_output=MAX_OUTPUT):
        yield


@PROFILE
@given(templates())
def test_generated_templates_end_within_the_budget(source):
    bounded(source)


@PROFILE
@given(expressions())
def test_generated_expressions_end_within_the_budget(expr):
    bounded(f"{{{{ {expr} }}}}")


@PROFILE
@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(["{{", "}}", "{%", "%}", "{#", "#}", "for", "in",
                                                                 "endfor", "macro", "range(100000)", "|", "*", "~",
                                                                 "'", "(", ")", "999999999"])), max_size=20))
def test_random_text_renders_or_fails_cleanly(parts):
    bounded("".join(parts))


BASES = st.sampled_from(["''", "s", "d", "items", "n", "range", "namespace", "dict", "namespace(v=1)", "d.items",
                         "s.upper", "s.format", "(1).real", "self", "x", "lipsum", "cycler", "joiner", "loop",
                         "[].append", "d.keys()", "range(3)", "(s | tojson)", "1.5"])
TRICKS = st.sampled_from([".__class__", ".__mro__", ".__subclasses__()", ".__globals__", ".__init__", ".__dict__",
                          ".__self__", ".__func__", ".__builtins__", "['__class__']", "|attr('__class__')",
                          "|attr('__globals__')", ".mro()", "._TemplateReference__context", ".__code__", ".gi_frame",
                          ".f_globals", ".__getattribute__('__class__')", ".__reduce_ex__(2)", "['_Namespace__attrs']",
                          "._Namespace__attrs", ".__base__", ".__len__()", "|attr('_TemplateReference__context')"])
SAFE = st.sampled_from(["", ".real", "|string", "|list", ".upper()", "['a']", "|first", "|default(1)", ".items()"])


@PROFILE
@given(BASES, st.lists(SAFE, max_size=2), TRICKS, st.lists(st.one_of(TRICKS, SAFE), max_size=3))
def test_attribute_tricks_never_leave_the_sandbox(base, before, trick, after):
    source = "{{ " + base + "".join(before) + trick + "".join(after) + " }}"
    with pytest.raises(TemplateError):
        render(source, CONTEXT, "w")
    for fmt in (f"'{{0{trick}}}'.format({base})", f"'{{0{trick}}}'.format_map({{0: {base}}})"):
        if trick.startswith("."):
            with pytest.raises(TemplateError):
                render("{{ " + fmt + " }}", CONTEXT, "w")
