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

    out = arun(resolve(DECLS, "x1", resolver, environ={"KC_TEST_VAR": "env-value-9",
                                                       "NOETL_KEYCHAIN_ENV": "KC_TEST_*"}))
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

    async def fetch(eid, names, grant):
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
    monkeypatch.setenv("NOETL_KEYCHAIN_ENV", "KC_TEST_VAR,KC_TEST_UNSET_VAR")
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
    monkeypatch.setenv("NOETL_KEYCHAIN_ENV", "KC_LOCAL_*")
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


# ------------------------------------------------------------------------------ encodings and logs
def _encodings(secret: str, user: str = "svc-user") -> dict[str, str]:
    """The forms a secret takes on its way out: URL-encoded, base64, JSON-escaped, HTTP basic auth."""
    import base64
    import json
    import re
    from urllib.parse import quote, quote_plus

    raw = secret.encode()
    b64, url64 = base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()
    return {
        "quote": quote(secret, safe=""), "quote_path": quote(secret), "quote_plus": quote_plus(secret),
        "quote_lower_hex": re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(secret, safe="")),
        "java_url_encoder": quote_plus(secret, safe="*").replace("~", "%7E"),
        "b64": b64, "b64_unpadded": b64.rstrip("="), "b64_url": url64, "b64_url_unpadded": url64.rstrip("="),
        "json_ascii": json.dumps(secret)[1:-1], "json_utf8": json.dumps(secret, ensure_ascii=False)[1:-1],
        "basic_auth": base64.b64encode(f"{user}:{secret}".encode()).decode(),
    }


SECRET = 'pg/pass word+1"é~?'  # every family of characters that encoders treat differently


def test_mask_covers_url_base64_json_and_basic_auth_forms():
    secrets = secrets_of({"db": {"user": "svc-user", "password": SECRET}})
    forms = _encodings(SECRET)
    assert forms["quote"] != forms["quote_plus"] != forms["b64"]  # the forms really differ
    for name, form in forms.items():
        text = f"GET /x?token={form}&page=2 -> Authorization: Basic {form}."
        masked = mask({"m": text, "l": [text]}, secrets)
        for out in (masked["m"], masked["l"][0]):
            assert form not in out, (name, out)
            assert out.startswith("GET /x?token=***") and "&page=2" in out, (name, out)


def test_mask_json_text_and_unrelated_text_untouched():
    import json

    secrets = secrets_of({"api": {"token": SECRET}})
    body = json.dumps({"token": SECRET, "note": "ok"})
    assert mask(body, secrets) == '{"token": "***", "note": "ok"}'
    assert mask({"rows": [{"id": 1, "name": "pg pass word 1"}]}, secrets) == {"rows": [{"id": 1, "name": "pg pass word 1"}]}
    plain = {"rows": [{"id": 1, "name": "alice"}], "n": 3}
    assert mask(plain, secrets) is plain  # nothing to mask: the value itself, not a copy


def test_log_records_are_masked_in_every_logger(caplog):
    import logging

    from noetl_mesh.core.keychain import LOG_MASKING, install_log_masking

    install_log_masking()
    caplog.set_level(logging.DEBUG)
    forms = _encodings(SECRET)
    LOG_MASKING.track("cmd-1", secrets_of({"db": {"user": "svc-user", "password": SECRET}}))
    try:
        for name in ("httpx", "httpcore.http11", "psycopg", "noetl.worker", "some.library"):
            logger = logging.getLogger(name)
            logger.setLevel(logging.DEBUG)
            logger.debug("request %s", f"http://h/x?t={forms['quote_plus']}")
            logger.info('HTTP Request: GET http://h/x?t=%s "HTTP/1.1 200 OK"', forms["quote"])
            logger.warning("auth %(h)s", {"h": f"Basic {forms['basic_auth']}"})
            try:
                raise ValueError(f"bad password {SECRET} ({forms['b64']})")
            except ValueError:
                logger.exception("failed")
            logger.setLevel(logging.NOTSET)
    finally:
        LOG_MASKING.forget("cmd-1")
    text = caplog.text + "".join(str(r.msg) + str(r.args) for r in caplog.records)
    assert text.count("***") >= 5 * 5
    for form in [SECRET, *forms.values()]:
        assert form not in text
    logging.getLogger("some.library").warning("after %s", SECRET)  # the command ended: nothing to mask
    assert caplog.records[-1].getMessage() == f"after {SECRET}"


