"""Access control at the gateway: who is calling (a bearer token validated by the sessions service),
and whether the route's permission (core/access.py) is among the caller's roles.

Every route declares exactly one of: a permission (``need("catalog.read")``), :data:`SIGNED_IN` (any
valid token; the sessions service checks the rest, e.g. changing one's own password), or
:data:`PUBLIC` (no token: liveness, readiness, login). The declaration is a FastAPI dependency, so it
runs before the route reads its body; :func:`declarations` reads them back from ``app.routes``, and
:func:`check_declarations` refuses to build an app in which a route has none (or two).

Validation (:class:`Authenticator`) asks ``noetl.q.sessions.validate`` and keeps the principal for at
most :data:`CACHE_SECONDS` per token, keyed by a keyed BLAKE2b digest of the token (a per-process random
key, so the key is no known derivation of the token and nothing in memory turns back into it).
Concurrent requests with the same uncached token share one validation. The revocation notices
(``noetl.sessions.revoked``) drop entries at once: by session or token id, or every entry of the user.
A validation that was in flight when any notice arrived answers its request but is not cached. What
else must hear of a revocation (the live streams, live.py) registers in ``Authenticator.on_revoked``.

The gateway's own audit records (credential reads with data, writes, cancels, refusals) go through
:class:`Auditor`, the client's address through :func:`client_address` (``NOETL_TRUSTED_PROXIES``).

The pure parts (the cache with an injected clock, header parsing, client addresses, messages) have no
I/O and are unit-tested in tests/unit/test_gateway_access.py.
"""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import math
import os
import secrets
import time
from typing import Any, Callable, Iterable

import nats.errors
import orjson
from fastapi import Depends, HTTPException, Request
from fastapi.routing import APIRoute

from noetl_mesh.core import access
from noetl_mesh.infra.bus import Bus, BusError

log = logging.getLogger("noetl.gateway.auth")

PUBLIC = "public"  # no token needed
SIGNED_IN = "signed_in"  # any valid token; no permission beyond it
CACHE_SECONDS = 1.0  # the longest a validation is reused: a revocation is seen by every replica within it
MAX_CACHED = 100_000  # entries; past it, expired entries are swept (and, if still full, all are dropped)
VALIDATE_TIMEOUT = 5.0  # seconds for the sessions service's answer
REALM = 'Bearer realm="noetl"'
INVALID = 'Bearer realm="noetl", error="invalid_token"'
DOCS = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc", "/docs/assets",  # public
                  "/asyncapi.json"})
CONSOLE = frozenset({"/ui"})  # the web console's files (services/gateway/console.py): public, they hold no data
TRUSTED_PROXIES_ENV = "NOETL_TRUSTED_PROXIES"


# --------------------------------------------------------------------------------------- messages
def roles_with(permission: str) -> list[str]:
    return [r for r in access.ROLES if access.allowed([r], permission)]


def denied_message(permission: str, roles: Iterable[str], why: str = "") -> str:
    """``this needs the permission execution.cancel.any (roles admin, operator); you have developer``."""
    have = ", ".join(roles) or "no role"
    return (f"this needs the permission {permission} (roles {', '.join(roles_with(permission))}){why}; "
            f"you have {have}")


def unauthenticated(message: str, presented: bool = True) -> HTTPException:
    return HTTPException(401, {"message": message, "location": "header.authorization", "errors": []},
                         {"WWW-Authenticate": INVALID if presented else REALM})


NO_TOKEN = ("this needs a token: send 'Authorization: Bearer <token>' with a session token (POST /api/auth/login, "
            "or `noetl login`) or an API token")


