"""D24 against real Postgres and NATS: the encrypted credential store behind the gateway and the CLI,
and the secret scan — a playbook uses a stored secret; no stored event, stream message or log line of
the stack holds it."""
from __future__ import annotations

import base64
import json
import hashlib
import logging
import os
from typing import Any, Iterator

import httpx
import orjson
import psycopg
import pytest
from nats.js.errors import NotFoundError

from noetl_mesh.cli import main as cli
from noetl_mesh.core.credentials import decrypt
from noetl_mesh.infra.bus import COMMANDS, EVENTS, Bus, BusError
from noetl_mesh.services.sessions.audit import STREAM as AUDIT
from noetl_mesh.services.sessions.store import LOGINS, SESSIONS, USERS
from noetl_mesh.services.worker import service as worker_service

from conftest import Capture, start_stack, stop_stack

pytestmark = pytest.mark.integration

KEY = base64.b64encode(bytes(range(32))).decode()
SECRET = "pw-Zq81-very-secret"
PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kc, path: tests/keychain}
workload: {api: API}
keychain:
  - {name: db, kind: credential, credential: scan_db}
workflow:
  - step: start
    tool:
      - name: call
        kind: http
        method: POST
        url: "{{ workload.api }}/echo"
        headers: {Authorization: "Bearer {{ keychain.db.password }}"}
        json: {token: "{{ keychain.db.password }}", user: "{{ keychain.db.user }}"}
      - name: nested
        kind: playbook
        path: tests/keychain_child
        args: {token: "{{ keychain.db.password }}"}
      - name: plain
        kind: noop
        result: "{{ keychain.db.password }}"
    next: {arcs: [{step: end}]}
  - step: end
    tool: {kind: noop, result: "{{ start.result }}"}
"""

# a child execution with its own keychain entry for the same stored secret (values passed in args
# arrive masked: the child resolves the credential itself)
CHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: kc_child, path: tests/keychain_child}
workload: {api: API}
keychain:
  - {name: db, kind: credential, credential: scan_db}
workflow:
  - step: start
    tool:
      kind: http
      method: POST
      url: "{{ workload.api }}/echo"
      json: {token: "{{ keychain.db.password }}", passed: "{{ args.token }}"}
"""


@pytest.fixture(scope="module")
def kc_stack(module_pg, fixture_api) -> Iterator[Any]:
    """A whole stack whose credentials service encrypts with a test key; the logs of every service are
    captured, and every command a worker runs."""
    old = os.environ.get("NOETL_CREDENTIAL_KEY")
    os.environ["NOETL_CREDENTIAL_KEY"] = KEY
    capture = Capture()
    root = logging.getLogger()
    level = root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    real = worker_service.execute_command

    async def wired(command, tools, publish, **kw):
        handle.commands.append(orjson.dumps(command).decode())
        return await real(command, tools, publish, **kw)

    worker_service.execute_command = wired
    nats, loop, handle = start_stack(module_pg, allow_net=fixture_api.endpoint)  # its tasks call the API (D33)
    handle.capture = capture
    handle.commands = []
    try:
        yield handle
    finally:
        stop_stack(nats, loop, handle)
        worker_service.execute_command = real
        root.removeHandler(capture)
        root.setLevel(level)
        if old is None:
            os.environ.pop("NOETL_CREDENTIAL_KEY", None)
        else:
            os.environ["NOETL_CREDENTIAL_KEY"] = old


