"""The credential store's rules (core/credentials.py): who may have a credential's data (a worker, for a
command it holds, of its pool and execution, for names its keychain declares, while the execution
runs), the keychain's environment allow-list, and what masking hides (secret fields only, never the
engine's own fields)."""
from __future__ import annotations

import asyncio
import base64

import orjson
import pytest
import yaml

from noetl_mesh.core.credentials import (Invalid, Refused, authorize, check_running, decrypt, encrypt, parse_resolve,
                                         put_fields, use_refusal)
from noetl_mesh.core.keychain import (Keychain, KeychainDenied, KeychainRefused, env_allowed, mask, resolve,
                                      secrets_of)
from noetl_mesh.core.local import run_local
from noetl_mesh.core.state import summary
from noetl_mesh.core.worker import execute_command
from noetl_mesh.tools.noop import NoopTool

KEYCHAIN = [{"name": "db", "kind": "credential", "credential": "pg_main"}, {"name": "api", "kind": "credential"},
            {"name": "home", "kind": "env", "var": "HOME"}, {"name": "k", "kind": "static", "x": "y"}]
COMMAND = {"command_id": "c1", "pool": "default", "execution_id": "e1", "step": "s", "keychain": KEYCHAIN}
INBOX = "_INBOX.UWORKERKEY.abc.1"


def arun(coro):
    return asyncio.run(coro)


def ask(names=("pg_main",), *, pool="default", eid="e1", seq=7, subject="noetl.cmd.default.e1", reply=INBOX):
    return parse_resolve(f"noetl.q.credential.resolve.{pool}", reply,
                         {"execution_id": eid, "names": list(names), "command": {"seq": seq, "subject": subject}})


def refused(fn, *args) -> Refused:
    with pytest.raises(Refused) as caught:
        fn(*args)
    return caught.value


# ------------------------------------------------------------------------------------------ grants
def test_a_command_held_grants_the_names_its_keychain_declares():
    assert authorize(ask(("pg_main", "api")), "noetl.cmd.default.e1", COMMAND) == ["pg_main", "api"]  # earlier versions'
    laned = "noetl.cmd.default.e1.5"  # in a lane of the pool's queue
    assert authorize(ask(("pg_main",), subject=laned), laned, COMMAND) == ["pg_main"]
    check_running(ask(), "RUNNING")
    check_running(ask(), None)  # not recorded yet: its command exists, so admission admitted it


def test_every_forged_or_replayed_resolution_is_refused_with_its_reason():
    cases = {
        "no_command": (ask(), None, None),  # acknowledged, purged, or never sent
        "wrong_execution": (ask(eid="e2", subject="noetl.cmd.default.e1"), "noetl.cmd.default.e1", COMMAND),
        "undeclared": (ask(("pg_main", "other_db")), "noetl.cmd.default.e1", COMMAND),
        "wrong_pool": (ask(pool="gpu", subject="noetl.cmd.default.e1"), "noetl.cmd.default.e1", COMMAND),
    }
    for reason, (a, stored, command) in cases.items():
        r = refused(authorize, a, stored, command)
        assert r.reason == reason, (reason, r.message)
    # the stored subject is not the one the worker named; a command whose body says another execution
    assert refused(authorize, ask(), "noetl.cmd.default.e9", COMMAND).reason == "no_command"
    assert refused(authorize, ask(), "noetl.cmd.default.e1", {**COMMAND, "execution_id": "e9"}).reason == \
        "wrong_execution"
    assert refused(authorize, ask(), "noetl.cmd.default.e1", {**COMMAND, "pool": "gpu"}).reason == "wrong_execution"
    assert refused(authorize, ask(subject="noetl.cmd.default"), "noetl.cmd.default", COMMAND).reason == "no_command"
    for odd in ("noetl.cmd.default.e1.8", "noetl.cmd.default.e1.05", "noetl.cmd.default.e1.x", "noetl.cmd.default.e1.3.4",
                "noetl.evt.default.e1.3"):  # no lane of a pool's queue, or no command subject
        assert refused(authorize, ask(subject=odd), odd, COMMAND).reason == "no_command", odd
    assert refused(authorize, ask(pool="gpu", subject="noetl.cmd.default.e1.5"), "noetl.cmd.default.e1.5",
                   COMMAND).reason == "wrong_pool"
    # an env or static entry's name is no credential of the keychain
    assert refused(authorize, ask(("home",)), "noetl.cmd.default.e1", COMMAND).reason == "undeclared"
    assert refused(authorize, ask(("k",)), "noetl.cmd.default.e1", COMMAND).reason == "undeclared"
    # the entry's name is not the stored name it stands for
    message = refused(authorize, ask(("db",)), "noetl.cmd.default.e1", COMMAND).message
    assert "'db'" in message and "declared: 'api', 'pg_main'" in message
    for status in ("COMPLETED", "FAILED", "CANCELLED"):
        r = refused(check_running, ask(), status)
        assert r.reason == "finished" and status in r.message


