"""Property tests: whatever the document — random values, random YAML-ish text, random bytes, the
examples mutated (keys deleted, renamed, duplicated; values replaced by any type) — the validator
answers valid or invalid, never raises, every error has a location, and it answers quickly.

Each test runs 100 examples by default (a few seconds); NOETL_FUZZ_EXAMPLES=5000 runs a longer fuzz.
"""
from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from noetl_mesh.lang.documents import check_value, load_document
from noetl_mesh.lang.graph import WorkflowGraph
from noetl_mesh.lang.validate import ValidationResult, validate, validate_cached, validate_text

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
EXAMPLE_TEXTS = [p.read_text() for p in EXAMPLES]
EXAMPLE_DOCS = [yaml.safe_load(t) for t in EXAMPLE_TEXTS]
BOUND = 5.0  # seconds per document: generous (normally a few ms)

FUZZ = settings(max_examples=int(os.environ.get("NOETL_FUZZ_EXAMPLES", "100")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

names = st.sampled_from(["start", "end", "step", "tool", "next", "arcs", "kind", "name", "spec", "policy",
                         "rules", "when", "then", "do", "loop", "in", "iterator", "workflow", "workbook",
                         "task", "to", "jump", "retry", "noop", "http", "python", "<<", "", "x" * 300])
strings = st.one_of(names, st.text(max_size=20), st.sampled_from(
    ["{{ x }}", "{{ ", "{% for %}", "\x00", "\ud800", "a\udfffb", "é", "{{ (((((( }}", "{# x"]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63 - 2, max_value=2**70),
                    st.floats(), strings)
keys = st.one_of(names, strings, st.integers(), st.booleans(), st.none())
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=12,
)


def answered(result: ValidationResult) -> None:
    assert isinstance(result, ValidationResult) and isinstance(result.ok, bool)
    for d in result.diagnostics:
        assert d.severity in ("error", "warning") and isinstance(d.location, str) and d.message
        str(d)
    if result.ok:
        assert result.playbook is not None and result.document is not None


def timed(fn, *args) -> Any:
    started = time.perf_counter()
    out = fn(*args)
    assert time.perf_counter() - started < BOUND
    return out


# --------------------------------------------------------------------------- arbitrary values
@FUZZ
@given(values)
def test_any_value_gets_an_answer(value):
    answered(timed(validate, value))
    answered(timed(validate_cached, value))


@FUZZ
@given(st.dictionaries(st.sampled_from(["apiVersion", "kind", "metadata", "executor", "workload", "keychain",
                                        "workbook", "workflow", "vars"]), values, max_size=6))
def test_any_root_gets_an_answer(root):
    answered(timed(validate, root))


@FUZZ
@given(values)
def test_any_value_as_yaml_text_gets_the_same_answer_kind(value):
    try:
        text = yaml.dump(value, Dumper=DUMPER, allow_unicode=True)
    except (yaml.YAMLError, UnicodeError, TypeError, ValueError):
        assume(False)
    result = timed(validate_text, text)
    answered(result)
    if not check_value(value):  # a JSON value: what the text means is what the value is
        doc, found = load_document(text)
        assert found == [] and _same(doc, value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# --------------------------------------------------------------------------- arbitrary text and bytes
yaml_alphabet = st.sampled_from(list(":-[]{}&*!|>'\"#%@`,?~<=\\ \n\t\r.0123456789abexyz") + ["\n  ", "\n- ",
                                "!!int ", "!!binary ", "&a ", "*a ", "<<: ", "---\n", "...\n", "\ufeff", "\x00",
                                "é", "\u2028", "\x85", "\ud800"])


@FUZZ
@given(st.lists(yaml_alphabet, max_size=120).map("".join))
def test_any_text_gets_an_answer(text):
    answered(timed(validate_text, text))


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_get_an_answer(data):
    answered(timed(validate_text, data))
    for bom in (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff"):
        answered(timed(validate_text, bom + data))


# --------------------------------------------------------------------------- the examples, mutated
def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, path + (i,))
    return out


def _at(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def mutated_examples(draw):
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLE_DOCS)))
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _at(doc, path[:-1]), path[-1]
        action = draw(st.sampled_from(["delete", "replace", "rename", "duplicate", "wrap", "name"]))
        if action == "delete":
            del parent[key]
        elif action == "replace":
            parent[key] = draw(values)
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(keys)] = parent.pop(key)
        elif action == "duplicate":
            if isinstance(parent, dict):
                parent[draw(names)] = copy.deepcopy(parent[key])
            else:
                parent.insert(key, copy.deepcopy(parent[key]))
        elif action == "wrap":
            parent[key] = draw(st.sampled_from([[parent[key]], {"x": parent[key]}, {parent[key]: 1}
                                                if isinstance(parent[key], (str, int)) else None]))
        elif action == "name":  # a step or task name (or any field) of any type
            parent[key] = draw(st.sampled_from([["a"], {"a": 1}, 5, None, True, "", "start", "end", 1.5]))
    return doc


@FUZZ
@given(mutated_examples())
def test_mutated_examples_get_an_answer(doc):
    answered(timed(validate, doc))
    try:
        text = yaml.dump(doc, Dumper=DUMPER, allow_unicode=True)
    except (yaml.YAMLError, UnicodeError, TypeError, ValueError):
        return
    answered(timed(validate_text, text))


@st.composite
def mutated_example_texts(draw):
    lines = draw(st.sampled_from(EXAMPLE_TEXTS)).splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["delete", "duplicate", "indent", "dedent", "insert", "swap"]))
        if action == "delete" and len(lines) > 1:
            del lines[i]
        elif action == "duplicate":
            lines.insert(i, lines[i])  # a duplicate key, or a second list item
        elif action == "indent":
            lines[i] = "  " + lines[i]
        elif action == "dedent":
            lines[i] = lines[i][2:] if lines[i].startswith("  ") else lines[i]
        elif action == "insert":
            at = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + draw(yaml_alphabet) + lines[i][at:]
        elif action == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
    return "".join(lines)


@FUZZ
@given(mutated_example_texts())
def test_mutated_example_texts_get_an_answer(text):
    answered(timed(validate_text, text))


def test_examples_are_valid_unmutated():
    for text in EXAMPLE_TEXTS:
        result = validate_text(text)
        assert result.ok, result.errors


# --------------------------------------------------------------------------- the graph
def _reach(start: str, successors: dict[str, list[str]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in successors[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@FUZZ
@given(st.integers(1, 12).flatmap(lambda n: st.lists(
    st.lists(st.integers(0, n), max_size=4), min_size=n, max_size=n)))
def test_back_edges_are_the_arcs_whose_source_the_target_reaches(arcs):
    """The definition (D16), checked by a search per step, against the one-pass build."""
    steps = [(f"s{i}", [f"s{t}" for t in targets]) for i, targets in enumerate(arcs)]  # s{n}: unknown
    graph = WorkflowGraph.build(steps)
    for name, _ in steps:
        into = [p for p in graph.places if p.target == name]
        reach = _reach(name, graph.successors)
        assert graph.back_places[name] == [p for p in into if p.source in reach]
        assert graph.forward_places[name] == [p for p in into if p.source not in reach]
        assert graph.reachable_from(name) == reach
