"""The sessions service against a real NATS server: bootstrap, logins, validation and sliding refresh,
expiry by NATS TTLs, concurrent replicas, revocation, users, API tokens, OIDC against a local issuer,
lockout, the audit log, and a scan of everything a run leaves for secrets.

Password hashing uses argon2id with small parameters (the service's path is the same; the default
parameters are measured in bench/bench_auth.py), except in the first test."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
import orjson
import pytest
from argon2 import PasswordHasher
from cryptography.hazmat.primitives.asymmetric import rsa

from noetl_mesh import limits
from noetl_mesh.core import access
from noetl_mesh.infra.bus import Bus, BusError
from noetl_mesh.services.sessions import audit
from noetl_mesh.services.sessions import service as S
from noetl_mesh.services.sessions.oidc import OidcConfig
from noetl_mesh.services.sessions.store import (LOGINS, SESSIONS, USERS, Conflict, failed_user_key, session_index,
                                                 session_key)

pytestmark = pytest.mark.integration

CHEAP = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
ADMIN_PW, DEV_PW = "admin password 1", "developer password 1"


class Harness:
    """Service replicas and a client connection; every reply is kept (the secret scan reads them)."""

    def __init__(self, client: Bus, services: list[S.SessionsService]):
        self.client, self.services, self.replies = client, services, []
        self.svc = services[0]

    async def call(self, subject: str, payload: Any, timeout: float = 20) -> Any:
        msg = await self.client.nc.request(subject, orjson.dumps(payload), timeout=timeout)
        reply = orjson.loads(msg.data)
        self.replies.append((subject, reply))
        if isinstance(reply, dict) and set(reply) == {"error"}:
            e = reply["error"]
            raise BusError(e["kind"], e["message"], e.get("details"))
        return reply

    async def fails(self, subject: str, payload: Any) -> BusError:
        with pytest.raises(BusError) as exc:
            await self.call(subject, payload)
        return exc.value

    async def bootstrap(self) -> tuple[str, dict]:
        r = await self.call(S.Q_BOOTSTRAP, {"username": "admin", "password": ADMIN_PW, "client_ip": "10.0.0.1"})
        return r["token"], await self.call(S.Q_VALIDATE, {"token": r["token"]})

    async def add(self, admin: dict, name: str, roles: list[str], password: str = DEV_PW, **kw) -> dict:
        return (await self.call(S.Q_USERS_ADD, {"principal": admin, "username": name, "password": password,
                                                "roles": roles, **kw}))["user"]

    async def login(self, name: str, password: str = DEV_PW, ip: str | None = "10.0.0.2") -> tuple[str, dict]:
        r = await self.call(S.Q_LOGIN, {"username": name, "password": password, "client_ip": ip})
        return r["token"], r["principal"]

    async def raw(self, bucket: str, key: str) -> dict | None:
        """A KV value as NATS holds it now (None when absent or removed)."""
        return await self.svc.__dict__[{SESSIONS: "sessions", USERS: "users", LOGINS: "logins"}[bucket]].get(key)


@contextlib.asynccontextmanager
async def running(url: str, replicas: int = 1, oidc: OidcConfig | None = None, hasher=CHEAP):
    buses, services = [], []
    for _ in range(replicas):
        bus = await Bus.connect(url, "noetl-sessions")
        svc = S.SessionsService(bus, oidc=oidc, hasher=hasher)
        await svc.start()
        buses.append(bus)
        services.append(svc)
    client = await Bus.connect(url, "test-client")
    try:
        yield Harness(client, services)
    finally:
        for svc, bus in zip(services, buses):
            await svc.stop()
            await bus.close()
        await client.close()


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ------------------------------------------------------------------------------ bootstrap, login
def test_bootstrap_once_then_login_and_validate(fresh_nats):
    async def main():
        async with running(fresh_nats.url, replicas=2, hasher=None) as h:  # argon2id with its default parameters
            first = await asyncio.gather(*(h.call(S.Q_BOOTSTRAP, {"username": f"admin{i}", "password": ADMIN_PW})
                                           for i in range(4)))
            created = [r for r in first if r["created"]]
            assert len(created) == 1, first  # concurrent bootstraps on two replicas: one admin
            again = await h.call(S.Q_BOOTSTRAP, {"username": "other"})
            assert again == {"created": False, "message": "already done: users exist; log in as one of them"}
            admin = await h.call(S.Q_VALIDATE, {"token": created[0]["token"]})
            assert admin["kind"] == "token" and admin["roles"] == ["admin"] and admin["expires_at"] is None
            users = (await h.call(S.Q_USERS_LIST, {"principal": admin}))["users"]
            assert [u["username"] for u in users] == [created[0]["user"]["username"]]
            assert users[0]["has_password"] and "password_hash" not in users[0]

            await h.add(admin, "dev", ["developer"], email="dev@example.com", display_name="Dev")
            token, who = await h.login("dev")
            assert token.startswith("noetl_s_")
            assert who["username"] == "dev" and who["roles"] == ["developer"] and who["kind"] == "session"
            assert await h.call(S.Q_VALIDATE, {"token": token}) == who
            stored, _ = await h.raw(SESSIONS, session_key(who["session_id"]))
            assert stored["user_id"] == who["user_id"] and stored["client_ip"] == "10.0.0.2"
            assert set(stored) == {"session_id", "user_id", "username", "email", "display_name", "roles", "created_at",
                                   "expires_at", "last_activity_at", "client_ip", "idp_subject"}

            wrong = await h.fails(S.Q_LOGIN, {"username": "dev", "password": "not it at all"})
            unknown = await h.fails(S.Q_LOGIN, {"username": "nobody", "password": "not it at all"})
            assert (wrong.kind, wrong.message) == (unknown.kind, unknown.message) == \
                ("unauthenticated", "wrong username or password")
            assert (await h.fails(S.Q_VALIDATE, {"token": "noetl_s_" + "x" * 43})).kind == "unauthenticated"
            assert (await h.fails(S.Q_VALIDATE, {"token": "Bearer something"})).message == "not a noetl token"
            # hostile requests get clear errors and change nothing
            for subject, payload in [(S.Q_LOGIN, [1, 2]), (S.Q_LOGIN, {"username": "a b", "password": "x"}),
                                     (S.Q_LOGIN, {"username": "dev", "password": "x" * 5000}),
                                     (S.Q_REVOKE, {"principal": admin, "session_id": "*"}),
                                     (S.Q_LIST, {"principal": admin, "user_id": "a.>"}),
                                     (S.Q_USERS_ADD, {"principal": admin, "username": "x", "roles": ["root"]}),
                                     # a username that reads as a user id: named elsewhere, it would be another user
                                     (S.Q_USERS_ADD, {"principal": admin, "username": "AB" * 16, "roles": ["viewer"]})]:
                assert (await h.fails(subject, payload)).kind == "bad_request", payload
            raw = await h.client.nc.request(S.Q_VALIDATE, b"{not json", timeout=10)
            assert orjson.loads(raw.data)["error"]["kind"] == "bad_request"
            assert (await h.fails(S.Q_USERS_ADD, {"principal": admin, "username": "dev", "roles": ["viewer"]})).kind == "conflict"

    run(main())


# ------------------------------------------------------------------------------ refresh and expiry
def test_activity_slides_the_idle_expiry_with_few_writes(fresh_nats):
    async def main():
        async with running(fresh_nats.url) as h:
            _, admin = await h.bootstrap()
            await h.add(admin, "dev", ["developer"])
            with limits.override(session_idle=60, session_refresh_interval=1):
                token, who = await h.login("dev")
                key = session_key(who["session_id"])
                rec0, rev0 = await h.raw(SESSIONS, key)
                for _ in range(20):  # a busy second: at most one write
                    await h.call(S.Q_VALIDATE, {"token": token})
                assert (await h.raw(SESSIONS, key))[1] - rev0 <= 1
                await asyncio.sleep(1.1)
                after = await h.call(S.Q_VALIDATE, {"token": token})
                rec1, rev1 = await h.raw(SESSIONS, key)
                assert rev1 > rev0 and rec1["last_activity_at"] > rec0["last_activity_at"]
                assert after["idle_expires_at"] > who["idle_expires_at"]
                # the TTL travels with the new message: it expires idle seconds after the write
                msg = await h.client.js.get_msg(f"KV_{SESSIONS}", subject=f"$KV.{SESSIONS}.{key}")
                assert msg.seq == rev1 and msg.headers["Nats-TTL"] == "60"
                forced = await h.call(S.Q_REFRESH, {"token": token})  # within the interval: no write
                assert forced["idle_expires_at"] == after["idle_expires_at"]

    run(main())


def test_idle_and_absolute_expiry_by_nats_ttl(fresh_nats):
    async def main():
        async with running(fresh_nats.url) as h:
            _, admin = await h.bootstrap()
            await h.add(admin, "dev", ["developer"])
            with limits.override(session_lifetime=4, session_idle=2, session_refresh_interval=1):
                busy, b = await h.login("dev")
                idle, i = await h.login("dev")
                start = time.monotonic()
                while time.monotonic() - start < 3.2:  # past the idle timeout, before the absolute expiry
                    await h.call(S.Q_VALIDATE, {"token": busy})
                    await asyncio.sleep(0.3)
                assert (await h.call(S.Q_VALIDATE, {"token": busy}))["session_id"] == b["session_id"]
                assert (await h.fails(S.Q_VALIDATE, {"token": idle})).kind == "unauthenticated"
                assert await h.raw(SESSIONS, session_key(i["session_id"])) is None  # NATS removed the key
                while time.monotonic() - start < 5.5:  # past the absolute lifetime, active all along
                    with contextlib.suppress(BusError):
                        await h.call(S.Q_VALIDATE, {"token": busy})
                    await asyncio.sleep(0.3)
                assert (await h.fails(S.Q_VALIDATE, {"token": busy})).kind == "unauthenticated"
                assert await h.raw(SESSIONS, session_key(b["session_id"])) is None
                assert await h.raw(SESSIONS, session_index(b["user_id"], b["session_id"])) is None

    run(main())


def test_concurrent_refreshes_on_two_replicas_lose_no_update(fresh_nats):
    async def main():
        async with running(fresh_nats.url, replicas=2) as h:
            _, admin = await h.bootstrap()
            dev = await h.add(admin, "dev", ["developer"])
            with limits.override(session_refresh_interval=0.001):  # every validation writes
                token, who = await h.login("dev")
                key = session_key(who["session_id"])
                _, rev0 = await h.raw(SESSIONS, key)

                stop = asyncio.Event()

                async def storm(n: int) -> list:  # waves of n validations at once, until stopped
                    out = []
                    while not stop.is_set():
                        out += await asyncio.gather(*(h.call(S.Q_VALIDATE, {"token": token}) for _ in range(n)),
                                                    return_exceptions=True)
                    return out

                async def role_changes() -> None:  # while the storm goes on: viewer last
                    for i in range(8):
                        roles = ["operator"] if i % 2 == 0 else ["viewer"]
                        await h.call(S.Q_USERS_ROLES, {"principal": admin, "user_id": dev["user_id"], "roles": roles})
                        await asyncio.sleep(0.02)

                storming = asyncio.create_task(storm(30))
                await asyncio.sleep(0.1)
                await role_changes()
                await asyncio.sleep(0.2)
                stop.set()
                results = await storming
                errors = [r for r in results if isinstance(r, BaseException)]
                assert errors == []  # races between replicas never reach the user
                rec, rev = await h.raw(SESSIONS, key)
                assert rec["roles"] == ["viewer"]  # the last role change survived every concurrent refresh
                assert (await h.call(S.Q_VALIDATE, {"token": token}))["roles"] == ["viewer"]
                assert rev > rev0 + 15  # refreshes were written, each against the revision it read
                assert all(s.answered > 50 for s in h.services)  # both replicas took part

                # the exact interleaving: a refresh read the session, the roles changed, the refresh writes
                stale, stale_rev = await h.raw(SESSIONS, key)
                await h.call(S.Q_USERS_ROLES, {"principal": admin, "user_id": dev["user_id"], "roles": ["operator"]})
                got = await h.svc._refresh(key, stale, stale_rev, time.time(), h.svc._policy())
                assert got["roles"] == ["operator"]  # the newer value stands, and no error
                assert (await h.raw(SESSIONS, key))[0]["roles"] == ["operator"]

    run(main())


# ------------------------------------------------------------------------------ revocation
def test_revocation_notice_and_no_resurrection(fresh_nats):
    async def main():
        async with running(fresh_nats.url, replicas=2) as h:
            _, admin = await h.bootstrap()
            await h.add(admin, "dev", ["developer"])
            notices: asyncio.Queue = asyncio.Queue()

            async def on_notice(msg):
                await notices.put(orjson.loads(msg.data))

            await h.client.nc.subscribe(S.REVOKED, cb=on_notice)
            token, who = await h.login("dev")
            await h.call(S.Q_REVOKE, {"token": token})
            notice = await asyncio.wait_for(notices.get(), 1.0)  # gateways hear of it within a second
            assert notice == {"session_id": who["session_id"], "user_id": who["user_id"], "reason": "logout"}
            assert (await h.fails(S.Q_VALIDATE, {"token": token})).kind == "unauthenticated"

            # the exact race: a refresh read the session, then it was revoked, then the refresh writes
            with limits.override(session_refresh_interval=0.001):
                token, who = await h.login("dev")
                key = session_key(who["session_id"])
                rec, rev = await h.raw(SESSIONS, key)
                await h.call(S.Q_REVOKE, {"principal": admin, "session_id": who["session_id"]})
                with pytest.raises(access.AccessError) as exc:
                    await h.svc._refresh(key, rec, rev, time.time(), h.svc._policy())
                assert exc.value.kind == "unauthenticated"
                with pytest.raises(Conflict):
                    await h.svc.sessions.update(key, rec, rev, ttl=60)
                assert await h.raw(SESSIONS, key) is None

                # and under load: validations racing a revocation, on both replicas
                for _ in range(5):
                    token, who = await h.login("dev")
                    key = session_key(who["session_id"])
                    racing = [h.call(S.Q_VALIDATE, {"token": token}) for _ in range(30)]
                    await asyncio.gather(*racing[:15], h.call(S.Q_REVOKE, {"token": token}), *racing[15:],
                                         return_exceptions=True)
                    await asyncio.sleep(0.05)
                    assert await h.raw(SESSIONS, key) is None
                    assert (await h.fails(S.Q_VALIDATE, {"token": token})).kind == "unauthenticated"

    run(main())


def test_sessions_of_a_user_list_revoke_disable(fresh_nats):
    async def main():
        async with running(fresh_nats.url) as h:
            admin_token, admin = await h.bootstrap()
            dev = await h.add(admin, "dev", ["developer"])
            await h.add(admin, "viewer", ["viewer"])
            (t1, p1), (t2, p2), (t3, p3) = [await h.login("dev") for _ in range(3)]
            own = (await h.call(S.Q_LIST, {"principal": p1}))["sessions"]
            assert [s["session_id"] for s in own] == [p3["session_id"], p2["session_id"], p1["session_id"]]
            assert [s["current"] for s in own] == [False, False, True]
            _, viewer = await h.login("viewer")
            assert (await h.fails(S.Q_LIST, {"principal": viewer, "user_id": dev["user_id"]})).kind == "forbidden"
            assert (await h.fails(S.Q_REVOKE, {"principal": viewer, "session_id": p1["session_id"]})).kind == "forbidden"
            assert len((await h.call(S.Q_LIST, {"principal": admin, "user_id": dev["user_id"]}))["sessions"]) == 3
            await h.call(S.Q_REVOKE, {"principal": p1, "session_id": p2["session_id"]})  # one's own, by id
            assert (await h.fails(S.Q_VALIDATE, {"token": t2})).kind == "unauthenticated"
            # a principal that is not (or no longer) live is refused, whatever roles it claims
            forged = {**p2, "roles": ["admin"]}
            assert (await h.fails(S.Q_USERS_LIST, {"principal": forged})).kind == "unauthenticated"
            forged = {**p1, "roles": ["admin"]}
            assert (await h.fails(S.Q_USERS_LIST, {"principal": forged})).kind == "forbidden"

            tok = await h.call(S.Q_TOKENS_CREATE, {"principal": p1, "name": "ci"})
            done = await h.call(S.Q_USERS_DISABLE, {"principal": admin, "user_id": dev["user_id"]})
            assert done["user"]["disabled"] and done["revoked"] == {"sessions": 2, "tokens": 1}
            for token in (t1, t3, tok["token"]):
                assert (await h.fails(S.Q_VALIDATE, {"token": token})).kind == "unauthenticated"
            assert (await h.fails(S.Q_LOGIN, {"username": "dev", "password": DEV_PW})).message == "wrong username or password"
            assert (await h.fails(S.Q_USERS_DISABLE, {"principal": admin, "user_id": admin["user_id"]})).kind == "bad_request"
            await h.call(S.Q_USERS_ENABLE, {"principal": admin, "user_id": dev["user_id"]})
            t4, p4 = await h.login("dev")
            assert (await h.call(S.Q_USERS_GET, {"principal": p4}))["user"]["username"] == "dev"
            assert (await h.fails(S.Q_USERS_GET, {"principal": p4, "username": "admin"})).kind == "forbidden"

            # the session limit ends the oldest session
            with limits.override(max_sessions_per_user=2):
                t5, p5 = await h.login("dev")
                t6, p6 = await h.login("dev")
                assert (await h.fails(S.Q_VALIDATE, {"token": t4})).kind == "unauthenticated"  # the oldest
                live = (await h.call(S.Q_LIST, {"principal": p6}))["sessions"]
                assert [s["session_id"] for s in live] == [p6["session_id"], p5["session_id"]]

            # a password change ends the user's other sessions and needs the current password
            assert (await h.fails(S.Q_USERS_PASSWORD, {"principal": p6, "password": "new password 1"})).kind == "bad_request"
            assert (await h.fails(S.Q_USERS_PASSWORD, {"principal": p6, "password": "new password 1",
                                                       "current_password": "wrong one!"})).kind == "unauthenticated"
            await h.call(S.Q_USERS_PASSWORD, {"principal": p6, "password": "new password 1", "current_password": DEV_PW})
            assert (await h.fails(S.Q_VALIDATE, {"token": t5})).kind == "unauthenticated"
            assert (await h.call(S.Q_VALIDATE, {"token": t6}))["session_id"] == p6["session_id"]
            await h.login("dev", "new password 1")

    run(main())


class CountingHasher(PasswordHasher):
    """CHEAP's parameters; counts the password checks."""

    def __init__(self) -> None:
        super().__init__(time_cost=1, memory_cost=1024, parallelism=1)
        self.verified = 0

    def verify(self, hash, password) -> bool:  # noqa: A002 - argon2's name
        self.verified += 1
        return super().verify(hash, password)


