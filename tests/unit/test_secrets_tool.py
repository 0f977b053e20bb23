"""The ``secrets`` tool (docs/tools.md, D24): a named secret from the credential store into the task result, the
tasks seeing the real value and every published event masked from the fetch on."""
from __future__ import annotations

import asyncio
import json

import yaml

from noetl_mesh.core.keychain import KeychainCache, dict_resolver
from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.core.worker import execute_command
from noetl_mesh.tools.base import ToolContext
from noetl_mesh.tools.noop import NoopTool
from noetl_mesh.tools.secrets import SecretsTool

SECRET = "s3cr3t-value"
CREDENTIALS = {"api": {"token": SECRET, "user": "svc-account"}}


def arun(coro):
    return asyncio.run(coro)


def playbook(secret_task: str, path: str = "t/secrets") -> dict:
    return yaml.safe_load(f"""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {{name: sec, path: {path}}}
keychain: [{{name: api, kind: credential}}]
workflow:
  - step: start
    tool:
      - {secret_task}
      - name: use
        kind: noop
        result: "{{{{ get.result.token }}}}"
        spec:
          policy:
            rules:
              # the literal is split so that the playbook (in the request event) does not hold it
              - when: "{{{{ get.result.token == 's3cr3t' ~ '-value' }}}}"
                then: {{do: continue, set_iter: {{saw_real: true}}, set_ctx: {{saw_real: true, echoed: "{{{{ outcome.result }}}}"}}}}
              - else: {{then: {{do: continue, set_ctx: {{saw_real: false}}}}}}
    next: {{arcs: [{{step: end}}]}}
  - step: end
    tool: {{kind: noop, result: "{{{{ ctx.echoed }}}}|{{{{ start.result }}}}"}}
""")


def ctx(eid: str = "e1") -> ToolContext:
    return ToolContext(execution_id=eid, step="s", task_name="get")


def test_secret_reaches_the_task_and_never_the_log():
    doc = playbook("{name: get, kind: secrets, secret: api}")
    run = arun(run_local(doc, tools={"noop": NoopTool()}, credentials=CREDENTIALS))
    s = summary(run.state)
    assert s["status"] == "COMPLETED"
    assert s["ctx"]["saw_real"] is True  # the policy saw the real value
    assert s["steps"]["start"]["result"] == "***" and s["steps"]["end"]["result"] == "***|***"
    processed = [e for e in run.log if e["name"] == "task.processed" and e["task"] == "get"]
    # the token is masked, the user is not (it says who, and masking it would mask every text holding it)
    assert processed and processed[0]["data"]["outcome"]["result"] == {"token": "***", "user": "svc-account"}
    log = json.dumps(run.log)
    assert SECRET not in log


def test_key_alias_and_store_provider():
    doc = playbook("{name: get, kind: secrets, key: api, provider: store}", path="t/secrets-alias")
    run = arun(run_local(doc, tools={"noop": NoopTool()}, credentials=CREDENTIALS))
    assert summary(run.state)["ctx"]["saw_real"] is True
    assert SECRET not in json.dumps(run.log)


def test_unknown_secret_is_secret_not_found_routed_by_policy():
    doc = yaml.safe_load("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sec, path: t/secrets-missing}
keychain: [{name: nope, kind: credential}]
workflow:
  - step: start
    tool:
      - name: get
        kind: secrets
        secret: nope
        spec:
          policy:
            rules:
              - when: "{{ outcome.error.kind == 'secret_not_found' and not outcome.error.retryable }}"
                then: {do: continue, set_ctx: {missing: true}}
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop}
""")
    run = arun(run_local(doc, tools={"noop": NoopTool()}, credentials=CREDENTIALS))
    s = summary(run.state)
    assert s["status"] == "COMPLETED" and s["ctx"]["missing"] is True


def test_bad_provider_is_invalid_task():
    out = arun(SecretsTool(dict_resolver(CREDENTIALS)).run({"secret": "api", "provider": "vault"}, {}, ctx()))
    assert out["status"] == "error" and out["error"]["kind"] == "invalid_task"
    assert "credential" in out["error"]["message"] and "store" in out["error"]["message"]
    doc = yaml.safe_load("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sec, path: t/secrets-provider}
workflow:
  - step: start
    tool: {name: get, kind: secrets, secret: api, provider: vault}
""")
    run = arun(run_local(doc, tools={"noop": NoopTool()}, credentials=CREDENTIALS))
    assert summary(run.state)["status"] == "FAILED"
    failed = next(e for e in run.log if e["name"] == "step.failed")
    assert failed["data"]["error"]["kind"] == "invalid_task"