def test_malformed_requests_and_replies_are_refused():
    r = refused(parse_resolve, "noetl.q.credential.resolve.default", "noetl.cancel.x",
                {"execution_id": "e1", "names": ["a"], "command": {"seq": 1, "subject": "s"}})
    assert r.reason == "bad_reply" and "inbox" in r.message
    for reply in (None, "", "_INBOX.", "noetl.evt.worker.ctl.e1"):
        assert refused(parse_resolve, "noetl.q.credential.resolve.default", reply, {}).reason == "bad_reply"
    for body in (None, [], {"names": ["a"], "command": {"seq": 1, "subject": "s"}},
                 {"execution_id": "e1", "names": [], "command": {"seq": 1, "subject": "s"}},
                 {"execution_id": "e1", "names": ["bad name"], "command": {"seq": 1, "subject": "s"}},
                 {"execution_id": "e1", "names": ["a"] * 65, "command": {"seq": 1, "subject": "s"}},
                 {"execution_id": "e1", "names": ["a"]},
                 {"execution_id": "e1", "names": ["a"], "command": {"seq": 0, "subject": "s"}},
                 {"execution_id": "e1", "names": ["a"], "command": {"seq": True, "subject": "s"}},
                 {"execution_id": "e.*", "names": ["a"], "command": {"seq": 1, "subject": "s"}}):
        assert refused(parse_resolve, "noetl.q.credential.resolve.default", INBOX, body).reason == "bad_request", body
    assert refused(parse_resolve, "noetl.q.credential.resolve", INBOX, {}).reason == "bad_request"


def test_sealing_binds_the_name_and_put_checks_its_fields():
    from cryptography.exceptions import InvalidTag

    key = bytes(range(32))
    blob, nonce = encrypt(key, "a", {"password": "pw"})
    assert decrypt(key, "a", blob, nonce) == {"password": "pw"}
    with pytest.raises(InvalidTag):
        decrypt(key, "b", blob, nonce)  # a row copied under another name does not open
    assert put_fields({"name": "a", "data": {"x": 1}}) == ("a", "generic", {"x": 1}, None, None, None)
    assert put_fields({"name": "a", "data": {"x": 1}, "roles": ["developer", "admin"]})[4] == ["admin", "developer"]
    dev = {"user_id": "a" * 32, "username": "dev"}
    assert put_fields({"name": "a", "data": {"x": 1}, "roles": [], "users": [dev, dev]})[4:] == ([], [dev])
    assert put_fields({"name": "a", "data": {"x": 1}, "users": [dev]})[4:] == (None, [dev])
    # roles none, users kept: the store refuses it if the credential names nobody either (its check)
    assert put_fields({"name": "a", "data": {"x": 1}, "roles": []})[4:] == ([], None)
    for bad in ({"name": "x"}, {"name": "x", "data": {}}, {"name": "bad name", "data": {"a": 1}},
                {"name": "x", "kind": "no spaces", "data": {"a": 1}}, {"name": "x", "data": {"a": 1}, "description": 1},
                {"name": "x", "data": {"a": 1}, "roles": ["root"]},
                {"name": "x", "data": {"a": 1}, "roles": [1]}, {"name": "x", "data": {"a": 1}, "users": "dev"},
                {"name": "x", "data": {"a": 1}, "roles": [], "users": []},
                {"name": "x", "data": {"a": 1}, "users": [{"user_id": "u-1", "username": "dev"}]},
                {"name": "x", "data": {"a": 1}, "users": [dev] * 101}):
        with pytest.raises(Invalid):
            put_fields(bad)


