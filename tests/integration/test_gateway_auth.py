"""Access control through the gateway, on a whole stack (real NATS, Postgres, the sessions service):
the role matrix over every route the app has, credentials' data and cancels by owner, revocation seen by
two gateways, the sessions service away, who started an execution, the audit records, client addresses
behind a proxy, and the command line's login, token and user commands."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from noetl_mesh import limits
from noetl_mesh.cli import main as cli
from noetl_mesh.client import GatewayClient, GatewayError, stored_token, token_file
from noetl_mesh.core import access
from noetl_mesh.infra.bus import Bus
from noetl_mesh.services.gateway import auth
from noetl_mesh.services.gateway.app import GatewayService

from conftest import noetl_up

pytestmark = pytest.mark.integration

ROLES = ("admin", "developer", "operator", "viewer")
PASSWORD = "a long password"
NONE = "0" * 32  # an id that names nothing
SLOW = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: slow, path: tests/auth_slow}
workflow:
  - step: start
    tool: {kind: python, code: "import time\\ntime.sleep(30)\\nresult = 1"}
"""
CHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: child, path: tests/auth_child}
workflow:
  - step: start
    tool: {kind: noop, result: 1}
"""
PARENT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: parent, path: tests/auth_parent}
workflow:
  - step: start
    tool: {kind: playbook, path: tests/auth_child}
"""


@pytest.fixture(scope="module", autouse=True)
def _key(throwaway_credential_key) -> None:
    """Credentials written by these tests are encrypted with a throw-away key (no key file)."""


@pytest.fixture(scope="module")
def people(stack) -> dict[str, dict[str, Any]]:
    """A user of each role: its user record, and an API token (admin: the stack's bootstrap token)."""
    async def make() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        async with stack.client() as admin:
            out["admin"] = {"user": await admin.whoami(), "token": stack.token}
            for role in ROLES[1:]:
                user = await admin.add_user(f"a-{role}", [role], password=PASSWORD)
                async with GatewayClient(stack.url, token="") as c:
                    c.use(None)
                    await c.login(f"a-{role}", PASSWORD)
                    out[role] = {"user": user, "token": (await c.create_token(f"{role} matrix"))["token"]}
        return out

    return stack.run(make())


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def sample(method: str, path: str) -> tuple[str, dict[str, Any]]:
    """A request to a route that, when let in, touches nothing that exists (ids that name nothing,
    bodies that are refused as invalid)."""
    url = path
    for name, value in (("{path:path}", "tests/none"), ("{catalog_id}", "999999"), ("{execution_id}", NONE),
                        ("{name}", "no_such_credential"), ("{user_id}", NONE), ("{session_id}", NONE),
                        ("{token_id}", NONE)):
        url = url.replace(name, value)
    body = {"json": {}} if method == "POST" and not path.endswith("/cancel") else {}
    if path.startswith("/api/live/"):  # a live stream: one that ends at once
        body = {"params": {"seconds": 1}}
    return url, body


def test_the_role_matrix_over_every_route_of_the_app(stack, people):
    """Every route the app has (read from app.routes), called without a token and with a token of each
    role: 401 without one (with WWW-Authenticate), 403 when access.allowed says no, let in otherwise."""
    app = stack.stack.services("gateway")[0].app
    routes = auth.declarations(app.routes)
    assert len(routes) >= 30 and None not in routes.values()
    checked = 0
    with httpx.Client(base_url=stack.url, trust_env=False, timeout=60) as http:
        for (method, path), permission in sorted(routes.items()):
            url, body = sample(method, path)
            for role in (None, *ROLES):
                token = people[role]["token"] if role else None
                if path == "/api/auth/logout" and role:  # it would end the token: a session of its own
                    name = "admin" if role == "admin" else f"a-{role}"
                    if role == "admin":
                        token = stack.run(_admin_session(stack))
                    else:
                        token = http.post("/api/auth/login", json={"username": name, "password": PASSWORD}).json()["token"]
                resp = http.request(method, url, headers=bearer(token), **body)
                where = (method, path, role, resp.status_code, resp.text[:300])
                assert resp.status_code < 500, where
                if permission == auth.PUBLIC:
                    assert resp.status_code not in (401, 403), where
                elif role is None:
                    assert resp.status_code == 401, where
                    assert resp.headers["www-authenticate"].startswith("Bearer"), where
                    assert "this needs a token" in resp.json()["detail"]["message"], where
                elif permission == auth.SIGNED_IN or access.allowed([role], permission):
                    assert resp.status_code not in (401, 403), where
                else:
                    assert resp.status_code == 403, where
                    message = resp.json()["detail"]["message"]
                    assert f"the permission {permission} (roles " in message and message.endswith(f"you have {role}")
                checked += 1
    assert checked == len(routes) * 5


