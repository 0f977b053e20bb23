"""The event-recorder's pure parts: rows and projection parameters Postgres can store, whatever the
event holds; which failures are the database's; replies cut and shrunk to a byte budget."""
from __future__ import annotations

import asyncio
import hashlib
import json
import math

import orjson
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg_pool import PoolTimeout

from noetl_mesh.infra.bus import dumps
from noetl_mesh.infra.payloads import STORE, is_ref
from noetl_mesh.services.event_recorder import replies, schema

DATA_AT = schema.STAGE_COLUMNS.index("data")


def storable_text(value: str | None) -> bool:
    return value is None or ("\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value))


def storable_json(value: str | None) -> bool:
    """What jsonb accepts: JSON text without NUL, unpaired surrogates (raw or escaped) or non-finite
    numbers."""
    if value is None:
        return True
    if not storable_text(value):
        return False
    return storable_value(json.loads(value, parse_constant=lambda c: pytest.fail(f"{c} in {value!r}")))


def storable_value(value) -> bool:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return all(storable_text(k) and storable_value(v) for k, v in value.items())
    if isinstance(value, list):
        return all(storable_value(v) for v in value)
    return True


def row_is_storable(row: tuple) -> bool:
    cols = dict(zip(schema.STAGE_COLUMNS, row))
    return (all(storable_text(cols[c]) for c in schema._TEXT)
            and (cols["ts"] is None or schema.timestamp(cols["ts"]) is not None)
            and storable_json(cols["data"]) and storable_json(cols["extra"]))


# ------------------------------------------------------------------------------------ text and json
def test_nul_and_unpaired_surrogates_are_escaped_as_six_characters() -> None:
    assert schema.text("a\x00b") == "a\\u0000b"
    assert schema.text("x\ud800y\udfff") == "x\\ud800y\\udfff"
    assert schema.text("plain é 😀") == "plain é 😀"
    assert schema.unstorable("a\x00b") == "contains a NUL character (\\u0000)"
    assert "unpaired surrogate (\\udc80)" in schema.unstorable("\udc80")
    assert schema.unstorable("fine é") is None


def test_json_text_is_what_jsonb_accepts() -> None:
    assert json.loads(schema.json_text({"k\x00": ["\x00", {"n": 1}]})) == {"k\\u0000": ["\\u0000", {"n": 1}]}
    assert json.loads(schema.json_text({"s": "\ud800", "big": 10**30})) == {"s": "\\ud800", "big": str(10**30)}
    assert json.loads(schema.json_text({"nan": math.nan, "s": "\x00"})) == {"nan": "NaN", "s": "\\u0000"}
    assert schema.json_text({"a": [1, "b"]}) == '{"a":[1,"b"]}'  # the common case: orjson as is


def test_messages_orjson_refuses_are_read_and_cleaned() -> None:
    assert schema.decode(b'[{"a": 1}]') == [{"a": 1}]
    assert schema.decode(b'["a\\ud800", NaN, Infinity, -Infinity, 1e999999]') == [
        "a\\ud800", "NaN", "Infinity", "-Infinity", "Infinity"]
    assert schema.decode(b'["a\xed\xa0\x80b"]') == ["a\\ud800b"]  # a surrogate encoded as UTF-8 bytes
    assert schema.decode(b'["\xff"]') == ["\\udcff"]  # not UTF-8 at all
    assert schema.decode(b"[1" + b"0" * 400 + b"]") == [str(10**400)]
    with pytest.raises(ValueError):
        schema.decode(b"[not json")


def test_timestamps_postgres_cannot_hold_move_to_extra() -> None:
    for bad in (1e300, -1e300, math.inf, math.nan, True, "yesterday"):
        row = dict(zip(schema.STAGE_COLUMNS, schema.event_row(1, {"event_id": "e", "execution_id": "x",
                                                                   "name": "n", "timestamp": bad})))
        assert row["ts"] is None and row["extra"] is not None, bad
    assert schema.timestamp(1_700_000_000.5) == 1_700_000_000.5


# ------------------------------------------------------------------------------------ event rows
TEXTS = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0xFFFF, blacklist_categories=()), max_size=12)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | TEXTS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXTS, children, max_size=4),
    max_leaves=20)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from([*schema._TEXT, "timestamp", "attempt", "iteration", "data", "odd", "x\x00"]),
                       JSONISH, max_size=10),
       TEXTS, TEXTS)