# ------------------------------------------------------------------------------------------ env entries
def test_env_entries_read_only_what_the_pool_exposes():
    assert env_allowed("API_TOKEN", "API_TOKEN,PARTNER_*") and env_allowed("PARTNER_X", "API_TOKEN, PARTNER_*")
    assert not env_allowed("HOME", "API_TOKEN,PARTNER_*") and not env_allowed("API_TOKEN", None)
    assert not env_allowed("NOETL_CREDENTIAL_KEY", "*")  # the engine's own settings never
    environ = {"API_TOKEN": "tok-123456", "HOME": "/root", "NOETL_NATS_CREDS": "/x/worker.nk",
               "NOETL_KEYCHAIN_ENV": "API_TOKEN,MISSING_*,NOETL_*"}
    decls = [{"name": "api", "kind": "env", "var": "API_TOKEN"}, {"name": "home", "kind": "env", "var": "HOME"},
             {"name": "seed", "kind": "env", "var": "NOETL_NATS_CREDS"},
             {"name": "gone", "kind": "env", "var": "MISSING_ONE"}]
    kc = arun(resolve(decls, "e1", environ=environ))
    assert dict(kc) == {"api": {"value": "tok-123456"}}
    with pytest.raises(KeychainDenied, match="HOME, which this worker pool does not expose to playbooks: add it to "
                                             "NOETL_KEYCHAIN_ENV"):
        kc["home"]
    with pytest.raises(KeychainDenied, match=r"engine's own settings \(NOETL_\*\)"):
        kc.get("seed")
    with pytest.raises(KeychainDenied, match="MISSING_ONE is not set"):
        kc["gone"]
    assert kc.get("nothing") is None and "home" not in kc
    assert arun(resolve(decls[1:2], "e1", environ={})) and not Keychain()  # only denied: still a keychain


def test_a_task_reading_a_denied_entry_fails_naming_the_variable_and_the_setting(monkeypatch):
    monkeypatch.delenv("NOETL_KEYCHAIN_ENV", raising=False)
    monkeypatch.setenv("KC_RULES_TOKEN", "never-seen-token")
    doc = yaml.safe_load("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kc, path: t/kc-env-denied}
keychain: [{name: tok, kind: env, var: KC_RULES_TOKEN}]
workflow:
  - step: start
    tool:
      - {name: free, kind: noop, result: fine}
      - {name: reads, kind: noop, result: "{{ keychain.tok.value }}"}
""")
    run = arun(run_local(doc, tools={"noop": NoopTool()}))
    assert summary(run.state)["status"] == "FAILED"
    outcomes = {e["task"]: e["data"]["outcome"] for e in run.log if e["name"] == "task.processed"}
    assert outcomes["free"]["status"] == "ok"  # a task that does not read it runs
    error = outcomes["reads"]["error"]
    assert error["kind"] == "template_error"
    assert "KC_RULES_TOKEN" in error["message"] and "NOETL_KEYCHAIN_ENV" in error["message"]
    assert "never-seen-token" not in orjson.dumps(run.log).decode()


def test_a_refused_credential_is_a_denied_entry():
    async def resolver(eid, decls):
        raise KeychainRefused("execution e1 has finished (COMPLETED)")

    kc = arun(resolve(KEYCHAIN[:2], "e1", resolver))
    with pytest.raises(KeychainDenied, match="credential 'pg_main'.*has finished"):
        kc["db"]


# ------------------------------------------------------------------------------------------ masking
def test_only_secret_fields_are_masked():
    data = {"db": {"host": "db.internal", "port": 5432, "user": "postgres", "dbname": "postgres",
                   "password": "pg-pass-123", "sslmode": "require"},
            "api": {"token": "api-tok-456", "client_id": "the-client"},
            "dsn": {"dsn": "postgresql://app:dsn%2Fpw-789@db.internal:5432/postgres?sslmode=require"},
            "kv": {"dsn": "host=db.internal user=postgres password='kv pw 0' dbname=postgres"},
            "key": {"private_key": "-----BEGIN PRIVATE KEY-----\nMIIabc\n-----END PRIVATE KEY-----"}}
    found = set(secrets_of(data))
    for secret in ("pg-pass-123", "api-tok-456", "the-client", "dsn%2Fpw-789", "dsn/pw-789", "kv pw 0",
                   "postgres:pg-pass-123", data["key"]["private_key"], data["dsn"]["dsn"], data["kv"]["dsn"]):
        assert secret in found, secret
    for public in ("db.internal", "postgres", "require"):
        assert public not in found, public


def test_a_credential_whose_user_is_postgres_leaves_the_error_kind_alone():
    """The reproduction: a user 'postgres' masked turned postgres_error into ***_error, and the arc that
    routes on the error kind no longer matched."""
    secrets = secrets_of({"db": {"user": "postgres", "password": "pg-pass-123", "host": "localhost"}})
    outcome = {"status": "error", "error": {"kind": "postgres_error", "message": "password pg-pass-123 for postgres"}}
    assert mask(outcome, secrets)["error"] == {"kind": "postgres_error", "message": "password *** for postgres"}


def test_the_engines_own_fields_are_never_masked_even_when_a_secret_equals_them():
    """A secret that happens to be an error kind, a status or a step name: the data is masked, the fields
    the engine routes on are not."""
    events = []

    async def publish(e):
        events.append(e)

    class Fails:
        async def run(self, task, spec, ctx):
            return {"status": "error", "error": {"kind": "http_error", "message": "http_error from ok"}}

    keychain = {"tok": {"token": "http_error"}, "other": {"secret": "start"}}
    command = {"command_id": "c1", "pool": "default", "execution_id": "e1", "step": "start", "step_run_id": "r1",
               "iteration": None, "chunk": None, "tasks": [{"name": "start", "kind": "fails"}], "workbook": [],
               "spec_layers": {}, "workload": {}, "ctx": {}, "args": {}, "iter": None, "steps": {},
               "keychain": keychain, "loop_mode": None}
    terminals = arun(execute_command(command, {"fails": Fails()}, publish))
    processed = next(e for e in events if e["name"] == "task.processed")
    assert processed["task"] == "start" and processed["step"] == "start"
    assert processed["data"]["outcome"]["status"] == "error"
    assert processed["data"]["outcome"]["error"]["kind"] == "http_error"
    assert processed["data"]["outcome"]["error"]["message"] == "*** from ok"
    assert terminals[0]["data"]["error"]["kind"] == "http_error"
    assert terminals[0]["data"]["error"]["message"] == "*** from ok"


def test_an_arc_routes_on_postgres_error_with_a_postgres_user(monkeypatch):
    doc = yaml.safe_load("""
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kc, path: t/kc-route}
keychain: [{name: db, kind: credential, credential: pg}]
workflow:
  - step: start
    tool:
      - name: q
        kind: http
        url: http://db.invalid/
    next:
      arcs:
        - {step: recover, when: "{{ event.error.kind == 'postgres_error' }}"}
  - step: recover
    tool: {kind: noop, result: recovered}