async def _admin_session(stack) -> str:
    """The bootstrap admin has no password: it gets one (once), then logs in."""
    async with stack.client() as admin:
        me = await admin.whoami()
        if not stack.stack.__dict__.get("admin_password"):
            await admin.set_password(PASSWORD, user=me["user_id"])
            stack.stack.__dict__["admin_password"] = True
        async with GatewayClient(stack.url, token="") as c:
            c.use(None)
            return (await c.login("admin", PASSWORD))["token"]


def test_credential_data_only_for_admins_and_every_read_and_write_is_audited(stack, people):
    async def go() -> None:
        async with stack.client() as admin:
            await admin.credential_put("auth_pg", "postgres", {"password": "pg-pass-Zq"})
            for role in ROLES[1:]:
                async with GatewayClient(stack.url, token=people[role]["token"]) as c:
                    with pytest.raises(GatewayError) as refused:
                        await c.credential_get("auth_pg", include_data=True)
                    assert refused.value.status == 403, role
                    if role == "viewer":  # not even the metadata
                        assert refused.value.message.startswith("this needs the permission credential.list")
                        continue
                    assert refused.value.message == ("this needs the permission credential.read_data (roles admin) to "
                                                     f"read a credential's data (include_data); you have {role}")
                    assert "data" not in await c.credential_get("auth_pg")  # the metadata: yes
            assert (await admin.credential_get("auth_pg", include_data=True))["data"] == {"password": "pg-pass-Zq"}
            records = await admin.audit(action="credential", limit=50)
            read = [r for r in records if r["action"] == "credential.read"]
            assert read and read[0]["target"] == {"credential": "auth_pg"} and read[0]["details"]["include_data"]
            assert read[0]["actor"]["username"] == "admin" and read[0]["client_ip"] == "127.0.0.1"
            assert any(r["action"] == "credential.written" for r in records)
            denied = await admin.audit(action="access.denied", limit=200)
            assert {r["actor"]["username"] for r in denied if (r["details"] or {}).get("permission") ==
                    "credential.read_data"} >= {"a-developer", "a-operator"}
            assert "pg-pass-Zq" not in str(records) + str(denied)

    stack.run(go())


