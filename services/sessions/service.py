"""sessions: logins, sessions, users, API tokens and the audit log, answered over NATS request/reply.
The rules are in :mod:`noetl_mesh.core.access`; storage in :mod:`.store` (KV buckets ``noetl_sessions``,
``noetl_users``, ``noetl_logins``), OIDC in :mod:`.oidc`, the audit stream in :mod:`.audit`.
docs/security.md is the operator's view.

API. JSON in, JSON out, queue group ``sessions``; an error is ``{"error": {"kind", "message",
"details"}}`` with kind ``unauthenticated``, ``forbidden``, ``bad_request``, ``not_found``,
``conflict``, ``locked`` (``details.retry_after``: seconds), ``unavailable`` or ``internal``.

Requests made for a user carry ``principal`` (what ``validate`` returned, as the gateway got it) and
usually ``client_ip``. The service does not trust the principal's roles: it reads the session or token
again (it must still be live) and checks the permission itself. Times are ISO 8601 UTC strings.

| subject | request | reply | permission |
|---|---|---|---|
| ``noetl.q.sessions.bootstrap`` | ``{username?: "admin", password?, client_ip?}`` | ``{created: true, user, token, token_id}`` (an admin API token, no expiry), or ``{created: false, message}`` once any user exists | none (NATS permissions guard the subject) |
| ``noetl.q.sessions.login`` | ``{username, password, client_ip?}`` or ``{id_token, nonce?, client_ip?}`` | ``{token, principal}`` | none |
| ``noetl.q.sessions.validate`` | ``{token}`` | the principal | none |
| ``noetl.q.sessions.refresh`` | ``{token}`` (a session's) | the principal, idle expiry moved now | none |
| ``noetl.q.sessions.revoke`` | ``{token}`` (logout; an API token revokes itself), or ``{principal, session_id}``, or ``{principal, user_id}`` (all of a user's sessions) | ``{revoked: [{session_id} or {token_id}]}`` | ``session.own`` / ``session.any`` |
| ``noetl.q.sessions.list`` | ``{principal, user_id?}`` | ``{sessions: [session]}`` newest first, ``current`` marks the caller's | ``session.own`` / ``session.any`` |
| ``noetl.q.users.add`` | ``{principal, username, password?, email?, display_name?, roles?: ["viewer"]}`` | ``{user}`` | ``user.admin`` |
| ``noetl.q.users.list`` | ``{principal}`` | ``{users: [user]}`` by username | ``user.admin`` |
| ``noetl.q.users.get`` | ``{principal, user_id}`` or ``{principal, username}`` | ``{user}`` | oneself, else ``user.admin`` |
| ``noetl.q.users.disable`` | ``{principal, user_id}`` | ``{user, revoked: {sessions, tokens}}``: its sessions and API tokens are revoked | ``user.admin`` |
| ``noetl.q.users.enable`` | ``{principal, user_id}`` | ``{user}`` | ``user.admin`` |
| ``noetl.q.users.roles`` | ``{principal, user_id, roles}`` | ``{user}``; its sessions take the roles, its tokens keep the roles it still has | ``user.admin`` |
| ``noetl.q.users.password`` | ``{principal, password, current_password?, user_id?}`` | ``{user}``; the user's other sessions are revoked | oneself (with ``current_password`` when one is set), else ``user.admin`` |
| ``noetl.q.tokens.create`` | ``{principal, name, roles?, expires_in?}`` (seconds) | ``{token, token_id, name, roles, expires_at}``; roles a subset of the caller's, ending no later than the caller (without ``expires_in``: when it ends) | ``token.own`` |
| ``noetl.q.tokens.list`` | ``{principal, user_id?}`` | ``{tokens: [token record]}`` | ``token.own`` / ``token.any`` |
| ``noetl.q.tokens.revoke`` | ``{principal, token_id}`` | ``{revoked: [{token_id}]}`` | ``token.own`` / ``token.any`` |
| ``noetl.q.users.standing`` | ``{user_id, token_id?}`` (no principal: services only, by their NATS permissions) | ``{exists, active, roles, token_active?}``: ``token_active`` when ``token_id`` is asked (that API token of the user is neither revoked nor expired) | — |
| ``noetl.q.audit.list`` | ``{principal, user?, action?, since?, limit?: 100}`` | ``{records: [record]}`` newest first (``limit`` ≤ 1000) | ``audit.read`` |

A principal: ``{user_id, username, email, display_name, roles, kind: "session" | "token", session_id |
token_id (+ token_name), expires_at (absolute; null for a token without expiry), idle_expires_at
(sessions)}``. A user: ``{user_id, username, email, display_name, roles, disabled, has_password, oidc,
created_at, updated_at}`` (never the password hash).

Notices: core NATS ``noetl.sessions.revoked`` ``{session_id?, token_id?, user_id, reason}`` whenever a
session or token stops being valid or changes (logout, revocation, user disabled, roles changed,
password changed, session limit): a gateway drops the cached validation of that session or token, or,
without either id, every cached validation of ``user_id``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any, Awaitable, Callable

import orjson

from noetl_mesh import limits
from noetl_mesh.core import access
from noetl_mesh.core.access import AccessError, iso, principal
from noetl_mesh.infra import metrics, tracing
from noetl_mesh.infra.bus import ERROR_KINDS, unsubscribe_all

from . import audit
from .oidc import OidcConfig, OidcVerifier
from .store import (BOOTSTRAP, LOGINS, SESSIONS, UNAVAILABLE, USERS, Bucket, Conflict, failed_address_key,
                    failed_user_key, name_key, oidc_key, session_index, session_key, token_index, token_key,
                    user_key)

log = logging.getLogger("noetl.sessions")

# ---- subjects (named in contracts/subjects.py; the gateway and CLI import them from here)
from noetl_mesh.contracts.subjects import (  # noqa: E402 - the one list: contracts/subjects.py
    Q_AUDIT_LIST, Q_BOOTSTRAP, Q_LIST, Q_LOGIN, Q_REFRESH, Q_REVOKE, Q_TOKENS_CREATE, Q_TOKENS_LIST, Q_TOKENS_REVOKE,
    Q_USERS_ADD, Q_USERS_DISABLE, Q_USERS_ENABLE, Q_USERS_GET, Q_USERS_LIST, Q_USERS_PASSWORD, Q_USERS_ROLES,
    Q_USERS_STANDING, Q_VALIDATE)
from noetl_mesh.contracts.subjects import SESSIONS_REVOKED as REVOKED  # noqa: E402 - notice: drop cached validations
QUEUE = "sessions"

MAX_IN_FLIGHT = 1024  # requests handled at once per replica; more are answered "unavailable"
MAX_HASH_QUEUE = 32  # password checks waiting for the hashing slot per replica; more are answered "unavailable"
BOOTSTRAP_TTL = 30  # seconds the bootstrap claim lives: a replica that dies mid-bootstrap blocks nobody
MAX_TOKEN_SECONDS = 10 * 365 * 24 * 3600
CAS_TRIES = 20
WRONG_LOGIN = "wrong username or password"  # every failed password login: unknown user, wrong password, disabled
ENV = object()  # OIDC configuration from the environment


class SessionsService:
    name = "sessions"

    def __init__(self, bus, *, oidc: Any = ENV, hasher=None, hash_threads: int = 1):
        """``oidc``: an :class:`OidcConfig`, None (no OIDC logins) or, by default, the environment's
        (``NOETL_OIDC_*``). ``hasher``: an argon2 ``PasswordHasher`` (:data:`access.HASHER` if None);
        ``hash_threads`` bounds the password hashes computed at once (each one core and 19 MiB), so
        logins never take every core from validations; more login throughput is more replicas."""
        self.bus = bus
        self.oidc_config: OidcConfig | None = OidcConfig.from_environment() if oidc is ENV else oidc
        self.verifier: OidcVerifier | None = None
        self.hasher = hasher or access.HASHER
        self._hashing = asyncio.Semaphore(hash_threads)
        self._hash_waiting = 0
        self._subs: list = []
        self._tasks: set[asyncio.Task] = set()
        self.answered = 0  # requests answered (any outcome)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        js = self.bus.js
        n = await self.bus.replica_count()  # what dies with one node must not be ours alone
        self.sessions = await Bucket(js, SESSIONS, "noetl login sessions (keys expire by per-message TTL)", n).open()
        self.users = await Bucket(js, USERS, "noetl users and API tokens", n).open()
        self.logins = await Bucket(js, LOGINS, "noetl failed-login counters", n).open()
        await audit.ensure_stream(js, n)
        if self.oidc_config is not None:
            self.verifier = OidcVerifier(self.oidc_config)
        for subject, handler in self._handlers().items():
            self._subs.append(await self.bus.nc.subscribe(subject, queue=QUEUE, cb=self._on_request(subject, handler)))
        await self.bus.nc.flush(timeout=5)  # started means answering: the server has the subscriptions
        log.info("sessions: answering %d subjects%s", len(self._subs),
                 f"; OIDC issuer {self.oidc_config.issuer}" if self.oidc_config else "")

    async def stop(self) -> None:
        await unsubscribe_all(self._subs)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self.verifier is not None:
            await self.verifier.close()
            self.verifier = None

    def _handlers(self) -> dict[str, Callable[[dict], Awaitable[Any]]]:
        return {
            Q_BOOTSTRAP: self.bootstrap, Q_LOGIN: self.login, Q_VALIDATE: self.validate, Q_REFRESH: self.refresh,
            Q_REVOKE: self.revoke, Q_LIST: self.list_sessions,
            Q_USERS_ADD: self.users_add, Q_USERS_LIST: self.users_list, Q_USERS_GET: self.users_get,
            Q_USERS_DISABLE: self.users_disable, Q_USERS_ENABLE: self.users_enable, Q_USERS_ROLES: self.users_roles,
            Q_USERS_PASSWORD: self.users_password, Q_USERS_STANDING: self.users_standing,
            Q_TOKENS_CREATE: self.tokens_create, Q_TOKENS_LIST: self.tokens_list, Q_TOKENS_REVOKE: self.tokens_revoke,
            Q_AUDIT_LIST: self.audit_list,
        }

    def _on_request(self, subject: str, handler: Callable[[dict], Awaitable[Any]]):
        """Like ``Bus.serve``, but each request is answered in its own task: a login waiting for its
        password hash never holds up the next request. Counted like ``Bus.serve``'s (``Bus.endpoint``)."""
        counts = self.bus.endpoint(subject, QUEUE)

        async def on_msg(msg) -> None:
            if self.bus.unanswerable(msg, subject, counts):  # an answer goes to an inbox only
                return
            if len(self._tasks) >= MAX_IN_FLIGHT:
                counts.record(time.perf_counter_ns(), error=f"unavailable: busy: {MAX_IN_FLIGHT} requests in progress")
                await _respond(msg, _error("unavailable", f"busy: {MAX_IN_FLIGHT} requests in progress"))
                return
            task = asyncio.create_task(self._answer(subject, handler, msg, counts))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return on_msg

    async def _answer(self, subject: str, handler, msg, counts) -> None:
        started = time.perf_counter_ns()
        t0 = time.perf_counter()
        with tracing.consume_span(f"{self.bus.name} {subject}", msg.headers, service=self.name):
            try:
                req = orjson.loads(msg.data) if msg.data else {}
                if not isinstance(req, dict):
                    raise AccessError("bad_request", "the request must be a JSON object")
                reply = await handler(req)
            except AccessError as exc:
                reply = _error(exc.kind, exc.message, exc.retry_after)
            except orjson.JSONDecodeError:
                reply = _error("bad_request", "the request is not JSON")
            except UNAVAILABLE as exc:
                log.warning("%s: NATS did not serve the request (%s: %s)", subject, type(exc).__name__, exc)
                reply = _error("unavailable", f"the session store (NATS JetStream) is unavailable ({type(exc).__name__})")
            except Exception as exc:  # noqa: BLE001 - reply instead of leaving the caller to time out
                log.exception("%s failed", subject)
                reply = _error("internal", f"{type(exc).__name__}")
            exemplar = metrics.exemplar()
        self.answered += 1
        await _respond(msg, reply)
        kind = (reply.get("error") or {}).get("kind") if isinstance(reply, dict) else None
        metrics.REQUESTS.labels(self.name, subject, "ok" if kind is None else kind if kind in ERROR_KINDS else "error") \
            .observe(time.perf_counter() - t0, exemplar)
        error = reply.get("error") if isinstance(reply, dict) and set(reply) == {"error"} else None
        counts.record(started, error=f"{error.get('kind')}: {error.get('message')}" if isinstance(error, dict) else None)

    async def ready(self) -> dict[str, Any]:
        """Its buckets open and its subjects answered (the store is NATS KV: no database)."""
        ok = bool(self._subs) and all(getattr(self, b, None) is not None for b in ("sessions", "users", "logins"))
        return {"ok": ok, **({} if ok else {"error": "not answering yet"})}

    # ------------------------------------------------------------------ settings
    @staticmethod
    def _policy() -> access.SessionPolicy:
        now = limits.current()
        return access.SessionPolicy(now.session_lifetime, now.session_idle, now.session_refresh_interval)

    @staticmethod
    def _counters(username: str | None, ip: str | None) -> list[tuple[str, access.LockoutPolicy, str]]:
        now = limits.current()
        out = []
        if username is not None:
            out.append((failed_user_key(username), access.LockoutPolicy(
                now.login_slow_after, now.login_lock_after, now.login_lock_seconds), "this user"))
        if ip is not None:
            out.append((failed_address_key(ip), access.LockoutPolicy(
                now.login_address_slow_after, now.login_address_lock_after, now.login_lock_seconds), "this address"))
        return out

    # ------------------------------------------------------------------ bootstrap
    async def bootstrap(self, req: dict) -> dict:
        name = access.new_username(req.get("username") or "admin")
        password = req.get("password")
        if password is not None:
            self._check_new_password(password)
        ip = access.client_ip(req.get("client_ip"))
        done = {"created": False, "message": "already done: users exist; log in as one of them"}
        if await self.users.keys(user_key()):
            return done
        try:  # one bootstrap at a time (the claim expires by itself)
            await self.users.create(BOOTSTRAP, {"claimed_at": iso(time.time())}, ttl=BOOTSTRAP_TTL)
        except Conflict:
            return {"created": False, "message": "already in progress"}
        if await self.users.keys(user_key()):
            return done
        user = await self._add_user(name, password, ["admin"])
        token, rec = await self._new_api_token(user, "bootstrap", ["admin"], None)
        log.info("bootstrap: created the first admin %s (user %s) with API token %s", name, user["user_id"],
                 rec["token_id"])
        await self._audit("user.bootstrapped", actor=principal(rec, "token"), client_ip=ip,
                          target={"user_id": user["user_id"], "username": name})
        return {"created": True, "user": access.public_user(user), "token": token, "token_id": rec["token_id"]}

    # ------------------------------------------------------------------ login
    async def login(self, req: dict) -> dict:
        ip = access.client_ip(req.get("client_ip"))
        if "id_token" in req:
            return await self._login_oidc(req, ip)
        name = access.username(req.get("username"))
        password = req.get("password")
        if not isinstance(password, str) or not password or len(password.encode()) > limits.current().max_password_bytes:
            raise AccessError("bad_request", "password: a non-empty string of at most max_password_bytes "
                                             f"= {limits.current().max_password_bytes} bytes")
        got = await self._user_by_name(name)
        user = got[0] if got else None
        # A disabled user's login fails like a wrong password, whether its password is right or not: the
        # hash is checked either way, the failure counted, the answer the same. Telling them apart would
        # let a guesser confirm a disabled user's password (to try elsewhere); the audit log says which.
        disabled = bool(user and user.get("disabled"))
        verdict, matched = await self._checked(self._counters(name, ip), user.get("password_hash") if user else None,
                                               password, refuse=disabled)
        if verdict != "ok":
            reason = "disabled" if disabled else "wrong username or password"
            await self._audit("session.login_failed", actor={"user_id": user and user["user_id"], "username": name},
                              client_ip=ip, outcome="failed",
                              details={"method": "password", "reason": reason, "locked": verdict == "locked",
                                       **({"password_matched": matched} if disabled else {})})
            raise AccessError("unauthenticated", WRONG_LOGIN)
        if access.needs_rehash(user["password_hash"], self.hasher):  # hashed with other parameters
            new_hash = await self._hash(password)
            user = await self._update_user(user["user_id"], lambda u: {**u, "password_hash": new_hash}) or user
        return await self._logged_in(user, ip, "password")

    async def _login_oidc(self, req: dict, ip: str | None) -> dict:
        if self.verifier is None:
            raise AccessError("bad_request", "OIDC login is not configured (NOETL_OIDC_ISSUER)")
        counters = self._counters(None, ip)
        await self._check(counters)
        try:
            claims = await self.verifier.verify(req.get("id_token"), req.get("nonce"))
        except AccessError as exc:
            if exc.kind == "unauthenticated":
                locks = await self._failed(counters)
                await self._audit("session.login_failed", actor=None, client_ip=ip, outcome="failed",
                                  details={"method": "oidc", "reason": exc.message, "locked": locks})
            raise
        identity = access.oidc_identity(claims, self.oidc_config.roles_claim)
        user = await self._oidc_user(identity)
        if user.get("disabled"):
            await self._audit("session.login_failed", actor={"user_id": user["user_id"], "username": user["username"]},
                              client_ip=ip, outcome="failed", details={"method": "oidc", "reason": "disabled"})
            raise AccessError("unauthenticated", "the user is disabled")
        return await self._logged_in(user, ip, "oidc", identity["subject"])

    async def _logged_in(self, user: dict, ip: str | None, method: str, idp_subject: str | None = None) -> dict:
        token, rec = await self._open_session(user, ip, idp_subject)
        who = principal(rec, "session", self._policy())
        log.info("login: user %s (%s) session %s via %s", user["username"], user["user_id"], rec["session_id"], method)
        await self._audit("session.login", actor=who, client_ip=ip, details={"method": method})
        return {"token": token, "principal": who}

    async def _oidc_user(self, identity: dict) -> dict:
        """The user an OIDC identity maps to: linked by issuer and subject; else a user whose username is
        the (verified) email, linked now; else, with auto-provisioning, a new user."""
        cfg = self.oidc_config
        link = oidc_key(identity["issuer"], identity["subject"])
        oidc = {"issuer": identity["issuer"], "subject": identity["subject"]}
        user = None
        got = await self.users.get(link)
        if got:
            found = await self._user(got[0].get("user_id", ""))
            user = found[0] if found else None
        if user is None and identity["email_verified"]:
            found = await self._user_by_name(identity["email"].lower())
            if found and found[0].get("oidc") in (None, oidc):  # never one linked to another identity
                user = found[0]
                try:
                    await self.users.create(link, {"user_id": user["user_id"]})
                except Conflict:
                    pass  # linked meanwhile
                user = await self._update_user(user["user_id"], lambda u: {**u, "oidc": oidc}) or user
        if user is None and cfg.auto_provision:
            name = identity["email"].lower() if identity["email_verified"] else None
            if name is None or not access.USERNAME.match(name) or await self.users.get(name_key(name)):
                name = "oidc-" + link.split(".", 1)[1][:16]
            try:
                user = await self._add_user(name, None, identity["roles"] or [cfg.default_role],
                                            email=identity["email"], display_name=identity["display_name"], oidc=oidc)
            except AccessError as exc:  # the same identity provisioned at the same moment elsewhere?
                got = await self.users.get(link) if exc.kind == "conflict" else None
                found = await self._user(got[0].get("user_id", "")) if got else None
                if not found:
                    raise
                return found[0]
            try:
                await self.users.create(link, {"user_id": user["user_id"]})
            except Conflict:
                pass
            await self._audit("user.added", actor=None, target={"user_id": user["user_id"], "username": name,
                                                                  "roles": user["roles"]}, details={"via": "oidc"})
        if user is None:
            raise AccessError("unauthenticated", "no user for this identity: an admin adds it "
                                                 "(with the verified email as username)")
        roles = identity["roles"]
        if roles is not None and (roles or [cfg.default_role]) != user["roles"]:  # the provider decides the roles
            before = user["roles"]
            user = await self._set_roles(user["user_id"], roles or [cfg.default_role])
            await self._audit("user.roles_changed", actor=None, target={"user_id": user["user_id"],
                                                                      "username": user["username"]},
                              details={"before": before, "after": user["roles"], "via": "oidc"})
        return user

    async def _checked(self, counters, stored: str | None, password: str, refuse: bool = False) -> tuple[str, bool]:
        """Check a password under the failed-login counters: (``ok``, ``failed``, or ``locked`` (failed,
        and this failure locked the user or the address); whether the password matched). ``refuse``: the
        account may not log in (disabled): the hash is checked all the same and the attempt counts as a
        failure, so nothing a caller can observe (answer, time, lockout) depends on the password.
        The counters are read and written inside the hashing slot, so at most ``hash_threads`` attempts
        per replica are ever between the check and the record: parallel guesses are throttled, parallel
        correct logins merely wait their turn."""
        async with self._hash_slot():
            seen = await self._check(counters)
            matched = await asyncio.to_thread(access.verify_password, stored, password, self.hasher)
            if matched and not refuse:
                for key, _, whom in counters:
                    if whom == "this user" and seen[key]:  # a success forgets the user's failures
                        await self.logins.purge(key)
                return "ok", True
            return ("locked" if await self._failed(counters) else "failed"), matched

    async def _check(self, counters) -> dict[str, bool]:
        """Refuse (locked, with retry_after) while a counter says wait; which counters hold failures."""
        seen = {}
        for key, policy, whom in counters:
            got = await self.logins.get(key)
            seen[key] = got is not None
            wait = policy.retry_after(got[0] if got else None, time.time())
            if wait > 0:
                what = "locked" if policy.locked(got[0]) else "slowed down"
                raise AccessError("locked", f"too many failed logins for {whom}: {what}, try again in "
                                            f"{math.ceil(wait)} s", retry_after=math.ceil(wait))
        return seen

    async def _failed(self, counters) -> bool:
        """Count a failure on each counter; True when one is locked now."""
        locks = False
        for key, policy, _ in counters:
            for _ in range(CAS_TRIES):
                got = await self.logins.get(key)
                new = policy.failed(got[0] if got else None, time.time())
                try:
                    if got:
                        await self.logins.update(key, new, got[1], ttl=policy.lock_seconds)
                    else:
                        await self.logins.create(key, new, ttl=policy.lock_seconds)
                except Conflict:
                    continue
                locks = locks or policy.locked(new)
                break
        return locks

    async def _hash(self, password: str) -> str:
        async with self._hash_slot():
            return await asyncio.to_thread(access.hash_password, password, self.hasher)

    @contextlib.asynccontextmanager
    async def _hash_slot(self):
        """The hashing slot; a flood of logins is refused at once instead of queueing hashes whose
        callers will have given up."""
        if self._hash_waiting >= MAX_HASH_QUEUE:
            raise AccessError("unavailable", f"busy: {MAX_HASH_QUEUE} password checks are waiting; try again",
                              retry_after=1)
        self._hash_waiting += 1
        try:
            await self._hashing.acquire()
        finally:
            self._hash_waiting -= 1
        try:
            yield
        finally:
            self._hashing.release()

    @staticmethod
    def _check_new_password(password: Any) -> None:
        problem = access.password_problem(password, limits.current().max_password_bytes)
        if problem:
            raise AccessError("bad_request", problem)

    # ------------------------------------------------------------------ sessions
    async def _open_session(self, user: dict, ip: str | None, idp_subject: str | None) -> tuple[str, dict]:
        policy, now = self._policy(), time.time()
        uid = user["user_id"]
        await self._cap_sessions(uid)
        token = access.new_token("session")
        sid = access.token_id(token)
        rec = access.session_record(sid, user, now, policy.lifetime, ip, idp_subject)
        # the index first: whoever lists the user's sessions (to revoke them) finds every session
        await self.sessions.create(session_index(uid, sid), {"session_id": sid, "created_at": rec["created_at"]},
                                   ttl=policy.lifetime)
        await self.sessions.create(session_key(sid), rec, ttl=policy.ttl(rec, now))
        # a disable or a role change that listed the sessions just before ours was written missed it
        got = await self._user(uid)
        if got is None or got[0].get("disabled"):
            await self._remove_session(uid, sid)
            raise AccessError("unauthenticated", "the user is disabled")
        if access.stale(rec, got[0]):
            rec = await self._rewrite_session(sid, got[0]) or rec
        return token, rec

    async def _cap_sessions(self, uid: str) -> None:
        """Below max_sessions_per_user before one more: the oldest sessions end."""
        cap = limits.current().max_sessions_per_user
        if len(await self.sessions.keys(session_index(uid))) < cap:
            return
        live = []
        for key, _, _ in await self.sessions.values(session_index(uid)):
            sid = key.rsplit(".", 1)[1]
            got = await self.sessions.get(session_key(sid))
            if got:
                live.append((got[0]["created_at"], sid))
            else:
                await self.sessions.purge(key)  # the session ended: its index entry goes too
        live.sort()
        for _, sid in live[:max(0, len(live) - cap + 1)]:
            await self._revoke_session(sid, uid, "session_limit")

    async def validate(self, req: dict) -> dict:
        token = req.get("token")
        kind = access.token_kind(token)
        if kind is None:
            raise AccessError("unauthenticated", "not a noetl token")
        if kind == "session":
            return await self._session_principal(access.token_id(token))
        return await self._token_principal(access.token_id(token))

    async def refresh(self, req: dict) -> dict:
        token = req.get("token")
        if access.token_kind(token) != "session":
            raise AccessError("bad_request", "refresh takes a session token (API tokens do not slide)")
        return await self._session_principal(access.token_id(token), force=True)

    async def _session_principal(self, sid: str, force: bool = False) -> dict:
        """One KV get; one compare-and-set write when the refresh is due (or ``force``d, at most once a
        second)."""
        policy, key = self._policy(), session_key(sid)
        got = await self.sessions.get(key)
        if got is None:
            raise AccessError("unauthenticated", "the session has ended (logged out, revoked or expired)")
        rec, rev = got
        now = time.time()
        if not policy.live(rec, now):
            raise AccessError("unauthenticated", "the session has expired")
        if policy.refresh_due(rec, now) or (force and now - access.epoch(rec["last_activity_at"]) >= 1):
            rec = await self._refresh(key, rec, rev, now, policy)
        return principal(rec, "session", policy)

    async def _refresh(self, key: str, rec: dict, rev: int, now: float, policy: access.SessionPolicy) -> dict:
        """Slide the idle expiry: an update against the revision read, with the new TTL. A lost race
        means another replica refreshed (or the user changed): its value stands, no error. A removed
        session stays removed: an update never creates."""
        new = {**rec, "last_activity_at": iso(now)}
        try:
            await self.sessions.update(key, new, rev, ttl=policy.ttl(new, now))
            return new
        except Conflict:
            got = await self.sessions.get(key)
            if got is None or not policy.live(got[0], time.time()):
                raise AccessError("unauthenticated", "the session has ended (logged out, revoked or expired)") from None
            return got[0]
        except UNAVAILABLE as exc:  # the session is valid; the next validation writes the activity
            log.warning("session %s: activity not written (%s)", rec.get("session_id"), type(exc).__name__)
            return rec

    async def _rewrite_session(self, sid: str, user: dict) -> dict | None:
        policy = self._policy()
        return await self._rewrite(self.sessions, session_key(sid), lambda rec: access.with_user(rec, user),
                                   lambda rec: policy.ttl(rec, time.time()))

    async def revoke(self, req: dict) -> dict:
        ip = access.client_ip(req.get("client_ip"))
        if "token" in req:  # logout: the token revokes itself
            kind = access.token_kind(req["token"])
            if kind is None:
                raise AccessError("unauthenticated", "not a noetl token")
            tid = access.token_id(req["token"])
            if kind == "session":
                got = await self.sessions.get(session_key(tid))
                if got is None:
                    return {"revoked": []}
                await self._revoke_session(tid, got[0]["user_id"], "logout")
                await self._audit("session.logout", actor=principal(got[0], "session"), client_ip=ip)
                return {"revoked": [{"session_id": tid}]}
            got = await self.users.get(token_key(tid))
            if got is None:
                return {"revoked": []}
            await self._revoke_token(got[0], "revoked")
            await self._audit("token.revoked", actor=principal(got[0], "token"), client_ip=ip,
                              target={"token_id": tid, "name": got[0].get("name")})
            return {"revoked": [{"token_id": tid}]}
        caller = await self._caller(req)
        if req.get("session_id") is not None:
            sid = access.an_id(req["session_id"], "session_id")
            got = await self.sessions.get(session_key(sid))
            if got is None:
                raise AccessError("not_found", f"no session {sid}")
            owner = got[0]["user_id"]
            await self._require(caller, access.scope(caller, owner, "session"), ip, {"session_id": sid})
            await self._revoke_session(sid, owner, "revoked")
            await self._audit("session.revoked", actor=caller, client_ip=ip, target={"session_id": sid, "user_id": owner})
            return {"revoked": [{"session_id": sid}]}
        if req.get("user_id") is not None:
            uid = access.an_id(req["user_id"], "user_id")
            await self._require(caller, access.scope(caller, uid, "session"), ip, {"user_id": uid})
            sids = await self._revoke_user_sessions(uid, "revoked")
            await self._audit("session.revoked", actor=caller, client_ip=ip, target={"user_id": uid},
                              details={"sessions": len(sids)})
            return {"revoked": [{"session_id": sid} for sid in sids]}
        raise AccessError("bad_request", "revoke takes token, session_id or user_id")

    async def list_sessions(self, req: dict) -> dict:
        caller = await self._caller(req)
        uid = access.an_id(req.get("user_id") or caller["user_id"], "user_id")
        await self._require(caller, access.scope(caller, uid, "session"), req.get("client_ip"), {"user_id": uid})
        policy, now = self._policy(), time.time()
        entries = await self.sessions.values(session_index(uid))
        got = await asyncio.gather(*(self.sessions.get(session_key(k.rsplit(".", 1)[1])) for k, _, _ in entries))
        out = [access.public_session(g[0], policy, caller) for g in got if g and policy.live(g[0], now)]
        return {"sessions": sorted(out, key=lambda s: s["created_at"], reverse=True)}

    async def _revoke_session(self, sid: str, uid: str, reason: str) -> None:
        await self._remove_session(uid, sid)
        await self._notify({"session_id": sid, "user_id": uid, "reason": reason})
        log.info("session %s of user %s ended: %s", sid, uid, reason)

    async def _remove_session(self, uid: str, sid: str) -> None:
        await self.sessions.purge(session_key(sid))
        await self.sessions.purge(session_index(uid, sid))

    async def _revoke_user_sessions(self, uid: str, reason: str, keep: str | None = None) -> list[str]:
        sids = [key.rsplit(".", 1)[1] for key, _, _ in await self.sessions.values(session_index(uid))]
        for sid in sids:
            if sid != keep:
                await self._remove_session(uid, sid)
        if sids:
            await self._notify({"user_id": uid, "reason": reason})
        return [sid for sid in sids if sid != keep]

    # ------------------------------------------------------------------ callers and permissions
    async def _caller(self, req: dict) -> dict:
        """The principal the request was made for, read again from the store (still live; its roles
        as stored, not as sent)."""
        p = req.get("principal")
        if not isinstance(p, dict):
            raise AccessError("unauthenticated", "this request needs the caller's principal")
        now = time.time()
        if p.get("kind") == "session":
            sid = access.an_id(p.get("session_id"), "principal.session_id")
            got = await self.sessions.get(session_key(sid))
            if got and self._policy().live(got[0], now):
                return principal(got[0], "session", self._policy())
        elif p.get("kind") == "token":
            tid = access.an_id(p.get("token_id"), "principal.token_id")
            got = await self.users.get(token_key(tid))
            if got and access.token_live(got[0], now):
                return principal(got[0], "token")
        raise AccessError("unauthenticated", "the caller's session or token has ended")

    async def _require(self, caller: dict, permission: str, ip: Any, target: dict | None = None) -> None:
        if access.allowed(caller["roles"], permission):
            return
        await self._audit("access.denied", actor=caller, client_ip=access.client_ip(ip), outcome="denied",
                          target=target, details={"permission": permission})
        raise AccessError("forbidden", f"permission {permission} is needed (roles: {', '.join(caller['roles']) or 'none'})")

    # ------------------------------------------------------------------ users
    async def _user(self, uid: str) -> tuple[dict, int] | None:
        return await self.users.get(user_key(uid)) if access.ID.match(uid or "") else None

    async def _user_by_name(self, name: str) -> tuple[dict, int] | None:
        got = await self.users.get(name_key(name))
        return await self._user(got[0].get("user_id", "")) if got else None

    async def _add_user(self, name: str, password: str | None, roles: list[str], email: str | None = None,
                        display_name: str | None = None, oidc: dict | None = None) -> dict:
        password_hash = await self._hash(password) if password else None
        uid = access.new_id()
        try:  # names are unique: the name key is created once
            await self.users.create(name_key(name), {"user_id": uid, "username": name})
        except Conflict:
            raise AccessError("conflict", f"a user named {name!r} exists") from None
        now = iso(time.time())
        user = {"user_id": uid, "username": name, "email": email, "display_name": display_name, "roles": roles,
                "disabled": False, "password_hash": password_hash, "oidc": oidc, "created_at": now, "updated_at": now}
        try:
            await self.users.create(user_key(uid), user)
        except BaseException:
            await self.users.purge(name_key(name))
            raise
        return user

    async def _update_user(self, uid: str, change: Callable[[dict], dict]) -> dict | None:
        return await self._rewrite(self.users, user_key(uid),
                                   lambda u: {**change(u), "updated_at": iso(time.time())}, lambda u: None)

    async def _set_roles(self, uid: str, roles: list[str]) -> dict:
        """Change a user's roles; its sessions take them, its API tokens keep those they still have
        (a token left with none is revoked)."""
        user = await self._update_user(uid, lambda u: {**u, "roles": roles})
        if user is None:
            raise AccessError("not_found", f"no user {uid}")
        for key, _, _ in await self.sessions.values(session_index(uid)):
            await self._rewrite_session(key.rsplit(".", 1)[1], user)
        for key, _, _ in await self.users.values(token_index(uid)):
            tid = key.rsplit(".", 1)[1]
            got = await self.users.get(token_key(tid))
            if got is None:
                continue
            kept = access.within(got[0]["roles"], roles)
            if not kept:
                await self._revoke_token(got[0], "roles_changed")
                continue
            await self._rewrite(self.users, token_key(tid), lambda rec: access.with_user(rec, user, kept), lambda rec: access.token_ttl(rec, time.time()))
        await self._notify({"user_id": uid, "reason": "roles_changed"})
        return user

    async def _target_user(self, req: dict) -> dict:
        if req.get("user_id") is not None:
            got = await self._user(access.an_id(req["user_id"], "user_id"))
        elif req.get("username") is not None:
            got = await self._user_by_name(access.username(req["username"]))
        else:
            raise AccessError("bad_request", "user_id or username is needed")
        if got is None:
            raise AccessError("not_found", "no such user")
        return got[0]

    async def users_add(self, req: dict) -> dict:
        caller = await self._caller(req)
        ip = access.client_ip(req.get("client_ip"))
        await self._require(caller, "user.admin", ip)
        name = access.new_username(req.get("username"))
        password = req.get("password")
        if password is not None:
            self._check_new_password(password)
        roles = access.role_list(req.get("roles", [access.DEFAULT_ROLE]))
        user = await self._add_user(name, password, roles, access.email(req.get("email")),
                                    access.display_name(req.get("display_name")))
        await self._audit("user.added", actor=caller, client_ip=ip,
                          target={"user_id": user["user_id"], "username": name, "roles": roles})
        return {"user": access.public_user(user)}

    async def users_list(self, req: dict) -> dict:
        caller = await self._caller(req)
        await self._require(caller, "user.admin", req.get("client_ip"))
        users = [access.public_user(u) for _, u, _ in await self.users.values(user_key())]
        return {"users": sorted(users, key=lambda u: u["username"])}

    async def users_get(self, req: dict) -> dict:
        caller = await self._caller(req)
        user = await self._target_user(req) if (req.get("user_id") or req.get("username")) else \
            await self._target_user({"user_id": caller["user_id"]})
        if user["user_id"] != caller["user_id"]:
            await self._require(caller, "user.admin", req.get("client_ip"), {"user_id": user["user_id"]})
        return {"user": access.public_user(user)}

    async def users_standing(self, req: dict) -> dict:
        """Whether a user still exists and is enabled, and its roles: what a service acting for the user
        later (the scheduler, for a schedule's creator; a worker, for an execution's starter and author)
        checks. With ``token_id``: also whether that API token of the user is still live
        (``token_active``: not revoked, not expired). Asked with no token: only services whose NATS user
        may publish this subject ask it (infra/nats_auth.py)."""
        uid = access.an_id(req.get("user_id"), "user_id")
        got = await self._user(uid)
        out: dict[str, Any] = {"exists": False, "active": False, "roles": []} if got is None else {
            "exists": True, "active": not got[0].get("disabled"), "roles": list(got[0].get("roles") or [])}
        if req.get("token_id") is not None:
            tid = access.an_id(req.get("token_id"), "token_id")
            token = await self.users.get(token_key(tid))
            out["token_active"] = (token is not None and token[0].get("user_id") == uid
                                   and access.token_live(token[0], time.time()))
        return out

    async def users_disable(self, req: dict) -> dict:
        caller = await self._caller(req)
        ip = access.client_ip(req.get("client_ip"))
        await self._require(caller, "user.admin", ip)
        uid = (await self._target_user(req))["user_id"]
        if uid == caller["user_id"]:
            raise AccessError("bad_request", "you cannot disable yourself")
        user = await self._update_user(uid, lambda u: {**u, "disabled": True})
        # after the flag: a login that read the user before it re-reads it after writing its session
        sids = await self._revoke_user_sessions(uid, "user_disabled")
        tokens = [rec for _, rec, _ in await self.users.values(token_index(uid))]
        for entry in tokens:
            got = await self.users.get(token_key(entry["token_id"]))
            if got:
                await self._revoke_token(got[0], "user_disabled", cascade=False)  # all of them go
            else:
                await self.users.purge(token_index(uid, entry["token_id"]))
        await self._audit("user.disabled", actor=caller, client_ip=ip, target={"user_id": uid, "username": user["username"]},
                          details={"sessions": len(sids), "tokens": len(tokens)})
        return {"user": access.public_user(user), "revoked": {"sessions": len(sids), "tokens": len(tokens)}}

    async def users_enable(self, req: dict) -> dict:
        caller = await self._caller(req)
        ip = access.client_ip(req.get("client_ip"))
        await self._require(caller, "user.admin", ip)
        uid = (await self._target_user(req))["user_id"]
        user = await self._update_user(uid, lambda u: {**u, "disabled": False})
        await self._audit("user.enabled", actor=caller, client_ip=ip, target={"user_id": uid, "username": user["username"]})
        return {"user": access.public_user(user)}

    async def users_roles(self, req: dict) -> dict:
        caller = await self._caller(req)
        ip = access.client_ip(req.get("client_ip"))
        await self._require(caller, "user.admin", ip)
        before = await self._target_user(req)
        roles = access.role_list(req.get("roles"))
        if before["user_id"] == caller["user_id"] and "admin" not in roles:
            raise AccessError("bad_request", "you cannot take the admin role from yourself")
        user = await self._set_roles(before["user_id"], roles)
        await self._audit("user.roles_changed", actor=caller, client_ip=ip,
                          target={"user_id": user["user_id"], "username": user["username"]},
                          details={"before": before["roles"], "after": roles})
        return {"user": access.public_user(user)}

    async def users_password(self, req: dict) -> dict:
        caller = await self._caller(req)
        ip = access.client_ip(req.get("client_ip"))
        target = await self._target_user(req) if req.get("user_id") else await self._target_user(
            {"user_id": caller["user_id"]})
        uid = target["user_id"]
        password = req.get("password")
        self._check_new_password(password)
        own = uid == caller["user_id"]
        if not own:
            await self._require(caller, "user.admin", ip, {"user_id": uid})
        elif target.get("password_hash"):  # proving the current one: a stolen session cannot take over
            current = req.get("current_password")
            if not isinstance(current, str) or len(current.encode()) > limits.current().max_password_bytes:
                raise AccessError("bad_request", "current_password is needed to change your own password")
            if (await self._checked(self._counters(target["username"], ip), target["password_hash"], current))[0] != "ok":
                await self._audit("user.password_changed", actor=caller, client_ip=ip, outcome="failed",
                                  target={"user_id": uid}, details={"reason": "wrong current password"})
                raise AccessError("unauthenticated", "the current password is wrong")
        new_hash = await self._hash(password)
        user = await self._update_user(uid, lambda u: {**u, "password_hash": new_hash})
        ended = await self._revoke_user_sessions(uid, "password_changed", keep=caller.get("session_id") if own else None)
        await self._audit("user.password_changed", actor=caller, client_ip=ip, target={"user_id": uid},
                          details={"sessions_ended": len(ended)})
        return {"user": access.public_user(user)}

    # ------------------------------------------------------------------ API tokens
    async def _new_api_token(self, user: dict, name: str, roles: list[str], expires_at: float | None,
                             minted_by: dict | None = None) -> tuple[str, dict]:
        now = time.time()
        token = access.new_token("token")
        tid = access.token_id(token)
        uid = user["user_id"]
        rec = access.token_record(tid, name, user, roles, now, expires_at, minted_by)
        ttl = expires_at - now if expires_at else None
        await self.users.create(token_index(uid, tid), {"token_id": tid, "name": name, "created_at": rec["created_at"]},
                                ttl=ttl)
        await self.users.create(token_key(tid), rec, ttl=ttl)
        got = await self._user(uid)  # disabled or changed while this was written?
        if got is None or got[0].get("disabled"):
            await self._revoke_token(rec, "user_disabled")
            raise AccessError("unauthenticated", "the user is disabled")
        kept = access.within(roles, got[0]["roles"])
        if kept != roles or access.stale(rec, got[0], kept):
            if not kept:
                await self._revoke_token(rec, "roles_changed")
                raise AccessError("forbidden", "the user no longer has these roles")
            rec = await self._rewrite(self.users, token_key(tid), lambda r: access.with_user(r, got[0], kept),
                                      lambda rec: access.token_ttl(rec, time.time())) or rec
        return token, rec

    async def _revoke_token(self, rec: dict, reason: str, cascade: bool = True) -> None:
        await self.users.purge(token_key(rec["token_id"]))
        await self.users.purge(token_index(rec["user_id"], rec["token_id"]))
        await self._notify({"token_id": rec["token_id"], "user_id": rec["user_id"], "reason": reason})
        log.info("API token %s of user %s revoked: %s", rec["token_id"], rec["user_id"], reason)
        if cascade:
            await self._revoke_minted(rec["user_id"], rec["token_id"])

    async def _revoke_minted(self, uid: str, tid: str) -> int:
        """Revoke the API tokens the revoked token ``tid`` made, and, through :meth:`_revoke_token`, what
        those made: a token may have no end of its own, so revoking a leaked one must end the copies
        made with it (a session's tokens end with its lifetime: access.token_expiry). A user's tokens are
        few (``max_tokens_per_user``)."""
        made = []
        for _, entry, _ in await self.users.values(token_index(uid)):
            made_id = entry.get("token_id") if isinstance(entry, dict) else None
            got = await self.users.get(token_key(made_id)) if isinstance(made_id, str) else None
            if got is not None and access.minted_by(got[0], {"token_id": tid}):
                made.append(got[0])
        for rec in made:
            await self._revoke_token(rec, "maker_revoked")
        return len(made)

    async def _token_principal(self, tid: str) -> dict:
        got = await self.users.get(token_key(tid))
        if got is None:
            raise AccessError("unauthenticated", "the API token is unknown or revoked")
        if not access.token_live(got[0], time.time()):
            raise AccessError("unauthenticated", "the API token has expired")
        return principal(got[0], "token")

    async def tokens_create(self, req: dict) -> dict:
        caller = await self._caller(req)
        ip = access.client_ip(req.get("client_ip"))
        await self._require(caller, "token.own", ip)
        name = access.token_name(req.get("name"))
        roles = access.token_roles(req.get("roles"), caller["roles"])  # never more than the caller has now
        # never longer than the caller lives: a stolen session does not become a lasting token
        expires_at = access.token_expiry(req.get("expires_in"), caller, time.time(), MAX_TOKEN_SECONDS)
        uid = caller["user_id"]
        if len(await self.users.values(token_index(uid))) >= limits.current().max_tokens_per_user:
            raise AccessError("conflict", f"the user has max_tokens_per_user = {limits.current().max_tokens_per_user} "
                                          "API tokens: revoke one first (or set NOETL_LIMIT_MAX_TOKENS_PER_USER)")
        got = await self._user(uid)
        if got is None:
            raise AccessError("unauthenticated", "the caller's user does not exist")
        token, rec = await self._new_api_token(got[0], name, roles, expires_at, access.minter(caller))
        await self._audit("token.created", actor=caller, client_ip=ip,
                          target={"token_id": rec["token_id"], "name": name, "roles": rec["roles"],
                                  "expires_at": rec["expires_at"], "minted_by": rec["minted_by"]})
        return {"token": token, "token_id": rec["token_id"], "name": name, "roles": rec["roles"],
                "expires_at": rec["expires_at"]}

    async def tokens_list(self, req: dict) -> dict:
        caller = await self._caller(req)
        uid = access.an_id(req.get("user_id") or caller["user_id"], "user_id")
        await self._require(caller, access.scope(caller, uid, "token"), req.get("client_ip"), {"user_id": uid})
        now = time.time()
        entries = await self.users.values(token_index(uid))
        got = await asyncio.gather(*(self.users.get(token_key(rec["token_id"])) for _, rec, _ in entries))
        out = [g[0] for g in got if g and access.token_live(g[0], now)]
        return {"tokens": sorted(out, key=lambda t: t["created_at"], reverse=True)}

    async def tokens_revoke(self, req: dict) -> dict:
        caller = await self._caller(req)
        ip = access.client_ip(req.get("client_ip"))
        tid = access.an_id(req.get("token_id"), "token_id")
        got = await self.users.get(token_key(tid))
        if got is None:
            raise AccessError("not_found", f"no API token {tid}")
        await self._require(caller, access.scope(caller, got[0]["user_id"], "token"), ip, {"token_id": tid})
        await self._revoke_token(got[0], "revoked")
        await self._audit("token.revoked", actor=caller, client_ip=ip,
                          target={"token_id": tid, "name": got[0].get("name"), "user_id": got[0]["user_id"]})
        return {"revoked": [{"token_id": tid}]}

    # ------------------------------------------------------------------ audit
    async def audit_list(self, req: dict) -> dict:
        caller = await self._caller(req)
        await self._require(caller, "audit.read", req.get("client_ip"))
        return {"records": await audit.query(self.bus.js, user=req.get("user"), action=req.get("action"),
                                             since=req.get("since"), limit=req.get("limit", 100))}

    async def _audit(self, action: str, **fields: Any) -> None:
        """Record; a record that cannot be stored is logged (the action itself already happened)."""
        try:
            await audit.publish(self.bus.js, access.audit_record(action, now=time.time(), **fields))
        except Exception as exc:  # noqa: BLE001
            log.error("audit record %s not stored (%s)", action, type(exc).__name__)

    # ------------------------------------------------------------------ helpers
    async def _rewrite(self, bucket: Bucket, key: str, change: Callable[[dict], dict | None],
                       ttl_of: Callable[[dict], float | None]) -> dict | None:
        """Compare-and-set ``change`` onto ``key`` until it sticks; None when the key is gone."""
        for _ in range(CAS_TRIES):
            got = await bucket.get(key)
            if got is None:
                return None
            new = change(got[0])
            if new is None:
                return None
            try:
                await bucket.update(key, new, got[1], ttl=ttl_of(new))
                return new
            except Conflict:
                continue
        raise AccessError("unavailable", f"{key} changed too often to be updated; try again")

    async def _notify(self, notice: dict) -> None:
        try:
            await self.bus.broadcast(REVOKED, notice)
        except Exception as exc:  # noqa: BLE001 - gateways' caches expire within a second anyway
            log.warning("revocation notice not sent (%s)", type(exc).__name__)


def _error(kind: str, message: str, retry_after: float | None = None) -> dict:
    return {"error": {"kind": kind, "message": message,
                      "details": {"retry_after": retry_after} if retry_after is not None else None}}


async def _respond(msg, reply: Any) -> None:
    try:
        await msg.respond(orjson.dumps(reply, default=str))
    except Exception as exc:  # noqa: BLE001 - the requester is gone
        log.debug("reply not sent (%s)", type(exc).__name__)