def bearer(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or a 401 saying what is wrong."""
    if header is None or not header.strip():
        raise unauthenticated(NO_TOKEN, presented=False)
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthenticated("the Authorization header must be 'Bearer <token>'", presented=False)
    token = token.strip()
    if access.token_kind(token) is None:
        raise unauthenticated("not a noetl token (noetl_s_... or noetl_t_...)")
    return token


def requested_by(principal: dict[str, Any], proof: bool = False) -> dict[str, Any]:
    """Who started an execution, as its request records it: the user's id and name and how they came
    (``kind``), never a secret nor the id of their session or token (``access.PROOF_KEYS``: every viewer
    reads the log); and the roles the request carried (an API token's may be fewer than its owner's: a
    pool checks these, D33). ``proof``: with that id, for a record only its service reads (a schedule's
    creator: revoking the token that made it pauses it)."""
    out = {k: principal.get(k) for k in ("user_id", "username", "kind")}
    if proof:
        key = "session_id" if principal.get("kind") == "session" else "token_id"
        out[key] = principal.get(key)
    out["roles"] = sorted(r for r in principal.get("roles") or () if isinstance(r, str))
    return out


# --------------------------------------------------------------------------------------- addresses
def trusted_networks(value: str | None) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``NOETL_TRUSTED_PROXIES``: addresses or networks (CIDR), separated by commas or spaces."""
    out = []
    for part in (value or "").replace(",", " ").split():
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{TRUSTED_PROXIES_ENV}: {part!r} is not an address or a network (CIDR)") from None
    return out


def _address(value: str | None):
    try:
        return ipaddress.ip_address((value or "").strip())
    except ValueError:
        return None


def client_address(peer: str | None, forwarded_for: str | None, trusted: list) -> str | None:
    """The caller's address: the connection's peer, unless the peer is a trusted proxy; then the
    ``X-Forwarded-For`` chain is read from the right (the nearest hop) past every trusted proxy, and
    the first address not trusted is the client. A malformed entry ends the walk at the hop that
    wrote it. Without trusted proxies the header is never read (anyone can send it)."""
    addr = _address(peer)
    if addr is None:
        return None
    if not trusted or not forwarded_for:
        return str(addr)
    current = addr
    for hop in reversed(forwarded_for.split(",")):
        if not any(current in net for net in trusted):
            return str(current)
        nxt = _address(hop)
        if nxt is None:
            return str(current)
        current = nxt
    return str(current)


# --------------------------------------------------------------------------------------- the cache
class PrincipalCache:
    """Validated principals by token digest, each for at most ``ttl`` seconds (pure: ``clock`` is
    injected). ``epoch`` counts revocation notices; :meth:`put` with an older epoch stores nothing."""

    def __init__(self, ttl: float = CACHE_SECONDS, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = MAX_CACHED):
        self.ttl, self.clock, self.max_entries = ttl, clock, max_entries
        self._key = secrets.token_bytes(32)
        self._entries: dict[bytes, tuple[dict[str, Any], float]] = {}
        self._by_id: dict[str, bytes] = {}
        self._by_user: dict[str, set[bytes]] = {}
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, token: str) -> bytes:
        return hashlib.blake2b(token.encode(), key=self._key, digest_size=16).digest()

    def get(self, key: bytes) -> dict[str, Any] | None:
        got = self._entries.get(key)
        if got is None:
            return None
        if self.clock() >= got[1]:
            self._remove(key)
            return None
        return got[0]

    def put(self, key: bytes, principal: dict[str, Any], epoch: int) -> bool:
        if epoch != self.epoch or self.ttl <= 0:
            return False  # a notice arrived while this was validated: it may be about this token
        if len(self._entries) >= self.max_entries:
            self.sweep()
            if len(self._entries) >= self.max_entries:
                self.clear()
        self._remove(key)
        self._entries[key] = (principal, self.clock() + self.ttl)
        ident = principal.get("session_id") or principal.get("token_id")
        if ident:
            self._by_id[ident] = key
        if principal.get("user_id"):
            self._by_user.setdefault(principal["user_id"], set()).add(key)
        return True

    def drop(self, notice: dict[str, Any]) -> int:
        """Apply a revocation notice; returns how many entries went."""
        self.epoch += 1
        ident = notice.get("session_id") or notice.get("token_id")
        if isinstance(ident, str):
            key = self._by_id.get(ident)
            return self._remove(key) if key is not None else 0
        uid = notice.get("user_id")
        if isinstance(uid, str):
            return sum(self._remove(k) for k in list(self._by_user.get(uid, ())))
        return 0

    def discard(self, key: bytes) -> None:
        self.epoch += 1
        self._remove(key)

    def sweep(self) -> None:
        now = self.clock()
        for key in [k for k, (_, ends) in self._entries.items() if now >= ends]:
            self._remove(key)

    def clear(self) -> None:
        self.epoch += 1
        self._entries.clear()
        self._by_id.clear()
        self._by_user.clear()

    def _remove(self, key: bytes) -> int:
        got = self._entries.pop(key, None)
        if got is None:
            return 0
        principal = got[0]
        ident = principal.get("session_id") or principal.get("token_id")
        if ident and self._by_id.get(ident) == key:
            del self._by_id[ident]
        keys = self._by_user.get(principal.get("user_id"))
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_user[principal["user_id"]]
        return 1