DECLARED = [{"name": "api", "kind": "credential"}]


def test_store_unreachable_is_retryable_secret_unavailable():
    async def fetch(eid, names, grant):
        raise TimeoutError("no responders")

    out = arun(SecretsTool(KeychainCache(fetch), keychain=DECLARED).run({"secret": "api"}, {}, ctx()))
    assert out["error"]["kind"] == "secret_unavailable" and out["error"]["retryable"] is True


def test_plain_resolver_and_sink():
    async def resolver(eid, decls):
        return {d["name"]: CREDENTIALS[d["credential"]] for d in decls if d["credential"] in CREDENTIALS}

    sink: set[str] = set()
    out = arun(SecretsTool(resolver, sink=sink, keychain=DECLARED).run({"secret": "api"}, {}, ctx()))
    assert out["status"] == "ok" and out["result"]["token"] == SECRET
    assert sink == {SECRET, f"svc-account:{SECRET}"}  # the last: what basic auth encodes


def test_later_commands_of_the_execution_mask_fetched_values():
    cache = dict_resolver(CREDENTIALS)
    published: list[dict] = []

    async def publish(e):
        published.append(e)

    def command(cid, tasks):
        return {"execution_id": "e9", "command_id": cid, "step": "s", "step_run_id": f"r-{cid}", "tasks": tasks,
                "keychain": DECLARED}

    arun(execute_command(command("c1", [{"name": "get", "kind": "secrets", "secret": "api"}]),
                         {"noop": NoopTool()}, publish, keychain_resolver=cache))
    assert set(cache.known_secrets("e9")) == {SECRET, f"svc-account:{SECRET}"} and cache.known_secrets("other") == []
    # a later command printing the value (e.g. from its input) is masked too
    terminals = arun(execute_command(command("c2", [{"name": "p", "kind": "noop", "result": f"x-{SECRET}"}]),
                                     {"noop": NoopTool()}, publish, keychain_resolver=cache))
    assert terminals[0]["data"]["result"] == "x-***"
    assert SECRET not in json.dumps(published)


def test_only_names_the_keychain_declares_are_fetched():
    """A secrets task may fetch a credential its playbook's keychain declares (by the entry's name or the
    stored name it gives), nothing else: refused before anything is asked."""
    asked = []

    async def fetch(eid, names, grant):
        asked.append(list(names))
        return {n: {"token": f"{n}-token-value"} for n in names}

    keychain = [{"name": "db", "kind": "credential", "credential": "pg_main"}, {"name": "env", "kind": "env"}]
    tool = SecretsTool(KeychainCache(fetch), keychain=keychain)
    by_entry = arun(tool.run({"secret": "db"}, {}, ctx()))
    by_stored = arun(tool.run({"secret": "pg_main"}, {}, ctx("e2")))
    assert by_entry["result"] == by_stored["result"] == {"token": "pg_main-token-value"}
    for name in ("other", "env", "api"):
        out = arun(tool.run({"secret": name}, {}, ctx("e3")))
        assert out["error"]["kind"] == "secret_not_declared" and not out["error"]["retryable"]
        assert f"secret {name!r} is not declared by the playbook's keychain" in out["error"]["message"]
    assert asked == [["pg_main"], ["pg_main"]]


def test_a_refused_resolution_is_secret_refused():
    from noetl_mesh.core.keychain import KeychainRefused

    async def fetch(eid, names, grant):
        raise KeychainRefused("execution e1 has finished (COMPLETED): its credentials are no longer resolved")

    out = arun(SecretsTool(KeychainCache(fetch), keychain=DECLARED).run({"secret": "api"}, {}, ctx()))
    assert out["error"]["kind"] == "secret_refused" and not out["error"]["retryable"]
    assert "has finished" in out["error"]["message"]