def test_every_event_gives_a_storable_row(fields: dict, event_id: str, execution_id: str) -> None:
    event = {**fields, "event_id": event_id, "execution_id": execution_id, "name": "n"}
    assert row_is_storable(schema.event_row(7, event))
    for params in schema.projection([{**event, "name": name} for name in (
            "playbook.execution.requested", "playbook.request.evaluated", "workflow.started",
            "workflow.finished")]).values():
        for p in params:
            assert all(storable_text(v) for v in p.values() if isinstance(v, str) and v is not p.get("error"))
            assert storable_json(p.get("error"))
            assert schema.timestamp(p["ts"]) is not None if "ts" in p else True


def test_a_clean_row_round_trips_and_odd_types_go_to_extra() -> None:
    event = {"event_id": "e1", "execution_id": "x1", "name": "step.done", "timestamp": 1_700_000_000.25,
             "step": 5, "attempt": 2**40, "iteration": 3, "data": {"r": [1, "a"]}, "custom": {"k": 1}}
    row = schema.event_row(11, event)
    cols = dict(zip(schema.STAGE_COLUMNS, row))
    assert (cols["seq"], cols["step"], cols["attempt"], cols["iteration"]) == (11, None, None, 3)
    assert json.loads(cols["extra"]) == {"step": 5, "attempt": 2**40, "custom": {"k": 1}}
    assert json.loads(cols["data"]) == {"r": [1, "a"]}


def test_a_rejected_event_keeps_its_names_and_ids_and_drops_its_data() -> None:
    long_id = "x" * 10_000
    event = {"event_id": "e\x00", "execution_id": long_id, "name": "step.done", "step": "s", "attempt": 1,
             "timestamp": 1_700_000_000.0, "data": {"huge": "v" * 100}, "custom": 1, "task": ["odd"]}
    out = schema.rejected(event, "DataError: no\x00pe")
    assert out["event_id"] == "e\\u0000" and out["name"] == "step.done" and out["step"] == "s"
    assert out["attempt"] == 1 and out["timestamp"] == 1_700_000_000.0
    assert out["data"] == {"unrecordable": "DataError: no\\u0000pe"} and schema.is_rejected(out)
    assert "custom" not in out and "task" not in out
    assert len(out["execution_id"]) <= 256 and out["execution_id"].startswith("x" * 200)
    assert hashlib.sha256(long_id.encode()).hexdigest()[:24] in out["execution_id"]
    assert schema.rejected(event, "again")["execution_id"] == out["execution_id"]  # same cut every time
    assert row_is_storable(schema.event_row(1, out))


def test_projection_parameters_are_escaped() -> None:
    events = [
        {"event_id": "1", "execution_id": "x\x00", "name": "playbook.execution.requested",
         "data": {"parent_execution_id": "a\x00b", "playbook": {"metadata": {"path": "p\ud800"}}}},
        {"event_id": "2", "execution_id": "x\x00", "name": "workflow.finished", "timestamp": 1e300,
         "data": {"status": "FAILED", "error": {"m\x00": "\x00"}}},
        {"event_id": "3", "execution_id": "y", "name": "workflow.finished", "data": ["not", "a", "dict"]},
    ]
    out = schema.projection(events)
    (req,) = out[schema.UPSERT_REQUESTED]
    assert (req["id"], req["parent"], req["path"]) == ("x\\u0000", "a\\u0000b", "p\\ud800")
    fin, odd = out[schema.UPSERT_FINISHED]
    assert json.loads(fin["error"]) == {"m\\u0000": "\\u0000"} and schema.timestamp(fin["ts"]) is not None
    assert (odd["status"], odd["error"]) == ("FAILED", None)