def test_a_disabled_user_fails_to_log_in_exactly_as_a_wrong_password_does(fresh_nats):
    """No oracle: a disabled user's right and wrong passwords (and an unknown user) get the same answer
    after the same work (the hash is checked each time) and count against the lockout alike; only the
    audit log tells them apart."""
    hasher = CountingHasher()

    async def main():
        async with running(fresh_nats.url, hasher=hasher) as h:
            _, admin = await h.bootstrap()
            dev = await h.add(admin, "dev", ["developer"])
            await h.call(S.Q_USERS_DISABLE, {"principal": admin, "user_id": dev["user_id"]})
            answers = []
            for name, password in (("dev", DEV_PW), ("dev", "wrong password 1"), ("nobody", DEV_PW)):
                before = hasher.verified
                refused = await h.fails(S.Q_LOGIN, {"username": name, "password": password, "client_ip": "10.3.3.3"})
                assert hasher.verified == before + 1, (name, password)  # the hash was checked either way
                answers.append((refused.kind, refused.message, refused.details))
            assert answers == [("unauthenticated", "wrong username or password", None)] * 3
            counted = await h.raw(LOGINS, failed_user_key("dev"))
            assert counted[0]["failures"] == 2  # the right password counts as a failure too
            failed = (await h.call(S.Q_AUDIT_LIST, {"principal": admin, "action": "session.login_failed"}))["records"]
            mine = [r["details"] for r in failed if r["actor"]["username"] == "dev"]
            assert [(d["reason"], d["password_matched"]) for d in mine] == [("disabled", False), ("disabled", True)]

    run(main())