def test_store_encrypted_get_list_delete_and_bad_bodies(kc_stack, module_pg) -> None:
    with httpx.Client(base_url=kc_stack.url, trust_env=False, headers=kc_stack.headers) as gw:
        made = gw.post("/api/credentials", json={"name": "pg_main", "kind": "postgres",
                                                 "data": {"user": "app", "password": "s3cr3t-pg-pass"},
                                                 "description": "main db"})
        assert made.status_code == 201, made.text
        assert set(made.json()) == {"name", "kind", "description", "roles", "users", "created_at", "updated_at"}
        with psycopg.connect(module_pg) as conn:
            name, kind, data, nonce = conn.execute(
                "SELECT name, kind, data, nonce FROM credential WHERE name = 'pg_main'").fetchone()
            raw = conn.execute("SELECT credential::text FROM credential").fetchall()
        assert kind == "postgres" and len(bytes(nonce)) == 12
        assert b"s3cr3t-pg-pass" not in bytes(data) and "s3cr3t-pg-pass" not in str(raw)
        assert decrypt(base64.b64decode(KEY), name, data, nonce) == {"user": "app", "password": "s3cr3t-pg-pass"}

        meta = gw.get("/api/credentials/pg_main").json()
        assert "data" not in meta and meta["kind"] == "postgres" and meta["description"] == "main db"
        full = gw.get("/api/credentials/pg_main", params={"include_data": "true"}).json()
        assert full["data"] == {"user": "app", "password": "s3cr3t-pg-pass"}
        # replace: new data, same row
        again = gw.post("/api/credentials", json={"name": "pg_main", "kind": "postgres", "data": {"password": "other-pw"}})
        assert again.status_code == 201 and again.json()["created_at"] == made.json()["created_at"]
        assert gw.get("/api/credentials/pg_main", params={"include_data": True}).json()["data"] == {"password": "other-pw"}

        listed = gw.get("/api/credentials").json()
        assert [c["name"] for c in listed if c["name"] == "pg_main"] == ["pg_main"]
        assert all("data" not in c for c in listed) and "other-pw" not in str(listed)

        for bad in ({"name": "x"}, {"name": "x", "data": {}}, {"name": "x", "data": [1]},
                    {"name": "bad name!", "data": {"a": 1}}, {"name": "x", "data": {"a": 1}, "extra": 1},
                    {"name": "x", "kind": "no spaces", "data": {"a": 1}}, {"data": {"a": 1}}):
            resp = gw.post("/api/credentials", json=bad)
            assert resp.status_code == 422, (bad, resp.text)

        assert gw.delete("/api/credentials/pg_main").status_code == 204
        assert gw.delete("/api/credentials/pg_main").status_code == 404
        assert gw.get("/api/credentials/pg_main").status_code == 404
        assert gw.get("/api/credentials/bad%20name").status_code == 400


