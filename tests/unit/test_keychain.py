"""D24 on the worker side: keychain declarations resolved when a command starts, the per-execution
credential cache, and the masking of everything a worker publishes."""
from __future__ import annotations

import asyncio

import orjson
import pytest
import yaml

from noetl_mesh.core import decide
from noetl_mesh.core.keychain import KeychainCache, dict_resolver, mask, resolve, secrets_of
from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.core.worker import execute_command
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.noop import NoopTool

DECLS = [
    {"name": "api", "kind": "static", "token": "static-tok-123", "url": "u"},
    {"name": "home", "kind": "env", "var": "KC_TEST_VAR"},
    {"name": "unset", "kind": "env", "var": "KC_TEST_UNSET_VAR"},
    {"name": "db", "kind": "credential", "credential": "pg_main"},
    {"name": "plain", "kind": "credential"},
    {"name": "absent", "kind": "credential"},
]


def arun(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------------ resolution
def test_resolve_static_env_and_credentials():
    calls = []

    async def resolver(eid, decls):
        calls.append((eid, [d["name"] for d in decls]))
        return {"db": {"password": "pg-secret-pw"}, "plain": {"token": "plain-tok"}}

    out = arun(resolve(DECLS, "x1", resolver, environ={"KC_TEST_VAR": "env-value-9"}))
    assert out == {"api": {"token": "static-tok-123", "url": "u"}, "home": {"value": "env-value-9"},
                   "db": {"password": "pg-secret-pw"}, "plain": {"token": "plain-tok"}}
    assert calls == [("x1", ["db", "plain", "absent"])]
    # no resolver: credential entries stay unresolved; a mapping is taken as already resolved
    assert set(arun(resolve(DECLS, "x1", None, environ={}))) == {"api"}
    assert arun(resolve({"k": {"a": 1}}, "x1")) == {"k": {"a": 1}}
    assert arun(resolve(None, "x1")) == {}


def test_cache_maps_stored_names_and_expires_per_execution():
    now = [0.0]
    asked = []

    async def fetch(eid, names):
        asked.append((eid, sorted(names)))
        return {"pg_main": {"password": f"pw-{len(asked)}"}, "plain": {"token": "t"}}

    cache = KeychainCache(fetch, ttl=60, clock=lambda: now[0])
    decls = [d for d in DECLS if d["kind"] == "credential"]
    first = arun(cache("e1", decls))
    assert first == {"db": {"password": "pw-1"}, "plain": {"token": "t"}}  # 'absent' is not stored
    assert arun(cache("e1", decls)) == first and len(asked) == 1  # cached, misses included
    arun(cache("e2", decls))
    assert asked[-1] == ("e2", ["absent", "pg_main", "plain"])  # per execution
    now[0] = 61
    assert arun(cache("e1", decls))["db"] == {"password": "pw-3"} and len(asked) == 3  # expired


def test_dict_resolver():
    r = dict_resolver({"plain": {"token": "abcd"}})
    assert arun(r("e", [{"name": "x", "kind": "credential", "credential": "plain"}])) == {"x": {"token": "abcd"}}


# ------------------------------------------------------------------------------------------ masking
def test_mask_nested_structures_and_messages():
    secrets = secrets_of({"a": {"token": "s3cr3t-token", "short": "abc", "n": 12345,
                                "list": ["listed-secret"]}})
    assert sorted(secrets) == ["listed-secret", "s3cr3t-token"]
    value = {"outcome": {"result": ["x s3cr3t-token y", {"s3cr3t-token": 1}, ("listed-secret",)],
                         "error": {"message": "connect failed: password=s3cr3t-token"}},
             "n": 5, "b": True, "none": None}
    masked = mask(value, secrets)
    assert masked == {"outcome": {"result": ["x *** y", {"***": 1}, ("***",)],
                                  "error": {"message": "connect failed: password=***"}},
                      "n": 5, "b": True, "none": None}
    assert "s3cr3t-token" in value["outcome"]["error"]["message"]  # the input is left alone
    assert mask("abc", ["abc"]) == "abc"  # shorter than 4: never masked
    assert mask("keep", []) == "keep"


class Echo:
    """A tool that reports what it saw: the real keychain, and an error naming the secret."""

    def __init__(self):
        self.seen = []

    async def run(self, task, spec, ctx: ToolContext):
        self.seen.append((task.get("value"), dict(ctx.keychain)))
        if task.get("fail"):
            return {"status": "error", "error": {"kind": "tool_error", "message": f"bad token {task['value']}"}}
        return {"status": "ok", "result": {"echo": task.get("value")}}


def command(tasks, keychain):
    return {"command_id": "c1", "pool": "default", "execution_id": "e1", "step": "s", "step_run_id": "r1",
            "iteration": None, "chunk": None, "tasks": tasks, "workbook": [], "spec_layers": {},
            "workload": {}, "ctx": {}, "args": {}, "iter": None, "steps": {}, "keychain": keychain,
            "loop_mode": None}


def test_worker_resolves_then_masks_every_event(monkeypatch):
    monkeypatch.setenv("KC_TEST_VAR", "env-secret-value")
    tool = Echo()
    events = []

    async def publish(e):
        events.append(e)

    async def resolver(eid, decls):
        return {"db": {"password": "stored-pw-1234"}}

    tasks = [{"name": "a", "kind": "echo", "value": "{{ keychain.api.token }}/{{ keychain.home.value }}"},
             {"name": "b", "kind": "echo", "value": "{{ keychain.db.password }}", "fail": True}]
    terminals = arun(execute_command(command(tasks, DECLS), {"echo": tool}, publish, keychain_resolver=resolver))
    assert tool.seen[0][0] == "static-tok-123/env-secret-value"
    assert tool.seen[1][0] == "stored-pw-1234"
    assert tool.seen[0][1]["db"] == {"password": "stored-pw-1234"} and "unset" not in tool.seen[0][1]
    text = orjson.dumps(events).decode() + orjson.dumps(terminals).decode()
    for secret in ("static-tok-123", "env-secret-value", "stored-pw-1234"):
        assert secret not in text
    assert "***/***" in text and "bad token ***" in text
    assert terminals[0]["name"] == "step.failed"


# ------------------------------------------------------------------------------------------ decide
def test_commands_and_the_log_carry_declarations_only():
    doc = yaml.safe_load("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kc, path: t/kc}
keychain:
  - {name: db, kind: credential, credential: pg_main}
  - {name: home, kind: env, var: HOME_VAR}
workflow:
  - step: start
    tool: {kind: noop, result: "{{ keychain.db.password }}"}
""")
    run = arun(run_local(doc, tools={"noop": NoopTool()}, credentials={"pg_main": {"password": "pw-from-store"}}))
    evaluated = next(e for e in run.log if e["name"] == "playbook.request.evaluated")
    assert evaluated["data"]["keychain"] == doc["keychain"]
    state = run.state
    cmd = decide.build_command(state, next(iter(state.runs.values())), pool="default")
    assert cmd["keychain"] == doc["keychain"]
    assert summary(state)["status"] == "COMPLETED"
    assert "pw-from-store" not in orjson.dumps(run.log).decode()
    assert summary(state)["steps"]["start"]["result"] == "***"


def test_local_run_masks_secrets_in_the_log_but_tasks_see_them(monkeypatch):
    monkeypatch.setenv("KC_LOCAL_SECRET", "env-local-secret-42")
    doc = yaml.safe_load("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kc, path: t/kc2}
keychain:
  - {name: api, kind: static, token: static-abc-123}
  - {name: env, kind: env, var: KC_LOCAL_SECRET}
workflow:
  - step: start
    tool:
      - name: a
        kind: noop
        result: "{{ keychain.env.value }}|{{ keychain.api.token }}"
        spec:
          policy:
            rules:
              - when: "{{ outcome.result.startswith('env-local-') and outcome.result.endswith('-abc-123') and outcome.result|length == 34 }}"
                then: {do: continue, set_ctx: {saw_real: true, echoed: "{{ outcome.result }}"}}
              - else: {then: {do: continue, set_ctx: {saw_real: false}}}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop, result: "{{ ctx.echoed }}"}
""")
    run = arun(run_local(doc, tools={"noop": NoopTool()}))
    s = summary(run.state)
    assert s["status"] == "COMPLETED"
    assert s["ctx"]["saw_real"] is True  # the task and its policy saw the real values
    assert s["steps"]["start"]["result"] == "***|***" and s["steps"]["end"]["result"] == "***|***"
    log = orjson.dumps(run.log).decode()
    assert "env-local-secret-42" not in log  # never in any event
    # a static entry is written in the playbook itself (so in the request); no worker event has it
    worker_events = orjson.dumps([e for e in run.log if e["source"] == "worker"]).decode()
    assert "static-abc-123" not in worker_events


def test_masking_leaves_the_envelope_alone():
    """A secret that happens to equal a step name masks data only: routing keeps working."""
    doc = yaml.safe_load("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kc, path: t/kc3}
keychain: [{name: k, kind: static, word: start}]
workflow:
  - step: start
    tool: {kind: noop, result: "{{ keychain.k.word }}"}
    next: {arcs: [{step: second}]}
  - step: second
    tool: {kind: noop, result: 2}
""")
    run = arun(run_local(doc, tools={"noop": NoopTool()}))
    s = summary(run.state)
    assert s["status"] == "COMPLETED" and s["steps"]["start"]["result"] == "***"
    assert s["steps"]["second"]["result"] == 2