""")

    class Failing:
        async def run(self, task, spec, ctx):
            user = ctx.keychain["db"]["user"]
            return {"status": "error", "error": {"kind": f"{user}_error", "message": f"role {user} refused"}}

    run = arun(run_local(doc, tools={"noop": NoopTool(), "http": Failing()},
                         credentials={"pg": {"user": "postgres", "password": "pg-pw-99"}}))
    s = summary(run.state)
    assert s["steps"]["recover"]["result"] == "recovered", s
    assert s["status"] == "COMPLETED"


def test_encoded_forms_of_secret_fields_are_still_masked():
    secret = "p@ss/wörd"
    secrets = secrets_of({"api": {"user": "svc", "token": secret}})
    basic = base64.b64encode(f"svc:{secret}".encode()).decode()
    text = f"Authorization: Basic {basic}; t={base64.b64encode(secret.encode()).decode()}; q=p%40ss%2Fw%C3%B6rd"
    assert mask(text, secrets) == "Authorization: Basic ***; t=***; q=***"


# ------------------------------------------------------------------------------------------ who may use one (D24)
ADMIN = {"user_id": "u-admin", "username": "ada", "roles": ["admin"]}
DEV = {"user_id": "u-dev", "username": "dev", "roles": ["developer"]}
STANDING = {"u-admin": {"active": True, "roles": ["admin"]}, "u-dev": {"active": True, "roles": ["developer"]}}


def used_by(starter, author, callers=(), roles=None, standing=STANDING, users=None):
    command = {**COMMAND, "requested_by": starter, "authored_by": author, "called_by": list(callers)}
    roles = {"pg_main": ["admin"]} if roles is None else roles
    return use_refusal(command, {k: (v, (users or {}).get(k, [])) for k, v in roles.items()}, standing)


DEV2 = {"user_id": "u-dev2", "username": "eve", "roles": ["developer"]}


def test_a_credential_that_names_users_is_theirs_whatever_their_roles():
    mine = {"pg_main": [{"user_id": "u-dev", "username": "dev"}]}
    assert used_by(DEV, DEV, users=mine) is None  # dev's own playbook: named, though not an admin
    assert used_by(ADMIN, DEV, users=mine) is None  # an admin runs it: the admin holds the role
    refused = used_by({**DEV2}, DEV, users=mine, standing={**STANDING, "u-dev2": {"active": True, "roles": ["developer"]}})
    assert refused.reason == "not_allowed" and "started by eve, who has developer" in refused.message
    assert "users with the role admin or the users dev (its roles and users, D24" in refused.message
    # another developer's playbook, started by dev: its author is not named
    assert "written by eve" in used_by(DEV, DEV2, users=mine, standing={**STANDING, "u-dev2": {
        "active": True, "roles": ["developer"]}}).message
    # a named user who is disabled is refused all the same
    assert "disabled" in used_by(DEV, DEV, users=mine, standing={**STANDING, "u-dev": {"active": False}}).message
    # a credential of named users only (no role): an admin is refused too
    only = used_by(ADMIN, ADMIN, roles={"pg_main": []}, users=mine)
    assert "written by the users dev (its users, D24" in only.message


def test_a_credential_is_used_only_when_every_user_of_the_command_holds_one_of_its_roles():
    assert used_by(ADMIN, ADMIN) is None
    assert used_by(DEV, DEV, roles={"pg_main": ["admin", "developer"]}) is None
    # a developer's own playbook naming an admin's credential: the reason names the credential, its roles, who
    refused = used_by(DEV, DEV)
    assert refused.reason == "not_allowed"
    assert "credential 'pg_main'" in refused.message and "role admin" in refused.message
    assert "started by dev, who has developer" in refused.message and "(its roles, D24" in refused.message
    # an admin's playbook started by a developer, and a developer's playbook started by an admin
    assert "started by dev" in used_by(DEV, ADMIN).message
    assert "written by dev" in used_by(ADMIN, DEV).message
    # an admin's playbook called as a child from a developer's: the caller counts too
    assert "called by a playbook written by dev" in used_by(ADMIN, ADMIN, callers=[DEV]).message
    # one name refused refuses the resolution
    assert used_by(ADMIN, ADMIN, roles={"pg_main": ["admin"], "api": ["developer"]}).reason == "not_allowed"


def test_the_roles_counted_are_held_now_and_carried_by_the_request():
    narrowed = {**ADMIN, "roles": ["developer"]}  # an admin's API token narrowed to developer
    assert "who holds admin now and whose request carried developer" in used_by(narrowed, ADMIN).message
    demoted = {**STANDING, "u-admin": {"active": True, "roles": ["viewer"]}}
    assert "who holds viewer now and whose request carried admin" in used_by(ADMIN, ADMIN, standing=demoted).message
    plain = {"user_id": "u-admin", "username": "ada"}  # a request that carried no roles: the roles held now
    assert "who has viewer" in used_by(plain, plain, standing=demoted).message
    disabled = {**STANDING, "u-admin": {"active": False, "roles": ["admin"]}}
    assert "who is disabled or removed" in used_by(ADMIN, ADMIN, standing=disabled).message
    assert "who is disabled or removed" in used_by(ADMIN, ADMIN, standing={}).message  # not known: not active


def test_an_unknown_author_is_refused_and_an_execution_nobody_started_has_nobody_to_check():
    assert "written by no user known" in used_by(ADMIN, None).message
    assert "called by a playbook written by no user known" in used_by(ADMIN, ADMIN, callers=[{}]).message
    assert used_by(None, None, standing={}) is None  # a stack without users (noetl run)
    assert used_by(ADMIN, ADMIN, roles={}) is None  # nothing stored under the names: nothing to use


def test_a_tree_deeper_than_the_authors_kept_has_an_author_not_known_at_its_top():
    """The authors above a child are kept to the nearest MAX_CALLERS: past that, the top ones are one
    author not known, which a credential (or a pool) naming roles refuses, rather than forgotten."""
    from types import SimpleNamespace

    from noetl_mesh.core.decide import MAX_CALLERS, callers

    authors = [{"user_id": f"u{i}", "username": f"a{i}"} for i in range(MAX_CALLERS + 5)]
    kept = callers(SimpleNamespace(request={"called_by": authors}))
    assert len(kept) == MAX_CALLERS and kept[0] == {} and kept[1:] == authors[-(MAX_CALLERS - 1):]
    assert callers(SimpleNamespace(request={"called_by": authors[:MAX_CALLERS]})) == authors[:MAX_CALLERS]
    standing = {a["user_id"]: {"active": True, "roles": ["admin"]} for a in authors} | STANDING
    assert "called by a playbook written by no user known" in used_by(ADMIN, ADMIN, kept, standing=standing).message