def test_cancel_own_or_any_and_who_started_what(stack, people):
    async def go() -> None:
        async with GatewayClient(stack.url, token=people["developer"]["token"]) as dev, \
                GatewayClient(stack.url, token=people["operator"]["token"]) as op, \
                stack.client() as admin:
            other = await admin.add_user("a-developer-2", ["developer"], password=PASSWORD)
            async with GatewayClient(stack.url, token="") as dev2:
                dev2.use(None)
                await dev2.login("a-developer-2", PASSWORD)
                mine, theirs = await dev.start(SLOW), await dev2.start(SLOW)
                for xid in (mine, theirs):
                    await _until(lambda xid=xid: dev.status(xid, brief=True))
                with pytest.raises(GatewayError) as refused:
                    await dev.cancel(theirs)
                assert refused.value.status == 403 and refused.value.message == (
                    "this needs the permission execution.cancel.any (roles admin, operator) to cancel an execution "
                    "another user started; you have developer")
                assert (await dev.cancel(mine))["status"] == "CANCELLING"  # its own
                assert (await op.cancel(theirs, reason="operator"))["status"] == "CANCELLING"  # any
                assert (await dev.wait(theirs, timeout=30))["status"] == "CANCELLED"

                dev_id = people["developer"]["user"]["user_id"]
                listed = await dev.list_executions(user="me")
                assert [x["execution_id"] for x in listed] == [mine]
                assert listed[0]["requested_by"] == dev_id
                assert [x["execution_id"] for x in await admin.list_executions(user=other["user_id"])] == [theirs]
                assert await op.list_executions(user="me") == []
                with pytest.raises(GatewayError) as bad:
                    await admin.list_executions(user="someone")
                assert bad.value.status == 422
                # an execution listed under another: only under one's own (or any, for who may cancel any)
                with pytest.raises(GatewayError) as linked:
                    await dev.start(SLOW, parent_execution_id=theirs)
                assert linked.value.status == 403 and "under one another user started" in linked.value.message
                with pytest.raises(GatewayError) as nowhere:
                    await dev.start(SLOW, parent_execution_id="0" * 32)
                assert nowhere.value.status == 422 and nowhere.value.body["detail"]["location"] == "body.parent_execution_id"
                under_mine = await dev.start(SLOW, parent_execution_id=mine)
                await dev.cancel(under_mine)

            # a child execution is its parent's caller's: listed with it, cancellable by them
            await admin.register(CHILD)
            parent = await dev.start(PARENT)
            assert (await dev.wait(parent, timeout=30))["status"] == "COMPLETED"
            children = (await dev.status(parent))["children"]
            child = children[0]["execution_id"] if isinstance(children[0], dict) else children[0]
            assert {parent, child} <= {x["execution_id"] for x in await dev.list_executions(user="me")}
            with pytest.raises(GatewayError) as finished:
                await dev.cancel(child)  # its own (inherited): refused only because it has finished
            assert finished.value.status == 409

            cancels = await admin.audit(action="execution.cancelled")
            assert {(r["actor"]["username"], r["target"]["execution_id"]) for r in cancels} >= {
                ("a-developer", mine), ("a-operator", theirs)}

    stack.run(go(), timeout=180)


