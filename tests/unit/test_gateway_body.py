"""Strict JSON bodies (services/gateway/body.py): what is refused, with which status, and where."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from noetl_mesh import limits
from noetl_mesh.services.gateway.body import BodyError, check, location, parse_json


def refused(text: str | bytes, max_depth: int = 64) -> BodyError:
    with pytest.raises(BodyError) as info:
        parse_json(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"), max_depth)
    return info.value


def test_ordinary_bodies_pass_unchanged():
    body = {"path": "a/b", "workload": {"n": [1, -2, 2**63 - 1, -(2**63), 1.5, True, None, "é😀", {}]}}
    assert parse_json(json.dumps(body).encode(), 64) == body
    assert parse_json(json.dumps(body, ensure_ascii=True).encode(), 64) == body  # escapes, pairs joined
    assert parse_json(b'"\\ud83d\\ude00"', 1) == "😀"


@pytest.mark.parametrize("text, where", [
    ('{"a": [1, 18446744073709551616]}', "body.a[1]"),
    ('{"a": 9223372036854775808}', "body.a"),
    ('{"a": -9223372036854775809}', "body.a"),
    ('[' + "9" * 5000 + ']', "body[0]"),  # past Python's int-from-string digit limit too
])
def test_integers_outside_int64_are_422_where_they_stand(text, where):
    err = refused(text)
    assert (err.status, err.type, err.location) == (422, "json_number", where)
    assert "64-bit" in err.message and len(err.message) < 300


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"x": -Infinity}', "1e400", "[-1e999]"])
def test_non_finite_numbers_are_422(text):
    err = refused(text)
    assert err.status == 422 and err.type == "json_number"


def test_nul_and_surrogates_in_strings_and_keys_are_422_with_their_path():
    nul = refused('{"parent_execution_id": "a\\u0000b"}')
    assert (nul.status, nul.type, nul.location) == (422, "json_nul", "body.parent_execution_id")
    assert "refused rather than removed" in nul.message
    key = refused('{"workload": {"k\\u0000": 1}}')
    assert key.location == 'body.workload["k\\u0000"]' and "key" in key.message
    lone = refused('{"a": ["ok", "x\\ud800y"]}')
    assert (lone.type, lone.location) == ("json_surrogate", "body.a[1]")
    low = refused('{"\\udc00": 1}')
    assert low.location == 'body["\\udc00"]'
    assert refused('"\\ud83d"').location == "body"  # a high surrogate without its pair


def test_depth_over_the_limit_is_422_naming_the_limit():
    assert parse_json(b"[" * 64 + b"]" * 64, 64) == parse_json(b"[" * 64 + b"]" * 64, 64)
    err = refused("[" * 65 + "]" * 65)
    assert err.status == 422 and err.type == "json_depth"
    assert "max_json_depth = 64 levels" in err.message and "NOETL_LIMIT_MAX_JSON_DEPTH" in err.message
    assert err.location == "body" + "[0]" * 64
    for depth in (300, 5_000, 200_000):  # past the parser's own recursion limit: still a 422
        err = refused("[" * depth + "]" * depth)
        assert err.status == 422 and "max_json_depth" in err.message
    with limits.override(max_json_depth=2):
        assert refused('{"a": {"b": {}}}', 2).location == "body.a.b"


def test_too_many_values_are_413_before_anything_is_built():
    with limits.override(max_body_values=1000):
        err = refused(b"[" + b"[]," * 2000 + b"[]]")
        assert (err.status, err.type) == (413, "too_many_values")
        assert "max_body_values = 1,000 values" in err.message and "NOETL_LIMIT_MAX_BODY_VALUES" in err.message
        assert refused(b'{"a": [' + b"1," * 1500 + b'1]}').status == 413
        # commas and brackets inside strings are text, not values
        csv = {"workload": {"csv": "a,b,[c],{d}," * 1000, "q": 'x\\",' * 500}}
        assert parse_json(json.dumps(csv).encode(), 64) == csv
        assert parse_json(b"[" + b"1," * 998 + b"1]", 64) == [1] * 999


def test_malformed_and_undecodable_bodies_are_400_with_the_position():
    err = refused('{"content": "a",\n  "x": }')
    assert err.status == 400 and "line 2, column 8" in err.message
    assert refused("").status == 400
    assert refused('{"a": 1} trailing').status == 400
    bad = refused(b'{"a": "caf\xe9"}')
    assert bad.status == 400 and "byte 10" in bad.message and "UTF-8" in bad.message
    assert refused(b'"\xed\xa0\x80"').status == 400  # a surrogate encoded in the bytes is not UTF-8
    assert refused('"a\x00b"').status == 400  # a raw control character is not JSON


def test_location_quotes_odd_keys_and_cuts_long_ones():
    assert location(("workload", "a.b", 0, "x_1")) == 'body.workload["a.b"][0].x_1'
    assert len(location(("k" * 10_000,))) < 100


def test_check_walks_values_of_any_depth_without_recursion():
    deep: list = []
    node = deep
    for _ in range(100_000):
        node.append([])
        node = node[0]
    with pytest.raises(BodyError, match="max_json_depth"):
        check(deep, 64)


any_text = st.lists(st.characters() | st.sampled_from(["\x00", "\ud800", "\udc00", "\ud83d\ude00"]),
                    max_size=8).map("".join)  # NUL and lone surrogates included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=20)


def storable(value, depth=0) -> bool:
    """The oracle, written plainly: what the event log can hold."""
    if isinstance(value, str):
        return "\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    if isinstance(value, float):
        return math.isfinite(value)
    if depth + 1 > 3:
        return False
    pairs = value.items() if isinstance(value, dict) else enumerate(value)
    return all((not isinstance(k, str) or storable(k)) and storable(v, depth + 1) for k, v in pairs)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_value_is_accepted_exactly_or_refused_with_a_422(value):
    raw = json.dumps(value, ensure_ascii=True).encode()  # NaN/Infinity written as such; surrogates escaped
    meant = json.loads(raw)  # what the text means (an escaped high+low surrogate pair is one character)
    try:
        got = parse_json(raw, 3)
    except BodyError as exc:
        assert exc.status == 422 and exc.message and exc.location.startswith("body")
        assert not storable(meant)
        return
    assert storable(meant)
    assert json.dumps(got, sort_keys=True) == json.dumps(meant, sort_keys=True)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_value_or_a_body_error(raw):
    try:
        parse_json(raw, 64)
    except BodyError as exc:
        assert exc.status in (400, 422)