# --------------------------------------------------------------------------------------- the shell
class Authenticator:
    """Token → principal through the sessions service, with the cache and the revocation notices."""

    def __init__(self, bus: Bus, ttl: float = CACHE_SECONDS):
        self.bus = bus
        self.cache = PrincipalCache(ttl)
        self._inflight: dict[bytes, asyncio.Future] = {}
        self._sub = None
        self._subscribing: asyncio.Lock | None = None
        self.validations = 0  # requests made to the sessions service
        # told of every notice after the cache dropped its entries (None: an unreadable one), e.g. the
        # live streams (live.Hub.revoked); each must return at once
        self.on_revoked: list[Callable[[dict[str, Any] | None], Any]] = []

    async def _subscribe(self) -> None:
        from noetl_mesh.services.sessions.service import REVOKED

        if self._subscribing is None:
            self._subscribing = asyncio.Lock()
        async with self._subscribing:
            if self._sub is None:
                self._sub = await self.bus.nc.subscribe(REVOKED, cb=self._on_notice)

    async def _on_notice(self, msg: Any) -> None:
        try:
            notice = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            notice = None
        if isinstance(notice, dict):
            self.cache.drop(notice)
        else:  # unreadable: drop everything rather than keep something revoked
            self.cache.clear()
            notice = None
        for listener in self.on_revoked:
            try:
                listener(notice)
            except Exception:  # noqa: BLE001 - one listener's bug must not keep the notice from the others
                log.exception("revocation notice listener %r failed", listener)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be closed already
                pass
            self._sub = None

    def forget(self, token: str) -> None:
        """Drop a token's cached validation (at logout)."""
        self.cache.discard(self.cache.key(token))

    async def principal(self, token: str) -> dict[str, Any]:
        """The principal of a well-formed token; 401 when the sessions service refuses it, 503 (with
        Retry-After) when it cannot answer."""
        key = self.cache.key(token)
        got = self.cache.get(key)
        if got is not None:
            return got
        task = self._inflight.get(key)
        if task is None:  # one validation per token at a time, not tied to the request that started it
            task = asyncio.create_task(self._validate(token, key))
            self._inflight[key] = task
            task.add_done_callback(lambda t, key=key: self._done(key, t))
        return await asyncio.shield(task)

    def _done(self, key: bytes, task: asyncio.Task) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: no warning when every waiter went away

    async def _validate(self, token: str, key: bytes) -> dict[str, Any]:
        from noetl_mesh.services.sessions.service import Q_VALIDATE

        if self._sub is None:
            await self._subscribe()  # before the first validation: no notice is missed after it
        if not self.bus.nc.is_connected:
            raise unavailable(f"NATS is {nats_state(self.bus.nc)}: the token cannot be checked now; retry shortly")
        epoch = self.cache.epoch
        self.validations += 1
        try:
            who = await self.bus.request(Q_VALIDATE, {"token": token}, timeout=VALIDATE_TIMEOUT)
        except BusError as exc:
            if exc.kind == "unauthenticated":
                raise unauthenticated(f"{exc.message}; log in again (POST /api/auth/login, `noetl login`)") from None
            raise unavailable(f"the sessions service cannot check the token now ({exc.kind}: {exc.message})",
                              exc.details) from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise unavailable(f"the sessions service cannot be asked now ({type(exc).__name__})") from None
        if not isinstance(who, dict) or not isinstance(who.get("roles"), list) or not who.get("user_id"):
            raise unavailable("the sessions service answered something that is not a principal")
        self.cache.put(key, who, epoch)
        return who