def test_installing_quiets_httpx_request_lines():
    import logging

    from noetl_mesh.core.keychain import install_log_masking

    install_log_masking()
    for name in ("httpx", "httpcore"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO)


def test_http_url_query_secret_reaches_neither_events_nor_logs(monkeypatch, caplog):
    """The reproduction: a keychain secret in an http task's URL query string and params. httpx logs
    every request line (URL included) at INFO; the worker's events carry the URL in results and errors."""
    import json
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler

    from noetl_mesh.core.keychain import LOG_MASKING, install_log_masking
    from noetl_mesh.testing.fixture_api import QuietHTTPServer
    from noetl_mesh.sandbox.policy import Policy, parse_destinations
    from noetl_mesh.tools.http import HttpTool

    def open_to(url: str) -> Policy:
        return Policy(allow=parse_destinations(url.split("//", 1)[1]))

    class Echo(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"path": self.path}).encode()
            self.send_response(200 if "fail" not in self.path else 500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = QuietHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    monkeypatch.setenv("KC_HTTP_SECRET", SECRET)
    monkeypatch.setenv("NOETL_KEYCHAIN_ENV", "KC_HTTP_SECRET")
    install_log_masking()
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)  # as verbose as anyone could make it
    tasks = [
        {"name": "url", "kind": "http", "url": base + "/a?token={{ keychain.api.value }}"},
        {"name": "params", "kind": "http", "url": base + "/b", "params": {"token": "{{ keychain.api.value }}"}},
        {"name": "fail", "kind": "http", "url": base + "/fail?token={{ keychain.api.value }}"},
    ]
    events = []

    async def publish(e):
        events.append(e)

    async def main():
        tool = HttpTool(trust_env=False, policy=open_to(base))  # D33: this server only
        try:
            return await execute_command(
                command(tasks, [{"name": "api", "kind": "env", "var": "KC_HTTP_SECRET"}]), {"http": tool}, publish,
                on_secrets=lambda s: LOG_MASKING.track("c1", s))
        finally:
            LOG_MASKING.forget("c1")
            await tool.close()

    try:
        terminals = arun(main())
    finally:
        srv.shutdown()
        srv.server_close()
    processed = [e for e in events if e["name"] == "task.processed"]
    assert [e["data"]["outcome"]["status"] for e in processed] == ["ok", "ok", "error"]
    assert processed[0]["data"]["outcome"]["result"] == {"path": "/a?token=***"}
    assert "***" in processed[2]["data"]["outcome"]["error"]["message"]
    assert terminals[0]["name"] == "step.failed"
    published = json.dumps(events + terminals, ensure_ascii=False) + json.dumps(events + terminals)
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert any(r.name.startswith("httpx") for r in caplog.records)  # the request lines were logged, masked
    for form in [SECRET, *_encodings(SECRET).values()]:
        assert form not in published
        assert form not in logged


def test_worker_events_mask_url_encoded_and_base64_forms():
    """A tool that hands back the secret in every encoded form, in its result, its error message and a
    ctx patch: the published events and the terminal event hold none of them."""
    import json

    forms = _encodings(SECRET)

    class Encodes:
        async def run(self, task, spec, ctx):
            if task.get("fail"):
                return {"status": "error", "error": {"kind": "tool_error", "message": " ".join(forms.values())}}
            return {"status": "ok", "result": {name: f"<{form}>" for name, form in forms.items()}}

    events = []

    async def publish(e):
        events.append(e)

    tasks = [{"name": "enc", "kind": "enc", "spec": {"policy": {"rules": [
                 {"else": {"then": {"do": "continue", "set_ctx": {"seen": "{{ outcome.result.b64 }}"}}}}]}}},
             {"name": "boom", "kind": "enc", "fail": True}]
    # a resolved credential with a user and a password (the basic-auth form needs both)
    terminals = arun(execute_command(
        command(tasks, {"db": {"user": "svc-user", "password": SECRET}}), {"enc": Encodes()}, publish))
    result = next(e for e in events if e["name"] == "task.processed")["data"]["outcome"]["result"]
    assert result == {name: "<***>" for name in forms}
    text = json.dumps(events + terminals, ensure_ascii=False) + json.dumps(events + terminals)
    for form in [SECRET, *forms.values()]:
        assert form not in text