async def _until(probe, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await probe()
        except GatewayError as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_revocation_reaches_every_gateway_at_once(stack, people):
    """Two gateways, each with the token cached; the second keeps validations for a minute, so only
    the revocation notice can make it refuse: logout, an API token revoked, a user disabled."""
    async def go() -> None:
        settings = stack.stack.settings
        bus = await Bus.connect(settings.nats_url, "second-gateway", settings.creds_for("gateway"))
        second = GatewayService(bus)
        await second.start()
        second.app.state.auth.cache.ttl = 60.0
        try:
            async with stack.client() as admin:
                await admin.add_user("a-revoked", ["viewer"], password=PASSWORD)
                async with GatewayClient(stack.url, token="") as a:
                    a.use(None)
                    session = (await a.login("a-revoked", PASSWORD))["token"]
                    api = (await a.create_token("revoked"))["token"]
                    other = (await a.login("a-revoked", PASSWORD))["token"]
                    async with GatewayClient(second.url, token=session) as b:
                        for token in (session, api, other):
                            b.use(token)
                            assert (await b.whoami())["username"] == "a-revoked"  # cached on both
                        a.use(session)
                        await a.logout()
                        await _refused(b, session)
                        b.use(other)
                        assert (await b.whoami())["kind"] == "session"  # the other session stays
                        a.use(other)
                        await a.revoke_token(await _token_id(a, "revoked"))
                        await _refused(b, api)
                        before = second.app.state.auth.validations
                        b.use(other)
                        await b.whoami()
                        assert second.app.state.auth.validations == before  # still cached
                        user = await admin.whoami()
                        assert user["roles"] == ["admin"]
                        await admin.disable_user("a-revoked")  # by username
                        await _refused(b, other)
        finally:
            await second.stop()
            await bus.close()

    stack.run(go())


async def _token_id(client: GatewayClient, name: str) -> str:
    return next(t["token_id"] for t in await client.tokens() if t["name"] == name)


async def _refused(client: GatewayClient, token: str) -> None:
    client.use(token)
    deadline = time.monotonic() + 10  # normally at once: the notice is on its way as the answer is
    while True:
        try:
            await client.whoami()
        except GatewayError as exc:
            assert exc.status == 401 and exc.message.endswith("log in again (POST /api/auth/login, `noetl login`)")
            return
        assert time.monotonic() < deadline, "a revoked token is still let in"
        await asyncio.sleep(0.05)


def test_the_sessions_service_away_is_503_not_401(stack, people):
    async def go() -> None:
        sessions = stack.stack.services("sessions")[0]
        fresh = people["viewer"]["token"]
        gateway = stack.stack.services("gateway")[0]
        gateway.app.state.auth.cache.clear()
        await sessions.stop()
        try:
            async with GatewayClient(stack.url, token=fresh) as c:
                with pytest.raises(GatewayError) as away:
                    await c.whoami()
                assert away.value.status == 503 and away.value.retry_after == 1.0
                assert "sessions service" in away.value.message
                c.use(None)
                with pytest.raises(GatewayError) as login:
                    await c.login("a-viewer", PASSWORD)
                assert login.value.status == 503 and login.value.retry_after is not None
        finally:
            await sessions.start()
        async with GatewayClient(stack.url, token=fresh) as c:
            assert (await c.whoami())["username"] == "a-viewer"

    stack.run(go())


def test_logins_lockout_and_the_client_address_behind_a_trusted_proxy(stack, people):
    async def go() -> None:
        settings = stack.stack.settings
        bus = await Bus.connect(settings.nats_url, "proxied-gateway", settings.creds_for("gateway"))
        behind = GatewayService(bus)
        try:
            os.environ[auth.TRUSTED_PROXIES_ENV] = "127.0.0.1"
            await behind.start()
        finally:
            del os.environ[auth.TRUSTED_PROXIES_ENV]
        try:
            async with httpx.AsyncClient(trust_env=False) as http:
                forwarded = {"X-Forwarded-For": "198.51.100.23"}
                for url in (stack.url, behind.url):
                    resp = await http.post(f"{url}/api/auth/login", headers=forwarded,
                                           json={"username": "a-viewer", "password": PASSWORD})
                    assert resp.status_code == 200 and resp.headers["cache-control"] == "no-store"
                    assert resp.json()["token"].startswith("noetl_s_")
                bad = await http.post(f"{stack.url}/api/auth/login", json={"username": "a-viewer", "password": "nope nope"})
                assert bad.status_code == 401 and bad.json()["detail"]["message"] == "wrong username or password"
                assert bad.headers["www-authenticate"].startswith("Bearer")
                with limits.override(login_slow_after=1):  # the next attempt must wait: 429 + Retry-After
                    again = await http.post(f"{stack.url}/api/auth/login",
                                            json={"username": "a-viewer", "password": "nope nope"})
                assert again.status_code == 429 and int(again.headers["retry-after"]) >= 1, again.text
                assert "too many failed logins" in again.json()["detail"]["message"]
                both = await http.post(f"{stack.url}/api/auth/login", json={"username": "x", "password": "y", "id_token": "z"})
                assert both.status_code == 422
                big = await http.post(f"{stack.url}/api/auth/login", json={"id_token": "x" * 200_000})
                assert big.status_code == 413 and "max_login_bytes" in big.json()["detail"]["message"]
            async with stack.client() as admin:
                logins = [r for r in await admin.audit(action="session.login", limit=20)
                          if (r["actor"] or {}).get("username") == "a-viewer"]
                assert [r["client_ip"] for r in logins[:2]] == ["198.51.100.23", "127.0.0.1"]  # newest first
        finally:
            await behind.stop()
            await bus.close()

    stack.run(go())


def test_users_sessions_and_tokens_through_the_api(stack, people):
    async def go() -> None:
        async with stack.client() as admin:
            users = {u["username"]: u for u in await admin.users()}
            assert {"admin", "a-developer"} <= set(users) and "password_hash" not in str(users)
            with pytest.raises(GatewayError) as twice:
                await admin.add_user("a-developer", ["viewer"])
            assert twice.value.status == 409
            with pytest.raises(GatewayError) as unknown_role:
                await admin.add_user("a-nobody", ["superuser"])
            assert unknown_role.value.status == 400 and "superuser" in unknown_role.value.message
            assert (await admin.set_roles("a-operator", ["operator", "viewer"]))["roles"] == ["operator", "viewer"]
        async with GatewayClient(stack.url, token=people["developer"]["token"]) as dev:
            me = await dev.whoami()
            assert me["kind"] == "token" and "execution.start" in me["permissions"] and "user.admin" not in me["permissions"]
            made = await dev.create_token("short", roles=["viewer"], expires_in=600)
            assert made["roles"] == ["viewer"] and made["token"].startswith("noetl_t_")
            with pytest.raises(GatewayError) as more:
                await dev.create_token("greedy", roles=["admin"])
            assert more.value.status == 403
            listed = await dev.tokens()
            assert "short" in {t["name"] for t in listed} and made["token"] not in str(listed) and "noetl_t_" not in str(listed)
            with pytest.raises(GatewayError) as others:
                await dev.tokens(user_id=people["admin"]["user"]["user_id"])
            assert others.value.status == 403 and "token.any" in others.value.message
            await dev.revoke_token(made["token_id"])
            sessions = await dev.sessions()
            assert all(s["user_id"] == me["user_id"] for s in sessions)

    stack.run(go())


def test_a_token_never_outlives_what_makes_it_and_ends_with_it(stack, people):
    """A session mints tokens that end by its own end at the latest (a stolen session does not become
    a lasting token); a token mints tokens within its own expiry, and revoking it ends what it made."""
    async def go() -> None:
        async with stack.client() as admin:
            await admin.add_user("a-minter", ["developer"], password=PASSWORD)
        async with GatewayClient(stack.url, token="") as c:
            c.use(None)
            session = (await c.login("a-minter", PASSWORD))["token"]
            ends = (await c.whoami())["expires_at"]
            made = await c.create_token("by-session")  # no expires_in: no longer than the session
            assert made["expires_at"] == ends
            with pytest.raises(GatewayError) as longer:
                await c.create_token("forever", expires_in=30 * 24 * 3600)
            assert longer.value.status == 403 and "cannot outlive the session that makes it" in longer.value.message
            short = await c.create_token("short", expires_in=600)
            listed = {t["name"]: t for t in await c.tokens()}
            assert listed["short"]["minted_by"] == {"kind": "session", "session_id": access.token_id(session)}

            c.use(short["token"])  # a token makes tokens within its own expiry
            child = await c.create_token("child", roles=["viewer"])
            assert child["expires_at"] == short["expires_at"]
            with pytest.raises(GatewayError) as beyond:
                await c.create_token("beyond", expires_in=601)
            assert beyond.value.status == 403 and "cannot outlive the API token" in beyond.value.message
            c.use(child["token"])
            grandchild = await c.create_token("grandchild")
            assert grandchild["roles"] == ["viewer"] and grandchild["expires_at"] == short["expires_at"]

            c.use(session)
            await c.revoke_token(short["token_id"])  # ends what it made, and what that made
            for token in (child["token"], grandchild["token"]):
                await _refused(c, token)
            c.use(session)
            assert {t["name"] for t in await c.tokens()} == {"by-session"}

            await c.logout()  # a session's tokens stay: they end by the session's lifetime at the latest
            c.use(made["token"])
            assert (await c.whoami())["token_name"] == "by-session"

    stack.run(go())


# ------------------------------------------------------------------------------ the command line
def test_cli_login_whoami_tokens_users_logout(stack, people, capsys, monkeypatch):
    url = stack.url
    monkeypatch.setattr("getpass.getpass", lambda prompt="": PASSWORD)
    assert cli(["whoami", "--gateway", url]) == 1
    assert "log in with `noetl login --gateway" in capsys.readouterr().err

    assert cli(["login", "--gateway", url, "--username", "a-developer"]) == 0
    out = capsys.readouterr().out
    assert "logged in to" in out and "as a-developer (roles developer)" in out
    path = token_file()
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    session = stored_token(url)
    assert session.startswith("noetl_s_") and session not in out
    assert cli(["whoami", "--gateway", url]) == 0 and '"username": "a-developer"' in capsys.readouterr().out
    assert stored_token(url.replace("127.0.0.1", "localhost")) is None  # kept for this gateway only

    assert cli(["token", "create", "ci", "--role", "viewer", "--gateway", url]) == 0
    made = capsys.readouterr().out
    api = re.search(r'"token": "(noetl_t_[^"]+)"', made).group(1)
    assert cli(["token", "list", "--gateway", url]) == 0 and api not in capsys.readouterr().out
    assert cli(["user", "list", "--gateway", url]) == 1  # a developer is no admin
    assert "this needs the permission user.admin" in capsys.readouterr().err
    assert cli(["session", "list", "--gateway", url]) == 0 and '"current": true' in capsys.readouterr().out

    monkeypatch.setenv("NOETL_TOKEN", stack.token)  # overrides the stored token
    assert cli(["whoami", "--gateway", url]) == 0 and '"username": "admin"' in capsys.readouterr().out
    assert cli(["user", "add", "a-cli", "--role", "operator", "--password", "--gateway", url]) == 0
    capsys.readouterr()
    assert cli(["user", "disable", "a-cli", "--gateway", url]) == 0 and '"disabled": true' in capsys.readouterr().out
    monkeypatch.delenv("NOETL_TOKEN")

    assert cli(["login", "--gateway", url, "--token", api]) == 0  # keep an API token instead
    assert "with API token 'ci'" in capsys.readouterr().out
    assert stored_token(url) == api

    async def session_ended() -> int:
        async with GatewayClient(url, token=session) as c:
            try:
                await c.whoami()
            except GatewayError as exc:
                return exc.status
            return 200
    assert stack.run(session_ended()) == 401  # the session the new login replaced has ended
    assert cli(["logout", "--gateway", url]) == 0 and "stays valid until revoked" in capsys.readouterr().out
    assert stored_token(url) is None
    assert cli(["token", "list", "--gateway", url]) == 1 and "log in with" in capsys.readouterr().err
    assert cli(["login", "--gateway", url, "--username", "a-developer"]) == 0
    capsys.readouterr()
    session = stored_token(url)
    assert cli(["logout", "--gateway", url]) == 0 and "logged out" in capsys.readouterr().out
    assert stored_token(url) is None and stack.run(session_ended()) == 401
    monkeypatch.setattr("getpass.getpass", lambda prompt="": "wrong password!")
    assert cli(["login", "--gateway", url, "--username", "a-developer"]) == 1
    assert "wrong username or password" in capsys.readouterr().err


def test_noetl_up_first_start_lets_local_commands_in_and_forgets_the_token_when_it_stops(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    for name in ("NOETL_TOKEN", "NOETL_NATS_URL", "NOETL_PG_DSN", "NOETL_GATEWAY_URL"):
        env.pop(name, None)
    root = tempfile.mkdtemp(prefix="noetl-up-")  # Postgres's own user must reach its data directory
    os.chmod(root, 0o755)
    home = Path(root) / "home"
    proc, text = noetl_up(["--in-process", "--home", str(home)], env, start_new_session=True)
    try:
        url = re.search(r"gateway: (http://\S+)", text).group(1)
        assert f"its API token (no expiry) is in {home / 'admin.token'}" in text and "first start" in text
        assert oct((home / "admin.token").stat().st_mode & 0o777) == "0o600"
        token = (home / "admin.token").read_text().strip()
        assert token not in text
        whoami = subprocess.run([sys.executable, "-m", "noetl_mesh.cli", "whoami", "--gateway", url],
                                capture_output=True, text=True, env=env, timeout=60)
        assert whoami.returncode == 0 and '"username": "admin"' in whoami.stdout, whoami.stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        text += proc.stdout.read()
        proc.wait(60)
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 0, text
    stored = (tmp_path / "config" / "noetl" / "tokens.json").read_text()
    assert token not in stored  # forgotten when the stack stopped