def test_cli_add_list_delete(kc_stack, capsys, monkeypatch) -> None:
    url = kc_stack.url
    monkeypatch.setenv("NOETL_TOKEN", kc_stack.token)
    assert cli(["credential", "add", "cli_cred", "--kind", "http", "--data", '{"token": "cli-tok-987"}',
                "--description", "from the cli", "--gateway", url]) == 0
    assert '"name": "cli_cred"' in capsys.readouterr().out
    assert cli(["credential", "list", "--gateway", url]) == 0
    out = capsys.readouterr().out
    assert "cli_cred" in out and "cli-tok-987" not in out
    assert cli(["credential", "add", "x", "--data", "not json", "--gateway", url]) == 2
    # who may use it from a playbook (D24): admin when not said; set at once or later
    assert cli(["credential", "roles", "cli_cred", "developer,admin", "--gateway", url, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["roles"] == ["admin", "developer"]
    assert cli(["credential", "roles", "cli_cred", "root", "--gateway", url]) != 0
    assert "root" in capsys.readouterr().err
    # or named users alone (D24): the credential is theirs whatever their roles
    assert cli(["credential", "roles", "cli_cred", "none", "--users", "admin", "--gateway", url, "-o", "json"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert named["roles"] == [] and [u["username"] for u in named["users"]] == ["admin"]
    assert cli(["credential", "roles", "cli_cred", "none", "--users", "none", "--gateway", url]) != 0
    assert "roles" in capsys.readouterr().err  # nobody at all could use it
    assert cli(["credential", "add", "cli_ops", "--data", '{"token": "t-2"}', "--roles", "operator",
                "--gateway", url, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["roles"] == ["operator"]
    assert cli(["credential", "delete", "cli_ops", "--gateway", url]) == 0
    assert cli(["credential", "delete", "cli_cred", "--gateway", url]) == 0
    assert cli(["credential", "delete", "cli_cred", "--gateway", url]) == 1


async def _stream_texts(nats_url: str, stream: str, creds: str | None = None) -> list[str]:
    """Every message still in the stream, read by sequence (a work-queue stream keeps only the
    commands not yet acknowledged; the commands the workers took are scanned as they arrive)."""
    bus = await Bus.connect(nats_url, "kc-scan", creds)
    try:
        state = (await bus.js.stream_info(stream)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            try:
                msg = await bus.js.get_msg(stream, seq)
            except NotFoundError:
                continue
            out.append((msg.data or b"").decode("utf-8", "replace") + str(msg.headers or ""))
        return out
    finally:
        await bus.close()


def _logins_tokens_and_revocations(url: str, admin_token: str) -> tuple[list[str], list[str], list[str]]:
    """Through the gateway: a user added with a password, logins (one failed), an API token created,
    used and revoked, a password change, a logout, a disabled user. Returns the passwords, the tokens
    and every answer's text (the answers that issue a token without that one field)."""
    passwords = ["scan user password 1", "scan user password 2", "wrong scan password 3"]
    tokens, answers = [admin_token], []

    def keep(resp: httpx.Response, issued: str | None = None) -> httpx.Response:
        assert resp.status_code < 500, resp.text
        body = resp.json() if resp.content else None
        if issued and isinstance(body, dict):
            tokens.append(body.pop(issued))
        answers.append(f"{resp.status_code} {body} {dict(resp.headers)}")
        return resp

    bearer = lambda token: {"Authorization": f"Bearer {token}"}  # noqa: E731
    with httpx.Client(base_url=url, trust_env=False) as gw:
        admin = bearer(admin_token)
        user = keep(gw.post("/api/users", headers=admin, json={"username": "scanner", "password": passwords[0],
                                                                "roles": ["developer"]})).json()
        assert keep(gw.post("/api/auth/login", json={"username": "scanner", "password": passwords[2]})).status_code == 401
        session = keep(gw.post("/api/auth/login", json={"username": "scanner", "password": passwords[0]}), "token")
        me = bearer(tokens[-1])
        assert keep(gw.get("/api/auth/whoami", headers=me)).status_code == 200
        made = keep(gw.post("/api/tokens", headers=me, json={"name": "scan"}), "token").json()
        assert keep(gw.get("/api/tokens", headers=bearer(tokens[-1]))).status_code == 200
        keep(gw.get("/api/sessions", headers=me))
        keep(gw.post("/api/users/me/password", headers=me, json={"password": passwords[1],
                                                                 "current_password": passwords[0]}))
        keep(gw.delete(f"/api/tokens/{made['token_id']}", headers=me))
        assert keep(gw.get("/api/auth/whoami", headers=bearer(tokens[-1]))).status_code == 401  # revoked
        keep(gw.post("/api/auth/logout", headers=me))
        assert keep(gw.get("/api/auth/whoami", headers=me)).status_code == 401
        keep(gw.post("/api/auth/login", json={"username": "scanner", "password": passwords[1]}), "token")
        keep(gw.post(f"/api/users/{user['user_id']}/disable", headers=admin))
        assert keep(gw.get("/api/auth/whoami", headers=bearer(tokens[-1]))).status_code == 401
        keep(gw.get("/api/audit", headers=admin, params={"limit": 1000}))
        keep(gw.get("/api/users", headers=admin))
        assert session.status_code == 200
    return passwords, tokens, answers


def test_secret_scan(kc_stack, module_pg, fixture_api) -> None:
    passwords, tokens, answers = _logins_tokens_and_revocations(kc_stack.url, kc_stack.token)
    with httpx.Client(base_url=kc_stack.url, trust_env=False, headers=kc_stack.headers) as gw:
        assert gw.post("/api/credentials", json={"name": "scan_db", "kind": "generic",
                                                 "data": {"user": "scanner", "password": SECRET}}).status_code == 201
        assert gw.post("/api/catalog", json={"content": CHILD.replace("API", fixture_api.url)}).status_code == 201
    status, events = kc_stack.execute(PLAYBOOK.replace("API", fixture_api.url))
    assert status["status"] == "COMPLETED", status
    nested = next(e for e in events if e["task"] == "nested" and e["name"] == "task.processed")["data"]["outcome"]
    assert nested["result"]["steps"]["start"]["result"] == {"echo": {"token": "***", "passed": "***"}}
    assert len(status["children"]) == 1
    # the tasks used the real secret (the echo answered it), but everything recorded shows ***
    assert status["steps"]["start"]["result"] == "***"
    call = [e for e in events if e["task"] == "call" and "outcome" in (e.get("data") or {})]
    assert call and call[-1]["data"]["outcome"]["status"] == "ok"
    # the password is masked; the user is not a secret (it says who: masking it would mask every text
    # holding that word, error kinds included)
    assert call[-1]["data"]["outcome"]["result"] == {"echo": {"token": "***", "user": "scanner"}}

    hits: list[str] = []
    with psycopg.connect(module_pg) as conn:
        rows = conn.execute("SELECT e::text FROM event e").fetchall()
        assert len(rows) >= len(events)
        hits += [r[0] for r in rows if SECRET in r[0]]
        hits += [r[0] for r in conn.execute("SELECT x::text FROM execution x").fetchall() if SECRET in r[0]]
    messages = kc_stack.run(_stream_texts(kc_stack.nats_url, EVENTS, kc_stack.admin)) + kc_stack.run(
        _stream_texts(kc_stack.nats_url, COMMANDS, kc_stack.admin))
    assert messages and kc_stack.commands
    assert any('"kind":"credential"' in c for c in kc_stack.commands)  # declarations travel, not values
    messages += kc_stack.commands
    hits += [m for m in messages if SECRET in m]
    hits += [line for line in kc_stack.capture.lines if SECRET in line]
    assert hits == []

    # nor any password, token or token hash of the logins: in logs, events, projections, streams
    # (events, commands, the audit log, every message of the sessions' KV buckets) or answers
    secrets = {f"password {i}": pw for i, pw in enumerate(passwords)}
    for i, token in enumerate(tokens):
        digest = hashlib.sha256(token.encode()).digest()
        secrets.update({f"token {i}": token, f"token {i} sha256": digest.hex(),
                        f"token {i} sha256 b64": base64.b64encode(digest).decode(),
                        f"token {i} sha256 b64url": base64.urlsafe_b64encode(digest).decode().rstrip("="),
                        f"token {i} id digest": hashlib.sha256(b"noetl.token-id\x00" + token.encode()).hexdigest()})
    assert len(tokens) == 4 and all(t.startswith(("noetl_s_", "noetl_t_")) for t in tokens)
    with psycopg.connect(module_pg) as conn:
        rows = [r[0] for r in conn.execute("SELECT e::text FROM event e UNION ALL SELECT x::text FROM execution x")]
    stored = {stream: kc_stack.run(_stream_texts(kc_stack.nats_url, stream, kc_stack.admin))
              for stream in (EVENTS, COMMANDS, AUDIT, f"KV_{SESSIONS}", f"KV_{USERS}", f"KV_{LOGINS}")}
    assert stored[AUDIT] and stored[f"KV_{USERS}"]
    places = {"logs": "\n".join(kc_stack.capture.lines), "postgres": "\n".join(rows), "answers": "\n".join(answers),
              "commands": "\n".join(kc_stack.commands), **{s: "\n".join(texts) for s, texts in stored.items()}}
    assert "session.login_failed" in places[AUDIT] and "credential.written" in places[AUDIT]
    found = [(what, where) for where, text in places.items() for what, secret in secrets.items() if secret in text]
    assert found == []


def test_key_file_generated_with_mode_600_in_the_home_given(tmp_path, monkeypatch) -> None:
    from noetl_mesh.services.credentials.store import load_key

    monkeypatch.delenv("NOETL_CREDENTIAL_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    assert load_key(home, create=False) is None
    key = load_key(home, create=True)
    path = home / "credential.key"
    assert len(key) == 32 and (path.stat().st_mode & 0o777) == 0o600
    assert load_key(home, create=False) == key
    assert not (tmp_path / ".noetl").exists()  # never the working directory's
    assert load_key(None, create=True) is None  # no home, no key file: only NOETL_CREDENTIAL_KEY
    monkeypatch.setenv("NOETL_CREDENTIAL_KEY", "bm90IDMyIGJ5dGVz")
    with pytest.raises(ValueError, match="32 bytes"):
        load_key(home, create=False)


def test_rotation_reencrypts_on_start(nats_url, pg_dsn, monkeypatch) -> None:
    import asyncio

    from noetl_mesh.services.credentials import CredentialsService

    old_key, new_key = base64.b64encode(b"o" * 32).decode(), base64.b64encode(b"n" * 32).decode()

    async def with_service(fn):
        bus = await Bus.connect(nats_url, "kc-rotate")
        await bus.setup(partitions=4)
        service = CredentialsService(bus, pg_dsn=pg_dsn)
        await service.start()
        try:
            return await fn(service)
        finally:
            await service.stop()
            await bus.close()

    monkeypatch.setenv("NOETL_CREDENTIAL_KEY", old_key)
    asyncio.run(with_service(lambda svc: svc.put({"name": "rot", "data": {"password": "rotate-me"}})))
    monkeypatch.setenv("NOETL_CREDENTIAL_KEY", new_key)
    monkeypatch.setenv("NOETL_CREDENTIAL_KEY_OLD", old_key)
    got = asyncio.run(with_service(lambda svc: svc.get({"name": "rot", "include_data": True})))
    assert got["data"] == {"password": "rotate-me"}
    with psycopg.connect(pg_dsn) as conn:
        data, nonce = conn.execute("SELECT data, nonce FROM credential WHERE name = 'rot'").fetchone()
    assert decrypt(base64.b64decode(new_key), "rot", data, nonce) == {"password": "rotate-me"}


def test_rows_the_recorder_stored_before_are_read_and_values_postgres_cannot_store_refused(
        nats_url, pg_dsn, monkeypatch, caplog) -> None:
    """The table the event-recorder made (its migration 2) is the credentials service's now: a row sealed
    before reads back, an admin's only (D24: the service says so as it migrates); a description Postgres
    cannot store is a bad request, data with a NUL is fine (it is sealed bytes)."""
    import asyncio

    from noetl_mesh.core.credentials import encrypt
    from noetl_mesh.services.credentials import CredentialsService
    from noetl_mesh.services.event_recorder import schema

    monkeypatch.setenv("NOETL_CREDENTIAL_KEY", KEY)

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(pg_dsn)
        async with conn:
            await schema.migrate(conn)  # the recorder's migrations: no credential table any more
            await conn.execute("""CREATE TABLE IF NOT EXISTS credential (id bigserial PRIMARY KEY,
                name text NOT NULL UNIQUE, kind text NOT NULL DEFAULT 'generic', description text,
                data bytea NOT NULL, nonce bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
                updated_at timestamptz NOT NULL DEFAULT now())""")  # what the recorder's migration 2 made
            blob, nonce = encrypt(base64.b64decode(KEY), "before", {"password": "kept-from-before"})
            await conn.execute("INSERT INTO credential (name, kind, data, nonce) VALUES ('before', 'postgres', %s, %s)",
                               (blob, nonce))
            await conn.commit()
        bus = await Bus.connect(nats_url, "kc-before")
        await bus.setup(partitions=4)
        service = CredentialsService(bus, pg_dsn=pg_dsn)
        await service.start()
        try:
            got = await bus.request("noetl.q.credential.get", {"name": "before", "include_data": True})
            assert got["data"] == {"password": "kept-from-before"} and got["kind"] == "postgres"
            assert got["roles"] == ["admin"]
            assert any("1 stored credential(s) may now be used only by the playbooks of admins" in r.getMessage()
                       for r in caplog.records), caplog.records
            with pytest.raises(BusError) as bad:
                await bus.request("noetl.q.credential.put", {"name": "c", "kind": "generic", "data": {"a": 1},
                                                             "description": "a\x00b"})
            assert bad.value.kind == "bad_request" and "description" in bad.value.message
            stored = await bus.request("noetl.q.credential.put", {"name": "c", "data": {"pw": "a\x00b"}})
            assert stored["name"] == "c"
            assert (await bus.request("noetl.q.credential.get", {"name": "c", "include_data": True}))["data"] == \
                {"pw": "a\x00b"}
            with pytest.raises(BusError) as bad:
                await bus.request("noetl.q.credential.get", {"name": "bad name"})
            assert bad.value.kind == "bad_request"
        finally:
            await service.stop()
            await bus.close()

    asyncio.run(main())


def test_up_keeps_its_key_in_its_home_whatever_the_working_directory(tmp_path) -> None:
    """`noetl up --home H` started from one directory stores a credential; started again from another
    directory (one process per service this time: `noetl service credentials --home H`) it reads it back.
    The key file is H/credential.key, never <working directory>/.noetl."""
    import re
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    from conftest import noetl_up

    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    for name in ("NOETL_TOKEN", "NOETL_NATS_URL", "NOETL_PG_DSN", "NOETL_GATEWAY_URL", "NOETL_HOME",
                 "NOETL_CREDENTIAL_KEY", "NOETL_CREDENTIAL_KEY_OLD", "NOETL_NATS_CREDS"):
        env.pop(name, None)
    root = Path(tempfile.mkdtemp(prefix="noetl-up-"))  # Postgres's own user must reach its data directory
    os.chmod(root, 0o755)
    home, first_dir, second_dir = root / "home", root / "first", root / "second"
    first_dir.mkdir()
    second_dir.mkdir()

    def run_up(cwd: Path, extra: list[str]) -> tuple[Any, str, str]:
        proc, text = noetl_up([*extra, "--home", str(home)], env, cwd=str(cwd), start_new_session=True)
        return proc, text, re.search(r"gateway: (http://\S+)", text).group(1)

    def stop(proc: Any) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)

    try:
        proc, text, url = run_up(first_dir, ["--in-process"])
        token = (home / "admin.token").read_text().strip()
        try:
            with httpx.Client(base_url=url, trust_env=False, headers={"Authorization": f"Bearer {token}"}) as gw:
                made = gw.post("/api/credentials", json={"name": "homed", "data": {"password": "homed-pw-1"}})
                assert made.status_code == 201, made.text
        finally:
            stop(proc)
        assert (home / "credential.key").exists() and not (first_dir / ".noetl").exists()
        proc, text, url = run_up(second_dir, [])
        try:
            with httpx.Client(base_url=url, trust_env=False, headers={"Authorization": f"Bearer {token}"}) as gw:
                got = gw.get("/api/credentials/homed", params={"include_data": "true"})
                assert got.status_code == 200, got.text
                assert got.json()["data"] == {"password": "homed-pw-1"}
        finally:
            stop(proc)
        assert not (second_dir / ".noetl").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