# ------------------------------------------------------------------------------------ failures
def test_only_the_databases_failures_are_transient() -> None:
    transient = [psycopg.errors.AdminShutdown(), psycopg.errors.ConnectionFailure(), psycopg.OperationalError(),
                 psycopg.InterfaceError(), PoolTimeout(), ConnectionRefusedError(), TimeoutError(),
                 psycopg.errors.UndefinedTable(), psycopg.errors.SerializationFailure(),
                 psycopg.errors.DiskFull(), psycopg.errors.LockNotAvailable()]
    not_transient = [psycopg.errors.UntranslatableCharacter(), psycopg.errors.DatetimeFieldOverflow(),
                     psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
                     psycopg.errors.ProgramLimitExceeded(), psycopg.errors.RaiseException(),
                     psycopg.errors.NotNullViolation(), psycopg.errors.InvalidParameterValue(),
                     UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
                     TypeError("Integer exceeds 64-bit range"), ValueError("x")]
    assert [schema.transient(e) for e in transient] == [True] * len(transient)
    assert [schema.transient(e) for e in not_transient] == [False] * len(not_transient)


# ------------------------------------------------------------------------------------ replies
class FakeStore:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    async def put(self, value):
        data = dumps(value)
        key = hashlib.sha256(data).hexdigest()
        self.objects[key] = data
        return {"store": STORE, "key": key, "size": len(data), "checksum": f"sha256:{key}"}

    def expand(self, value):
        if is_ref(value):
            return self.expand(orjson.loads(self.objects[value["key"]]))
        if isinstance(value, dict):
            return {k: self.expand(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.expand(v) for v in value]
        return value


def run(coro):
    return asyncio.run(coro)


def test_fit_replaces_the_biggest_values_only() -> None:
    store = FakeStore()
    summary = {"status": "COMPLETED", "steps": {f"s{i}": {"status": "success", "result": str(i) * 200_000}
                                                for i in range(6)}}
    out = run(replies.fit(summary, 768 * 1024, store.put))
    assert len(dumps(out)) <= 768 * 1024 and store.expand(out) == summary
    refs = [name for name, step in out["steps"].items() if is_ref(step["result"])]
    assert len(refs) == 3  # three results inline are 600 kB: they fit
    assert all(step["status"] == "success" for step in out["steps"].values())  # only results went
    assert run(replies.fit({"a": 1}, 100, store.put)) == {"a": 1}


def test_fit_shares_a_list_and_never_replaces_the_top_level() -> None:
    store = FakeStore()
    rows = [{"id": i, "error": {"message": "e" * 3000}} for i in range(40)]
    out = run(replies.fit(rows, 64 * 1024, store.put))
    assert isinstance(out, list) and len(out) == 40 and len(dumps(out)) <= 64 * 1024
    assert store.expand(out) == rows
    small = [{"id": i} for i in range(100)]  # many small parts: nothing to gain by reference
    assert run(replies.fit(small, 300, store.put)) == small
    assert run(replies.fit("x" * 5000, 300, store.put)) == "x" * 5000  # the caller says too_large


def test_page_is_cut_by_bytes_and_a_lone_big_event_goes_by_reference() -> None:
    store = FakeStore()
    events = [{"event_id": f"e{i}", "data": {"result": "r" * 20_000}} for i in range(10)]
    whole, n = run(replies.page(events, 768 * 1024, store.put))
    assert n == 10 and orjson.loads(dumps(whole)) == events
    page, n = run(replies.page(events, 64 * 1024, store.put))
    assert 1 < n < 10 and orjson.loads(dumps(page)) == events[:n]
    assert len(dumps({"events": page, "total": 10, "offset": 0, "limit": 1000, "next_offset": n})) <= 64 * 1024
    huge = [{"event_id": "h", "name": "task.processed", "data": {"outcome": {"result": "h" * 100_000}}}, *events]
    page, n = run(replies.page(huge, 64 * 1024, store.put))
    first, *rest = orjson.loads(dumps(page))
    assert n == 1 + len(rest) and first["event_id"] == "h" and is_ref(first["data"]["outcome"]["result"])
    assert store.expand(first) == huge[0]
    assert rest == events[:len(rest)]  # then what fits, as it is


def test_lookups_use_the_stored_form_of_an_id() -> None:
    from noetl_mesh.services.event_recorder.service import _execution_id

    stored = schema.event_row(1, {"event_id": "e", "execution_id": "a\x00b", "name": "n"})
    assert _execution_id({"execution_id": "a\x00b"}) == dict(zip(schema.STAGE_COLUMNS, stored))["execution_id"]