# ------------------------------------------------------------------------------ API tokens
def test_api_token_lifecycle(fresh_nats):
    async def main():
        async with running(fresh_nats.url) as h:
            _, admin = await h.bootstrap()
            dev = await h.add(admin, "dev", ["developer"])
            _, p = await h.login("dev")
            made = await h.call(S.Q_TOKENS_CREATE, {"principal": p, "name": "deploy", "roles": ["viewer"]})
            assert made["token"].startswith("noetl_t_") and made["roles"] == ["viewer"]
            assert made["expires_at"] == p["expires_at"]  # no later than the session that made it
            used = await h.call(S.Q_VALIDATE, {"token": made["token"]})
            assert used["kind"] == "token" and used["token_id"] == made["token_id"] and used["roles"] == ["viewer"]
            assert used["user_id"] == dev["user_id"] and used["token_name"] == "deploy"
            # a token never gets more than its creator: a viewer token cannot make a developer token
            refused = await h.fails(S.Q_TOKENS_CREATE, {"principal": used, "name": "x", "roles": ["developer"]})
            assert refused.kind == "forbidden"
            assert (await h.fails(S.Q_TOKENS_CREATE, {"principal": p, "name": "x", "roles": ["admin"]})).kind == "forbidden"
            full = await h.call(S.Q_TOKENS_CREATE, {"principal": p, "name": "full"})
            assert full["roles"] == ["developer"]
            listed = (await h.call(S.Q_TOKENS_LIST, {"principal": p}))["tokens"]
            assert [t["name"] for t in listed] == ["full", "deploy"]
            assert all(set(t) == {"token_id", "name", "user_id", "username", "email", "display_name", "roles",
                                  "created_at", "expires_at", "minted_by"} for t in listed)
            _, viewer = await h.login("admin", ADMIN_PW)
            assert len((await h.call(S.Q_TOKENS_LIST, {"principal": viewer, "user_id": dev["user_id"]}))["tokens"]) == 2

            # expiry: NATS removes the key
            short = await h.call(S.Q_TOKENS_CREATE, {"principal": p, "name": "short", "expires_in": 1})
            assert (await h.call(S.Q_VALIDATE, {"token": short["token"]}))["token_name"] == "short"
            await asyncio.sleep(2.2)
            assert (await h.fails(S.Q_VALIDATE, {"token": short["token"]})).kind == "unauthenticated"
            assert await h.raw(USERS, f"token.{short['token_id']}") is None

            # a demotion keeps the token roles the user still has, revokes tokens left with none
            await h.call(S.Q_USERS_ROLES, {"principal": admin, "user_id": dev["user_id"], "roles": ["viewer"]})
            assert (await h.call(S.Q_VALIDATE, {"token": made["token"]}))["roles"] == ["viewer"]
            assert (await h.fails(S.Q_VALIDATE, {"token": full["token"]})).kind == "unauthenticated"

            # revocation: by id (owner or token.any), or by the token itself
            await h.call(S.Q_TOKENS_REVOKE, {"principal": used, "token_id": made["token_id"]})
            assert (await h.fails(S.Q_VALIDATE, {"token": made["token"]})).kind == "unauthenticated"
            assert (await h.fails(S.Q_TOKENS_REVOKE, {"principal": admin, "token_id": made["token_id"]})).kind == "not_found"
            again = await h.call(S.Q_TOKENS_CREATE, {"principal": admin, "name": "self"})
            assert await h.call(S.Q_REVOKE, {"token": again["token"]}) == {"revoked": [{"token_id": again["token_id"]}]}
            assert (await h.fails(S.Q_VALIDATE, {"token": again["token"]})).kind == "unauthenticated"
            with limits.override(max_tokens_per_user=2):  # the admin has its bootstrap token
                await h.call(S.Q_TOKENS_CREATE, {"principal": admin, "name": "one"})
                assert (await h.fails(S.Q_TOKENS_CREATE, {"principal": admin, "name": "two"})).kind == "conflict"

    run(main())