def nats_state(nc: Any) -> str:
    if nc.is_connected:
        return "connected"
    if nc.is_closed:
        return "closed"
    if nc.is_reconnecting:
        return "reconnecting"
    return "connecting" if nc.is_connecting else "disconnected"


def retry_seconds(details: Any, default: int = 1) -> str:
    value = details.get("retry_after") if isinstance(details, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return str(max(1, math.ceil(value)))
    return str(default)


def unavailable(message: str, details: Any = None) -> HTTPException:
    return HTTPException(503, {"message": message, "location": None, "errors": []},
                         {"Retry-After": retry_seconds(details)})


# --------------------------------------------------------------------------------------- declarations
class Require:
    """A route's access declaration (a FastAPI dependency answering the principal, or None for a public
    route). Denials at the gateway are recorded in the audit log as ``access.denied``."""

    def __init__(self, permission: str):
        if permission not in (PUBLIC, SIGNED_IN) and permission not in access.PERMISSIONS:
            raise ValueError(f"unknown permission {permission!r}; known: {', '.join(access.PERMISSIONS)}")
        self.permission = permission

    def __repr__(self) -> str:
        return f"Require({self.permission!r})"

    async def __call__(self, request: Request) -> dict[str, Any] | None:
        if self.permission == PUBLIC:
            return None
        token = bearer(request.headers.get("authorization"))
        who = await request.app.state.auth.principal(token)
        request.state.principal = who
        if self.permission != SIGNED_IN and not access.allowed(who["roles"], self.permission):
            raise deny(request, who, self.permission)
        return who


def deny(request: Request, who: dict[str, Any], permission: str, why: str = "",
         target: dict[str, Any] | None = None) -> HTTPException:
    """A 403 naming the permission, the roles that grant it and the caller's; recorded (in the
    background: a refusal never waits for the audit log)."""
    request.app.state.auditor.later("access.denied", who, request, outcome="denied", target=target,
                                    details={"permission": permission, "route": f"{request.method} {request.url.path}"})
    return HTTPException(403, {"message": denied_message(permission, who.get("roles") or [], why),
                               "location": None, "errors": []})


def check_owner(request: Request, who: dict[str, Any], owner: Any, why: str, target: dict[str, Any]) -> None:
    """Go on when the caller is ``owner`` (a user id: who started an execution, who made a schedule) or
    may act on anyone's (``execution.cancel.any``); else the 403 of :func:`deny`, ``why`` saying what
    was asked."""
    if owner != who["user_id"] and not access.allowed(who["roles"], "execution.cancel.any"):
        raise deny(request, who, "execution.cancel.any", why, target)


_REQUIRES: dict[str, Any] = {}


def need(permission: str) -> Any:
    """The dependency declaring a route's permission: ``who: dict = need("execution.read")``;
    ``need(SIGNED_IN)`` for any valid token, ``need(PUBLIC)`` for none."""
    if permission not in _REQUIRES:
        _REQUIRES[permission] = Depends(Require(permission))
    return _REQUIRES[permission]


def _requires(dependant: Any) -> list[Require]:
    found = [dependant.call] if isinstance(dependant.call, Require) else []
    for sub in dependant.dependencies:
        found += _requires(sub)
    return found


def declarations(routes: Iterable[Any]) -> dict[tuple[str, str], str | None]:
    """``(method, path) → permission`` (or PUBLIC / SIGNED_IN) for every route; None for a route
    that declares none or more than one. FastAPI's documentation routes are PUBLIC."""
    out: dict[tuple[str, str], str | None] = {}
    for route in routes:
        methods = sorted(getattr(route, "methods", None) or {"GET"})
        path = getattr(route, "path", repr(route))
        if isinstance(route, APIRoute):
            found = {r.permission for r in _requires(route.dependant)}
            permission = found.pop() if len(found) == 1 and len(_requires(route.dependant)) == 1 else None
        else:
            permission = PUBLIC if path in DOCS or path in CONSOLE else None
        for method in methods:
            if method != "HEAD":
                out[(method, path)] = permission
    return out


def check_declarations(app: Any) -> None:
    """Refuse an app with a route that does not declare exactly one permission (or a public marker);
    document each route's permission and the bearer scheme in the OpenAPI description."""
    missing = [f"{m} {p}" for (m, p), perm in declarations(app.routes).items() if perm is None]
    if missing:
        raise RuntimeError("routes without exactly one access declaration (need(permission), need(SIGNED_IN) "
                           f"or need(PUBLIC)): {', '.join(missing)}")
    for route in app.routes:
        if isinstance(route, APIRoute):
            permission = _requires(route.dependant)[0].permission
            extra = dict(route.openapi_extra or {})
            if permission == PUBLIC:
                extra["security"] = []
                note = "No token needed."
            else:
                extra["security"] = [{"bearer": []}]
                note = ("Any valid token." if permission == SIGNED_IN else
                        f"Needs the permission `{permission}` (roles {', '.join(roles_with(permission))}).")
            route.openapi_extra = extra
            route.description = f"{route.description or ''}\n\n{note}".strip()
    original = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original()
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes["bearer"] = {"type": "http", "scheme": "bearer",
                             "description": "a session token (POST /api/auth/login) or an API token"}
        return schema

    app.openapi = openapi


def trusted_from_environment() -> list:
    return trusted_networks(os.environ.get(TRUSTED_PROXIES_ENV))


# --------------------------------------------------------------------------------------- audit
MAX_BACKGROUND_AUDITS = 256  # records being written at once without a request waiting; more are logged only


def caller_ip(request: Request) -> str | None:
    """The client's address (see :func:`client_address`) with the app's trusted proxies."""
    peer = request.client.host if request.client else None
    return client_address(peer, request.headers.get("x-forwarded-for"), request.app.state.trusted_proxies)


class Auditor:
    """The gateway's audit records (services/sessions/audit.py): ``record`` waits for the stream's
    acknowledgement; ``later`` writes in the background (a refusal does not wait for it)."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self._tasks: set[asyncio.Task] = set()

    async def record(self, action: str, who: dict[str, Any] | None, request: Request, *, required: bool = False,
                     **fields: Any) -> None:
        """``required``: when the record cannot be stored the request fails (503) instead of going on."""
        from noetl_mesh.services.sessions import audit

        try:
            await asyncio.wait_for(audit.record(self.bus, action, actor=who, client_ip=caller_ip(request), **fields),
                                   VALIDATE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001
            log.error("audit record %s not stored (%s)", action, type(exc).__name__)
            if required:
                raise unavailable(f"the audit log cannot record {action} now, so it is not done") from None

    def later(self, action: str, who: dict[str, Any] | None, request: Request, **fields: Any) -> None:
        if len(self._tasks) >= MAX_BACKGROUND_AUDITS:
            log.warning("audit record %s of user %s not written: %d records in flight", action,
                        (who or {}).get("user_id"), len(self._tasks))
            return
        task = asyncio.create_task(self.record(action, who, request, **fields))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