# ------------------------------------------------------------------------------ OIDC
class LocalIssuer:
    """An OIDC provider on loopback: discovery and a key set; signs ID tokens with RSA keys."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self.published: list[str] = []
        self.jwks_hits = 0
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path == "/.well-known/openid-configuration":
                    body = {"issuer": issuer.url, "jwks_uri": issuer.url + "/jwks",
                            "id_token_signing_alg_values_supported": ["RS256"]}
                elif self.path == "/jwks":
                    issuer.jwks_hits += 1
                    body = {"keys": [issuer.jwk(kid) for kid in issuer.published]}
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add_key(self, kid: str, publish: bool = True) -> None:
        self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if publish:
            self.published.append(kid)

    def jwk(self, kid: str) -> dict:
        data = jwt.algorithms.RSAAlgorithm.to_jwk(self.keys[kid].public_key(), as_dict=True)
        return {**data, "kid": kid, "use": "sig", "alg": "RS256"}

    def token(self, kid: str = "k1", key: str | None = None, **claims: Any) -> str:
        now = int(time.time())
        payload = {"iss": self.url, "aud": "noetl", "sub": "user-1", "iat": now, "exp": now + 300,
                   "email": "ann@example.com", "email_verified": True, "name": "Ann", **claims}
        return jwt.encode({k: v for k, v in payload.items() if v is not None}, self.keys[key or kid],
                          algorithm="RS256", headers={"kid": kid})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_oidc_logins_against_a_local_issuer(fresh_nats):
    idp = LocalIssuer()
    idp.add_key("k1")
    config = OidcConfig(issuer=idp.url, audience="noetl", roles_claim="roles")

    async def main():
        async with running(fresh_nats.url, oidc=config) as h:
            _, admin = await h.bootstrap()
            # no user for the identity yet, and no auto-provisioning: refused
            assert (await h.fails(S.Q_LOGIN, {"id_token": idp.token()})).message.startswith("no user for this identity")
            await h.add(admin, "ann@example.com", ["viewer"])
            r = await h.call(S.Q_LOGIN, {"id_token": idp.token(roles=["developer"]), "client_ip": "10.0.0.9"})
            who = r["principal"]
            assert who["username"] == "ann@example.com" and who["roles"] == ["developer"]  # the provider's roles
            stored, _ = await h.raw(SESSIONS, session_key(who["session_id"]))
            assert stored["idp_subject"] == "user-1"
            again = await h.call(S.Q_LOGIN, {"id_token": idp.token(email="changed@example.com", roles=["viewer"])})
            assert again["principal"]["user_id"] == who["user_id"]  # linked by issuer and subject now
            assert (await h.call(S.Q_VALIDATE, {"token": r["token"]}))["roles"] == ["viewer"]  # sessions follow

            idp.add_key("other", publish=False)
            cases = {
                "bad signature": idp.token(kid="k1", key="other"),
                "wrong audience": idp.token(aud="someone-else"),
                "expired": idp.token(exp=int(time.time()) - 3600, iat=int(time.time()) - 7200),
                "wrong issuer": idp.token(iss="https://evil.example"),
                "no subject": idp.token(sub=None),
                "alg none": jwt.encode({"iss": idp.url, "aud": "noetl", "sub": "user-1", "exp": int(time.time()) + 60,
                                        "iat": int(time.time())}, None, algorithm="none", headers={"kid": "k1"}),
                "hmac with the public key": jwt.encode({"iss": idp.url, "aud": "noetl", "sub": "user-1"},
                                                       "a shared secret of at least 32 bytes!", algorithm="HS256", headers={"kid": "k1"}),
                "garbage": "not.a.jwt",
            }
            messages = {}
            for what, token in cases.items():
                e = await h.fails(S.Q_LOGIN, {"id_token": token})
                assert e.kind == "unauthenticated", (what, e)
                messages[what] = e.message
            assert "signature" in messages["bad signature"] and "(aud)" in messages["wrong audience"]
            assert "expired" in messages["expired"] and "(iss)" in messages["wrong issuer"]
            assert "not accepted" in messages["alg none"] and "not accepted" in messages["hmac with the public key"]

            # key rotation: an unknown kid fetches the key set again (once), then verifies
            hits = idp.jwks_hits
            idp.add_key("k2")
            await asyncio.sleep(1.1)  # oidc_jwks_min_interval since the last fetch
            ok = await h.call(S.Q_LOGIN, {"id_token": idp.token(kid="k2")})
            assert ok["principal"]["user_id"] == who["user_id"] and idp.jwks_hits == hits + 1
            # ... but made-up kids do not make it fetch again and again: once a second at most (the
            # limit here), however many logins name one (5 in a row; on a loaded machine they may take
            # more than a second, and then one more fetch is allowed for each second they took)
            idp.add_key("k3", publish=False)
            began = time.monotonic()
            for _ in range(5):
                assert (await h.fails(S.Q_LOGIN, {"id_token": idp.token(kid="k3")})).kind == "unauthenticated"
            took = time.monotonic() - began
            assert hits + 1 <= idp.jwks_hits <= hits + 1 + int(took), (idp.jwks_hits, hits, took)
            failed = (await h.call(S.Q_AUDIT_LIST, {"principal": admin, "action": "session.login_failed"}))["records"]
            assert len(failed) >= len(cases) + 5 and all(r["details"]["method"] == "oidc" for r in failed)

        auto = OidcConfig(issuer=idp.url, audience="noetl", auto_provision=True)
        async with running(fresh_nats.url, oidc=auto) as h:  # same NATS: the users bucket is kept
            r = await h.call(S.Q_LOGIN, {"id_token": idp.token(sub="new-person", email="bob@example.com", name="Bob")})
            assert r["principal"]["username"] == "bob@example.com" and r["principal"]["roles"] == ["viewer"]
            assert r["principal"]["display_name"] == "Bob"
            unverified = await h.call(S.Q_LOGIN, {"id_token": idp.token(sub="p3", email="eve@example.com",
                                                                         email_verified=False)})
            assert unverified["principal"]["username"].startswith("oidc-")  # an unverified email names nobody

    try:
        with limits.override(oidc_jwks_min_interval=1):
            run(main())
    finally:
        idp.close()


# ------------------------------------------------------------------------------ lockout
def test_failed_logins_are_slowed_then_locked_then_forgotten(fresh_nats):
    async def main():
        async with running(fresh_nats.url) as h:
            _, admin = await h.bootstrap()
            await h.add(admin, "dev", ["developer"])
            await h.add(admin, "ops", ["operator"])
            with limits.override(login_slow_after=2, login_lock_after=3, login_lock_seconds=3,
                                 login_address_slow_after=50, login_address_lock_after=100):
                bad = {"username": "dev", "password": "wrong password", "client_ip": "10.1.1.1"}
                for _ in range(2):
                    assert (await h.fails(S.Q_LOGIN, bad)).kind == "unauthenticated"
                slowed = await h.fails(S.Q_LOGIN, bad)  # the third comes too soon
                assert slowed.kind == "locked" and slowed.details["retry_after"] == 1 and "slowed" in slowed.message
                await asyncio.sleep(1.1)
                assert (await h.fails(S.Q_LOGIN, bad)).kind == "unauthenticated"  # failure 3: locked
                locked = await h.fails(S.Q_LOGIN, {**bad, "password": DEV_PW})  # even the right password
                assert locked.kind == "locked" and locked.details["retry_after"] == 3 and "locked" in locked.message
                assert (await h.login("ops"))[1]["username"] == "ops"  # other users are not affected
                await asyncio.sleep(3.2)
                assert (await h.login("dev"))[1]["username"] == "dev"  # the window passed
                # correct logins of one user at once are not mistaken for guesses
                many = await asyncio.gather(*(h.login("dev") for _ in range(6)))
                assert len({p["session_id"] for _, p in many}) == 6

                # parallel guesses are counted before they are checked: no burst gets through
                results = await asyncio.gather(*(h.call(S.Q_LOGIN, bad) for _ in range(10)), return_exceptions=True)
                kinds = sorted(r.kind for r in results)
                assert kinds.count("unauthenticated") == 2 and kinds.count("locked") == 8

            with limits.override(login_address_slow_after=3, login_address_lock_after=3, login_lock_seconds=3):
                for name in ("a1", "a2", "a3"):  # spraying many users from one address
                    assert (await h.fails(S.Q_LOGIN, {"username": name, "password": "guess guess",
                                                      "client_ip": "10.9.9.9"})).kind == "unauthenticated"
                e = await h.fails(S.Q_LOGIN, {"username": "ops", "password": DEV_PW, "client_ip": "10.9.9.9"})
                assert e.kind == "locked" and "this address" in e.message
                assert (await h.login("ops", ip="10.9.9.10"))[1]["username"] == "ops"

            failed = (await h.call(S.Q_AUDIT_LIST, {"principal": admin, "action": "session.login_failed"}))["records"]
            dev_failures = [r for r in failed if r["actor"]["username"] == "dev"]
            assert len(dev_failures) == 3 + 2  # each failure is recorded
            assert any(r["details"]["locked"] for r in dev_failures)

    run(main())


# ------------------------------------------------------------------------------ audit
def test_audit_records_and_query(fresh_nats):
    async def main():
        async with running(fresh_nats.url) as h:
            _, admin = await h.bootstrap()
            dev = await h.add(admin, "dev", ["developer"])
            t, p = await h.login("dev", ip="192.0.2.7")
            await h.call(S.Q_REVOKE, {"token": t, "client_ip": "192.0.2.7"})
            _, p = await h.login("dev")
            assert (await h.fails(S.Q_AUDIT_LIST, {"principal": p})).kind == "forbidden"
            # the gateway's helper
            await audit.record(h.client, "credential.read", actor=p, client_ip="192.0.2.8", target={"credential": "pg1"})
            # the server's answer to an API request, stored at an audit subject (any user allowed any API
            # request can have it written there): not a record
            before = (await h.client.js.stream_info(audit.STREAM)).state.messages
            await h.client.nc.publish(f"$JS.API.STREAM.INFO.{audit.STREAM}", b"", reply="noetl.audit.credential.resolved.x")
            for _ in range(100):
                if (await h.client.js.stream_info(audit.STREAM)).state.messages > before:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the server did not store its answer")

            everything = (await h.call(S.Q_AUDIT_LIST, {"principal": admin}))["records"]
            actions = [r["action"] for r in everything]
            assert actions == ["credential.read", "access.denied", "session.login", "session.logout", "session.login",
                               "user.added", "user.bootstrapped"]  # newest first
            login = everything[4]
            assert login["actor"]["user_id"] == dev["user_id"] and login["client_ip"] == "192.0.2.7"
            assert login["actor"]["session_id"] == everything[3]["actor"]["session_id"]
            assert everything[1]["details"] == {"permission": "audit.read"} and everything[1]["outcome"] == "denied"

            def q(**kw):
                return h.call(S.Q_AUDIT_LIST, {"principal": admin, **kw})

            assert [r["action"] for r in (await q(user=dev["user_id"]))["records"]] == actions[:5]
            assert [r["action"] for r in (await q(action="session"))["records"]] == actions[2:5]
            assert [r["action"] for r in (await q(action="session.login", user=dev["user_id"], limit=1))["records"]] == \
                ["session.login"]
            assert (await q(since=everything[2]["at"]))["records"] == everything[:3]
            assert (await h.fails(S.Q_AUDIT_LIST, {"principal": admin, "action": "x.>"})).kind == "bad_request"
            info = await h.client.js.stream_info(audit.STREAM)
            assert info.config.max_age == 90 * 24 * 3600 and info.config.subjects == ["noetl.audit.>"]
            # many records: the query reads backwards in growing windows
            for i in range(150):
                await audit.record(h.client, "execution.cancelled", actor=admin, target={"execution_id": str(i)})
            got = (await q(action="user", limit=5))["records"]
            assert [r["action"] for r in got] == ["user.added", "user.bootstrapped"]
            got = (await q(limit=120))["records"]
            assert len(got) == 120 and got[0]["target"] == {"execution_id": "149"}

    run(main())


# ------------------------------------------------------------------------------ nothing secret leaks
def test_no_secret_in_logs_kv_audit_notices_or_replies(fresh_nats, caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore"):  # an in-process worker of an earlier test keeps them at WARNING
        caplog.set_level(logging.DEBUG, logger=name)
    idp = LocalIssuer()
    idp.add_key("k1")
    config = OidcConfig(issuer=idp.url, audience="noetl")
    passwords = [ADMIN_PW, DEV_PW, "second password 2", "wrong password 3"]

    async def main():
        async with running(fresh_nats.url, replicas=2, oidc=config) as h:
            notices: list[bytes] = []

            async def on_notice(msg):
                notices.append(msg.data)

            await h.client.nc.subscribe(S.REVOKED, cb=on_notice)
            tokens = []
            boot = await h.call(S.Q_BOOTSTRAP, {"username": "admin", "password": ADMIN_PW, "client_ip": "10.0.0.1"})
            tokens.append(boot["token"])
            admin = await h.call(S.Q_VALIDATE, {"token": boot["token"]})
            dev = await h.add(admin, "dev", ["developer"])
            await h.add(admin, "ann@example.com", ["viewer"])
            with limits.override(session_refresh_interval=0.001):
                t, p = await h.login("dev")
                tokens.append(t)
                for _ in range(3):
                    await h.call(S.Q_VALIDATE, {"token": t})
                await h.call(S.Q_REFRESH, {"token": t})
            with contextlib.suppress(BusError):
                await h.call(S.Q_LOGIN, {"username": "dev", "password": passwords[3], "client_ip": "10.0.0.3"})
            made = await h.call(S.Q_TOKENS_CREATE, {"principal": p, "name": "ci", "roles": ["viewer"]})
            tokens.append(made["token"])
            await h.call(S.Q_VALIDATE, {"token": made["token"]})
            await h.call(S.Q_TOKENS_LIST, {"principal": p})
            await h.call(S.Q_LIST, {"principal": p})
            await h.call(S.Q_USERS_PASSWORD, {"principal": p, "password": passwords[2], "current_password": DEV_PW})
            t2, p2 = await h.login("dev", passwords[2])
            tokens.append(t2)
            id_token = idp.token()
            oidc = await h.call(S.Q_LOGIN, {"id_token": id_token})
            tokens += [oidc["token"], id_token]
            await h.call(S.Q_USERS_LIST, {"principal": admin})
            await h.call(S.Q_USERS_GET, {"principal": admin, "user_id": dev["user_id"]})
            await h.call(S.Q_USERS_ROLES, {"principal": admin, "user_id": dev["user_id"], "roles": ["operator"]})
            await h.call(S.Q_REVOKE, {"token": t2})
            await h.call(S.Q_TOKENS_REVOKE, {"principal": admin, "token_id": made["token_id"]})
            await h.call(S.Q_USERS_DISABLE, {"principal": admin, "user_id": dev["user_id"]})
            await h.call(S.Q_AUDIT_LIST, {"principal": admin, "limit": 1000})
            await asyncio.sleep(0.2)  # notices in flight

            # everything stored: every message of every bucket's stream (values, markers, history) and the audit log
            stored: dict[str, list[bytes]] = {}
            for stream in (f"KV_{SESSIONS}", f"KV_{USERS}", f"KV_{LOGINS}", audit.STREAM):
                state = (await h.client.js.stream_info(stream)).state
                stored[stream] = []
                for seq in range(state.first_seq, state.last_seq + 1):
                    with contextlib.suppress(Exception):
                        msg = await h.client.js.get_msg(stream, seq=seq)
                        stored[stream].append(msg.subject.encode() + b" " + (msg.data or b"") +
                                              json.dumps(msg.headers or {}).encode())
            assert sum(len(v) for v in stored.values()) > 30
            return h.replies, stored, notices, tokens

    try:
        replies, stored, notices, tokens = run(main())
    finally:
        idp.close()
    password_hashes = []
    for blob in stored[f"KV_{USERS}"]:
        start = blob.find(b'"password_hash":"')
        if start >= 0:
            password_hashes.append(blob[start + 17:blob.index(b'"', start + 17)].decode())
    assert len(password_hashes) >= 3
    secrets = {f"password {i}": pw for i, pw in enumerate(passwords)}
    for i, token in enumerate(tokens):
        digest = hashlib.sha256(token.encode()).digest()
        secrets[f"token {i}"] = token
        secrets[f"token {i} sha256"] = digest.hex()
        secrets[f"token {i} sha256 b64"] = base64.b64encode(digest).decode()
        secrets[f"token {i} sha256 b64url"] = base64.urlsafe_b64encode(digest).decode().rstrip("=")
        secrets[f"token {i} id digest"] = hashlib.sha256(b"noetl.token-id\x00" + token.encode()).hexdigest()
    hashes = {f"argon2 hash {i}": h for i, h in enumerate(password_hashes)}
    hashes.update({f"argon2 salt+hash {i}": h.rsplit("$", 2)[-2] + "$" + h.rsplit("$", 1)[-1]
                   for i, h in enumerate(password_hashes)})

    # the replies that issue a token carry it once, in "token"; nothing else of any reply is secret
    issuing = (S.Q_BOOTSTRAP, S.Q_LOGIN, S.Q_TOKENS_CREATE)
    reply_text = "\n".join(json.dumps({k: v for k, v in r.items() if not (s in issuing and k == "token")})
                           for s, r in replies)
    logs = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert len(caplog.records) > 20
    places = {"logs": logs, "replies": reply_text, "notices": b"\n".join(notices).decode(),
              "audit": b"\n".join(stored[audit.STREAM]).decode(), "sessions bucket": b"\n".join(stored[f"KV_{SESSIONS}"]).decode(),
              "logins bucket": b"\n".join(stored[f"KV_{LOGINS}"]).decode(), "users bucket": b"\n".join(stored[f"KV_{USERS}"]).decode()}
    found = [(what, where) for where, text in places.items() for what, secret in secrets.items() if secret in text]
    # the users bucket keeps the argon2 hashes (that is where they live); nowhere else has them
    found += [(what, where) for where, text in places.items() if where != "users bucket"
              for what, secret in hashes.items() if secret in text]
    assert found == []


def test_password_hashes_follow_the_service_parameters(fresh_nats):
    other = PasswordHasher(time_cost=1, memory_cost=2048, parallelism=1)

    async def main():
        async with running(fresh_nats.url) as h:  # hashes made with CHEAP
            _, admin = await h.bootstrap()
            dev = await h.add(admin, "dev", ["developer"])
        async with running(fresh_nats.url, hasher=other) as h:  # the parameters changed
            before, _ = await h.raw(USERS, f"user.{dev['user_id']}")
            await h.login("dev")
            after, rev = await h.raw(USERS, f"user.{dev['user_id']}")
            assert "m=1024" in before["password_hash"] and "m=2048" in after["password_hash"]  # rehashed at login
            await h.login("dev")
            assert (await h.raw(USERS, f"user.{dev['user_id']}"))[1] == rev  # once: no write per login

    run(main())


def test_a_login_flood_is_refused_at_once_and_validations_go_on(fresh_nats, monkeypatch):
    monkeypatch.setattr(S, "MAX_HASH_QUEUE", 2)

    async def main():
        async with running(fresh_nats.url, hasher=None) as h:  # default parameters: each check takes a while
            _, admin = await h.bootstrap()
            await h.add(admin, "dev", ["developer"])
            token, _ = await h.login("dev")
            flood = asyncio.gather(*(h.login("dev") for _ in range(8)), return_exceptions=True)
            await asyncio.sleep(0.01)
            assert (await h.call(S.Q_VALIDATE, {"token": token}))["username"] == "dev"  # not behind the flood
            results = await flood
            busy = [r for r in results if isinstance(r, BusError)]
            assert len(results) - len(busy) >= 3 and busy  # one hashing, two waiting; the rest refused
            assert all(b.kind == "unavailable" and b.details == {"retry_after": 1} for b in busy)

    run(main())
